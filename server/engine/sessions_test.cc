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

const Principal kAlice{"token:alice"};
const Principal kBob{"token:bob"};
const Principal kAdmin{"token:ops", /*admin=*/true};

SessionOptions Options() {
  SessionOptions o;
  o.default_lease = absl::Seconds(10);
  o.max_lease = absl::Seconds(60);
  return o;
}

TEST(SessionsTest, OpenedSessionsResolveAndRenew) {
  SessionTable t(0xabc, Options());
  const OpenedSession s = t.Open(absl::ZeroDuration(), 0, kAlice, kStart).value();
  EXPECT_EQ(s.lease, absl::Seconds(10));
  EXPECT_EQ(s.handle.substr(0, 17), "0000000000000abc-");
  // A call at 9 s renews the lease: the session is still there at 18 s.
  ASSERT_TRUE(t.Resolve(s.handle, kAlice, kStart + absl::Seconds(9)).ok());
  EXPECT_TRUE(t.Expire(kStart + absl::Seconds(18)).empty());
  auto id = t.Resolve(s.handle, kAlice, kStart + absl::Seconds(18));
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(*id, s.id);
}

TEST(SessionsTest, LeasesExpire) {
  SessionTable t(1, Options());
  const OpenedSession s = t.Open(absl::Seconds(2), 0, kAlice, kStart).value();
  EXPECT_TRUE(t.Expire(kStart + absl::Seconds(1)).empty());
  EXPECT_EQ(t.Expire(kStart + absl::Seconds(2)), std::vector<SessionId>{s.id});
  EXPECT_EQ(t.Resolve(s.handle, kAlice, kStart + absl::Seconds(3)).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(t.size(), 0);
}

TEST(SessionsTest, LeasesAndQuotasAreCappedAtTheServersLimits) {
  SessionOptions o = Options();
  o.max_pages = 7;
  SessionTable t(1, o);
  const OpenedSession s = t.Open(absl::Hours(5), 0, kAlice, kStart).value();
  EXPECT_EQ(s.lease, absl::Seconds(60));
  EXPECT_EQ(s.max_pages, 7);  // none asked: the limit
  EXPECT_EQ(t.Open(absl::Seconds(1), 3, kAlice, kStart)->max_pages, 3);
  // A client cannot raise its quota over the server's limit by asking for more.
  const OpenedSession greedy =
      t.Open(absl::Seconds(1), std::numeric_limits<int32_t>::max(), kAlice, kStart).value();
  EXPECT_EQ(greedy.max_pages, 7);
  EXPECT_TRUE(t.Charge(greedy.id, 7).ok());
  EXPECT_EQ(t.Charge(greedy.id, 1).code(), absl::StatusCode::kResourceExhausted);
  // Without a server limit a session gets what it asks for (0: no quota).
  SessionTable unlimited(1, Options());
  EXPECT_EQ(unlimited.Open(absl::Seconds(1), 0, kAlice, kStart)->max_pages, 0);
  EXPECT_EQ(unlimited.Open(absl::Seconds(1), 9, kAlice, kStart)->max_pages, 9);
}

TEST(SessionsTest, SessionsAreLimitedInNumber) {
  SessionOptions o = Options();
  o.max_sessions = 3;
  SessionTable t(1, o);
  std::vector<OpenedSession> open;
  for (int i = 0; i < 3; ++i) {
    open.push_back(t.Open(absl::ZeroDuration(), 0, kAlice, kStart).value());
  }
  EXPECT_EQ(t.Open(absl::ZeroDuration(), 0, kBob, kStart).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(t.Close(open[0].handle, kAlice).ok());
  EXPECT_TRUE(t.Open(absl::ZeroDuration(), 0, kBob, kStart).ok());
}

TEST(SessionsTest, EveryCallNamesASession) {
  SessionTable t(1, Options());
  const absl::Status st = t.Resolve("", kAlice, kStart).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("OpenSession"), std::string::npos) << st;
  EXPECT_EQ(t.Close("", kAlice).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.size(), 0);  // nothing was opened on the caller's behalf
}

// A handle is a capability bound to the principal that opened it: another token (with the
// handle) is refused, and its refused calls do not keep the session alive.
TEST(SessionsTest, OnlyTheOwnerOrAnAdminUsesASession) {
  SessionTable t(1, Options());
  const OpenedSession s = t.Open(absl::Seconds(10), 0, kAlice, kStart).value();
  for (absl::Duration at : {absl::Seconds(6), absl::Seconds(9)}) {
    EXPECT_EQ(t.Resolve(s.handle, kBob, kStart + at).status().code(),
              absl::StatusCode::kPermissionDenied);
  }
  EXPECT_EQ(t.Resolve(s.handle, Principal{}, kStart).status().code(),
            absl::StatusCode::kPermissionDenied);  // anonymous is no one's owner either
  EXPECT_EQ(t.Close(s.handle, kBob).status().code(), absl::StatusCode::kPermissionDenied);
  // Bob's calls renewed nothing: the lease ran out 10 s after Alice opened it.
  EXPECT_EQ(t.Expire(kStart + absl::Seconds(10)), std::vector<SessionId>{s.id});

  const OpenedSession again = t.Open(absl::Seconds(10), 0, kAlice, kStart).value();
  ASSERT_TRUE(t.Resolve(again.handle, kAdmin, kStart + absl::Seconds(9)).ok());  // renews
  EXPECT_TRUE(t.Expire(kStart + absl::Seconds(12)).empty());
  EXPECT_TRUE(t.Resolve(again.handle, kAlice, kStart).ok());
  EXPECT_TRUE(t.Close(again.handle, kAdmin).ok());
}

TEST(SessionsTest, HandlesOfAnotherEpochOrMalformedAreRefused) {
  SessionTable before(0x1111, Options());
  const OpenedSession old = before.Open(absl::ZeroDuration(), 0, kAlice, kStart).value();
  SessionTable after(0x2222, Options());  // the server restarted
  const absl::Status restarted = after.Resolve(old.handle, kAlice, kStart).status();
  EXPECT_EQ(restarted.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(restarted.message().find("restarted"), std::string::npos) << restarted;
  for (const char* bad :
       {"x", "0000000000002222", "0000000000002222-", "0000000000002222-0", "0000000000002222-abc",
        "2222-1", "0000000000002222-1-2", "-+18", "-0000018"}) {
    EXPECT_EQ(after.Resolve(bad, kAlice, kStart).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(after.Close(old.handle, kAlice).status().code(), absl::StatusCode::kFailedPrecondition);
}

// A handle is a capability: 128 random bits (not a counter a neighbour can guess), and exactly
// one spelling of it is accepted.
TEST(SessionsTest, HandlesAreUnguessableAndCanonical) {
  SessionTable t(0x2222, Options());
  const OpenedSession a = t.Open(absl::ZeroDuration(), 0, kAlice, kStart).value();
  const OpenedSession b = t.Open(absl::ZeroDuration(), 0, kAlice, kStart).value();
  ASSERT_EQ(a.handle.size(), 16u + 1 + 32);
  // The secrets share no structure: a counter would leave them equal but for the last digits.
  int same = 0;
  for (size_t i = 17; i < a.handle.size(); ++i) same += a.handle[i] == b.handle[i];
  EXPECT_LT(same, 12);
  ASSERT_TRUE(t.Resolve(a.handle, kAlice, kStart).ok());
  std::string upper = a.handle;
  for (char& c : upper) c = static_cast<char>(std::toupper(c));
  for (const std::string& variant : {upper, " " + a.handle, a.handle + " ", "+" + a.handle,
                                     a.handle.substr(0, 17) + "-" + a.handle.substr(18),
                                     a.handle + "0", "0" + a.handle, a.handle.substr(1)}) {
    EXPECT_EQ(t.Resolve(variant, kAlice, kStart).status().code(),
              absl::StatusCode::kInvalidArgument)
        << variant;
  }
  // A well-formed handle nobody was given names nothing.
  std::string guessed = a.handle;
  guessed.back() = guessed.back() == '0' ? '1' : '0';
  EXPECT_EQ(t.Resolve(guessed, kAlice, kStart).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.Close(guessed, kAlice).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(t.Resolve(a.handle, kAlice, kStart).ok());
}

TEST(SessionsTest, CloseRemovesOnce) {
  SessionTable t(1, Options());
  const OpenedSession s = t.Open(absl::ZeroDuration(), 0, kAlice, kStart).value();
  auto closed = t.Close(s.handle, kAlice);
  ASSERT_TRUE(closed.ok());
  EXPECT_EQ(*closed, s.id);
  EXPECT_EQ(t.Close(s.handle, kAlice).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(t.Resolve(s.handle, kAlice, kStart).status().code(), absl::StatusCode::kNotFound);
}

TEST(SessionsTest, QuotasAreChargedAndRefunded) {
  SessionTable t(1, Options());
  const OpenedSession s = t.Open(absl::ZeroDuration(), 10, kAlice, kStart).value();
  EXPECT_TRUE(t.Charge(s.id, 6).ok());
  EXPECT_EQ(t.Charge(s.id, 5).code(), absl::StatusCode::kResourceExhausted);
  t.Refund(s.id, 2);
  EXPECT_TRUE(t.Charge(s.id, 6).ok());
  const OpenedSession unlimited = t.Open(absl::ZeroDuration(), 0, kAlice, kStart).value();
  EXPECT_TRUE(t.Charge(unlimited.id, 1'000'000).ok());
}

TEST(SessionsTest, BadHandlesAreShortenedInMessages) {
  SessionTable t(1, Options());
  const std::string hostile = std::string(100000, 'x') + "\n";
  const absl::StatusOr<SessionId> id = t.Resolve(hostile, kAlice, kStart);
  ASSERT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_LT(id.status().message().size(), 200u);
  EXPECT_NE(id.status().message().find("(100001 bytes)"), std::string::npos) << id.status();
}

// AllocatePages charges the quota before the pool checks num_pages: a hostile INT32_MAX must be
// refused by the quota (or refunded) without overflowing the session's page count.
TEST(SessionsTest, HugeChargesNeitherOverflowNorBypassTheQuota) {
  constexpr int kMax = std::numeric_limits<int32_t>::max();
  SessionTable t(1, Options());
  const OpenedSession s = t.Open(absl::ZeroDuration(), 10, kAlice, kStart).value();
  ASSERT_TRUE(t.Charge(s.id, 2).ok());
  EXPECT_EQ(t.Charge(s.id, kMax).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(t.Charge(s.id, 8).ok());  // 2 + 8: the quota is intact
  EXPECT_EQ(t.Charge(s.id, 1).code(), absl::StatusCode::kResourceExhausted);

  const OpenedSession unlimited = t.Open(absl::ZeroDuration(), 0, kAlice, kStart).value();
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
      for (int i = 0; i < 500; ++i) {
        const OpenedSession s = t.Open(absl::Seconds(1 + i % 20), 4, kAlice, now()).value();
        absl::StatusOr<SessionId> id = t.Resolve(s.handle, kAlice, now());
        if (id.ok()) {
          EXPECT_EQ(*id, s.id);
          const absl::Status charged = t.Charge(s.id, 3);
          EXPECT_TRUE(charged.ok() || absl::IsNotFound(charged)) << charged;
          t.Refund(s.id, 3);
        } else {
          EXPECT_TRUE(absl::IsNotFound(id.status())) << id.status();  // expired meanwhile
        }
        absl::StatusOr<SessionId> closed = t.Close(s.handle, kAlice);
        EXPECT_TRUE(closed.ok() || absl::IsNotFound(closed.status())) << closed.status();
      }
    });
  }
  for (auto& th : handlers) th.join();
  stop.store(true);
  reaper.join();
  // Every session was closed or expired.
  EXPECT_EQ(t.size(), 0);
}

}  // namespace
}  // namespace attn
