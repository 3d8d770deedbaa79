"""ArmorFactors: the one serialized form (to_tensors / metadata / from_tensors)."""

import math

import pytest
import torch

from torch_armor import ArmorConfig
from torch_armor.core.factors import ArmorFactors
from torch_armor.config.armor import BcdConfig
from torch_armor.core.factorize import factorize

from _helpers import random_layer


@pytest.fixture(scope="module", params=["proxy", "refined"])
def factors(request):
    w, h = random_layer(32, 48, seed=4, dtype=torch.float32)
    xtx = None
    if request.param == "refined":
        x = torch.randn(200, 48, generator=torch.Generator().manual_seed(5))
        xtx = x.T @ x
        h = xtx.diagonal().clone()
    return factorize(w, h, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=3)), xtx=xtx)


def test_round_trip_is_bit_identical(factors):
    tensors = factors.to_tensors()
    assert list(tensors) == ["a_blocks", "core", "b_blocks", "mask", "history", "history_iters", "history_time_s"]
    meta = factors.metadata()
    assert set(meta) == {"pattern", "nowag_loss", "best_iter", "relative_output_loss"}
    assert (meta["pattern"], meta["nowag_loss"], meta["best_iter"]) == ("2:4", factors.nowag_loss, factors.best_iter)
    assert math.isnan(meta["relative_output_loss"]) != factors.refined
    back = ArmorFactors.from_tensors(tensors, **meta)
    for name, value in tensors.items():
        original = getattr(factors, name)
        assert value.dtype == original.dtype and torch.equal(getattr(back, name), original), name
    assert (back.pattern, back.nowag_loss, back.best_iter) == (factors.pattern, factors.nowag_loss, factors.best_iter)
    assert back.refined == factors.refined and back.relative_loss == factors.relative_loss
    assert torch.equal(back.dense(), factors.dense())


def test_missing_or_unknown_tensor_is_a_clear_error(factors):
    tensors = factors.to_tensors()
    del tensors["mask"]
    with pytest.raises(ValueError, match=r"missing \['mask'\]"):
        ArmorFactors.from_tensors(tensors)
    with pytest.raises(ValueError, match=r"unknown \['extra'\]"):
        ArmorFactors.from_tensors({**factors.to_tensors(), "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"scalars: unknown \['seconds'\]"):
        ArmorFactors.from_tensors(factors.to_tensors(), seconds=1.0)


def test_mismatched_shapes_are_named(factors):
    bad = {**factors.to_tensors(), "core": torch.zeros(32, 32)}
    with pytest.raises(ValueError, match="do not tile the core"):
        ArmorFactors.from_tensors(bad)
    bad = {**factors.to_tensors(), "mask": torch.zeros(32, 48)}
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        ArmorFactors.from_tensors(bad)
    assert factors.history.shape[0] > 1
    bad = {**factors.to_tensors(), "history_iters": torch.zeros(1, dtype=torch.long)}
    with pytest.raises(ValueError, match="1-D of one length"):
        ArmorFactors.from_tensors(bad)
