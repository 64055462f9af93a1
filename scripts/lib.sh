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

# build [cmake --build args]: configures and builds preset $PRESET. It holds build/.$PRESET.lock
# meanwhile, so it first waits for a build of the same preset in progress (background_builds),
# and shows that build's output.
build() {
  log "configuring and building (preset $PRESET)"
  mkdir -p "$ROOT/build"
  (
    flock 9
    local background="$ROOT/build/.$PRESET.background.log"
    if [ -f "$background" ]; then
      cat "$background"
      rm -f "$background"
    fi
    cmake --preset "$PRESET" -S "$ROOT" >/dev/null
    cmake --build --preset "$PRESET" "$@"
  ) 9>"$ROOT/build/.$PRESET.lock"
}

# background_builds PRESET[:JOBS]...: builds the presets one after the other in the background at
# the lowest CPU priority, so that they use the CPU the tests leave idle (the end-to-end suites
# wait on their servers most of the time) and yield it to them otherwise. Returns once it holds
# every preset's lock: a later `build` of one of them waits for it, shows its output (kept in
# build/.PRESET.background.log meanwhile) and finds nothing left to do; after a failed one, that
# `build` builds again and shows the errors. stop_background_builds ends it (an EXIT trap, for a
# run that fails before it has waited for every preset).
background_builds() {
  mkdir -p "$ROOT/build"
  local ready
  ready=$(mktemp -u)
  mkfifo "$ready"
  set -m  # its own process group, for stop_background_builds
  (
    fds=()
    for spec in "$@"; do
      exec {fd}>"$ROOT/build/.${spec%%:*}.lock"
      flock "$fd"
      fds+=("$fd")
    done
    echo >"$ready"
    for i in "${!fds[@]}"; do
      spec=${*:i+1:1} t=$SECONDS
      preset=${spec%%:*} jobs=()
      [ "$preset" = "$spec" ] || jobs=(-j "${spec#*:}")
      {
        if nice -n 19 cmake --preset "$preset" -S "$ROOT" >/dev/null &&
          nice -n 19 cmake --build --preset "$preset" "${jobs[@]}"; then
          log "preset $preset built in the background in $((SECONDS - t)) s"
        else
          log "preset $preset FAILED in the background after $((SECONDS - t)) s"
        fi
      } >"$ROOT/build/.$preset.background.log" 2>&1
      fd=${fds[i]}
      exec {fd}>&-  # releases the lock
    done
  ) </dev/null >/dev/null 2>&1 &
  BACKGROUND_BUILDS=$!
  set +m
  read -r <"$ready"
  rm -f "$ready"
  log "building ${*%%:*} in the background"
}

stop_background_builds() {
  if [ -n "${BACKGROUND_BUILDS:-}" ] && kill -0 "$BACKGROUND_BUILDS" 2>/dev/null; then
    kill -- "-$BACKGROUND_BUILDS" 2>/dev/null || true
  fi
}

server_bin() { echo "$ROOT/build/$PRESET/bin/attnserve"; }
