#!/usr/bin/env bash
# Runs the go command on the Go client with the offline Debian GOPATH set up (see env.sh), after
# regenerating the stubs from proto/. Packages are relative to client/go. Examples:
#
#   client/go/go.sh build ./...
#   client/go/go.sh test ./attnserve -run TestLive -v
#   client/go/go.sh run ./cmd/scheduler --address=127.0.0.1:50051
#   client/go/go.sh build -o /tmp/attn-loadgen ./cmd/loadgen
#
# Relative output paths (-o) are taken from client/go. Packages must already be installed
# (client/go/test.sh installs them).
set -euo pipefail
source "$(dirname "$0")/env.sh"
go_setup_env
go_generate
go_run "$@"
