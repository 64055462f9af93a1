#include "server/engine/page_pool.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attn {

PagePool::PagePool(int num_pages, std::string name, PageObserver* observer)
    : num_pages_(num_pages),
      name_(std::move(name)),
      observer_(observer),
      owner_(num_pages, 0),
      pins_(num_pages, 0),
      used_before_(num_pages, false) {
  free_list_.reserve(num_pages);
  for (int id = num_pages - 1; id >= 0; --id) free_list_.push_back(id);
}

int PagePool::free_pages() const {
  absl::ReaderMutexLock lock(&mu_);
  return static_cast<int>(free_list_.size());
}

int PagePool::pages_of(SessionId owner) const {
  absl::ReaderMutexLock lock(&mu_);
  return static_cast<int>(std::count(owner_.begin(), owner_.end(), owner));
}

int PagePool::pinned_pages() const {
  absl::ReaderMutexLock lock(&mu_);
  return static_cast<int>(
      std::count_if(pins_.begin(), pins_.end(), [](int32_t n) { return n > 0; }));
}

void PagePool::ReportLocked(PageEvent event, int pages) const {
  if (observer_ == nullptr || pages == 0) return;
  observer_->OnPageChange(
      PageChange{name_, event, pages, static_cast<int>(free_list_.size()), num_pages_});
}

absl::StatusOr<std::vector<int32_t>> PagePool::Allocate(int num_pages, SessionId owner,
                                                        std::vector<int32_t>* to_scrub) {
  if (num_pages < 1 || num_pages > total_pages()) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_pages = ", num_pages, " is outside [1, ", total_pages(), "]"));
  }
  absl::MutexLock lock(&mu_);
  if (static_cast<size_t>(num_pages) > free_list_.size()) {
    return absl::ResourceExhaustedError(absl::StrCat("asked for ", num_pages, " pages, ",
                                                     free_list_.size(), " of ", total_pages(),
                                                     " are free"));
  }
  std::vector<int32_t> ids(free_list_.end() - num_pages, free_list_.end());
  free_list_.resize(free_list_.size() - num_pages);
  for (int32_t id : ids) {
    owner_[id] = owner;
    if (to_scrub != nullptr && used_before_[id]) {
      to_scrub->push_back(id);
      ++pins_[id];
    }
    used_before_[id] = true;
  }
  ReportLocked(PageEvent::kAllocated, num_pages);
  return ids;
}

absl::Status PagePool::CheckOwnedLocked(absl::Span<const int32_t> ids, SessionId owner,
                                        const char* field) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= total_pages()) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "] = ", id, " is outside [0, ", total_pages(), ")"));
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
          "page_ids[", i, "] = ", ids[i],
          " is in use by an unfinished Prefill or Decode or by a plan (ReleasePlan it first)"));
    }
  }
  for (int32_t id : ids) FreeLocked(id);
  ReportLocked(PageEvent::kFreed, static_cast<int>(ids.size()));
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
  int freed = 0;
  for (int32_t id : ids) {
    if (--pins_[id] == 0 && owner_[id] == kReleased) {
      FreeLocked(id);
      ++freed;
    }
  }
  ReportLocked(PageEvent::kUnpinned, freed);
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

int PagePool::ReleaseOwner(SessionId owner, PageEvent why) {
  return ReleaseOwners(absl::MakeConstSpan(&owner, 1), why);
}

int PagePool::ReleaseOwners(absl::Span<const SessionId> owners, PageEvent why) {
  if (owners.empty()) return 0;
  const absl::flat_hash_set<SessionId> released_owners(owners.begin(), owners.end());
  absl::MutexLock lock(&mu_);
  int released = 0;
  for (int32_t id = 0; id < total_pages(); ++id) {
    // Free pages (0) and pages released while pinned (kReleased) are nobody's.
    if (owner_[id] <= 0 || !released_owners.contains(owner_[id])) continue;
    ++released;
    if (pins_[id] > 0) {
      owner_[id] = kReleased;
    } else {
      FreeLocked(id);
    }
  }
  ReportLocked(why, released);
  return released;
}

}  // namespace attn
