// The engine's rules without gRPC: quotas, page ownership, admission (pins, append locks), lease
// reclaim, the drain and what the observer hears. The backend is a fake whose lanes can be held,
// so calls stay in flight exactly as long as a test needs.
#include "server/engine/engine.h"

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace attn {
namespace {

using ::absl::StatusCode;

// Lanes that run nothing, and that a test can hold so that calls pile up behind a running one.
struct Gate {
  absl::Mutex mu;
  bool hold ABSL_GUARDED_BY(mu) = false;
  int running ABSL_GUARDED_BY(mu) = 0;
  int launches ABSL_GUARDED_BY(mu) = 0;
  std::vector<std::pair<int, int32_t>> scrubbed ABSL_GUARDED_BY(mu);  // (pool, page)
  int pinned_while_scrubbing ABSL_GUARDED_BY(mu) = 0;
  bool scrub_fails ABSL_GUARDED_BY(mu) = false;

  void Hold(bool h) {
    absl::MutexLock lock(&mu);
    hold = h;
  }
  int Launches() {
    absl::MutexLock lock(&mu);
    return launches;
  }
  void AwaitRunning() {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](Gate* g) ABSL_NO_THREAD_SAFETY_ANALYSIS { return g->running > 0; }, this));
  }
};

class GateLane final : public Lane {
 public:
  explicit GateLane(Gate* gate) : gate_(gate) {}
  absl::StatusOr<LaunchStats> Run(absl::Span<AttentionCall* const>) override {
    absl::MutexLock lock(&gate_->mu);
    ++gate_->running;
    gate_->mu.Await(absl::Condition(
        +[](Gate* g) ABSL_NO_THREAD_SAFETY_ANALYSIS { return !g->hold; }, gate_));
    --gate_->running;
    ++gate_->launches;
    return LaunchStats{};
  }

 private:
  Gate* gate_;
};

// Host memory standing in for a mapped region (the real mappings have tests of their own).
class HeapRegion final : public MappedMemory {
 public:
  explicit HeapRegion(int64_t size) : bytes_(static_cast<size_t>(size)) {}
  RegionKind kind() const override { return RegionKind::kSharedMemory; }
  char* data() const override { return const_cast<char*>(bytes_.data()); }
  int64_t size() const override { return static_cast<int64_t>(bytes_.size()); }

 private:
  std::vector<char> bytes_;
};

class GateBackend final : public Backend {
 public:
  explicit GateBackend(Gate* gate) : gate_(gate) {}
  std::string name() const override { return "gate"; }
  std::string device() const override { return "none"; }
  absl::Status AddPool(const PoolGeometry&) override { return absl::OkStatus(); }
  absl::StatusOr<std::unique_ptr<Lane>> CreateLane(int, Op) override {
    return std::unique_ptr<Lane>(new GateLane(gate_));
  }
  absl::StatusOr<std::unique_ptr<MappedMemory>> MapRegion(const RegionSpec& spec,
                                                          absl::string_view) override {
    return std::unique_ptr<MappedMemory>(new HeapRegion(spec.size));
  }
  // Records what it is asked to zero (pool number, page ids), and how many of them were pinned
  // while it ran (all of them must be, so no close can free them under the scrub).
  absl::Status ScrubPages(int pool, absl::Span<const int32_t> pages) override {
    absl::MutexLock lock(&gate_->mu);
    for (int32_t id : pages) gate_->scrubbed.emplace_back(pool, id);
    if (pinned_pages) gate_->pinned_while_scrubbing += pinned_pages(pool);
    return gate_->scrub_fails ? absl::InternalError("scrub failed") : absl::OkStatus();
  }
  std::function<int(int)> pinned_pages;

 private:
  Gate* gate_;
};

// Checks each report against the pool it names, and keeps what a metrics gauge would show.
class CheckingObserver final : public PageObserver {
 public:
  void OnPoolAdded(const std::string& pool, int total_pages) override {
    absl::MutexLock lock(&mu_);
    free_[pool] = total_pages;
  }
  void OnPageChange(const PageChange& c) override {
    absl::MutexLock lock(&mu_);
    EXPECT_GT(c.pages, 0);
    EXPECT_GE(c.free_pages, 0);
    EXPECT_LE(c.free_pages, c.total_pages);
    free_[c.pool] = c.free_pages;
    events_[c.pool].push_back(c.event);
    if (c.event == PageEvent::kReclaimed) reclaimed_[c.pool] += c.pages;
  }
  void OnAllocationFailure(const std::string& pool) override {
    absl::MutexLock lock(&mu_);
    ++failures_[pool];
  }
  int free(const std::string& pool) {
    absl::MutexLock lock(&mu_);
    return free_[pool];
  }
  int reclaimed(const std::string& pool) {
    absl::MutexLock lock(&mu_);
    return reclaimed_[pool];
  }
  int failures(const std::string& pool) {
    absl::MutexLock lock(&mu_);
    return failures_[pool];
  }
  std::vector<PageEvent> events(const std::string& pool) {
    absl::MutexLock lock(&mu_);
    return events_[pool];
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, int> free_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> reclaimed_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int> failures_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::vector<PageEvent>> events_ ABSL_GUARDED_BY(mu_);
};

constexpr int kGqaPages = 16;
constexpr int kMlaPages = 8;

// The outcome of a submitted call, and what the engine looked like when it was answered.
struct Answer {
  absl::Notification done;
  absl::Status status;
  CallReport report;
  absl::Status free_on_answer;  // FreePages of the call's pages, tried in `done`
  bool idle_on_answer = true;   // WaitForIdle(now) in `done`
};

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(BatchingOptions{}); }

  void Start(BatchingOptions batching) {
    engine_.reset();
    SessionOptions sessions;
    sessions.default_lease = absl::Minutes(10);  // the reaper never expires anything by itself
    std::vector<PoolGeometry> pools{PoolGeometry::Gqa("gqa", 2, 4, 4, 2, 64, kGqaPages),
                                    PoolGeometry::Mla("mla", 1, 4, 2, kMlaPages)};
    DataPlaneOptions data_plane;
    data_plane.shared_memory = true;  // CUDA IPC stays off
    data_plane.limits.max_regions_per_session = 2;
    auto backend = std::make_unique<GateBackend>(&gate_);
    GateBackend* gate_backend = backend.get();
    auto engine = Engine::Create(std::move(backend), std::move(pools), batching, sessions,
                                 /*epoch=*/7, nullptr, &observer_, data_plane);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
    gate_backend->pinned_pages = [this](int pool) {
      return engine_->pools()[pool]->pages().pinned_pages();
    };
  }

  Caller Open(int max_pages = 0, absl::Duration lease = absl::ZeroDuration(),
              const Principal& who = Principal{"token:alice"}) {
    absl::StatusOr<OpenedSession> s = engine_->OpenSession(lease, max_pages, who);
    EXPECT_TRUE(s.ok()) << s.status();
    return Caller{s.ok() ? s->handle : "", who};
  }
  std::vector<int32_t> Allocate(const Caller& who, int n, const std::string& pool = "gqa") {
    absl::StatusOr<std::vector<int32_t>> ids = engine_->AllocatePages(pool, who, n);
    EXPECT_TRUE(ids.ok()) << ids.status();
    return ids.ok() ? *ids : std::vector<int32_t>{};
  }
  Engine::Pool& Pool(const std::string& name = "gqa") { return **engine_->FindPool(name); }

  // A decode over `pages` (one sequence of full pages, page size 4); appending to its last page
  // when `append`.
  static AttentionCall Decode(const std::vector<int32_t>& pages, bool append) {
    AttentionCall c;
    c.op = Op::kDecode;
    c.batch_size = 1;
    c.total_q = 1;
    c.kv_indices = pages;
    c.kv_indptr = Indptr(static_cast<int32_t>(pages.size()));
    c.kv_last_page_len = {4};
    if (append && !pages.empty()) c.append_pages = {AppendKey(pages.back(), 0)};
    return c;
  }
  // [0, n], kept alive for the calls that view it.
  static absl::Span<const int32_t> Indptr(int32_t n) {
    static absl::Mutex mu(absl::kConstInit);
    static auto* kept = new std::map<int32_t, std::vector<int32_t>>();
    absl::MutexLock lock(&mu);
    auto [it, inserted] = kept->try_emplace(n, std::vector<int32_t>{0, n});
    return it->second;
  }
  absl::StatusOr<Admission> Admit(const Caller& who, const std::vector<int32_t>& pages,
                                  bool append = false, const std::string& pool = "gqa") {
    return engine_->Admit(Pool(pool), who, Decode(pages, append));
  }
  void Submit(Admission a, const Caller& who, const std::vector<int32_t>& pages, Answer* answer) {
    engine_->Submit(std::move(a), absl::InfiniteFuture(), nullptr,
                    [this, who, pages, answer](const absl::Status& st, const CallReport& r) {
                      answer->status = st;
                      answer->report = r;
                      answer->free_on_answer = engine_->FreePages("gqa", who, pages).status();
                      answer->idle_on_answer = engine_->WaitForIdle(absl::Now());
                      answer->done.Notify();
                    });
  }
  void ExpectBalanced() {
    for (const auto& pool : engine_->pools()) {
      const PagePool& pages = pool->pages();
      EXPECT_EQ(pages.free_pages() + pages.used_pages(), pages.total_pages());
      // The observer (the metrics' gauges) saw the pool as it is.
      EXPECT_EQ(observer_.free(pool->geometry.name), pool->free_pages()) << pool->geometry.name;
    }
  }

  Gate gate_;
  CheckingObserver observer_;
  std::unique_ptr<Engine> engine_;
};

TEST_F(EngineTest, QuotaIsChargedWithThePoolAndRefundedOnFree) {
  const Caller a = Open(/*max_pages=*/5);
  const std::vector<int32_t> three = Allocate(a, 3);
  ASSERT_EQ(three.size(), 3u);
  Allocate(a, 1, "mla");  // the quota is summed over pools
  EXPECT_EQ(engine_->AllocatePages("gqa", a, 2).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Pool().free_pages(), kGqaPages - 3);  // the refused call allocated nothing
  EXPECT_EQ(observer_.failures("gqa"), 1);
  absl::StatusOr<int> free = engine_->FreePages("gqa", a, {three[0], three[1]});
  ASSERT_TRUE(free.ok()) << free.status();
  EXPECT_EQ(*free, kGqaPages - 1);
  EXPECT_EQ(Allocate(a, 2).size(), 2u);  // the freed pages went back to the quota
  ExpectBalanced();
}

TEST_F(EngineTest, AFullPoolRefundsTheQuotaItCharged) {
  const Caller a = Open(/*max_pages=*/kGqaPages);
  const Caller b = Open();
  Allocate(b, kGqaPages - 2);
  EXPECT_EQ(engine_->AllocatePages("gqa", a, 4).status().code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(engine_->CloseSession(b.session, b.principal).ok());
  // Had the refused call kept its charge, a would now be 4 pages short of its quota.
  EXPECT_EQ(Allocate(a, kGqaPages).size(), static_cast<size_t>(kGqaPages));
  ExpectBalanced();
}

TEST_F(EngineTest, AllocationErrorsComeInTheServicesOrder) {
  const Caller a = Open();
  EXPECT_EQ(engine_->AllocatePages("nope", a, 1).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(engine_->AllocatePages("gqa", Caller{"garbage", a.principal}, 1).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->AllocatePages("gqa", Caller{"", a.principal}, 1).status().code(),
            StatusCode::kInvalidArgument);  // no implicit session
  EXPECT_EQ(engine_->AllocatePages("gqa", a, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->AllocatePages("gqa", a, kGqaPages + 1).status().code(),
            StatusCode::kInvalidArgument);
  engine_->StartDrain();
  EXPECT_EQ(engine_->AllocatePages("nope", a, 0).status().code(), StatusCode::kUnavailable);
}

// The handle alone is not enough: another principal holding it (a leaked or guessed handle)
// can neither use, free, renew nor close the session; an admin can.
TEST_F(EngineTest, ASessionServesOnlyItsPrincipalAndAdmins) {
  const Caller alice = Open(0, absl::Seconds(5));
  const std::vector<int32_t> mine = Allocate(alice, 2);
  const Caller mallory{alice.session, Principal{"token:mallory"}};
  EXPECT_EQ(Admit(mallory, mine).status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(engine_->FreePages("gqa", mallory, mine).status().code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(engine_->AllocatePages("gqa", mallory, 1).status().code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(engine_->RenewLease(mallory).code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(engine_->CloseSession(alice.session, mallory.principal).status().code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(Pool().free_pages(), kGqaPages - 2);
  const Caller ops{alice.session, Principal{"token:ops", /*admin=*/true}};
  EXPECT_TRUE(Admit(ops, mine).ok());
  absl::StatusOr<int> freed = engine_->CloseSession(alice.session, ops.principal);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 2);
  ExpectBalanced();
}

// Pages go to a new owner zeroed: the first allocation of a page needs nothing (storage starts
// zeroed), a page an earlier session held is scrubbed before its id is returned, while pinned.
TEST_F(EngineTest, ReusedPagesAreScrubbedBeforeTheNewOwnerGetsThem) {
  const Caller a = Open(), b = Open(0, absl::ZeroDuration(), Principal{"token:bob"});
  const std::vector<int32_t> first = Allocate(a, 3);
  Allocate(a, 2, "mla");
  {
    absl::MutexLock lock(&gate_.mu);
    EXPECT_TRUE(gate_.scrubbed.empty());
  }
  ASSERT_TRUE(engine_->FreePages("gqa", a, {first[0], first[2]}).ok());
  ASSERT_TRUE(engine_->CloseSession(a.session, a.principal).ok());  // the mla pages too
  // b asks for more pages than were used: only the used ones are scrubbed.
  const std::vector<int32_t> reused = Allocate(b, kGqaPages);
  Allocate(b, kMlaPages, "mla");
  absl::MutexLock lock(&gate_.mu);
  std::vector<std::pair<int, int32_t>> expected = {
      {0, first[0]}, {0, first[1]}, {0, first[2]}, {1, 0}, {1, 1}};
  std::sort(gate_.scrubbed.begin(), gate_.scrubbed.end());
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(gate_.scrubbed, expected);
  EXPECT_EQ(gate_.pinned_while_scrubbing, 5);  // each list pinned while it was zeroed
  EXPECT_EQ(Pool().pages().pinned_pages(), 0);
}

TEST_F(EngineTest, AFailedScrubAllocatesNothing) {
  const Caller a = Open(/*max_pages=*/4);
  const std::vector<int32_t> pages = Allocate(a, 4);
  ASSERT_TRUE(engine_->FreePages("gqa", a, pages).ok());
  {
    absl::MutexLock lock(&gate_.mu);
    gate_.scrub_fails = true;
  }
  EXPECT_EQ(engine_->AllocatePages("gqa", a, 4).status().code(), StatusCode::kInternal);
  EXPECT_EQ(Pool().free_pages(), kGqaPages);
  EXPECT_EQ(Pool().pages().pinned_pages(), 0);
  {
    absl::MutexLock lock(&gate_.mu);
    gate_.scrub_fails = false;
  }
  EXPECT_EQ(Allocate(a, 4).size(), 4u);  // the quota was refunded
  ExpectBalanced();
}

// A page table may name one page many times: without a budget, the owner of one page could
// hold a lane for as long as it liked. The budget refuses the call before its session is
// looked at (so not renewed), and bounds merged launches the same way.
TEST_F(EngineTest, CallsOverTheWorkBudgetAreRefused) {
  BatchingOptions batching;
  batching.max_call_key_reads = 4 * 100;  // 100 pages of 4 tokens, one query row
  Start(batching);
  const Caller a = Open();
  const std::vector<int32_t> one = Allocate(a, 1);
  EXPECT_TRUE(Admit(a, std::vector<int32_t>(100, one[0])).ok());
  const absl::Status over = Admit(a, std::vector<int32_t>(101, one[0])).status();
  EXPECT_EQ(over.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(over.message().find("max_call_key_reads = 400"), std::string::npos) << over;
  EXPECT_NE(over.message().find("404"), std::string::npos) << over;
  EXPECT_EQ(Pool().pages().pinned_pages(), 0);
}

TEST_F(EngineTest, CloseSessionReleasesItsPagesInEveryPool) {
  const Caller a = Open();
  Allocate(a, 3);
  Allocate(a, 2, "mla");
  absl::StatusOr<int> freed = engine_->CloseSession(a.session, a.principal);
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_EQ(*freed, 5);
  EXPECT_EQ(Pool().free_pages(), kGqaPages);
  EXPECT_EQ(Pool("mla").free_pages(), kMlaPages);
  EXPECT_EQ(engine_->CloseSession(a.session, a.principal).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(engine_->AllocatePages("gqa", a, 1).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(observer_.reclaimed("gqa"), 0);  // a close is not a reclaim
  ExpectBalanced();
}

// The stale gauge: a reclaim must move the pool's counts as the observer reports them.
TEST_F(EngineTest, ExpiredLeasesAreReclaimedAndReported) {
  const Caller a = Open(0, absl::Seconds(1));
  const Caller b = Open(0, absl::Hours(1));
  Allocate(a, 5);
  Allocate(a, 1, "mla");
  Allocate(b, 2);
  EXPECT_EQ(observer_.free("gqa"), kGqaPages - 7);
  engine_->ExpireSessions(absl::Now() + absl::Seconds(2));
  EXPECT_EQ(Pool().free_pages(), kGqaPages - 2);
  EXPECT_EQ(observer_.free("gqa"), kGqaPages - 2);
  EXPECT_EQ(observer_.free("mla"), kMlaPages);
  EXPECT_EQ(observer_.reclaimed("gqa"), 5);
  EXPECT_EQ(observer_.reclaimed("mla"), 1);
  EXPECT_EQ(engine_->RenewLease(a).code(), StatusCode::kNotFound);
  EXPECT_TRUE(engine_->RenewLease(b).ok());
  ExpectBalanced();
}

TEST_F(EngineTest, AnAdmissionHoldsPinsAndAppendLocksUntilItGoesOutOfScope) {
  const Caller a = Open();
  const std::vector<int32_t> pages = Allocate(a, 3);
  {
    absl::StatusOr<Admission> first = Admit(a, pages, /*append=*/true);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(Pool().pages().pinned_pages(), 3);
    EXPECT_EQ(engine_->FreePages("gqa", a, {pages[0]}).status().code(),
              StatusCode::kFailedPrecondition);
    // Reading the pages is fine; appending to the same page of the same layer is not.
    absl::StatusOr<Admission> reader = Admit(a, pages);
    EXPECT_TRUE(reader.ok()) << reader.status();
    EXPECT_EQ(Admit(a, pages, /*append=*/true).status().code(), StatusCode::kFailedPrecondition);
    EXPECT_FALSE(engine_->WaitForIdle(absl::Now()));  // two admitted calls
    // Moving an admission moves what it holds; assigning over one releases the old.
    Admission moved = *std::move(first);
    EXPECT_EQ(Admit(a, pages, /*append=*/true).status().code(), StatusCode::kFailedPrecondition);
    moved = *std::move(reader);
    absl::StatusOr<Admission> again = Admit(a, pages, /*append=*/true);
    EXPECT_TRUE(again.ok()) << again.status();
  }
  EXPECT_EQ(Pool().pages().pinned_pages(), 0);
  EXPECT_TRUE(engine_->WaitForIdle(absl::Now()));
  EXPECT_TRUE(engine_->FreePages("gqa", a, pages).ok());
  ExpectBalanced();
}

TEST_F(EngineTest, ARefusedAdmissionHoldsNothing) {
  const Caller a = Open(), b = Open();
  const std::vector<int32_t> mine = Allocate(a, 2);
  const std::vector<int32_t> theirs = Allocate(b, 1);
  // A page of another session, after one of its own: the first page is not left pinned.
  EXPECT_EQ(Admit(a, {mine[0], theirs[0]}).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(Admit(a, {mine[0], kGqaPages}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(
      Admit(Caller{"0000000000000007-" + std::string(32, '9'), a.principal}, mine).status().code(),
      StatusCode::kNotFound);
  absl::StatusOr<Admission> appending = Admit(a, mine, /*append=*/true);
  ASSERT_TRUE(appending.ok());
  EXPECT_EQ(Admit(a, mine, /*append=*/true).status().code(), StatusCode::kFailedPrecondition);
  appending = absl::CancelledError("dropped");
  EXPECT_EQ(Pool().pages().pinned_pages(), 0);
  EXPECT_TRUE(engine_->WaitForIdle(absl::Now()));
  EXPECT_TRUE(Admit(a, mine, /*append=*/true).ok());
}

TEST_F(EngineTest, ASubmittedCallIsUnpinnedBeforeItsAnswerAndCountedUntilAfter) {
  const Caller a = Open();
  const std::vector<int32_t> pages = Allocate(a, 2);
  gate_.Hold(true);
  absl::StatusOr<Admission> admitted = Admit(a, pages, /*append=*/true);
  ASSERT_TRUE(admitted.ok());
  Answer answer;
  Submit(*std::move(admitted), a, pages, &answer);
  gate_.AwaitRunning();
  EXPECT_EQ(engine_->FreePages("gqa", a, pages).status().code(), StatusCode::kFailedPrecondition);
  gate_.Hold(false);
  ASSERT_TRUE(answer.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(answer.status.ok()) << answer.status;
  EXPECT_TRUE(answer.free_on_answer.ok()) << answer.free_on_answer;  // unpinned by then
  EXPECT_FALSE(answer.idle_on_answer);  // still counted while it is answered
  EXPECT_TRUE(engine_->WaitForIdle(absl::Now() + absl::Seconds(30)));
  ExpectBalanced();
}

RegionSpec Shm(const std::string& name, int64_t size = 4096) {
  RegionSpec spec;
  spec.shm_name = name;
  spec.size = size;
  spec.key = std::string(kRegionKeyBytes, 'k');
  return spec;
}

TEST_F(EngineTest, ARegionUsedByARunningCallCannotBeUnregistered) {
  const Caller a = Open();
  ASSERT_TRUE(engine_->RegisterRegion(a, "arena", Shm("/attnserve-a")).ok());
  const std::vector<int32_t> pages = Allocate(a, 1);
  gate_.Hold(true);
  absl::StatusOr<RegionUse> use = engine_->ResolveRegions(a, {{"arena", 0, 256, "q.region"}});
  ASSERT_TRUE(use.ok()) << use.status();
  absl::StatusOr<Admission> admitted =
      engine_->Admit(Pool(), a, Decode(pages, false), *std::move(use));
  ASSERT_TRUE(admitted.ok());
  Answer answer;
  Submit(*std::move(admitted), a, pages, &answer);
  gate_.AwaitRunning();
  EXPECT_EQ(engine_->UnregisterRegion(a, "arena").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine_->ListRegions(a)->front().calls_in_flight, 1);
  gate_.Hold(false);
  ASSERT_TRUE(answer.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(answer.status.ok()) << answer.status;
  // Released before the answer: a client may unregister as soon as it has it.
  EXPECT_TRUE(engine_->UnregisterRegion(a, "arena").ok());
  EXPECT_TRUE(engine_->ListRegions(a)->empty());
}

TEST_F(EngineTest, RegionsBelongToTheirSessionAndGoWithIt) {
  const Caller a = Open(), b = Open();
  ASSERT_TRUE(engine_->RegisterRegion(a, "arena", Shm("/attnserve-a")).ok());
  // Registering the same memory again (a retry after a lost answer) gets the same region.
  absl::StatusOr<RegionInfo> again = engine_->RegisterRegion(a, "arena", Shm("/attnserve-a"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(engine_->RegisterRegion(a, "arena", Shm("/attnserve-other")).status().code(),
            StatusCode::kAlreadyExists);
  EXPECT_EQ(engine_->ResolveRegions(b, {{"arena", 0, 16, "q.region"}}).status().code(),
            StatusCode::kNotFound);  // another session's region does not exist for b
  EXPECT_EQ(engine_->UnregisterRegion(b, "arena").code(), StatusCode::kNotFound);
  ASSERT_TRUE(engine_->RegisterRegion(a, "second", Shm("/attnserve-b")).ok());
  EXPECT_EQ(engine_->RegisterRegion(a, "third", Shm("/attnserve-c")).status().code(),
            StatusCode::kResourceExhausted);  // the server's limit of 2
  ASSERT_TRUE(engine_->CloseSession(a.session, a.principal).ok());
  EXPECT_EQ(engine_->ListRegions(a).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(engine_->RegisterRegion(b, "arena", Shm("/attnserve-a")).ok());
  RegionSpec ipc = Shm("");
  ipc.kind = RegionKind::kCudaIpc;
  EXPECT_EQ(engine_->RegisterRegion(b, "gpu", ipc).status().code(), StatusCode::kUnimplemented);
}

TEST_F(EngineTest, DrainRefusesNewWorkAndWaitsForAdmittedCalls) {
  const Caller a = Open();
  const std::vector<int32_t> pages = Allocate(a, 2);
  const std::vector<int32_t> spare = Allocate(a, 1);
  gate_.Hold(true);
  absl::StatusOr<Admission> admitted = Admit(a, pages);
  ASSERT_TRUE(admitted.ok());
  Answer answer;
  Submit(*std::move(admitted), a, pages, &answer);
  gate_.AwaitRunning();

  engine_->StartDrain();
  EXPECT_TRUE(engine_->draining());
  EXPECT_EQ(Admit(a, spare).status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(engine_->AllocatePages("gqa", a, 1).status().code(), StatusCode::kUnavailable);
  EXPECT_TRUE(engine_->FreePages("gqa", a, spare).ok());  // clients can still give pages back
  EXPECT_FALSE(engine_->WaitForIdle(absl::Now() + absl::Milliseconds(10)));
  gate_.Hold(false);
  EXPECT_TRUE(engine_->WaitForIdle(absl::Now() + absl::Seconds(30)));
  ASSERT_TRUE(answer.done.HasBeenNotified());
  EXPECT_TRUE(answer.status.ok());
}

TEST_F(EngineTest, AFullQueueAnswersAtOnceWithARetryHint) {
  BatchingOptions batching;
  batching.max_queue_requests = 1;
  Start(batching);
  const Caller a = Open();
  const std::vector<int32_t> p0 = Allocate(a, 1), p1 = Allocate(a, 1), p2 = Allocate(a, 1);
  gate_.Hold(true);
  Answer running, queued, refused;
  absl::StatusOr<Admission> admitted = Admit(a, p0);
  Submit(*std::move(admitted), a, p0, &running);
  gate_.AwaitRunning();
  admitted = Admit(a, p1);
  Submit(*std::move(admitted), a, p1, &queued);
  admitted = Admit(a, p2, /*append=*/true);
  ASSERT_TRUE(admitted.ok());
  Submit(*std::move(admitted), a, p2, &refused);
  ASSERT_TRUE(refused.done.HasBeenNotified());  // answered inside Submit
  EXPECT_EQ(refused.status.code(), StatusCode::kResourceExhausted);
  EXPECT_GE(refused.report.retry_after, absl::Milliseconds(1));
  EXPECT_TRUE(refused.free_on_answer.ok()) << refused.free_on_answer;
  EXPECT_TRUE(Admit(a, p1, /*append=*/true).ok());  // nothing of the refused call is held
  gate_.Hold(false);
  ASSERT_TRUE(queued.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(queued.status.ok());
  EXPECT_EQ(queued.report.retry_after, absl::ZeroDuration());
  EXPECT_TRUE(engine_->WaitForIdle(absl::Now() + absl::Seconds(30)));
}

TEST_F(EngineTest, PagesReclaimedWhilePinnedAreFreedByTheirLastCall) {
  const Caller a = Open(0, absl::Seconds(1));
  const std::vector<int32_t> pages = Allocate(a, 4);
  gate_.Hold(true);
  const std::vector<int32_t> read{pages[0], pages[1]};  // the call's page table lives on
  absl::StatusOr<Admission> admitted = Admit(a, read);
  ASSERT_TRUE(admitted.ok());
  Answer answer;
  Submit(*std::move(admitted), a, read, &answer);
  gate_.AwaitRunning();
  engine_->ExpireSessions(absl::Now() + absl::Seconds(2));
  EXPECT_EQ(observer_.reclaimed("gqa"), 4);
  EXPECT_EQ(Pool().free_pages(), kGqaPages - 2);  // the running call's pages are still in use
  ExpectBalanced();
  gate_.Hold(false);
  EXPECT_TRUE(engine_->WaitForIdle(absl::Now() + absl::Seconds(30)));
  EXPECT_EQ(Pool().free_pages(), kGqaPages);
  EXPECT_EQ(observer_.events("gqa").back(), PageEvent::kUnpinned);
  ExpectBalanced();
}

TEST_F(EngineTest, DestroyingTheEngineEndsQueuedCallsAndReleasesThem) {
  BatchingOptions batching;
  batching.max_queue_delay = absl::InfiniteDuration();  // a lone call waits for company forever
  batching.max_batch_requests = 2;
  Start(batching);
  const Caller a = Open();
  const std::vector<int32_t> pages = Allocate(a, 2);
  absl::StatusOr<Admission> admitted = Admit(a, pages, /*append=*/true);
  ASSERT_TRUE(admitted.ok());
  absl::Status status;
  int pinned_on_answer = -1;
  const PagePool* pool = &Pool().pages();
  engine_->Submit(*std::move(admitted), absl::InfiniteFuture(), nullptr,
                  [&](const absl::Status& st, const CallReport&) {
                    status = st;
                    pinned_on_answer = pool->pinned_pages();
                  });
  engine_.reset();
  EXPECT_EQ(status.code(), StatusCode::kUnavailable);
  EXPECT_EQ(pinned_on_answer, 0);
  EXPECT_EQ(gate_.Launches(), 0);
}

// AllocatePages racing CloseSession and lease expiry used to lose pages for good: the quota was
// charged and the session could close before the pages were allocated to it, so they belonged to
// a session that no longer existed. Now the two happen under one lock: whatever the interleaving,
// a closed session owns nothing and the pool balances.
TEST_F(EngineTest, AllocationRacingCloseAndExpiryLosesNoPage) {
  constexpr int kRounds = 200;
  constexpr int kAllocators = 3;
  for (int round = 0; round < kRounds; ++round) {
    const bool expire = round % 2 == 1;
    const OpenedSession s = *engine_->OpenSession(absl::Seconds(1), 0, Principal{});
    const Caller who{s.handle, Principal{}};
    absl::Notification go;
    std::vector<std::thread> allocators;
    for (int t = 0; t < kAllocators; ++t) {
      allocators.emplace_back([&, t] {
        go.WaitForNotification();
        const std::string pool = t % 2 == 0 ? "gqa" : "mla";
        // Allocate and free until the session is gone.
        for (;;) {
          absl::StatusOr<std::vector<int32_t>> ids = engine_->AllocatePages(pool, who, 1);
          if (!ids.ok()) {
            ASSERT_TRUE(absl::IsNotFound(ids.status()) || absl::IsResourceExhausted(ids.status()))
                << ids.status();
            if (absl::IsNotFound(ids.status())) return;
            continue;
          }
          if (absl::Status st = engine_->FreePages(pool, who, *ids).status(); !st.ok()) {
            // Closed in between: the close released the pages instead.
            ASSERT_TRUE(absl::IsNotFound(st)) << st;
            return;
          }
        }
      });
    }
    std::thread closer([&] {
      go.WaitForNotification();
      if (expire) {
        engine_->ExpireSessions(absl::Now() + absl::Seconds(2));
      } else {
        ASSERT_TRUE(engine_->CloseSession(who.session, who.principal).ok());
      }
    });
    go.Notify();
    closer.join();
    for (auto& t : allocators) t.join();
    for (const auto& pool : engine_->pools()) {
      ASSERT_EQ(pool->pages().pages_of(s.id), 0)
          << "round " << round << ", pool " << pool->geometry.name;
      ASSERT_EQ(pool->free_pages(), pool->total_pages()) << "round " << round;
    }
  }
  ExpectBalanced();
}

// --- Plans

// A decode table over `pages` (one sequence of full pages, page size 4).
PlanTable DecodeTable(const std::vector<int32_t>& pages) {
  PlanTable t;
  t.op = Op::kDecode;
  t.kv_indptr = {0, static_cast<int32_t>(pages.size())};
  t.kv_indices = pages;
  t.kv_last_page_len = {4};
  return t;
}

// The call a validator would make of a plan's table: its views point into the plan.
AttentionCall CallOn(const Plan& plan) {
  AttentionCall c;
  c.op = plan.table().op;
  c.batch_size = plan.table().batch();
  c.total_q = c.batch_size;
  c.kv_indptr = plan.table().kv_indptr;
  c.kv_indices = plan.table().kv_indices;
  c.kv_last_page_len = plan.table().kv_last_page_len;
  return c;
}

// A plan's pages are pinned while it lives: FreePages refuses them, and releasing the plan
// gives them back; a plan naming another session's page pins nothing and keeps the old plan.
TEST_F(EngineTest, APlanPinsItsPagesUntilReleasedOrReplaced) {
  const Caller a = Open(), b = Open(0, absl::ZeroDuration(), Principal{"token:bob"});
  const std::vector<int32_t> mine = Allocate(a, 3);
  const std::vector<int32_t> theirs = Allocate(b, 1);
  ASSERT_TRUE(engine_->CreatePlan(Pool(), a, "step", DecodeTable(mine)).ok());
  EXPECT_EQ(Pool().pages().pinned_pages(), 3);
  EXPECT_EQ(engine_->FreePages("gqa", a, {mine[0]}).status().code(),
            StatusCode::kFailedPrecondition);
  // Another session's page: refused, nothing pinned, the old plan stays.
  EXPECT_EQ(engine_->CreatePlan(Pool(), a, "step", DecodeTable({mine[0], theirs[0]})).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(Pool().pages().pinned_pages(), 3);
  ASSERT_TRUE(engine_->FindPlan(Pool(), a, "step", Op::kDecode).ok());
  // Replaced by a smaller table under the same name: the page left out is free to free.
  ASSERT_TRUE(engine_->CreatePlan(Pool(), a, "step", DecodeTable({mine[1], mine[2]})).ok());
  EXPECT_EQ(Pool().pages().pinned_pages(), 2);
  EXPECT_TRUE(engine_->FreePages("gqa", a, {mine[0]}).ok());
  ASSERT_TRUE(engine_->ReleasePlan(a, "step").ok());
  EXPECT_EQ(Pool().pages().pinned_pages(), 0);
  EXPECT_EQ(engine_->ReleasePlan(a, "step").code(), StatusCode::kNotFound);
  EXPECT_TRUE(engine_->FreePages("gqa", a, {mine[1], mine[2]}).ok());
  ExpectBalanced();
}

// A plan is its session's: another session (or another principal holding the handle) cannot
// find it, and a call of another pool or method cannot use it.
TEST_F(EngineTest, APlanServesOnlyItsSessionPoolAndMethod) {
  const Caller a = Open(), b = Open(0, absl::ZeroDuration(), Principal{"token:bob"});
  ASSERT_TRUE(engine_->CreatePlan(Pool(), a, "step", DecodeTable(Allocate(a, 2))).ok());
  EXPECT_EQ(engine_->FindPlan(Pool(), b, "step", Op::kDecode).status().code(),
            StatusCode::kNotFound);
  const Caller mallory{a.session, Principal{"token:mallory"}};
  EXPECT_EQ(engine_->FindPlan(Pool(), mallory, "step", Op::kDecode).status().code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(engine_->ReleasePlan(b, "step").code(), StatusCode::kNotFound);
  EXPECT_EQ(engine_->FindPlan(Pool("mla"), a, "step", Op::kDecode).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(engine_->FindPlan(Pool(), a, "step", Op::kPrefill).status().code(),
            StatusCode::kInvalidArgument);
  absl::StatusOr<std::shared_ptr<const Plan>> plan =
      engine_->FindPlan(Pool(), a, "step", Op::kDecode);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Admitting b's call with a's plan would read a's pages: refused even if a caller got there.
  EXPECT_FALSE(engine_->Admit(Pool(), b, CallOn(**plan), {}, *plan).ok());
  EXPECT_EQ(engine_->CreatePlan(Pool(), a, "bad name", DecodeTable({})).code(),
            StatusCode::kInvalidArgument);
}

// A call on a plan carries the plan's id (AttentionCall::table_id), which no other plan has, a
// replacement under the same name included; a call with a table of its own carries none.
TEST_F(EngineTest, ACallOnAPlanCarriesItsTablesId) {
  const Caller a = Open();
  const std::vector<int32_t> pages = Allocate(a, 2);
  auto admit_on_step = [&]() -> uint64_t {
    absl::StatusOr<std::shared_ptr<const Plan>> plan =
        engine_->FindPlan(Pool(), a, "step", Op::kDecode);
    EXPECT_TRUE(plan.ok()) << plan.status();
    absl::StatusOr<Admission> admitted = engine_->Admit(Pool(), a, CallOn(**plan), {}, *plan);
    EXPECT_TRUE(admitted.ok()) << admitted.status();
    EXPECT_EQ(admitted->call().table_id, (*plan)->id());
    return admitted->call().table_id;
  };
  ASSERT_TRUE(engine_->CreatePlan(Pool(), a, "step", DecodeTable(pages)).ok());
  const uint64_t first = admit_on_step();
  EXPECT_NE(first, 0u);
  EXPECT_EQ(admit_on_step(), first);
  ASSERT_TRUE(engine_->CreatePlan(Pool(), a, "step", DecodeTable(pages)).ok());  // the same table
  const uint64_t second = admit_on_step();
  EXPECT_NE(second, 0u);
  EXPECT_NE(second, first);
  absl::StatusOr<std::shared_ptr<const Plan>> plan =
      engine_->FindPlan(Pool(), a, "step", Op::kDecode);
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<Admission> own = engine_->Admit(Pool(), a, CallOn(**plan));
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->call().table_id, 0u);
}

TEST_F(EngineTest, PlansPerSessionAreBounded) {
  const Caller a = Open();
  const std::vector<int32_t> pages = Allocate(a, 1);
  for (int i = 0; i < 16; ++i) {
    ASSERT_TRUE(engine_->CreatePlan(Pool(), a, absl::StrCat("p", i), DecodeTable(pages)).ok());
  }
  EXPECT_EQ(engine_->CreatePlan(Pool(), a, "one-more", DecodeTable(pages)).code(),
            StatusCode::kResourceExhausted);
  EXPECT_TRUE(engine_->CreatePlan(Pool(), a, "p3", DecodeTable(pages)).ok());  // a replacement
  EXPECT_EQ(Pool().pages().pinned_pages(), 1);
  ASSERT_TRUE(engine_->ReleasePlan(a, "p0").ok());
  EXPECT_TRUE(engine_->CreatePlan(Pool(), a, "one-more", DecodeTable(pages)).ok());
}

// A call admitted with a plan keeps it: releasing the plan meanwhile takes effect for later
// calls, and the pages stay pinned until the call is answered (then they can be freed).
TEST_F(EngineTest, ACallKeepsItsPlanUntilItIsAnswered) {
  const Caller a = Open();
  const std::vector<int32_t> pages = Allocate(a, 2);
  ASSERT_TRUE(engine_->CreatePlan(Pool(), a, "step", DecodeTable(pages)).ok());
  absl::StatusOr<std::shared_ptr<const Plan>> plan =
      engine_->FindPlan(Pool(), a, "step", Op::kDecode);
  ASSERT_TRUE(plan.ok()) << plan.status();
  gate_.Hold(true);
  absl::StatusOr<Admission> admitted = engine_->Admit(Pool(), a, CallOn(**plan), {}, *plan);
  ASSERT_TRUE(admitted.ok()) << admitted.status();
  plan->reset();
  Answer answer;
  Submit(*std::move(admitted), a, pages, &answer);
  gate_.AwaitRunning();
  ASSERT_TRUE(engine_->ReleasePlan(a, "step").ok());
  EXPECT_EQ(engine_->FindPlan(Pool(), a, "step", Op::kDecode).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(Pool().pages().pinned_pages(), 2);  // the running call's
  EXPECT_EQ(engine_->FreePages("gqa", a, pages).status().code(), StatusCode::kFailedPrecondition);
  gate_.Hold(false);
  answer.done.WaitForNotification();
  EXPECT_TRUE(answer.status.ok()) << answer.status;
  EXPECT_TRUE(answer.free_on_answer.ok()) << answer.free_on_answer;  // freed in `done`
  ExpectBalanced();
}

// A session that closes or expires takes its plans along, so their pins cannot keep its pages
// out of the pool.
TEST_F(EngineTest, PlansGoWithTheirSession) {
  const Caller a = Open(0, absl::Seconds(1));
  const Caller b = Open();
  ASSERT_TRUE(engine_->CreatePlan(Pool(), a, "step", DecodeTable(Allocate(a, 3))).ok());
  ASSERT_TRUE(engine_->CreatePlan(Pool(), b, "step", DecodeTable(Allocate(b, 2))).ok());
  engine_->ExpireSessions(absl::Now() + absl::Seconds(2));
  EXPECT_EQ(Pool().free_pages(), kGqaPages - 2);
  EXPECT_EQ(Pool().pages().pinned_pages(), 2);
  ASSERT_TRUE(engine_->CloseSession(b.session, b.principal).ok());
  EXPECT_EQ(Pool().free_pages(), kGqaPages);
  EXPECT_EQ(Pool().pages().pinned_pages(), 0);
  ExpectBalanced();
}

}  // namespace
}  // namespace attn
