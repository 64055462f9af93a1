// What the fuzz targets share: ATTN_FUZZ_VERBOSE=1 makes them say what each input did.
#pragma once

#include <cstdlib>

namespace attn {

inline bool FuzzVerbose() {
  static const bool verbose = [] {
    const char* env = std::getenv("ATTN_FUZZ_VERBOSE");
    return env != nullptr && env[0] == '1';
  }();
  return verbose;
}

}  // namespace attn
