"""Moving the core's input outliers into B: the same linear map, the same 2:4 support, less 8-bit error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from _helpers import random_pattern_factors
from conftest import make_converted_tiny_llama

from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import ArmorTensor
from torch_armor.tensor.eight_bit import quantize_core_8bit
from torch_armor.tensor.smoothing import (core_input_amax, fold_core_input_scale, smooth_core_inputs,
                                          smoothing_scale)


def _weight(seed=0, d_out=32, d_in=64, storage="compact", dtype=torch.float32):
    return ArmorTensor.from_factors(random_pattern_factors(d_out, d_in, 16, seed=seed), storage=storage, dtype=dtype,
                                    name="layers.0.mlp.up_proj")


def _support(w: ArmorTensor) -> torch.Tensor:
    return w.core_dense() != 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), log_scale=st.floats(-6.0, 6.0), storage=st.sampled_from(["compact", "dense"]))
def test_fold_keeps_the_linear_map_the_support_and_the_storage(seed, log_scale, storage):
    w = _weight(seed, storage=storage)
    scale = torch.exp(torch.randn(64, generator=torch.Generator().manual_seed(seed)) * log_scale / 3)
    moved = fold_core_input_scale(w, scale)
    assert type(moved) is type(w) and moved.layer_name == w.layer_name
    assert torch.equal(_support(moved), _support(w))
    # independent reference in float64: A · core · B with the scale applied explicitly to both sides
    a = torch.block_diag(*w.a_blocks.double())
    b = torch.block_diag(*w.b_blocks.double())
    ref = a @ w.core_dense().double() @ b
    assert torch.allclose(moved.dense_weight().double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    expected_core = w.core_dense().double() * scale.double()[None, :]
    assert torch.allclose(moved.core_dense().double(), expected_core, rtol=1e-6, atol=0)


def test_smoothing_scale_follows_the_rule_channel_by_channel():
    w = _weight(3)
    amax = torch.rand(64, generator=torch.Generator().manual_seed(1)) * 50
    amax[5] = 0.0  # a channel that never fired keeps scale 1
    scale = smoothing_scale(amax, w, 0.3)
    core = w.core_dense()
    for j in range(64):
        col = max(abs(float(v)) for v in core[:, j])
        want = 1.0 if amax[j] == 0 or col == 0 else min(max(float(amax[j]) ** 0.3 / col ** 0.7, 1e-4), 1e4)
        assert float(scale[j]) == pytest.approx(want, rel=1e-5)


def test_alpha_zero_turns_smoothing_off():
    w = _weight(4)
    assert torch.equal(smoothing_scale(torch.rand(64) + 0.5, w, 0.0), torch.ones(64))
    model = make_converted_tiny_llama(iters=1)
    parts = lambda: {n: [m.weight.a_blocks, m.weight.b_blocks, m.weight.core_dense()]  # noqa: E731
                     for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), ArmorTensor)}
    before = parts()
    smooth_core_inputs(model, [torch.zeros(1, 4, dtype=torch.long)], 0.0)
    after = parts()
    assert set(after) == set(before)
    assert all(torch.equal(x, y) for n in before for x, y in zip(before[n], after[n]))


def test_smoothing_cuts_the_int8_error_of_outlier_channels():
    """Tokens with a few huge B-pass channels: per-token int8 loses the small ones; after smoothing it does not."""
    w = _weight(5)
    gen = torch.Generator().manual_seed(7)
    b_inv = torch.linalg.inv(torch.block_diag(*w.b_blocks))
    z = torch.randn(256, 64, generator=gen)
    z[:, [3, 40]] *= 200.0  # outlier channels of z = B·x
    x = z @ b_inv.T
    ref = F.linear(x.double(), w.dense_weight().double())

    def int8_error(weight):
        out = F.linear(x, quantize_core_8bit(weight, "int8")).double()
        return float((out - ref).norm() / ref.norm())

    amax = (x @ torch.block_diag(*w.b_blocks).T).abs().amax(0)
    smoothed = fold_core_input_scale(w, smoothing_scale(amax, w, 0.5))
    assert int8_error(smoothed) < 0.5 * int8_error(w)


def test_core_input_amax_matches_the_b_pass_outputs_seen():
    model = make_converted_tiny_llama(iters=1)
    batches = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    seen = {}

    def record(name):
        def hook(module, args):
            w = module.weight
            z = args[0].reshape(-1, w.shape[1]) @ torch.block_diag(*w.b_blocks).T
            seen[name] = torch.maximum(seen[name], z.abs().amax(0)) if name in seen else z.abs().amax(0)
        return hook

    layers = {n: m for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), ArmorTensor)}
    handles = [m.register_forward_pre_hook(record(n)) for n, m in layers.items()]
    with torch.no_grad():
        for batch in batches:
            model(batch)
    for h in handles:
        h.remove()
    amax = core_input_amax(model, batches)
    assert set(amax) == set(layers) == set(seen)
    for name in layers:
        assert torch.allclose(amax[name], seen[name], rtol=1e-5, atol=1e-6)


def test_smooth_core_inputs_keeps_the_models_logits():
    model = make_converted_tiny_llama(iters=1)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(ids).logits
        scales = smooth_core_inputs(model, [ids], alpha=0.5)
        after = model(ids).logits
    assert any(not torch.allclose(s, torch.ones_like(s)) for s in scales.values())
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-4 * before.abs().max().item())


def test_refusals_name_the_layer_and_the_fix():
    w = _weight(6)
    q = quantize_core_8bit(w, "int8")
    with pytest.raises(ArmorInputError, match="layers.0.mlp.up_proj.*already quantized.*smooth the floating"):
        fold_core_input_scale(q, torch.ones(64))
    with pytest.raises(ArmorInputError, match=r"\(64,\), positive"):
        fold_core_input_scale(w, -torch.ones(64))
    with pytest.raises(ArmorInputError, match="alpha must be in"):
        smoothing_scale(torch.ones(64), w, 1.5)
    with pytest.raises(ArmorInputError, match="no ARMOR layers"):
        core_input_amax(torch.nn.Sequential(torch.nn.Linear(4, 4)), [torch.zeros(1, 4)])
