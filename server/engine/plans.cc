#include "server/engine/plans.h"

#include <atomic>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/engine/regions.h"
#include "server/engine/status_macros.h"

namespace attn {

absl::StatusOr<std::shared_ptr<Plan>> Plan::Create(PagePool* pages, int pool, SessionId session,
                                                   PlanTable table) {
  if (absl::Status st = pages->Pin(table.kv_indices, session, "kv_indices"); !st.ok()) return st;
  return std::shared_ptr<Plan>(new Plan(pages, pool, session, std::move(table)));
}

Plan::Plan(PagePool* pages, int pool, SessionId session, PlanTable table)
    : id_([] {
        static std::atomic<uint64_t> next{1};
        return next.fetch_add(1, std::memory_order_relaxed);
      }()),
      pages_(pages),
      pool_(pool),
      session_(session),
      table_(std::move(table)) {}

Plan::~Plan() { pages_->Unpin(table_.kv_indices); }

absl::Status PlanRegistry::CheckName(absl::string_view name) {
  if (IsValidName(name)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("plan name '", ShownName(name), "' must be 1-64 characters of [A-Za-z0-9_.-]"));
}

absl::StatusOr<std::shared_ptr<Plan>> PlanRegistry::Put(absl::string_view name,
                                                        std::shared_ptr<Plan> plan) {
  if (absl::Status st = CheckName(name); !st.ok()) return st;
  absl::MutexLock lock(&mu_);
  auto& mine = plans_[plan->session()];
  auto it = mine.find(name);
  if (it != mine.end()) return std::exchange(it->second, std::move(plan));
  if (static_cast<int>(mine.size()) >= max_per_session_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the session holds ", mine.size(), " plans, this server's most (max_plans_per_session = ",
        max_per_session_, "): release one (ReleasePlan) or reuse a name"));
  }
  mine.emplace(name, std::move(plan));
  return std::shared_ptr<Plan>();
}

absl::StatusOr<std::shared_ptr<const Plan>> PlanRegistry::Find(SessionId session,
                                                               absl::string_view name) const {
  absl::MutexLock lock(&mu_);
  auto s = plans_.find(session);
  if (s != plans_.end()) {
    auto it = s->second.find(name);
    if (it != s->second.end()) return std::shared_ptr<const Plan>(it->second);
  }
  return absl::NotFoundError(
      absl::StrCat("plan '", ShownName(name), "' is not one of this session's (CreatePlan)"));
}

absl::StatusOr<std::shared_ptr<Plan>> PlanRegistry::Remove(SessionId session,
                                                           absl::string_view name) {
  absl::MutexLock lock(&mu_);
  auto s = plans_.find(session);
  if (s != plans_.end()) {
    auto it = s->second.find(name);
    if (it != s->second.end()) {
      std::shared_ptr<Plan> plan = std::move(it->second);
      s->second.erase(it);
      if (s->second.empty()) plans_.erase(s);
      return plan;
    }
  }
  return absl::NotFoundError(
      absl::StrCat("plan '", ShownName(name), "' is not one of this session's"));
}

void PlanRegistry::ReleaseSession(SessionId session, std::vector<std::shared_ptr<void>>* out) {
  absl::MutexLock lock(&mu_);
  auto s = plans_.find(session);
  if (s == plans_.end()) return;
  for (auto& [name, plan] : s->second) out->push_back(std::move(plan));
  plans_.erase(s);
}

}  // namespace attn
