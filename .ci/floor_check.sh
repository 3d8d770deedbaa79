#!/usr/bin/env bash
# The declared floor of transformers holds: install exactly that release (with what it depends on) beside
# the test environment and run the Hugging Face tests against it. Run after ./dev.sh test (uses its .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
floor="$(sed -n 's/^ *"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)"
[ -n "$floor" ] || { echo "floor check: no transformers>=X in pyproject.toml" >&2; exit 1; }
start=$(date +%s)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/floor_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
"$VENV/bin/pip" install -q --disable-pip-version-check --target "$WORK/site" "transformers==$floor" > "$WORK/pip.log" 2>&1 \
  || { cat "$WORK/pip.log" >&2; echo "floor check: could not install transformers==$floor" >&2; exit 1; }
got="$(PYTHONPATH="$WORK/site" "$VENV/bin/python" -c 'import transformers; print(transformers.__version__)')"
[ "$got" = "$floor" ] || { echo "floor check: imported transformers $got, wanted $floor" >&2; exit 1; }
PYTHONPATH="$WORK/site" "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/format/test_hf.py
echo "floor check (transformers $floor, tests/format/test_hf.py) passed in $(( $(date +%s) - start )) s"
