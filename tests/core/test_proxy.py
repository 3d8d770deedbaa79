import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_armor.core.proxy import nowag_prune, proxy_loss, relative_proxy_loss
from torch_armor.core.pattern import auto_block_size
from torch_armor.core.proxy import normalize_weight, validate_layer

from _helpers import check_mask, random_layer


def test_normalize_roundtrip_and_norms():
    w, _ = random_layer(12, 20)
    w_bar, r, c = normalize_weight(w)
    assert torch.allclose(r[:, None] * w_bar * c, w)
    # rows of W_bar have unit norm; the columns of W diag(1/c) have unit norm
    assert torch.allclose(w_bar.norm(dim=1), torch.ones(12, dtype=w.dtype))
    assert torch.allclose((w / c).norm(dim=0), torch.ones(20, dtype=w.dtype))


def test_normalize_zero_rows_and_columns():
    w, _ = random_layer(6, 8)
    w[:, 3] = 0
    w[2] = 0
    w_bar, r, c = normalize_weight(w)
    assert torch.isfinite(w_bar).all()
    assert torch.allclose(r[:, None] * w_bar * c, w)


def _naive_nowag(w, h, n, m):
    w_bar, _, _ = normalize_weight(w)
    score = w_bar**2 * h
    mask = torch.zeros_like(w, dtype=torch.bool)
    for i in range(w.shape[0]):
        for g in range(0, w.shape[1], m):
            order = sorted(range(m), key=lambda k: -float(score[i, g + k]))
            for k in order[:n]:
                mask[i, g + k] = True
    return mask


@settings(max_examples=25, deadline=None)
@given(d_out=st.integers(1, 9), groups=st.integers(1, 5), nm=st.sampled_from([(1, 2), (2, 4), (3, 4), (4, 8), (2, 8)]),
       seed=st.integers(0, 1000))
def test_nowag_matches_naive_and_pattern(d_out, groups, nm, seed):
    n, m = nm
    w, h = random_layer(d_out, groups * m, seed)
    mask, pruned = nowag_prune(w, h, f"{n}:{m}")
    assert torch.equal(mask, _naive_nowag(w, h, n, m))
    assert check_mask(mask, f"{n}:{m}")
    assert torch.equal(pruned, w * mask)


def test_nowag_is_optimal_elementwise_pruning():
    # With W_hat restricted to W ⊙ mask, NoWag-P minimizes the proxy loss over all 2:4 masks.
    w, h = random_layer(2, 8, seed=3)
    mask, pruned = nowag_prune(w, h, "2:4")
    best = proxy_loss(w, pruned, h)
    supports = [s for s in itertools.combinations(range(4), 2)]
    for choice in itertools.product(supports, repeat=4):  # 2 rows x 2 groups
        m = torch.zeros(2, 8, dtype=torch.bool)
        for idx, sup in enumerate(choice):
            row, grp = divmod(idx, 2)
            for k in sup:
                m[row, grp * 4 + k] = True
        assert proxy_loss(w, w * m, h) >= best - 1e-12


def test_nowag_unstructured_keeps_fraction_per_row():
    w, h = random_layer(5, 40)
    mask, _ = nowag_prune(w, h, "unstructured:0.75")
    assert (mask.sum(1) == 10).all()


def test_proxy_loss_definition():
    w, h = random_layer(7, 12, seed=1)
    approx = w + 0.1 * torch.randn_like(w)
    c = w.norm(dim=0)
    r = (w / c).norm(dim=1)
    expected = sum(
        float(((w[i, j] - approx[i, j]) / (r[i] * c[j])) ** 2 * h[j]) for i in range(7) for j in range(12)
    )
    assert float(proxy_loss(w, approx, h)) == pytest.approx(expected, rel=1e-10)


def test_relative_proxy_loss_of_nowag_is_one():
    w, h = random_layer(8, 16)
    _, pruned = nowag_prune(w, h)
    assert relative_proxy_loss(w, pruned, h) == pytest.approx(1.0)
    assert relative_proxy_loss(w, w, h) == 0.0


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda w, h: (w[0], h), "2-D"),
        (lambda w, h: (w.to(torch.int32), h), "dtype"),
        (lambda w, h: (w.to(torch.complex64), h), "dtype"),
        (lambda w, h: (w.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("nan"), dtype=w.dtype)), h), "NaN"),
        (lambda w, h: (w.index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(float("inf"), dtype=w.dtype)), h), "NaN or Inf"),
        (lambda w, h: (w, h.index_put((torch.tensor([0]),), torch.tensor(float("nan"), dtype=h.dtype))), "act_sq_norm"),
        (lambda w, h: (w, -h), "negative"),
        (lambda w, h: (w, torch.zeros_like(h)), "calibration"),
        (lambda w, h: (w, h[:-1]), "shape"),
        (lambda w, h: (w[:, :-2], h[:-2]), "multiple of M"),
    ],
)
def test_validate_layer_errors(make, match):
    w, h = random_layer(8, 16)
    bad_w, bad_h = make(w, h)
    with pytest.raises(ValueError, match=match) as info:
        validate_layer(bad_w, bad_h, "2:4", name="model.layers.0.q_proj")
    assert "model.layers.0.q_proj" in str(info.value)


def test_validate_block_size_suggests_fix():
    w, h = random_layer(24, 48)
    with pytest.raises(ValueError, match=r"\[4, 8, 12, 24\]"):
        validate_layer(w, h, "2:4", block_size=16)


# ------------------------------------------------------------------ auto block size


def brute_force_block_size(d_out, d_in, max_overhead, multiple_of):
    best = None
    for b in range(1, min(d_out, d_in) + 1):
        if d_out % b == 0 and d_in % b == 0 and b % multiple_of == 0:
            if b * (d_in + d_out) / (d_in * d_out) <= max_overhead:
                best = b
    return best


@pytest.mark.parametrize("multiple_of", [1, 2, 4, 8])
@pytest.mark.parametrize("max_overhead", [0.01, 0.025, 0.05, 0.1, 0.3])
def test_auto_block_size_matches_brute_force(multiple_of, max_overhead):
    g = torch.Generator().manual_seed(multiple_of * 1000 + int(max_overhead * 1000))
    dims = [4, 8, 12, 16, 24, 64, 96, 192, 576, 768, 1536, 4096]
    shapes = [(a, b) for a in dims for b in dims]
    shapes += [tuple(int(v) for v in torch.randint(1, 700, (2,), generator=g)) for _ in range(60)]
    for d_out, d_in in shapes:
        want = brute_force_block_size(d_out, d_in, max_overhead, multiple_of)
        if want is None:
            with pytest.raises(ValueError, match="block size"):
                auto_block_size(d_out, d_in, max_overhead, multiple_of)
        else:
            assert auto_block_size(d_out, d_in, max_overhead, multiple_of) == want, (d_out, d_in)


def test_auto_block_size_smollm2_shapes():
    # q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536 at 5%
    assert auto_block_size(576, 576, 0.05) == 12
    assert auto_block_size(192, 576, 0.05) == 4
    assert auto_block_size(1536, 576, 0.05) == 16
    assert auto_block_size(576, 1536, 0.05) == 16
    assert auto_block_size(4096, 4096, 0.05) == 64


def test_auto_block_size_errors():
    with pytest.raises(ValueError, match="smallest valid one, 4, costs"):
        auto_block_size(8, 8, 0.05, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        auto_block_size(12, 12, 0.9, 8)
    with pytest.raises(ValueError, match="max_overhead"):
        auto_block_size(64, 64, 0.0)
    with pytest.raises(ValueError, match="d_out"):
        auto_block_size(0, 64, 0.05)


def test_for_layer_resolves_block_sizes_of_a_model_and_checks_shapes():
    """ArmorConfig.for_layer on every linear of a model (the successor of the pipeline's
    armor_layer_configs): fixed sizes kept, "auto" within the overhead budget, a bad shape named."""
    from torch import nn

    from torch_armor import ArmorConfig
    from torch_armor.config.armor import BcdConfig

    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 48), nn.Linear(30, 8))

    def configs(names, cfg):
        return {n: cfg.for_layer(*model.get_submodule(n).weight.shape, name=n) for n in names}

    cfgs = configs(["0", "1"], ArmorConfig(block_size=16, optimizer=BcdConfig()))
    assert [c.block_size for c in cfgs.values()] == [16, 16]
    auto = configs(["0", "1"], ArmorConfig(block_size="auto", max_overhead=0.5))
    for name, cfg in auto.items():
        d_out, d_in = model.get_submodule(name).weight.shape
        assert cfg.block_size == auto_block_size(d_out, d_in, 0.5, 4)
        assert d_out % cfg.block_size == 0 and d_in % cfg.block_size == 0
        assert cfg.block_size * (d_out + d_in) <= 0.5 * d_out * d_in
    with pytest.raises(ValueError, match="'2'"):
        configs(["2"], ArmorConfig(block_size=16))
