"""``torch-armor demo`` respects the user's time: each row is printed and kept on disk as soon as it is
done, and an interrupted demo resumes, skipping the finished rows."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_armor.cli.parser import build_parser
from torch_armor.cli.commands import demo_protocol as _demo_protocol
from torch_armor.recipes.demo_runs import ROWS_JSON, TABLE_MD

ROOT = Path(__file__).resolve().parents[1]


def _demo(run_dir: Path) -> list:
    return [sys.executable, "-m", "torch_armor", "demo", "--methods", "dense", "magnitude", "armor",
            "--layers", "0-1", "--n-calib", "4", "--n-eval", "2", "--seq-len", "64", "--iters", "2", "--refine", "none", "--reconstruct-steps", "0",
            "--threads", "1", "--run-dir", str(run_dir)]


def _rows(run_dir: Path) -> list:
    path = run_dir / ROWS_JSON
    return json.loads(path.read_text())["rows"] if path.is_file() else []


def test_interrupted_demo_resumes_without_redoing_finished_rows(tmp_path, sotu_available, wiki_available,
                                                                smollm2_tokenizer):
    run_dir = tmp_path / "demo"
    proc = subprocess.Popen(_demo(run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    deadline = time.monotonic() + 300
    while len(_rows(run_dir)) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    finished = _rows(run_dir)
    if proc.returncode == 0:
        pytest.skip("the demo finished before it could be interrupted")
    assert proc.returncode == 130, err
    assert f"finished rows are kept in {run_dir}" in err.splitlines()[-1]
    assert 1 <= len(finished) < 3 and [r["method"] for r in finished] == ["dense", "magnitude"][:len(finished)]
    assert out.count("| dense |") == 1  # the row was printed as soon as it was done

    rerun = subprocess.run(_demo(run_dir), capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    for row in finished:  # kept, not recomputed
        assert f"{row['label'] or row['method']}: ppl {row['ppl']:.3f} (kept from an earlier run)" in rerun.stderr
    rows = _rows(run_dir)
    assert [r["method"] for r in rows] == ["dense", "magnitude", "armor"]
    assert rows[:len(finished)] == finished
    assert (run_dir / TABLE_MD).read_text().count("\n") == 2 + 3


@pytest.mark.parametrize("argv, methods, n_eval, run_dir", [
    ([], ["dense", "nowag", "sparsegpt", "armor"], 16, "runs/demo-quick"),
    (["--full"], ["dense", "magnitude", "wanda", "sparsegpt", "nowag", "armor"], 64, "runs/demo-full"),
    (["--full", "--n-eval", "8", "--methods", "armor"], ["armor"], 8, "runs/demo-full"),
])
def test_demo_protocols(argv, methods, n_eval, run_dir):
    args = build_parser().parse_args(["demo", *argv])
    _demo_protocol(args)
    assert (args.methods, args.n_eval, args.run_dir) == (methods, n_eval, run_dir)
