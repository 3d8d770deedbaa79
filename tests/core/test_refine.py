"""Output-space refinement against independent references: the A closed form against lstsq with a
full H, the CG steps against dense normal-equation solves, monotone decrease (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_armor import ArmorConfig
from torch_armor.config.armor import BcdConfig
from torch_armor.core.factorize import factorize
from torch_armor.core import refine
from torch_armor.core.refine import damped_xtx, output_loss, refine_output

from _helpers import block_diag_dense

D_OUT, D_IN, D_B = 8, 12, 4


def _problem(seed: int, d_out: int = D_OUT, d_in: int = D_IN, d_b: int = D_B):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    x = torch.randn(3 * d_in, d_in, generator=g, dtype=torch.float64) @ (
        torch.eye(d_in, dtype=torch.float64) + 0.7 * torch.randn(d_in, d_in, generator=g, dtype=torch.float64))
    h = x.T @ x
    a = torch.eye(d_b, dtype=torch.float64) + 0.3 * torch.randn(d_out // d_b, d_b, d_b, generator=g, dtype=torch.float64)
    b = torch.eye(d_b, dtype=torch.float64) + 0.3 * torch.randn(d_in // d_b, d_b, d_b, generator=g, dtype=torch.float64)
    mask = torch.zeros(d_out, d_in // 4, 4, dtype=torch.bool)
    keep = torch.rand(d_out, d_in // 4, 4, generator=g).argsort(-1)[..., :2]
    mask = mask.scatter_(-1, keep, True).reshape(d_out, d_in)
    core = torch.randn(d_out, d_in, generator=g, dtype=torch.float64) * mask
    return w, h, a, core, b, mask


def _loss(w, h, a, core, b) -> float:
    return float(output_loss(w, block_diag_dense(a) @ core @ block_diag_dense(b), h))


def test_a_is_the_least_squares_solution_with_full_h():
    w, h, a, core, b, _ = _problem(0)
    new_a = refine._update_a(w @ h, h, a, core, b, ridge=0.0)
    chol = torch.linalg.cholesky(h)
    c = core @ block_diag_dense(b)
    for i in range(a.shape[0]):
        rows = slice(i * D_B, (i + 1) * D_B)
        # min ‖(W_i − A_i C_i) L‖  ⇔  (C_i L)ᵀ A_iᵀ ≈ (W_i L)ᵀ
        want = torch.linalg.lstsq((c[rows] @ chol).T, (w[rows] @ chol).T).solution.T
        torch.testing.assert_close(new_a[i], want, rtol=1e-6, atol=1e-8)


def _normal_equations(w, h, basis):
    """Minimize tr((W − Σ s_k M_k) H (·)ᵀ) over s: G s = g, G_kl = tr(M_k H M_lᵀ), g_k = tr(W H M_kᵀ)."""
    flat = torch.stack([(m @ h).reshape(-1) for m in basis])
    gram = flat @ torch.stack([m.reshape(-1) for m in basis]).T
    rhs = flat @ w.reshape(-1)
    return torch.linalg.solve(gram, rhs)


def test_core_cg_reaches_the_dense_solution():
    w, h, a, core, b, mask = _problem(1)
    a_dense, b_dense = block_diag_dense(a), block_diag_dense(b)
    entries = mask.nonzero().tolist()
    basis = [torch.outer(a_dense[:, r], b_dense[c, :]) for r, c in entries]
    values = _normal_equations(w, h, basis)
    want = torch.zeros_like(core)
    for (r, c), v in zip(entries, values):
        want[r, c] = v
    got = refine._update_core(w, h, a, core, mask, b, steps=3 * len(entries))  # CG: n steps in exact arithmetic
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_b_cg_reaches_the_dense_solution():
    w, h, a, core, b, _ = _problem(2)
    e = block_diag_dense(a) @ core
    q = b.shape[0]
    index, basis = [], []
    for j in range(q):
        for r in range(D_B):
            for c in range(D_B):
                unit = torch.zeros(D_IN, D_IN, dtype=torch.float64)
                unit[j * D_B + r, j * D_B + c] = 1.0
                index.append((j, r, c))
                basis.append(e @ unit)
    values = _normal_equations(w, h, basis)
    want = torch.zeros_like(b)
    for (j, r, c), v in zip(index, values):
        want[j, r, c] = v
    got = refine._update_b(w, h, a, core, b, steps=3 * len(index))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.integers(1, 6), damp=st.sampled_from([0.0, 0.01]))
def test_every_step_and_the_whole_refinement_never_raise_the_loss(seed, steps, damp):
    w, h, a, core, b, mask = _problem(seed)
    hd = damped_xtx(h, damp)
    tol = 1e-9 * _loss(w, hd, a, core, b)
    start = _loss(w, hd, a, core, b)
    a = refine._update_a(w @ hd, hd, a, core, b, ridge=1e-6)
    after_a = _loss(w, hd, a, core, b)
    core = refine._update_core(w, hd, a, core, mask, b, steps)
    after_core = _loss(w, hd, a, core, b)
    b = refine._update_b(w, hd, a, core, b, steps)
    after_b = _loss(w, hd, a, core, b)
    assert after_a <= start + tol and after_core <= after_a + tol and after_b <= after_core + tol
    assert torch.equal(core != 0, (core != 0) & mask)  # nothing off the mask


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_refine_output_improves_factorize_and_reports_the_loss(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 32, generator=g)
    x = torch.randn(128, 32, generator=g) @ (torch.eye(32) + 0.5 * torch.randn(32, 32, generator=g))
    xtx = x.T @ x
    f = factorize(w, xtx.diagonal().clone(), ArmorConfig(block_size=8, refine=None, optimizer=BcdConfig(iters=3)))
    r = refine_output(w, xtx, f, rounds=2, cg_steps=5, damp=0.01)
    hd = damped_xtx(xtx, 0.01)
    assert float(output_loss(w, r.dense(), hd)) <= float(output_loss(w, f.dense(), hd)) * (1 + 1e-6)
    assert torch.equal(r.mask, f.mask) and not r.core[~r.mask].any()
    # the reported relative loss, recomputed: ‖(W − Ŵ)Xᵀ‖² ÷ NoWag-P's
    from torch_armor.core.proxy import nowag_prune

    _, nowag = nowag_prune(w, xtx.diagonal(), "2:4")
    want = float(((w - r.dense()) @ x.T).square().sum() / ((w - nowag) @ x.T).square().sum())
    assert r.relative_output_loss == pytest.approx(want, rel=1e-3)
    assert r.refined and not f.refined and r.relative_loss == float(r.history[-1])


def test_factorize_refines_only_with_xtx_and_config():
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(16, 32, generator=g), torch.randn(64, 32, generator=g)
    xtx = x.T @ x
    cfg = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2))
    assert not factorize(w, xtx.diagonal().clone(), cfg).refined
    assert factorize(w, xtx.diagonal().clone(), cfg, xtx=xtx).refined
    assert not factorize(w, xtx.diagonal().clone(), ArmorConfig(block_size=8, refine=None, optimizer=BcdConfig(iters=2)), xtx=xtx).refined
    with pytest.raises(ValueError, match="ArmorConfig.refine must be RefineConfig"):
        ArmorConfig(refine="input")


def _correlated_layer(seed: int):
    """A 16 × 32 float32 weight and inputs ``x`` with strongly correlated channels."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 32, generator=g)
    x = torch.randn(128, 32, generator=g) @ (torch.eye(32) + 0.8 * torch.randn(32, 32, generator=g))
    return w, x, x.T @ x


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_core_steps_keep_n_m_and_beat_the_fixed_mask_refinement(seed):
    from torch_armor.core.proxy import nowag_prune  # only this test needs it

    w, x, xtx = _correlated_layer(seed)
    f = factorize(w, xtx.diagonal().clone(), ArmorConfig(block_size=8, refine=None, optimizer=BcdConfig(iters=3)))
    fixed = refine_output(w, xtx, f, rounds=2, cg_steps=5)
    moved = refine_output(w, xtx, f, rounds=2, cg_steps=5, core_steps=24)
    hd = damped_xtx(xtx, 0.01)
    assert float(output_loss(w, moved.dense(), hd)) <= float(output_loss(w, fixed.dense(), hd)) * (1 + 1e-6)
    assert bool((moved.mask.reshape(16, 8, 4).sum(-1) == 2).all()) and not moved.core[~moved.mask].any()
    _, nowag = nowag_prune(w, xtx.diagonal(), "2:4")
    want = float(((w - moved.dense()) @ x.T).square().sum() / ((w - nowag) @ x.T).square().sum())
    assert moved.relative_output_loss == pytest.approx(want, rel=1e-3)


def test_core_steps_through_the_config_and_its_checks():
    from torch_armor.config.armor import RefineConfig  # only this test needs it
    from torch_armor.errors import ArmorInputError  # only this test needs it

    w, _, xtx = _correlated_layer(6)
    base = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=3))
    fixed = factorize(w, xtx.diagonal().clone(), base, xtx=xtx)
    cfg = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=3), refine=RefineConfig(core_steps=16))
    moved = factorize(w, xtx.diagonal().clone(), cfg, xtx=xtx)
    assert moved.relative_output_loss < fixed.relative_output_loss
    assert cfg.to_dict()["refine"]["core_steps"] == 16 and base.to_dict()["refine"]["core_steps"] == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ArmorInputError, match="core_steps"):
            RefineConfig(core_steps=bad)
    with pytest.raises(ArmorInputError, match="core_steps"):
        refine_output(w, xtx, fixed, core_steps=-1)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), n_blocks=st.integers(1, 11), d_b=st.sampled_from([1, 2, 4]),
       chunks=st.integers(1, 9))
def test_tiled_b_h_bt_and_symmetrize_equal_the_dense_formulas(seed, n_blocks, d_b, chunks):
    g = torch.Generator().manual_seed(seed)
    n = n_blocks * d_b
    h = torch.randn(n, n, generator=g, dtype=torch.float64)
    b = torch.randn(n_blocks, d_b, d_b, generator=g, dtype=torch.float64)
    dense_b = block_diag_dense(b)
    torch.testing.assert_close(refine._b_h_bt(h, b, chunks), dense_b @ h @ dense_b.T, rtol=1e-12, atol=1e-12)
    want = (h + h.T) / 2
    got = refine._symmetrize_(h.clone(), chunks)
    assert torch.equal(got, want)  # the same two additions and halvings, bit for bit


class _NewSquareTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts op results that own a new storage of at least ``min_numel`` elements."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel, self.count = min_numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
                    and t.untyped_storage().nbytes() >= self.min_numel * t.element_size()):
                self.count += 1
        return out


def test_core_and_b_steps_of_a_wide_layer_allocate_one_d_in_squared_tensor_each():
    """Before: ``B·H``, ``B H Bᵀ`` and its symmetrized copy in the core step; ``EᵀE``, ``EᵀR`` and one
    ``EᵀE·blockdiag(V)`` per CG step in the ``B`` step: on a wide ``down_proj`` those ``(d_in, d_in)``
    products, not the weight, set refinement's peak memory."""
    d_out, d_in = 16, 256
    w, h, a, core, b, mask = _problem(7, d_out, d_in, 8)
    hd = damped_xtx(h, 0.01)
    for step in (lambda: refine._update_core(w, hd, a, core, mask, b, 4), lambda: refine._update_b(w, hd, a, core, b, 4)):
        with _NewSquareTensors(d_in * d_in // 2) as rec:
            step()
        assert rec.count == 1
