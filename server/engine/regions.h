// Registered memory regions (attention.proto, "Registered memory"): which session owns which
// region, the limits on them, and the calls that use them.
//
// A region is memory a caller shares with the server, mapped once by the backend
// (Backend::MapRegion): POSIX shared memory (host addresses) or CUDA memory opened from an IPC
// handle (device addresses). Calls name byte slices of their session's regions; Resolve checks
// each slice against its region and returns a RegionUse that keeps the region mapped and counted
// as in use until the call is done. A region in use cannot be unregistered; a session that
// closes or expires drops its regions at once, and each one is unmapped when the last call using
// it finishes. Thread safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/engine/sessions.h"

namespace attn {

enum class RegionKind { kSharedMemory, kCudaIpc };

inline const char* RegionKindName(RegionKind kind) {
  return kind == RegionKind::kSharedMemory ? "shared memory" : "CUDA IPC";
}

// The first bytes of every region at registration: kRegionMagic, then the caller's key.
inline constexpr absl::string_view kRegionMagic = "attnserve.region";
inline constexpr int kRegionKeyBytes = 32;
inline constexpr int kRegionHeaderBytes = 16 + kRegionKeyBytes;
// RegionSlice offsets are multiples of this; RegisterRegion offsets of kRegionMapAlignment.
inline constexpr int64_t kRegionSliceAlignment = 16;
inline constexpr int64_t kRegionMapAlignment = 64;

// What a caller asks the backend to map.
struct RegionSpec {
  RegionKind kind = RegionKind::kSharedMemory;
  std::string shm_name;    // kSharedMemory: the shm_open name
  std::string ipc_handle;  // kCudaIpc: cudaIpcMemHandle_t bytes
  int64_t offset = 0;      // into the shared-memory object or the IPC allocation
  int64_t size = 0;
  std::string key;  // kRegionKeyBytes bytes expected after kRegionMagic at the region's start
};

// Memory mapped into the server by a backend; unmapped when destroyed. data() is a host address
// for kSharedMemory and a device address (on the backend's device) for kCudaIpc.
class MappedMemory {
 public:
  virtual ~MappedMemory() = default;
  virtual RegionKind kind() const = 0;
  virtual char* data() const = 0;
  virtual int64_t size() const = 0;
  // Set when the memory under the mapping went away (a shared-memory object truncated by its
  // owner): accesses since then read zeros and writes are lost; calls that used it fail.
  virtual bool broken() const { return false; }
};

struct RegionLimits {
  int max_regions_per_session = 16;
  int64_t max_bytes_per_session = int64_t{4} << 30;
};

// What the operator allows (ServerConfig.data_plane); everything is off by default.
struct DataPlaneOptions {
  bool shared_memory = false;
  bool cuda_ipc = false;
  RegionLimits limits;
  std::string shm_name_prefix = "/attnserve";  // only names starting with this are opened
  // Call queues (server/rpc/call_queue.h), with shared memory: each has a thread of its own.
  int max_call_queues = 16;
  int max_call_queues_per_session = 4;
  int call_queue_spin_us = 100;    // polling after each call before sleeping on the doorbell
  int max_plans_per_session = 16;  // checked page tables (server/engine/plans.h), always on
};

// What a registration asked for, field by field in a fixed order, each named as in
// RegisterRegionRequest ("shared_memory.shm_name", "size", "key", "call_queue.slots", ...): a
// retry of a registration whose answer was lost asks for the same; any other registration of the
// name is refused, naming the first field that differs.
using RegistrationFields = std::vector<std::pair<std::string, std::string>>;

// A region as ListRegions shows it.
struct RegionInfo {
  std::string name;
  RegionKind kind = RegionKind::kSharedMemory;
  int64_t size = 0;
  int calls_in_flight = 0;
  bool held = false;  // by a RegionHold: a call queue
};

// Names clients give their regions and plans: 1-64 bytes of [A-Za-z0-9_.-].
bool IsValidName(absl::string_view name);
// A client's name as messages show it: at most 64 bytes, non-printable bytes escaped.
std::string ShownName(absl::string_view name);

// A byte range a call reads or writes in one of its session's regions.
struct SliceRef {
  std::string region;
  int64_t offset = 0;
  int64_t bytes = 0;
  std::string field;  // for error messages, e.g. "q.region"
};

// The regions one call uses, resolved and counted as in use until this is destroyed.
class RegionUse {
 public:
  RegionUse() = default;
  RegionUse(RegionUse&& other) noexcept = default;
  RegionUse& operator=(RegionUse&& other) noexcept;  // stops using what this used
  ~RegionUse() { Release(); }

  // Address of slice i of the Resolve call that made this (host or device, see kind(i)).
  char* data(size_t i) const { return slices_[i].data; }
  RegionKind kind(size_t i) const { return slices_[i].kind; }
  size_t size() const { return slices_.size(); }
  bool empty() const { return slices_.empty(); }
  // FAILED_PRECONDITION naming the first region whose memory went away during the call.
  absl::Status CheckIntact() const;

 private:
  friend class RegionTable;
  friend class RegionHold;
  struct Region;
  void Release();
  struct Slice {
    char* data;
    RegionKind kind;
    int index;  // into regions_
  };
  std::vector<std::shared_ptr<Region>> regions_;  // distinct, each counted once
  std::vector<Slice> slices_;
};

// Why a region left its table: UnregisterRegion, or its session closed or expired.
enum class RegionGone { kUnregistered, kSessionReleased };

// Keeps a registered region mapped for a user that is not a call: a call queue's server thread
// (server/rpc/call_queue.h). It does not count as a call in flight, so the region can still be
// unregistered; the `on_gone` given to RegionTable::Hold tells the holder when the region leaves
// its table, and is never called once the hold is destroyed or reset. Move-only.
class RegionHold {
 public:
  RegionHold() = default;
  RegionHold(RegionHold&& other) noexcept = default;
  RegionHold& operator=(RegionHold&& other) noexcept;
  ~RegionHold() { Reset(); }

  // Stops watching, then lets the region go (unmapped here if nothing else uses it).
  void Reset();
  bool held() const { return region_ != nullptr; }
  char* data() const;
  int64_t size() const;
  // Whether the memory under a shared-memory mapping went away (MappedMemory::broken).
  bool broken() const;

 private:
  friend class RegionTable;
  std::shared_ptr<RegionUse::Region> region_;
};

class RegionTable {
 public:
  explicit RegionTable(RegionLimits limits) : limits_(limits) {}
  RegionTable(const RegionTable&) = delete;
  RegionTable& operator=(const RegionTable&) = delete;

  const RegionLimits& limits() const { return limits_; }

  // Checks the name and the session's limits for a region of `size` bytes and reserves both, so
  // the (slow) mapping runs outside the lock: INVALID_ARGUMENT for a bad name, ALREADY_EXISTS for
  // a name the session registered otherwise (naming the first field of `what` that differs),
  // RESOURCE_EXHAUSTED past a limit. Then exactly one of Commit (the mapping succeeded) or
  // Abandon (it failed). `what` is the whole registration (the memory: kind, name or handle,
  // offset, size, key; and what it is for: a call queue's geometry): a retry of a registration
  // that succeeded (its answer was lost) finds the same `what` and gets the region's info
  // instead, with nothing reserved (FAILED_PRECONDITION instead when the region's memory went
  // away: MappedMemory::broken).
  absl::StatusOr<std::optional<RegionInfo>> Reserve(SessionId session, absl::string_view name,
                                                    int64_t size, RegistrationFields what = {});
  // Installs the mapping under a reserved name. If the session was released in between, the
  // mapping is dropped and NOT_FOUND returned.
  absl::StatusOr<RegionInfo> Commit(SessionId session, absl::string_view name,
                                    std::unique_ptr<MappedMemory> memory);
  void Abandon(SessionId session, absl::string_view name);

  // NOT_FOUND for a name the session has not registered, FAILED_PRECONDITION while calls use it.
  absl::Status Remove(SessionId session, absl::string_view name);

  std::vector<RegionInfo> List(SessionId session) const;

  // Drops every region of a closed or expired session: each is unmapped when no call uses it and
  // `unmap` (which the caller destroys outside its own locks: unmapping can take milliseconds)
  // is gone. Returns how many.
  int ReleaseSession(SessionId session, std::vector<std::shared_ptr<void>>* unmap);

  // Checks every slice against the session's regions -- registered (NOT_FOUND otherwise), offset
  // aligned to kRegionSliceAlignment and [offset, offset + bytes) inside the region, overflow-safe
  // (INVALID_ARGUMENT otherwise), memory intact (FAILED_PRECONDITION) -- and marks the regions in
  // use. All or nothing.
  absl::StatusOr<RegionUse> Resolve(SessionId session, absl::Span<const SliceRef> slices);

  // Holds the session's region `name` (NOT_FOUND when not registered). `on_gone` runs once, when
  // the region leaves the table, under this table's lock: it must not block or call back into
  // the table. A region has at most one holder (FAILED_PRECONDITION for a second, and for a
  // region whose memory went away).
  absl::StatusOr<RegionHold> Hold(SessionId session, absl::string_view name,
                                  std::function<void(RegionGone)> on_gone);

  int size() const;  // regions registered, over all sessions

 private:
  struct Slot {
    int64_t size = 0;
    RegistrationFields what;                    // Reserve's `what`
    std::shared_ptr<RegionUse::Region> region;  // nullptr while reserved
  };
  struct SessionRegions {
    int64_t bytes = 0;  // committed + reserved
    absl::flat_hash_map<std::string, Slot> by_name;
  };

  // The slot of `name` in `session`, or nullptr.
  Slot* FindLocked(SessionId session, absl::string_view name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets the slot (the session's entry too once empty) and returns its region.
  std::shared_ptr<RegionUse::Region> EraseLocked(SessionId session, absl::string_view name)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RegionLimits limits_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<SessionId, SessionRegions> sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attn
