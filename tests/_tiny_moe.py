"""Tiny random mixture-of-experts models with ARMOR experts, and their slow dense reference.

``armor_moe(arch)`` builds a random model of ``arch`` (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE: all
fused 3-D experts in transformers 5), factorizes every expert ``P[e]`` of every fused parameter
with torch_armor's per-layer factorizer on random activation statistics, installs them with
``armor_experts_from_factors`` and returns ``(model, reference)``: ``reference`` is the same model
whose 3-D parameters are the dense stacks ``torch.stack([f.dense() for f in factors])`` (per-expert
``A·core·B``), run through the model's own eager experts forward (the slow reference of MOE.md).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Dict, Tuple

import torch
from torch import nn

from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.core.factorize import factorize
from torch_armor.tensor.experts import armor_experts_from_factors
from torch_armor.format.hf import attach_quantizer

ARCHS = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe")
#: calibration token ids (8 windows of 16, vocabulary 64) and the ids logits are compared on
CALIB = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
_SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


def make_moe(arch: str, seed: int = 0, experts: int = 4, vocab: int = 64) -> nn.Module:
    """A random ``arch`` causal LM: hidden 32, expert width 16, ``experts`` experts, top-2 (eager experts)."""
    import transformers  # local: the architectures are looked up by name

    small = dict(_SMALL, vocab_size=vocab)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**small, head_dim=8, intermediate_size=64, moe_intermediate_size=16,
                                          num_experts=experts, num_experts_per_tok=2, decoder_sparse_step=1)
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "mixtral":
        cfg = transformers.MixtralConfig(**small, intermediate_size=16, num_local_experts=experts,
                                         num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    elif arch == "olmoe":
        cfg = transformers.OlmoeConfig(**small, intermediate_size=16, num_experts=experts, num_experts_per_tok=2)
        cls = transformers.OlmoeForCausalLM
    elif arch == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**small, intermediate_size=64, moe_intermediate_size=16,
                                          shared_expert_intermediate_size=32, num_experts=experts,
                                          num_experts_per_tok=2, decoder_sparse_step=1)
        cls = transformers.Qwen2MoeForCausalLM
    else:
        raise ValueError(arch)
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    return widen(cls(cfg))


def widen(model: nn.Module) -> nn.Module:
    """``model`` in eval mode with every weight of 2 or more dimensions redrawn from N(0, 0.3²): the
    default init (std 0.02) routes and predicts almost uniformly."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.eval()


def widened(model_class: type, config: object, seed: int = 0) -> nn.Module:
    """A random ``model_class(config)`` (seeded), through :func:`widen`."""
    torch.manual_seed(seed)
    return widen(model_class(config))


def logits_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def experts_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """``{path: module}`` of every fused experts module (the ones holding 3-D ``gate_up_proj``/``down_proj``)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m._parameters.get("gate_up_proj"), torch.Tensor) and m._parameters["gate_up_proj"].dim() == 3}


@functools.lru_cache(maxsize=None)
def _factors(arch: str, seed: int, experts: int, block_size: int, vocab: int):
    model = make_moe(arch, seed, experts, vocab)
    conf = ArmorConfig(block_size=block_size, optimizer=BcdConfig(iters=2), refine=None, reconstruct=None)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for path, module in experts_modules(model).items():
        for pname in EXPERT_PARAMS:
            p = module._parameters[pname].detach()
            out[f"{path}.{pname}"] = [factorize(p[e], torch.rand(p.shape[2], generator=gen) + 0.1, conf,
                                                name=f"{path}.{pname}.{e}") for e in range(p.shape[0])]
    return out


def armor_moe(arch: str, seed: int = 0, experts: int = 4, block_size: int = 8, implementation: str = "armor",
              vocab: int = 64) -> Tuple[nn.Module, nn.Module]:
    """``(model with ARMOR experts, dense slow reference)`` of a random ``arch`` model (factors cached)."""
    model = make_moe(arch, seed, experts, vocab)
    reference = copy.deepcopy(model)
    factors = _factors(arch, seed, experts, block_size, vocab)
    for fqn, fs in factors.items():
        path, _, pname = fqn.rpartition(".")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            armor_experts_from_factors(model.get_submodule(path), pname, fs, name=fqn)
        dense = torch.stack([f.dense() for f in fs]).to(torch.float32)
        reference.get_submodule(path)._parameters[pname] = nn.Parameter(dense, requires_grad=False)
    model.set_experts_implementation(implementation)
    reference.set_experts_implementation("eager")
    return attach_quantizer(model), reference


def armor_and_magnitude_errors(make, calib: torch.Tensor, ids: torch.Tensor, armor: ArmorConfig,
                               layers, pruned=None) -> Dict[str, float]:
    """``{"armor", "magnitude": mean squared logit error against the dense model}`` after pruning ``layers``
    of a fresh ``make()`` with each; every selected layer (a list of names), or every name of ``pruned``,
    must be in the report, and no other."""
    from torch_armor.engine.methods import config_for_method
    from torch_armor.engine.prune import PruneOptions, prune_model

    want = logits_of(make(), ids)
    errors = {}
    for method in ("magnitude", "armor"):
        model = make()
        config = armor if method == "armor" else config_for_method(method)
        report = prune_model(model, calib, config, layers=layers, options=PruneOptions(progress=False))
        expected = pruned if pruned is not None else None if layers is None or isinstance(layers, str) else layers
        if expected is not None:
            assert sorted(r.name for r in report.layers) == sorted(expected), method
        errors[method] = float((logits_of(model, ids) - want).pow(2).mean())
    return errors


def assert_saves_and_loads_bit_identically(model: nn.Module, directory, ids: torch.Tensor) -> None:
    """``save_pretrained`` then ``load_pretrained`` and ``AutoModelForCausalLM.from_pretrained`` give the
    very same logits."""
    from transformers import AutoModelForCausalLM

    from torch_armor import load_pretrained, save_pretrained

    logits = logits_of(model, ids)
    save_pretrained(model, directory)
    assert torch.equal(logits_of(load_pretrained(directory).eval(), ids), logits)
    assert torch.equal(logits_of(AutoModelForCausalLM.from_pretrained(directory).eval(), ids), logits)


def reconstruction_errors(model: nn.Module, calib: torch.Tensor) -> Dict[int, Tuple[float, float]]:
    """``report.stages["reconstruction"]["errors"]`` (``{block: (error before, after)}``) of an ARMOR prune of ``model``
    with a short block reconstruction (block size 8), checked to cover every block and never to get worse."""
    from torch_armor.config.armor import ReconstructConfig
    from torch_armor.engine.prune import PruneOptions, prune_model

    config = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=None, distill=None,
                         reconstruct=ReconstructConfig(steps=4, held_out=2))
    errors = prune_model(model, calib, config, options=PruneOptions(progress=False)).stages["reconstruction"]["errors"]
    assert sorted(errors) == list(range(len(errors))) and len(errors) >= 2, errors
    assert all(after <= before for before, after in errors.values()), errors
    return errors


def stored_factors(run_dir, name: str):
    """The ArmorFactors of layer ``name`` stored in ``run_dir``, checked to have a 2:4 core."""
    from pathlib import Path

    from safetensors.torch import load_file

    from torch_armor.core.factors import ArmorFactors

    t = load_file(str(Path(run_dir) / "layers" / f"{name}.safetensors"))
    f = ArmorFactors(t["a_blocks"], t["core"], t["b_blocks"], t["mask"].bool())
    assert bool((f.mask.reshape(f.mask.shape[0], -1, 4).sum(-1) == 2).all()), name
    assert bool((f.core[~f.mask] == 0).all()), name
    return f


def install_stored_factors(reference: nn.Module, run_dir, names, transposed: bool = False) -> None:
    """Check that every layer of ``names`` stored in ``run_dir`` has a 2:4 core, and write its
    ``A·core·B`` into ``reference`` (expert ``e`` of a fused parameter as ``P[e]``, or ``P[e].T`` for a
    ``transposed`` layout such as gpt-oss's)."""
    from torch_armor.calibration.experts import split_expert_name

    for n in names:
        f = stored_factors(run_dir, n)
        split = split_expert_name(n)
        if split is None:
            reference.get_submodule(n).weight.data = f.dense()
        else:
            reference.get_parameter(split[0]).data[split[1]] = f.dense().T if transposed else f.dense()


@functools.lru_cache(maxsize=None)
def moe_table_tool():
    """``tools/moe_table.py`` as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("moe_table", Path(__file__).resolve().parents[1] / "tools" / "moe_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
