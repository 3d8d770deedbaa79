"""The per-layer runner: ProxyReference (the NoWag-P denominator computed once per layer) against
the independent relative_proxy_loss."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_armor.core.proxy import mask_from_scores, relative_proxy_loss
from torch_armor.engine.runner import ProxyReference


@settings(max_examples=40, deadline=None)
@given(
    pattern=st.sampled_from(["2:4", "4:8"]),
    d_out=st.integers(1, 24),
    groups=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_proxy_reference_equals_relative_proxy_loss(pattern, d_out, groups, seed):
    m = int(pattern.split(":")[1])
    d_in = groups * m
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_out, d_in, generator=g)
    h = torch.rand(d_in, generator=g).pow(3) * 10 + 1e-2
    # an approximation that is neither NoWag-P nor the weight: another mask, perturbed values
    approx = w * mask_from_scores(torch.rand(d_out, d_in, generator=g), pattern)
    approx = approx + 0.1 * torch.randn(d_out, d_in, generator=g) * (approx != 0)
    ref = ProxyReference(w, h, pattern)
    want = relative_proxy_loss(w, approx, h, pattern)
    assert ref.relative(w, approx) == pytest.approx(want, rel=1e-5)
    assert ref.relative(w, w) == 0.0
