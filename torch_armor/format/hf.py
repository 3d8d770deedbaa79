"""All of torch_armor's transformers integration: ARMOR as a transformers quantizer (``quant_method:
"armor"``), ``config.json``'s ``quantization_config``, the sharded-index file, and handing a
converted model to transformers (:func:`attach_quantizer`, :func:`load_hf_quantized`).

Importing this module registers :class:`ArmorQuantizationConfig` and :class:`ArmorHfQuantizer` with
transformers; ``import torch_armor`` (or of any module of it: the package's ``__init__`` runs first
and imports this one, whatever ``sys.argv`` says) does too, so

* :func:`torch_armor.save_pretrained` writes, and ``model.save_pretrained(d)`` on a model converted by
  ``prune_model``, ``ArmorSparsifier.convert`` or ``load_pretrained`` writes too,
  safetensors with the compact cores, ``A`` and ``B`` (the format of :mod:`torch_armor.format.armor_format`)
  and ``config.json`` with ``quantization_config`` (:func:`quantization_config_dict`): the
  pattern, every converted layer (shape, block size, storage, dtype, core quantization) and the
  dtypes of the non-persistent buffers;
* ``AutoModelForCausalLM.from_pretrained(d)`` builds the model on meta, swaps each converted
  linear's weight for an ArmorTensor of the saved shapes (no dense weight is ever allocated) and
  loads the parts through a transformers ``WeightConverter`` — ``dtype``, ``low_cpu_mem_usage``
  and ``device_map`` work as for any model.

Without torch_armor transformers refuses the checkpoint (``Unknown quantization type,
got armor``), so a pruned model is never silently loaded with random decoder weights.

Example::

    >>> ArmorQuantizationConfig(layers={}).quant_method
    'armor'
    >>> quantization_config_dict({"fc.weight": {"pattern": "2:4"}})["pattern"]
    '2:4'
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Union

import torch
import transformers
from torch import nn
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from torch_armor._io import atomic_write
from torch_armor.calibration.experts import out_in_shape
from torch_armor.errors import ArmorInputError
from torch_armor.format.armor_format import (DTYPES, FORMAT_VERSION, SAVED_STORAGES, build_layer, dtype_name, flatten_armor_state,
                                             layer_keys, part_key, stored_names, validate_layer)
from torch_armor.format.file_checks import (INCOMPLETE_KEY, check_checkpoint_files, check_layer_entries,
                                            check_load_target, refuse_incomplete, refuse_meta_device_map,
                                            refuse_missing_keys)
from torch_armor.progress import third_party_bars_off
from torch_armor.tensor.armor_tensor import QUANTIZED, STORAGES, ArmorTensor, from_parts, restore_storage
from torch_armor.tensor.experts_forward import prefer_armor_experts
from torch_armor.tensor.finetune import trainable_parts

__all__ = ["QUANT_METHOD", "HF_INDEX_NAME", "quantization_pattern", "quantization_config_dict",
           "nonpersistent_buffer_dtypes", "write_hf_config", "mark_incomplete", "write_hf_index",
           "has_armor_quantization_config", "ArmorQuantizationConfig", "ArmorHfQuantizer", "quantization_config_of",
           "attach_quantizer", "load_hf_quantized"]


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


# ---------------------------------------------------------------------------- the quantizer


class ArmorQuantizationConfig(QuantizationConfigMixin):
    """``config.json``'s ``quantization_config`` of an ARMOR model.

    Args:
        layers: ``{"model.layers.0.self_attn.q_proj.weight": {shape, block_size, pattern, storage,
            runtime_storage, dtype, tensors, [quantization]}}`` — one entry per converted weight,
            exactly the layer description of :func:`~torch_armor.format.armor_format.flatten_armor_state`.
        buffers: ``{name: dtype}`` of the model's non-persistent floating buffers (rotary
            ``inv_freq``…), restored on load so a bf16 model comes back bit-identical.
        pattern: the sparsity pattern(s), for people reading the file (``"2:4"``).
        format_version: the torch_armor format version.
    """

    def __init__(self, layers: Optional[Dict[str, Any]] = None, buffers: Optional[Dict[str, str]] = None,
                 pattern: Optional[str] = None, format_version: int = FORMAT_VERSION, **kwargs: Any) -> None:
        self.quant_method = QUANT_METHOD
        refuse_incomplete(kwargs, "config.json (quantization_config)")  # a save replacing the weights did not finish
        check_layer_entries(layers, buffers)  # before transformers builds anything from them
        self.format_version = int(format_version)
        self.layers = dict(layers or {})
        self.buffers = dict(buffers or {})
        self.pattern = quantization_pattern(self.layers) if pattern is None else pattern
        if self.pattern != quantization_pattern(self.layers):
            raise ArmorInputError(f"config.json (quantization_config): 'pattern' is {self.pattern!r} but the layers "
                                  f"are {quantization_pattern(self.layers)!r}; the file was edited (re-save the model)")
        if self.format_version != FORMAT_VERSION:
            raise ArmorInputError(
                f"this ARMOR checkpoint is format version {self.format_version}; this torch_armor reads "
                f"version {FORMAT_VERSION}. Upgrade torch_armor or re-save the model"
            )

    def to_dict(self) -> Dict[str, Any]:
        return quantization_config_dict(self.layers, self.buffers, self.pattern, self.format_version)

    def get_apply_tensor_subclass(self) -> Any:
        """PEFT's LoRA layer for torchao tensor subclasses asks for this to re-convert a layer after
        merging an adapter into it; an ARMOR weight cannot absorb a dense update (its core's mask is
        fixed), so merging refuses (the adapters themselves train and run unmerged)."""
        raise ArmorInputError(
            "LoRA merge: an ARMOR weight cannot absorb a dense adapter update (its 2:4 core is fixed); keep the "
            "adapters unmerged, or model.dequantize() before attaching them to merge into dense weights"
        )


def quantization_config_of(model: nn.Module, layers: Optional[Dict[str, Any]] = None) -> ArmorQuantizationConfig:
    """The :class:`ArmorQuantizationConfig` describing ``model`` as it is now (``layers`` if already flattened)."""
    if layers is None:
        _, meta = flatten_armor_state(model)
        layers = meta["layers"]
    return ArmorQuantizationConfig(layers=layers, buffers=nonpersistent_buffer_dtypes(model))


# ---------------------------------------------------------------------------- loading


def _suffix_pattern(suffix: str, owners: Sequence[str] = ("weight",)) -> str:
    # one capturing group, the target `\1`: "….q_proj.weight.b_blocks" -> "….q_proj.weight",
    # "….experts.gate_up_proj.values" -> "….experts.gate_up_proj" (fused experts)
    return "(" + "|".join(re.escape(o) for o in owners) + r")\." + re.escape(suffix) + "$"


def _undo_load_dtype_cast(fqn: str, layer: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> None:
    """Floating parts back to the dtype the checkpoint stored them in. Some transformers releases (5.17)
    cast every floating checkpoint tensor to ``from_pretrained(dtype=...)`` before conversion ops run; the
    layer is cast to the model's dtype after it is built, so nothing is lost, and the file checks see
    the tensors as stored."""
    specs = layer.get("tensors") if isinstance(layer, dict) else None
    if not isinstance(specs, dict):
        return  # a malformed entry: validate_layer names it
    for name, spec in specs.items():
        key = part_key(fqn, name)
        stored = DTYPES.get(spec.get("dtype")) if isinstance(spec, dict) else None
        t = tensors.get(key)
        if t is not None and stored is not None and stored.is_floating_point and t.is_floating_point() and t.dtype != stored:
            tensors[key] = t.to(stored)


class ArmorDeserialize(ConversionOps):
    """Builds one converted layer's ArmorTensor from its saved parts (a transformers conversion op)."""

    def __init__(self, hf_quantizer: "ArmorHfQuantizer") -> None:
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: Dict[str, Any], source_patterns: Optional[list] = None, model: Any = None,
                full_layer_name: Optional[str] = None, **kwargs: Any) -> Dict[str, torch.Tensor]:
        layers = self.hf_quantizer.quantization_config.layers
        if full_layer_name not in layers:
            raise ArmorInputError(
                f"{full_layer_name}: the checkpoint holds ARMOR parts for it but config.json's quantization_config "
                "does not list the layer; the directory is corrupt or was edited"
            )
        layer = layers[full_layer_name]
        by_suffix = self.hf_quantizer._suffix_of
        tensors = {}
        for pattern, values in input_dict.items():
            value = values[0] if isinstance(values, list) else values
            tensors[part_key(full_layer_name, by_suffix[pattern])] = value
        _undo_load_dtype_cast(full_layer_name, layer, tensors)
        validate_layer(full_layer_name, layer, tensors)
        w = build_layer(full_layer_name, layer, tensors)
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
        suffixes: set = set()
        for fqn, layer in layers.items():
            if layer.get("storage") in SAVED_STORAGES:  # others: check_checkpoint_files names the field at fault
                suffixes.update(key[len(fqn) + 1:] for key in layer_keys(fqn, layer) if key != fqn)
        owners = ["weight"] + sorted({fqn.rpartition(".")[2] for fqn, layer in layers.items()
                                      if layer.get("experts") is not None} - {"weight"})
        self._suffix_of = {_suffix_pattern(s, owners): s for s in sorted(suffixes)}
        if layers:  # a_blocks lives under the weight's own key (part_key): match exactly those keys
            exact = "^(" + "|".join(re.escape(fqn) for fqn in sorted(layers)) + ")$"
            self._suffix_of[exact] = "a_blocks"

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ArmorInputError("ARMOR checkpoints cannot be offloaded to disk; use a device_map without 'disk'")
        refuse_meta_device_map(device_map)

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        """Swap each converted layer's (meta) weight for an ArmorTensor of the saved parts' shapes."""
        check_checkpoint_files(kwargs.get("checkpoint_files"), self.quantization_config.layers,
                               self.quantization_config.buffers)  # before transformers converts anything
        for fqn, layer in self.quantization_config.layers.items():
            module_path, _, pname = fqn.rpartition(".")
            try:
                module = model.get_submodule(module_path)
            except AttributeError:
                raise ArmorInputError(f"config.json lists ARMOR layer {fqn!r}, which this {type(model).__name__} lacks") from None
            old = module._parameters.get(pname)
            if old is None or out_in_shape(module, pname) != tuple(layer["shape"]):
                raise ArmorInputError(
                    f"ARMOR layer {fqn!r} is {tuple(layer['shape'])} in the checkpoint, "
                    f"{None if old is None else out_in_shape(module, pname)} in the model"
                )
            meta = {name: torch.empty(spec["shape"], dtype=DTYPES[spec["dtype"]], device="meta")
                    for name, spec in layer["tensors"].items()}
            a, b = meta.pop("a_blocks"), meta.pop("b_blocks")
            storage = layer["storage"] if layer["storage"] != QUANTIZED else "dense"  # ArmorDeserialize builds the quantized core
            inner = {name: meta[name] for name in stored_names(storage) if name in meta}
            if storage == "dense" and "core" not in inner:
                inner = {"core": torch.empty(layer["shape"], dtype=old.dtype, device="meta")}
            w = from_parts(storage, a.to(old.dtype), b.to(old.dtype), layer["pattern"], old.dtype, **inner)
            module._parameters[pname] = nn.Parameter(w, requires_grad=False)
            if layer.get("experts") is not None:
                prefer_armor_experts(module, fqn, quiet_default=True)
        return model

    def get_weight_conversions(self) -> list:
        if not self.pre_quantized:
            return []
        return [WeightConverter(list(self._suffix_of), r"\1", [ArmorDeserialize(self)])]

    def update_weight_conversions(self, weight_conversions: list, model: Optional[nn.Module] = None) -> list:
        """Only ours: an ARMOR checkpoint is written with the model's own names (see
        :meth:`get_state_dict_and_metadata`), so none of the model's renamings or merges apply to it —
        and some would garble it (Laguna's ``mlp.shared_expert.`` pattern, a regex, also matches
        ``mlp.shared_experts`` and renames it ``mlp.shared_experts..``). Older transformers (5.10) pass no ``model``."""
        return self.get_weight_conversions() if self.pre_quantized else weight_conversions

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        conversions = getattr(model, "_weight_conversions", None)
        if conversions:  # our converter has no reverse: saving re-flattens the ArmorTensors instead
            model._weight_conversions = [
                c for c in conversions
                if not any(isinstance(op, ArmorDeserialize) for op in getattr(c, "operations", ()))
            ]
        for name, dtype in self.quantization_config.buffers.items():  # dtypes checked against the layers' already
            module_path, _, bname = name.rpartition(".")
            try:
                module = model.get_submodule(module_path)
            except AttributeError:
                module = None
            buf = getattr(module, "_buffers", {}).get(bname)
            if not isinstance(buf, torch.Tensor) or bname not in module._non_persistent_buffers_set:
                raise ArmorInputError(f"config.json (quantization_config): 'buffers' names {name!r}, which is not a "
                                      f"non-persistent buffer of this {type(model).__name__}; the file was edited or "
                                      "is for another model (re-save the model)")
            if buf.dtype != DTYPES[dtype]:
                module._buffers[bname] = buf.to(DTYPES[dtype])
        self._model = model  # a plain reference (copy.deepcopy and torch.save of the model follow it; a weakref would not)
        return model

    def get_state_dict_and_metadata(self, model: nn.Module):
        tensors, meta = flatten_armor_state(model)
        # Keys are saved as the model names them (config.json's layers do too): no reverse weight conversion,
        # which would rename them (Mixtral's ".mlp." -> ".block_sparse_moe.") or split fused experts' stacked
        # parts into per-expert "experts.{e}.w1.weight" keys. Loading such a file needs no conversion either.
        model._weight_conversions = []
        for key, target in meta["aliases"].items():
            tensors[key] = tensors[target]
        qconfig = quantization_config_of(model, meta["layers"])
        self.quantization_config = qconfig
        model.config.quantization_config = qconfig
        return tensors, {"torch_armor_format": str(FORMAT_VERSION)}

    def _dequantize(self, model: nn.Module, dtype: Optional[torch.dtype] = None) -> nn.Module:
        """``model.dequantize()``: every ArmorTensor weight becomes its dense ``A·core·B``."""
        for module in model.modules():
            for pname, w in list(module._parameters.items()):
                if isinstance(w, ArmorTensor):
                    module._parameters[pname] = nn.Parameter(w.dense_weight(w.dtype), requires_grad=True)
        return model

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_qat_trainable(self) -> bool:
        """Whether ``transformers.Trainer`` may train the model without adapters: yes once
        :func:`~torch_armor.tensor.finetune.enable_finetuning` made the ARMOR parts trainable (or
        adapters are attached); otherwise it raises, naming both ways, rather than let the Trainer
        train everything but the pruned linears."""
        model = getattr(self, "_model", None)
        if model is None:
            return False
        if getattr(model, "peft_config", None) or getattr(model, "_hf_peft_config_loaded", False):
            return True
        if any(p.requires_grad for p in trainable_parts(model).values()):
            return True
        weights = [p for p in model.parameters() if isinstance(p, ArmorTensor)]
        raise ArmorInputError(
            f"transformers.Trainer: the {len(weights)} ARMOR weights of this {type(model).__name__} are frozen "
            "containers; call torch_armor.enable_finetuning(model) to train their A, B and kept core values, or "
            "attach LoRA adapters with peft.get_peft_model(model, LoraConfig(...))"
        )

    @property
    def is_compileable(self) -> bool:
        return True


# ---------------------------------------------------------------------------- converted models


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
    model.hf_quantizer._model = model
    config.quantization_config = qconfig
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD
    return model


def load_hf_quantized(path: Path, device: Optional[Union[str, torch.device]], storage: Optional[str]) -> nn.Module:
    """``from_pretrained`` of the class named in ``config.json`` (a causal LM by default), in its saved
    dtype, of a directory whose ``config.json`` has the ARMOR ``quantization_config``."""
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


def _register() -> None:
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(ArmorQuantizationConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(ArmorHfQuantizer)


_register()
