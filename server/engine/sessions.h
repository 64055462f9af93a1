// Sessions: who owns pages, for how long (leases), and how many (quotas).
//
// A session is opened explicitly (OpenSession) by a principal, the identity the RPC edge
// authenticated: a bearer token's name or a client certificate's subject, or no one (anonymous)
// when the server checks neither. Its handle is a capability: the server's epoch (so a handle
// from before a restart is recognized as such) and 128 random bits, in exactly one spelling.
// Only its owner may use it, unless the caller is an admin; a call refused for that does not
// renew the lease. There are no implicit sessions: gRPC gives a handler no identity of the
// connection it came on, and a peer address is none (every process on a unix socket shares one,
// a NAT or proxy hands one to the next connection), so every call that uses pages names its
// session. Every call resolving a session renews its lease; Expire() closes the sessions whose
// lease ran out, and the caller reclaims their pages (server/engine/page_pool.h keeps page
// ownership). Thread safe.
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

// Who makes a call, as the RPC edge authenticated it.
struct Principal {
  std::string name;    // "token:<name>", "cert:<subject>"; empty: anonymous (no auth configured)
  bool admin = false;  // may use every session (an operator's token)
};

struct SessionOptions {
  absl::Duration default_lease = absl::Minutes(5);
  absl::Duration max_lease = absl::Hours(1);
  // The most pages one session may hold (summed over pools), and the quota of a session that
  // asks for none; a session asking for more gets this. 0: no limit.
  int max_pages = 0;
  int max_sessions = 4096;  // open sessions at once, over all principals
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
  const SessionOptions& options() const { return options_; }

  // A new session owned by `owner`. A lease of 0 takes the default and is capped at max_lease;
  // max_pages of 0, or above the server's limit, takes the limit. RESOURCE_EXHAUSTED when
  // max_sessions are open.
  absl::StatusOr<OpenedSession> Open(absl::Duration lease, int max_pages, const Principal& owner,
                                     absl::Time now);

  // The session `handle` names, if `who` may use it; renews its lease then. INVALID_ARGUMENT
  // for an empty or malformed handle, FAILED_PRECONDITION for a handle of another epoch,
  // NOT_FOUND for a closed or expired one, PERMISSION_DENIED when `who` is neither its owner nor
  // an admin (the lease is left as it was).
  absl::StatusOr<SessionId> Resolve(absl::string_view handle, const Principal& who, absl::Time now);

  // Removes a session `who` may use (as Resolve would find it); the caller frees its pages.
  absl::StatusOr<SessionId> Close(absl::string_view handle, const Principal& who);

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
    std::string owner;   // Principal::name
    std::string secret;  // the random part of the handle
  };

  // The secret of a well-formed handle of this epoch (INVALID_ARGUMENT / FAILED_PRECONDITION).
  absl::StatusOr<absl::string_view> ParseHandle(absl::string_view handle) const;
  std::string Handle(const std::string& secret) const;
  // The session `handle` names if `who` may use it (NOT_FOUND / PERMISSION_DENIED).
  absl::StatusOr<SessionId> FindLocked(absl::string_view handle, absl::string_view secret,
                                       const Principal& who) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const uint64_t epoch_;
  const SessionOptions options_;
  mutable absl::Mutex mu_;
  SessionId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<SessionId, Session> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, SessionId> by_secret_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attn
