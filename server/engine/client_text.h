// Strings from clients in error messages and logs.
#pragma once

#include <string>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace attn {

// `text` as an error message or a log line shows it: C-escaped, at most `max_bytes` of it, then
// its length. A message must not grow with the request: one longer than the client's metadata
// limit arrives as RESOURCE_EXHAUSTED instead of the real error, and a log line is one line.
inline std::string ShownClientString(absl::string_view text, size_t max_bytes = 64) {
  if (text.size() <= max_bytes) return absl::CHexEscape(text);
  return absl::StrCat(absl::CHexEscape(text.substr(0, max_bytes)), "... (", text.size(), " bytes)");
}

}  // namespace attn
