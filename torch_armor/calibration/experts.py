"""Mixture-of-experts models: fused 3-D expert parameters as layers, routers, per-expert statistics.

transformers 5 stores the experts of a mixture-of-experts block fused: ``mlp.experts.gate_up_proj``
``(E, 2·I, H)`` and ``mlp.experts.down_proj`` ``(E, H, I)`` (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE,
…; the class is decorated with ``transformers.integrations.moe.use_experts_implementation``). Each
expert's matrix is one layer, named ``f"{param}.{e}"`` (``model.layers.0.mlp.experts.gate_up_proj.3``,
weight ``param[e]``); ``gate_up_proj[e]`` is one ``(2·I) × H`` layer, as the checkpoint stores it.
A transposed layout (gpt-oss: ``gate_up_proj`` ``(E, H, 2·I)``, ``is_transposed``) holds expert ``e``'s
weight as ``param[e].T`` (:func:`expert_weight`, a view); ARMOR experts are always ``(E, out, in)``.

The router (:mod:`torch_armor.calibration.routers`) is left dense: it is tiny and the top-k choice
is sensitive to it. ``nn.Linear`` experts (a ``ModuleList``, Qwen2-MoE's
``shared_expert``) are ordinary linears whose hooks already see only their routed tokens.

Per-expert statistics (:class:`ExpertsObserver`) come from a forward pre-hook on the experts
module, which receives ``(hidden_states, top_k_index, top_k_weights)``: ``"routed"`` (default)
accumulates, for expert ``e``, the tokens the router sends to ``e`` (``gate_up``'s input) and
``act(gate)·up`` of those tokens through ``e``'s current weights (``down``'s input); ``"all"``
(llm-compressor's ``calibrate_all_experts``) sends every token through every expert for the
statistics only — the block's output stays routed either way. An expert that received fewer than
``min_tokens`` routed tokens falls back to the statistics of all tokens reaching the block
through its own weights, with one warning naming it and its count.

Example::

    >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    >>> cfg = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    ...                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    ...                      num_experts=4, num_experts_per_tok=2, vocab_size=50)
    >>> params = expert_params(Qwen3MoeForCausalLM(cfg))
    >>> [(p.fqn, p.num_experts, p.shape) for p in params]
    [('model.layers.0.mlp.experts.gate_up_proj', 4, (32, 32)), ('model.layers.0.mlp.experts.down_proj', 4, (32, 16))]
    >>> split_expert_name("model.layers.0.mlp.experts.down_proj.3")
    ('model.layers.0.mlp.experts.down_proj', 3)
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from torch_armor.calibration.observer import ActSqNormObserver, LayerStatistics, current_token_mask, token_mask
from torch_armor.errors import ArmorInputError

__all__ = ["ExpertParam", "ExpertSlot", "ExpertsObserver", "EXPERT_CALIBRATIONS", "expert_params",
           "unsupported_experts", "holds_fused_experts", "takes_routing", "stores_in_by_out", "expert_weight", "out_in_shape", "split_expert_name", "expert_layer_names", "is_experts_module",
           "observe_experts"]

#: ``expert_calibration`` values: the router's top-k tokens per expert, or every token.
EXPERT_CALIBRATIONS = ("routed", "all")
#: the fused layouts understood: (input projection, output projection)
_LAYOUTS = (("gate_up_proj", "down_proj"), ("up_proj", "down_proj"))


@dataclass(frozen=True)
class ExpertParam:
    """One fused 3-D expert parameter ``module.<attr>`` of shape ``(num_experts, out, in)``."""

    module_name: str
    attr: str
    num_experts: int
    shape: Tuple[int, int]

    @property
    def fqn(self) -> str:
        return f"{self.module_name}.{self.attr}"

    def layer_names(self) -> List[str]:
        return [f"{self.fqn}.{e}" for e in range(self.num_experts)]


class ExpertSlot:
    """Expert ``index`` of a fused parameter, seen as a layer: ``weight`` is ``module.<attr>[index]``."""

    def __init__(self, module: nn.Module, attr: str, index: int, name: str) -> None:
        self.module, self.attr, self.index, self.name = module, attr, index, name

    @property
    def weight(self) -> torch.Tensor:
        return expert_weight(self.module, self.attr, self.index)

    @property
    def param_fqn(self) -> str:
        return self.name.rsplit(".", 1)[0]


def is_experts_module(module: nn.Module) -> bool:
    """A fused experts module: decorated by ``use_experts_implementation`` (it then carries
    ``is_transposed``/``has_gate``), or any module holding 3-D parameters named like experts."""
    if hasattr(module, "is_transposed") and hasattr(module, "has_gate"):
        return True
    names = {n for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
    return any(set(layout) <= names for layout in _LAYOUTS)


def stores_in_by_out(module: nn.Module, attr: str) -> bool:
    """Whether ``module.<attr>`` holds each expert as ``(in, out)``: a dense parameter of a transposed
    experts module (gpt-oss). ARMOR experts replacing it are ``(E, out, in)`` whatever the module's layout."""
    return bool(getattr(module, "is_transposed", False)) and type(getattr(module, attr)) in (torch.Tensor, nn.Parameter)


def expert_weight(module: nn.Module, attr: str, e: int) -> torch.Tensor:
    """Expert ``e``'s ``(out, in)`` weight of ``module.<attr>``: a view (writes go through)."""
    w = getattr(module, attr)[e]
    return w.T if stores_in_by_out(module, attr) else w


def out_in_shape(module: nn.Module, attr: str) -> Tuple[int, ...]:
    """The shape of ``module.<attr>`` with each expert as ``(out, in)`` (what ARMOR experts of it have)."""
    shape = tuple(getattr(module, attr).shape)
    return shape[:-2] + (shape[-1], shape[-2]) if stores_in_by_out(module, attr) else shape


def _layout(module: nn.Module) -> Optional[Tuple[str, str]]:
    """The module's ``(input projection, down projection)`` names, or ``None`` if it is a layout
    the per-expert statistics do not understand (other names)."""
    names = {n for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
    return next((layout for layout in _LAYOUTS if set(layout) <= names), None)


def takes_routing(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes the routing after the hidden states, as transformers' experts
    do (``(hidden_states, top_k_index, top_k_weights)``, gpt-oss's ``router_indices``/``routing_weights``):
    three positional parameters. Inkling's shared experts (``(hidden_states, gammas)``: every token)
    and Llama-4's experts (``(hidden_states)``: every token through every expert, its input scaled
    by the router's score) do not."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: taken as the transformers one
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in positional for p in parameters) >= 3 or any(
        p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)


def holds_fused_experts(module: nn.Module) -> bool:
    """Fused experts of any layout: 3-D parameters of the module's own (a convolution's are not experts)."""
    return not isinstance(module, nn.modules.conv._ConvNd) and any(
        p.dim() == 3 for p in module.parameters(recurse=False))


def unsupported_experts(model: nn.Module) -> Dict[str, str]:
    """``{experts module name: why}`` for experts modules whose weights are left dense: any module
    holding 3-D parameters not in a layout pruned as experts (JetMoE's ``input_linear``)."""
    out = {}
    for name, module in model.named_modules():
        if not (is_experts_module(module) or holds_fused_experts(module)):
            continue
        if _layout(module) is None:
            out[name] = ("experts layout not supported yet: 3-D weights other than gate_up_proj/up_proj + down_proj "
                         "(E, out, in) or transposed")
        elif not takes_routing(module):
            out[name] = (f"{type(module).__name__}.forward takes no (top_k_index, top_k_weights): every token reaches "
                         "every expert (shared experts, or Llama-4's router-scaled inputs), not the routed experts the "
                         "per-expert statistics calibrate")
    return out


def expert_params(model: nn.Module) -> List[ExpertParam]:
    """Every fused expert parameter of ``model`` that is pruned as E layers, in module order."""
    out = []
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        layout = _layout(module)
        if layout is None or not takes_routing(module):
            continue
        for attr in layout:
            e_count, d_out, d_in = out_in_shape(module, attr)
            out.append(ExpertParam(name, attr, int(e_count), (int(d_out), int(d_in))))
    return out


def expert_layer_names(model: nn.Module) -> List[str]:
    """The names of every expert layer (``f"{param}.{e}"``)."""
    return [n for p in expert_params(model) for n in p.layer_names()]


def split_expert_name(name: str) -> Optional[Tuple[str, int]]:
    """``(param fqn, expert index)`` of an expert layer name, or ``None`` for another name."""
    head, _, tail = name.rpartition(".")
    if not tail.isdigit() or head.rsplit(".", 1)[-1] not in {a for layout in _LAYOUTS for a in layout}:
        return None
    return head, int(tail)


def _call_args(args: tuple, kwargs: dict, name: str, module: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    hidden = args[0] if len(args) > 0 else kwargs.get("hidden_states")
    index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
    if not isinstance(hidden, torch.Tensor) or not isinstance(index, torch.Tensor):
        raise ArmorInputError(f"experts module {name!r} ({type(module).__name__}) was called without (hidden_states, "
                              "top_k_index): its forward is not the transformers experts signature, so its tokens "
                              "cannot be told apart per expert; leave its experts out of the selection (layers=)")
    return hidden, index


class ExpertsObserver:
    """Per-expert input statistics of one fused experts module (see the module docstring).

    ``experts``: the expert indices to observe (default: all); ``mode``: ``"routed"`` or ``"all"``;
    ``min_tokens``: the routed-token count below which an expert falls back to all tokens.
    """

    def __init__(self, module: nn.Module, name: str, *, track_xtx: bool = False, mode: str = "routed",
                 min_tokens: int = 0, experts: Optional[Sequence[int]] = None) -> None:
        if mode not in EXPERT_CALIBRATIONS:
            raise ArmorInputError(f"expert_calibration must be one of {EXPERT_CALIBRATIONS}, got {mode!r}")
        layout = _layout(module)
        if layout is None:
            raise ArmorInputError(f"experts module {name!r} ({type(module).__name__}) has a layout the per-expert "
                                  "statistics do not understand; leave its experts out of the selection")
        self.module, self.name, self.mode, self.min_tokens = module, name, mode, int(min_tokens)
        self.first, self.second = layout
        self.track_xtx = track_xtx
        num = int(getattr(module, self.first).shape[0])
        self.experts = list(range(num)) if experts is None else sorted(set(int(e) for e in experts))
        self.routed_tokens: Dict[int, int] = {e: 0 for e in self.experts}
        self._obs = {(attr, e): ActSqNormObserver(track_xtx=track_xtx) for attr in layout for e in self.experts}
        self._inputs: List[torch.Tensor] = []  # every (unpadded) token reaching the experts: the fallback
        self._handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def intermediate(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """The down projection's input for tokens ``x`` through expert ``e``'s current weights."""
        m = self.module
        w = expert_weight(m, self.first, e)
        bias = getattr(m, f"{self.first}_bias", None)
        h = F.linear(x.to(w.dtype), w, None if bias is None else bias[e])
        if self.first != "gate_up_proj":
            return m.act_fn(h)
        if hasattr(m, "_apply_gate"):
            return m._apply_gate(h)
        gate, up = h.chunk(2, dim=-1)  # an undecorated module (LongCat): transformers' default [gate; up] gate
        return m.act_fn(gate) * up

    def _add(self, e: int, x: torch.Tensor) -> None:
        with token_mask(None):  # rows are already the chosen tokens
            self._obs[(self.first, e)].update(x)
            self._obs[(self.second, e)].update(self.intermediate(e, x))

    def _hook(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden, index = _call_args(args, kwargs, self.name, self.module)
        x = hidden.detach().reshape(-1, hidden.shape[-1])
        index = index.reshape(x.shape[0], -1)
        mask = current_token_mask()
        if mask is not None:
            keep = mask.reshape(-1).to(x.device)
            x, index = x[keep], index[keep]
        with torch.no_grad():
            for e in self.experts:
                routed = (index == e).any(dim=-1)
                self.routed_tokens[e] += int(routed.sum())
                self._add(e, x if self.mode == "all" else x[routed])
            if self.mode == "routed" and self.min_tokens > 0:
                self._inputs.append(x)

    def statistics(self) -> Dict[str, LayerStatistics]:
        """``{f"{param}.{e}": LayerStatistics}``; experts under ``min_tokens`` fall back (one
        warning each) to all the tokens that reached the block."""
        self.remove()
        if self.mode == "routed":
            for e in self.experts:
                count = self.routed_tokens[e]
                if count >= self.min_tokens:
                    continue
                total = sum(x.shape[0] for x in self._inputs)
                warnings.warn(f"expert {self.name}.{e} received {count} routed calibration tokens (fewer than "
                              f"min_expert_tokens={self.min_tokens}): its statistics are those of all {total} tokens "
                              "reaching the block, through its own weights; use more calibration windows to avoid it",
                              stacklevel=2)
                for attr in (self.first, self.second):
                    self._obs[(attr, e)].reset()
                with torch.no_grad():
                    for x in self._inputs:
                        self._add(e, x)
        self._inputs = []
        return {f"{self.name}.{attr}.{e}": obs.statistics() for (attr, e), obs in self._obs.items()}


def observe_experts(slots: Mapping[str, ExpertSlot], *, track_xtx: bool, mode: str,
                    min_tokens: int) -> Dict[str, ExpertsObserver]:
    """One :class:`ExpertsObserver` per experts module holding a layer of ``slots`` (``{name: ExpertSlot}``)."""
    wanted: Dict[str, Tuple[nn.Module, set]] = {}
    for name, slot in slots.items():
        if split_expert_name(name) is None:
            raise ArmorInputError(f"layer {name!r} is not an expert layer name (expected <experts>.<param>.<e>)")
        module_name = slot.param_fqn.rsplit(".", 1)[0]
        wanted.setdefault(module_name, (slot.module, set()))[1].add(slot.index)
    return {module_name: ExpertsObserver(module, module_name, track_xtx=track_xtx, mode=mode, min_tokens=min_tokens,
                                         experts=sorted(experts))
            for module_name, (module, experts) in wanted.items()}
