"""Small problem generators shared by the math tests."""

from __future__ import annotations

import torch

from torch_armor.core.proxy import mask_from_scores


def random_layer(d_out: int, d_in: int, seed: int = 0, dtype=torch.float64):
    """A random weight and positive activation statistics with a realistic spread."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_out, d_in, generator=g, dtype=dtype)
    h = torch.rand(d_in, generator=g, dtype=dtype).pow(3) * 10 + 1e-2
    return w, h


def random_factors(d_out: int, d_in: int, d_b: int, n: int, m: int, seed: int = 0, dtype=torch.float64):
    """Random blocks and a random valid N:M core, in normalized space."""
    g = torch.Generator().manual_seed(seed)
    eye = torch.eye(d_b, dtype=dtype)
    a = eye + 0.3 * torch.randn(d_out // d_b, d_b, d_b, generator=g, dtype=dtype)
    b = eye + 0.3 * torch.randn(d_in // d_b, d_b, d_b, generator=g, dtype=dtype)
    core = torch.randn(d_out, d_in, generator=g, dtype=dtype)
    mask = mask_from_scores(torch.rand(d_out, d_in, generator=g, dtype=dtype), f"{n}:{m}")
    return a, b, core * mask, mask
