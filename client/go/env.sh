# Shared by client/go/test.sh and client/go/go.sh: installs Debian's Go toolchain and packaged
# gRPC / protobuf sources when missing, generates the stubs from proto/ and sets up an offline
# GOPATH build. Source it; it defines variables and functions only.
#
# Why GOPATH mode: Debian ships Go libraries as source under /usr/share/gocode/src (GOPATH
# layout) without the module cache entries that module mode needs for their dependencies' go.mod
# files (grpc 1.33's go.mod names envoy, udpa, uuid, ... that Debian does not ship), so
# GO111MODULE=on with GOPROXY=off cannot load the module graph. GOPATH mode only needs the
# packages actually imported, all of which Debian has. Nothing leaves the machine.
#
# Layout (everything generated lives in the git-ignored client/go/gen/):
#   gen/attnservev1/              protoc-gen-go + protoc-gen-go-grpc output
#                                 (import path attnserve/client/go/gen/attnservev1)
#   gen/_gopath/src/attnserve/client/go -> ../../../../..  (this directory, so that the import
#                                 path attnserve/client/go/... resolves; "_" keeps `./...` out)

GO_CLIENT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
GO_REPO_ROOT=$(cd "$GO_CLIENT_DIR/../.." && pwd -P)
GO_IMPORT_ROOT=attnserve/client/go
GO_GEN_DIR=$GO_CLIENT_DIR/gen
GO_GOPATH=$GO_GEN_DIR/_gopath
# The client's directory as the go command must see it (through the GOPATH symlink).
GO_LOGICAL_DIR=$GO_GOPATH/src/$GO_IMPORT_ROOT
GO_DEBIAN_GOCODE=/usr/share/gocode

# golang-github-golang-protobuf-1-5-dev is named explicitly: golang-google-grpc-dev accepts the
# 1-3 variant too, which apt may pick and which panics at run time next to protobuf 1.28.
GO_APT_PACKAGES=(
  golang-go
  golang-google-grpc-dev
  golang-github-golang-protobuf-1-5-dev
  golang-google-protobuf-dev
  protoc-gen-go
  protoc-gen-go-grpc
  protobuf-compiler
)

go_log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

go_as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# Installs the packages that are missing (apt-get update first). No-op when all are present.
go_install_packages() {
  local missing=() p
  for p in "${GO_APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    go_log "installing ${missing[*]}"
    go_as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive go_as_root apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  fi
}

# Exports the environment of an offline GOPATH build and creates the GOPATH symlink.
go_setup_env() {
  export GO111MODULE=off
  export GOPATH="$GO_GOPATH:$GO_DEBIAN_GOCODE"
  export GOPROXY=off
  export GOFLAGS="${GOFLAGS:-}"
  # cgo is not needed; without it no C compiler is needed either.
  export CGO_ENABLED="${CGO_ENABLED:-0}"
  if [ -z "${GOCACHE:-}" ] && [ -z "${XDG_CACHE_HOME:-}" ] && [ -z "${HOME:-}" ]; then
    export GOCACHE="$GO_GEN_DIR/_cache"
  fi
  mkdir -p "$GO_GOPATH/src/attnserve/client"
  ln -sfn ../../../../.. "$GO_GOPATH/src/attnserve/client/go"
}

# Generates gen/attnservev1 from proto/ (a fraction of a second; always redone so it never goes
# stale). The import path comes from the protos' go_package option.
go_generate() {
  local out="$GO_GEN_DIR/.protoc-out"
  rm -rf "$out" && mkdir -p "$out"
  protoc -I "$GO_REPO_ROOT/proto" \
    --go_out="$out" --go_opt="module=$GO_IMPORT_ROOT/gen" \
    --go-grpc_out="$out" --go-grpc_opt="module=$GO_IMPORT_ROOT/gen" \
    "$GO_REPO_ROOT/proto/attnserve/v1/attention.proto" \
    "$GO_REPO_ROOT/proto/attnserve/v1/server_config.proto"
  rm -rf "$GO_GEN_DIR/attnservev1"
  mv "$out/attnservev1" "$GO_GEN_DIR/attnservev1"
  rm -rf "$out"
}

# Runs the go command in the client's logical directory, so ./... patterns work.
go_run() {
  (cd "$GO_LOGICAL_DIR" && go "$@")
}
