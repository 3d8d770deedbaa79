import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_armor import ArmorConfig
from torch_armor.config.armor import BcdConfig
from torch_armor.core.factorize import factorize
from torch_armor.core.bcd import refine_core_cg, update_a, update_b
from torch_armor.core.factorize import reconstruct_normalized

from _helpers import check_mask, random_factors, random_layer


def _loss(w_bar, a, core, b, h):
    return float(((w_bar - reconstruct_normalized(a, core, b)) ** 2 * h).sum())


def _generic_lstsq(w_bar, h, a, core, b, which):
    """Solve for every entry of A (or B) at once with a dense weighted least squares."""
    sqrt_h = h.sqrt()
    target_fn = lambda x: reconstruct_normalized(*x)  # noqa: E731
    base = {"a": a, "b": b}[which]
    columns = []
    for k in range(base.numel()):
        unit = torch.zeros_like(base).reshape(-1)
        unit[k] = 1
        unit = unit.reshape(base.shape)
        args = (unit, core, b) if which == "a" else (a, core, unit)
        columns.append((target_fn(args) * sqrt_h).reshape(-1))
    design = torch.stack(columns, 1)
    sol = torch.linalg.lstsq(design, (w_bar * sqrt_h).reshape(-1, 1), driver="gelsd").solution
    return sol.reshape(base.shape)


def test_update_a_equals_generic_weighted_lstsq():
    w_bar, h = random_layer(8, 12, seed=1)
    a, b, core, _ = random_factors(8, 12, 4, 2, 4, seed=2)
    ours = update_a(w_bar, h, a, core, b, ridge=0.0)
    ref = _generic_lstsq(w_bar, h, a, core, b, "a")
    assert torch.allclose(ours, ref, rtol=1e-7, atol=1e-9)


def test_update_b_equals_generic_weighted_lstsq_for_any_weights():
    """The activation weights drop out of B's closed form: update_b never sees h, yet it
    equals the h-weighted least-squares optimum for several very different h."""
    w_bar, _ = random_layer(8, 12, seed=3)
    a, b, core, _ = random_factors(8, 12, 4, 2, 4, seed=4)
    ours = update_b(w_bar, a, core, b, ridge=0.0)
    g = torch.Generator().manual_seed(0)
    for spread in (1.0, 1e3, 1e-3):
        h = torch.rand(12, generator=g, dtype=torch.float64) * spread + 1e-3
        ref = _generic_lstsq(w_bar, h, a, core, b, "b")
        assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-8)


def test_refine_core_cg_converges_to_support_lstsq():
    w_bar, h = random_layer(8, 8, seed=5)
    a, b, core, mask = random_factors(8, 8, 4, 2, 4, seed=6)
    ours = refine_core_cg(w_bar, h, a, core, mask, b, steps=40, ridge=0.0)
    # generic: unknowns = kept entries of the core
    idx = mask.reshape(-1).nonzero().squeeze(1)
    sqrt_h = h.sqrt()
    cols = []
    for k in idx.tolist():
        unit = torch.zeros(64, dtype=w_bar.dtype)
        unit[k] = 1
        cols.append((reconstruct_normalized(a, unit.reshape(8, 8), b) * sqrt_h).reshape(-1))
    sol = torch.linalg.lstsq(torch.stack(cols, 1), (w_bar * sqrt_h).reshape(-1, 1)).solution[:, 0]
    ref = torch.zeros(64, dtype=w_bar.dtype)
    ref[idx] = sol
    assert torch.allclose(ours, ref.reshape(8, 8), rtol=1e-6, atol=1e-8)
    assert torch.all(ours[~mask] == 0)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 3), q=st.integers(1, 3), mult=st.integers(1, 2),
       nm=st.sampled_from([(2, 4), (1, 4), (4, 8)]), ridge=st.sampled_from([0.0, 1e-8, 1e-6, 1e-2]),
       cg=st.integers(1, 4), seed=st.integers(0, 1000))
def test_each_exact_substep_never_increases_loss(p, q, mult, nm, ridge, cg, seed):
    n, m = nm
    d_b = m * mult
    w_bar, h = random_layer(p * d_b, q * d_b, seed=seed)
    a, b, core, mask = random_factors(p * d_b, q * d_b, d_b, n, m, seed=seed + 1)
    loss = _loss(w_bar, a, core, b, h)
    tol = 1e-9 * max(loss, 1.0)
    a = update_a(w_bar, h, a, core, b, ridge)
    new = _loss(w_bar, a, core, b, h)
    assert new <= loss + tol
    b = update_b(w_bar, a, core, b, ridge)
    newer = _loss(w_bar, a, core, b, h)
    assert newer <= new + tol
    core = refine_core_cg(w_bar, h, a, core, mask, b, cg, ridge)
    assert _loss(w_bar, a, core, b, h) <= newer + tol
    assert torch.all(core[~mask] == 0)


@pytest.mark.parametrize("pattern", ["2:4", "4:8", "unstructured:0.5"])
def test_bcd_history_is_monotone_and_beats_adam_per_iteration(pattern):
    w, h = random_layer(32, 64, seed=9, dtype=torch.float32)
    f = factorize(w, h, ArmorConfig(block_size=16, pattern=pattern, optimizer=BcdConfig(iters=15)))
    assert check_mask(f.mask, pattern)
    diffs = f.history[1:] - f.history[:-1]
    assert (diffs <= 1e-5).all()
    assert f.relative_loss < 0.9


def test_bcd_time_budget_and_tolerance_stop_early():
    w, h = random_layer(64, 64, seed=1, dtype=torch.float32)
    f = factorize(w, h, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=10_000, time_budget_s=0.5)))
    assert f.history_time_s[-1] < 5.0 and f.history_iters[-1] < 10_000
    g = factorize(w, h, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=10_000, tol=1e-3)))
    last = g.history[-2:]
    assert (last[0] - last[1]) / last[0] < 1e-3 and g.history_iters[-1] < 10_000
