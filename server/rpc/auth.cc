#include "server/rpc/auth.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.pb.h"

namespace attn {
namespace {

absl::StatusOr<std::string> ReadToken(const attnserve::v1::AccessToken& t) {
  if (t.token_file().empty()) return t.token();
  std::ifstream in(t.token_file());
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read token file ", t.token_file()));
  std::stringstream text;
  text << in.rdbuf();
  return std::string(absl::StripAsciiWhitespace(text.str()));
}

bool IsServiceMethod(const std::string& name) {
  const google::protobuf::ServiceDescriptor* service =
      attnserve::v1::GetServerInfoRequest::descriptor()->file()->FindServiceByName(
          "AttentionService");
  return service != nullptr && service->FindMethodByName(name) != nullptr;
}

}  // namespace

absl::StatusOr<Authorizer> Authorizer::Create(
    const std::vector<attnserve::v1::AccessToken>& tokens) {
  Authorizer a;
  for (const attnserve::v1::AccessToken& t : tokens) {
    absl::StatusOr<std::string> token = ReadToken(t);
    if (!token.ok()) return token.status();
    if (token->empty()) {
      return absl::InvalidArgumentError(absl::StrCat("access token '", t.name(), "' is empty"));
    }
    Grant grant;
    grant.name = t.name();
    grant.admin = t.admin();
    for (const std::string& method : t.methods()) {
      if (method == "*") {
        grant.all_methods = true;
      } else if (IsServiceMethod(method)) {
        grant.methods.insert(method);
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "access token '", t.name(), "': '", method, "' is not an AttentionService method"));
      }
    }
    if (!a.tokens_.emplace(*std::move(token), std::move(grant)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("access token '", t.name(), "' repeats another token"));
    }
  }
  return a;
}

absl::StatusOr<Principal> Authorizer::Authenticate(absl::string_view authorization,
                                                   absl::string_view method) const {
  if (!enabled()) return Principal{};
  constexpr absl::string_view kBearer = "Bearer ";
  if (!absl::StartsWithIgnoreCase(authorization, kBearer)) {
    return absl::UnauthenticatedError(
        "this server needs a bearer token: metadata 'authorization: Bearer <token>'");
  }
  auto it = tokens_.find(absl::StripAsciiWhitespace(authorization.substr(kBearer.size())));
  if (it == tokens_.end()) return absl::UnauthenticatedError("unknown bearer token");
  const Grant& g = it->second;
  if (!g.all_methods && !g.methods.contains(method)) {
    return absl::PermissionDeniedError(
        absl::StrCat("token '", g.name, "' may not call ", method));
  }
  return Principal{absl::StrCat("token:", g.name), g.admin};
}

}  // namespace attn
