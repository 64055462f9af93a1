#include "server/page_pool.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace attn {

PagePool::PagePool(int num_pages) : num_pages_(num_pages), allocated_(num_pages, 0) {
  free_list_.reserve(num_pages);
  for (int id = num_pages - 1; id >= 0; --id) free_list_.push_back(id);
}

int PagePool::free_pages() const {
  absl::ReaderMutexLock lock(&mu_);
  return static_cast<int>(free_list_.size());
}

absl::StatusOr<std::vector<int32_t>> PagePool::Allocate(int num_pages) {
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
  for (int32_t id : ids) allocated_[id] = 1;
  return ids;
}

absl::Status PagePool::CheckAllocatedLocked(absl::Span<const int32_t> ids,
                                            const char* field) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= total_pages()) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "] = ", id,
                                                     " is outside [0, ", total_pages(), ")"));
    }
    if (!allocated_[id]) {
      return absl::FailedPreconditionError(
          absl::StrCat(field, "[", i, "] = ", id, " is not an allocated page"));
    }
  }
  return absl::OkStatus();
}

absl::Status PagePool::CheckAllocated(absl::Span<const int32_t> ids, const char* field) const {
  absl::ReaderMutexLock lock(&mu_);
  return CheckAllocatedLocked(ids, field);
}

absl::Status PagePool::Free(absl::Span<const int32_t> ids) {
  std::vector<int32_t> sorted(ids.begin(), ids.end());
  std::sort(sorted.begin(), sorted.end());
  if (auto dup = std::adjacent_find(sorted.begin(), sorted.end()); dup != sorted.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_ids lists page ", *dup, " more than once"));
  }
  absl::MutexLock lock(&mu_);
  if (absl::Status st = CheckAllocatedLocked(ids, "page_ids"); !st.ok()) return st;
  for (int32_t id : ids) {
    allocated_[id] = 0;
    free_list_.push_back(id);
  }
  return absl::OkStatus();
}

}  // namespace attn
