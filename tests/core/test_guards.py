"""Numerical guards of issue #14: rank-deficient and all-zero blocks, huge magnitudes, inputs
that are not plain dense tensors, and the final finite/loss check of every factor set."""

from __future__ import annotations

import pytest
import torch

from tests._helpers import check_mask
from torch_armor import ArmorConfig
from torch_armor.config.armor import BcdConfig
from torch_armor.config.levers import OPTIMIZERS
from torch_armor.core import factorize as factorize_mod
from torch_armor.core.factorize import factorize
from torch_armor.core.proxy import nowag_prune, proxy_loss
from torch_armor.errors import ArmorNumericalError


def _check_against_nowag(weight, h, factors, pattern="2:4"):
    """Independent reference: the loss of ``dense()`` recomputed from scratch, never above NoWag-P's."""
    dense = factors.dense().double()
    assert torch.isfinite(dense).all()
    assert check_mask(factors.mask, pattern)
    _, pruned = nowag_prune(weight.double(), h.double(), pattern)
    ref = float(proxy_loss(weight.double(), pruned, h.double()))
    got = float(proxy_loss(weight.double(), dense, h.double()))
    assert got <= ref * (1 + 1e-4)
    assert factors.relative_loss == pytest.approx(got / ref, rel=1e-3, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("optimizer", ["bcd", "adam"])
def test_zero_statistics_block(dtype, optimizer):
    """A block of 16 input channels never active in calibration (old code: oneMKL error, then an
    INTERNAL ASSERT in torch.linalg.lstsq, in fp32 and fp64)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g, dtype=dtype)
    h = torch.rand(64, generator=g, dtype=dtype) + 0.1
    h[:16] = 0
    f = factorize(w, h, ArmorConfig(block_size=16, dtype=dtype, optimizer=OPTIMIZERS[optimizer](iters=4)), name="layers.0.q_proj")
    _check_against_nowag(w, h, f)


def test_rank_deficient_weight_blocks():
    """All-zero weight tiles and a rank-one remainder: the closed-form solves stay finite."""
    g = torch.Generator().manual_seed(1)
    w = torch.outer(torch.randn(64, generator=g), torch.randn(64, generator=g))
    w[:16] = 0
    w[:, 32:48] = 0
    h = torch.rand(64, generator=g) + 0.1
    f = factorize(w, h, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=4)))
    _check_against_nowag(w, h, f)


@pytest.mark.parametrize("scale", [2.0 ** 63, 2.0 ** -100])
def test_extreme_weight_magnitudes_fp32(scale):
    """Weights near the top (2^63 ≈ 1e19: old code returned non-finite dense() with relative loss
    0.0) or the bottom of fp32's range give the unit-scale layer's factors, scaled."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 64, generator=g)
    h = torch.rand(64, generator=g) + 0.1
    config = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=3))
    ref = factorize(w, h, config)
    f = factorize(w * scale, h, config)
    assert torch.isfinite(f.dense()).all()
    assert f.relative_loss == pytest.approx(ref.relative_loss, rel=1e-5)
    torch.testing.assert_close(f.dense().double() / scale, ref.dense().double(), rtol=1e-5, atol=1e-6)


def test_weight_entries_near_1e19():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 64, generator=g) * 1e19
    h = torch.rand(64, generator=g) + 0.1
    f = factorize(w, h, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=3)))
    assert 0 < f.relative_loss <= 1
    _check_against_nowag(w, h, f)


def test_huge_statistics():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 32, generator=g)
    h = (torch.rand(32, generator=g) + 0.1) * 1e37
    f = factorize(w, h, ArmorConfig(block_size=8, optimizer=BcdConfig(iters=3)))
    _check_against_nowag(w, h / 1e37, f)
    assert f.nowag_loss == pytest.approx(float(proxy_loss(w.double(), nowag_prune(w, h / 1e37)[1].double(),
                                                              h.double() / 1e37)) * 1e37, rel=1e-4)


def test_meta_and_converted_weights_are_refused_with_the_layer_name():
    h = torch.rand(32) + 0.1
    with pytest.raises(ValueError, match=r"layer 'mlp.up'.*meta device"):
        factorize(torch.empty(32, 32, device="meta"), h, ArmorConfig(block_size=8), name="mlp.up")
    from torch_armor.tensor.armor_tensor import ArmorTensor

    f = factorize(torch.randn(32, 32), h, ArmorConfig(block_size=8, optimizer=BcdConfig(iters=1)))
    converted = ArmorTensor.from_factors(f)
    with pytest.raises(ValueError, match=r"layer 'mlp.up'.*ArmorTensor.*already converted"):
        factorize(converted, h, ArmorConfig(block_size=8), name="mlp.up")


def test_non_finite_optimizer_output_is_a_clear_error(monkeypatch):
    """Every returned factor set is checked: a corrupted optimizer result never leaves factorize."""
    real = factorize_mod._run_bcd

    def broken(*args):
        best = real(*args)
        best["a"] = best["a"].clone()
        best["a"][0, 0, 0] = float("nan")
        return best

    monkeypatch.setattr(factorize_mod, "_run_bcd", broken)
    w, h = torch.randn(32, 32), torch.rand(32) + 0.1
    with pytest.raises(ArmorNumericalError, match=r"layer 'x.proj'.*non-finite A"):
        factorize(w, h, ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2)), name="x.proj")


def test_inconsistent_loss_is_a_clear_error(monkeypatch):
    real = factorize_mod._run_bcd

    def broken(*args):
        best = real(*args)
        best["b"] = best["b"] * 3.0  # finite, but not the iterate whose loss was tracked
        return best

    monkeypatch.setattr(factorize_mod, "_run_bcd", broken)
    w, h = torch.randn(32, 32), torch.rand(32) + 0.1
    with pytest.raises(ArmorNumericalError, match=r"layer 'x.proj'.*loss check failed"):
        factorize(w, h, ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2)), name="x.proj")
