"""Routers of mixture-of-experts blocks, found by what they do: their output selects the experts.

A mixture-of-experts block is a module with an ``experts`` child (fused 3-D experts, a
``ModuleList``, JetMoE's attention experts) or with a child holding 3-D expert weights (JetMoE's
``input_linear``). Its router is whatever module's weight produces the
scores the block takes the top-k of — ``mlp.gate`` (Qwen3-MoE, Mixtral), ``ffn.router.layer``
(DBRX), ``mlp.gate.wg`` (Hunyuan), ``mlp.router.gate`` (AFMoE), Zaya's router MLP, whatever the
names. :func:`router_names` runs each block (or, if its forward needs more than hidden states, each
of its children) once on two probe tokens (on the meta device when the model is there) and follows the data from every ``F.linear`` of a block parameter to the first
selection (``topk``, ``sort``, ``argsort``, ``argmax``), then stops, before any expert runs: every
module whose weight fed it is a router. A block whose forward cannot be probed that way (it needs
other arguments) falls back to its modules with an ``(E, in)`` weight, E its number of experts.
A linear child of the block with a single output (Qwen2-MoE's ``shared_expert_gate``: a scalar
per token scaling the shared expert) is kept with the routers: it gates an expert too.

Routers stay dense (tiny, and the top-k choice is sensitive to them) and are listed in the report.

Example::

    >>> from transformers import HunYuanMoEV1Config, HunYuanMoEV1ForCausalLM
    >>> model = HunYuanMoEV1ForCausalLM(HunYuanMoEV1Config(
    ...     hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
    ...     num_key_value_heads=2, head_dim=8, num_experts=4, moe_topk=2, vocab_size=64))
    >>> router_names(model)  # its router is the linear ``wg`` inside ``mlp.gate``
    ['model.layers.0.mlp.gate.wg']
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Set

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from torch_armor.calibration.experts import holds_fused_experts

__all__ = ["router_names", "moe_blocks"]

#: the ops that pick experts from routing scores
_SELECTIONS = {torch.topk, torch.Tensor.topk, torch.sort, torch.Tensor.sort, torch.argsort, torch.Tensor.argsort,
               torch.argmax, torch.Tensor.argmax}


class _ExpertsSelected(Exception):
    """Raised by the probe at the first selection: nothing after it needs to run."""


class _RoutingProbe(TorchFunctionMode):
    """Tags every tensor computed from an ``F.linear`` of a watched weight with that weight's module;
    at the first selection op, the tags of its input are the routers."""

    def __init__(self, owners: Dict[int, str]) -> None:
        super().__init__()
        self.owners = owners
        self.tags: Dict[int, tuple] = {}  # id(tensor) -> (tensor kept alive so the id stays its own, names)
        self.routers: Set[str] = set()

    def _tags_of(self, values) -> Set[str]:
        out: Set[str] = set()
        for leaf in tree_leaves(values):
            if isinstance(leaf, torch.Tensor) and id(leaf) in self.tags:
                out |= self.tags[id(leaf)][1]
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = self._tags_of((args, kwargs))
        if func in _SELECTIONS and found:
            self.routers |= found
            raise _ExpertsSelected
        out = func(*args, **kwargs)
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if id(weight) in self.owners:
                found = found | {self.owners[id(weight)]}
        if found:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.tags[id(leaf)] = (leaf, frozenset(found))
        return out


def moe_blocks(model: nn.Module) -> Iterator[tuple]:
    """``(name, module)`` of every mixture-of-experts block: a module with an ``experts`` child, or
    with a child holding fused experts (JetMoE's ``input_linear``)."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "experts", None), nn.Module) or any(
                holds_fused_experts(child) for child in module.children()):
            yield name, module


def _num_experts(block: nn.Module) -> Optional[int]:
    experts = getattr(block, "experts", None)
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    sizes = {int(p.shape[0]) for m in block.modules() if holds_fused_experts(m)
             for p in m.parameters(recurse=False) if p.dim() == 3}
    return sizes.pop() if len(sizes) == 1 else None


def _hidden_size(model: nn.Module, block: nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        size = getattr(config.get_text_config(), "hidden_size", None)
        if isinstance(size, int):
            return size
    linear = next((m for m in block.modules() if isinstance(m, nn.Linear)), None)
    return None if linear is None else linear.in_features


def _owner(block_name: str, param_name: str) -> str:
    """The full name of the module holding ``param_name`` (relative to the block ``block_name``)."""
    module = param_name.rpartition(".")[0]
    return ".".join(part for part in (block_name, module) if part)


def _selects(module: nn.Module, owners: Dict[int, str], hidden: int) -> Optional[Set[str]]:
    """The watched modules whose weights feed ``module``'s first selection on probe tokens, or ``None``
    if its forward fails on hidden states alone or selects nothing from them."""
    param = next(module.parameters(), None)
    if param is None:
        return None
    dtype = param.dtype if param.dtype.is_floating_point else torch.float32
    generator = torch.Generator().manual_seed(0)
    for shape in ((1, 2, hidden), (2, hidden)):
        x = torch.randn(shape, generator=generator).to(device=param.device, dtype=dtype)
        probe = _RoutingProbe(owners)
        try:
            with torch.no_grad(), probe:
                module(x)
        except _ExpertsSelected:
            return probe.routers
        except Exception:  # noqa: BLE001  (a forward that wants more than hidden states: try the next way)
            continue
    return None


def _probe(block: nn.Module, owners: Dict[int, str], hidden: int) -> Optional[Set[str]]:
    """The block's routers by probing the block, else each of its children (Gemma-4's decoder layer
    holds the experts but needs position embeddings; its ``router`` takes hidden states alone)."""
    routed = _selects(block, owners, hidden)
    if routed is not None:
        return routed
    found: Set[str] = set()
    for child in block.children():
        found |= _selects(child, owners, hidden) or set()
    return found or None


def router_names(model: nn.Module) -> List[str]:
    """The routers of every mixture-of-experts block of ``model`` (module names, in module order): the
    modules whose weights produce the scores that select experts, and single-output linear children
    of a block (shared-expert gates). See the module docstring for how they are found."""
    found: Set[str] = set()
    for block_name, block in moe_blocks(model):
        weights = [(_owner(block_name, n), p) for n, p in block.named_parameters() if p.dim() == 2]
        hidden = _hidden_size(model, block)
        routed = None if hidden is None else _probe(block, {id(p): n for n, p in weights}, hidden)
        if routed is None:
            count = _num_experts(block)
            routed = {n for n, p in weights if count is not None and p.shape[0] == count}
        found |= routed
        found |= {_owner(block_name, f"{n}.weight") for n, child in block.named_children()
                  if isinstance(child, nn.Linear) and child.out_features == 1}
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(found, key=lambda n: order.get(n, len(order)))
