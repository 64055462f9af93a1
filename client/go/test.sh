#!/usr/bin/env bash
# Builds and tests the Go client, offline, from Debian's packages:
#   1. installs golang-go, the packaged gRPC / protobuf Go sources and the protoc plugins when
#      missing (apt-get update first; needs root or sudo),
#   2. generates the stubs from proto/ into client/go/gen/ (git-ignored),
#   3. checks gofmt, builds every package and the commands (into client/go/gen/bin/), go vet,
#   4. go test ./...: unit tests, and the end-to-end tests against the real server binary
#      ($ATTNSERVE_BIN, default <repo>/build/release/bin/attnserve; skipped when missing).
#
# Extra arguments go to `go test`, e.g. client/go/test.sh -v -run TestGQA
set -euo pipefail
source "$(dirname "$0")/env.sh"

go_install_packages
go_setup_env
go_log "go client: generating stubs ($(protoc --version), $(go version | cut -d' ' -f3))"
go_generate

unformatted=$(cd "$GO_CLIENT_DIR" && gofmt -l $(find . -name '*.go' -not -path './gen/*'))
if [ -n "$unformatted" ]; then
  echo "gofmt needed on: $unformatted" >&2
  exit 1
fi

go_log "go client: build, vet"
go_run build ./...
go_run build -o "$GO_GEN_DIR/bin/" ./cmd/...
go_run vet ./...

go_log "go client: test"
go_run test -count=1 -timeout=5m "$@" ./...
go_log "go client: all tests passed (commands in ${GO_GEN_DIR#"$GO_REPO_ROOT"/}/bin)"
