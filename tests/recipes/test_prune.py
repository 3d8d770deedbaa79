"""prune_model on a tiny random Llama: every method against independent references (2:4 pattern,
magnitude top-2, NoWag-P's relative loss 1, the proxy loss from whole-model statistics), ARMOR's
wrappers and overhead, block_size="auto", errors that leave the model untouched, resuming from
finished factors without factorizing again."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from conftest import make_tiny_llama
from torch_armor import ArmorConfig, PruneOptions, WandaConfig, prune_model
from torch_armor.config.armor import BcdConfig
from torch_armor.engine.methods import config_for_method
from torch_armor.calibration.observer import collect_statistics, decoder_linear_names
from torch_armor.core.pattern import auto_block_size
from torch_armor.core.proxy import relative_proxy_loss
from torch_armor.engine.methods import method_names
from torch_armor.armor.method import wrapper_overhead
from torch_armor.engine.report import PruneReport
from torch_armor.errors import RunMismatchError
from torch_armor.tensor.armor_tensor import ArmorTensor

FAST_ARMOR = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1))
CALIB = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, no thread sync


def _approx(weight) -> torch.Tensor:
    return weight.dense_weight().detach() if isinstance(weight, ArmorTensor) else weight.detach()


def _snapshot(model) -> dict:
    """Every parameter, cloned (ArmorTensor weights materialized)."""
    return {n: _approx(p).clone() for n, p in model.named_parameters()}


def _unchanged(model, before) -> bool:
    now = dict(model.named_parameters())
    return set(now) == set(before) and all(
        type(p) is nn.Parameter and torch.equal(p.detach(), before[n]) for n, p in now.items())


def _sequential_reference_stats(pruned, names) -> dict:
    """Statistics the slow, obvious way: block 0's from a dense whole-model pass, block 1's from a
    whole-model pass of the dense model with block 0 replaced by its pruned weights."""
    dense = make_tiny_llama()
    block0 = [n for n in names if n.startswith("model.layers.0.")]
    stats = collect_statistics(dense, block0, CALIB, progress=False, track_xtx=True)
    for n in block0:
        dense.get_submodule(n).weight = nn.Parameter(_approx(pruned.get_submodule(n).weight).clone())
    stats.update(collect_statistics(dense, [n for n in names if n not in block0], CALIB, progress=False,
                                    track_xtx=True))
    return stats


def _out_loss(diff, xtx) -> float:
    return float(torch.einsum("ij,jk,ik->", diff, xtx, diff))


def _nowag_keep(w, h):
    """NoWag-P's mask the slow way: per row and group of 4, the two largest (W/(r c))² h."""
    col = w.square().sum(0).sqrt()
    row = (w / col).square().sum(1, keepdim=True).sqrt()
    return _magnitude_keep(w / (row * col) * h.sqrt())


def _magnitude_keep(w):
    groups = w.abs().reshape(w.shape[0], -1, 4)
    idx = groups.topk(2, dim=-1).indices
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, idx, True).reshape(w.shape)


@pytest.mark.parametrize("method", method_names())
def test_prune_model_every_method_gives_pattern_and_report(tiny_llama, method):
    model = tiny_llama
    names = decoder_linear_names(model)
    dense = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    config = FAST_ARMOR if method == "armor" else config_for_method(method)
    report = prune_model(model, CALIB, config, options=PruneOptions(progress=False))
    assert isinstance(report, PruneReport) and report.method == method and report.pattern == "2:4"
    assert [layer.name for layer in report.layers] == names
    stats = _sequential_reference_stats(model, names)
    for layer in report.layers:
        module = model.get_submodule(layer.name)
        assert layer.shape == tuple(module.weight.shape)
        assert math.isfinite(layer.relative_proxy_loss) and layer.relative_proxy_loss > 0
        assert layer.seconds >= 0
        want = relative_proxy_loss(dense[layer.name], _approx(module.weight), stats[layer.name].act_sq_norm, "2:4")
        assert layer.relative_proxy_loss == pytest.approx(want, rel=1e-5), layer.name
        if method == "armor":
            assert isinstance(module.weight, ArmorTensor)
            core = module.weight.core_dense()
            assert int((core.reshape(core.shape[0], -1, 4) != 0).sum(-1).max()) <= 2
            # refined in output space: ‖(W − Ŵ)Xᵀ‖² ÷ NoWag-P's, recomputed in float64, never above 1
            xtx, w = stats[layer.name].xtx.double(), dense[layer.name].double()
            nowag = w * _nowag_keep(w, stats[layer.name].act_sq_norm.double())
            want_out = _out_loss(w - _approx(module.weight).double(), xtx) / _out_loss(w - nowag, xtx)
            assert layer.relative_output_loss == pytest.approx(want_out, rel=1e-4)
            assert layer.relative_output_loss <= 1.0 + 1e-6
            assert layer.details["block_size"] == 16 and layer.extra_params == 16 * sum(layer.shape)
        else:
            w = module.weight.detach()
            assert type(module.weight) is nn.Parameter
            # at most 2 nonzeros in every group of 4, exactly half the weights zero
            assert int((w.reshape(w.shape[0], -1, 4) != 0).sum(-1).max()) <= 2
            assert float((w == 0).float().mean()) == pytest.approx(0.5, abs=1e-3)
            assert layer.extra_params == 0 and layer.details == {}
            if method == "nowag":
                assert layer.relative_proxy_loss == pytest.approx(1.0)
            if method == "magnitude":
                assert torch.equal(w != 0, _magnitude_keep(dense[layer.name]))
    if method == "armor":
        assert report.overhead == pytest.approx(wrapper_overhead(model))
        want = (sum(16 * sum(layer.shape) for layer in report.layers)
                / sum(a * b for a, b in (layer.shape for layer in report.layers)))
        assert report.overhead == pytest.approx(want)
    else:
        assert report.overhead == 0.0 and wrapper_overhead(model) == 0.0


def test_armor_beats_nowag_in_proxy_loss(tiny_llama):
    report = prune_model(tiny_llama, CALIB, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=3)), options=PruneOptions(progress=False))
    assert report.mean_relative_proxy_loss < 1.0


def test_prune_model_block_size_auto_and_errors(tiny_llama_factory):
    model = tiny_llama_factory()
    report = prune_model(model, CALIB, ArmorConfig(block_size="auto", max_overhead=0.3, optimizer=BcdConfig(iters=1)), options=PruneOptions(progress=False))
    assert len(report.layers) == 14
    for layer in report.layers:
        assert layer.details["block_size"] == auto_block_size(*layer.shape, 0.3, 4)
    model = tiny_llama_factory()
    before = _snapshot(model)
    with pytest.raises(ValueError, match="does not divide"):
        prune_model(model, CALIB, ArmorConfig(block_size=24, optimizer=BcdConfig(iters=1)), options=PruneOptions(progress=False))
    with pytest.raises(ValueError, match="no block size fits"):
        prune_model(model, CALIB, ArmorConfig(block_size="auto", max_overhead=0.01, optimizer=BcdConfig(iters=1)), options=PruneOptions(progress=False))
    with pytest.raises(ValueError, match="config must be a method config"):
        prune_model(model, CALIB, "dense")  # a method name is no config
    for bad in (CALIB.float(), CALIB[:0], CALIB[0], [], [CALIB.float()], None):
        with pytest.raises(ValueError, match="calibration must be"):
            prune_model(model, bad, WandaConfig(), options=PruneOptions(progress=False))
    # nothing was touched by the failed calls
    assert _unchanged(model, before)


def test_strict_a_layer_that_does_not_fit_fails_before_any_is_pruned(tiny_llama):
    """Block 1's MLP is 80 wide: block size 32 fits every layer of block 0 but not it (without strict
    it gets a smaller block size or stays dense: tests/engine/test_fit.py)."""
    mlp = tiny_llama.model.layers[1].mlp
    mlp.gate_proj, mlp.up_proj = nn.Linear(64, 80, bias=False), nn.Linear(64, 80, bias=False)
    mlp.down_proj = nn.Linear(80, 64, bias=False)
    before = _snapshot(tiny_llama)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate_proj.*does not divide"):
        prune_model(tiny_llama, CALIB, ArmorConfig(block_size=32, optimizer=BcdConfig(iters=1)),
                    options=PruneOptions(progress=False, strict=True))
    assert _unchanged(tiny_llama, before)


def test_prune_model_refuses_offloaded_weights_naming_the_layer(tiny_llama):
    accelerate = pytest.importorskip("accelerate")
    accelerate.cpu_offload(tiny_llama, execution_device="cpu")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj.*meta device.*reload the model"):
        prune_model(tiny_llama, CALIB, ArmorConfig(), options=PruneOptions(progress=False))


def test_finished_factors_convert_without_factorizing(monkeypatch, tmp_path, tiny_llama_factory):
    """The successor of prune(..., factors=given): layers already in the run directory are
    converted from their stored factors, not factorized again; other settings are refused."""
    import torch_armor.armor.method as methods

    names = ["model.layers.0.mlp.up_proj"]
    cfg = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2))
    first = tiny_llama_factory()
    fresh = prune_model(first, CALIB, cfg, layers=names, options=PruneOptions(run_dir=tmp_path / "run", progress=False))
    monkeypatch.setattr(methods, "factorize", lambda *a, **k: pytest.fail("factorized again"))
    model = tiny_llama_factory()
    report = prune_model(model, CALIB, cfg, layers=names, options=PruneOptions(run_dir=tmp_path / "run", progress=False))
    assert report.layers[0].relative_proxy_loss == fresh.layers[0].relative_proxy_loss
    weight = model.get_submodule(names[0]).weight
    assert isinstance(weight, ArmorTensor)
    torch.testing.assert_close(weight.dense_weight(), first.get_submodule(names[0]).weight.dense_weight(),
                               rtol=0, atol=0)
    with pytest.raises(RunMismatchError, match="block_size"):
        prune_model(tiny_llama_factory(), CALIB, ArmorConfig(block_size=32, optimizer=BcdConfig(iters=2)), layers=names, options=PruneOptions(run_dir=tmp_path / "run", progress=False))


def test_block_size_budget_spends_one_model_wide_overhead(tiny_llama_factory):
    from torch_armor.armor.allocate import layer_kind

    report = prune_model(tiny_llama_factory(), CALIB, ArmorConfig(block_size="budget", max_overhead=0.25, optimizer=BcdConfig(iters=2)), options=PruneOptions(progress=False))
    sizes = {layer.name: layer.details["block_size"] for layer in report.layers}
    extra = sum(layer.details["block_size"] * sum(layer.shape) for layer in report.layers)
    total = sum(layer.shape[0] * layer.shape[1] for layer in report.layers)
    assert extra <= 0.25 * total
    assert dict(report.settings["config"]["block_sizes"]) == sizes  # the allocation is in the report's settings
    by_kind = {}
    for name, size in sizes.items():
        by_kind.setdefault(layer_kind(name), set()).add(size)
    assert all(len(v) == 1 for v in by_kind.values())  # one measured curve per kind
    assert len({s for v in by_kind.values() for s in v}) > 1  # the budget is spent unevenly
    with pytest.raises(ValueError, match="below the smallest wrapper overhead"):
        prune_model(tiny_llama_factory(), CALIB, ArmorConfig(block_size="budget", max_overhead=0.1, optimizer=BcdConfig(iters=1)), options=PruneOptions(progress=False))
