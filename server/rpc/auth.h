// Bearer-token authorization of AttentionService calls, with per-method permissions.
//
// Tokens come from the server config (attnserve.v1.AccessToken: the token or a file holding it,
// the methods it may call, "*" for all, and whether it is an admin). With no tokens configured
// every call is allowed. A token's name is the principal its calls act as: the owner of the
// sessions it opens (server/engine/sessions.h). Thread safe after construction.
#pragma once

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnserve/v1/server_config.pb.h"
#include "server/engine/sessions.h"

namespace attn {

class Authorizer {
 public:
  // Reads token files; INVALID_ARGUMENT for an empty token, an unknown method name or a token
  // listed twice.
  static absl::StatusOr<Authorizer> Create(const std::vector<attnserve::v1::AccessToken>& tokens);

  bool enabled() const { return !tokens_.empty(); }

  // `authorization`: the call's "authorization" metadata value (empty when absent). The token's
  // principal ("token:<name>", admin as configured), or UNAUTHENTICATED (no or unknown token) /
  // PERMISSION_DENIED (the token may not call `method`). Without tokens: the anonymous one.
  absl::StatusOr<Principal> Authenticate(absl::string_view authorization,
                                         absl::string_view method) const;
  absl::Status Check(absl::string_view authorization, absl::string_view method) const {
    return Authenticate(authorization, method).status();
  }

 private:
  struct Grant {
    std::string name;
    bool admin = false;
    bool all_methods = false;
    absl::flat_hash_set<std::string> methods;
  };
  absl::flat_hash_map<std::string, Grant> tokens_;  // by token
};

}  // namespace attn
