#include "server/engine/sessions.h"

#include <sys/random.h>

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

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

// A client's handle as error messages show it: escaped, and at most 64 bytes of it (the message
// must not grow with the request).
std::string ShownHandle(absl::string_view handle) {
  constexpr size_t kMaxShown = 64;
  if (handle.size() <= kMaxShown) return absl::CHexEscape(handle);
  return absl::StrCat(absl::CHexEscape(handle.substr(0, kMaxShown)), "... (", handle.size(),
                      " bytes)");
}

}  // namespace

// Handles are "<epoch: 16 hex digits>-<secret: 32 hex digits>", lowercase, nothing else: one
// spelling per session, and the secret cannot be guessed from other handles.
absl::StatusOr<absl::string_view> SessionTable::ParseHandle(absl::string_view handle) const {
  uint64_t epoch = 0;
  if (handle.size() != kHandleSize || handle[kEpochDigits] != '-' ||
      !IsLowerHex(handle.substr(0, kEpochDigits)) || !IsLowerHex(handle.substr(kEpochDigits + 1)) ||
      !absl::SimpleHexAtoi(handle.substr(0, kEpochDigits), &epoch)) {
    return absl::InvalidArgumentError(
        absl::StrCat("session '", ShownHandle(handle), "' is not a session handle of this server"));
  }
  if (epoch != epoch_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session '%s' is from server epoch %016x; this server (epoch %016x) restarted since and "
        "holds none of its pages",
        handle, epoch, epoch_));
  }
  return handle.substr(kEpochDigits + 1);
}

std::string SessionTable::Handle(const std::string& secret) const {
  return absl::StrCat(absl::Hex(epoch_, absl::kZeroPad16), "-", secret);
}

OpenedSession SessionTable::Open(absl::Duration lease, int max_pages, absl::Time now) {
  if (lease <= absl::ZeroDuration()) lease = options_.default_lease;
  lease = std::min(lease, options_.max_lease);
  if (max_pages <= 0) max_pages = options_.default_max_pages;
  std::string secret = RandomSecret();
  absl::MutexLock lock(&mu_);
  const SessionId id = next_id_++;
  by_secret_[secret] = id;
  sessions_[id] = Session{lease, now, max_pages, 0, "", secret};
  return OpenedSession{id, Handle(secret), lease, max_pages};
}

absl::StatusOr<SessionId> SessionTable::Resolve(absl::string_view handle, absl::string_view peer,
                                                absl::Time now) {
  if (!handle.empty()) {
    absl::StatusOr<absl::string_view> secret = ParseHandle(handle);
    if (!secret.ok()) return secret.status();
    absl::MutexLock lock(&mu_);
    auto it = by_secret_.find(*secret);
    if (it == by_secret_.end()) {
      return absl::NotFoundError(absl::StrCat(
          "session '", handle, "' is closed or its lease expired; its pages were freed"));
    }
    sessions_[it->second].last_seen = now;
    return it->second;
  }
  absl::MutexLock lock(&mu_);
  auto [slot, inserted] = by_peer_.try_emplace(std::string(peer), 0);
  if (inserted) {
    slot->second = next_id_++;
    sessions_[slot->second] =
        Session{options_.default_lease, now, options_.default_max_pages, 0, std::string(peer)};
  } else {
    sessions_[slot->second].last_seen = now;
  }
  return slot->second;
}

absl::StatusOr<SessionId> SessionTable::Close(absl::string_view handle) {
  absl::StatusOr<absl::string_view> secret = ParseHandle(handle);
  if (!secret.ok()) return secret.status();
  absl::MutexLock lock(&mu_);
  auto it = by_secret_.find(*secret);
  if (it == by_secret_.end()) {
    return absl::NotFoundError(absl::StrCat("session '", handle, "' is already closed"));
  }
  const SessionId id = it->second;
  by_secret_.erase(it);
  sessions_.erase(id);
  return id;
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
    if (!s.peer.empty()) by_peer_.erase(s.peer);
    if (!s.secret.empty()) by_secret_.erase(s.secret);
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
