// Sessions: who owns pages, for how long (leases), and how many (quotas).
//
// A session is an id the server hands out, either explicitly (OpenSession) or implicitly for a
// client connection (keyed by its peer address). A handle is a capability: the server's epoch
// (so a handle from before a restart is recognized as such) and 128 random bits, in exactly one
// spelling. Every call resolving a session
// renews its lease; Expire() closes the sessions whose lease ran out, and the caller reclaims
// their pages (server/engine/page_pool.h keeps page ownership). Thread safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attn {

using SessionId = int64_t;  // never reused within an epoch; 0 is no session

struct SessionOptions {
  absl::Duration default_lease = absl::Minutes(5);
  absl::Duration max_lease = absl::Hours(1);
  int default_max_pages = 0;  // 0: no quota
};

struct OpenedSession {
  SessionId id;
  std::string handle;
  absl::Duration lease;
  int max_pages;  // 0: no quota
};

class SessionTable {
 public:
  SessionTable(uint64_t epoch, SessionOptions options);

  uint64_t epoch() const { return epoch_; }
  absl::Duration default_lease() const { return options_.default_lease; }

  // A new explicit session; lease and max_pages of 0 take the defaults; the lease is capped.
  OpenedSession Open(absl::Duration lease, int max_pages, absl::Time now);

  // The session of a call: the one `handle` names, or (empty handle) the implicit session of
  // the connection `peer`, created on first use. Renews the lease. FAILED_PRECONDITION for a
  // handle of another epoch, NOT_FOUND for a closed or expired one, INVALID_ARGUMENT for a
  // malformed one.
  absl::StatusOr<SessionId> Resolve(absl::string_view handle, absl::string_view peer,
                                    absl::Time now);

  // Removes an explicit session (as Resolve would find it); the caller frees its pages.
  absl::StatusOr<SessionId> Close(absl::string_view handle);

  // Removes and returns the sessions whose lease ran out by `now`.
  std::vector<SessionId> Expire(absl::Time now);

  // Quota accounting: charges `pages` to the session, RESOURCE_EXHAUSTED past its quota.
  absl::Status Charge(SessionId id, int pages);
  void Refund(SessionId id, int pages);

  int size() const;

 private:
  struct Session {
    absl::Duration lease;
    absl::Time last_seen;
    int max_pages = 0;
    int64_t pages = 0;   // 64 bits: a charge of up to INT32_MAX pages is refused, not wrapped
    std::string peer;    // implicit sessions only
    std::string secret;  // explicit sessions only: the random part of the handle
  };

  // The secret of a well-formed handle of this epoch (INVALID_ARGUMENT / FAILED_PRECONDITION).
  absl::StatusOr<absl::string_view> ParseHandle(absl::string_view handle) const;
  std::string Handle(const std::string& secret) const;

  const uint64_t epoch_;
  const SessionOptions options_;
  mutable absl::Mutex mu_;
  SessionId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<SessionId, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, SessionId> by_peer_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, SessionId> by_secret_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attn
