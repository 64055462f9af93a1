// Creates the backend a server's options name: "cpu", "cuda", or "auto" (CUDA when this build has
// the CUDA backend and a device is present, the CPU otherwise).
#pragma once

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "server/backend.h"
#include "server/config.h"

namespace attn {

// `on_fatal_error` runs once if the device fails in a way that poisons the process (CUDA sticky
// errors); the server then stops serving and exits non-zero. options.inject_fault wraps the
// backend in the testing hook of server/fault_injection.h.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(
    const ServerOptions& options, std::function<void(const absl::Status&)> on_fatal_error);

}  // namespace attn
