"""Quiet by default: what reaches stderr is what the user asked for (one line per stage when it is
not a terminal), whatever the import order."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import torch_armor.progress as progress_module
from _tiny_dir import save_tiny_model
from torch_armor._quiet import known_import_noise_dropped
from torch_armor.cli.parser import main
from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.sparsifier import ArmorSparsifier

ROOT = Path(__file__).resolve().parents[1]
NOISE = re.compile(r"torchao|_pytree|register_constant|Failed to load")


def _python(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=600, **kwargs)


def _lines(text: str) -> list:
    """Lines as a log file shows them, a carriage-return refresh counted as a line of its own."""
    return [line for line in re.split(r"[\r\n]", text) if line.strip()]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_known_noise_is_dropped_only_inside_the_scope_and_errors_pass_through():
    heard = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    torchao_log = logging.getLogger("torchao")
    filters = list(torchao_log.filters)
    torchao_log.addHandler(handler)
    try:
        with pytest.raises(RuntimeError, match="inside"):
            with known_import_noise_dropped():
                torchao_log.warning("Failed to load torchao/_C_mxfp8.so: no CUDA")
                torchao_log.warning("something else")
                raise RuntimeError("inside")
        torchao_log.warning("Failed to load torchao/_C_mxfp8.so: no CUDA")
    finally:
        torchao_log.removeHandler(handler)
    assert heard == ["something else", "Failed to load torchao/_C_mxfp8.so: no CUDA"]
    assert torchao_log.filters == filters


def test_import_loads_everything_quietly():
    proc = _python("-c", "import sys, torch_armor; from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING; "
                         "print('armor' in AUTO_QUANTIZER_MAPPING, 'torchao' in sys.modules)")
    assert proc.stdout.split() == ["True", "True"] and not NOISE.search(proc.stderr), proc.stderr


@pytest.mark.parametrize("first", ["import transformers", "from transformers import AutoModelForCausalLM",
                                   "import torch"])
def test_import_orders_print_nothing(first):
    # transformers imported first, then torch_armor, then a model class: transformers' import of
    # torchao happens inside torch_armor's import, so its warnings are filtered
    proc = _python("-c", f"{first}; import torch_armor; from transformers import LlamaForCausalLM; import torchao")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_piped_cli_prune_prints_few_lines(tmp_path, tiny_dir):
    proc = _python("-m", "torch_armor", "prune", str(tiny_dir), "--out", str(tmp_path / "out"),
                   "--calib", str(tiny_dir.parent / "text.txt"), "--n-calib", "4", "--seq-len", "32",
                   "--iters", "2", "--reconstruct-steps", "1")
    lines = _lines(proc.stderr)
    assert proc.returncode == 0, proc.stderr
    assert len(lines) <= 10 and not [line for line in lines if NOISE.search(line)], lines


def test_piped_tutorial_prints_few_lines():
    proc = _python(str(ROOT / "tutorials" / "02_finetune_wrappers.py"), "--steps", "2")
    lines = _lines(proc.stderr)
    assert proc.returncode == 0, proc.stderr
    assert len(lines) <= 10 and not [line for line in lines if NOISE.search(line)], lines


def test_offline_hub_id_fails_in_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    code = main(["eval", "nobody-here/no-such-model", "--no-progress", "--threads", "1"])  # no "machine is busy" line
    err = capsys.readouterr().err
    assert code == 2 and len(_lines(err)) == 1 and "cannot be reached" in err, err


def test_sparsifier_bar_is_one_line_per_stage_in_a_log(capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    sparsifier = ArmorSparsifier(ArmorConfig(block_size=8, optimizer=BcdConfig(iters=1)), progress=True)
    sparsifier.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
    model(torch.randn(64, 32))
    sparsifier.convert(model)
    err = capsys.readouterr().err  # captured: not a terminal
    assert "\r" not in err
    assert [line for line in err.splitlines() if line.startswith("ArmorSparsifier")] == [
        line for line in err.splitlines() if re.fullmatch(r"ArmorSparsifier: 2/2 layer in [\d.]+ s", line)]
    assert len(err.splitlines()) == 1, err


def test_long_stage_prints_a_line_every_interval(monkeypatch):
    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0.0)  # every step is "after the interval"
    stream = io.StringIO()
    for _ in progress_module.tqdm(range(3), desc="stage", unit="block", file=stream):
        pass
    lines = stream.getvalue().splitlines()
    assert [re.sub(r"[\d.]+ s( left)?$", r"T\1", re.sub(r"[\d.]+ s, about", "T, about", line)) for line in lines] == [
        "stage: 1/3 block, T, about T left", "stage: 2/3 block, T, about T left", "stage: 3/3 block in T"]


def test_the_time_left_is_the_rest_at_the_pace_so_far(monkeypatch):
    """A resumed stage (initial=2 of 12) that took 40 s per block: 9 blocks left after the first are 6 min."""
    clock = iter(range(0, 10_000, 40))
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0.0)
    stream = io.StringIO()
    bar = progress_module.tqdm(total=12, initial=2, desc="stage", unit="block", file=stream)
    bar.update(1)
    assert stream.getvalue().splitlines()[0] == "stage: 3/12 block, 40 s, about 6 min left"
    bar.update(8)
    assert stream.getvalue().splitlines()[1] == "stage: 11/12 block, 80 s, about 9 s left"


def test_a_stage_left_early_says_where_it_stopped():
    stream = io.StringIO()
    for index in progress_module.tqdm(range(5), desc="stage", unit="block", file=stream):
        if index == 2:
            break
    stream_text = stream.getvalue()
    assert re.fullmatch(r"stage: stopped at 2/5 block after [\d.]+ s\n", stream_text), stream_text


@pytest.fixture
def bars_on():
    """transformers' bars on (as in a fresh interactive session), the previous state restored after."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    yield hf_logging
    (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()


def test_library_loads_draw_no_transformers_bar_and_leave_its_state(capsys, tiny_dir, bars_on):
    """The library's own from_pretrained calls hide "Loading weights" for the call only: a user's
    own load afterwards still shows transformers' bar (no process-wide side effect)."""
    from transformers import AutoModelForCausalLM

    from torch_armor.recipes.models import load_model

    capsys.readouterr()
    load_model(str(tiny_dir))
    assert "Loading weights" not in capsys.readouterr().err
    assert bars_on.is_progress_bar_enabled()
    AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    assert "Loading weights" in capsys.readouterr().err  # the check above can see the bar


@pytest.mark.parametrize("before", [True, False])
def test_bars_off_restores_either_state(before):
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    was, hub_was = hf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled()
    try:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()
        with progress_module.third_party_bars_off():
            assert not hf_logging.is_progress_bar_enabled() and hub_utils.are_progress_bars_disabled()
        assert hf_logging.is_progress_bar_enabled() is before and hub_utils.are_progress_bars_disabled() is not before
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
        (hub_utils.disable_progress_bars if hub_was else hub_utils.enable_progress_bars)()


def test_every_stage_of_an_in_memory_prune_reports_in_a_log(capsys, monkeypatch, tiny_llama, one_thread):
    """Not a terminal (captured): sampling, the dense teacher, the block pass (its reconstruction named
    as it starts) and distillation each report; with the interval at 0 s, every status is a line, as
    a stage longer than LOG_EVERY_S does on a real model."""
    from torch_armor import PruneOptions, prune_model
    from torch_armor.config.armor import DistillConfig, ReconstructConfig

    monkeypatch.setattr(progress_module, "LOG_EVERY_S", 0.0)
    config = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1), reconstruct=ReconstructConfig(steps=2),
                         distill=DistillConfig(steps=2, eval_every=1, sampled_windows=2, sample_prompt_tokens=4))
    capsys.readouterr()
    prune_model(tiny_llama, torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0)), config,
                options=PruneOptions(progress=True, batch_size=4))
    lines = capsys.readouterr().err.splitlines()
    for stage in (r"distillation: sampling windows: 2/2 window in [\d.]+ s",
                  r"distillation: dense top-64: \d+/\d+ window in [\d.]+ s",
                  r"prune ARMOR: 0/2 block, \d+ s \(block 0: reconstruction, 2 steps\)",
                  r"prune ARMOR: 2/2 block in [\d.]+ s",
                  r"distillation: 1/2 step, \d+ s, about \d+ (s|min) left \(held-out KL [\d.]+\)",
                  r"distillation: 2/2 step in [\d.]+ s"):
        assert any(re.fullmatch(stage, line) for line in lines), (stage, lines)
    assert any(re.fullmatch(r"distillation: sampling windows: 0/2 window, \d+ s \(token \d+/16\)", line)
               for line in lines), lines
