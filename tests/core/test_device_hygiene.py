"""The optimizer's inner loops stay on the device: no host syncs, no full-size float64 temporaries.

A host sync is any tensor-to-Python conversion (``bool(t)``, ``float(t)``, ``t.item()``): on a GPU
each one drains the queue. They all dispatch ``aten._local_scalar_dense`` (or ``is_nonzero``), which
a dispatch mode counts on CPU as well (issue #21, row 9).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_armor import ArmorConfig
from torch_armor.config.armor import BcdConfig
from torch_armor.core.factorize import factorize
from torch_armor.core.bcd import update_a, update_b
from torch_armor.core.proxy import LOSS_CHUNK, proxy_loss
from torch_armor.core.refine import refine_output

from _helpers import random_factors, random_layer

SYNCS = {"_local_scalar_dense", "is_nonzero", "item"}


class Recorder(TorchDispatchMode):
    """Counts host syncs and remembers the largest float64 tensor any op returned."""

    def __init__(self):
        super().__init__()
        self.syncs = 0
        self.largest_float64 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in SYNCS:
            self.syncs += 1
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                self.largest_float64 = max(self.largest_float64, t.numel())
        return out


def test_exact_a_and_b_updates_never_sync():
    """Before: two ``bool()`` per proximal solve (``ok.any()``, ``todo.any()``)."""
    a, b, core, _ = random_factors(32, 64, 8, 2, 4, seed=1, dtype=torch.float32)
    w, h = random_layer(32, 64, seed=1, dtype=torch.float32)
    with Recorder() as rec:
        update_a(w, h, a, core, b)
        update_b(w, a, core, b)
    assert rec.syncs == 0


def test_output_refinement_syncs_do_not_grow_with_cg_steps():
    """Before: two ``bool()`` per CG step (curvature and ``rᵀz`` tests); now one loss per round."""
    w, h = random_layer(32, 64, seed=2, dtype=torch.float32)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(2))
    factors = factorize(w, h, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1), refine=None))
    counts = []
    for steps in (1, 12):
        with Recorder() as rec:
            refine_output(w, x.T @ x, factors, rounds=1, cg_steps=steps)
        counts.append(rec.syncs)
    assert counts[0] == counts[1]


def test_proxy_loss_works_on_float64_chunks_not_full_copies():
    """Before: five full-size float64 temporaries (≈1.9 GB each at 8192×28672)."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(1024, 8192, generator=gen)
    approx = w * (torch.rand(w.shape, generator=gen) > 0.5)
    h = torch.rand(8192, generator=gen)
    with Recorder() as rec:
        loss = proxy_loss(w, approx, h)
    assert 0 < rec.largest_float64 <= LOSS_CHUNK < w.numel()
    wd = w.double()  # the definition, in float64 at full size (independent of the chunking)
    col = wd.norm(dim=0)
    row = (wd / col).norm(dim=1)
    ref = (((wd - approx.double()) / row[:, None] / col).square() * h.double()).sum()
    assert abs(float(loss) - float(ref)) <= 1e-12 * float(ref)
