// Plans (attention.proto, "Plans"): page tables checked once for the calls that name them, kept
// per session under a name. A plan pins its pages for as long as it lives, so every call naming
// it skips the per-page work of a page table (the copy, the ownership check, the pins): what a
// scheduler's step pays once instead of once per layer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/engine/attention_call.h"
#include "server/engine/page_pool.h"
#include "server/engine/sessions.h"

namespace attn {

// A page table as the request gave it, after the checks a call's table gets
// (server/api/validate.h, ValidatePlanTable): CSR as in AttentionCall, qo_indptr empty for a
// Decode table.
struct PlanTable {
  Op op = Op::kDecode;
  std::vector<int32_t> qo_indptr;
  std::vector<int32_t> kv_indptr;
  std::vector<int32_t> kv_indices;
  std::vector<int32_t> kv_last_page_len;  // as sent (batch or batch + 1 entries, or empty)

  int batch() const { return static_cast<int>(kv_indptr.size()) - 1; }
};

// One plan: its table, and the pins on its pages, which go with the plan (its destructor).
// Immutable once made; calls admitted with it keep it alive through a shared_ptr.
class Plan {
 public:
  // Pins `table.kv_indices` in `pages` for `session` (PagePool::Pin's errors).
  static absl::StatusOr<std::shared_ptr<Plan>> Create(PagePool* pages, int pool, SessionId session,
                                                      PlanTable table);
  ~Plan();
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  int pool() const { return pool_; }  // the Engine's pool index
  SessionId session() const { return session_; }
  const PlanTable& table() const { return table_; }
  // Unique among the plans of the process's life, never 0 (AttentionCall::table_id).
  uint64_t id() const { return id_; }

 private:
  Plan(PagePool* pages, int pool, SessionId session, PlanTable table);

  const uint64_t id_;
  PagePool* const pages_;
  const int pool_;
  const SessionId session_;
  const PlanTable table_;
};

// The plans of every session. Lookups and changes are short (a hash lookup); a replaced or
// released plan is handed back to the caller to destroy outside its locks (its Unpin takes the
// pool's lock). Thread safe.
class PlanRegistry {
 public:
  explicit PlanRegistry(int max_per_session) : max_per_session_(max_per_session) {}

  // INVALID_ARGUMENT for a name that is not 1-64 bytes of [A-Za-z0-9_.-].
  static absl::Status CheckName(absl::string_view name);

  // Stores `plan` under `name` for its session. Replacing a plan of that name always works
  // (the old one is returned); a new name past the session's limit is RESOURCE_EXHAUSTED, and
  // CheckName's error for a bad name.
  absl::StatusOr<std::shared_ptr<Plan>> Put(absl::string_view name, std::shared_ptr<Plan> plan);
  // The session's plan `name`: NOT_FOUND when it has none of that name.
  absl::StatusOr<std::shared_ptr<const Plan>> Find(SessionId session, absl::string_view name) const;
  // Removes the session's plan `name` and returns it (NOT_FOUND when there is none).
  absl::StatusOr<std::shared_ptr<Plan>> Remove(SessionId session, absl::string_view name);
  // Removes every plan of `session` (closed or expired), appending them to `out`.
  void ReleaseSession(SessionId session, std::vector<std::shared_ptr<void>>* out);

 private:
  const int max_per_session_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<SessionId, absl::flat_hash_map<std::string, std::shared_ptr<Plan>>> plans_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace attn
