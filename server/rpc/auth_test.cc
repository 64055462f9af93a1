#include "server/rpc/auth.h"

#include <cstdio>
#include <fstream>

#include "gtest/gtest.h"

namespace attn {
namespace {

attnserve::v1::AccessToken Token(const std::string& name, const std::string& token,
                                 std::initializer_list<const char*> methods) {
  attnserve::v1::AccessToken t;
  t.set_name(name);
  t.set_token(token);
  for (const char* m : methods) t.add_methods(m);
  return t;
}

TEST(AuthTest, WithoutTokensEverythingIsAllowed) {
  auto a = Authorizer::Create({});
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(a->enabled());
  EXPECT_TRUE(a->Check("", "Prefill").ok());
}

TEST(AuthTest, TokensAndScopes) {
  auto a = Authorizer::Create({Token("sched", "s3cret", {"*"}),
                               Token("dash", "r3ad", {"GetServerInfo"})});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->Check("Bearer s3cret", "Prefill").ok());
  EXPECT_TRUE(a->Check("bearer s3cret", "CloseSession").ok());
  EXPECT_TRUE(a->Check("Bearer r3ad", "GetServerInfo").ok());
  EXPECT_EQ(a->Check("Bearer r3ad", "AllocatePages").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(a->Check("", "GetServerInfo").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(a->Check("Bearer nope", "GetServerInfo").code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(a->Check("Basic s3cret", "GetServerInfo").code(), absl::StatusCode::kUnauthenticated);
}

TEST(AuthTest, ReadsTokenFilesAndRejectsBadConfigs) {
  const std::string path = ::testing::TempDir() + "/token";
  std::ofstream(path) << "from-a-file\n";
  attnserve::v1::AccessToken file;
  file.set_name("file");
  file.set_token_file(path);
  file.add_methods("Decode");
  auto a = Authorizer::Create({file});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->Check("Bearer from-a-file", "Decode").ok());

  EXPECT_FALSE(Authorizer::Create({Token("x", "", {"*"})}).ok());               // empty token
  EXPECT_FALSE(Authorizer::Create({Token("x", "t", {"Prefil"})}).ok());         // unknown method
  EXPECT_FALSE(Authorizer::Create({Token("x", "t", {"*"}), Token("y", "t", {"*"})}).ok());
  file.set_token_file(path + ".missing");
  EXPECT_FALSE(Authorizer::Create({file}).ok());
}

}  // namespace
}  // namespace attn
