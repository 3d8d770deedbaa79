"""Issue #14: an interrupted save never leaves a directory that loads as a valid but partial (or
mixed old/new) model: ``armor_config.json`` is removed first and written last."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from torch import nn

import torch_armor.format.serialization as ser


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))


@pytest.mark.parametrize("stage", ["_move", "file_sha256", "_write_hf_config_or_config"])
@pytest.mark.parametrize("over_existing", [False, True])
def test_interrupted_save_never_loads(tmp_path, monkeypatch, stage, over_existing):
    target = tmp_path / "ckpt"
    if over_existing:
        ser.save_pretrained(_model(0), target)
        assert ser.load_pretrained(target, _model(9))  # a valid checkpoint before
    name = "atomic_write" if stage == "_write_hf_config_or_config" else stage
    real = getattr(ser, name)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[0]))

    monkeypatch.setattr(ser, name, disk_full)
    with pytest.raises(OSError):
        ser.save_pretrained(_model(1), target)
    monkeypatch.setattr(ser, name, real)
    try:
        before = ser.load_pretrained(target, _model(9))
    except ValueError as err:
        assert "armor_config.json" in str(err) or "not a directory written" in str(err)
    else:  # the fault came before the directory was touched: the old model, whole
        assert over_existing
        _assert_same(before, _model(0))
    ser.save_pretrained(_model(1), target)  # the retry succeeds and loads the new model exactly
    _assert_same(ser.load_pretrained(target, _model(9)), _model(1))


def _assert_same(loaded, reference):
    for (k, a), (_, b) in zip(loaded.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), k


def test_an_overwrite_killed_after_its_first_new_shard_leaves_a_directory_that_refuses_to_load(tmp_path):
    """``prune --overwrite`` over a finished sharded OUT, SIGKILLed right after the first new shard is moved in:
    OUT then holds shards of two runs, and both loaders refuse it naming the cause; the same command finishes it."""
    from transformers import AutoModelForCausalLM

    from _processes import start_cli, wait_stopped
    from _tiny_dir import fast_prune_args, save_tiny_model
    from torch_armor.cli.parser import main
    from torch_armor.errors import ArmorInputError

    model_dir = save_tiny_model(tmp_path)
    out = tmp_path / "out"
    first = ["prune", str(model_dir), "--out", str(out), *fast_prune_args(tmp_path)]
    again = first + ["--overwrite", "--seed", "1"]  # other calibration windows: other weights
    threads = torch.get_num_threads()
    try:
        assert main(first) == 0
        shards = sorted(out.glob("model-*.safetensors"))
        before = [p.read_bytes() for p in shards]
        proc = start_cli(again, tmp_path / "again.log", stop_at="first-shard-moved")
        try:
            wait_stopped(proc, tmp_path / "again.log")
        finally:
            proc.kill()
            proc.wait()
        after = [p.read_bytes() for p in shards]
        assert len(shards) == 3 and after[0] != before[0] and after[1:] == before[1:]  # two runs side by side
        for load in (ser.load_pretrained, AutoModelForCausalLM.from_pretrained):
            with pytest.raises(ArmorInputError, match=rf"config.json \(quantization_config\): the directory is "
                                                      rf"half-written: a save replacing its weights files \(process "
                                                      rf"{proc.pid}\) did not finish"):
                load(out)
        assert main(again) == 0  # the same command: resumed, the directory finished
        fresh = tmp_path / "fresh"
        assert main([*again[:3], str(fresh), *again[4:]]) == 0
    finally:
        torch.set_num_threads(threads)
    for name in ("model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors", "config.json"):
        assert (out / name).read_bytes() == (fresh / name).read_bytes(), name
    ids = torch.arange(12)[None] % 20
    with torch.no_grad():
        assert torch.equal(ser.load_pretrained(out)(ids).logits, ser.load_pretrained(fresh)(ids).logits)
