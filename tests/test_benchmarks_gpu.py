"""benchmarks/inference_gpu.py without a GPU: the CPU dry run's tables, the no-CUDA exit, refusals."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "inference_gpu.py"
NO_CUDA = "no CUDA device: run this on an NVIDIA GPU (sm80+; Hopper uses cuSPARSELt)"


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _tables(out: str) -> dict:
    """``{title: (header cells, data rows)}`` of the markdown tables in ``out``."""
    tables = {}
    for section in out.split("\n### ")[1:]:
        title, _, body = section.partition("\n")
        lines = [line for line in body.splitlines() if line.startswith("|")]
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        assert set(lines[1]) <= set("|-")
        tables[title.split(":")[0]] = (header, lines[2:])
    return tables


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "out.json"
    proc = _run("--dry-run", "--json", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(path.read_text())


def test_dry_run_tables(dry_run):
    out, saved = dry_run
    assert out.startswith("reproduce: `python benchmarks/inference_gpu.py --dry-run --json ")
    assert f"torch {torch.__version__}" in out and "device: CPU (dry run" in out
    tables = _tables(out)
    assert set(tables) == {"per layer", "whole model", "FLOPs per token (meta device; tokens cancel)"}
    header, rows = tables["per layer"]
    assert header == ["shape", "tokens", "variant", "mode", "flushed ms", "b2b ms", "x dense", "x 2:4", "check", "note"]
    assert len(rows) == 1 * 2 * 5 * 2  # shape 64x128, tokens 1 and 16, dense/2:4/3 d_b, eager/compiled
    assert not any("refused" in r or "failed" in r for r in rows), rows
    assert all("| ok " in r for r in rows)  # every row agrees with the dense product of its weights
    assert sum("armor d_b=16 |" in r for r in rows) == 4  # the library's default block size is a row
    header, rows = tables["whole model"]
    assert header[:4] == ["variant", "workload", "median ms", "tokens/s"] and "peak MB" in header
    assert "check" in header
    assert len(rows) == 3 * 3  # dense/2:4/armor x prefill 16, prefill 32, decode 4
    assert sum(r.startswith("| armor d_b=16 |") for r in rows) == 3
    header, rows = tables["FLOPs per token (meta device; tokens cancel)"]
    assert "wrapper %" in header and len(rows) == 3 and all(r.rstrip(" |").endswith("ok") for r in rows)
    assert len(saved["layers"]) == 20 and len(saved["model"]) == 9 and len(saved["flops"]) == 3
    assert all(isinstance(r["ms"], float) and r["ms"] > 0 for r in saved["layers"] + saved["model"])
    assert all(isinstance(r["b2b_ms"], float) and r["b2b_ms"] > 0 for r in saved["layers"])
    assert saved["failed_checks"] == 0 and all(r["error"] < 1e-5 for r in saved["layers"])
    dense = [r for r in saved["layers"] if r["variant"] == "dense"]
    assert all(r["x_dense"] == 1.0 for r in dense)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_cuda_without_gpu_exits_2():
    proc = _run("--device", "cuda", timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == NO_CUDA and proc.stdout == ""


def _bench_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import inference_gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return inference_gpu


def test_refused_kernel_is_reported(monkeypatch):
    """A 2:4 kernel that refuses the shape gives a note, never a time (CUDA path, policy faked here)."""
    inference_gpu = _bench_module()
    hopper_without_cusparselt = inference_gpu.policy.DeviceInfo("cuda", (9, 0), frozenset({"cutlass"}))
    monkeypatch.setattr(inference_gpu.policy, "device_info", lambda device: hopper_without_cusparselt)
    w, note = inference_gpu.sparse_weight(torch.zeros(64, 64, dtype=torch.bfloat16), semi=True)
    assert w is None and note.startswith("refused: ") and "sm8x only" in note
    assert inference_gpu.refusal(RuntimeError("bad shape\nmore"), "compiled") == "compile failed: bad shape"


def test_a_failing_row_is_reported_and_the_others_go_on(monkeypatch):
    inference_gpu = _bench_module()
    real = inference_gpu.armor_weight

    def broken(d_out, d_in, d_b, *args):
        if d_b == 32:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(d_out, d_in, d_b, *args)

    monkeypatch.setattr(inference_gpu, "armor_weight", broken)
    args = inference_gpu.parse_args(["--dry-run", "--no-compile", "--tokens", "4"])
    rows = inference_gpu.bench_layers(args, inference_gpu.Clock(False), "cpu", torch.float32, semi=False)
    by_variant = {r["variant"]: r for r in rows}
    assert by_variant["armor d_b=32"]["ms"] is None and "illegal memory access" in by_variant["armor d_b=32"]["note"]
    assert all(isinstance(by_variant[v]["ms"], float) for v in ("dense", "2:4", "armor d_b=16", "armor d_b=64"))


CHECK = ROOT / "benchmarks" / "gpu_check.py"


def _check(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(CHECK), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_gpu_check_without_gpu_exits_2():
    proc = _check(timeout=60)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


def test_gpu_check_lists_every_test_and_fails_on_a_failing_one(tmp_path):
    tests = tmp_path / "test_probe.py"
    tests.write_text("def test_fine():\n    pass\n\ndef test_broken():\n    assert 1 == 2, 'kernel off'\n")
    proc = _check("--dry-run", "--out", str(tmp_path / "out"), "--tests", str(tests), "--bench-args=--flops-only")
    assert proc.returncode == 1, proc.stderr
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "## CUDA tests: 1 passed, 1 failed, 0 skipped" in summary
    assert "- PASS " in summary and "test_fine" in summary and "- FAIL " in summary and "kernel off" in summary
    assert "FLOPs per token" in summary and "result: FAILED (" in summary
    assert (tmp_path / "out" / "inference_gpu.json").is_file() and (tmp_path / "out" / "cuda_tests.xml").is_file()


def test_gpu_check_quick_prints_its_plan_and_estimate_first_and_keeps_to_its_budget(tmp_path):
    """``--quick --dry-run``: the plan (every step, its rows) and an estimate of at most 5 minutes come
    before anything runs; with no budget left each measuring step is a row saying it was skipped."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("def test_fine():\n    pass\n")
    proc = _check("--quick", "--dry-run", "--budget-s", "0", "--out", str(tmp_path / "out"), "--tests", str(probe))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    plan = re.search(r"## Plan \(estimate ([0-9.]+) min on one H100", out)
    assert plan and float(plan.group(1)) <= 5.0
    assert out.index("## Plan") < out.index("## CUDA tests: 1 passed")
    assert "= 60 rows" in out and "= 15 rows" in out and "= 3 rows" in out
    rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == ["tests", "layers", "model", "prune"]
    assert all("skipped" in r["note"] for r in rows[1:])


def test_report_writes_each_row_before_the_next_is_measured(tmp_path):
    """A command cut off by a time limit keeps every finished row: the summary and rows.jsonl hold row k
    while row k+1 is being measured."""
    gpu_check = _import_benchmark("gpu_check")
    report = gpu_check.Report(tmp_path)

    def rows():
        for k in range(3):
            if k:
                assert f"| row{k - 1} |" in report.summary.read_text()
                assert len(report.rows.read_text().splitlines()) == k
            yield {"what": f"row{k}", "seconds": float(k)}

    assert len(report.table("prune", gpu_check.PRUNE_COLS, rows())) == 3


def test_quick_rows_on_cpu():
    """The quick steps' own code at tiny sizes on CPU (no number means anything): every variant a row,
    each checked against the dense product of its weights; CUDA-graph rows say why they did not run."""
    gpu_quick = _import_benchmark("gpu_quick")
    layers = list(gpu_quick.layer_rows(dry=True, block_size=16, repeats=1))
    variants = gpu_quick.LAYER_VARIANTS + gpu_quick.EIGHT_BIT_VARIANTS
    assert len(layers) == 2 * 2 * len(variants) and [r["variant"] for r in layers[:len(variants)]] == variants
    assert all(r["check"].startswith("ok") for r in layers), layers
    for row in layers:  # each 8-bit row against the same 8 bits dense, measured in the same step
        fmt = next((f for f in ("int8", "fp8") if f in row["variant"].split()), None)
        assert (row.get("x_8bit_dense") is not None) == (fmt is not None), row
        if row["variant"] == f"{fmt} dense":
            assert row["x_8bit_dense"] == 1.0
    model = list(gpu_quick.model_rows(dry=True, layers=1, block_size=16))
    assert len(model) == 15 and all(("ms" in r) != ("graph" in r["workload"]) for r in model), model
    assert all(r["check"].startswith("ok") for r in model if r["variant"] != "dense")


def _import_benchmark(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
