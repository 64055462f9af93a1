#include "server/engine/sessions.h"

#include <atomic>
#include <cctype>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace attn {
namespace {

const absl::Time kStart = absl::FromUnixSeconds(1'000'000);

SessionOptions Options() {
  SessionOptions o;
  o.default_lease = absl::Seconds(10);
  o.max_lease = absl::Seconds(60);
  return o;
}

TEST(SessionsTest, OpenedSessionsResolveAndRenew) {
  SessionTable t(0xabc, Options());
  const OpenedSession s = t.Open(absl::ZeroDuration(), 0, kStart);
  EXPECT_EQ(s.lease, absl::Seconds(10));
  EXPECT_EQ(s.handle.substr(0, 17), "0000000000000abc-");
  // A call at 9 s renews the lease: the session is still there at 18 s.
  ASSERT_TRUE(t.Resolve(s.handle, "peer", kStart + absl::Seconds(9)).ok());
  EXPECT_TRUE(t.Expire(kStart + absl::Seconds(18)).empty());
  auto id = t.Resolve(s.handle, "peer", kStart + absl::Seconds(18));
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(*id, s.id);
}

TEST(SessionsTest, LeasesExpire) {
  SessionTable t(1, Options());
  const OpenedSession s = t.Open(absl::Seconds(2), 0, kStart);
  EXPECT_TRUE(t.Expire(kStart + absl::Seconds(1)).empty());
  EXPECT_EQ(t.Expire(kStart + absl::Seconds(2)), std::vector<SessionId>{s.id});
  EXPECT_EQ(t.Resolve(s.handle, "p", kStart + absl::Seconds(3)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(t.size(), 0);
}

TEST(SessionsTest, LeasesAreCappedAndQuotasDefault) {
  SessionOptions o = Options();
  o.default_max_pages = 7;
  SessionTable t(1, o);
  const OpenedSession s = t.Open(absl::Hours(5), 0, kStart);
  EXPECT_EQ(s.lease, absl::Seconds(60));
  EXPECT_EQ(s.max_pages, 7);
  EXPECT_EQ(t.Open(absl::Seconds(1), 3, kStart).max_pages, 3);
}

TEST(SessionsTest, ImplicitSessionsArePerPeer) {
  SessionTable t(1, Options());
  auto a1 = t.Resolve("", "ipv4:127.0.0.1:1000", kStart);
  auto a2 = t.Resolve("", "ipv4:127.0.0.1:1000", kStart + absl::Seconds(5));
  auto b = t.Resolve("", "ipv4:127.0.0.1:2000", kStart);
  ASSERT_TRUE(a1.ok() && a2.ok() && b.ok());
  EXPECT_EQ(*a1, *a2);
  EXPECT_NE(*a1, *b);
  // b was last seen at 0 s, a at 5 s: at 12 s only b has expired, and a new b is a new session.
  EXPECT_EQ(t.Expire(kStart + absl::Seconds(12)), std::vector<SessionId>{*b});
  auto b2 = t.Resolve("", "ipv4:127.0.0.1:2000", kStart + absl::Seconds(12));
  ASSERT_TRUE(b2.ok());
  EXPECT_NE(*b2, *b);
}

TEST(SessionsTest, HandlesOfAnotherEpochOrMalformedAreRefused) {
  SessionTable before(0x1111, Options());
  const OpenedSession old = before.Open(absl::ZeroDuration(), 0, kStart);
  SessionTable after(0x2222, Options());  // the server restarted
  const absl::Status restarted = after.Resolve(old.handle, "p", kStart).status();
  EXPECT_EQ(restarted.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(restarted.message().find("restarted"), std::string::npos) << restarted;
  for (const char* bad :
       {"x", "0000000000002222", "0000000000002222-", "0000000000002222-0", "0000000000002222-abc",
        "2222-1", "0000000000002222-1-2", "-+18", "-0000018"}) {
    EXPECT_EQ(after.Resolve(bad, "p", kStart).status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(after.Close(old.handle).status().code(), absl::StatusCode::kFailedPrecondition);
}

// A handle is a capability: 128 random bits (not a counter a neighbour can guess), and exactly
// one spelling of it is accepted.
TEST(SessionsTest, HandlesAreUnguessableAndCanonical) {
  SessionTable t(0x2222, Options());
  const OpenedSession a = t.Open(absl::ZeroDuration(), 0, kStart);
  const OpenedSession b = t.Open(absl::ZeroDuration(), 0, kStart);
  ASSERT_EQ(a.handle.size(), 16u + 1 + 32);
  // The secrets share no structure: a counter would leave them equal but for the last digits.
  int same = 0;
  for (size_t i = 17; i < a.handle.size(); ++i) same += a.handle[i] == b.handle[i];
  EXPECT_LT(same, 12);
  ASSERT_TRUE(t.Resolve(a.handle, "p", kStart).ok());
  std::string upper = a.handle;
  for (char& c : upper) c = static_cast<char>(std::toupper(c));
  for (const std::string& variant : {upper, " " + a.handle, a.handle + " ", "+" + a.handle,
                                     a.handle.substr(0, 17) + "-" + a.handle.substr(18),
                                     a.handle + "0", "0" + a.handle, a.handle.substr(1)}) {
    EXPECT_EQ(t.Resolve(variant, "p", kStart).status().code(), absl::StatusCode::kInvalidArgument)
        << variant;
  }
  // A well-formed handle nobody was given names nothing.
  std::string guessed = a.handle;
  guessed.back() = guessed.back() == '0' ? '1' : '0';
  EXPECT_EQ(t.Resolve(guessed, "p", kStart).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.Close(guessed).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(t.Resolve(a.handle, "p", kStart).ok());
}

TEST(SessionsTest, CloseRemovesOnce) {
  SessionTable t(1, Options());
  const OpenedSession s = t.Open(absl::ZeroDuration(), 0, kStart);
  auto closed = t.Close(s.handle);
  ASSERT_TRUE(closed.ok());
  EXPECT_EQ(*closed, s.id);
  EXPECT_EQ(t.Close(s.handle).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.Resolve(s.handle, "p", kStart).status().code(), absl::StatusCode::kNotFound);
}

TEST(SessionsTest, QuotasAreChargedAndRefunded) {
  SessionTable t(1, Options());
  const OpenedSession s = t.Open(absl::ZeroDuration(), 10, kStart);
  EXPECT_TRUE(t.Charge(s.id, 6).ok());
  EXPECT_EQ(t.Charge(s.id, 5).code(), absl::StatusCode::kResourceExhausted);
  t.Refund(s.id, 2);
  EXPECT_TRUE(t.Charge(s.id, 6).ok());
  const OpenedSession unlimited = t.Open(absl::ZeroDuration(), 0, kStart);
  EXPECT_TRUE(t.Charge(unlimited.id, 1'000'000).ok());
}

TEST(SessionsTest, BadHandlesAreShortenedInMessages) {
  SessionTable t(1, Options());
  const std::string hostile = std::string(100000, 'x') + "\n";
  const absl::StatusOr<SessionId> id = t.Resolve(hostile, "p", kStart);
  ASSERT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(id.status().message().size(), 200u);
  EXPECT_NE(id.status().message().find("(100001 bytes)"), std::string::npos) << id.status();
}

// AllocatePages charges the quota before the pool checks num_pages: a hostile INT32_MAX must be
// refused by the quota (or refunded) without overflowing the session's page count.
TEST(SessionsTest, HugeChargesNeitherOverflowNorBypassTheQuota) {
  constexpr int kMax = std::numeric_limits<int32_t>::max();
  SessionTable t(1, Options());
  const OpenedSession s = t.Open(absl::ZeroDuration(), 10, kStart);
  ASSERT_TRUE(t.Charge(s.id, 2).ok());
  EXPECT_EQ(t.Charge(s.id, kMax).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(t.Charge(s.id, 8).ok());  // 2 + 8: the quota is intact
  EXPECT_EQ(t.Charge(s.id, 1).code(), absl::StatusCode::kResourceExhausted);

  const OpenedSession unlimited = t.Open(absl::ZeroDuration(), 0, kStart);
  ASSERT_TRUE(t.Charge(unlimited.id, 2).ok());
  ASSERT_TRUE(t.Charge(unlimited.id, kMax).ok());  // the pool refuses it next; then:
  t.Refund(unlimited.id, kMax);
  ASSERT_TRUE(t.Charge(unlimited.id, kMax).ok());
  t.Refund(unlimited.id, kMax);
}

// Handlers on many threads open, resolve, charge and close sessions while the reaper expires
// them (the table is shared by every call; scripts/sanitize runs this under ThreadSanitizer).
TEST(SessionsTest, ConcurrentCallsAndExpiry) {
  SessionTable t(1, Options());
  std::atomic<bool> stop{false};
  std::atomic<int64_t> clock_s{0};  // a shared fake clock the reaper advances
  auto now = [&] { return kStart + absl::Seconds(clock_s.load()); };
  std::thread reaper([&] {
    while (!stop.load()) {
      clock_s.fetch_add(1);
      t.Expire(now());
    }
  });
  std::vector<std::thread> handlers;
  for (int h = 0; h < 4; ++h) {
    handlers.emplace_back([&, h] {
      const std::string peer = "ipv4:127.0.0.1:" + std::to_string(1000 + h);
      for (int i = 0; i < 500; ++i) {
        const OpenedSession s = t.Open(absl::Seconds(1 + i % 20), 4, now());
        absl::StatusOr<SessionId> id = t.Resolve(s.handle, peer, now());
        if (id.ok()) {
          EXPECT_EQ(*id, s.id);
          const absl::Status charged = t.Charge(s.id, 3);
          EXPECT_TRUE(charged.ok() || absl::IsNotFound(charged)) << charged;
          t.Refund(s.id, 3);
        } else {
          EXPECT_TRUE(absl::IsNotFound(id.status())) << id.status();  // expired meanwhile
        }
        ASSERT_TRUE(t.Resolve("", peer, now()).ok());
        absl::StatusOr<SessionId> closed = t.Close(s.handle);
        EXPECT_TRUE(closed.ok() || absl::IsNotFound(closed.status())) << closed.status();
      }
    });
  }
  for (auto& th : handlers) th.join();
  stop.store(true);
  reaper.join();
  // Every explicit session was closed or expired; only the implicit ones may remain.
  const int left = t.size();
  EXPECT_LE(left, 4);
  EXPECT_EQ(t.Expire(now() + absl::Hours(2)).size(), static_cast<size_t>(left));
  EXPECT_EQ(t.size(), 0);
}

}  // namespace
}  // namespace attn
