"""End-to-end check of an installed torch_armor wheel without extras (run by .ci/wheel_check.sh).

Saves a tiny random Llama and a tokenizer trained here (tests/_tiny_dir.py: no hub), prunes it with
the ``torch-armor`` command, loads the output with ``from_pretrained``, generates, and evaluates it
with ``torch-armor eval``. Every step's exit code is checked; a failing step prints its stderr.
"""

import subprocess
import sys
import tempfile
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


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="wheel_smoke_"))
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
