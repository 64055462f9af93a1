// Execution backends (CPU threads, CUDA streams) behind one interface.
//
// A Backend owns the storage of every pool (allocated once, at start) and hands out Lanes. A Lane
// is one independent execution context (its own scratch or pinned staging, its own CUDA stream)
// used by one batcher thread at a time; different lanes may run concurrently.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "server/engine/attention_call.h"
#include "server/engine/pool_geometry.h"
#include "server/engine/regions.h"

namespace attn {

// Where a launch's time went, stage by stage, on the lane's thread.
struct LaunchStats {
  absl::Duration prepare;  // merging the calls, planning, gathering inputs (pinned memory: GPU)
  absl::Duration execute;  // waiting for the backend: GPU copies in, kernels, copies out, sync
  absl::Duration finish;   // writing each call's outputs into its response
  absl::Duration compute;  // append + attention within execute (device time on the GPU)
  int64_t bytes_in = 0;    // inputs moved to the backend (host-to-device on the GPU)
  int64_t bytes_out = 0;   // outputs moved back
};

// Cuts a lane's Run into consecutive stages: Next(&stage) sets `stage` to the time since the
// previous mark (the first: since construction).
class StageTimer {
 public:
  void Next(absl::Duration* stage) {
    const absl::Time now = absl::Now();
    *stage = now - last_;
    last_ = now;
  }

 private:
  absl::Time last_ = absl::Now();
};

class Lane {
 public:
  virtual ~Lane() = default;
  // Appends the calls' new K/V and runs attention for all of them as one merged launch, then
  // writes each call's out (and lse when asked). All calls share op, pool, sm_scale and whether
  // they append. A backend that ChecksFiniteInputs() sets `refused` on a call whose inputs hold
  // a NaN or Inf, appends none of its rows and leaves its response outputs unset (outputs it
  // was to write into a region may have been written). Not thread safe: one caller at a time.
  virtual absl::StatusOr<LaunchStats> Run(absl::Span<AttentionCall* const> calls) = 0;
  // Gives back what the lane keeps between launches for large ones (pinned staging, idle
  // response buffers); the batcher calls it once its lane has been idle for a while
  // (BatchingOptions::idle_release). Same thread rules as Run.
  virtual void ReleaseIdle() {}
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;    // "cpu" or "cuda"
  virtual std::string device() const = 0;  // human-readable device description

  // True when the lanes refuse calls with NaN or Inf inputs themselves (AttentionCall::refused),
  // so validation need not scan them on the host; false: validation must.
  virtual bool ChecksFiniteInputs() const { return false; }
  // Allocates the storage of a pool; pools are numbered in the order they are added.
  virtual absl::Status AddPool(const PoolGeometry& geometry) = 0;

  // A new execution context for calls of `op` on pool number `pool`.
  virtual absl::StatusOr<std::unique_ptr<Lane>> CreateLane(int pool, Op op) = 0;

  // Maps a region a caller shares (server/engine/regions.h) so the lanes can read and write it:
  // shared memory opened only under `shm_name_prefix`. UNIMPLEMENTED for a kind the backend
  // cannot use (CUDA IPC without a GPU). Thread safe.
  virtual absl::StatusOr<std::unique_ptr<MappedMemory>> MapRegion(
      const RegionSpec& spec, absl::string_view shm_name_prefix) {
    (void)spec;
    (void)shm_name_prefix;
    return absl::UnimplementedError(absl::StrCat("the ", name(), " backend maps no regions"));
  }

  // Zeroes every layer of the listed pages of pool number `pool` (distinct ids in range), so a
  // page's next owner cannot read its previous owner's rows. Returns once every later launch,
  // on any lane, sees the zeros. Called from handler threads, concurrently with launches, none
  // of which uses these pages (the engine pins them to the caller meanwhile). Cheap by design:
  // one launch for the whole list on the GPU, and madvise for whole OS pages on the CPU.
  virtual absl::Status ScrubPages(int pool, absl::Span<const int32_t> pages) = 0;
};

}  // namespace attn
