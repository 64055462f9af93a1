#!/usr/bin/env bash
# Checks the runtime floor of the Python client: builds its wheel (with the generator that
# pyproject.toml pins for this Python), reads the grpcio / protobuf minimums the wheel declares,
# installs the wheel into a fresh venv beside exactly those versions and runs the unit tests
# there. Needs PyPI (or a mirror) for the old versions. Usage: client/python/check_floor.sh [python]
set -euo pipefail
PYTHON=${1:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" -m venv "$WORK/build-env"
"$WORK/build-env/bin/pip" install -q --upgrade pip build
"$WORK/build-env/bin/python" -m build -q --wheel --outdir "$WORK/dist" "$HERE" >/dev/null
wheel=$(ls "$WORK"/dist/attnserve-*.whl)

# "Requires-Dist: grpcio>=1.62.0" -> grpcio==1.62.0
floor=$(unzip -p "$wheel" '*.dist-info/METADATA' |
  sed -n 's/^Requires-Dist: \(grpcio\|protobuf\)>=\([0-9.]*\)$/\1==\2/p')
if [ "$(echo "$floor" | wc -l)" -ne 2 ]; then
  echo "check_floor: expected grpcio and protobuf minimums in $wheel, got: $floor" >&2
  exit 1
fi
echo "check_floor: $(basename "$wheel") declares:" $floor

"$PYTHON" -m venv "$WORK/floor-env"
# shellcheck disable=SC2086 # one requirement per word
"$WORK/floor-env/bin/pip" install -q $floor numpy pytest
"$WORK/floor-env/bin/pip" install -q --no-deps "$wheel"
"$WORK/floor-env/bin/python" -c 'import grpc, google.protobuf as p; print("check_floor: runtime grpcio", grpc.__version__, "protobuf", p.__version__)'
# Generated code warns (or raises) when it does not fit its runtime: make warnings errors.
(cd "$WORK" && "$WORK/floor-env/bin/python" -W error::UserWarning -W error::RuntimeWarning \
  -m pytest -q -p no:cacheprovider "$HERE/tests")
