"""Expert layers in the engine: resolving a layer name to a module or an expert slot, writing
the results of a fused expert parameter back at once, and the weights a prune leaves dense.

A fused expert parameter ``P`` ``(E, out, in)`` is E layers ``f"{P}.{e}"``
(:mod:`torch_armor.calibration.experts`); the method that solved them writes their solutions into
``P`` (:meth:`~torch_armor.engine.methods.Method.apply_experts`: a baseline's pruned weights into
``P[e]``, ARMOR all E experts as one ``(E, out, in)`` ArmorTensor parameter).

Example::

    >>> from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    >>> cfg = Qwen2MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    ...                      shared_expert_intermediate_size=32, num_hidden_layers=1,
    ...                      num_attention_heads=4, num_key_value_heads=2, num_experts=4,
    ...                      num_experts_per_tok=2, vocab_size=50)
    >>> model = Qwen2MoeForCausalLM(cfg)
    >>> type(layer_module(model, "model.layers.0.mlp.experts.down_proj.3")).__name__
    'ExpertSlot'
    >>> for line in dense_lines(dense_weights(model, prunable_names(model), "model.layers")): print(line)
    model.embed_tokens.weight: 1 dense (outside the decoder blocks)
    model.layers.*.mlp.gate.weight: 1 dense (router: routing-critical and tiny)
    model.layers.*.mlp.shared_expert_gate.weight: 1 dense (router: routing-critical and tiny)
    lm_head.weight: 1 dense (outside the decoder blocks)
    1-D weights (norms, biases): 6 dense
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from torch_armor.calibration.experts import (ExpertSlot, flat_experts_count, out_in_shape, split_expert_name,
                                             unsupported_experts)
from torch_armor.calibration.routers import moe_blocks, router_names
from torch_armor.calibration.selection import prunable_names  # noqa: F401  (doctest)
from torch_armor.errors import ArmorInputError

__all__ = ["layer_module", "write_experts", "experts_roots", "no_expert_pruned", "dense_weights", "with_dense_layers",
           "dense_lines", "group_by_param", "routed_token_lines"]

#: the entry of :func:`dense_weights` that counts norms and biases (kept last)
ONE_D_WEIGHTS = "1-D weights (norms, biases)"

def layer_module(model: nn.Module, name: str) -> Any:
    """The ``nn.Linear`` called ``name``, or an :class:`ExpertSlot` for an expert layer name."""
    split = split_expert_name(name)
    if split is not None:
        param_fqn, e = split
        module_name, attr = param_fqn.rsplit(".", 1)
        module = model.get_submodule(module_name)
        param = getattr(module, attr, None)
        if isinstance(param, torch.Tensor) and (param.dim() == 3 or flat_experts_count(module) is not None):
            count = out_in_shape(module, attr)[0]
            if not 0 <= e < count:
                raise ArmorInputError(f"layer {name!r}: {param_fqn} holds {count} experts, not {e + 1}")
            parent = model.get_submodule(module_name.rpartition(".")[0])
            return ExpertSlot(module, attr, e, name, parent=parent)
    return model.get_submodule(name)


def group_by_param(names: Sequence[str]) -> Dict[str, List[str]]:
    """``{param fqn: [its expert layer names]}`` of the expert layers among ``names``."""
    out: Dict[str, List[str]] = {}
    for n in names:
        split = split_expert_name(n)
        if split is not None:
            out.setdefault(split[0], []).append(n)
    return out


def write_experts(slots: Mapping[str, ExpertSlot], solutions: Mapping[str, Any], storage: str = "dense") -> None:
    """Write the solutions of expert layers (``{name: LayerSolution}``) into their fused parameters,
    one parameter at a time, by the method that solved them."""
    for param_fqn, names in group_by_param(list(solutions)).items():
        solved = [solutions[n] for n in names]
        solved[0].method.apply_experts(param_fqn, [slots[n] for n in names], solved, storage)


def _reason(model: nn.Module, name: str, blocks_prefix: str, routers: Sequence[str],
            unsupported: Mapping[str, str], why_dense: Mapping[str, str], experts_roots: Sequence[str]) -> str:
    owner = name.rsplit(".", 1)[0]
    if name in why_dense:
        return why_dense[name]
    if not name.startswith(blocks_prefix + "."):
        return "outside the decoder blocks"
    if owner in unsupported:
        return unsupported[owner]
    if owner in routers:
        return "router: routing-critical and tiny"
    module = model.get_submodule(owner)
    if isinstance(module, nn.Embedding):
        return "embedding: rows looked up by index (Doge's experts), not a matmul to prune"
    if any(owner == root or owner.startswith(root + ".") for root in experts_roots):
        if isinstance(module, nn.Linear) or split_expert_name(f"{name}.0") is not None:
            return "expert not selected by layers="
        return ("experts layout not supported yet: experts weights other than 3-D gate_up_proj, gate_proj + up_proj or "
                "up_proj, + down_proj")
    if not isinstance(module, nn.Linear):  # Mamba's conv1d, A_log
        return f"not a linear's weight ({type(module).__name__}.{name.rsplit('.', 1)[1]}): ARMOR prunes linears only"
    return "not selected"


def experts_roots(model: nn.Module) -> List[str]:
    """The ``experts`` modules of every mixture-of-experts block of ``model``."""
    return [f"{name}.experts" if name else "experts" for name, block in moe_blocks(model)
            if isinstance(getattr(block, "experts", None), nn.Module)]


def no_expert_pruned(model: nn.Module, pruned: Sequence[str], dense: Mapping[str, Tuple[int, str]],
                     blocks_prefix: str) -> str:
    """One line saying that no expert of ``model`` is among ``pruned`` (layer names) and why, from
    :func:`dense_weights`' entries; ``""`` when some expert is pruned or the model has none."""
    roots = experts_roots(model)
    if not roots or any(split_expert_name(n) is not None or any(n.startswith(r + ".") for r in roots) for n in pruned):
        return ""
    patterns = {_pattern(r, blocks_prefix) + "." for r in roots}
    why = [f"{k} ({why})" for k, (_, why) in dense.items() if any(k.startswith(p) for p in patterns)]
    return (f"no expert of the model's {len(roots)} mixture-of-experts block(s) was pruned, every expert weight "
            f"stays dense: {'; '.join(why) or 'none is a linear or fused experts parameter'}; the dense weights "
            "are listed in PruneReport.dense_weights and logged")


def dense_weights(model: nn.Module, pruned: Sequence[str], blocks_prefix: str,
                  why_dense: Optional[Mapping[str, str]] = None) -> Dict[str, Tuple[int, str]]:
    """``{name pattern: (count, why)}``: every weight of ``model`` that the prune of ``pruned``
    (layer names) leaves dense, its decoder-block index replaced by ``*``; norms and biases
    (fused experts' ``(E, out)`` biases too) are one entry. ``why_dense``: ``{weight name: why}``
    for weights left dense for a reason of the caller's (a block size that fits no layer shape)."""
    done = set()
    for n in pruned:
        split = split_expert_name(n)
        done.add(split[0] if split is not None else f"{n}.weight")
    routers = set(router_names(model))
    unsupported = unsupported_experts(model)
    roots = experts_roots(model)
    out: Dict[str, Tuple[int, str]] = {}
    ones = 0
    for name, param in model.named_parameters():
        if name in done:
            continue
        if param.dim() < 2 or name.endswith("bias"):  # fused experts' biases are (E, out)
            ones += 1
            continue
        pattern = _pattern(name, blocks_prefix)
        count, why = out.get(pattern, (0, _reason(model, name, blocks_prefix, routers, unsupported, why_dense or {},
                                                       roots)))
        out[pattern] = (count + 1, why)
    if ones:
        out[ONE_D_WEIGHTS] = (ones, "")
    return out


def _pattern(name: str, blocks_prefix: str) -> str:
    """``name`` with its decoder-block index replaced by ``*``."""
    return re.sub(r"\.\d+\.", ".*.", name, count=1) if name.startswith(blocks_prefix + ".") else name


def with_dense_layers(dense: Mapping[str, Tuple[int, str]], layers: Mapping[str, str],
                      blocks_prefix: str) -> Dict[str, Tuple[int, str]]:
    """:func:`dense_weights`' entries plus the weights of ``layers`` (``{linear name: why}``), which
    the prune left dense after all (decided while it ran); the norms and biases entry stays last."""
    out = {k: v for k, v in dense.items() if k != ONE_D_WEIGHTS}
    for name, why in layers.items():
        pattern = _pattern(f"{name}.weight", blocks_prefix)
        out[pattern] = (out.get(pattern, (0, why))[0] + 1, why)
    if ONE_D_WEIGHTS in dense:
        out[ONE_D_WEIGHTS] = dense[ONE_D_WEIGHTS]
    return out


def dense_lines(dense: Mapping[str, Tuple[int, str]]) -> List[str]:
    """One line per kind of weight left dense: ``pattern: count dense (why)``."""
    return [f"{k}: {c} dense" + (f" ({why})" if why else "") for k, (c, why) in dense.items()]


def routed_token_lines(tokens: Mapping[str, int], limit: Optional[int] = None) -> List[str]:
    """Per experts module: the fewest and most routed calibration tokens of its experts."""
    by_module: Dict[str, List[int]] = {}
    for name, count in tokens.items():
        by_module.setdefault(name.rsplit(".", 1)[0], []).append(count)
    return [f"{m}: {len(c)} experts, routed tokens min {min(c)}, max {max(c)}" for m, c in by_module.items()][:limit]
