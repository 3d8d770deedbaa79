import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_armor.core.sparse_core import block_grams, core_gradient, group_decrease, select_groups, sparse_core_step
from torch_armor.core.sparse_core_fullh import (
    _coupling,
    fullh_core_gradient,
    fullh_core_step,
    fullh_core_sweeps,
    fullh_objective,
)
from torch_armor.errors import ArmorInputError

from _helpers import block_diag_dense, check_mask, random_factors


def _spd(d: int, seed: int, correlated: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * d, d, generator=g, dtype=torch.float64)
    x = x @ (torch.eye(d, dtype=torch.float64) + correlated * torch.randn(d, d, generator=g, dtype=torch.float64))
    return x.T @ x / (4 * d) + 1e-3 * torch.eye(d, dtype=torch.float64)


def _problem(d_out, d_in, d_b, seed, correlated=1.0):
    a, b, core, mask = random_factors(d_out, d_in, d_b, 2, 4, seed=seed)
    w = torch.randn(d_out, d_in, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return w, _spd(d_in, seed + 2, correlated), a, core, mask, b


def _dense_loss(w, h, a, core, b):
    """``tr(E H Eᵀ)`` with the block-diagonal matrices written out."""
    e = w - block_diag_dense(a) @ core @ block_diag_dense(b)
    return float(torch.trace(e @ h @ e.T))


def _state(w, h, a, core, mask, b):
    core, mask = core.clone().contiguous(), mask.clone().contiguous()
    grad = fullh_core_gradient(w, h, a, core, b).contiguous()
    q, q_diag = _coupling(b, h)
    return core, mask, grad, a.transpose(1, 2) @ a, q, q_diag


def _best_single_moves(w, h, a, core, b, d_b, n=2, m=4):
    """Per row block of ``A``: the lowest loss reachable by re-solving one group in it, over every
    group and support — least squares on the explicit Kronecker form ``vec(A E B L)``, ``H = L Lᵀ``."""
    a_full, b_full = block_diag_dense(a), block_diag_dense(b)
    chol = torch.linalg.cholesky(h)
    d_out, d_in = core.shape
    best = {}
    for r in range(d_out):
        for c0 in range(0, d_in, m):
            base = core.clone()
            base[r, c0:c0 + m] = 0
            target = ((w - a_full @ base @ b_full) @ chol).reshape(-1)
            for sup in itertools.combinations(range(m), n):
                design = torch.stack([torch.outer(a_full[:, r], (b_full @ chol)[c0 + s]).reshape(-1) for s in sup], 1)
                x = torch.linalg.lstsq(design, target[:, None]).solution[:, 0]
                loss = float((target - design @ x).square().sum())
                values = torch.zeros(m, dtype=core.dtype)
                values[list(sup)] = x
                key = r // d_b
                if key not in best or loss < best[key][0]:
                    best[key] = (loss, r, c0, values)
    return best


def test_objective_matches_dense_trace_and_gradient_matches_autograd():
    w, h, a, core, mask, b = _problem(16, 24, 8, seed=0)
    assert float(fullh_objective(w, h, a, core, b)) == pytest.approx(_dense_loss(w, h, a, core, b), rel=1e-12)
    s = core.clone().requires_grad_(True)
    e = w - block_diag_dense(a) @ s @ block_diag_dense(b)
    torch.trace(e @ h @ e.T).backward()
    torch.testing.assert_close(fullh_core_gradient(w, h, a, core, b), s.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_one_tile_step_is_the_brute_force_best_group_and_support(seed):
    w, h, a, core, mask, b = _problem(8, 8, 8, seed=seed)
    before = _dense_loss(w, h, a, core, b)
    loss, r, c0, values = _best_single_moves(w, h, a, core, b, d_b=8)[0]
    state = _state(w, h, a, core, mask, b)
    change = fullh_core_step(*state, 2, 4)
    new_core, new_mask = state[0], state[1]
    after = _dense_loss(w, h, a, new_core, b)
    assert after == pytest.approx(min(loss, before), rel=1e-9)
    assert float(change.sum()) == pytest.approx(after - before, rel=1e-7, abs=1e-9)
    if loss < before * (1 - 1e-9):
        torch.testing.assert_close(new_core[r, c0:c0 + 4], values, rtol=1e-7, atol=1e-9)
        assert new_mask[r, c0:c0 + 4].tolist() == (values != 0).tolist()
    assert check_mask(new_mask, "2:4") and bool((new_core[~new_mask] == 0).all())


@pytest.mark.parametrize("seed", range(3))
def test_step_beats_the_best_single_group_of_every_row_block(seed):
    """Two row blocks of A (independent) with two column tiles each (coupled through H)."""
    w, h, a, core, mask, b = _problem(8, 8, 4, seed=10 + seed)
    before = _dense_loss(w, h, a, core, b)
    best = _best_single_moves(w, h, a, core, b, d_b=4)
    state = _state(w, h, a, core, mask, b)
    change = fullh_core_step(*state, 2, 4)
    after = _dense_loss(w, h, a, state[0], b)
    bound = before + sum(min(loss - before, 0.0) for loss, *_ in best.values())
    assert after <= bound + 1e-9 * before
    assert float(change.sum()) == pytest.approx(after - before, rel=1e-7, abs=1e-9)
    assert check_mask(state[1], "2:4")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), d_b=st.sampled_from([4, 8]), p=st.integers(1, 2), q=st.integers(1, 3),
       correlated=st.floats(0.0, 3.0))
def test_steps_are_exact_and_never_raise_the_loss(seed, d_b, p, q, correlated):
    w, h, a, core, mask, b = _problem(p * d_b, q * d_b, d_b, seed=seed, correlated=correlated)
    state = _state(w, h, a, core, mask, b)
    loss = _dense_loss(w, h, a, core, b)
    for _ in range(4):
        change = fullh_core_step(*state, 2, 4)
        new = _dense_loss(w, h, a, state[0], b)
        assert bool((change <= 0).all())
        assert new <= loss + 1e-10 * loss
        assert float(change.sum()) == pytest.approx(new - loss, rel=1e-6, abs=1e-9 * loss)
        loss = new
        # the gradient is kept exact
        torch.testing.assert_close(state[2], fullh_core_gradient(w, h, a, state[0], b), rtol=1e-8, atol=1e-8 * loss)
    assert check_mask(state[1], "2:4") and bool((state[0][~state[1]] == 0).all())


@pytest.mark.parametrize("identity", [True, False])
def test_diagonal_h_reproduces_the_diagonal_proxy_step(identity):
    """With ``H = diag(h)`` the objective is the proxy ``Σ (W − Ŵ)² h_j``: the full-H step must
    make the same move as :func:`sparse_core_step` on the proxy's own gradient and Gram blocks."""
    d_b = 8
    w, _, a, core, mask, b = _problem(16, 24, d_b, seed=3)
    if identity:
        a = torch.eye(d_b, dtype=torch.float64).expand_as(a).contiguous()
        b = torch.eye(d_b, dtype=torch.float64).expand_as(b).contiguous()
    h = torch.rand(24, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.1
    state = _state(w, torch.diag(h), a, core, mask, b)
    fullh_core_step(*state, 2, 4)

    ref_core, ref_mask = core.clone().contiguous(), mask.clone().contiguous()
    residual = w - block_diag_dense(a) @ ref_core @ block_diag_dense(b)
    grad = core_gradient(residual, a, b, h).contiguous()
    a_gram, b_gram = block_grams(a, b, h)
    dec = group_decrease(ref_core, grad, a_gram, b_gram, 2, 4)
    rows, groups = select_groups(grad, d_b, 4, "decrease-greedy", decrease=dec)
    sparse_core_step(ref_core, ref_mask, a_gram, b_gram, grad, 2, 4, rows, groups)
    torch.testing.assert_close(state[0], ref_core, rtol=1e-9, atol=1e-12)
    assert torch.equal(state[1], ref_mask)
    assert not torch.equal(ref_mask, mask)  # the step did move the mask


def test_sweeps_are_monotone_keep_the_best_and_leave_inputs_alone():
    w, h, a, core, mask, b = _problem(16, 32, 8, seed=7)
    core0, mask0 = core.clone(), mask.clone()
    new_core, new_mask, losses = fullh_core_sweeps(w, h, a, core, mask, b, n=2, m=4, steps=40, steps_per_sweep=5)
    assert torch.equal(core, core0) and torch.equal(mask, mask0)
    assert losses[0] == pytest.approx(_dense_loss(w, h, a, core, b), rel=1e-12)
    assert all(y < x for x, y in zip(losses[:-2], losses[1:-1]))
    final = _dense_loss(w, h, a, new_core, b)
    assert final == pytest.approx(min(losses), rel=1e-12) and final < 0.9 * losses[0]
    assert check_mask(new_mask, "2:4") and bool((new_core[~new_mask] == 0).all())
    same, _, only = fullh_core_sweeps(w, h, a, core, mask, b, n=2, m=4, steps=0)
    assert torch.equal(same, core0) and len(only) == 1


def test_sweeps_reject_bad_arguments():
    w, h, a, core, mask, b = _problem(8, 8, 4, seed=0)
    with pytest.raises(ArmorInputError, match="steps"):
        fullh_core_sweeps(w, h, a, core, mask, b, n=2, m=4, steps=-1)
    with pytest.raises(ArmorInputError, match="do not fit"):
        fullh_core_sweeps(w, h[:4, :4], a, core, mask, b, n=2, m=4, steps=1)


def test_steps_never_sync_and_float32_sweeps_stay_monotone():
    from tests.core.test_device_hygiene import Recorder  # test helper, imported where used

    w, h, a, core, mask, b = _problem(16, 32, 8, seed=9)
    state = _state(w, h, a, core, mask, b)
    with Recorder() as rec:
        for _ in range(3):
            fullh_core_step(*state, 2, 4)
    assert rec.syncs == 0
    new_core, new_mask, losses = fullh_core_sweeps(w.float(), h.float(), a.float(), core.float(), mask, b.float(),
                                                   n=2, m=4, steps=20, steps_per_sweep=4)
    assert new_core.dtype == torch.float32 and check_mask(new_mask, "2:4")
    final = _dense_loss(w, h, a, new_core.double(), b)
    assert final == pytest.approx(min(losses), rel=1e-4) and final < losses[0]
