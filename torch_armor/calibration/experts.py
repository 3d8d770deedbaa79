"""Mixture-of-experts models: fused 3-D expert parameters as layers, routers, per-expert statistics.

transformers 5 stores the experts of a mixture-of-experts block fused: ``mlp.experts.gate_up_proj``
``(E, 2·I, H)`` and ``mlp.experts.down_proj`` ``(E, H, I)`` (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE,
…; the class is decorated with ``transformers.integrations.moe.use_experts_implementation``). Each
expert's matrix is one layer, named ``f"{param}.{e}"`` (``model.layers.0.mlp.experts.gate_up_proj.3``,
weight ``param[e]``); ``gate_up_proj[e]`` is one ``(2·I) × H`` layer, as the checkpoint stores it.
A transposed layout (gpt-oss: ``gate_up_proj`` ``(E, H, 2·I)``, ``is_transposed``) holds expert ``e``'s
weight as ``param[e].T`` (:func:`expert_weight`, a view); ARMOR experts are always ``(E, out, in)``.
Grouped experts (JetMoE's ``input_linear``/``output_linear``: one ``(E, out, in)`` ``weight`` per module,
called with the rows already grouped by expert and each expert's row count) are observed per module
(:class:`GroupedExpertsObserver`): expert ``e``'s rows are its statistics. Flat experts (DBRX's
``experts.mlp``: ``w1``, ``v1``, ``w2`` each a 2-D ``(E·I, H)`` parameter, expert ``e`` the rows
``e·I … (e+1)·I``) are ``w1``/``v1`` ``(I, H)`` and ``w2`` transposed, ``(H, I)``: ARMOR experts of them are
``(E, out, in)``, which DBRX's own forward reads through ``view`` (:mod:`torch_armor.tensor.experts`).

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

Experts whose forward takes no routing (:func:`experts_inputs`) are observed from what they do receive:
Llama-4's (``forward(hidden_states)``, stored ``(E, in, out)`` like gpt-oss's) get every token once per expert,
``(E·T, H)``, scaled by the router's sigmoid score for that expert and zero where the router did not pick it:
expert ``e``'s rows are its ``T`` rows that are not all zero (so its token count is the tokens routed to it,
and ``"all"`` / the fallback use every such row of every expert). Inkling's shared experts
(``forward(hidden_states, gammas)``, 3-D ``gate_proj``/``up_proj``/``down_proj``) get every token: their input
projections' statistics are of every token, the down projection's of ``act(gate)·up·gammas[:, e]``, its real
input; they never fall back.

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

__all__ = ["ExpertParam", "ExpertSlot", "ExpertsObserver", "GroupedExpertsObserver", "EXPERT_CALIBRATIONS",
           "expert_params", "is_grouped_experts", "flat_experts_count", "square_flat_experts", "takes_routing",
           "experts_inputs", "transposed_experts", "ROUTED", "STACKED", "SHARED",
           "unsupported_experts", "holds_fused_experts", "stores_in_by_out", "expert_weight", "out_in_shape", "split_expert_name", "expert_layer_names", "is_experts_module",
           "observe_experts"]

#: ``expert_calibration`` values: the router's top-k tokens per expert, or every token.
EXPERT_CALIBRATIONS = ("routed", "all")
#: the fused layouts understood: (input projection(s), output projection); gate_proj + up_proj (Inkling's
#: shared experts) before up_proj alone, which it contains
_LAYOUTS = (("gate_up_proj", "down_proj"), ("gate_proj", "up_proj", "down_proj"), ("up_proj", "down_proj"))
#: experts modules transformers leaves undecorated (no ``is_transposed``) that store each expert ``(in, out)``
#: and multiply ``torch.bmm(x, P)``: Llama-4's (``gate_up_proj`` ``(E, H, 2·I)``, ``down_proj`` ``(E, I, H)``)
_TRANSPOSED_CLASSES = frozenset({"Llama4TextExperts"})
#: how an experts module is handed its tokens (:func:`experts_inputs`)
ROUTED, STACKED, SHARED = "routed", "stacked", "shared"
#: the one parameter of a grouped experts module (JetMoE's ParallelExperts)
_GROUPED = "weight"
#: a flat experts module (DBRX's ExpertGLU): (gate, up) read the routed tokens, the last their intermediate
_FLAT = ("w1", "v1", "w2")


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
    """Expert ``index`` of a fused parameter, seen as a layer: ``weight`` is ``module.<attr>[index]``.
    ``parent``: the module holding ``module`` (a grouped experts module's router is its sibling)."""

    def __init__(self, module: nn.Module, attr: str, index: int, name: str,
                 parent: Optional[nn.Module] = None) -> None:
        self.module, self.attr, self.index, self.name, self.parent = module, attr, index, name, parent

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


def is_grouped_experts(module: nn.Module) -> bool:
    """A module whose one 3-D ``weight`` ``(E, out, in)`` runs rows already grouped by expert, its forward
    taking each expert's row count (``expert_size``: JetMoE's ParallelExperts)."""
    params = {n: p for n, p in module.named_parameters(recurse=False)}
    if set(params) != {_GROUPED} or params[_GROUPED].dim() != 3 or isinstance(module, nn.modules.conv._ConvNd):
        return False
    return "expert_size" in inspect.signature(module.forward).parameters


def _is_dense(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter)


def flat_experts_count(module: nn.Module) -> Optional[int]:
    """E of a flat experts module (DBRX's ExpertGLU: 2-D ``w1``/``v1``/``w2`` of ``E·I`` rows each and
    ``moe_num_experts``), or ``None`` for any other module. Counted from its ARMOR experts once converted."""
    count = getattr(module, "moe_num_experts", None)
    params = module._parameters
    if not isinstance(count, int) or count <= 0 or not all(isinstance(params.get(a), torch.Tensor) for a in _FLAT):
        return None
    shapes = [tuple(params[a].shape) for a in _FLAT]
    if not all(len(s) == 3 and s[0] == count if not _is_dense(params[a]) else len(s) == 2 and s[0] % count == 0
               for a, s in zip(_FLAT, shapes)):
        return None
    return count


def transposed_experts(module: nn.Module) -> bool:
    """Whether ``module`` stores its experts' 3-D parameters ``(E, in, out)`` and multiplies ``x @ P[e]``:
    ``is_transposed`` (gpt-oss, set by ``use_experts_implementation``), or Llama-4's undecorated experts."""
    return bool(getattr(module, "is_transposed", False)) or type(module).__name__ in _TRANSPOSED_CLASSES


def stores_in_by_out(module: nn.Module, attr: str) -> bool:
    """Whether ``module.<attr>`` holds each expert as ``(in, out)``: a dense parameter of a transposed
    experts module (gpt-oss), or DBRX's ``w2``. ARMOR experts replacing it are ``(E, out, in)`` whatever the
    module's layout."""
    if not _is_dense(getattr(module, attr)):
        return False
    if flat_experts_count(module) is not None:
        return attr == _FLAT[-1]
    return transposed_experts(module)


def _dense_expert(module: nn.Module, attr: str, e: int) -> torch.Tensor:
    w = getattr(module, attr)
    count = flat_experts_count(module)
    return w.view(count, -1, w.shape[-1])[e] if count is not None and _is_dense(w) else w[e]


def expert_weight(module: nn.Module, attr: str, e: int) -> torch.Tensor:
    """Expert ``e``'s ``(out, in)`` weight of ``module.<attr>``: a view (writes go through)."""
    w = _dense_expert(module, attr, e)
    return w.T if stores_in_by_out(module, attr) else w


def out_in_shape(module: nn.Module, attr: str) -> Tuple[int, ...]:
    """The shape of ``module.<attr>`` with each expert as ``(out, in)`` (what ARMOR experts of it have)."""
    w = getattr(module, attr)
    count = flat_experts_count(module)
    shape = (count, w.shape[0] // count, w.shape[1]) if count is not None and _is_dense(w) else tuple(w.shape)
    return shape[:-2] + (shape[-1], shape[-2]) if stores_in_by_out(module, attr) else shape


def _layout(module: nn.Module) -> Optional[Tuple[str, ...]]:
    """The module's ``(input projection(s)…, down projection)`` names, or ``None`` if it is a layout
    the per-expert statistics do not understand (other names)."""
    if flat_experts_count(module) is not None:
        return _FLAT
    names = {n for n, p in module.named_parameters(recurse=False) if p.dim() == 3}
    return next((layout for layout in _LAYOUTS if set(layout) <= names), None)


def square_flat_experts(module: nn.Module) -> bool:
    """A flat experts module whose experts are square (``I == H``): DBRX's forward reads ``w2`` through
    ``view(-1, I, H)``, which cannot tell ARMOR's ``(E, H, I)`` experts from their transpose then."""
    count = flat_experts_count(module)
    return count is not None and len(set(out_in_shape(module, _FLAT[0])[1:])) == 1


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


def _positional_names(module: nn.Module) -> Optional[List[str]]:
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in positional]


def experts_inputs(module: nn.Module) -> Optional[str]:
    """How ``module``'s experts receive their tokens, which the per-expert statistics follow:

    - ``"routed"``: ``(hidden_states, top_k_index, top_k_weights)`` (:func:`takes_routing`), expert ``e``'s
      inputs are the tokens routed to it;
    - ``"stacked"``: ``forward(hidden_states)`` alone (Llama-4): ``(E·T, H)`` rows, expert ``e``'s the ``e``-th
      ``T`` of them, every token already scaled by the router's score for ``e`` (zero where not picked);
    - ``"shared"``: ``forward(hidden_states, gammas)`` (Inkling's shared experts): every token reaches every
      expert, whose intermediate ``act(gate)·up`` is scaled by ``gammas[:, e]`` before its down projection;
    - ``None``: another signature, whose tokens cannot be told apart per expert.
    """
    if takes_routing(module):
        return ROUTED
    names = _positional_names(module)
    if names == ["hidden_states"]:
        return STACKED
    if names == ["hidden_states", "gammas"]:
        return SHARED
    return None


def holds_fused_experts(module: nn.Module) -> bool:
    """Fused experts of any layout: 3-D parameters of the module's own (a convolution's are not experts,
    nor a state-space mixer's, the module holding ``A_log``: Zamba's per-head ``x_proj_weight``)."""
    own = dict(module.named_parameters(recurse=False))
    return not isinstance(module, nn.modules.conv._ConvNd) and "A_log" not in own and any(
        p.dim() == 3 for p in own.values())


def unsupported_experts(model: nn.Module) -> Dict[str, str]:
    """``{experts module name: why}`` for experts modules whose weights are left dense: any module
    holding 3-D parameters not in a layout pruned as experts (JetMoE's ``input_linear``)."""
    out = {}
    for name, module in model.named_modules():
        if square_flat_experts(module):
            out[name] = ("square flat experts (ffn_hidden_size == hidden_size): DBRX's forward reads w2 through a "
                         "view that cannot tell ARMOR's (E, H, I) experts from their transpose")
            continue
        if not (is_experts_module(module) or holds_fused_experts(module)) or is_grouped_experts(module):
            continue
        if _layout(module) is None:
            out[name] = ("experts layout not supported yet: 3-D weights other than gate_up_proj, gate_proj + up_proj "
                         "or up_proj, + down_proj (E, out, in) or transposed")
        elif experts_inputs(module) is None:
            out[name] = (f"{type(module).__name__}.forward takes neither (hidden_states, top_k_index, top_k_weights), "
                         "Llama-4's (hidden_states) nor Inkling's (hidden_states, gammas): its tokens cannot be told "
                         "apart per expert for the per-expert statistics")
    return out


def expert_params(model: nn.Module) -> List[ExpertParam]:
    """Every fused expert parameter of ``model`` that is pruned as E layers, in module order."""
    out = []
    for name, module in model.named_modules():
        if is_grouped_experts(module):
            e_count, d_out, d_in = getattr(module, _GROUPED).shape
            out.append(ExpertParam(name, _GROUPED, int(e_count), (int(d_out), int(d_in))))
            continue
        if not (is_experts_module(module) or flat_experts_count(module) is not None) or square_flat_experts(module):
            continue
        layout = _layout(module)
        if layout is None or experts_inputs(module) is None:
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
    if not tail.isdigit() or head.rsplit(".", 1)[-1] not in {_GROUPED}.union(_FLAT, *_LAYOUTS):
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


class _PerExpertStatistics:
    """What both observers share: the mode, the experts observed and their routed-token counts, and
    the fallback of an expert under ``min_tokens`` to every input kept in ``_inputs`` (one warning each)."""

    #: what the fallback's inputs are, for its warning
    fallback_inputs = ""
    #: whether an expert under ``min_tokens`` falls back to ``_inputs`` (not when every token reaches it)
    falls_back = True

    def __init__(self, num_experts: int, mode: str, min_tokens: int, experts: Optional[Sequence[int]]) -> None:
        if mode not in EXPERT_CALIBRATIONS:
            raise ArmorInputError(f"expert_calibration must be one of {EXPERT_CALIBRATIONS}, got {mode!r}")
        self.mode, self.min_tokens = mode, int(min_tokens)
        self.experts = list(range(num_experts)) if experts is None else sorted(set(int(e) for e in experts))
        self.routed_tokens: Dict[int, int] = {e: 0 for e in self.experts}
        self._inputs: List[torch.Tensor] = []  # the fallback's inputs (unpadded)

    def remove(self) -> None:
        raise NotImplementedError

    def _refill(self, e: int) -> None:
        """Expert ``e``'s statistics again, from ``_inputs``."""
        raise NotImplementedError

    def _named(self) -> Dict[str, LayerStatistics]:
        raise NotImplementedError

    def statistics(self) -> Dict[str, LayerStatistics]:
        """``{f"{param}.{e}": LayerStatistics}``; experts under ``min_tokens`` fall back (one
        warning each) to ``fallback_inputs``."""
        self.remove()
        if self.mode == "routed" and self.falls_back:
            for e in self.experts:
                count = self.routed_tokens[e]
                if count >= self.min_tokens:
                    continue
                total = sum(x.shape[0] for x in self._inputs)
                warnings.warn(f"expert {self.name}.{e} received {count} routed calibration tokens (fewer than "
                              f"min_expert_tokens={self.min_tokens}): its statistics are those of all {total} "
                              f"{self.fallback_inputs}; use more calibration windows to avoid it", stacklevel=2)
                with torch.no_grad(), token_mask(None):
                    self._refill(e)
        self._inputs = []
        return self._named()


class ExpertsObserver(_PerExpertStatistics):
    """Per-expert input statistics of one fused experts module (see the module docstring).

    ``experts``: the expert indices to observe (default: all); ``mode``: ``"routed"`` or ``"all"``;
    ``min_tokens``: the routed-token count below which an expert falls back to all tokens; ``called``:
    the module whose forward takes ``(hidden_states, top_k_index, …)`` when it is not ``module`` itself
    (DBRX's ``experts``, holding the flat ``experts.mlp``).
    """

    fallback_inputs = "tokens reaching the block, through its own weights"

    def __init__(self, module: nn.Module, name: str, *, track_xtx: bool = False, mode: str = "routed",
                 min_tokens: int = 0, experts: Optional[Sequence[int]] = None,
                 called: Optional[nn.Module] = None) -> None:
        layout = _layout(module)
        if layout is None:
            raise ArmorInputError(f"experts module {name!r} ({type(module).__name__}) has a layout the per-expert "
                                  "statistics do not understand; leave its experts out of the selection")
        self.firsts, self.second = layout[:-1], layout[-1]
        self.first = self.firsts[0]
        super().__init__(int(out_in_shape(module, self.first)[0]), mode, min_tokens, experts)
        self.module, self.name, self.track_xtx = module, name, track_xtx
        self.inputs = experts_inputs(called or module) or ROUTED
        self.falls_back = self.inputs != SHARED  # every token reaches a shared expert already
        self._obs = {}
        for e in self.experts:  # the input projections read the same tokens: one observer
            shared = ActSqNormObserver(track_xtx=track_xtx)
            self._obs.update({(attr, e): shared for attr in self.firsts})
            self._obs[(self.second, e)] = ActSqNormObserver(track_xtx=track_xtx)
        self._handle = (called or module).register_forward_pre_hook(self._hook, with_kwargs=True)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def intermediate(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """The down projection's input for tokens ``x`` through expert ``e``'s current weights."""
        m = self.module
        w = expert_weight(m, self.first, e)
        if len(self.firsts) == 2:  # DBRX: act(w1 x) * (v1 x); Inkling's shared experts: act(gate x) * (up x)
            x = x.to(w.dtype)
            act = getattr(m, "activation_fn", None) or m.act_fn
            return act(F.linear(x, w)) * F.linear(x, expert_weight(m, self.firsts[1], e))
        bias = getattr(m, f"{self.first}_bias", None)
        h = F.linear(x.to(w.dtype), w, None if bias is None else bias[e])
        if self.first != "gate_up_proj":
            return m.act_fn(h)
        if hasattr(m, "_apply_gate"):
            return m._apply_gate(h)
        gate, up = h.chunk(2, dim=-1)  # an undecorated module (LongCat): transformers' default [gate; up] gate
        return m.act_fn(gate) * up

    def _add(self, e: int, x: torch.Tensor, scale: Optional[torch.Tensor] = None) -> None:
        """Expert ``e`` reads rows ``x``; its intermediate is scaled by ``scale`` (``(rows, 1)``, Inkling's gammas)."""
        with token_mask(None):  # rows are already the chosen tokens
            self._obs[(self.first, e)].update(x)
            h = self.intermediate(e, x)
            self._obs[(self.second, e)].update(h if scale is None else h * scale.to(h.dtype))

    def _expert_rows(self, args: tuple, kwargs: dict
                     ) -> Tuple[torch.Tensor, Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor]]]]:
        """``(every row reaching the module, {e: (expert e's rows, its intermediate's scale or None)})`` of one
        call, padding left out: the rows an expert receives as its ``experts_inputs`` kind says."""
        mask = current_token_mask()
        keep = None if mask is None else mask.reshape(-1)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if self.inputs == STACKED:  # Llama-4: (E·T, H), expert e's rows the e-th T, zero where not routed to e
            count = int(out_in_shape(self.module, self.first)[0])
            if not isinstance(hidden, torch.Tensor) or hidden.reshape(-1, hidden.shape[-1]).shape[0] % count:
                raise ArmorInputError(f"experts module {self.name!r} ({type(self.module).__name__}) was not called with "
                                      f"every token once per expert ({count} experts); its forward is not Llama-4's")
            stacked = hidden.detach().reshape(count, -1, hidden.shape[-1])
            if keep is not None:
                stacked = stacked[:, keep.to(stacked.device)]
            reached = stacked.ne(0).any(dim=-1)  # (E, T): the rows the router's score did not zero
            rows = {e: (stacked[e][reached[e]], None) for e in self.experts}
            return stacked[reached], rows
        if self.inputs == SHARED:  # Inkling's shared experts: every token, gammas (T, E) scale the intermediate
            gammas = args[1] if len(args) > 1 else kwargs.get("gammas")
            if not isinstance(hidden, torch.Tensor) or not isinstance(gammas, torch.Tensor):
                raise ArmorInputError(f"shared experts module {self.name!r} ({type(self.module).__name__}) was called "
                                      "without (hidden_states, gammas); its forward is not Inkling's")
            x = hidden.detach().reshape(-1, hidden.shape[-1])
            gammas = gammas.detach().reshape(x.shape[0], -1)
            if keep is not None:
                x, gammas = x[keep.to(x.device)], gammas[keep.to(x.device)]
            return x, {e: (x, gammas[:, e:e + 1]) for e in self.experts}
        hidden, index = _call_args(args, kwargs, self.name, self.module)
        x = hidden.detach().reshape(-1, hidden.shape[-1])
        index = index.reshape(x.shape[0], -1)
        if keep is not None:
            x, index = x[keep.to(x.device)], index[keep.to(x.device)]
        return x, {e: (x[(index == e).any(dim=-1)], None) for e in self.experts}

    def _hook(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        with torch.no_grad():
            x, rows = self._expert_rows(args, kwargs)
            for e in self.experts:
                chosen, scale = rows[e]
                self.routed_tokens[e] += int(chosen.shape[0])
                if self.mode == "all" and self.inputs != SHARED:
                    chosen = x
                self._add(e, chosen, scale)
            if self.mode == "routed" and self.min_tokens > 0 and self.falls_back:
                self._inputs.append(x)

    def _refill(self, e: int) -> None:
        for attr in (self.first, self.second):  # the other input projections share the first's
            self._obs[(attr, e)].reset()
        for x in self._inputs:
            self._add(e, x)

    def _named(self) -> Dict[str, LayerStatistics]:
        return {f"{self.name}.{attr}.{e}": obs.statistics() for (attr, e), obs in self._obs.items()}


class GroupedExpertsObserver(_PerExpertStatistics):
    """Per-expert input statistics of one grouped experts module (JetMoE's ``input_linear``/``output_linear``).

    Its forward receives ``(inputs, expert_size)``: the rows grouped by expert, expert ``e``'s
    ``expert_size[e]`` rows in a row. ``"routed"``: expert ``e``'s statistics are its rows. ``"all"``,
    and the fallback of an expert under ``min_tokens``: every row the module received (for an output
    projection these are the other experts' intermediates: the module alone cannot run another
    expert's input projection). Padding is left out through each row's token, which the sibling
    router (``parent.router``, JetMoE's top-k gating: ``batch_index`` is its second output) gives.
    """

    fallback_inputs = "rows reaching its grouped experts module"

    def __init__(self, module: nn.Module, name: str, *, parent: Optional[nn.Module], track_xtx: bool = False,
                 mode: str = "routed", min_tokens: int = 0, experts: Optional[Sequence[int]] = None) -> None:
        super().__init__(int(getattr(module, _GROUPED).shape[0]), mode, min_tokens, experts)
        self.module, self.name = module, name
        self._obs = {e: ActSqNormObserver(track_xtx=track_xtx) for e in self.experts}
        self._row_tokens: Optional[torch.Tensor] = None
        router = getattr(parent, "router", None) if parent is not None else None
        self._handles = [module.register_forward_pre_hook(self._hook, with_kwargs=True)]
        if isinstance(router, nn.Module):
            self._handles.append(router.register_forward_hook(self._rows_of))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _rows_of(self, _module: nn.Module, _args: tuple, out) -> None:
        rows = out[1] if isinstance(out, (tuple, list)) and len(out) > 1 else None
        self._row_tokens = rows.detach() if isinstance(rows, torch.Tensor) and not rows.is_floating_point() else None

    def _hook(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        rows = args[0] if args else kwargs.get("inputs")
        sizes = args[1] if len(args) > 1 else kwargs.get("expert_size")
        if not isinstance(rows, torch.Tensor) or sizes is None:
            raise ArmorInputError(f"grouped experts module {self.name!r} was called without (inputs, expert_size); "
                                  "its forward is not JetMoE's ParallelExperts signature")
        x = rows.detach().reshape(-1, rows.shape[-1])
        sizes = [int(n) for n in (sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes)]
        keep = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        mask = current_token_mask()
        if mask is not None:
            tokens = self._row_tokens
            if tokens is None or tokens.shape[0] != x.shape[0]:
                raise ArmorInputError(f"grouped experts module {self.name!r}: padded calibration batches need each "
                                      "row's token from the sibling router (JetMoE's top-k gating), which was not "
                                      "seen; calibrate with unpadded batches (equal-length windows)")
            keep = mask.reshape(-1).to(x.device)[tokens.to(x.device)]
        with torch.no_grad(), token_mask(None):  # rows are already the chosen tokens
            for e, (chunk, kept) in enumerate(zip(x.split(sizes), keep.split(sizes))):
                if e not in self._obs:
                    continue
                chunk = chunk[kept]
                self.routed_tokens[e] += int(chunk.shape[0])
                if self.mode == "routed":
                    self._obs[e].update(chunk)
            if self.mode == "all":
                for e in self.experts:
                    self._obs[e].update(x[keep])
            elif self.min_tokens > 0:
                self._inputs.append(x[keep])

    def _refill(self, e: int) -> None:
        self._obs[e].reset()
        for x in self._inputs:
            self._obs[e].update(x)

    def _named(self) -> Dict[str, LayerStatistics]:
        return {f"{self.name}.{_GROUPED}.{e}": obs.statistics() for e, obs in self._obs.items()}


def observe_experts(slots: Mapping[str, ExpertSlot], *, track_xtx: bool, mode: str,
                    min_tokens: int) -> Dict[str, "ExpertsObserver | GroupedExpertsObserver"]:
    """One observer per experts module holding a layer of ``slots`` (``{name: ExpertSlot}``):
    :class:`GroupedExpertsObserver` for a grouped experts module, else :class:`ExpertsObserver`."""
    wanted: Dict[str, Tuple[ExpertSlot, set]] = {}
    for name, slot in slots.items():
        if split_expert_name(name) is None:
            raise ArmorInputError(f"layer {name!r} is not an expert layer name (expected <experts>.<param>.<e>)")
        module_name = slot.param_fqn.rsplit(".", 1)[0]
        wanted.setdefault(module_name, (slot, set()))[1].add(slot.index)
    out: Dict[str, "ExpertsObserver | GroupedExpertsObserver"] = {}
    for module_name, (slot, experts) in wanted.items():
        kw = dict(track_xtx=track_xtx, mode=mode, min_tokens=min_tokens, experts=sorted(experts))
        if is_grouped_experts(slot.module):
            out[module_name] = GroupedExpertsObserver(slot.module, module_name, parent=slot.parent, **kw)
        else:
            called = slot.parent if flat_experts_count(slot.module) is not None else None
            out[module_name] = ExpertsObserver(slot.module, module_name, called=called, **kw)
    return out
