// A configured pool (the server config's PoolConfig) as a checked geometry, and a geometry as the
// API's PoolInfo.
#pragma once

#include "absl/status/statusor.h"
#include "attnserve/v1/attention.pb.h"
#include "attnserve/v1/server_config.pb.h"
#include "server/engine/pool_geometry.h"

namespace attn {

namespace v1 = ::attnserve::v1;

// Checks a PoolConfig (name, supported dims, capacity) and derives its geometry; capacity_bytes is
// rounded down to whole pages. INVALID_ARGUMENT names the field at fault.
absl::StatusOr<PoolGeometry> GeometryFromConfig(const v1::PoolConfig& config);

// The API's description of a pool (free_pages is filled in by the caller).
v1::PoolInfo ToPoolInfo(const PoolGeometry& geometry);

}  // namespace attn
