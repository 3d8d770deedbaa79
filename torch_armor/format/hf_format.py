"""The ARMOR format inside a Hugging Face checkpoint: ``config.json``'s ``quantization_config``,
the sharded-index file, and handing a converted model to transformers.

``quantization_config`` (:func:`quantization_config_dict`) carries ``quant_method: "armor"``, the
pattern(s), every converted layer's description (:func:`torch_armor.format.layout.layer_parts`)
and the dtypes of the non-persistent buffers. :func:`attach_quantizer` makes a converted model's
``save_pretrained`` write this format and :func:`load_hf_quantized` loads such a directory with
``from_pretrained``; both use the quantizer that :mod:`torch_armor.format.hf` registers with transformers
under ``quant_method "armor"`` (``import torch_armor`` registers it).

Example::

    >>> quantization_config_dict({"fc.weight": {"pattern": "2:4"}})["pattern"]
    '2:4'
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
import transformers
from torch import nn
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

from torch_armor._io import atomic_write
from torch_armor.errors import ArmorInputError
from torch_armor.progress import third_party_bars_off
from torch_armor.tensor.armor_tensor import STORAGES, ArmorTensor
from torch_armor.format.file_checks import INCOMPLETE_KEY, check_load_target, refuse_missing_keys
from torch_armor.format.flatten import flatten_armor_state
from torch_armor.format.layout import FORMAT_VERSION, dtype_name

__all__ = ["QUANT_METHOD", "HF_INDEX_NAME", "quantization_pattern", "quantization_config_dict",
           "nonpersistent_buffer_dtypes", "write_hf_config", "mark_incomplete", "write_hf_index",
           "has_armor_quantization_config", "attach_quantizer", "load_hf_quantized"]

QUANT_METHOD = "armor"
HF_INDEX_NAME = "model.safetensors.index.json"


def quantization_pattern(layers: Mapping[str, Any]) -> Optional[str]:
    """The pattern(s) of the converted layers, for people reading ``config.json`` (``"2:4"``)."""
    patterns = sorted({str(v.get("pattern")) for v in layers.values()})
    return ",".join(patterns) if patterns else None


def quantization_config_dict(layers: Mapping[str, Any], buffers: Optional[Mapping[str, str]] = None,
                             pattern: Optional[str] = None, format_version: int = FORMAT_VERSION) -> Dict[str, Any]:
    """``config.json``'s ``quantization_config`` of an ARMOR model."""
    return {"quant_method": QUANT_METHOD, "format_version": int(format_version),
            "pattern": quantization_pattern(layers) if pattern is None else pattern,
            "layers": dict(layers), "buffers": dict(buffers or {})}


def nonpersistent_buffer_dtypes(model: nn.Module) -> Dict[str, str]:
    """``{name: dtype}`` of the non-persistent floating buffers (rotary ``inv_freq``…), which the
    weights files do not hold: restored on load so a bf16 model comes back bit-identical."""
    out = {}
    for mname, module in model.named_modules():
        for bname in getattr(module, "_non_persistent_buffers_set", ()):
            buf = module._buffers.get(bname)
            if isinstance(buf, torch.Tensor) and buf.is_floating_point():
                out[f"{mname}.{bname}" if mname else bname] = dtype_name(buf.dtype)
    return out


def write_hf_config(path: Path, hf_config: Any, layers: Optional[Dict[str, Any]] = None,
                    buffers: Optional[Dict[str, str]] = None) -> None:
    """Write ``config.json``; with converted ``layers`` it carries ``quantization_config`` (quant_method
    ``"armor"``), so ``AutoModelForCausalLM.from_pretrained`` loads the directory."""
    dtypes = {layer.get("dtype") for layer in (layers or {}).values()}
    _write_config(path, hf_config, quantization_config_dict(layers, buffers) if layers else None, dtypes)


def mark_incomplete(path: Path, hf_config: Any) -> None:
    """Write a ``config.json`` whose ``quantization_config`` says the directory is being rewritten
    (:data:`~torch_armor.format.file_checks.INCOMPLETE_KEY`): until :func:`write_hf_config` replaces it,
    ``from_pretrained`` and ``load_pretrained`` refuse the directory instead of loading weights files of two saves."""
    quant = {"quant_method": QUANT_METHOD, "format_version": FORMAT_VERSION,
             INCOMPLETE_KEY: f"process {os.getpid()}"}
    _write_config(path, hf_config, quant, set())


def _write_config(path: Path, hf_config: Any, quant: Optional[Dict[str, Any]], dtypes: set) -> None:
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
        raise ArmorInputError(f"hf_config must be a transformers config or a dict, got {type(hf_config).__name__}")


def write_hf_index(path: Path, dests: Sequence[Path], owner: Dict[str, Path], sources: Sequence[Path]) -> None:
    """``model.safetensors.index.json`` (the Hugging Face sharded layout) for a multi-file checkpoint."""
    dest_of = {s: d for s, d in zip(sources, dests)}
    weight_map = {key: dest_of[src].name for key, src in sorted(owner.items())}
    total = sum(d.stat().st_size for d in dests)
    text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    atomic_write(path / HF_INDEX_NAME, text.encode())


def has_armor_quantization_config(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path/config.json`` has a ``quantization_config`` whose ``quant_method`` is :data:`QUANT_METHOD`."""
    try:
        with open(Path(path) / "config.json") as fh:
            quant = json.load(fh).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(quant, dict) and quant.get("quant_method") == QUANT_METHOD


def _registered() -> Tuple[type, type]:
    """The quantization config and quantizer classes registered with transformers for ``"armor"``."""
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING or QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        raise ArmorInputError("transformers does not know quant_method 'armor': import torch_armor (its hf module "
                              "registers the ARMOR quantizer) before saving or loading ARMOR models")
    return AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD], AUTO_QUANTIZER_MAPPING[QUANT_METHOD]


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
    config_class, quantizer_class = _registered()
    _, meta = flatten_armor_state(model)
    qconfig = config_class(layers=meta["layers"], buffers=nonpersistent_buffer_dtypes(model))
    if not isinstance(getattr(model, "hf_quantizer", None), quantizer_class):
        model.hf_quantizer = quantizer_class(qconfig, pre_quantized=True)
    else:
        model.hf_quantizer.quantization_config = qconfig
    model.hf_quantizer._model = model
    config.quantization_config = qconfig
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD
    return model


def load_hf_quantized(path: Path, device: Optional[Union[str, torch.device]], storage: Optional[str]) -> nn.Module:
    """``from_pretrained`` of the class named in ``config.json`` (a causal LM by default), in its saved
    dtype, of a directory whose ``config.json`` has the ARMOR ``quantization_config``."""
    _registered()
    check_load_target(path, device)  # files, quantization_config and device checked before transformers reads them
    config = transformers.AutoConfig.from_pretrained(str(path))
    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    cls = cls or transformers.AutoModelForCausalLM
    kwargs: Dict[str, Any] = {"dtype": "auto"}
    if device is not None:
        kwargs["device_map"] = str(torch.device(device))
    with third_party_bars_off():  # no "Loading weights" bar: the caller asked for a model, not a bar
        model, info = cls.from_pretrained(str(path), output_loading_info=True, **kwargs)
    refuse_missing_keys(path, info)  # a torch_armor directory never loads with randomly initialised weights
    model.eval()
    if storage is not None:
        for module in model.modules():
            for pname, w in list(module._parameters.items()):
                # floating cores only: a quantized (torchao, int8, fp8) core is not re-stored
                if isinstance(w, ArmorTensor) and w.storage_format in STORAGES \
                        and w.storage_format != storage:
                    module._parameters[pname] = nn.Parameter(w.with_storage(storage), requires_grad=False)
    return model
