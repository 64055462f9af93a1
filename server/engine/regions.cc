#include "server/engine/regions.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attn {

struct RegionUse::Region {
  Region(std::string n, std::unique_ptr<MappedMemory> m)
      : name(std::move(n)), memory(std::move(m)) {}
  const std::string name;
  const std::unique_ptr<MappedMemory> memory;
  std::atomic<int> in_use{0};  // RegionUses holding it

  // The region left its table: tells the holder (RegionHold), once.
  void Gone(RegionGone why) {
    absl::MutexLock lock(&watch_mu);
    if (on_gone) std::exchange(on_gone, nullptr)(why);
    gone = true;
  }
  absl::Mutex watch_mu;
  std::function<void(RegionGone)> on_gone ABSL_GUARDED_BY(watch_mu);
  bool held ABSL_GUARDED_BY(watch_mu) = false;
  bool gone ABSL_GUARDED_BY(watch_mu) = false;
};

RegionHold& RegionHold::operator=(RegionHold&& other) noexcept {
  if (this != &other) {
    Reset();
    region_ = std::move(other.region_);
  }
  return *this;
}

void RegionHold::Reset() {
  if (region_ == nullptr) return;
  {
    absl::MutexLock lock(&region_->watch_mu);
    region_->on_gone = nullptr;
    region_->held = false;
  }
  region_.reset();
}

char* RegionHold::data() const { return region_->memory->data(); }
int64_t RegionHold::size() const { return region_->memory->size(); }
bool RegionHold::broken() const { return region_->memory->broken(); }

void RegionUse::Release() {
  for (const auto& region : regions_) region->in_use.fetch_sub(1, std::memory_order_acq_rel);
  regions_.clear();
  slices_.clear();
}

RegionUse& RegionUse::operator=(RegionUse&& other) noexcept {
  if (this != &other) {
    Release();
    regions_ = std::move(other.regions_);
    slices_ = std::move(other.slices_);
    other.regions_.clear();
    other.slices_.clear();
  }
  return *this;
}

absl::Status RegionUse::CheckIntact() const {
  for (const auto& region : regions_) {
    if (region->memory->broken()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "region '", region->name,
          "': its memory went away during the call (the shared-memory object was truncated)"));
    }
  }
  return absl::OkStatus();
}

bool IsValidName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

std::string ShownName(absl::string_view name) {
  std::string out;
  for (char c : name.substr(0, 64)) {
    if (c >= 0x20 && c < 0x7f && c != '\'') {
      out.push_back(c);
    } else {
      absl::StrAppend(&out, "\\x", absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
    }
  }
  if (name.size() > 64) absl::StrAppend(&out, "... (", name.size(), " bytes)");
  return out;
}

namespace {

// The first field in which two registrations differ ("" when they are the same); a field only
// one of them has differs.
std::string FirstDifference(const RegistrationFields& a, const RegistrationFields& b) {
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    if (i >= a.size()) return b[i].first;
    if (i >= b.size() || a[i] != b[i]) return a[i].first;
  }
  return "";
}

absl::Status BrokenError(absl::string_view name) {
  return absl::FailedPreconditionError(
      absl::StrCat("region '", name,
                   "' lost its memory (the shared-memory object was truncated); unregister it"));
}

}  // namespace

RegionTable::Slot* RegionTable::FindLocked(SessionId session, absl::string_view name) {
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return nullptr;
  auto it = s->second.by_name.find(name);
  return it == s->second.by_name.end() ? nullptr : &it->second;
}

std::shared_ptr<RegionUse::Region> RegionTable::EraseLocked(SessionId session,
                                                            absl::string_view name) {
  auto s = sessions_.find(session);
  auto it = s->second.by_name.find(name);
  std::shared_ptr<RegionUse::Region> region = std::move(it->second.region);
  if (region != nullptr) region->Gone(RegionGone::kUnregistered);
  s->second.bytes -= it->second.size;
  s->second.by_name.erase(it);
  if (s->second.by_name.empty()) sessions_.erase(s);
  return region;
}

absl::StatusOr<std::optional<RegionInfo>> RegionTable::Reserve(SessionId session,
                                                               absl::string_view name, int64_t size,
                                                               RegistrationFields what) {
  if (!IsValidName(name)) {
    return absl::InvalidArgumentError(absl::StrCat("region name '", ShownName(name),
                                                   "' must be 1-64 characters of [A-Za-z0-9_.-]"));
  }
  if (size < kRegionHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("size = ", size, " is below the ", kRegionHeaderBytes, "-byte region header"));
  }
  absl::MutexLock lock(&mu_);
  SessionRegions& s = sessions_[session];
  if (auto it = s.by_name.find(name); it != s.by_name.end()) {
    const Slot& slot = it->second;
    const std::string already =
        absl::StrCat("region '", name, "' is already registered by this session");
    if (slot.region == nullptr || what.empty()) return absl::AlreadyExistsError(already);
    // Only the very same registration is a retry: one that differs in anything (a call queue's
    // geometry too) would be answered OK and served as the first one asked.
    if (const std::string field = FirstDifference(slot.what, what); !field.empty()) {
      return absl::AlreadyExistsError(absl::StrCat(
          already, " with another ", field,
          "; a retry must repeat the registration exactly (unregister the region to change it)"));
    }
    // A retry must not report a region whose memory went away as registered (a call queue
    // would be served again, and stop at once).
    if (slot.region->memory->broken()) return BrokenError(name);
    absl::MutexLock watch(&slot.region->watch_mu);
    return RegionInfo{slot.region->name, slot.region->memory->kind(), slot.size,
                      slot.region->in_use.load(), slot.region->held};
  }
  const int count = static_cast<int>(s.by_name.size());
  absl::Status refused;
  if (count + 1 > limits_.max_regions_per_session) {
    refused = absl::ResourceExhaustedError(absl::StrCat("the session has ", count,
                                                        " regions; the server allows ",
                                                        limits_.max_regions_per_session));
  } else if (size > limits_.max_bytes_per_session - s.bytes) {
    refused = absl::ResourceExhaustedError(absl::StrCat(
        "size = ", size, " bytes: the session's regions would exceed the server's limit of ",
        limits_.max_bytes_per_session, " bytes (", s.bytes, " registered)"));
  }
  if (!refused.ok()) {
    if (s.by_name.empty()) sessions_.erase(session);
    return refused;
  }
  s.by_name.emplace(name, Slot{size, std::move(what), nullptr});
  s.bytes += size;
  return std::nullopt;
}

absl::StatusOr<RegionInfo> RegionTable::Commit(SessionId session, absl::string_view name,
                                               std::unique_ptr<MappedMemory> memory) {
  {
    absl::MutexLock lock(&mu_);
    Slot* slot = FindLocked(session, name);
    if (slot != nullptr && slot->region == nullptr) {
      slot->size = memory->size();
      slot->region = std::make_shared<RegionUse::Region>(std::string(name), std::move(memory));
      return RegionInfo{slot->region->name, slot->region->memory->kind(), slot->size, 0};
    }
  }
  // The session was released meanwhile; `memory` is unmapped here, outside the lock.
  return absl::NotFoundError(
      absl::StrCat("region '", name, "': the session closed while the region was being mapped"));
}

void RegionTable::Abandon(SessionId session, absl::string_view name) {
  absl::MutexLock lock(&mu_);
  Slot* slot = FindLocked(session, name);
  if (slot != nullptr && slot->region == nullptr) EraseLocked(session, name);
}

absl::Status RegionTable::Remove(SessionId session, absl::string_view name) {
  std::shared_ptr<RegionUse::Region> removed;  // unmapped once the lock is released
  absl::MutexLock lock(&mu_);
  Slot* slot = FindLocked(session, name);
  if (slot == nullptr || slot->region == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("region '", ShownName(name), "' is not registered by this session"));
  }
  if (const int users = slot->region->in_use.load(); users > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("region '", name, "' is in use by ", users, " queued or running call(s)"));
  }
  removed = EraseLocked(session, name);
  return absl::OkStatus();
}

std::vector<RegionInfo> RegionTable::List(SessionId session) const {
  std::vector<RegionInfo> out;
  absl::MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return out;
  for (const auto& [name, slot] : s->second.by_name) {
    if (slot.region == nullptr) continue;
    absl::MutexLock watch(&slot.region->watch_mu);
    out.push_back(RegionInfo{name, slot.region->memory->kind(), slot.size,
                             slot.region->in_use.load(), slot.region->held});
  }
  return out;
}

int RegionTable::ReleaseSession(SessionId session, std::vector<std::shared_ptr<void>>* unmap) {
  absl::MutexLock lock(&mu_);
  auto s = sessions_.find(session);
  if (s == sessions_.end()) return 0;
  int count = 0;
  for (auto& [name, slot] : s->second.by_name) {
    if (slot.region == nullptr) continue;
    ++count;
    slot.region->Gone(RegionGone::kSessionReleased);
    unmap->push_back(std::move(slot.region));
  }
  sessions_.erase(s);
  return count;
}

absl::StatusOr<RegionUse> RegionTable::Resolve(SessionId session,
                                               absl::Span<const SliceRef> slices) {
  RegionUse use;
  absl::MutexLock lock(&mu_);
  for (const SliceRef& slice : slices) {
    Slot* slot = FindLocked(session, slice.region);
    if (slot == nullptr || slot->region == nullptr) {
      return absl::NotFoundError(absl::StrCat(slice.field, ": region '", ShownName(slice.region),
                                              "' is not registered by this session"));
    }
    const std::shared_ptr<RegionUse::Region>& shared = slot->region;
    const RegionUse::Region& region = *shared;
    const int64_t size = region.memory->size();
    if (slice.offset < 0 || slice.offset % kRegionSliceAlignment != 0) {
      return absl::InvalidArgumentError(absl::StrCat(slice.field, ": offset = ", slice.offset,
                                                     " must be a non-negative multiple of ",
                                                     kRegionSliceAlignment));
    }
    // Both are non-negative, so size - offset cannot overflow.
    if (slice.bytes < 0 || slice.offset > size || slice.bytes > size - slice.offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          slice.field, ": bytes [", slice.offset, ", ", slice.offset, " + ", slice.bytes,
          ") lie outside region '", region.name, "' of ", size, " bytes"));
    }
    if (region.memory->broken()) {
      return absl::FailedPreconditionError(absl::StrCat(
          slice.field, ": region '", region.name,
          "' lost its memory (the shared-memory object was truncated); unregister it"));
    }
    int index = -1;
    for (size_t r = 0; r < use.regions_.size(); ++r) {
      if (use.regions_[r] == shared) index = static_cast<int>(r);
    }
    if (index < 0) {
      index = static_cast<int>(use.regions_.size());
      use.regions_.push_back(shared);
      shared->in_use.fetch_add(1, std::memory_order_acq_rel);
    }
    use.slices_.push_back({region.memory->data() + slice.offset, region.memory->kind(), index});
  }
  return use;
}

absl::StatusOr<RegionHold> RegionTable::Hold(SessionId session, absl::string_view name,
                                             std::function<void(RegionGone)> on_gone) {
  absl::MutexLock lock(&mu_);
  Slot* slot = FindLocked(session, name);
  if (slot == nullptr || slot->region == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("region '", ShownName(name), "' is not registered by this session"));
  }
  if (slot->region->memory->broken()) return BrokenError(name);
  RegionHold hold;
  {
    absl::MutexLock watch(&slot->region->watch_mu);
    if (slot->region->held) {
      return absl::FailedPreconditionError(
          absl::StrCat("region '", name, "' is already held (a call queue serves it)"));
    }
    slot->region->held = true;
    slot->region->on_gone = std::move(on_gone);
  }
  hold.region_ = slot->region;
  return hold;
}

int RegionTable::size() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [session, s] : sessions_) {
    for (const auto& [name, slot] : s.by_name) n += slot.region != nullptr;
  }
  return n;
}

}  // namespace attn
