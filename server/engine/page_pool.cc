#include "server/engine/page_pool.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace attn {

PagePool::PagePool(int num_pages)
    : num_pages_(num_pages), owner_(num_pages, 0), pins_(num_pages, 0) {
  free_list_.reserve(num_pages);
  for (int id = num_pages - 1; id >= 0; --id) free_list_.push_back(id);
}

int PagePool::free_pages() const {
  absl::ReaderMutexLock lock(&mu_);
  return static_cast<int>(free_list_.size());
}

absl::StatusOr<std::vector<int32_t>> PagePool::Allocate(int num_pages, SessionId owner) {
  if (num_pages < 1 || num_pages > total_pages()) {
    return absl::InvalidArgumentError(absl::StrCat("num_pages = ", num_pages,
                                                   " is outside [1, ", total_pages(), "]"));
  }
  absl::MutexLock lock(&mu_);
  if (static_cast<size_t>(num_pages) > free_list_.size()) {
    return absl::ResourceExhaustedError(absl::StrCat("asked for ", num_pages, " pages, ",
                                                     free_list_.size(), " of ", total_pages(),
                                                     " are free"));
  }
  std::vector<int32_t> ids(free_list_.end() - num_pages, free_list_.end());
  free_list_.resize(free_list_.size() - num_pages);
  for (int32_t id : ids) owner_[id] = owner;
  return ids;
}

absl::Status PagePool::CheckOwnedLocked(absl::Span<const int32_t> ids, SessionId owner,
                                        const char* field) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= total_pages()) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] = ", id,
                                                     " is outside [0, ", total_pages(), ")"));
    }
    if (owner_[id] != owner) {
      return absl::FailedPreconditionError(absl::StrCat(
          field, "[", i, "] = ", id,
          owner_[id] == 0 ? " is not an allocated page" : " belongs to another session"));
    }
  }
  return absl::OkStatus();
}

void PagePool::FreeLocked(int32_t id) {
  owner_[id] = 0;
  free_list_.push_back(id);
}

absl::Status PagePool::Free(absl::Span<const int32_t> ids, SessionId owner) {
  std::vector<int32_t> sorted(ids.begin(), ids.end());
  std::sort(sorted.begin(), sorted.end());
  if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_ids lists page ", *dup, " more than once"));
  }
  absl::MutexLock lock(&mu_);
  if (absl::Status st = CheckOwnedLocked(ids, owner, "page_ids"); !st.ok()) return st;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (pins_[ids[i]] > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "page_ids[", i, "] = ", ids[i], " is in use by an unfinished Prefill or Decode"));
    }
  }
  for (int32_t id : ids) FreeLocked(id);
  return absl::OkStatus();
}

absl::Status PagePool::Pin(absl::Span<const int32_t> ids, SessionId owner, const char* field) {
  absl::MutexLock lock(&mu_);
  if (absl::Status st = CheckOwnedLocked(ids, owner, field); !st.ok()) return st;
  for (int32_t id : ids) ++pins_[id];
  return absl::OkStatus();
}

void PagePool::Unpin(absl::Span<const int32_t> ids) {
  absl::MutexLock lock(&mu_);
  for (int32_t id : ids) {
    if (--pins_[id] == 0 && owner_[id] == kReleased) FreeLocked(id);
  }
}

absl::Status AppendLocks::Acquire(absl::Span<const int64_t> keys) {
  absl::MutexLock lock(&mu_);
  for (int64_t key : keys) {
    if (held_.contains(key)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "page ", AppendKeyPage(key), " (layer ", AppendKeyLayer(key),
          ") is being appended to by another unfinished Prefill or Decode; a sequence's calls "
          "that append must not overlap"));
    }
  }
  held_.insert(keys.begin(), keys.end());
  return absl::OkStatus();
}

void AppendLocks::Release(absl::Span<const int64_t> keys) {
  absl::MutexLock lock(&mu_);
  for (int64_t key : keys) held_.erase(key);
}

int PagePool::ReleaseOwner(SessionId owner) {
  absl::MutexLock lock(&mu_);
  int released = 0;
  for (int32_t id = 0; id < total_pages(); ++id) {
    if (owner_[id] != owner) continue;
    ++released;
    if (pins_[id] > 0) {
      owner_[id] = kReleased;
    } else {
      FreeLocked(id);
    }
  }
  return released;
}

}  // namespace attn
