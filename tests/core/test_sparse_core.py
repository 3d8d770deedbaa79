import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_armor.core.factorize import reconstruct_normalized
from torch_armor.core.sparse_core import (
    block_grams,
    core_gradient,
    group_decrease,
    select_groups,
    solve_psd,
    sparse_core_step,
    sparse_core_steps,
)

from _helpers import check_mask, random_factors, random_layer, solve_psd_2x2


def _loss(w_bar, a, core, b, h):
    return float(((w_bar - reconstruct_normalized(a, core, b)) ** 2 * h).sum())


def _brute_force_best(w_bar, a, core, b, h, d_b, n, m, rows, groups):
    """Joint least squares over every combination of supports of all chosen groups."""
    p, q = rows.shape
    slots = [(i, j) for i in range(p) for j in range(q)]
    base = core.clone()
    cols = {}
    for i, j in slots:
        r = i * d_b + int(rows[i, j])
        c0 = j * d_b + int(groups[i, j]) * m
        base[r, c0:c0 + m] = 0
        cols[(i, j)] = (r, c0)
    sqrt_h = h.sqrt()
    target = ((w_bar - reconstruct_normalized(a, base, b)) * sqrt_h).reshape(-1)
    best = float("inf")
    for choice in itertools.product(itertools.combinations(range(m), n), repeat=len(slots)):
        design = []
        for (i, j), sup in zip(slots, choice):
            r, c0 = cols[(i, j)]
            for k in sup:
                unit = torch.zeros_like(core)
                unit[r, c0 + k] = 1
                design.append((reconstruct_normalized(a, unit, b) * sqrt_h).reshape(-1))
        x = torch.linalg.lstsq(torch.stack(design, 1), target[:, None], driver="gelsd").solution
        resid = target - torch.stack(design, 1) @ x[:, 0]
        best = min(best, float(resid.square().sum()))
    return best


@pytest.mark.parametrize("n,m,d_b,p,q", [(2, 4, 4, 2, 2), (1, 4, 4, 1, 3), (3, 4, 8, 1, 1), (1, 2, 2, 2, 2)])
def test_step_matches_brute_force(n, m, d_b, p, q):
    torch.manual_seed(0)
    w_bar, h = random_layer(p * d_b, q * d_b, seed=7)
    a, b, core, mask = random_factors(p * d_b, q * d_b, d_b, n, m, seed=11)
    grad = core_gradient(w_bar - reconstruct_normalized(a, core, b), a, b, h)
    rows, groups = select_groups(grad, d_b, m, "l1-random", torch.Generator().manual_seed(0))
    expected = _brute_force_best(w_bar, a, core, b, h, d_b, n, m, rows, groups)
    before = _loss(w_bar, a, core, b, h)
    core2, mask2 = core.clone(), mask.clone()
    gain = sparse_core_step(core2, mask2, *block_grams(a, b, h), grad, n, m, rows, groups)
    after = _loss(w_bar, a, core2, b, h)
    assert after == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert before - after == pytest.approx(float(gain.sum()), rel=1e-8, abs=1e-9)
    assert check_mask(mask2, f"{n}:{m}")
    assert torch.all(core2[~mask2] == 0)
    # only the chosen group of each tile may change
    changed = (core2 != core) | (mask2 != mask)
    assert int(changed.reshape(p, d_b, q, d_b // m, m).any(-1).sum()) <= p * q


@settings(max_examples=30, deadline=None)
@given(
    p=st.integers(1, 3), q=st.integers(1, 3), d_b_mult=st.integers(1, 3),
    nm=st.sampled_from([(2, 4), (1, 4), (3, 4), (1, 2), (4, 8), (2, 8)]),
    selection=st.sampled_from(["l1-random", "l2-random", "l1-greedy", "random"]),
    seed=st.integers(0, 10_000),
)
def test_step_never_increases_loss(p, q, d_b_mult, nm, selection, seed):
    n, m = nm
    d_b = m * d_b_mult
    w_bar, h = random_layer(p * d_b, q * d_b, seed=seed)
    a, b, core, mask = random_factors(p * d_b, q * d_b, d_b, n, m, seed=seed + 1)
    before = _loss(w_bar, a, core, b, h)
    for step in range(3):
        grad = core_gradient(w_bar - reconstruct_normalized(a, core, b), a, b, h)
        rows, groups = select_groups(grad, d_b, m, selection, torch.Generator().manual_seed(seed + step))
        gain = sparse_core_step(core, mask, *block_grams(a, b, h), grad, n, m, rows, groups)
        after = _loss(w_bar, a, core, b, h)
        assert (gain >= 0).all()
        assert after <= before + 1e-9 * max(1.0, before)
        assert after == pytest.approx(before - float(gain.sum()), rel=1e-7, abs=1e-9)
        before = after
    assert check_mask(mask, f"{n}:{m}")



@settings(max_examples=30, deadline=None)
@given(
    p=st.integers(1, 3), q=st.integers(1, 3), d_b_mult=st.integers(1, 3),
    nm=st.sampled_from([(2, 4), (1, 4), (3, 4), (1, 2), (4, 8), (2, 8)]),
    selection=st.sampled_from(["decrease-greedy", "mixed", "l1-random"]),
    k_steps=st.integers(1, 6),
    seed=st.integers(0, 10_000),
)
def test_batched_steps_never_increase_loss(p, q, d_b_mult, nm, selection, k_steps, seed):
    """bcd's group phase: groups chosen from the sweep's gradient and decreases, K exact steps."""
    n, m = nm
    d_b = m * d_b_mult
    w_bar, h = random_layer(p * d_b, q * d_b, seed=seed)
    a, b, core, mask = random_factors(p * d_b, q * d_b, d_b, n, m, seed=seed + 1)
    a_gram, b_gram = block_grams(a, b, h)
    before = _loss(w_bar, a, core, b, h)
    for sweep in range(2):
        grad = core_gradient(w_bar - reconstruct_normalized(a, core, b), a, b, h)
        decrease = group_decrease(core, grad, a_gram, b_gram, n, m)
        rows, groups = select_groups(grad, d_b, m, selection, torch.Generator().manual_seed(seed + sweep),
                                     num=k_steps, decrease=decrease)
        gain = sparse_core_steps(core, mask, a_gram, b_gram, grad, n, m, rows, groups)
        after = _loss(w_bar, a, core, b, h)
        assert (gain >= 0).all()
        assert after <= before + 1e-9 * max(1.0, before)
        assert after == pytest.approx(before - float(gain.sum()), rel=1e-7, abs=1e-9)
        if selection == "decrease-greedy":  # the first step alone takes at least the best decrease
            assert float(gain.sum()) >= float(
                decrease.reshape(p, d_b, q, d_b // m).amax((1, 3)).sum()) * (1 - 1e-7) - 1e-9
        before = after
    assert check_mask(mask, f"{n}:{m}")

def test_core_gradient_matches_autograd():
    w_bar, h = random_layer(16, 24, seed=2)
    a, b, core, _ = random_factors(16, 24, 8, 2, 4, seed=3)
    core = core.clone().requires_grad_(True)
    loss = ((w_bar - reconstruct_normalized(a, core, b)) ** 2 * h).sum()
    (auto,) = torch.autograd.grad(loss, core)
    ours = core_gradient(w_bar - reconstruct_normalized(a, core.detach(), b), a, b, h)
    assert torch.allclose(ours, auto, rtol=1e-10, atol=1e-10)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), singular=st.booleans())
def test_closed_form_2x2_matches_lstsq(seed, singular):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5 if not singular else 1, generator=g, dtype=torch.float64)
    k = x @ x.T  # PSD, rank 1 when singular
    u = torch.randn(2, generator=g, dtype=torch.float64)
    ours = solve_psd_2x2(k, u)
    ref = torch.linalg.lstsq(k, u[:, None], driver="gelsd", rcond=1e-10).solution[:, 0]
    assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-8)
    assert torch.allclose(solve_psd(k[None], u[None])[0], ours)


def test_solve_psd_general_matches_lstsq():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4, 3, 6, generator=g, dtype=torch.float64)
    k = x @ x.transpose(-1, -2)
    u = torch.randn(7, 4, 3, generator=g, dtype=torch.float64)
    ours = solve_psd(k, u)
    ref = torch.linalg.lstsq(k, u[..., None]).solution[..., 0]
    assert torch.allclose(ours, ref, rtol=1e-8, atol=1e-8)


def test_selection_follows_gradient_norm():
    # One tile with a single group carrying all the gradient: every sampler must pick it.
    grad = torch.zeros(8, 8, dtype=torch.float64)
    grad[5, 4:8] = torch.tensor([1.0, -2.0, 0.5, 3.0])
    for sel in ["l1-random", "l2-random", "l1-greedy"]:
        rows, groups = select_groups(grad, 8, 4, sel, torch.Generator().manual_seed(1))
        assert (int(rows), int(groups)) == (5, 1)


def test_l1_random_frequencies():
    grad = torch.zeros(4, 4, dtype=torch.float64)
    grad[0, :4] = 1.0  # L1 = 4
    grad[2, :4] = torch.tensor([3.0, 3.0, 3.0, 3.0])  # L1 = 12
    gen = torch.Generator().manual_seed(0)
    picks = [int(select_groups(grad, 4, 4, "l1-random", gen)[0]) for _ in range(4000)]
    frac_row2 = sum(r == 2 for r in picks) / len(picks)
    assert frac_row2 == pytest.approx(0.75, abs=0.03)
    assert set(picks) == {0, 2}


def _two_by_three_tiles(n, m, d_b_mult, seed):
    """A random 2×3-tile problem with its grams and exact core gradient (float64)."""
    d_b = m * d_b_mult * 2
    w_bar, h = random_layer(2 * d_b, 3 * d_b, seed=seed)
    a, b, core, mask = random_factors(2 * d_b, 3 * d_b, d_b, n, m, seed=seed + 1)
    a_gram, b_gram = block_grams(a, b, h)
    grad = core_gradient(w_bar - reconstruct_normalized(a, core, b), a, b, h)
    return d_b, w_bar, h, a, b, core, mask, a_gram, b_gram, grad


@settings(max_examples=20, deadline=None)
@given(nm=st.sampled_from([(2, 4), (1, 4), (4, 8)]), d_b_mult=st.integers(1, 2), seed=st.integers(0, 1000))
def test_incremental_gradient_matches_autograd(nm, d_b_mult, seed):
    """Many sequential group updates with rank-one gradient updates keep the gradient exact."""
    n, m = nm
    d_b, w_bar, h, a, b, core, mask, a_gram, b_gram, grad = _two_by_three_tiles(n, m, d_b_mult, seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(25):
        rows, groups = select_groups(grad, d_b, m, "l1-random", gen)
        sparse_core_step(core, mask, a_gram, b_gram, grad, n, m, rows, groups, update_grad=True)
    leaf = core.clone().requires_grad_(True)
    loss = ((w_bar - reconstruct_normalized(a, leaf, b)) ** 2 * h).sum()
    (auto,) = torch.autograd.grad(loss, leaf)
    assert torch.allclose(grad, auto, rtol=1e-8, atol=1e-8)


@settings(max_examples=20, deadline=None)
@given(nm=st.sampled_from([(2, 4), (1, 4), (4, 8)]), d_b_mult=st.integers(1, 2), k_steps=st.integers(1, 12),
       selection=st.sampled_from(["l1-random", "random", "l1-greedy"]), seed=st.integers(0, 1000))
def test_batched_steps_equal_sequential_steps_with_exact_gradient(nm, d_b_mult, k_steps, selection, seed):
    """K steps chosen up front, each corrected to the exact gradient on its group, give what K
    plain steps with a fully updated gradient give (repeated groups included)."""
    n, m = nm
    d_b, w_bar, h, a, b, core, mask, a_gram, b_gram, grad = _two_by_three_tiles(n, m, d_b_mult, seed)
    rows, groups = select_groups(grad, d_b, m, selection, torch.Generator().manual_seed(seed), num=k_steps)
    assert rows.shape == groups.shape == (k_steps, 2, 3)

    start_core = core.clone()
    ref_core, ref_mask, ref_grad = core.clone(), mask.clone(), grad.clone()
    ref_gain = torch.zeros(2, 3, dtype=core.dtype)
    for k in range(k_steps):
        ref_gain += sparse_core_step(ref_core, ref_mask, a_gram, b_gram, ref_grad, n, m, rows[k], groups[k],
                                     update_grad=True)
    stale = grad.clone()
    gain = sparse_core_steps(core, mask, a_gram, b_gram, grad, n, m, rows, groups)
    assert torch.equal(grad, stale)  # the input gradient is not touched
    assert torch.equal(mask, ref_mask)
    assert torch.allclose(core, ref_core, rtol=1e-9, atol=1e-10)
    assert torch.allclose(gain, ref_gain, rtol=1e-7, atol=1e-9)
    # and the reported gains are the true decrease of the proxy loss
    decrease = _loss(w_bar, a, start_core, b, h) - _loss(w_bar, a, core, b, h)
    assert float(decrease) == pytest.approx(float(gain.sum()), rel=1e-6, abs=1e-9)
    assert float(gain.min()) >= 0


@settings(max_examples=15, deadline=None)
@given(nm=st.sampled_from([(2, 4), (1, 4), (4, 8)]), seed=st.integers(0, 1000))
def test_group_decrease_is_each_groups_own_step(nm, seed):
    """The decrease predicted for every group equals what a sparse-core step on that group
    alone (one tile at a time, all others untouched) actually removes from the loss."""
    n, m = nm
    d_b, w_bar, h, a, b, core, mask, a_gram, b_gram, grad = _two_by_three_tiles(n, m, 1, seed)
    predicted = group_decrease(core, grad, a_gram, b_gram, n, m)
    assert predicted.shape == (2 * d_b, 3 * d_b // m) and float(predicted.min()) >= 0
    start = _loss(w_bar, a, core, b, h)
    actual = torch.zeros_like(predicted)
    for row in range(2 * d_b):
        for grp in range(3 * d_b // m):
            i, j = row // d_b, (grp * m) // d_b
            rows = torch.zeros(2, 3, dtype=torch.long)
            groups = torch.zeros(2, 3, dtype=torch.long)
            rows[i, j], groups[i, j] = row % d_b, grp % (d_b // m)
            c, mk = core.clone(), mask.clone()
            sparse_core_step(c, mk, a_gram, b_gram, grad.clone(), n, m, rows, groups)
            # only tile (i, j) is meant to move: undo the others (they re-solved group 0, row 0)
            keep = torch.zeros_like(mk)
            keep[i * d_b:(i + 1) * d_b, j * d_b:(j + 1) * d_b] = True
            c = torch.where(keep, c, core)
            actual[row, grp] = start - _loss(w_bar, a, c, b, h)
    assert torch.allclose(predicted, actual, rtol=1e-6, atol=1e-9)


def test_decrease_greedy_and_mixed_selection():
    # block 8, M = 4: a 8×16 matrix is two tiles, each row of a tile holds 2 groups
    decrease = torch.zeros(8, 4, dtype=torch.float64)
    decrease[3, 1], decrease[6, 0], decrease[0, 1] = 5.0, 4.0, 3.0  # tile 0
    decrease[2, 3] = 1.0  # tile 1: row 2, its group 1
    grad = torch.zeros(8, 16, dtype=torch.float64)
    grad[7, 12:16] = 1.0  # tile 1's gradient sits in row 7, group 1; tile 0 has none
    gen = torch.Generator().manual_seed(0)
    rows, groups = select_groups(grad, 8, 4, "decrease-greedy", gen, num=3, decrease=decrease)
    assert rows.shape == groups.shape == (3, 1, 2)
    assert [(int(r), int(g)) for r, g in zip(rows[:, 0, 0], groups[:, 0, 0])] == [(3, 1), (6, 0), (0, 1)]
    assert (int(rows[0, 0, 1]), int(groups[0, 0, 1])) == (2, 1)
    rows, groups = select_groups(grad, 8, 4, "mixed", gen, num=3, decrease=decrease)
    assert (int(rows[0, 0, 0]), int(groups[0, 0, 0])) == (3, 1)  # 3 // 2 = 1 greedy pick first
    assert (int(rows[0, 0, 1]), int(groups[0, 0, 1])) == (2, 1)
    assert rows[1:, 0, 1].tolist() == [7, 7] and groups[1:, 0, 1].tolist() == [1, 1]  # then l1-random
    rows, groups = select_groups(grad, 8, 4, "mixed", gen, decrease=decrease)  # one draw: l1-random
    assert (int(rows[0, 1]), int(groups[0, 1])) == (7, 1)
    with pytest.raises(ValueError, match="decrease"):
        select_groups(grad, 8, 4, "mixed", gen, num=2)
