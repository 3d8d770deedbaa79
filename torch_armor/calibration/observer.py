"""Streaming activation statistics for linear layers (plain forward pre-hooks).

For every observed ``nn.Linear`` we accumulate, over all tokens ``x`` (rows of the input,
any leading batch/sequence shape), in float32 whatever the input dtype:

* ``act_sq_norm[j] = Σ x_j²``  (shape ``(d_in,)``): ARMOR, Wanda and NoWag need it;
* ``xtx = Σ xᵀx``  (shape ``(d_in, d_in)``, only with ``track_xtx=True``): SparseGPT needs it;
* ``num_tokens``.

Activations are never stored. No ``torch.ao.quantization`` observers are used.

Padding: inside ``with token_mask(attention_mask):`` (``(batch, seq)``, 1 = real token, 0 = pad)
every observer keeps only the rows of real tokens, so pad positions are left out of every
statistic (``Σ x²``, ``XᵀX``, ``num_tokens``). :func:`collect_statistics`, ``prune_model`` and the
sparsifiers' ``set_attention_mask`` use it; without a mask every position counts.

Example::

    >>> lin = torch.nn.Linear(4, 2)
    >>> obs = ActSqNormObserver().attach(lin, "lin")
    >>> _ = lin(torch.ones(3, 5, 4))
    >>> obs.num_tokens, obs.act_sq_norm.tolist()
    (15, [15.0, 15.0, 15.0, 15.0])
    >>> obs.remove()
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Union

import torch
from torch import nn
from torch_armor.progress import tqdm
from torch_armor.errors import ArmorInputError

__all__ = [
    "model_device",
    "LayerStatistics",
    "ActSqNormObserver",
    "attach_observers",
    "remove_observers",
    "decoder_linear_names",
    "collect_statistics",
    "token_mask",
    "set_token_mask",
    "current_token_mask",
]

_TOKEN_MASK: "contextvars.ContextVar[Optional[torch.Tensor]]" = contextvars.ContextVar("torch_armor_token_mask",
                                                                                      default=None)


def _as_token_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.is_floating_point() and not bool(
            ((mask == 0) | (mask == 1)).all()):
        raise ArmorInputError("attention_mask must be a (batch, seq_len) tensor of 0 (pad) and 1 (token), got "
                         f"{type(mask).__name__} {tuple(getattr(mask, 'shape', ()))}")
    mask = mask.detach().to(torch.bool)
    if not bool(mask.any()):
        raise ArmorInputError("attention_mask masks every position of the batch: nothing would be observed")
    return mask


def set_token_mask(mask: Optional[torch.Tensor]) -> None:
    """Observe only the tokens where ``mask`` (``(batch, seq_len)``) is 1 in the forward passes
    that follow, until the next call (``None``: every position again)."""
    _TOKEN_MASK.set(_as_token_mask(mask))


def current_token_mask() -> Optional[torch.Tensor]:
    """The ``(batch, seq_len)`` mask observers apply now (:func:`token_mask`), or ``None``."""
    return _TOKEN_MASK.get()


@contextlib.contextmanager
def token_mask(mask: Optional[torch.Tensor]):
    """Within the block, observers count only the positions where ``mask`` is 1 (pads left out).

    Example::

        >>> lin = torch.nn.Linear(2, 1)
        >>> obs = ActSqNormObserver().attach(lin, "lin")
        >>> x = torch.tensor([[[1.0, 1.0], [5.0, 5.0]]])        # batch 1, 2 positions
        >>> with token_mask(torch.tensor([[1, 0]])):            # the second one is padding
        ...     _ = lin(x)
        >>> obs.num_tokens, obs.act_sq_norm.tolist()
        (1, [1.0, 1.0])
        >>> obs.remove()
    """
    handle = _TOKEN_MASK.set(_as_token_mask(mask))
    try:
        yield
    finally:
        _TOKEN_MASK.reset(handle)


@dataclass(frozen=True)
class LayerStatistics:
    """Accumulated input statistics of one linear layer.

    Attributes:
        act_sq_norm: ``Σ_tokens x_j²``, float32, shape ``(d_in,)`` (``h`` in the ARMOR proxy loss).
        num_tokens: how many input rows were accumulated.
        xtx: ``Σ_tokens xᵀx``, float32, shape ``(d_in, d_in)``, or ``None`` if not tracked.

    Example::

        >>> s = LayerStatistics(torch.tensor([4.0, 8.0]), num_tokens=4)
        >>> s.mean_sq.tolist()
        [1.0, 2.0]
    """

    act_sq_norm: torch.Tensor
    num_tokens: int
    xtx: Optional[torch.Tensor] = None

    @property
    def mean_sq(self) -> torch.Tensor:
        """``act_sq_norm / num_tokens`` (mean squared activation per input channel)."""
        if self.num_tokens == 0:
            raise ArmorInputError("no tokens were observed, so there is no mean; run the model first")
        return self.act_sq_norm / self.num_tokens


class ActSqNormObserver:
    """Accumulates ``Σ x_j²`` (and optionally ``Σ xᵀx``) of a linear layer's input.

    Attach with :meth:`attach`; every forward call of the module then adds its input to the
    statistics. Inputs containing NaN/Inf raise a ``ValueError`` naming the layer.

    Example::

        >>> lin = torch.nn.Linear(3, 1)
        >>> obs = ActSqNormObserver(track_xtx=True).attach(lin, "proj")
        >>> _ = lin(torch.tensor([[1.0, 2.0, 0.0]]))
        >>> obs.xtx.tolist()
        [[1.0, 2.0, 0.0], [2.0, 4.0, 0.0], [0.0, 0.0, 0.0]]
        >>> obs.remove()
    """

    def __init__(self, track_xtx: bool = False) -> None:
        self.track_xtx = bool(track_xtx)
        self.name: Optional[str] = None
        self.in_features: Optional[int] = None
        self.num_tokens = 0
        self._sq: Optional[torch.Tensor] = None
        self._xtx: Optional[torch.Tensor] = None
        self._handle: Optional[torch.utils.hooks.RemovableHandle] = None
        self._device: Optional[torch.device] = None

    # -- lifecycle -----------------------------------------------------------------------------
    def attach(self, module: nn.Module, name: str = "") -> "ActSqNormObserver":
        """Register the forward pre-hook on ``module`` (an ``nn.Linear``); returns ``self``."""
        if not isinstance(module, nn.Linear):
            raise ArmorInputError(
                f"ActSqNormObserver observes nn.Linear layers, but {name or 'the module'} is a "
                f"{type(module).__name__}"
            )
        if self._handle is not None:
            raise ArmorInputError(
                f"this observer is already attached to {self.name!r}; call remove() first or "
                f"create one observer per layer"
            )
        self.name = name
        self.in_features = module.in_features
        self._device = module.weight.device if module.weight.device.type != "meta" else None
        self._handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def remove(self) -> None:
        """Detach the hook (statistics are kept). Safe to call twice."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def reset(self) -> None:
        """Forget all accumulated statistics (the hook stays attached)."""
        self.num_tokens = 0
        self._sq = None
        self._xtx = None

    @property
    def attached(self) -> bool:
        """Whether the hook is currently registered."""
        return self._handle is not None

    # -- accumulation --------------------------------------------------------------------------
    def _hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor):
            raise ArmorInputError(f"layer {self.name!r} was called without a tensor input")
        self.update(x)

    def update(self, x: torch.Tensor) -> None:
        """Add the rows of ``x`` (shape ``(..., d_in)``) to the statistics."""
        d_in = self.in_features if self.in_features is not None else x.shape[-1]
        if x.dim() == 0 or x.shape[-1] != d_in:
            raise ArmorInputError(
                f"layer {self.name!r} expects inputs with last dimension {d_in}, "
                f"got shape {tuple(x.shape)}"
            )
        with torch.no_grad():
            rows = x.detach().reshape(-1, d_in).to(torch.float32)
            mask = _TOKEN_MASK.get()
            if mask is not None:
                if mask.numel() != rows.shape[0]:
                    raise ArmorInputError(
                        f"layer {self.name!r} saw {rows.shape[0]} input rows but the attention mask has "
                        f"{mask.numel()} positions {tuple(mask.shape)}: pass the mask of the batch being run")
                rows = rows[mask.reshape(-1).to(rows.device)]
            sq = rows.square().sum(dim=0)
            if not bool(torch.isfinite(sq).all()):
                if not bool(torch.isfinite(rows).all()):
                    raise ArmorInputError(
                        f"NaN or Inf in the input of layer {self.name!r}; the model produces "
                        f"non-finite activations on this data (check the dtype, e.g. fp16 "
                        f"overflow, or the weights)"
                    )
                raise ArmorInputError(
                    f"squared inputs of layer {self.name!r} overflow float32; the activations "
                    f"are too large (|x| > 1e19) to accumulate"
                )
            if self._sq is None:
                self._sq = torch.zeros(d_in, dtype=torch.float32, device=rows.device)
                if self.track_xtx:
                    self._xtx = torch.zeros(d_in, d_in, dtype=torch.float32, device=rows.device)
            self._sq += sq
            if self.track_xtx:
                self._xtx.addmm_(rows.T, rows)
            self.num_tokens += rows.shape[0]

    # -- results -------------------------------------------------------------------------------
    def _zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=torch.float32, device=self._device or "cpu")

    @property
    def act_sq_norm(self) -> torch.Tensor:
        """``Σ x_j²`` over all observed tokens, float32 ``(d_in,)`` (zeros before any input)."""
        if self._sq is None:
            if self.in_features is None:
                raise ArmorInputError("the observer is not attached to a layer and has seen no input")
            return self._zeros(self.in_features)
        return self._sq

    @property
    def xtx(self) -> Optional[torch.Tensor]:
        """``Σ xᵀx``, float32 ``(d_in, d_in)``; ``None`` unless ``track_xtx=True``."""
        if not self.track_xtx:
            return None
        if self._xtx is None:
            if self.in_features is None:
                raise ArmorInputError("the observer is not attached to a layer and has seen no input")
            return self._zeros(self.in_features, self.in_features)
        return self._xtx

    def statistics(self) -> LayerStatistics:
        """The accumulated statistics as a :class:`LayerStatistics`."""
        return LayerStatistics(self.act_sq_norm, self.num_tokens, self.xtx)

    def __repr__(self) -> str:
        return (
            f"ActSqNormObserver(name={self.name!r}, in_features={self.in_features}, "
            f"num_tokens={self.num_tokens}, track_xtx={self.track_xtx}, attached={self.attached})"
        )


def _resolve(model: nn.Module, names_or_modules: Iterable[Union[str, nn.Module]]) -> dict[str, nn.Module]:
    if isinstance(names_or_modules, (str, nn.Module)):
        names_or_modules = [names_or_modules]
    by_name = dict(model.named_modules())
    by_id = {id(m): n for n, m in by_name.items()}
    resolved: dict[str, nn.Module] = {}
    for item in names_or_modules:
        if isinstance(item, str):
            if item not in by_name:
                raise ArmorInputError(
                    f"the model has no submodule named {item!r}; see decoder_linear_names(model) "
                    f"or model.named_modules() for valid names"
                )
            resolved[item] = by_name[item]
        elif isinstance(item, nn.Module):
            if id(item) not in by_id:
                raise ArmorInputError(f"the module {type(item).__name__} given is not part of the model")
            resolved[by_id[id(item)]] = item
        else:
            raise ArmorInputError(f"expected module names or nn.Module objects, got {type(item).__name__}")
    return resolved


def attach_observers(
    model: nn.Module,
    names_or_modules: Iterable[Union[str, nn.Module]],
    track_xtx: bool = False,
) -> dict[str, ActSqNormObserver]:
    """Attach one :class:`ActSqNormObserver` per named linear of ``model``.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
        >>> obs = attach_observers(model, ["0", "1"])
        >>> _ = model(torch.ones(5, 2))
        >>> obs["1"].num_tokens
        5
        >>> remove_observers(obs)
    """
    observers: dict[str, ActSqNormObserver] = {}
    try:
        for name, module in _resolve(model, names_or_modules).items():
            observers[name] = ActSqNormObserver(track_xtx=track_xtx).attach(module, name)
    except Exception:
        remove_observers(observers)
        raise
    return observers


def remove_observers(observers: Union[Mapping[str, ActSqNormObserver], Iterable[ActSqNormObserver]]) -> None:
    """Remove the hooks of all observers (statistics are kept)."""
    values = observers.values() if isinstance(observers, Mapping) else observers
    for obs in values:
        obs.remove()


def _storage_key(t: torch.Tensor) -> Optional[tuple]:
    if t.device.type == "meta":
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return None
    return (t.device, ptr) if ptr else None


def decoder_linear_names(model: nn.Module) -> list[str]:
    """Names of the linears to prune: every ``nn.Linear`` (subclasses included) except the
    output head (``model.get_output_embeddings()``) and any linear whose weight is tied to
    (is, or shares storage with) an input embedding. SmolLM2-135M gives 210 names.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
        >>> decoder_linear_names(LlamaForCausalLM(cfg))[:2]
        ['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.k_proj']
    """
    excluded_ids: set[int] = set()
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if isinstance(head, nn.Module):
        excluded_ids.add(id(head))

    emb_weights: list[torch.Tensor] = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    get_in = getattr(model, "get_input_embeddings", None)
    try:
        inp = get_in() if callable(get_in) else None
    except NotImplementedError:
        inp = None
    if isinstance(getattr(inp, "weight", None), torch.Tensor):
        emb_weights.append(inp.weight)
    emb_ids = {id(w) for w in emb_weights}
    emb_storage = {k for k in (_storage_key(w) for w in emb_weights) if k is not None}

    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or id(module) in excluded_ids:
            continue
        w = module.weight
        if id(w) in emb_ids or _storage_key(w) in emb_storage:
            continue
        names.append(name)
    return names


def model_device(model: nn.Module) -> torch.device:
    """Where to put the token ids: accelerate's execution device for an offloaded model, else
    the input embedding's device (the first stage of a ``device_map``), else the first real
    parameter's. Offloaded weights sit on the meta device and are never the answer."""
    hook = getattr(model, "_hf_hook", None)
    exec_device = getattr(hook, "execution_device", None)
    if exec_device is not None:
        return torch.device(f"cuda:{exec_device}" if isinstance(exec_device, int) else exec_device)
    try:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except NotImplementedError:
        emb = None
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device.type != "meta":
        return weight.device
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _forward_kwargs(model: nn.Module) -> dict[str, Any]:
    config = getattr(model, "config", None)
    return {"use_cache": False} if getattr(config, "use_cache", None) is not None else {}


def collect_statistics(
    model: nn.Module,
    names: Iterable[Union[str, nn.Module]],
    windows: torch.Tensor,
    batch_size: int = 4,
    track_xtx: bool = False,
    progress: bool = True,
    attention_mask: Optional[torch.Tensor] = None,
) -> dict[str, LayerStatistics]:
    """Run ``windows`` (``(n, seq_len)`` token ids) through ``model`` and return the input
    statistics of each named linear. With ``attention_mask`` (same shape, 0 = pad) the model
    gets the mask and pad positions are left out of every statistic.

    Forward passes run under ``torch.no_grad`` in eval mode (the previous train/eval mode is
    restored), ``batch_size`` windows at a time; the hooks are removed even on error.
    Statistics stay on the device where they were accumulated.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
        >>> model = LlamaForCausalLM(cfg)
        >>> stats = collect_statistics(model, decoder_linear_names(model),
        ...                            torch.randint(0, 50, (3, 8)), progress=False)
        >>> stats["model.layers.0.mlp.down_proj"].act_sq_norm.shape, stats["model.layers.0.mlp.down_proj"].num_tokens
        (torch.Size([64]), 24)
    """
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2:
        raise ArmorInputError(
            "windows must be a 2-D tensor of token ids (n_windows, seq_len), e.g. from "
            f"calibration_windows(); got {type(windows).__name__} with shape "
            f"{tuple(getattr(windows, 'shape', ()))}"
        )
    if windows.dtype.is_floating_point or windows.numel() == 0:
        raise ArmorInputError(f"windows must be non-empty integer token ids, got dtype {windows.dtype} and shape {tuple(windows.shape)}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ArmorInputError(f"batch_size must be a positive integer, got {batch_size!r}")

    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != windows.shape):
        raise ArmorInputError(f"attention_mask must have the windows' shape {tuple(windows.shape)}, got "
                         f"{tuple(getattr(attention_mask, 'shape', ()))}")
    observers = attach_observers(model, names, track_xtx=track_xtx)
    was_training = model.training
    device = model_device(model)
    kwargs = _forward_kwargs(model)
    try:
        model.eval()
        with torch.no_grad():
            for start in tqdm(
                range(0, windows.shape[0], batch_size),
                desc="calibration",
                unit="batch",
                disable=not progress,
            ):
                batch = windows[start : start + batch_size].to(device=device, dtype=torch.long)
                if attention_mask is None:
                    model(batch, **kwargs)
                    continue
                mask = attention_mask[start : start + batch_size]
                with token_mask(mask):
                    model(batch, attention_mask=mask.to(device=device, dtype=torch.long), **kwargs)
    finally:
        remove_observers(observers)
        model.train(was_training)
    return {name: obs.statistics() for name, obs in observers.items()}
