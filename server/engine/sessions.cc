#include "server/engine/sessions.h"

#include <sys/random.h>

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "server/engine/client_text.h"

namespace attn {

SessionTable::SessionTable(uint64_t epoch, SessionOptions options)
    : epoch_(epoch), options_(options) {}

namespace {

constexpr size_t kEpochDigits = 16;
constexpr size_t kSecretBytes = 16;  // 128 random bits
constexpr size_t kHandleSize = kEpochDigits + 1 + 2 * kSecretBytes;

bool IsLowerHex(absl::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// 128 bits from the kernel's CSPRNG, as 32 lowercase hex digits.
std::string RandomSecret() {
  unsigned char bytes[kSecretBytes];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
    // n < 0 is EINTR (the call blocks only before the pool is initialized at boot): retry.
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

}  // namespace

// Handles are "<epoch: 16 hex digits>-<secret: 32 hex digits>", lowercase, nothing else: one
// spelling per session, and the secret cannot be guessed from other handles.
absl::StatusOr<absl::string_view> SessionTable::ParseHandle(absl::string_view handle) const {
  uint64_t epoch = 0;
  if (handle.size() != kHandleSize || handle[kEpochDigits] != '-' ||
      !IsLowerHex(handle.substr(0, kEpochDigits)) || !IsLowerHex(handle.substr(kEpochDigits + 1)) ||
      !absl::SimpleHexAtoi(handle.substr(0, kEpochDigits), &epoch)) {
    return absl::InvalidArgumentError(absl::StrCat("session '", ShownClientString(handle),
                                                   "' is not a session handle of this server"));
  }
  if (epoch != epoch_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session '%s' is from server epoch %016x; this server (epoch %016x) restarted since and "
        "holds none of its pages",
        ShownClientString(handle), epoch, epoch_));
  }
  return handle.substr(kEpochDigits + 1);
}

std::string SessionTable::Handle(const std::string& secret) const {
  return absl::StrCat(absl::Hex(epoch_, absl::kZeroPad16), "-", secret);
}

absl::StatusOr<OpenedSession> SessionTable::Open(absl::Duration lease, int max_pages,
                                                 const Principal& owner, absl::Time now) {
  if (lease <= absl::ZeroDuration()) lease = options_.default_lease;
  lease = std::min(lease, options_.max_lease);
  // The server's limit is the ceiling of every quota, and the quota of a session asking none.
  if (options_.max_pages > 0 && (max_pages <= 0 || max_pages > options_.max_pages)) {
    max_pages = options_.max_pages;
  }
  max_pages = std::max(max_pages, 0);
  std::string secret = RandomSecret();
  absl::MutexLock lock(&mu_);
  if (static_cast<int64_t>(sessions_.size()) >= options_.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server has ", sessions_.size(),
                     " open sessions, its limit (max_sessions); close "
                     "sessions that are no longer used"));
  }
  const SessionId id = next_id_++;
  by_secret_[secret] = id;
  sessions_[id] = Session{lease, now, max_pages, 0, owner.name, secret};
  return OpenedSession{id, Handle(secret), lease, max_pages};
}

absl::StatusOr<SessionId> SessionTable::FindLocked(absl::string_view handle,
                                                   absl::string_view secret,
                                                   const Principal& who) const {
  auto it = by_secret_.find(secret);
  if (it == by_secret_.end()) {
    return absl::NotFoundError(absl::StrCat("session '", ShownClientString(handle),
                                            "' is closed or its lease expired; its pages were "
                                            "freed"));
  }
  if (!who.admin && sessions_.at(it->second).owner != who.name) {
    // The owner's name is not disclosed: the caller learns only that it may not use this one.
    return absl::PermissionDeniedError(absl::StrCat(
        "session '", ShownClientString(handle),
        "' belongs to another principal; only the token or client certificate that opened it "
        "(or an admin token) may use it"));
  }
  return it->second;
}

absl::StatusOr<SessionId> SessionTable::Resolve(absl::string_view handle, const Principal& who,
                                                absl::Time now) {
  if (handle.empty()) {
    return absl::InvalidArgumentError(
        "session is empty: every call that uses pages names a session from OpenSession");
  }
  absl::StatusOr<absl::string_view> secret = ParseHandle(handle);
  if (!secret.ok()) return secret.status();
  absl::MutexLock lock(&mu_);
  absl::StatusOr<SessionId> id = FindLocked(handle, *secret, who);
  if (id.ok()) sessions_[*id].last_seen = now;  // only a call that may use it renews it
  return id;
}

absl::StatusOr<SessionId> SessionTable::Close(absl::string_view handle, const Principal& who) {
  if (handle.empty()) return absl::InvalidArgumentError("session is empty: name the one to close");
  absl::StatusOr<absl::string_view> secret = ParseHandle(handle);
  if (!secret.ok()) return secret.status();
  absl::MutexLock lock(&mu_);
  absl::StatusOr<SessionId> id = FindLocked(handle, *secret, who);
  if (!id.ok()) return id.status();
  by_secret_.erase(*secret);
  sessions_.erase(*id);
  return *id;
}

std::vector<SessionId> SessionTable::Expire(absl::Time now) {
  std::vector<SessionId> expired;
  absl::MutexLock lock(&mu_);
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    const Session& s = it->second;
    if (now - s.last_seen < s.lease) {
      ++it;
      continue;
    }
    expired.push_back(it->first);
    by_secret_.erase(s.secret);
    sessions_.erase(it++);
  }
  return expired;
}

absl::Status SessionTable::Charge(SessionId id, int pages) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return absl::NotFoundError("the session was closed meanwhile");
  Session& s = it->second;
  if (s.max_pages > 0 && s.pages + pages > s.max_pages) {
    return absl::ResourceExhaustedError(absl::StrCat("the session's quota is ", s.max_pages,
                                                     " pages; it holds ", s.pages,
                                                     " and asked for ", pages, " more"));
  }
  s.pages += pages;
  return absl::OkStatus();
}

void SessionTable::Refund(SessionId id, int pages) {
  absl::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it != sessions_.end()) it->second.pages = std::max<int64_t>(0, it->second.pages - pages);
}

int SessionTable::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(sessions_.size());
}

}  // namespace attn
