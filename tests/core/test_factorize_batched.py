import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_armor import ArmorConfig
from torch_armor.config.armor import AdamConfig, BcdConfig
from torch_armor.core.factorize import factorize
from torch_armor.core.factorize_batched import factorize_batched, serial_reason
from torch_armor.core.sparse_core import select_groups, selection_uniforms
from torch_armor.errors import ArmorInputError

from _helpers import check_mask, random_layer


def _experts(n_exp: int, d_out: int, d_in: int, seed: int, dtype=torch.float32):
    layers = [random_layer(d_out, d_in, seed=seed + e, dtype=dtype) for e in range(n_exp)]
    return torch.stack([w for w, _ in layers]), torch.stack([h for _, h in layers])


def _assert_same(batched, serial):
    """Bit-identical factors, masks, loss history and best iterate (the serial path is the reference)."""
    assert len(batched) == len(serial)
    for fb, fs in zip(batched, serial):
        for key in ("a_blocks", "core", "b_blocks", "mask", "history", "history_iters"):
            assert torch.equal(getattr(fb, key), getattr(fs, key)), key
        assert fb.best_iter == fs.best_iter and fb.nowag_loss == fs.nowag_loss
        assert check_mask(fb.mask, "2:4")


@settings(max_examples=12, deadline=None)
@given(n_exp=st.integers(1, 4), tiles=st.tuples(st.integers(1, 3), st.integers(1, 3)), seed=st.integers(0, 10**6),
       iters=st.integers(0, 5), selection=st.sampled_from([None, "l1-random", "l2-random", "l1-greedy",
                                                           "decrease-greedy"]),
       log_every=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_batched_equals_serial(n_exp, tiles, seed, iters, selection, log_every, dtype):
    w, h = _experts(n_exp, 8 * tiles[0], 8 * tiles[1], seed, dtype)
    cfg = ArmorConfig(block_size=8, seed=seed % 97, dtype=dtype,
                      optimizer=BcdConfig(iters=iters, selection=selection, log_every=log_every))
    serial = [factorize(w[e], h[e], cfg) for e in range(n_exp)]
    _assert_same(factorize_batched(w, h, cfg), serial)


def test_batched_with_refinement_equals_serial():
    w, h = _experts(3, 16, 32, seed=5)
    xs = [torch.randn(40, 32, generator=torch.Generator().manual_seed(e)) for e in range(3)]
    xtxs = [x.T @ x for x in xs]
    h = torch.stack([x.square().sum(0) for x in xs])
    cfg = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=3))
    serial = [factorize(w[e], h[e], cfg, xtx=xtxs[e]) for e in range(3)]
    batched = factorize_batched(w, h, cfg, xtxs=xtxs)
    _assert_same(batched, serial)
    assert all(f.refined for f in batched)


@pytest.mark.parametrize("opt", [AdamConfig(iters=3), BcdConfig(iters=3, tol=0.1), BcdConfig(iters=3, time_budget_s=60),
                                 BcdConfig(iters=3, selection="random")])
def test_unsupported_configs_fall_back_to_the_serial_loop(opt):
    cfg = ArmorConfig(block_size=8, optimizer=opt)
    assert serial_reason(cfg) is not None
    w, h = _experts(2, 8, 16, seed=1)
    _assert_same(factorize_batched(w, h, cfg), [factorize(w[e], h[e], cfg) for e in range(2)])


def test_default_config_is_batched():
    assert serial_reason(ArmorConfig()) is None


def test_expert_with_zero_loss_falls_back():
    w, h = _experts(2, 8, 16, seed=2)
    w[1] = 0.0  # NoWag-P is already exact: the serial path skips the optimizer for it
    cfg = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2))
    _assert_same(factorize_batched(w, h, cfg), [factorize(w[e], h[e], cfg) for e in range(2)])


def test_mismatched_statistics_name_the_cause():
    with pytest.raises(ArmorInputError, match="act_sq_norms"):
        factorize_batched(torch.randn(3, 8, 16), torch.rand(2, 16))


@pytest.mark.parametrize("rule", ["l1-random", "l2-random", "mixed", "decrease-greedy"])
def test_pre_drawn_uniforms_select_the_same_groups(rule):
    grad = torch.randn(16, 32)
    decrease = torch.rand(16, 8)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    direct = select_groups(grad, 8, 4, rule, g1, num=3, decrease=decrease)
    uniform = selection_uniforms(rule, 2 * 4, 3, g2, grad.device, grad.dtype)
    drawn = select_groups(grad, 8, 4, rule, None, num=3, decrease=decrease, uniform=uniform)
    assert all(torch.equal(x, y) for x, y in zip(direct, drawn))


def test_many_experts_run_in_chunks_with_the_same_result(monkeypatch):
    import torch_armor.core.factorize_batched as batched_module  # patched: a chunk of two experts

    monkeypatch.setattr(batched_module, "MAX_BATCH_ELEMENTS", 2 * 8 * 16)
    w, h = _experts(5, 8, 16, seed=3)
    cfg = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=3))
    _assert_same(factorize_batched(w, h, cfg), [factorize(w[e], h[e], cfg) for e in range(5)])
