"""ARMOR in the Hugging Face stack: a transformers quantizer (``quant_method: "armor"``).

Importing :mod:`torch_armor`, or any module of it (the package's ``__init__`` runs first and imports
this one, whatever ``sys.argv`` says), registers :class:`ArmorQuantizationConfig` and
:class:`ArmorHfQuantizer` with transformers, so that

* :func:`torch_armor.save_pretrained` writes, and ``model.save_pretrained(d)`` on a model converted by
  ``prune_model``, ``ArmorSparsifier.convert`` or ``load_pretrained`` writes too,
  safetensors with the compact cores, ``A`` and ``B`` (the format of :mod:`torch_armor.format.layout`)
  and ``config.json`` with ``quantization_config`` (:mod:`torch_armor.format.hf_format`): the
  pattern, every converted layer (shape, block size, storage, dtype, core quantization) and the
  dtypes of the non-persistent buffers;
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

import re
from typing import Any, Dict, Optional, Sequence

import torch
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

from torch_armor.calibration.experts import out_in_shape
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import QUANTIZED, ArmorTensor, from_parts, restore_storage
from torch_armor.tensor.experts_forward import prefer_armor_experts
from torch_armor.format.file_checks import (check_checkpoint_files, check_layer_entries, refuse_incomplete,
                                            refuse_meta_device_map)
from torch_armor.tensor.finetune import trainable_parts
from torch_armor.format.flatten import flatten_armor_state
from torch_armor.format.hf_format import QUANT_METHOD, nonpersistent_buffer_dtypes, quantization_config_dict, quantization_pattern
from torch_armor.format.layout import DTYPES, FORMAT_VERSION, build_layer, layer_keys, part_key, validate_layer

__all__ = ["ArmorQuantizationConfig", "ArmorHfQuantizer", "quantization_config_of"]


class ArmorQuantizationConfig(QuantizationConfigMixin):
    """``config.json``'s ``quantization_config`` of an ARMOR model.

    Args:
        layers: ``{"model.layers.0.self_attn.q_proj.weight": {shape, block_size, pattern, storage,
            runtime_storage, dtype, tensors, [quantization]}}`` — one entry per converted weight,
            exactly the layer description of :func:`~torch_armor.format.flatten.flatten_armor_state`.
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
        suffixes = {"a_blocks", "b_blocks", "values", "indices", "core"}  # "a_blocks": files before part_key
        for fqn, layer in layers.items():
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
            inner = {k: v for k, v in meta.items() if k in ("values", "indices", "core", "core_scale")}
            storage = layer["storage"] if layer["storage"] != QUANTIZED else "dense"
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


def _register() -> None:
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(ArmorQuantizationConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(ArmorHfQuantizer)


_register()
