"""Decoder blocks: finding them, capturing their inputs, and block-local statistics.

The block-by-block engine (:mod:`torch_armor.engine.blocks`) calibrates one decoder block at a
time: the inputs of block 0 are captured from the embeddings, and each block's linears are observed
while the block runs on its inputs.

Each block is called with what the model's own forward passes it, not with block 0's arguments:
the capture runs the model's forward with every decoder block stood in for by a recorder that
returns its hidden states unchanged, so the forward computes each block's arguments (Gemma-4's
per-layer input, the attention mask of each layer's type) without running a block, and the last
recorder stops it there (recorders return ``(hidden, None)`` instead when the model takes a layer's
output apart: GLM-MoE-DSA's layers return their attention's top-k too). An argument computed from earlier blocks' outputs (Inkling-2's
``block_states`` once it holds a layer's output) cannot be given to one block at a time: a second
recording whose blocks return shifted hidden states finds it, and the capture refuses it by name.

Example::

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    >>> model = LlamaForCausalLM(cfg).eval()
    >>> prefix, blocks = decoder_blocks(model)
    >>> prefix, len(blocks)
    ('model.layers', 2)
    >>> inputs = capture_block_inputs(model, blocks[0], [torch.randint(0, 50, (2, 8))])
    >>> inputs[0].hidden.shape
    torch.Size([2, 8, 32])
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from torch_armor.calibration.experts import ExpertSlot, observe_experts
from torch_armor.calibration.observer import ActSqNormObserver, LayerStatistics, model_device, token_mask
from torch_armor.errors import ArmorInputError

__all__ = ["BlockInput", "decoder_blocks", "capture_block_inputs", "run_block", "block_statistics", "to_device",
           "READ_BY_KERNEL", "NEVER_REACHED"]

#: why a selected linear that calibration never called is left dense: its weight is an operand of the
#: block's forward all the same (Mamba's ``dt_proj``: the selective scan reads ``dt_proj.weight``) ...
READ_BY_KERNEL = ("read directly by a fused kernel (its weight is an operand of the block's forward), never called as "
                  "a module, so no input statistics to prune it by")
#: ... or nothing read it at all (a ``ModuleList`` expert no calibration token was routed to)
NEVER_REACHED = "never called during calibration: no calibration token reached it"

logger = logging.getLogger("torch_armor")


class BlockInput:
    """One calibration batch at a block boundary: the hidden states and the keyword arguments
    the decoder layer is called with (attention mask, position embeddings, …).

    After :meth:`offload` the hidden states live in a safetensors file and are read back each
    time :attr:`hidden` is used; assigning :attr:`hidden` then rewrites the file.

    ``layer_kwargs`` (when captured for every block): the keyword arguments the model passes to
    each decoder block; :meth:`enter_block` makes :attr:`kwargs` those of one block.
    """

    def __init__(self, hidden: torch.Tensor, kwargs: Optional[Dict[str, Any]] = None,
                 token_mask: Optional[torch.Tensor] = None,
                 layer_kwargs: Optional[Sequence[Dict[str, Any]]] = None) -> None:
        self._hidden: Optional[torch.Tensor] = hidden
        self.kwargs: Dict[str, Any] = dict(kwargs or {})
        self.path: Optional[Path] = None
        #: ``(batch, seq_len)`` bool, False at pad positions (left out of statistics), or None
        self.token_mask: Optional[torch.Tensor] = token_mask
        self.layer_kwargs: Optional[List[Dict[str, Any]]] = None if layer_kwargs is None else list(layer_kwargs)

    def enter_block(self, index: int) -> None:
        """Make :attr:`kwargs` the arguments the model passes to decoder block ``index`` (no change
        when only block 0's were captured)."""
        if self.layer_kwargs is not None:
            self.kwargs = self.layer_kwargs[index]

    def copy(self, hidden: Optional[torch.Tensor] = None) -> "BlockInput":
        """A new input with these arguments and ``hidden`` (default: these hidden states)."""
        return BlockInput(self.hidden if hidden is None else hidden, self.kwargs, self.token_mask, self.layer_kwargs)

    @property
    def hidden(self) -> torch.Tensor:
        if self.path is None:
            return self._hidden
        return load_file(str(self.path))["hidden"]

    @hidden.setter
    def hidden(self, value: torch.Tensor) -> None:
        if self.path is None:
            self._hidden = value
            return
        save_file({"hidden": value.detach().contiguous().cpu()}, str(self.path))

    def offload(self, path: Union[str, os.PathLike]) -> None:
        """Keep the hidden states in ``path`` from now on (frees their memory)."""
        value = self.hidden
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.hidden = value
        self._hidden = None


def decoder_blocks(model: nn.Module) -> Tuple[str, nn.ModuleList]:
    """``(prefix, blocks)``: the ``nn.ModuleList`` holding the decoder layers (the longest
    ``ModuleList`` whose entries contain ``nn.Linear`` layers and that is not inside another such
    list, e.g. not ModuleList experts), e.g. ``("model.layers", …)``.

    Raises:
        ValueError: the model has no such list (not a decoder stack), or it has transformers
            ``Conv1D`` layers (GPT-2 style: "Conv1D layers are not supported; …").
    """
    conv1d = next((name for name, m in model.named_modules() if type(m).__name__ == "Conv1D"), None)
    if conv1d is not None:
        raise ArmorInputError(
            f"Conv1D layers are not supported; {type(model).__name__} stores its projections as transformers "
            f"Conv1D (e.g. {conv1d!r}, the GPT-2 layout with transposed weights), and ARMOR converts nn.Linear "
            "weights only. Use a model with nn.Linear projections (Llama, Mistral, Qwen2/3, Gemma2/3, Phi-3, "
            "GPT-NeoX)"
        )
    best: Optional[Tuple[str, nn.ModuleList]] = None
    candidates = [(name, module) for name, module in model.named_modules()
                  if isinstance(module, nn.ModuleList) and len(module) > 0
                  and all(any(isinstance(m, nn.Linear) for m in child.modules()) for child in module)]
    for name, module in candidates:
        if any(name.startswith(other + ".") for other, _ in candidates):
            continue  # a list inside a block (e.g. ModuleList experts) is not the decoder stack
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    if best is None:
        raise ArmorInputError(
            f"{type(model).__name__} has no list of decoder blocks (an nn.ModuleList of layers holding "
            "nn.Linear modules); prune it with ArmorSparsifier instead of prune_model"
        )
    return best


class _Captured(Exception):
    pass


def to_device(value: Any, device: Optional[torch.device], dtype: Optional[torch.dtype] = None) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        return value.to(device) if device is not None else value
    if isinstance(value, tuple):
        return tuple(to_device(v, device, dtype) for v in value)
    if isinstance(value, list):
        return [to_device(v, device, dtype) for v in value]
    if isinstance(value, dict):
        return {k: to_device(v, device, dtype) for k, v in value.items()}
    return value


def _call_as_kwargs(forward: Callable, args: tuple, kwargs: dict, where: str) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """``(hidden states, the other arguments by name)`` of a call ``forward(*args, **kwargs)``;
    positional arguments after the hidden states are named by ``forward``'s signature."""
    try:
        signature = inspect.signature(forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):  # a signature that does not take this call: hidden states come first
        signature, bound = None, None
    unnamed: tuple = tuple(args[1:]) if bound is None else ()
    named: Dict[str, Any] = dict(kwargs) if bound is None else {}
    if bound is not None:
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                unnamed = tuple(value)
            else:
                named[name] = value
        first = next(iter(signature.parameters.values()), None)
        if args and first is not None and first.kind is not inspect.Parameter.VAR_POSITIONAL:
            named.pop(first.name)  # args[0], the hidden states
        elif args:
            unnamed = unnamed[1:]
    if unnamed:
        raise ArmorInputError(f"decoder layer {where!r} is called with {len(unnamed)} positional arguments after the "
                              "hidden states that its forward's signature does not name; prune_model cannot pass them "
                              "to one layer at a time")
    return (args[0] if args else named.pop("hidden_states")), named


def _record_block_calls(blocks: Sequence[nn.Module], run: Callable[[], Any], shift: float,
                        names: Sequence[str], as_tuple: bool = False) -> List[Optional[Tuple[torch.Tensor, Dict[str, Any]]]]:
    """Run ``run`` (the model's forward) with every block of ``blocks`` replaced by a recorder: each
    returns its hidden states plus ``shift`` (``as_tuple``: as ``(hidden, None)``, for layers that return
    a tuple the model unpacks) and keeps ``(hidden, other arguments)``; the last one stops the forward.
    Blocks the forward did not reach, or reached with hidden states of another shape than block 0's
    (the model took the recorder's output apart), are ``None``."""
    calls: List[Optional[Tuple[torch.Tensor, Dict[str, Any]]]] = [None] * len(blocks)

    def recorder(index: int, forward: Callable) -> Callable:
        def record(*args: Any, **kwargs: Any) -> Any:
            if calls[index] is not None:
                raise ArmorInputError(f"decoder layer {names[index]!r} ({type(blocks[index]).__name__}) is called more "
                                      "than once in one forward (a looped model) and prune_model runs each layer once, "
                                      "in order; prune its nn.Linear layers with ArmorSparsifier (whole-model "
                                      "calibration) instead")
            hidden, rest = _call_as_kwargs(forward, args, kwargs, names[index])
            calls[index] = (hidden, rest)
            if index == len(blocks) - 1:
                raise _Captured
            out = hidden + shift if shift else hidden
            return (out, None) if as_tuple else out
        return record

    own = [block.__dict__.get("forward") for block in blocks]  # a forward set on the instance (accelerate's hooks)
    for index, block in enumerate(blocks):
        block.forward = recorder(index, block.forward)  # the instance attribute shadows the class's forward
    try:
        run()
    except _Captured:
        pass
    except ArmorInputError:
        raise
    except Exception as err:  # noqa: BLE001  (a forward that cannot go on with a recorder's output: blocks it did not reach get block 0's arguments)
        if calls[0] is None:
            raise
        logger.debug("capturing decoder layer arguments stopped after layer %d: %s",
                     max(i for i, c in enumerate(calls) if c is not None), err)
    finally:
        for block, forward in zip(blocks, own):
            del block.forward
            if forward is not None:
                block.forward = forward
    shape = getattr(calls[0][0], "shape", None) if calls[0] is not None else None
    return [call if call is None or i == 0 or getattr(call[0], "shape", None) == shape else None
            for i, call in enumerate(calls)]


def _first_dependent(calls: Sequence[Optional[tuple]], shifted: Sequence[Optional[tuple]]) -> Optional[Tuple[int, str]]:
    """``(block index, argument name)`` of the first argument that differs between a recording whose
    blocks return their input and one whose blocks shift it: an argument the model computes from
    earlier blocks' outputs."""
    for index in range(1, len(calls)):
        if calls[index] is None or shifted[index] is None:
            continue
        plain, moved = calls[index][1], shifted[index][1]
        for name in plain:
            a = [x for x in tree_leaves(plain[name]) if isinstance(x, torch.Tensor)]
            b = [x for x in tree_leaves(moved.get(name)) if isinstance(x, torch.Tensor)]
            if len(a) != len(b) or any(x.shape != y.shape or (x.device.type != "meta" and not torch.equal(x, y))
                                       for x, y in zip(a, b)):
                return index, name
    return None


def capture_block_inputs(
    model: nn.Module,
    first_block: nn.Module,
    batches: Sequence[torch.Tensor],
    *,
    hidden_dtype: Optional[torch.dtype] = None,
    store_device: Optional[torch.device] = None,
    blocks: Optional[Sequence[nn.Module]] = None,
    blocks_prefix: str = "",
) -> List[BlockInput]:
    """Run each batch of token ids through ``model`` up to ``first_block`` and return what the
    block would receive. No decoder block runs (later blocks may sit on the meta device).
    ``hidden_dtype`` (default: as produced) and ``store_device`` (default: CPU) say how the hidden
    states are kept; the keyword arguments are kept as produced.

    With ``blocks`` (the decoder blocks, ``first_block`` first; ``blocks_prefix`` their list's name,
    for messages) each :class:`BlockInput` also holds every block's arguments as the model's forward
    passes them (:attr:`BlockInput.layer_kwargs`, see the module docstring); an argument the model
    computes from earlier blocks' outputs raises :class:`~torch_armor.errors.ArmorInputError`.

    A batch may be ``(token_ids, attention_mask)`` (``(b, seq_len)`` each, 0 = pad): the model gets
    the mask and the :class:`BlockInput` keeps it, so pad positions are left out of the statistics."""
    blocks = [first_block] if blocks is None else list(blocks)
    if blocks[0] is not first_block:
        raise ValueError("capture_block_inputs: blocks must start with first_block")
    names = [f"{blocks_prefix}.{i}" if blocks_prefix else str(i) for i in range(len(blocks))]
    captured: List[BlockInput] = []
    as_tuple = False  # the recorders return a tuple (decided on the first batch)
    device = model_device(model)
    extra = {"use_cache": False} if getattr(getattr(model, "config", None), "use_cache", None) is not None else {}
    with torch.no_grad():
        for j, batch in enumerate(batches):
            mask = None
            if isinstance(batch, (tuple, list)):
                batch, mask = batch
                mask = mask.to(torch.bool)
            kwargs = dict(extra) if mask is None else dict(extra, attention_mask=mask.to(device=device,
                                                                                        dtype=torch.long))
            run = functools.partial(model, batch.to(device=device, dtype=torch.long), **kwargs)
            calls = _record_block_calls(blocks, run, 0.0, names, as_tuple)
            if calls[0] is None:
                raise ArmorInputError("the model's forward never reached its first decoder block")
            if j == 0 and None in calls:  # not followed to the end: its layers may return a tuple
                retried = _record_block_calls(blocks, run, 0.0, names, as_tuple=True)
                if sum(c is not None for c in retried) > sum(c is not None for c in calls):
                    calls, as_tuple = retried, True
            if j == 0 and len(blocks) > 1:
                dependent = _first_dependent(calls, _record_block_calls(blocks, run, 1.0, names, as_tuple))
                if dependent is not None:
                    index, arg = dependent
                    raise ArmorInputError(
                        f"decoder layer {names[index]!r} ({type(blocks[index]).__name__}) is called with {arg!r}, "
                        "which the model computes from earlier layers' outputs (state carried across layers) and "
                        "prune_model runs one layer at a time; prune its nn.Linear layers with ArmorSparsifier "
                        "(whole-model calibration) instead")
            hidden, first_kwargs = calls[0]
            layer_kwargs = None
            if len(blocks) > 1:
                layer_kwargs = [(call if call is not None else calls[0])[1] for call in calls]
            captured.append(BlockInput(to_device(hidden, store_device or torch.device("cpu"), hidden_dtype),
                                       first_kwargs, mask, layer_kwargs))
    return captured


def run_block(block: nn.Module, inp: BlockInput, device: torch.device) -> torch.Tensor:
    """The block's output hidden states for one batch, computed on ``device`` in the block's dtype
    and returned like the input (its device and dtype). Computing on CUDA, host-side hidden states
    live in pinned memory (pinned once, on first use), so the copies each way are DMA transfers."""
    hidden = inp.hidden
    if torch.device(device).type == "cuda" and hidden.device.type == "cpu" and inp.path is None \
            and not hidden.is_pinned():
        hidden = hidden.pin_memory()
        inp.hidden = hidden
    param = next((p for p in block.parameters() if p.device.type != "meta"), None)
    compute_dtype = param.dtype if param is not None else hidden.dtype
    with torch.no_grad():
        out = block(hidden.to(device=device, dtype=compute_dtype, non_blocking=hidden.is_pinned()),
                    **to_device(inp.kwargs, device))
    if isinstance(out, (tuple, list)):
        out = out[0]
    if hidden.is_pinned() and out.device.type != "cpu":  # back into pinned memory (a blocking copy)
        return torch.empty(out.shape, dtype=hidden.dtype, pin_memory=True).copy_(out.detach())
    return out.detach().to(device=hidden.device, dtype=hidden.dtype)


class _WeightReads(TorchFunctionMode):
    """Records which of the watched weights (``{id(weight): layer name}``) any torch op reads."""

    def __init__(self, watched: Dict[int, str]) -> None:
        super().__init__()
        self.watched, self.read = watched, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for leaf in tree_leaves((args, kwargs or {})):
            if isinstance(leaf, torch.Tensor) and id(leaf) in self.watched:
                self.read.add(self.watched[id(leaf)])
        return func(*args, **(kwargs or {}))


def _uncalled_reasons(block: nn.Module, layers: Dict[str, nn.Linear], inp: BlockInput,
                      device: torch.device) -> Dict[str, str]:
    """Why each of ``layers`` (never called during calibration) is left dense, from one more run of
    ``block`` on ``inp`` that watches whether the block's forward reads their weights."""
    watch = _WeightReads({id(m.weight): n for n, m in layers.items()})
    with watch:
        run_block(block, inp, device)
    return {n: READ_BY_KERNEL if n in watch.read else NEVER_REACHED for n in layers}


def block_statistics(
    block: nn.Module,
    layers: Dict[str, nn.Linear],
    inputs: Sequence[BlockInput],
    *,
    device: torch.device,
    track_xtx: bool = False,
    propagate: bool = False,
    outputs: Optional[List[torch.Tensor]] = None,
    expert_calibration: str = "routed",
    min_expert_tokens: int = 0,
    expert_tokens: Optional[Dict[str, int]] = None,
    uncalled: Optional[Dict[str, str]] = None,
) -> Dict[str, LayerStatistics]:
    """Input statistics of ``layers`` (``{name: linear inside block}``) while ``block`` runs on
    ``inputs``; with ``propagate`` each batch's input is replaced by the block's output once the
    batch has run (the dense stream of a one-shot prune); ``outputs``, if given, receives the
    block's output for each batch.

    Linears that read the very same input tensor (q/k/v, gate/up) are observed once and share
    one :class:`LayerStatistics` (found from which tensors the first batch hands them).

    Expert layers (:class:`~torch_armor.calibration.experts.ExpertSlot` values) are observed per
    expert by :class:`~torch_armor.calibration.experts.ExpertsObserver` (``expert_calibration``,
    ``min_expert_tokens``); ``expert_tokens``, if given, receives ``{f"{experts}.{e}": routed tokens}``.

    ``uncalled``, if given, receives ``{name: why}`` for every linear of ``layers`` that was never
    called during the run (:data:`READ_BY_KERNEL` when the block's forward reads its weight directly,
    else :data:`NEVER_REACHED`); their statistics are empty. A linear that was called with all-zero
    inputs is not among them."""
    slots = {n: m for n, m in layers.items() if isinstance(m, ExpertSlot)}
    layers = {n: m for n, m in layers.items() if not isinstance(m, ExpertSlot)}
    experts = observe_experts(slots, track_xtx=track_xtx, mode=expert_calibration, min_tokens=min_expert_tokens)
    seen: Dict[str, torch.Tensor] = {}  # first batch: the tensor each linear read (kept alive, so `is` is exact)
    probes = []
    for name, module in layers.items():
        def probe(_m: nn.Module, args: tuple, _name: str = name) -> None:
            seen.setdefault(_name, args[0])
        probes.append(module.register_forward_pre_hook(probe))
    called: set = set()
    calls = [module.register_forward_pre_hook(lambda _m, _a, _name=name: called.add(_name))
             for name, module in layers.items()]
    first = None  # the first batch's input, kept for _uncalled_reasons when propagating replaces it
    if inputs and propagate and uncalled is not None:
        first = BlockInput(inputs[0].hidden, inputs[0].kwargs, inputs[0].token_mask)
    observers = {name: ActSqNormObserver(track_xtx=track_xtx).attach(module, name) for name, module in layers.items()}
    try:
        for i, inp in enumerate(inputs):
            with token_mask(getattr(inp, "token_mask", None)):
                out = run_block(block, inp, device)
            if propagate:
                inp.hidden = out
            if outputs is not None:
                outputs.append(out)
            del out
            if i == 0:  # the first batch showed which linears share an input: observe each input once
                for h in probes:
                    h.remove()
                probes = []
                reps: List[str] = []
                for name in layers:
                    rep = next((r for r in reps if name in seen and seen.get(r) is seen[name]), None)
                    if rep is None:
                        reps.append(name)
                    else:
                        observers[name].remove()
                        observers[name] = observers[rep]
                seen.clear()
    finally:
        for h in probes + calls:
            h.remove()
        for obs in observers.values():
            obs.remove()
        for obs in experts.values():
            obs.remove()
    stats = {name: obs.statistics() for name, obs in observers.items()}
    missing = {n: m for n, m in layers.items() if n not in called}
    if uncalled is not None and missing and inputs:
        uncalled.update(_uncalled_reasons(block, missing, first if first is not None else inputs[0], device))
    for module_name, obs in experts.items():
        found = obs.statistics()
        stats.update((n, found[n]) for n in slots if n in found)
        if expert_tokens is not None:
            expert_tokens.update((f"{module_name}.{e}", c) for e, c in obs.routed_tokens.items())
    return stats
