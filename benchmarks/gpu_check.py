"""The GPU check: one command, run on a machine with an NVIDIA GPU, that lists the CUDA tests as
PASS/FAIL and measures ARMOR against dense and plain 2:4. Every row is written the moment it is
measured (``OUT/summary.md`` and ``OUT/rows.jsonl``), so a command cut off by a time limit keeps
what it finished.

    python benchmarks/gpu_check.py --quick            # <= 5 min on one H100 (its estimate printed first)
    python benchmarks/gpu_check.py                    # full: the tests, then benchmarks/inference_gpu.py
    python benchmarks/gpu_check.py --quick --dry-run  # on a CPU: the plan, the estimate, the script checked

``--quick`` (``benchmarks/gpu_quick.py``), within ``--budget-s`` (300 s; a step that would not fit is
skipped with a row saying so):

1. the device: name, compute capability, driver, torch / CUDA / cuSPARSELt / Triton versions;
2. the CUDA tests (``tests/kernels``: the Triton kernels compiled; ``tests/tensor/test_cuda.py``: the 2:4
   numerics, the policy on the real device, ``prune_model(device="cuda")``, ``from_pretrained``;
   the fake-CUDA traces): one ``PASS``/``FAIL``/``SKIP`` line each;
3. Llama-3-8B layer shapes at 1, 16, 256, 2048 tokens: dense / plain 2:4 (same masks) / ARMOR bmm /
   ARMOR fused, bf16, each checked against the dense product of its weights; at 16 and 2048 tokens also
   int8 and fp8 (e4m3), each token quantized on the fly: the dense weight (``torch._int_mm`` /
   ``torch._scaled_mm``), the plain 2:4 core (8-bit ``_cslt_sparse_mm``) and ARMOR's 8-bit core;
4. an 8B-shaped model (``--layers`` decoder layers): prefill 2048, 128 decode steps at batch 1 and 16
   with the static cache, eager and from a CUDA graph, dense / plain 2:4 / ARMOR;
5. the default prune of one 8B-shaped decoder block, projected to 8B and 70B;
6. the targets: ARMOR >= 1.3x dense and >= 90% of plain 2:4's speed-up at prefill 2048; decode at
   batch 1 with CUDA graphs >= 1.2x dense; ARMOR fp8 2:4 >= 1.3x fp8 dense at 2048 tokens.

Exit status 0 only if no test failed and every row agrees with its dense reference; 2 without CUDA
(unless ``--dry-run``, which runs the same steps on a CPU at tiny sizes: no number it prints means
anything).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
CUDA_TESTS = ["tests/kernels", "tests/tensor/test_cuda.py", "tests/tensor/test_semi_structured.py",
              "tests/tensor/test_semi_structured_model.py", "tests/tensor/test_policy.py"]
QUICK_BENCH = ["--shapes", "4096x4096", "--tokens", "1", "16", "2048", "--skip-model"]
DRY_BENCH = ["--dry-run", "--no-compile", "--skip-model"]
NO_CUDA = "no CUDA device: run this on an NVIDIA GPU (sm80+), or pass --dry-run to check the script on a CPU"
#: seconds each quick step is expected to take on one H100 (a guess until the first GPU run replaces it)
QUICK_ESTIMATE_S = {"start": 20, "tests": 90, "layers": 40, "model": 60, "prune": 90}

LAYER_COLS = [("shape", "shape", ""), ("tokens", "tokens", ""), ("variant", "variant", ""), ("flushed ms", "ms", ".4f"),
              ("b2b ms", "b2b_ms", ".4f"), ("x dense", "x_dense", ".2f"), ("x 2:4", "x_24", ".2f"),
              ("x 8-bit dense", "x_8bit_dense", ".2f"), ("check", "check", ""), ("note", "note", "")]
MODEL_COLS = [("variant", "variant", ""), ("workload", "workload", ""), ("ms", "ms", ".2f"), ("tokens/s", "tok_s", ".1f"),
              ("x dense", "x_dense", ".2f"), ("x 2:4", "x_24", ".2f"), ("check", "check", ""), ("note", "note", "")]
PRUNE_COLS = [("what", "what", ""), ("seconds", "seconds", ".1f"), ("note", "note", "")]


class Report:
    """``OUT/summary.md`` and ``OUT/rows.jsonl``, appended and flushed line by line."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.summary, self.rows = out / "summary.md", out / "rows.jsonl"
        self.summary.write_text("")
        self.rows.write_text("")

    def lines(self, lines: Iterable[str]) -> None:
        text = "".join(f"{line}\n" for line in lines)
        print(text, end="", flush=True)
        with self.summary.open("a") as f:
            f.write(text)

    def table(self, step: str, cols: Sequence[tuple], rows: Iterable[dict]) -> List[dict]:
        """Write each row of ``rows`` as it comes: a markdown line in the summary, a JSON line in rows.jsonl."""
        self.lines(["", "| " + " | ".join(c[0] for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"])
        seen = []
        for row in rows:
            seen.append(row)
            self.lines(["| " + " | ".join(_fmt(row.get(key), spec) for _, key, spec in cols) + " |"])
            with self.rows.open("a") as f:
                f.write(json.dumps({"step": step, **row}) + "\n")
        return seen


def _fmt(value, spec: str) -> str:
    if value is None:
        return "—"
    return f"{value:{spec}}" if isinstance(value, float) and spec else str(value)


def device_lines() -> List[str]:
    import torch

    from torch_armor.tensor import policy

    try:
        import triton  # noqa: F401  local: optional, only reported

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed (ARMOR's wrappers fall back to batched matmuls)"
    lines = [f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
             f"triton {triton_version}"]
    if torch.cuda.is_available():
        info = policy.device_info("cuda")
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip() or "?"
        lines.append(f"device: {torch.cuda.get_device_name()} (sm{info.capability[0]}{info.capability[1]}), driver "
                     f"{driver}, 2:4 backends: {', '.join(sorted(info.backends)) or 'none'}, cuSPARSELt "
                     f"{torch.backends.cusparselt.version() if 'cusparselt' in info.backends else '-'}")
    else:
        lines.append("device: none (dry run on CPU: no number below means anything)")
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


def run_tests(report: Report, out: Path, tests: Sequence[str], timeout: Optional[float]) -> int:
    """The tests as a PASS/FAIL list; returns how many failed."""
    junit = out / "cuda_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *tests]
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        (out / "cuda_tests.log").write_text(proc.stdout + proc.stderr)
        results = test_results(junit) if junit.exists() else \
            [("pytest", "FAIL", ((proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1][:120])]
    except subprocess.TimeoutExpired:
        results = [("pytest", "FAIL", f"did not finish in {timeout:.0f} s")]
    counts = {s: sum(r[1] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    report.lines(["", f"## CUDA tests: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped", ""])
    report.lines(f"- {status} {name}" + (f" — {why}" if why else "") for name, status, why in results)
    with report.rows.open("a") as f:
        f.writelines(json.dumps({"step": "tests", "test": n, "status": s, "why": w}) + "\n" for n, s, w in results)
    return counts["FAIL"]


def prune_subprocess(dry: bool, timeout: float) -> Iterable[dict]:
    """:func:`gpu_quick.prune_rows` in its own process (its memory freed after; stopped at ``timeout``)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_quick.py"), "prune"] + (["--dry-run"] if dry else [])
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"what": "one 8B-shaped decoder block, ArmorConfig()", "note": f"not finished in {timeout:.0f} s"}]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not rows:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
        rows.append({"what": "one 8B-shaped decoder block, ArmorConfig()", "note": f"failed: {tail}"})
    return rows


def quick(args, report: Report, started: float) -> int:
    import gpu_quick

    budget = args.budget_s
    estimate = sum(QUICK_ESTIMATE_S.values())
    shapes, tokens = gpu_quick.SHAPES_8B, gpu_quick.TOKENS
    report.lines([
        "", f"## Plan (estimate {estimate / 60:.1f} min on one H100, within a {budget:.0f} s budget; "
            "step times are guesses until a GPU run replaces them)", "",
        f"- tests: {' '.join(args.tests or CUDA_TESTS)} (~{QUICK_ESTIMATE_S['tests']} s)",
        f"- layers: {len(shapes)} shapes ({', '.join(shapes)}) x {len(tokens)} token counts ({', '.join(map(str, tokens))}) "
        f"x {len(gpu_quick.LAYER_VARIANTS)} variants ({', '.join(gpu_quick.LAYER_VARIANTS)}), and "
        f"{', '.join(gpu_quick.EIGHT_BIT_VARIANTS)} at {' and '.join(map(str, gpu_quick.EIGHT_BIT_TOKENS))} tokens = "
        f"{len(shapes) * (len(tokens) * len(gpu_quick.LAYER_VARIANTS) + 4)} rows (~{QUICK_ESTIMATE_S['layers']} s)",
        f"- model: Llama-3-8B-shaped, {args.layers} decoder layers, dense / 2:4 / ARMOR d_b={args.block_size} x "
        f"(prefill 2048, decode 128 eager and CUDA graph at batch 1 and 16) = 15 rows (~{QUICK_ESTIMATE_S['model']} s)",
        f"- prune: one 8B-shaped decoder block with ArmorConfig(), projected to 8B and 70B = 3 rows "
        f"(~{QUICK_ESTIMATE_S['prune']} s)",
    ])

    def left() -> float:
        return budget - (time.perf_counter() - started)

    def step(name: str, title: str, cols, rows: Callable[[], Iterable[dict]]) -> List[dict]:
        report.lines(["", f"## {title}"])
        if left() < QUICK_ESTIMATE_S[name] / 2:
            return report.table(name, cols, [{cols[0][1]: name, "note": f"skipped: {left():.0f} s of the budget left"}])
        return report.table(name, cols, rows())

    failed = run_tests(report, args.out, args.tests or CUDA_TESTS, timeout=None if args.dry_run else max(30.0, left() - 180))
    layers = step("layers", "Llama-3-8B layer shapes, F.linear, bf16, eager", LAYER_COLS,
                  lambda: gpu_quick.layer_rows(args.dry_run, args.block_size))
    model = step("model", f"8B-shaped model, {args.layers} decoder layers", MODEL_COLS,
                 lambda: gpu_quick.model_rows(args.dry_run, args.layers, args.block_size))
    step("prune", "GPU prune", PRUNE_COLS, lambda: prune_subprocess(args.dry_run, max(10.0, left())))
    report.lines(["", "## Targets", ""] + [f"- {line}" for line in gpu_quick.targets(layers, model)])
    bad = sum(str(r.get("check", "")).startswith("FAIL") for r in layers + model)
    return failed + bad


def full(args, report: Report) -> int:
    failed = run_tests(report, args.out, args.tests or CUDA_TESTS, timeout=None)
    bench_args = shlex.split(args.bench_args) if args.bench_args is not None else (DRY_BENCH if args.dry_run else [])
    json_path = args.out / "inference_gpu.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "inference_gpu.py"), *bench_args, "--json", str(json_path)]
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    text = proc.stdout + (f"\n(exit {proc.returncode}) {proc.stderr.strip()[-2000:]}" if proc.returncode else "")
    (args.out / "inference_gpu.md").write_text(text)
    data = json.loads(json_path.read_text()) if json_path.exists() else None
    report.lines(["", "## Inference benchmark", "", text.strip()])
    return failed + (data.get("failed_checks", 1) if data else 1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check"), help="directory for the results (default gpu_check)")
    p.add_argument("--quick", action="store_true", help="the 8B-shaped rows within --budget-s (default: full)")
    p.add_argument("--dry-run", action="store_true", help="on a CPU: run the steps at tiny sizes, to check this script")
    p.add_argument("--tests", nargs="+", default=None, help=f"pytest targets (default: {' '.join(CUDA_TESTS)})")
    p.add_argument("--bench-args", default=None, help="full mode: arguments for benchmarks/inference_gpu.py")
    p.add_argument("--budget-s", type=float, default=300.0, help="quick mode: seconds for everything (default 300)")
    p.add_argument("--layers", type=int, default=2, help="quick mode: decoder layers of the 8B-shaped model (default 2)")
    p.add_argument("--block-size", type=int, default=16, help="ARMOR's d_b in the benchmark rows (default 16, the library's)")
    args = p.parse_args(argv)
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # torch_armor from this checkout; gpu_quick
    import torch

    if not (args.dry_run or torch.cuda.is_available()):
        print(NO_CUDA, file=sys.stderr)
        return 2
    report = Report(args.out)
    command = "python benchmarks/gpu_check.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    report.lines(["# torch_armor GPU check", "", f"command: `{command.strip()}`", "", *device_lines()])
    bad = quick(args, report, started) if args.quick else full(args, report)
    verdict = "ok" if bad == 0 else "FAILED"
    report.lines(["", f"result: {verdict} ({bad} failed test(s) or benchmark row(s) off their dense reference or missing)",
                  f"wall time: {time.perf_counter() - started:.0f} s"])
    print(f"written: {args.out / 'summary.md'}, {args.out / 'rows.jsonl'}")
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
