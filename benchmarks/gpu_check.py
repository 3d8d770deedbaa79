"""The GPU check: one command, run on a machine with an NVIDIA GPU, that produces the README's GPU
table and a pass/fail list of the CUDA tests.

    ./dev.sh setup   # or: pip install -e ".[test,demo]" into an environment with a CUDA build of torch
    python benchmarks/gpu_check.py                 # full: every CUDA test, then benchmarks/inference_gpu.py
    python benchmarks/gpu_check.py --quick         # the tests, and one layer shape without the whole model
    python benchmarks/gpu_check.py --dry-run       # on a CPU: checks this script (no CUDA number comes out)

Steps:

1. the device: name, compute capability, torch and CUDA versions, the 2:4 backends the storage
   policy sees (``torch_armor.tensor.policy.device_info``);
2. the CUDA tests with pytest (``tests/tensor/test_cuda.py``: 2:4 numerics against dense, the policy on
   the real device, moves, ``load_state_dict``, ``torch.compile``, ``prune_model(device="cuda")``,
   ``from_pretrained(device_map="cuda")``, pinned hidden states, no host syncs; and the device-free
   ``test_semi_structured.py`` / ``test_policy.py``): one ``PASS``/``FAIL``/``SKIP`` line per test;
3. ``benchmarks/inference_gpu.py`` (its defaults: the README table; ``--quick``: 4096x4096 only, no
   whole model), markdown and JSON saved;
4. ``OUT/summary.md`` with all of it. Exit status 0 only if no test failed and every benchmark row
   agrees with its dense reference; 2 without CUDA (unless ``--dry-run``).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
CUDA_TESTS = ["tests/tensor/test_cuda.py", "tests/tensor/test_semi_structured.py", "tests/tensor/test_policy.py"]
QUICK_BENCH = ["--shapes", "4096x4096", "--tokens", "1", "16", "2048", "--skip-model"]
DRY_BENCH = ["--dry-run", "--no-compile", "--skip-model"]
NO_CUDA = "no CUDA device: run this on an NVIDIA GPU (sm80+), or pass --dry-run to check the script on a CPU"


def device_lines() -> List[str]:
    import torch

    sys.path.insert(0, str(ROOT))
    from torch_armor.tensor import policy

    lines = [f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}"]
    if torch.cuda.is_available():
        info = policy.device_info("cuda")
        lines.append(f"device: {torch.cuda.get_device_name()} (sm{info.capability[0]}{info.capability[1]}), "
                     f"2:4 backends: {', '.join(sorted(info.backends)) or 'none'}, "
                     f"cuSPARSELt {torch.backends.cusparselt.version() if 'cusparselt' in info.backends else '-'}")
    else:
        lines.append("device: none (dry run on CPU: no CUDA number below means anything)")
    return lines


def test_results(junit: Path) -> List[Tuple[str, str, str]]:
    """``[(test id, PASS|FAIL|SKIP, first line of the reason)]`` from a pytest junit XML file."""
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        status, why = "PASS", ""
        for tag, label in (("failure", "FAIL"), ("error", "FAIL"), ("skipped", "SKIP")):
            found = case.find(tag)
            if found is not None:
                status, why = label, (found.get("message") or "").strip().splitlines()[0:1]
                why = why[0][:120] if why else ""
                break
        out.append((name, status, why))
    return out


def run_tests(out: Path, tests: Sequence[str]) -> List[Tuple[str, str, str]]:
    junit = out / "cuda_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests]
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    (out / "cuda_tests.log").write_text(proc.stdout + proc.stderr)
    if not junit.exists():
        return [("pytest", "FAIL", (proc.stderr or proc.stdout).strip().splitlines()[-1:][0][:120])]
    return test_results(junit)


def run_benchmark(out: Path, bench_args: Sequence[str]) -> Tuple[str, Optional[dict]]:
    json_path = out / "inference_gpu.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "inference_gpu.py"), *bench_args, "--json", str(json_path)]
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    text = proc.stdout + (f"\n(exit {proc.returncode}) {proc.stderr.strip()[-2000:]}" if proc.returncode else "")
    (out / "inference_gpu.md").write_text(text)
    return text, json.loads(json_path.read_text()) if json_path.exists() else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check"), help="directory for the results (default gpu_check)")
    p.add_argument("--quick", action="store_true", help="one layer shape, no whole model")
    p.add_argument("--dry-run", action="store_true", help="on a CPU: run what runs there, to check this script")
    p.add_argument("--tests", nargs="+", default=None, help=f"pytest targets (default: {' '.join(CUDA_TESTS)})")
    p.add_argument("--bench-args", default=None, help="arguments for benchmarks/inference_gpu.py instead of ours")
    args = p.parse_args(argv)
    import torch

    if not (args.dry_run or torch.cuda.is_available()):
        print(NO_CUDA, file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    lines = ["# torch_armor GPU check", "", *device_lines(), ""]
    print("\n".join(lines), flush=True)
    results = run_tests(args.out, args.tests or CUDA_TESTS)
    counts = {s: sum(r[1] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    lines += [f"## CUDA tests: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped", ""]
    lines += [f"- {status} {name}" + (f" — {why}" if why else "") for name, status, why in results]
    bench_args = shlex.split(args.bench_args) if args.bench_args is not None else \
        (DRY_BENCH if args.dry_run else QUICK_BENCH if args.quick else [])
    table, data = run_benchmark(args.out, bench_args)
    bad_rows = data.get("failed_checks", 1) if data else 1
    lines += ["", "## Inference benchmark", "", table.strip(), ""]
    verdict = "ok" if counts["FAIL"] == 0 and bad_rows == 0 else "FAILED"
    lines.append(f"result: {verdict} ({counts['FAIL']} failed test(s), {bad_rows} benchmark row(s) off their dense "
                 "reference or missing)")
    text = "\n".join(lines) + "\n"
    (args.out / "summary.md").write_text(text)
    print(text[text.index("## CUDA tests"):])
    print(f"written: {args.out / 'summary.md'}")
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
