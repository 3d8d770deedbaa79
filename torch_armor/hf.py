"""ARMOR in the Hugging Face stack: a transformers quantizer (``quant_method: "armor"``).

Importing :mod:`torch_armor` registers :class:`ArmorQuantizationConfig` and
:class:`ArmorHfQuantizer` with transformers, so that

* ``model.save_pretrained(d)`` on a converted model (``prune_model``, ``ArmorSparsifier.convert``,
  ``load_pretrained``, ``from_pretrained``; any other model after :func:`attach_quantizer`) writes
  safetensors with the compact cores, ``A`` and ``B`` (the flattening of
  :mod:`torch_armor.tensor.flatten`) and ``config.json`` with ``quantization_config``: the pattern,
  every converted layer (shape, block size, storage, dtype, core quantization) and the dtypes of
  the non-persistent buffers;
* ``AutoModelForCausalLM.from_pretrained(d)`` builds the model on meta, swaps each converted
  linear's weight for an ArmorTensor of the saved shapes (no dense weight is ever allocated) and
  loads the parts through a transformers ``WeightConverter`` — ``dtype``, ``low_cpu_mem_usage``
  and ``device_map`` work as for any model.

Without ``import torch_armor`` transformers refuses the checkpoint (``Unknown quantization type,
got armor``), so a pruned model is never silently loaded with random decoder weights.

Example::

    >>> ArmorQuantizationConfig(layers={}).quant_method
    'armor'
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from torch_armor._io import atomic_write
from torch_armor.tensor.armor_tensor import QUANTIZED, ArmorTensor, from_parts, restore_storage
from torch_armor.tensor.flatten import (
    FORMAT_VERSION,
    _DTYPES,
    _build_layer,
    _dtype_name,
    _layer_keys,
    _validate_layer,
    flatten_armor_state,
    part_key,
)

from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

__all__ = ["QUANT_METHOD", "ArmorQuantizationConfig", "ArmorHfQuantizer", "attach_quantizer", "quantization_config_of",
           "from_pretrained", "write_hf_config", "write_hf_index"]

HF_INDEX_NAME = "model.safetensors.index.json"

QUANT_METHOD = "armor"


class ArmorQuantizationConfig(QuantizationConfigMixin):
    """``config.json``'s ``quantization_config`` of an ARMOR model.

    Args:
        layers: ``{"model.layers.0.self_attn.q_proj.weight": {shape, block_size, pattern, storage,
            runtime_storage, dtype, tensors, [quantization]}}`` — one entry per converted weight,
            exactly the layer description of :func:`~torch_armor.tensor.flatten.flatten_armor_state`.
        buffers: ``{name: dtype}`` of the model's non-persistent floating buffers (rotary
            ``inv_freq``…), restored on load so a bf16 model comes back bit-identical.
        pattern: the sparsity pattern(s), for people reading the file (``"2:4"``).
        format_version: the torch_armor format version.
    """

    def __init__(self, layers: Optional[Dict[str, Any]] = None, buffers: Optional[Dict[str, str]] = None,
                 pattern: Optional[str] = None, format_version: int = FORMAT_VERSION, **kwargs: Any) -> None:
        self.quant_method = QUANT_METHOD
        self.format_version = int(format_version)
        self.layers = dict(layers or {})
        self.buffers = dict(buffers or {})
        if pattern is None:
            patterns = sorted({str(v.get("pattern")) for v in self.layers.values()})
            pattern = ",".join(patterns) if patterns else None
        self.pattern = pattern
        if self.format_version != FORMAT_VERSION:
            raise ValueError(
                f"this ARMOR checkpoint is format version {self.format_version}; this torch_armor reads "
                f"version {FORMAT_VERSION}. Upgrade torch_armor or re-save the model"
            )

    def to_dict(self) -> Dict[str, Any]:
        return {"quant_method": QUANT_METHOD, "format_version": self.format_version, "pattern": self.pattern,
                "layers": self.layers, "buffers": self.buffers}


def _nonpersistent_buffer_dtypes(model: nn.Module) -> Dict[str, str]:
    out = {}
    for mname, module in model.named_modules():
        for bname in getattr(module, "_non_persistent_buffers_set", ()):
            buf = module._buffers.get(bname)
            if isinstance(buf, torch.Tensor) and buf.is_floating_point():
                out[f"{mname}.{bname}" if mname else bname] = _dtype_name(buf.dtype)
    return out


def quantization_config_of(model: nn.Module, layers: Optional[Dict[str, Any]] = None) -> ArmorQuantizationConfig:
    """The :class:`ArmorQuantizationConfig` describing ``model`` as it is now (``layers`` if already flattened)."""
    if layers is None:
        _, meta = flatten_armor_state(model)
        layers = meta["layers"]
    return ArmorQuantizationConfig(layers=layers, buffers=_nonpersistent_buffer_dtypes(model))


def attach_quantizer(model: nn.Module) -> nn.Module:
    """Make ``model.save_pretrained`` write the ARMOR format (sets ``model.hf_quantizer`` and
    ``model.config.quantization_config``); a no-op for models without a transformers config or
    without ArmorTensor weights. Returns ``model``.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict") or not hasattr(model, "save_pretrained"):
        return model
    if not any(isinstance(p, ArmorTensor) for p in model.parameters()):
        return model
    qconfig = quantization_config_of(model)
    if not isinstance(getattr(model, "hf_quantizer", None), ArmorHfQuantizer):
        model.hf_quantizer = ArmorHfQuantizer(qconfig, pre_quantized=True)
    else:
        model.hf_quantizer.quantization_config = qconfig
    config.quantization_config = qconfig
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD
    return model


# ----------------------------------------------------------- torch_armor.save/load_pretrained


def write_hf_config(path: Path, hf_config: Any, layers: Optional[Dict[str, Any]] = None,
                     buffers: Optional[Dict[str, str]] = None) -> None:
    """Write ``config.json``; with converted ``layers`` it carries ``quantization_config`` (quant_method
    ``"armor"``), so ``AutoModelForCausalLM.from_pretrained`` loads the directory."""
    quant = None
    dtypes = {layer.get("dtype") for layer in (layers or {}).values()}
    if layers:
        quant = ArmorQuantizationConfig(layers=layers, buffers=buffers).to_dict()
    if isinstance(hf_config, Mapping):
        data = dict(hf_config)
        if quant is not None:
            data["quantization_config"] = quant
            if len(dtypes) == 1:  # from_pretrained(dtype="auto") builds the model in the layers' dtype
                data["dtype"] = dtypes.pop()
        text = json.dumps(data, indent=2, sort_keys=True) + "\n"
        atomic_write(path / "config.json", text.encode())
    elif hasattr(hf_config, "save_pretrained"):
        if quant is not None:
            hf_config = copy.deepcopy(hf_config)
            hf_config.quantization_config = quant
            if len(dtypes) == 1:  # from_pretrained(dtype="auto") builds the model in the layers' dtype
                hf_config.dtype = dtypes.pop()
        hf_config.save_pretrained(str(path))
    else:
        raise ValueError(f"hf_config must be a transformers config or a dict, got {type(hf_config).__name__}")


def write_hf_index(path: Path, dests: Sequence[Path], owner: Dict[str, Path], sources: Sequence[Path]) -> None:
    """``model.safetensors.index.json`` (the Hugging Face sharded layout) for a multi-file checkpoint."""
    dest_of = {s: d for s, d in zip(sources, dests)}
    weight_map = {key: dest_of[src].name for key, src in sorted(owner.items())}
    total = sum(d.stat().st_size for d in dests)
    text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    atomic_write(path / HF_INDEX_NAME, text.encode())


def from_pretrained(path: Path, device: Optional[Union[str, torch.device]], storage: Optional[str]) -> nn.Module:
    """``from_pretrained`` of the class named in ``config.json`` (a causal LM by default), in its saved dtype."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(path))
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    cls = cls or transformers.AutoModelForCausalLM
    kwargs: Dict[str, Any] = {"dtype": "auto"}
    if device is not None:
        kwargs["device_map"] = str(torch.device(device))
    model = cls.from_pretrained(str(path), **kwargs).eval()
    if storage is not None:
        for module in model.modules():
            w = module._parameters.get("weight")
            if isinstance(w, ArmorTensor) and w.storage_format != QUANTIZED and w.storage_format != storage:
                module._parameters["weight"] = nn.Parameter(w.with_storage(storage), requires_grad=False)
    return model


# ---------------------------------------------------------------------------- loading


def _suffix_pattern(suffix: str) -> str:
    # one capturing group, the target `\1`: "….q_proj.weight.b_blocks" -> "….q_proj.weight"
    return r"(weight)\." + re.escape(suffix) + "$"


class ArmorDeserialize(ConversionOps):
    """Builds one converted layer's ArmorTensor from its saved parts (a transformers conversion op)."""

    def __init__(self, hf_quantizer: "ArmorHfQuantizer") -> None:
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: Dict[str, Any], source_patterns: Optional[list] = None, model: Any = None,
                full_layer_name: Optional[str] = None, **kwargs: Any) -> Dict[str, torch.Tensor]:
        layers = self.hf_quantizer.quantization_config.layers
        if full_layer_name not in layers:
            raise ValueError(
                f"{full_layer_name}: the checkpoint holds ARMOR parts for it but config.json's quantization_config "
                "does not list the layer; the directory is corrupt or was edited"
            )
        layer = layers[full_layer_name]
        by_suffix = self.hf_quantizer._suffix_of
        tensors = {}
        for pattern, values in input_dict.items():
            value = values[0] if isinstance(values, list) else values
            tensors[part_key(full_layer_name, by_suffix[pattern])] = value
        _validate_layer(full_layer_name, layer, tensors)
        w = _build_layer(full_layer_name, layer, tensors)
        module, _, pname = full_layer_name.rpartition(".")
        target = model.get_submodule(module)._parameters[pname]
        dtype = target.dtype if target is not None else w.dtype
        if dtype != w.dtype:  # dtype= at load time: the wrappers and a floating core follow it
            w = w.to(dtype)
        w = restore_storage(w, layer["runtime_storage"], name=full_layer_name)
        param = nn.Parameter(w, requires_grad=False)
        return {full_layer_name: param}


class ArmorHfQuantizer(HfQuantizer):
    """Loads and saves ARMOR checkpoints in ``from_pretrained`` / ``save_pretrained``."""

    requires_calibration = True  # a dense checkpoint cannot be ARMOR-converted on load: prune it first

    def __init__(self, quantization_config: ArmorQuantizationConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        layers = quantization_config.layers
        suffixes = {"a_blocks", "b_blocks", "values", "indices", "core"}  # "a_blocks": files before part_key
        for fqn, layer in layers.items():
            suffixes.update(key[len(fqn) + 1:] for key in _layer_keys(fqn, layer) if key != fqn)
        self._suffix_of = {_suffix_pattern(s): s for s in sorted(suffixes)}
        if layers:  # a_blocks lives under the weight's own key (part_key): match exactly those keys
            exact = "^(" + "|".join(re.escape(fqn) for fqn in sorted(layers)) + ")$"
            self._suffix_of[exact] = "a_blocks"

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("ARMOR checkpoints cannot be offloaded to disk; use a device_map without 'disk'")

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        """Swap each converted layer's (meta) weight for an ArmorTensor of the saved parts' shapes."""
        for fqn, layer in self.quantization_config.layers.items():
            module_path, _, pname = fqn.rpartition(".")
            try:
                module = model.get_submodule(module_path)
            except AttributeError:
                raise ValueError(f"config.json lists ARMOR layer {fqn!r}, which this {type(model).__name__} lacks") from None
            old = module._parameters.get(pname)
            if old is None or tuple(old.shape) != tuple(layer["shape"]):
                raise ValueError(
                    f"ARMOR layer {fqn!r} is {tuple(layer['shape'])} in the checkpoint, "
                    f"{None if old is None else tuple(old.shape)} in the model"
                )
            meta = {name: torch.empty(spec["shape"], dtype=_DTYPES[spec["dtype"]], device="meta")
                    for name, spec in layer["tensors"].items()}
            a, b = meta.pop("a_blocks"), meta.pop("b_blocks")
            inner = {k: v for k, v in meta.items() if k in ("values", "indices", "core")}
            storage = layer["storage"] if layer["storage"] != QUANTIZED else "dense"
            if storage == "dense" and "core" not in inner:
                inner = {"core": torch.empty(layer["shape"], dtype=old.dtype, device="meta")}
            w = from_parts(storage, a.to(old.dtype), b.to(old.dtype), layer["pattern"], old.dtype, **inner)
            module._parameters[pname] = nn.Parameter(w, requires_grad=False)
        return model

    def get_weight_conversions(self) -> list:
        if not self.pre_quantized:
            return []
        return [WeightConverter(list(self._suffix_of), r"\1", [ArmorDeserialize(self)])]

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        conversions = getattr(model, "_weight_conversions", None)
        if conversions:  # our converter has no reverse: saving re-flattens the ArmorTensors instead
            model._weight_conversions = [
                c for c in conversions
                if not any(isinstance(op, ArmorDeserialize) for op in getattr(c, "operations", ()))
            ]
        for name, dtype in self.quantization_config.buffers.items():
            module_path, _, bname = name.rpartition(".")
            try:
                module = model.get_submodule(module_path)
            except AttributeError:
                continue
            buf = module._buffers.get(bname)
            if isinstance(buf, torch.Tensor) and dtype in _DTYPES and buf.dtype != _DTYPES[dtype]:
                module._buffers[bname] = buf.to(_DTYPES[dtype])
        return model

    def get_state_dict_and_metadata(self, model: nn.Module):
        tensors, meta = flatten_armor_state(model)
        for key, target in meta["aliases"].items():
            tensors[key] = tensors[target]
        qconfig = quantization_config_of(model, meta["layers"])
        self.quantization_config = qconfig
        model.config.quantization_config = qconfig
        return tensors, {"torch_armor_format": str(FORMAT_VERSION)}

    def _dequantize(self, model: nn.Module, dtype: Optional[torch.dtype] = None) -> nn.Module:
        """``model.dequantize()``: every ArmorTensor weight becomes its dense ``A·core·B``."""
        for module in model.modules():
            w = module._parameters.get("weight")
            if isinstance(w, ArmorTensor):
                module._parameters["weight"] = nn.Parameter(w.dense_weight(w.dtype), requires_grad=True)
        return model

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        return True


def _register() -> None:
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(ArmorQuantizationConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(ArmorHfQuantizer)


_register()
