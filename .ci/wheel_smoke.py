"""End-to-end check of an installed torch_armor wheel without extras (run by .ci/wheel_check.sh).

First, the embedded demo model without its extra: ``torch-armor prune smollm2 --out X`` must fail at
once (seconds, against the ~80 s its model takes to load) with one line naming the one command that
installs everything it needs. Then the job that needs no extra:
Saves a tiny random Llama and a tokenizer trained here (tests/_tiny_dir.py: no hub), prunes it with
the ``torch-armor`` command, loads the output with ``from_pretrained``, generates, and evaluates it
with ``torch-armor eval``. Every step's exit code is checked; a failing step prints its stderr.
"""

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch_armor  # noqa: F401  (first: registers the "armor" quantization method with transformers)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _tiny_dir import save_tiny_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402


def run(*args: str) -> str:
    proc = subprocess.run(["torch-armor", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"FAIL: torch-armor {' '.join(args)} exited {proc.returncode}\n{proc.stderr}")
    return proc.stdout


#: the most seconds the refusal may take: importing torch_armor is a few seconds, a model load ~80 s
REFUSAL_LIMIT_S = 30.0


def check_demo_refused_at_once(work: Path) -> None:
    out = work / "X"
    start = time.perf_counter()
    proc = subprocess.run(["torch-armor", "prune", "smollm2", "--out", str(out)], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    lines = proc.stderr.splitlines()
    commands = re.findall(r"`([^`]*)`", proc.stderr)
    assert proc.returncode != 0, f"prune smollm2 without the demo extra exited 0:\n{proc.stdout}"
    assert len(lines) == 1, f"expected one line of error, got {len(lines)}:\n{proc.stderr}"
    assert len(commands) == 1 and commands[0].startswith("pip install 'torch_armor[demo]'"), proc.stderr
    assert seconds < REFUSAL_LIMIT_S and not out.exists(), f"refused after {seconds:.1f} s (out exists: {out.exists()})"
    print(f"wheel smoke: prune smollm2 without extras refused in {seconds:.1f} s: {lines[0]}")


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="wheel_smoke_"))
    check_demo_refused_at_once(work)
    dense, out, text = save_tiny_model(work), work / "pruned", work / "text.txt"
    run("prune", str(dense), "--out", str(out), "--calib", str(text), "--n-calib", "4", "--seq-len", "32",
        "--iters", "2", "--reconstruct-steps", "1")
    assert (out / "prune_report.json").is_file(), "prune wrote no prune_report.json"

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("the union of the state", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 4), generated.shape

    line = run("eval", str(out), "--data", str(text), "--n-eval", "2", "--seq-len", "32")
    assert line.startswith("perplexity: "), line
    print(f"wheel smoke: prune, from_pretrained, generate and eval passed ({line.strip()})")


if __name__ == "__main__":
    main()
