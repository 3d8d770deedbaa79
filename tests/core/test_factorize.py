import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_armor import ArmorConfig
from torch_armor.config.armor import AdamConfig, BcdConfig
from torch_armor.core.factorize import factorize
from torch_armor.core.proxy import nowag_prune, proxy_loss, relative_proxy_loss
from torch_armor.core.proxy import normalize_weight

from _helpers import block_diag_dense, check_mask, random_layer


def _optimizer(name: str, iters: int, lr: float = 1e-4):
    """The optimizer config of a parametrized test: Adam with ``lr``, or BCD (which has no learning rate)."""
    return AdamConfig(iters=iters, lr=lr) if name == "adam" else BcdConfig(iters=iters)


def test_zero_iterations_is_nowag():
    w, h = random_layer(16, 32, dtype=torch.float32)
    f = factorize(w, h, ArmorConfig(block_size=8, optimizer=BcdConfig(iters=0)))
    mask, pruned = nowag_prune(w, h)
    assert torch.equal(f.mask, mask)
    assert torch.allclose(f.dense(), pruned, atol=1e-6)
    assert f.history.tolist() == [1.0]


@pytest.mark.parametrize("opt", ["adam", "bcd"])
def test_dense_equals_independent_formula(opt):
    w, h = random_layer(16, 24, dtype=torch.float32)
    f = factorize(w, h, ArmorConfig(block_size=8, optimizer=_optimizer(opt, 30, lr=1e-2)))
    w64 = w.double()
    c = w64.norm(dim=0)
    r = (w64 / c).norm(dim=1)
    a_raw = f.a_blocks.double() / r.reshape(2, 8, 1)
    b_raw = f.b_blocks.double() / c.reshape(3, 1, 8)
    w_prime = f.core.double() / 1.0
    expected = torch.diag(r) @ block_diag_dense(a_raw) @ (w_prime * f.mask) @ block_diag_dense(b_raw) @ torch.diag(c)
    assert torch.allclose(f.dense().double(), expected, atol=1e-5)
    assert torch.all(f.core[~f.mask] == 0)


@pytest.mark.parametrize("opt", ["adam", "bcd"])
def test_history_matches_independent_loss_and_improves(opt):
    w, h = random_layer(32, 64, dtype=torch.float32)
    f = factorize(w, h, ArmorConfig(block_size=16, optimizer=_optimizer(opt, 60, lr=3e-3)))
    assert f.history[0] == 1.0
    assert f.relative_loss < 0.9
    assert relative_proxy_loss(w, f.dense(), h) == pytest.approx(f.relative_loss, rel=1e-4)
    assert f.history.min() == pytest.approx(float(f.history[int(torch.nonzero(f.history_iters == f.best_iter)[0])]))


@settings(max_examples=12, deadline=None)
@given(p=st.integers(1, 3), q=st.integers(1, 3), d_b=st.sampled_from([4, 8, 16]),
       pattern=st.sampled_from(["2:4", "1:4", "3:4", "4:8", "unstructured:0.5"]),
       lr=st.sampled_from([1e-4, 1e-2, 1.0]), seed=st.integers(0, 1000), opt=st.sampled_from(["adam", "bcd"]))
def test_pattern_and_never_worse_than_nowag(p, q, d_b, pattern, lr, seed, opt):
    if pattern == "4:8" and d_b == 4:
        d_b = 8
    w, h = random_layer(p * d_b, q * d_b, seed=seed, dtype=torch.float32)
    f = factorize(w, h, ArmorConfig(block_size=d_b, pattern=pattern, seed=seed, optimizer=_optimizer(opt, 8, lr=lr)))
    assert check_mask(f.mask, pattern)
    assert torch.all(f.core[~f.mask] == 0)
    _, pruned = nowag_prune(w, h, pattern)
    # lr=1.0 makes Adam diverge: the best-iterate rule must still hold
    assert float(proxy_loss(w, f.dense(), h)) <= float(proxy_loss(w, pruned, h)) * (1 + 1e-4)


@pytest.mark.parametrize("opt", ["adam", "bcd"])
def test_unstructured_keeps_nowag_mask(opt):
    w, h = random_layer(16, 32, dtype=torch.float32)
    f = factorize(w, h, ArmorConfig(block_size=8, pattern="unstructured:0.5", optimizer=_optimizer(opt, 20, lr=1e-2)))
    mask, _ = nowag_prune(w, h, "unstructured:0.5")
    assert torch.equal(f.mask, mask)
    assert f.relative_loss < 1.0


@pytest.mark.parametrize("opt", ["adam", "bcd"])
def test_deterministic_bit_identical(opt):
    w, h = random_layer(32, 32, dtype=torch.float32)
    cfg = ArmorConfig(block_size=8, seed=5, optimizer=_optimizer(opt, 25, lr=1e-3))
    f1, f2 = factorize(w, h, cfg), factorize(w, h, cfg)
    for name in ("a_blocks", "b_blocks", "core", "mask", "history"):
        assert torch.equal(getattr(f1, name), getattr(f2, name)), name
    f3 = factorize(w, h, ArmorConfig(block_size=8, seed=6, optimizer=_optimizer(opt, 25, lr=1e-3)))
    assert not torch.equal(f1.mask, f3.mask) or not torch.equal(f1.core, f3.core)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("opt", ["adam", "bcd"])
def test_half_precision_optimized_in_fp32(dtype, opt):
    w, h = random_layer(16, 32, dtype=torch.float32)
    f = factorize(w.to(dtype), h, ArmorConfig(block_size=8, optimizer=_optimizer(opt, 20, lr=1e-2)))
    assert f.a_blocks.dtype == f.core.dtype == f.b_blocks.dtype == dtype
    f32 = factorize(w.to(dtype).float(), h, ArmorConfig(block_size=8, optimizer=_optimizer(opt, 20, lr=1e-2)))
    assert torch.equal(f.mask, f32.mask)
    assert torch.allclose(f.core.float(), f32.core, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("opt", ["adam", "bcd"])
def test_zero_variance_channels_are_pruned_first(opt):
    w, h = random_layer(8, 16, dtype=torch.float32)
    h[[1, 2, 3]] = 0  # never active in calibration
    f = factorize(w, h, ArmorConfig(block_size=8, optimizer=_optimizer(opt, 5, lr=1e-3)))
    assert not f.mask[:, [1, 2, 3]].any(dim=0).all()
    assert f.relative_loss <= 1.0


def test_already_sparse_weight_is_exact():
    w, h = random_layer(8, 16, dtype=torch.float32)
    mask, pruned = nowag_prune(w, h)
    f = factorize(pruned, h, ArmorConfig(block_size=8, optimizer=BcdConfig(iters=5)))
    assert torch.allclose(f.dense(), pruned, atol=1e-6)


def test_bad_inputs_name_the_layer():
    w, h = random_layer(24, 48, dtype=torch.float32)
    with pytest.raises(ValueError, match="blocks.3.mlp") as info:
        factorize(w, h, ArmorConfig(block_size=16), name="blocks.3.mlp")
    assert "[4, 8, 12, 24]" in str(info.value)
    with pytest.raises(ValueError, match="2-D"):
        factorize(w[0], h, ArmorConfig(block_size=8))
    with pytest.raises(ValueError, match="calibration"):
        factorize(w, torch.zeros_like(h), ArmorConfig(block_size=8))


def _reference_adam(w, h, cfg):
    """Slow, obviously-correct paper recipe with autograd, in the lean order
    (sparse-core step, then Adam step, each iteration) and the same random stream."""
    from torch_armor.core.factorize import reconstruct_normalized
    from torch_armor.core.proxy import mask_from_scores, nowag_scores
    from torch_armor.core.sparse_core import block_grams, core_gradient, select_groups, sparse_core_step

    w_bar, _, _ = normalize_weight(w)
    mask = mask_from_scores(nowag_scores(w_bar, h), cfg.pattern).contiguous()
    d_b = cfg.block_size
    eye = torch.eye(d_b, dtype=w.dtype)
    a = eye.repeat(w.shape[0] // d_b, 1, 1).requires_grad_(True)
    b = eye.repeat(w.shape[1] // d_b, 1, 1).requires_grad_(True)
    wp = (w_bar * mask).clone().requires_grad_(True)
    opt = torch.optim.Adam([a, b, wp], lr=cfg.optimizer.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    losses = []
    for _ in range(cfg.optimizer.iterations):
        with torch.no_grad():
            s = (wp * mask).contiguous()
            grad = core_gradient(w_bar - reconstruct_normalized(a, s, b), a, b, h).contiguous()
            rows, groups = select_groups(grad, d_b, 4, cfg.optimizer.selection_rule, gen)
            sparse_core_step(s, mask, *block_grams(a, b, h), grad, 2, 4, rows, groups)
            wp.copy_(torch.where(mask, s, wp))
        loss = ((w_bar - reconstruct_normalized(a, wp * mask, b)) ** 2 * h).sum()
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.tensor(losses, dtype=torch.float64)


def test_lean_adam_matches_autograd_reference():
    w, h = random_layer(32, 48, seed=4)
    cfg = ArmorConfig(block_size=16, dtype=torch.float64, seed=2, optimizer=AdamConfig(iters=40, lr=3e-3))
    f = factorize(w, h, cfg)
    ref = _reference_adam(w, h, cfg)
    ours = f.history[1:-1] * f.nowag_loss  # post-sparse losses at iterations 1..n-1
    assert torch.allclose(ours, ref[1:], rtol=1e-9)


def test_adam_decrease_greedy_takes_each_tiles_best_group_first():
    """adam with "decrease-greedy": the sparse step of iteration 2 (after one Adam step from
    NoWag-P, replayed here with autograd and torch.optim.Adam) removes exactly each tile's
    largest group decrease at that point."""
    from torch_armor.core.factorize import reconstruct_normalized
    from torch_armor.core.proxy import mask_from_scores, nowag_scores
    from torch_armor.core.sparse_core import block_grams, core_gradient, group_decrease

    w, h = random_layer(16, 24, seed=5)
    cfg = ArmorConfig(block_size=8, dtype=torch.float64, optimizer=AdamConfig(selection="decrease-greedy", iters=2, lr=1e-2))
    f = factorize(w, h, cfg)

    w_bar, _, _ = normalize_weight(w.double())
    mask = mask_from_scores(nowag_scores(w_bar, h), cfg.sparsity)
    eye = torch.eye(8, dtype=torch.float64)
    a, b, w_prime = (eye.repeat(2, 1, 1).requires_grad_(), eye.repeat(3, 1, 1).requires_grad_(),
                     (w_bar * mask).requires_grad_())
    loss = ((w_bar - reconstruct_normalized(a, w_prime * mask, b)) ** 2 * h).sum()
    nowag = float(loss)
    loss.backward()
    torch.optim.Adam([a, b, w_prime], lr=cfg.optimizer.lr).step()  # iteration 1's sparse step is a no-op at NoWag-P
    a, b, core = a.detach(), b.detach(), (w_prime * mask).detach()
    residual = w_bar - reconstruct_normalized(a, core, b)
    decrease = group_decrease(core, core_gradient(residual, a, b, h), *block_grams(a, b, h), 2, 4)
    best_per_tile = float(decrease.reshape(2, 8, 3, 2).amax((1, 3)).sum())
    assert best_per_tile > 1e-4 * nowag  # the step does something
    expected = (float((residual ** 2 * h).sum()) - best_per_tile) / nowag
    recorded = dict(zip(f.history_iters.tolist(), f.history.tolist()))
    assert recorded[1] == pytest.approx(expected, rel=1e-8)
