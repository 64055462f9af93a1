# Shared by scripts/demo, scripts/test and scripts/gpu-check: installs what is missing (Debian's
# packages, PyPI for Python tools), builds with a CMake preset, and prepares the Python venv.
# Source it; it defines functions only.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
PRESET=${ATTN_PRESET:-release}

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# Debian packages the build and the tests need.
APT_PACKAGES=(
  cmake ninja-build g++ pkg-config
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libabsl-dev prometheus-cpp-dev googletest libgtest-dev libgmock-dev libbenchmark-dev
  prometheus clang-14 libclang-rt-14-dev
  libjemalloc2  # tests/e2e/test_isolation.py runs the server on it too (LD_PRELOAD)
)

install_packages() {
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then missing+=(python3-venv); fi
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  fi
}

# The Python client (stubs generated from proto/ at install time) and the test tools.
setup_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV"
    python3 -m venv "$VENV"
  fi
  log "installing the Python client into $VENV"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  "$VENV/bin/pip" install -q "$ROOT/client/python[fast]" pytest ruff
  # tests/e2e/test_isolation.py reads the server's reflection with its messages, as grpcurl would.
  "$VENV/bin/pip" install -q grpcio-reflection
}

build() {
  log "configuring and building (preset $PRESET)"
  cmake --preset "$PRESET" -S "$ROOT" >/dev/null
  cmake --build --preset "$PRESET" "$@"
}

server_bin() { echo "$ROOT/build/$PRESET/bin/attnserve"; }
