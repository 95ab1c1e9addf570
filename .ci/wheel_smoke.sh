#!/usr/bin/env bash
# Packaging check: build the wheel, install it WITHOUT extras into a fresh virtual
# environment (the pinned CPU torch first, so pip never pulls a CUDA build), and run the
# main job on the in-process engine and the simulator from outside the source tree. An
# import on a default path that no dependency declares fails here.
#
#   bash .ci/wheel_smoke.sh          (run by `make test` through tests/test_packaging.py)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH="${TORCH:-torch==2.13.0}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

"$PYTHON" -m venv "$WORK/venv"
PIP=("$WORK/venv/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install "$TORCH"
# build from a copy of the tracked files: the source tree's own build outputs stay out of
# the wheel, and the build writes nothing into the tree
mkdir -p "$WORK/src"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
  | tar --null -T - -cf - 2>/dev/null) | tar -xf - -C "$WORK/src"
"${PIP[@]}" wheel --no-deps -w "$WORK/dist" "$WORK/src"
"${PIP[@]}" install "$WORK"/dist/ddiloco-*.whl
cd "$WORK"   # away from the source tree: only the installed package is importable
"$WORK/venv/bin/ddiloco" train --engine inproc --steps 20 --out "$WORK/run" --no-progress
test -s "$WORK/run/summary.json" && test -s "$WORK/run/config.toml"
"$WORK/venv/bin/ddiloco" simulate --system decoupled --chips 300000 --learners 4 --seeds 2 --hours 1
echo "wheel smoke: ok"
