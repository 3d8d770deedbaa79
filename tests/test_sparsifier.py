"""Tests for torch_armor.sparsifier: the prepare → calibrate → step → convert shell.

ArmorSparsifier runs tiny BCD budgets on small layers; with a baseline's config the same class is
checked against the direct pruning functions on statistics recomputed here from the calibration inputs.
"""

from __future__ import annotations

import copy
import doctest
import logging
import warnings

import pytest
import torch
from torch import nn

import torch_armor.armor.method as runner_module  # where the ARMOR method calls factorize
import torch_armor.sparsifier as sparsifier_module
from torch_armor.core import baselines
from torch_armor import ArmorConfig, MagnitudeConfig, SparseGPTConfig, WandaConfig
from torch_armor.config.armor import BcdConfig
from torch_armor.engine.methods import config_for_method
from torch_armor.core.factors import ArmorFactors
from torch_armor.core.proxy import nowag_prune
from torch_armor.sparsifier import ArmorSparsifier
from torch_armor.tensor.armor_tensor import ArmorTensor

FAST_CONFIG = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2))
FAST = dict(progress=False)
LAYERS = ["0.weight", "2.weight", "4.weight", "6.weight"]
PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: thread hand-offs cost more than they save on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """Four prunable linears (16-divisible shapes) and a head."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(),
        nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 8),
    ).to(dtype)


def calib_batches(seed: int = 1, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 8, 32, generator=g).to(dtype), torch.randn(24, 32, generator=g).to(dtype)]


def per_sweep(cfg: ArmorConfig) -> int:
    """The sparse-core group updates per sweep a config's layer gets (derived from its block size)."""
    return cfg.optimizer.group_updates_per_sweep(cfg.block_size)


def prepared(model: nn.Module, calibrate: bool = True, config: ArmorConfig = FAST_CONFIG, **kwargs) -> ArmorSparsifier:
    sp = ArmorSparsifier(config, **{**FAST, **kwargs})
    sp.prepare(model, [{"tensor_fqn": f} for f in LAYERS])
    if calibrate:
        with torch.no_grad():
            for x in calib_batches():
                model(x)
    return sp


def no_hooks(module: nn.Module) -> bool:
    return not module._forward_pre_hooks and not module._forward_pre_hooks_with_kwargs


def assert_plain(obj, where="state") -> None:
    """Only what torch.load(weights_only=True) is meant for: tensors, str, numbers, lists, dicts."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert isinstance(k, str), where
            assert_plain(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            assert_plain(v, f"{where}[{i}]")
    else:
        assert obj is None or type(obj) in (torch.Tensor, str, int, float, bool), f"{where}: {type(obj)}"


def armor_parts(w: ArmorTensor) -> list[torch.Tensor]:
    return [w.a_blocks, w.b_blocks, w.core_dense()]


# --- layer selection ---------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_default_layers_skip_head_and_tied(tiny_llama_factory, tie):
    model = tiny_llama_factory(tie=tie)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    sp = ArmorSparsifier(FAST_CONFIG, **FAST)
    sp.prepare(model)
    expected = [f"model.layers.{i}.{p}.weight" for i in range(2) for p in PROJ]
    assert [g["tensor_fqn"] for g in sp.groups] == expected
    assert no_hooks(model.lm_head)
    assert not no_hooks(model.model.layers[0].mlp.down_proj)
    with torch.no_grad():
        ref = model(torch.arange(16)[None] % 128).logits
        model(torch.randint(0, 128, (2, 12)))
    model = sp.convert(model)
    assert all(isinstance(model.get_submodule(f[: -len(".weight")]).weight, ArmorTensor) for f in expected)
    assert type(model.lm_head.weight) is nn.Parameter and not isinstance(model.lm_head.weight, ArmorTensor)
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(no_hooks(m) for m in model.modules())
    with torch.no_grad():
        out = model(torch.arange(16)[None] % 128).logits
    assert out.shape == ref.shape and torch.isfinite(out).all()


def test_linear_subclass_included():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    sp = ArmorSparsifier(FAST_CONFIG, **FAST)
    sp.prepare(model)
    assert [g["tensor_fqn"] for g in sp.groups] == ["0.weight", "2.weight"]
    model(torch.randn(20, 32))
    sp.convert(model)
    assert isinstance(model[0], MyLinear) and isinstance(model[0].weight, ArmorTensor)


def test_prepare_config_errors():
    model = make_mlp()
    sp = ArmorSparsifier(FAST_CONFIG, **FAST)
    with pytest.raises(ValueError, match="no module 'nope'"):
        sp.prepare(model, [{"tensor_fqn": "nope.weight"}])
    with pytest.raises(ValueError, match="'1.weight'.*nn.Linear"):
        sp.prepare(model, [{"tensor_fqn": "1.weight"}])  # a ReLU
    with pytest.raises(ValueError, match="unknown per-layer options \\['blocksize'\\]"):
        sp.prepare(model, [{"tensor_fqn": "0.weight", "blocksize": 16}])
    with pytest.raises(ValueError, match="twice"):
        sp.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "0.weight"}])
    with pytest.raises(ValueError, match="'0.weight'.*invalid per-layer setting.*optimizer"):
        sp.prepare(model, [{"tensor_fqn": "0.weight", "optimizer": "sgd"}])
    assert all(no_hooks(m) for m in model.modules())  # failed prepares attach nothing


def test_prepare_twice_replaces_hooks():
    model = make_mlp()
    sp = ArmorSparsifier(FAST_CONFIG, **FAST)
    sp.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
    sp.prepare(model, [{"tensor_fqn": "2.weight"}])
    assert no_hooks(model[0]) and len(model[2]._forward_pre_hooks) == 1


# --- configuration -----------------------------------------------------------------------------
def test_settings_only_in_the_config():
    """ArmorSparsifier takes its settings in the config; keyword overrides are no call form."""
    cfg = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=50))
    with pytest.raises(TypeError, match="num_iters"):
        ArmorSparsifier(cfg, num_iters=3)
    with pytest.raises(TypeError, match="block_size"):
        ArmorSparsifier(block_size=16)
    with pytest.raises(ValueError, match="storage"):
        ArmorSparsifier(storage="sparse")
    with pytest.raises(ValueError, match=r"config must be a method config \(.*ArmorConfig\(\).*\), got str"):
        ArmorSparsifier("armor")  # the config's type is the method: a method name is no config


def _largest_block(d_out: int, d_in: int, max_overhead: float, group: int = 4):
    """Brute force: the largest multiple of ``group`` dividing both dims within ``max_overhead`` (None: none)."""
    fits = [d for d in range(group, min(d_out, d_in) + 1, group)
            if d_out % d == 0 and d_in % d == 0 and d * (d_in + d_out) <= max_overhead * d_in * d_out]
    return max(fits, default=None)


def test_a_layer_the_block_size_does_not_fit_is_refused_when_strict():
    model = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 64))
    sp = ArmorSparsifier(ArmorConfig(block_size=32, optimizer=BcdConfig(iters=2)), strict=True, progress=False)
    with pytest.raises(ValueError) as err:
        sp.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
    msg = str(err.value)
    assert "'0'" in msg and "block_size=32" in msg and "16" in msg and "'block_size'" in msg and "\n" not in msg
    assert no_hooks(model[0]) and no_hooks(model[2])


@pytest.mark.parametrize("max_overhead", [0.5, 0.9])
def test_a_layer_the_block_size_does_not_fit_gets_the_largest_that_does(max_overhead):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 64))
    sp = ArmorSparsifier(ArmorConfig(block_size=32, max_overhead=max_overhead, optimizer=BcdConfig(iters=2)),
                         progress=False)
    with pytest.warns(UserWarning, match=r"1 layer\(s\) the settings do not fit.*0\.weight") as caught:
        sp.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
    assert caught[0].filename == __file__  # the warning points at the caller's prepare()
    want = _largest_block(32, 48, max_overhead)
    assert sp.config_for("0.weight").block_size == want and sp.config_for("2.weight").block_size == 32
    assert sp.unfit_layers["0.weight"].startswith(f"block size {want}: block_size=32 does not divide")
    model(torch.randn(40, 48))
    sp.convert(model)
    assert model[0].weight.block_size == want and model[2].weight.block_size == 32


def test_a_layer_nothing_fits_stays_dense_and_unhooked():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 64))
    dense = model[0].weight.detach().clone()
    sp = ArmorSparsifier(ArmorConfig(block_size=32, optimizer=BcdConfig(iters=2)), progress=False)
    with pytest.warns(UserWarning, match=r"0\.weight \(1\): dense: .*within 5\.0% wrapper overhead"):
        sp.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
    assert _largest_block(32, 48, 0.05) is None and no_hooks(model[0]) and not no_hooks(model[2])
    with pytest.raises(KeyError, match="'0.weight' is left dense: dense: block_size=32"):
        sp.config_for("0.weight")
    model(torch.randn(40, 48))
    sp.convert(model)
    assert type(model[0].weight) is nn.Parameter and torch.equal(model[0].weight, dense)
    assert isinstance(model[2].weight, ArmorTensor)
    nothing = ArmorSparsifier(ArmorConfig(block_size=32), progress=False)
    with pytest.raises(ValueError, match="fit none of the 1 prepared layers.*'0.weight'"):
        nothing.prepare(nn.Sequential(nn.Linear(48, 32)), [{"tensor_fqn": "0.weight"}])


def test_a_per_layer_block_size_override():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 64))
    sp = ArmorSparsifier(ArmorConfig(block_size=32, optimizer=BcdConfig(iters=2)), strict=True, progress=False)
    sp.prepare(model, [{"tensor_fqn": "0.weight", "block_size": 16}, {"tensor_fqn": "2.weight"}])
    assert sp.config_for("0.weight").block_size == 16 and not sp.unfit_layers
    assert per_sweep(sp.config_for("0.weight")) == per_sweep(ArmorConfig(block_size=16))
    assert per_sweep(sp.config_for("2.weight")) == per_sweep(ArmorConfig(block_size=32))
    model(torch.randn(40, 48))
    sp.convert(model)
    assert model[0].weight.block_size == 16 and model[2].weight.block_size == 32


@pytest.mark.parametrize("config", [ArmorConfig(block_size=64), ArmorConfig(block_size=64, max_overhead=0.6),
                                    ArmorConfig(block_size=32, block_sizes={"*.mlp.*": 128}),
                                    WandaConfig(pattern="2:4"), ArmorConfig(block_size="auto", max_overhead=0.2)])
def test_the_sparsifier_fits_layers_as_prune_model_plans_them(tiny_llama_factory, config):
    """The sparsifier and plan_prune decide every layer alike: the same settings, the same layers left dense."""
    from torch_armor.engine.plan import plan_prune

    model = tiny_llama_factory()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_prune(model, torch.randint(0, 128, (2, 8)), config)
        sp = ArmorSparsifier(config, progress=False)
        sp.prepare(model)
    assert {f"{n}.weight": why for n, why in plan.unfit.items()} == sp.unfit_layers
    assert [f"{n}.weight" for n in plan.names] == [g["tensor_fqn"] for g in sp.groups]
    def settings(cfg):  # the fallbacks of other layers aside (the plan's config holds every layer's)
        return {k: v for k, v in vars(cfg).items() if k != "block_sizes"}

    for name in plan.names:
        want = plan.config.for_layer(*model.get_submodule(name).weight.shape, name=name)
        assert settings(sp.config_for(f"{name}.weight")) == settings(want)
    assert plan.unfit or not isinstance(getattr(config, "block_size", None), int)  # each integer block size leaves some layer unfit


# --- calibration -------------------------------------------------------------------------------
def test_calibration_streams_fp32_from_bf16_inputs():
    model = make_mlp(dtype=torch.bfloat16)
    sp = prepared(model, calibrate=False)
    batches = calib_batches(dtype=torch.bfloat16)
    with torch.no_grad():
        for x in batches:
            model(x)
    stats = sp.statistics("0.weight")
    ref = sum(x.reshape(-1, 32).double().square().sum(0) for x in batches)
    assert stats.act_sq_norm.dtype == torch.float32 and stats.num_tokens == 4 * 8 + 24
    torch.testing.assert_close(stats.act_sq_norm.double(), ref, rtol=1e-6, atol=0)
    # the fp32 sum differs from what a bf16 accumulator would give
    assert not torch.equal(stats.act_sq_norm, sum(x.reshape(-1, 32).square().sum(0) for x in batches).float())
    sp.convert(model)
    assert model[0].weight.dtype == torch.bfloat16
    assert model(batches[0]).dtype == torch.bfloat16


def test_step_without_calibration_names_layer():
    sp = prepared(make_mlp(), calibrate=False)
    with pytest.raises(ValueError, match="layer '0.weight' saw no calibration data"):
        sp.step()
    assert not sp.factors
    with pytest.raises(ValueError, match="nothing prepared"):
        ArmorSparsifier(FAST_CONFIG, **FAST).step()


# --- step / convert / squash -------------------------------------------------------------------
def test_convert_in_place_outputs_and_errors(caplog):
    model = make_mlp()
    dense = copy.deepcopy(model)
    sp = prepared(model)
    with caplog.at_level(logging.INFO, logger="torch_armor"):
        out = sp.convert(model)
    assert out is model
    for fqn in LAYERS:
        assert f"{fqn}: output loss " in caplog.text  # refined by default: the output loss, not the proxy
    x = torch.randn(5, 7, 32)
    h = x
    for i, layer in enumerate(model):
        if isinstance(layer, nn.Linear) and f"{i}.weight" in LAYERS:
            w_hat = sp.factors[f"{i}.weight"].dense()
            assert isinstance(layer.weight, ArmorTensor)
            assert torch.equal(layer.bias, dense[i].bias)
            torch.testing.assert_close(layer(h), h @ w_hat.T + layer.bias, rtol=1e-5, atol=1e-5)
        h = layer(h)
        assert no_hooks(layer)
    with pytest.raises(ValueError, match="already converted"):
        sp.convert(model)
    with pytest.raises(ValueError, match="already converted.*'0'.*reload"):
        ArmorSparsifier(FAST_CONFIG, **FAST).prepare(model)
    with pytest.raises(ValueError, match="already converted"):
        sp.prepare(model, [{"tensor_fqn": "0.weight"}])
    with pytest.raises(ValueError, match="did not prepare"):
        prepared(make_mlp()).convert(nn.Sequential(nn.Linear(32, 32)))


def test_step_logs_and_on_layer_done():
    calls = []
    sp = prepared(make_mlp(), on_layer_done=lambda fqn, sol: calls.append((fqn, sol)))
    sp.step()
    assert [c[0] for c in calls] == LAYERS
    assert all(isinstance(sol.payload, ArmorFactors) and sol.payload is sp.factors[fqn] for fqn, sol in calls)
    sp.step()  # nothing left to do
    assert len(calls) == len(LAYERS)
    with pytest.raises(ValueError, match="on_layer_done"):
        ArmorSparsifier(on_layer_done="print")


def test_step_shows_progress_bar(capsys):
    sp = prepared(make_mlp(), progress=True)
    sp.step()
    err = capsys.readouterr().err
    assert "ArmorSparsifier" in err and f"{len(LAYERS)}/{len(LAYERS)}" in err


def test_squash_mask_leaves_plain_dense():
    model = make_mlp()
    sp = prepared(model)
    sp.squash_mask()  # runs step() itself
    for fqn in LAYERS:
        layer = model.get_submodule(fqn[: -len(".weight")])
        assert type(layer.weight) is nn.Parameter and type(layer.weight.data) is torch.Tensor
        assert torch.equal(layer.weight.data, sp.factors[fqn].dense())
        assert no_hooks(layer)
    model(torch.randn(3, 32))  # plain forward, no statistics hooks fire
    assert sp.statistics("0.weight").num_tokens == 56


# --- save / resume -----------------------------------------------------------------------------
def test_state_dict_weights_only_roundtrip_bit_identical(tmp_path, monkeypatch):
    model = make_mlp()
    dense = copy.deepcopy(model)
    sp = prepared(model)
    sp.step()
    state = sp.state_dict()
    assert_plain(state)
    torch.save(state, tmp_path / "sp.pt")
    sp.convert(model)

    def boom(*args, **kwargs):
        raise AssertionError("factorize must not run when every layer was loaded")

    monkeypatch.setattr(runner_module, "factorize", boom)
    fresh = ArmorSparsifier(FAST_CONFIG, **FAST)
    fresh.prepare(dense, [{"tensor_fqn": f} for f in LAYERS])
    fresh.load_state_dict(torch.load(tmp_path / "sp.pt", weights_only=True))
    assert torch.equal(fresh.statistics("2.weight").act_sq_norm, sp.statistics("2.weight").act_sq_norm)
    fresh.convert(dense)
    for fqn in LAYERS:
        name = fqn[: -len(".weight")]
        a, b = model.get_submodule(name).weight, dense.get_submodule(name).weight
        assert all(torch.equal(x, y) for x, y in zip(armor_parts(a), armor_parts(b)))
        assert torch.equal(fresh.factors[fqn].history, sp.factors[fqn].history)
    x = torch.randn(6, 32)
    assert torch.equal(model(x), dense(x))
    assert all(no_hooks(m) for m in dense.modules())


def test_resume_computes_only_unfinished_layers(tmp_path, monkeypatch):
    reference = prepared(make_mlp())
    reference.step()

    class Stop(Exception):
        pass

    def checkpoint(fqn, solution):  # save after every layer, die after the second
        torch.save(interrupted.state_dict(), tmp_path / "ckpt.pt")
        if fqn == LAYERS[1]:
            raise Stop

    interrupted = prepared(make_mlp(), on_layer_done=checkpoint)
    with pytest.raises(Stop):
        interrupted.step()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert [f for f in LAYERS if "factors" in saved["state"][f]] == LAYERS[:2]

    seen = []
    real = runner_module.factorize

    def counting(weight, h, config, xtx=None, name=None):
        seen.append(name)
        return real(weight, h, config, xtx=xtx, name=name)

    monkeypatch.setattr(runner_module, "factorize", counting)
    model = make_mlp()
    resumed = prepared(model, calibrate=False)  # no new calibration: statistics come from the file
    resumed.load_state_dict(saved)
    resumed.convert(model)
    assert seen == LAYERS[2:]
    for fqn in LAYERS:
        assert torch.equal(resumed.factors[fqn].dense(), reference.factors[fqn].dense())


def test_calibration_after_load_adds_to_loaded_statistics():
    sp = prepared(make_mlp())
    state = sp.state_dict()
    model = make_mlp()
    fresh = prepared(model)  # calibrated too: loading replaces what it saw
    fresh.load_state_dict(state)
    assert fresh.statistics("0.weight").num_tokens == 56
    x = torch.randn(10, 32)
    model(x)
    stats = fresh.statistics("0.weight")
    assert stats.num_tokens == 66
    torch.testing.assert_close(stats.act_sq_norm, state["state"]["0.weight"]["act_sq_norm"] + x.square().sum(0))


def test_load_state_dict_errors(caplog):
    sp = prepared(make_mlp())
    sp.step()
    state = sp.state_dict()
    other_settings = prepared(make_mlp(), config=ArmorConfig(block_size=16, optimizer=BcdConfig(iters=3)))
    with caplog.at_level(logging.WARNING, logger="torch_armor"):
        other_settings.load_state_dict(state)
    assert "0.weight: loaded result was computed with different settings {'optimizer.iters': 2}" in caplog.text
    with pytest.raises(ValueError, match="prepare"):
        ArmorSparsifier(FAST_CONFIG, **FAST).load_state_dict(state)
    other = ArmorSparsifier(WandaConfig(), progress=False)
    other.prepare(make_mlp(), [{"tensor_fqn": f} for f in LAYERS])
    with pytest.raises(ValueError, match=r"comes from ArmorSparsifier\(method='armor'\).*not ArmorSparsifier\(method='wanda'\)"):
        other.load_state_dict(state)
    partial = ArmorSparsifier(FAST_CONFIG, **FAST)
    partial.prepare(make_mlp(), [{"tensor_fqn": "0.weight"}])
    with pytest.raises(ValueError, match="unexpected \\['2.weight'"):
        partial.load_state_dict(state)
    partial.load_state_dict(state, strict=False)
    assert list(partial.factors) == ["0.weight"]
    wrong = ArmorSparsifier(FAST_CONFIG, **FAST)
    wrong.prepare(nn.Sequential(nn.Linear(32, 32)), [{"tensor_fqn": "0.weight"}])
    with pytest.raises(ValueError, match="'0.weight'.*different model"):
        wrong.load_state_dict(state, strict=False)


def test_state_from_other_weights_is_refused(tmp_path):
    sp = prepared(make_mlp())
    sp.step()
    torch.save(sp.state_dict(), tmp_path / "sp.pt")
    state = torch.load(tmp_path / "sp.pt", weights_only=True)
    assert list(state["weight_hashes"]) == LAYERS
    changed = make_mlp()
    with torch.no_grad():
        changed[4].weight[3, 5] += 1e-3  # same shapes, one weight differs
    other = prepared(changed, calibrate=False)
    with pytest.raises(ValueError) as err:
        other.load_state_dict(state)
    msg = str(err.value)
    assert "'4.weight'" in msg and "other weights" in msg and "prepare() the model the state was saved from" in msg
    assert "\n" not in msg and "'0.weight'" not in msg
    assert not other.factors and other.statistics("0.weight").num_tokens == 0  # nothing was loaded
    recast = prepared(make_mlp(dtype=torch.bfloat16), calibrate=False)  # the dtype is part of the identity
    with pytest.raises(ValueError, match="'0.weight'.*other weights"):
        recast.load_state_dict(state)
    same = prepared(make_mlp(), calibrate=False)
    same.load_state_dict(state)
    assert list(same.factors) == LAYERS
    assert torch.equal(same.statistics("4.weight").act_sq_norm, sp.statistics("4.weight").act_sq_norm)
    pruning = ArmorSparsifier(MagnitudeConfig(), progress=False)
    pruning.prepare(make_mlp(), [{"tensor_fqn": "4.weight"}])
    pruning_state = pruning.state_dict()
    pruning = ArmorSparsifier(MagnitudeConfig(), progress=False)
    pruning.prepare(changed, [{"tensor_fqn": "4.weight"}])
    with pytest.raises(ValueError, match="'4.weight'.*other weights"):
        pruning.load_state_dict(pruning_state)


def test_state_without_hashes_is_refused():
    sp = prepared(make_mlp())
    state = sp.state_dict()
    assert state["version"] == sparsifier_module.STATE_DICT_VERSION == 3
    assert state["groups"][0]["config"] == FAST_CONFIG.to_dict()  # the one serialized form, nested
    old = {k: v for k, v in state.items() if k != "weight_hashes"}
    for bad in ({**old, "version": 1}, {**state, "version": 2}, old):  # earlier forms: refused
        fresh = prepared(make_mlp(), calibrate=False)
        with pytest.raises(ValueError, match="without weight hashes.*recompute"):
            fresh.load_state_dict(bad)
        assert fresh.statistics("0.weight").num_tokens == 0


@pytest.mark.parametrize("method", ["armor", "sparsegpt", "wanda", "nowag", "magnitude"])
def test_one_sparsifier_converts_with_every_method(method):
    """One class for the torch.ao protocol whatever the config: ARMOR swaps in ArmorTensor weights, a
    baseline writes its pruned dense weight, through the same prepare → calibrate → convert."""
    config = FAST_CONFIG if method == "armor" else config_for_method(method, **({"block_size": 16} if method == "sparsegpt" else {}))
    model = make_mlp()
    dense = copy.deepcopy(model)
    sp = ArmorSparsifier(config, **FAST)
    assert sp.method_config is config
    sp.prepare(model, [{"tensor_fqn": f} for f in LAYERS])
    with torch.no_grad():
        for x in calib_batches():
            model(x)
    assert sp.convert(model) is model
    for fqn in LAYERS:
        w, original = model.get_submodule(fqn[:-7]).weight, dense.get_submodule(fqn[:-7]).weight.detach()
        if method == "armor":
            assert isinstance(w, ArmorTensor) and sp.factors[fqn].pattern == "2:4"
            approx = w.dense_weight()
        else:
            assert type(w) is nn.Parameter and not isinstance(w, ArmorTensor) and not sp.factors
            approx = w.detach()
            assert ((approx != 0).reshape(approx.shape[0], -1, 4).sum(-1) <= 2).all()  # 2:4 in the weight itself
        torch.testing.assert_close(approx, sp.approximation(fqn).to(approx.dtype), rtol=1e-5, atol=1e-6)
        assert 0 < (approx - original).norm() < original.norm()
    assert all(no_hooks(m) for m in model.modules())


# --- baselines through ArmorSparsifier -------------------------------------------------------------------------
def independent_stats(model: nn.Sequential, batches: list[torch.Tensor]) -> dict:
    """Σx² and XᵀX of every linear's input, recomputed in float64 from the calibration inputs."""
    out = {}
    for x in batches:
        h = x.reshape(-1, 32).double()
        for i, layer in enumerate(model):
            if isinstance(layer, nn.Linear):
                sq, xtx = out.get(i, (0, 0))
                out[i] = (sq + h.square().sum(0), xtx + h.T @ h)
            h = layer.double()(h)
            layer.float()
    return out


@pytest.mark.parametrize("method", ["magnitude", "wanda", "nowag", "sparsegpt"])
def test_pruning_matches_direct_functions(method, tmp_path):
    model = make_mlp()
    dense = copy.deepcopy(model)
    kwargs = {"block_size": 16} if method == "sparsegpt" else {}
    sp = ArmorSparsifier(config_for_method(method, **kwargs), progress=False)
    config = [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight", "pattern": "4:8"}, {"tensor_fqn": "4.weight"}]
    sp.prepare(model, config)
    batches = calib_batches()
    with torch.no_grad():
        for x in batches:
            model(x)
    ref = independent_stats(copy.deepcopy(dense), batches)
    assert sp.convert(model) is model
    for (i, pattern) in [(0, "2:4"), (2, "4:8"), (4, "2:4")]:
        fqn, w = f"{i}.weight", dense[i].weight.detach()
        sq, xtx = ref[i]
        if method != "magnitude":
            stats = sp.statistics(fqn)
            torch.testing.assert_close(stats.act_sq_norm.double(), sq, rtol=1e-5, atol=1e-4)
            h = stats.act_sq_norm
        if method == "magnitude":
            mask, pruned = baselines.magnitude_prune(w, pattern)
        elif method == "wanda":
            mask, pruned = baselines.wanda_prune(w, h, pattern)
        elif method == "nowag":
            mask, pruned = nowag_prune(w, h, pattern)
        else:
            mask, pruned = baselines.sparsegpt_prune(w, xtx.float(), pattern, block_size=16)
        got = model[i].weight
        assert type(got) is nn.Parameter
        if method == "sparsegpt":  # observer's fp32 XᵀX vs the float64 one: rounding only
            torch.testing.assert_close(got.data, pruned, rtol=1e-3, atol=1e-3)
        else:
            assert torch.equal(got.data, pruned)
        n, m = map(int, pattern.split(":"))
        nz = (got.data != 0).reshape(got.shape[0], -1, m).sum(-1)
        assert (nz <= n).all() and torch.equal(sp.solutions[fqn].mask, mask)
        assert (got.data[~mask] == 0).all()
    assert torch.equal(model[6].weight, dense[6].weight)
    assert all(no_hooks(mod) for mod in model.modules())
    with pytest.raises(ValueError, match="already converted"):
        sp.convert(model)


def test_sparsegpt_uses_collected_xtx_exactly():
    model = make_mlp()
    dense = copy.deepcopy(model)
    sp = ArmorSparsifier(SparseGPTConfig(block_size=16, damp=0.05), progress=False)
    sp.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
    batches = calib_batches()
    with torch.no_grad():
        for x in batches:
            model(x)
    ref = independent_stats(copy.deepcopy(dense), batches)
    xtx = {f: sp.statistics(f).xtx.clone() for f in ("0.weight", "2.weight")}
    for i in (0, 2):
        torch.testing.assert_close(xtx[f"{i}.weight"].double(), ref[i][1], rtol=1e-5, atol=1e-4)
    sp.convert(model)
    for i in (0, 2):
        _, pruned = baselines.sparsegpt_prune(dense[i].weight.detach(), xtx[f"{i}.weight"], "2:4",
                                              block_size=16, damp=0.05)
        assert torch.equal(model[i].weight.data, pruned)
    assert sp.statistics("0.weight").xtx is None  # d_in² floats released after convert


def test_pruning_options_and_resume(tmp_path):
    # the config's type is the method: a method name is no config
    with pytest.raises(ValueError, match="config must be a method config"):
        ArmorSparsifier("wanda")
    with pytest.raises(TypeError, match="damp"):
        ArmorSparsifier(WandaConfig(), damp=0.1)
    # magnitude needs no calibration
    model = make_mlp()
    sp = ArmorSparsifier(MagnitudeConfig(), progress=False)
    sp.prepare(model, [{"tensor_fqn": "0.weight"}])
    assert no_hooks(model[0])
    sp.convert(model)
    assert float((model[0].weight == 0).float().mean()) == 0.5
    # wanda without calibration names the layer
    sp = ArmorSparsifier(WandaConfig(), progress=False)
    sp.prepare(make_mlp(), [{"tensor_fqn": "2.weight"}])
    with pytest.raises(ValueError, match="'2.weight' saw no calibration"):
        sp.step()
    # save / load through weights_only
    model, dense = make_mlp(), make_mlp()
    sp = ArmorSparsifier(SparseGPTConfig(block_size=16), progress=False)
    sp.prepare(model, [{"tensor_fqn": f} for f in LAYERS])
    model(calib_batches()[1])
    state = sp.state_dict()
    assert_plain(state)
    torch.save(state, tmp_path / "p.pt")
    sp.convert(model)
    again = ArmorSparsifier(SparseGPTConfig(block_size=16), progress=False)
    again.prepare(dense, [{"tensor_fqn": f} for f in LAYERS])
    again.load_state_dict(torch.load(tmp_path / "p.pt", weights_only=True))
    again.convert(dense)
    assert all(torch.equal(model.get_submodule(f[:-7]).weight, dense.get_submodule(f[:-7]).weight) for f in LAYERS)


def test_docstring_examples_run():
    result = doctest.testmod(sparsifier_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0


def test_auto_block_size_is_resolved_per_layer():
    model = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 64))
    sp = ArmorSparsifier(ArmorConfig(block_size="auto", max_overhead=0.5, optimizer=BcdConfig(iters=1)), progress=False)
    sp.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight", "max_overhead": 0.2}])
    first, second = sp.config_for("0.weight"), sp.config_for("2.weight")
    assert first.block_size == 8 and second.block_size == 4  # largest within 50% / 20% overhead
    assert per_sweep(first) == 4 and sp.method_config.block_size == "auto"
    model(torch.randn(20, 48))
    sp.convert(model)
    assert model[0].weight.block_size == 8 and model[2].weight.block_size == 4
