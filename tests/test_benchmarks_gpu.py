"""benchmarks/inference_gpu.py without a GPU: the CPU dry run's tables, the no-CUDA exit, refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
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
    assert header == ["shape", "tokens", "variant", "mode", "median ms", "x dense", "x 2:4", "note"]
    assert len(rows) == 1 * 2 * 5 * 2  # shape 64x128, tokens 1 and 16, dense/2:4/3 d_b, eager/compiled
    assert not any("refused" in r or "failed" in r for r in rows), rows
    header, rows = tables["whole model"]
    assert header[:4] == ["variant", "workload", "median ms", "tokens/s"] and "peak MB" in header
    assert len(rows) == 3 * 3  # dense/2:4/armor x prefill 16, prefill 32, decode 4
    header, rows = tables["FLOPs per token (meta device; tokens cancel)"]
    assert "wrapper %" in header and len(rows) == 3 and all(r.rstrip(" |").endswith("ok") for r in rows)
    assert len(saved["layers"]) == 20 and len(saved["model"]) == 9 and len(saved["flops"]) == 3
    assert all(isinstance(r["ms"], float) and r["ms"] > 0 for r in saved["layers"] + saved["model"])
    dense = [r for r in saved["layers"] if r["variant"] == "dense"]
    assert all(r["x_dense"] == 1.0 for r in dense)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without CUDA")
def test_cuda_without_gpu_exits_2():
    proc = _run("--device", "cuda", timeout=30)
    assert proc.returncode == 2
    assert proc.stderr.strip() == NO_CUDA and proc.stdout == ""


def test_refused_kernel_is_reported(monkeypatch):
    """A 2:4 kernel that refuses the shape gives a note, never a time (CUDA path, faked here)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import inference_gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def refuse(core, backend=None):
        warnings.warn("cusparselt semi-structured kernels cannot take a core of shape (8, 8); keeps dense")
        return core

    monkeypatch.setattr(inference_gpu, "to_semi_structured", refuse)
    w, note = inference_gpu.sparse_weight(torch.zeros(8, 8), semi=True)
    assert w is None and note == "refused: cusparselt semi-structured kernels cannot take a core of shape (8, 8)"
    assert inference_gpu.refusal(RuntimeError("bad shape\nmore"), "compiled") == "compile failed: bad shape"
