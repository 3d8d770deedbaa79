"""Decoder blocks: finding them, capturing their inputs, and block-local statistics.

The block-by-block engine (:mod:`torch_armor.engine.blocks`) calibrates one decoder block at a
time: the inputs of block 0 are captured from the embeddings (a forward pre-hook that stops the
model there), and each block's linears are observed while the block runs on its inputs.

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

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

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


class BlockInput:
    """One calibration batch at a block boundary: the hidden states and the keyword arguments
    the decoder layer is called with (attention mask, position embeddings, …).

    After :meth:`offload` the hidden states live in a safetensors file and are read back each
    time :attr:`hidden` is used; assigning :attr:`hidden` then rewrites the file.
    """

    def __init__(self, hidden: torch.Tensor, kwargs: Optional[Dict[str, Any]] = None,
                 token_mask: Optional[torch.Tensor] = None) -> None:
        self._hidden: Optional[torch.Tensor] = hidden
        self.kwargs: Dict[str, Any] = dict(kwargs or {})
        self.path: Optional[Path] = None
        #: ``(batch, seq_len)`` bool, False at pad positions (left out of statistics), or None
        self.token_mask: Optional[torch.Tensor] = token_mask

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


def capture_block_inputs(
    model: nn.Module,
    first_block: nn.Module,
    batches: Sequence[torch.Tensor],
    *,
    hidden_dtype: Optional[torch.dtype] = None,
    store_device: Optional[torch.device] = None,
) -> List[BlockInput]:
    """Run each batch of token ids through ``model`` up to ``first_block`` and return what the
    block would receive. Nothing after the embeddings runs (later blocks may sit on the meta
    device). ``hidden_dtype`` (default: as produced) and ``store_device`` (default: CPU) say how
    the hidden states are kept; the keyword arguments are kept as produced.

    A batch may be ``(token_ids, attention_mask)`` (``(b, seq_len)`` each, 0 = pad): the model gets
    the mask and the :class:`BlockInput` keeps it, so pad positions are left out of the statistics."""
    captured: List[BlockInput] = []
    current: Dict[str, Optional[torch.Tensor]] = {"mask": None}

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        captured.append(BlockInput(to_device(hidden, store_device or torch.device("cpu"), hidden_dtype), rest,
                                   current["mask"]))
        raise _Captured

    handle = first_block.register_forward_pre_hook(hook, with_kwargs=True)
    device = model_device(model)
    extra = {"use_cache": False} if getattr(getattr(model, "config", None), "use_cache", None) is not None else {}
    try:
        with torch.no_grad():
            for batch in batches:
                mask = None
                if isinstance(batch, (tuple, list)):
                    batch, mask = batch
                    mask = mask.to(torch.bool)
                current["mask"] = mask
                kwargs = dict(extra) if mask is None else dict(extra, attention_mask=mask.to(device=device,
                                                                                            dtype=torch.long))
                try:
                    model(batch.to(device=device, dtype=torch.long), **kwargs)
                except _Captured:
                    continue
                raise ArmorInputError("the model's forward never reached its first decoder block")
    finally:
        handle.remove()
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
