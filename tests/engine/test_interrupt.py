"""Signals and late failures: one line, a distinct exit status, and a state the same command resumes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _helpers import assert_same_saved_model  # the same check as the CLI's resume test
from torch_armor.cli.parser import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_and_text(tmp_path_factory, smollm2_tokenizer):
    """A 6-block random Llama with SmolLM2's vocabulary (plain HF directory) and a calibration text."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny6")
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(smollm2_tokenizer), max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(folder / "model"))
    smollm2_tokenizer.save_pretrained(str(folder / "model"))
    text = folder / "calib.txt"
    text.write_text(" ".join(f"Line {i} about the weather, the harvest and the budget." for i in range(300)))
    return folder / "model", text


def _args(model, text, out, *extra) -> list:
    """Streamed (the tiny checkpoint would load whole): the interruptions below hit the block pass and the
    shard assembly of a model too large for memory."""
    return ["prune", str(model), "--calib", str(text), "--n-calib", "2", "--seq-len", "32", "--block-size", "16",
            "--iters", "6", "--threads", "1", "--no-progress", "--stream", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def reference(model_and_text, tmp_path_factory):
    """The same prune, uninterrupted."""
    model, text = model_and_text
    out = tmp_path_factory.mktemp("reference") / "out"
    assert main(_args(model, text, out)) == 0
    return out


def _default_sigint() -> None:
    """A background shell starts jobs with SIGINT ignored (and Python keeps it so): undo that for the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _hidden_block(run_dir: Path) -> int:
    from safetensors import safe_open

    try:
        with safe_open(str(run_dir / "hidden.safetensors"), framework="pt") as fh:
            return int((fh.metadata() or {}).get("block", 0))
    except Exception:  # noqa: BLE001 - not written yet / being replaced
        return 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_prune_says_where_and_the_same_command_resumes(tmp_path, model_and_text, reference, sig):
    model, text = model_and_text
    out = tmp_path / "out"
    argv = _args(model, text, out)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torch_armor", *argv], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    try:
        end = time.monotonic() + 300
        while _hidden_block(out / "armor_run") < 1:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            assert time.monotonic() < end, "no block finished in time"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGSTOP)  # deliver the signal at a known point: inside the block loop
        os.kill(proc.pid, sig)
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err
    assert re.fullmatch(r"torch-armor prune: interrupted after block [1-5] of 6; rerun the same command to resume "
                        rf"from {re.escape(str(out / 'armor_run'))}", lines[-1]), lines[-1]
    done = int(re.search(r"after block (\d)", lines[-1]).group(1))
    assert done == _hidden_block(out / "armor_run")  # the message counts what is on disk

    assert main(argv) == 0  # the same command, no --overwrite: resumes
    assert_same_saved_model(out, reference)


LATE_STEPS = {
    "assembly": "torch_armor.engine.sources.assemble_checkpoint",
    "tokenizer": "transformers.PreTrainedTokenizerBase.save_pretrained",
    "report": "torch_armor.engine.report.PruneReport.save_json",
    "plot": "torch_armor.engine.report.PruneReport.save_plot",
}


@pytest.mark.parametrize("step,overwrite", [(step, False) for step in sorted(LATE_STEPS)] + [("plot", True)])
def test_a_failure_after_the_last_block_is_resumed(tmp_path, monkeypatch, capsys, model_and_text, reference, step,
                                                   overwrite):
    model, text = model_and_text
    out = tmp_path / "out"

    def fail(*a, **k):
        raise OSError(28, "No space left on device", str(out / step))

    with monkeypatch.context() as m:
        m.setattr(LATE_STEPS[step], fail)
        assert main(_args(model, text, out)) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert main(_args(model, text, out, *(["--overwrite"] if overwrite else []))) == 0, capsys.readouterr().err
    assert "42 of 42 layers already finished" in capsys.readouterr().err  # nothing recomputed
    assert not (out / "armor_run").exists()
    assert_same_saved_model(out, reference)
    from torch_armor import load_pretrained

    load_pretrained(out)  # complete and consistent
