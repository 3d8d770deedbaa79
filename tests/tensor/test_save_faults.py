"""Issue #14: an interrupted save never leaves a directory that loads as a valid but partial (or
mixed old/new) model: ``armor_config.json`` is removed first and written last."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from torch import nn

import torch_armor.tensor.serialization as ser


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
