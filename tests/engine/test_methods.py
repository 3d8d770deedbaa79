"""The method registry: a config's type picks the code, the names map to config types in one
place, each method declares what it needs, and a method registered from outside runs through
prune_model like the built-in ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_tiny_llama
from torch_armor import ArmorConfig, MagnitudeConfig, NoWagConfig, PruneOptions, SparseGPTConfig, WandaConfig, prune_model
from torch_armor.config.armor import ReconstructConfig
from torch_armor.engine.methods import config_for_method
from torch_armor.calibration.observer import LayerStatistics
from torch_armor.core import baselines
from torch_armor.config.methods import MethodConfig
from torch_armor.core.proxy import nowag_prune
from torch_armor.engine.methods import METHODS, Method, ModelPass, ModelPassRun, method_for, method_names, register_method
from torch_armor.engine.runner import solve_layer


def _layer(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 32, generator=g)
    return torch.randn(16, 32, generator=g), LayerStatistics(x.square().sum(0), 64, x.T @ x)


@pytest.mark.parametrize("config, direct", [
    (MagnitudeConfig(), lambda w, s: baselines.magnitude_prune(w, "2:4")),
    (WandaConfig(pattern="4:8"), lambda w, s: baselines.wanda_prune(w, s.act_sq_norm, "4:8")),
    (NoWagConfig(), lambda w, s: nowag_prune(w, s.act_sq_norm, "2:4")),
    (SparseGPTConfig(block_size=16, damp=0.05), lambda w, s: baselines.sparsegpt_prune(w, s.xtx, "2:4", 16, 0.05)),
])
def test_a_config_runs_its_method(config, direct):
    w, stats = _layer()
    sol = solve_layer(w, stats, config, "fc")
    mask, pruned = direct(w, stats)
    assert torch.equal(sol.mask, mask) and torch.equal(sol.payload, pruned)
    assert sol.method is method_for(config) and method_for(config).config_type is type(config)


def test_names_map_to_config_types_in_one_place():
    assert method_names() == ("magnitude", "wanda", "sparsegpt", "nowag", "armor")
    for name in method_names():
        config = config_for_method(name)
        assert method_for(config).name == name and type(config) is method_for(config).config_type
    assert config_for_method("sparsegpt", damp=0.2) == SparseGPTConfig(damp=0.2)
    with pytest.raises(ValueError, match="method must be one of"):
        config_for_method("dense")
    with pytest.raises(ValueError, match="method config"):
        method_for(object())


def test_what_each_method_needs():
    assert not METHODS[MagnitudeConfig].needs_statistics and METHODS[WandaConfig].needs_statistics
    assert METHODS[SparseGPTConfig].needs_xtx(SparseGPTConfig()) and not METHODS[WandaConfig].needs_xtx(WandaConfig())
    armor = METHODS[ArmorConfig]
    assert armor.stores_layers and not METHODS[NoWagConfig].stores_layers
    assert armor.needs_xtx(ArmorConfig()) and armor.block_targets(ArmorConfig(), sequential=True) == "block"
    off = ArmorConfig(refine=None, reconstruct=None)
    assert not armor.needs_xtx(off) and armor.block_targets(off, sequential=True) is None
    assert armor.needs_xtx(dataclasses.replace(off, reconstruct=ReconstructConfig()))  # reports output losses


@dataclasses.dataclass(frozen=True)
class HalfMagnitudeConfig(MethodConfig):
    """A method from outside the package: magnitude pruning with every kept weight halved."""

    pattern: str = "2:4"


def test_a_registered_method_runs_through_prune_model():
    @register_method(HalfMagnitudeConfig, name="half-magnitude", label="half magnitude", needs_statistics=False)
    def _half(weight, stats, config, name=""):
        mask, pruned = baselines.magnitude_prune(weight, config.pattern)
        return mask, pruned / 2

    try:
        model, reference = make_tiny_llama(), make_tiny_llama()
        report = prune_model(model, torch.randint(0, 128, (2, 8)), HalfMagnitudeConfig(),
                             options=PruneOptions(progress=False))
        assert report.method == "half-magnitude" and len(report.layers) == 14
        dense = reference.model.layers[0].mlp.up_proj.weight.detach()
        _, want = baselines.magnitude_prune(dense, "2:4")
        assert torch.equal(model.model.layers[0].mlp.up_proj.weight.detach(), want / 2)
    finally:
        METHODS.pop(HalfMagnitudeConfig, None)


@dataclasses.dataclass(frozen=True)
class HookedConfig(MethodConfig):
    """A method from outside the package that uses every hook of the engine."""

    pattern: str = "2:4"


class _HookedPass(ModelPass):
    def __init__(self, calls):
        self.calls = calls

    def before_blocks(self, plan, run):
        self.calls.append(("before_blocks", len(plan.blocks), len(plan.batches)))
        return _HookedRun(plan.batches, 0, self.calls)


@dataclasses.dataclass
class _HookedRun(ModelPassRun):
    calls: list = dataclasses.field(default_factory=list)

    def after_model(self, model, report):
        self.calls.append(("after_model", len(report.layers)))
        report.stages["distillation"] = {"hooked": True}


class _Hooked(Method):
    calls: list = []

    def plan(self, config, run, inputs, by_block):
        self.calls.append(("plan", [len(names) for names in by_block]))
        return config

    def block_targets(self, config, sequential):
        return "block"

    def after_block(self, index, block, layers, stats, solutions, configs, data, run, report):
        inputs, targets = data
        self.calls.append(("after_block", index, sorted(solutions), len(inputs), len(targets)))
        for sol in solutions.values():
            sol.payload = sol.payload / 2
        return solutions

    def model_pass(self, config, batches, *, streamed):
        return _HookedPass(self.calls)


def test_the_engine_calls_every_hook_of_a_registered_method_and_names_none():
    """The loop runs a method it has never heard of through its hooks: the plan before the block pass, the
    whole-model pass around it, after_block on every block with the block's inputs and the dense block's
    outputs (and what after_block returns is what the model gets)."""
    register_method(HookedConfig, name="hooked", needs_statistics=False, kind=_Hooked)(
        lambda weight, stats, config, name="": baselines.magnitude_prune(weight, config.pattern))
    _Hooked.calls = calls = []
    try:
        model, reference = make_tiny_llama(), make_tiny_llama()
        calib = torch.randint(0, 128, (3, 8), generator=torch.Generator().manual_seed(0))
        report = prune_model(model, calib, HookedConfig(), options=PruneOptions(progress=False, batch_size=1))
        assert report.stages["distillation"] == {"hooked": True}
        per_block = sorted(f"model.layers.{{}}.{n}" for n in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj",
                                                             "self_attn.k_proj", "self_attn.o_proj",
                                                             "self_attn.q_proj", "self_attn.v_proj"))
        assert calls == [("before_blocks", 2, 3), ("plan", [7, 7]),
                         ("after_block", 0, [n.format(0) for n in per_block], 3, 3),
                         ("after_block", 1, [n.format(1) for n in per_block], 3, 3), ("after_model", 14)]
        dense = reference.model.layers[1].self_attn.q_proj.weight.detach()
        _, want = baselines.magnitude_prune(dense, "2:4")
        assert torch.equal(model.model.layers[1].self_attn.q_proj.weight.detach(), want / 2)
    finally:
        METHODS.pop(HookedConfig, None)


@dataclasses.dataclass(frozen=True)
class ScaledConfig(MethodConfig):
    """A method from outside the package whose result is a type of its own."""

    pattern: str = "2:4"


@dataclasses.dataclass
class _Scaled:
    """A pruned weight kept as ``scale · unit`` (the method's own payload)."""

    unit: torch.Tensor
    scale: float


class _ScaledMethod(Method):
    def solution(self, name, result, seconds=None):
        return super().solution(name, ((result.unit != 0), result), seconds)

    def approximation(self, payload):
        return payload.unit * payload.scale

    def apply_solution(self, solution, module, storage):
        module.weight = torch.nn.Parameter(self.approximation(solution.payload), requires_grad=False)

    def report_fields(self, payload):
        return {"shape": tuple(payload.unit.shape), "details": {"iterations": 7}}


def test_a_method_of_its_own_payload_runs_through_prune_model():
    """The engine carries a layer's solution without reading it: the method says what it approximates,
    how it is written into the module and what the report shows of it."""
    def solve(weight, stats, config, name=""):
        _, pruned = baselines.magnitude_prune(weight, config.pattern)
        return _Scaled(pruned / 4, 2.0)

    register_method(ScaledConfig, name="scaled", needs_statistics=False, kind=_ScaledMethod)(solve)
    try:
        model, reference = make_tiny_llama(), make_tiny_llama()
        report = prune_model(model, torch.randint(0, 128, (2, 8)), ScaledConfig(), options=PruneOptions(progress=False))
        dense = reference.model.layers[0].mlp.up_proj.weight.detach()
        _, want = baselines.magnitude_prune(dense, "2:4")
        assert torch.equal(model.model.layers[0].mlp.up_proj.weight.detach(), want / 2)
        layer = next(r for r in report.layers if r.name == "model.layers.0.mlp.up_proj")
        assert layer.details == {"iterations": 7} and layer.shape == tuple(dense.shape)
        assert layer.relative_proxy_loss > 1  # not reported by the method: the engine measured it (÷ NoWag-P's)
    finally:
        METHODS.pop(ScaledConfig, None)
