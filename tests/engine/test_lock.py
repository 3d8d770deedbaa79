"""Run directories are owned: two real prune processes on one run directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_llama
from torch_armor.engine.lock import LOCK_NAME, RunDirectoryBusy, run_lock

ROOT = Path(__file__).resolve().parents[2]

_PRUNE = textwrap.dedent("""
    import sys, torch
    torch.set_num_threads(1)
    from torch_armor import ArmorConfig, PruneOptions, prune_model
    from torch_armor.config.armor import BcdConfig
    model, run_dir, out = sys.argv[1:4]
    calib = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    prune_model(model, calib, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2)),
                options=PruneOptions(run_dir=run_dir, out=out, progress=False))
""")


def _start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", _PRUNE, *map(str, args)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _logits(directory: Path) -> torch.Tensor:
    from torch_armor import load_pretrained

    model = load_pretrained(directory)
    with torch.no_grad():
        return model(torch.arange(12)[None] % 128).logits


def _wait_for_holder(proc: subprocess.Popen, lock: Path, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if lock.is_file() and lock.read_text().strip() == str(proc.pid):
            return
        if proc.poll() is not None:
            pytest.fail(f"the first prune ended before taking the lock: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    pytest.fail("the first prune never took the lock")


def test_two_prune_processes_on_one_run_directory(tmp_path):
    model_dir = tmp_path / "model"
    make_tiny_llama().save_pretrained(model_dir)
    run_dir = tmp_path / "run"
    first = _start(model_dir, run_dir, tmp_path / "out-a")
    try:
        _wait_for_holder(first, run_dir / LOCK_NAME)
        os.kill(first.pid, signal.SIGSTOP)  # hold the first one inside its prune, deterministically
        try:
            second = _start(model_dir, run_dir, tmp_path / "out-b")
            _, err = second.communicate(timeout=300)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert second.returncode != 0
        last = err.strip().splitlines()[-1]
        assert f"in use by process {first.pid}" in last and str(run_dir) in last
        assert not (tmp_path / "out-b").exists()
        _, first_err = first.communicate(timeout=600)
        assert first.returncode == 0, first_err[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
    single = _start(model_dir, tmp_path / "run-single", tmp_path / "out-single")
    _, single_err = single.communicate(timeout=600)
    assert single.returncode == 0, single_err[-2000:]
    assert torch.equal(_logits(tmp_path / "out-a"), _logits(tmp_path / "out-single"))


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from torch_armor.engine.lock import run_lock
        with run_lock({str(tmp_path)!r}):
            print("held", flush=True)
            time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryBusy, match=f"process {holder.pid}"):
            with run_lock(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    with run_lock(tmp_path):  # the OS dropped the dead holder's lock
        assert (tmp_path / LOCK_NAME).read_text() == str(os.getpid())


def test_the_lock_is_reentrant_in_one_process(tmp_path):
    with run_lock(tmp_path):
        with run_lock(tmp_path):
            pass
        with run_lock(tmp_path):  # still held after the inner one ends
            pass
    with run_lock(tmp_path):
        pass


# ------------------------------------------------------------------ two prunes into one --out, own run directories
def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _wait_for_line(proc: subprocess.Popen, log: Path, text: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None and time.monotonic() < end, f"no {text!r}: {log.read_text()[-2000:]}"
        time.sleep(0.05)


def _commands(tmp_path: Path) -> dict:
    """Prunes "a" and "b" of one tiny model into one --out, each with its own --run-dir and seed."""
    from _tiny_dir import fast_prune_args, save_tiny_model

    model_dir = save_tiny_model(tmp_path)
    return {name: ["prune", model_dir, "--out", tmp_path / "out", "--run-dir", tmp_path / f"run-{name}", "--seed", seed,
                   *fast_prune_args(tmp_path)] for name, seed in (("a", "0"), ("b", "1"))}


def _finish(*procs: subprocess.Popen) -> list:
    try:
        return [proc.wait(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def test_of_two_prunes_into_one_out_at_once_the_second_to_finish_keeps_its_model_in_its_run_directory(tmp_path):
    from _processes import start_cli, wait_stopped

    commands = _commands(tmp_path)
    out = tmp_path / "out"
    # "at once", whatever the machine's load: A stops holding --out's lock before writing, B prunes and
    # waits for that lock, then A goes on; B finishes second
    procs = {"a": start_cli(commands["a"], tmp_path / "a.log", stop_at="save")}
    try:
        wait_stopped(procs["a"], tmp_path / "a.log")
        procs["b"] = start_cli(commands["b"], tmp_path / "b.log")
        _wait_for_line(procs["b"], tmp_path / "b.log", f"waiting for --out {out}: another process is writing it")
        os.kill(procs["a"].pid, signal.SIGCONT)
    except BaseException:
        for proc in procs.values():
            proc.kill()
        raise
    codes = dict(zip(procs, _finish(*procs.values())))
    assert codes == {"a": 0, "b": 2}, {name: (tmp_path / f"{name}.log").read_text()[-1000:] for name in procs}
    loser = "b"
    kept = tmp_path / f"run-{loser}" / "pruned"
    last = (tmp_path / f"{loser}.log").read_text().strip().splitlines()[-1]
    assert last.startswith(f"torch-armor prune: error: --out {out}: another process wrote ") and \
        f"its pruned model is saved in {kept} instead" in last, last
    from torch_armor import load_pretrained

    ids = torch.arange(12)[None] % 20
    with torch.no_grad():  # the winner's model in --out, the loser's (another seed) whole in its run directory
        assert not torch.equal(load_pretrained(kept)(ids).logits, load_pretrained(out)(ids).logits)


def test_a_killed_writer_leaves_out_to_the_next_and_its_rerun_does_not_replace_that(tmp_path):
    from _processes import start_cli, wait_stopped

    commands = _commands(tmp_path)
    out = tmp_path / "out"
    a = start_cli(commands["a"], tmp_path / "a.log", stop_at="save")  # stops holding --out's lock, before writing
    b = None
    try:
        wait_stopped(a, tmp_path / "a.log")
        b = start_cli(commands["b"], tmp_path / "b.log")
        _wait_for_line(b, tmp_path / "b.log", f"waiting for --out {out}: another process is writing it")
        os.kill(a.pid, signal.SIGKILL)  # the lock dies with its holder: B goes on
        assert _finish(b) == [0], (tmp_path / "b.log").read_text()[-2000:]
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    written = _tree(out)
    rerun = start_cli(commands["a"], tmp_path / "rerun.log")  # A's command again: its run directory resumes it
    assert _finish(rerun) == [2]
    assert f"--out {out} is not empty; pass --overwrite" in (tmp_path / "rerun.log").read_text()
    assert _tree(out) == written  # B's finished model is not replaced by A's resumed one
