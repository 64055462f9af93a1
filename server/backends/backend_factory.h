// Creates the backend a server's options name: "cpu", "cuda", or "auto" (CUDA when this build has
// the CUDA backend and a device is present, the CPU otherwise).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/engine/backend.h"

namespace attn {

struct BackendOptions {
  std::string kind = "auto";  // "auto", "cpu" or "cuda"
  int cpu_threads = 0;        // 0: hardware concurrency
  bool cuda_single_stream = false;
  std::string inject_fault;   // testing hook (server/backends/fault_injection.h); empty: none
};

// `on_fatal_error` runs once if the device fails in a way that poisons the process (CUDA sticky
// errors); the server then stops serving and exits non-zero. options.inject_fault wraps the
// backend in the testing hook of server/backends/fault_injection.h.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(
    const BackendOptions& options, std::function<void(const absl::Status&)> on_fatal_error);

}  // namespace attn
