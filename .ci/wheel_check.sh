#!/usr/bin/env bash
# Build a wheel, install it into a fresh virtual environment WITHOUT extras, and run a tiny
# end-to-end check (.ci/wheel_smoke.py: prune with the CLI, from_pretrained, generate, eval).
# torch is pinned to the local CPU wheel first: a bare `torch>=2.13` would pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/wheel_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)
quietly() {  # run a pip step; show its output only if it fails
  "$@" > "$WORK/step.log" 2>&1 || { cat "$WORK/step.log" >&2; echo "wheel check: failed: $*" >&2; exit 1; }
}
quietly "$PY" -m pip wheel --disable-pip-version-check --no-deps -w "$WORK/dist" "$REPO"
quietly "$PY" -m venv "$WORK/venv"
quietly "$WORK/venv/bin/pip" install --disable-pip-version-check torch==2.13.0
quietly "$WORK/venv/bin/pip" install --disable-pip-version-check "$WORK"/dist/torch_armor-*.whl
# outside the checkout, so that the installed wheel (not the source tree) is imported
cd "$WORK"
PATH="$WORK/venv/bin:$PATH" "$WORK/venv/bin/python" "$REPO/.ci/wheel_smoke.py"
echo "wheel check passed in $(( $(date +%s) - start )) s"
