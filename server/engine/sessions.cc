#include "server/engine/sessions.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace attn {

SessionTable::SessionTable(uint64_t epoch, SessionOptions options)
    : epoch_(epoch), options_(options) {}

// Handles are "<epoch as 16 hex digits>-<id>".
std::string SessionTable::Handle(SessionId id) const {
  return absl::StrFormat("%016x-%d", epoch_, id);
}

namespace {

// A client's handle as error messages show it: escaped, and at most 64 bytes of it (the message
// must not grow with the request).
std::string ShownHandle(absl::string_view handle) {
  constexpr size_t kMaxShown = 64;
  if (handle.size() <= kMaxShown) return absl::CHexEscape(handle);
  return absl::StrCat(absl::CHexEscape(handle.substr(0, kMaxShown)), "... (", handle.size(),
                      " bytes)");
}

}  // namespace

absl::StatusOr<SessionId> SessionTable::ParseHandle(absl::string_view handle) const {
  const std::vector<absl::string_view> parts = absl::StrSplit(handle, '-');
  uint64_t epoch = 0;
  SessionId id = 0;
  if (parts.size() != 2 || parts[0].size() != 16 || !absl::SimpleHexAtoi(parts[0], &epoch) ||
      !absl::SimpleAtoi(parts[1], &id) || id <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("session '", ShownHandle(handle), "' is not a session handle of this server"));
  }
  if (epoch != epoch_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "session '%s' is from server epoch %016x; this server (epoch %016x) restarted since and "
        "holds none of its pages",
        handle, epoch, epoch_));
  }
  return id;
}

OpenedSession SessionTable::Open(absl::Duration lease, int max_pages, absl::Time now) {
  if (lease <= absl::ZeroDuration()) lease = options_.default_lease;
  lease = std::min(lease, options_.max_lease);
  if (max_pages <= 0) max_pages = options_.default_max_pages;
  absl::MutexLock lock(&mu_);
  const SessionId id = next_id_++;
  sessions_[id] = Session{lease, now, max_pages, 0, ""};
  return OpenedSession{id, Handle(id), lease, max_pages};
}

absl::StatusOr<SessionId> SessionTable::Resolve(absl::string_view handle, absl::string_view peer,
                                                absl::Time now) {
  if (!handle.empty()) {
    absl::StatusOr<SessionId> id = ParseHandle(handle);
    if (!id.ok()) return id.status();
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(*id);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat(
          "session '", handle, "' is closed or its lease expired; its pages were freed"));
    }
    it->second.last_seen = now;
    return *id;
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
  absl::StatusOr<SessionId> id = ParseHandle(handle);
  if (!id.ok()) return id.status();
  absl::MutexLock lock(&mu_);
  if (sessions_.erase(*id) == 0) {
    return absl::NotFoundError(absl::StrCat("session '", handle, "' is already closed"));
  }
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
    if (!s.peer.empty()) by_peer_.erase(s.peer);
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
    return absl::ResourceExhaustedError(
        absl::StrCat("the session's quota is ", s.max_pages, " pages; it holds ", s.pages,
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
