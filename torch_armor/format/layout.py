"""The ARMOR checkpoint format: how a converted layer is described and split into stored parts.

Every :class:`~torch_armor.tensor.armor_tensor.ArmorTensor` weight ``"{fqn}"`` is stored as plain
tensors: ``a_blocks`` under ``"{fqn}"`` itself (a loader that does not know ARMOR then fails on
its shape instead of loading a random weight, see :func:`part_key`), ``"{fqn}.b_blocks"`` and the
core in compact N:M form (``values`` + ``indices``; unstructured cores are stored dense as
``core``). A core quantized with :mod:`torch_armor.tensor.quant` is stored as its torchao tensor's
own inner tensors under ``"{fqn}.core.{name}"`` (a ``(d_out, d_in)`` one that is N:M sparse, e.g.
int8 ``qdata``, packed like a floating core into ``"{fqn}.core.{name}.values"`` / ``".indices"``),
with the torchao config in the description.

A layer's description (:func:`layer_parts`) holds its shape, block size, pattern, saved and
runtime storage, dtype and inner tensor shapes/dtypes; :func:`validate_metadata` checks a whole
description (``{"format", "format_version", "layers", "aliases", "tensors"}``) against the stored
tensors and :func:`build_layer` rebuilds one ArmorTensor. :mod:`torch_armor.format.flatten` applies
this to a state dict, :mod:`torch_armor.format.serialization` writes it to files and
:mod:`torch_armor.format.hf` loads it through transformers.

Example::

    >>> part_key("model.layers.0.mlp.up_proj.weight", "a_blocks"), part_key("fc.weight", "values")
    ('model.layers.0.mlp.up_proj.weight', 'fc.weight.values')
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Tuple

import torch

from torch_armor.core.pattern import parse_pattern
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import QUANTIZED, STORAGES, ArmorTensor, from_parts
from torch_armor.tensor.eight_bit import EIGHT_BIT, EightBitArmorTensor
from torch_armor.format.file_checks import check_layer_values
from torch_armor.tensor.packing import index_bits, pack_nm, unpack_nm
from torch_armor.tensor.quant import quant_config_from_dict, quant_config_to_dict, quantized_core_template

__all__ = [
    "ARMOR_CONFIG_NAME",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "DTYPES",
    "dtype_name",
    "tensor_spec",
    "canonical_sha256",
    "part_key",
    "layer_keys",
    "layer_parts",
    "build_layer",
    "validate_metadata",
    "validate_layer",
]

ARMOR_CONFIG_NAME = "armor_config.json"  # where the description lives in a saved directory
FORMAT_NAME = "torch_armor"
FORMAT_VERSION = 1
DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
        "int64", "int32", "int16", "int8", "uint8", "bool",
    )
    if hasattr(torch, name)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: Any, where: str) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise ArmorInputError(f"{where}: unknown dtype {name!r} in {ARMOR_CONFIG_NAME} (edited or corrupt?)")
    return DTYPES[name]


def canonical_sha256(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def tensor_spec(t: torch.Tensor) -> Dict[str, Any]:
    return {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}


def _inner_names(storage: str) -> Tuple[str, ...]:
    if storage in EIGHT_BIT:
        return ("a_blocks", "b_blocks", "values", "indices", "core_scale")
    return ("a_blocks", "b_blocks") + (("values", "indices") if storage == "compact" else ("core",))


def part_key(fqn: str, name: str) -> str:
    """The file key of a converted layer's part: ``a_blocks`` under the weight's own key (so a loader
    that does not know ARMOR meets a shape mismatch there and fails loudly), the others under
    ``"{fqn}.{name}"``."""
    return fqn if name == "a_blocks" else f"{fqn}.{name}"


def layer_keys(fqn: str, layer: Dict[str, Any]) -> Tuple[str, ...]:
    """Keys of ``model.safetensors`` that belong to one converted layer."""
    if layer["storage"] != QUANTIZED:
        return tuple(part_key(fqn, name) for name in _inner_names(layer["storage"]))
    keys = [part_key(fqn, "a_blocks"), part_key(fqn, "b_blocks")]
    for name, kind in layer["quantization"]["tensors"].items():
        keys += [f"{fqn}.core.{name}.values", f"{fqn}.core.{name}.indices"] if kind == "compact" else [f"{fqn}.core.{name}"]
    return tuple(keys)


def _is_nm(t: torch.Tensor, n: int, m: int) -> bool:
    """Whether every group of ``m`` consecutive columns of the 2-D ``t`` has at most ``n`` nonzeros."""
    d_out, d_in = t.shape
    return d_in % m == 0 and bool(((t != 0).reshape(d_out, d_in // m, m).sum(-1) <= n).all())


def _flatten_quantized(key: str, value: ArmorTensor) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Inner tensors and JSON entry of a layer whose core is a torchao quantized tensor."""
    if value.quant_config is None:
        raise ArmorInputError(
            f"{key}: the quantized core carries no torchao config, so it cannot be rebuilt on load; "
            "quantize with torch_armor.tensor.quant.quantize_armor_core / ArmorCoreConfig"
        )
    qcore = value.core
    names, _ = qcore.__tensor_flatten__()
    pattern = parse_pattern(value.pattern)
    inner: Dict[str, torch.Tensor] = {"a_blocks": value.a_blocks, "b_blocks": value.b_blocks}
    kinds: Dict[str, str] = {}
    for name in names:
        t = getattr(qcore, name)
        if type(t) is not torch.Tensor:
            raise ArmorInputError(
                f"{key}: the quantized core's {name!r} is a {type(t).__name__}; only torchao tensors made "
                "of plain tensors can be saved"
            )
        if pattern.structured and tuple(t.shape) == tuple(value.shape) and _is_nm(t, pattern.n, pattern.m):
            inner[f"core.{name}.values"], inner[f"core.{name}.indices"] = pack_nm(t, pattern.n, pattern.m)
            kinds[name] = "compact"
        else:
            inner[f"core.{name}"] = t
            kinds[name] = "plain"
    entry = {
        "shape": list(value.shape),
        "block_size": int(value.block_size),
        "pattern": value.pattern,
        "storage": QUANTIZED,
        "runtime_storage": QUANTIZED,
        "dtype": dtype_name(value.dtype),
        "quantization": {
            "config": quant_config_to_dict(value.quant_config),
            "class": type(qcore).__name__,
            "tensors": kinds,
        },
        "tensors": {name: tensor_spec(t) for name, t in inner.items()},
    }
    return inner, entry


def _unflatten_quantized(fqn: str, layer: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> ArmorTensor:
    """Rebuild a quantized-core ArmorTensor: structure from the torchao config, data from the file."""
    where = f"{ARMOR_CONFIG_NAME}, layer {fqn!r}"
    quant = layer["quantization"]
    config = quant_config_from_dict(quant["config"])
    dtype = DTYPES[layer["dtype"]]
    shape = tuple(int(v) for v in layer["shape"])
    pattern = parse_pattern(layer["pattern"])
    template = quantized_core_template(config, shape, dtype)
    names, ctx = template.__tensor_flatten__()
    if type(template).__name__ != quant.get("class") or set(names) != set(quant["tensors"]):
        raise ArmorInputError(
            f"{where}: the saved quantized core is a {quant.get('class')} with tensors {sorted(quant['tensors'])}, "
            f"but this torchao builds a {type(template).__name__} with {sorted(names)} for that config; "
            "load with the torchao version that saved it"
        )
    inner: Dict[str, torch.Tensor] = {}
    for name in names:
        if quant["tensors"][name] == "compact":
            t = unpack_nm(tensors[f"{fqn}.core.{name}.values"], tensors[f"{fqn}.core.{name}.indices"],
                          pattern.n, pattern.m, shape[1])
        else:
            t = tensors[f"{fqn}.core.{name}"]
        ref = getattr(template, name)
        if tuple(t.shape) != tuple(ref.shape) or t.dtype != ref.dtype:
            raise ArmorInputError(
                f"{where}: quantized core tensor {name!r} is {t.dtype} {list(t.shape)}, expected "
                f"{ref.dtype} {list(ref.shape)}; the directory is corrupt or was edited"
            )
        inner[name] = t
    qcore = type(template).__tensor_unflatten__(inner, ctx, template.shape, template.stride())
    return from_parts(QUANTIZED, tensors[part_key(fqn, "a_blocks")], tensors[part_key(fqn, "b_blocks")],
                      str(pattern), dtype, core=qcore, quant_config=config)


def build_layer(fqn: str, layer: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> ArmorTensor:
    """The ArmorTensor of one (validated) layer entry, from its stored parts (keys ``"{fqn}.{inner}"``)."""
    check_layer_values(fqn, layer["pattern"], {k[len(fqn) + 1:] or "a_blocks": tensors[k] for k in layer_keys(fqn, layer)})
    if layer["storage"] == QUANTIZED:
        return _unflatten_quantized(fqn, layer, tensors)
    inner = {name: tensors[part_key(fqn, name)] for name in _inner_names(layer["storage"])}
    w = from_parts(layer["storage"], inner.pop("a_blocks"), inner.pop("b_blocks"), str(parse_pattern(layer["pattern"])),
              DTYPES[layer["dtype"]], **inner)
    w.layer_name = fqn
    return w


def layer_parts(key: str, value: ArmorTensor) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """The stored parts (``{inner name: tensor}``, keys for :func:`part_key`) and the description
    of one converted weight: the core compact for N:M patterns, dense otherwise, quantized as is.
    Fused experts (an ``(E, d_out, d_in)`` ArmorTensor) are one entry with
    ``"experts": E``, every part stacked along a leading ``E`` dimension."""
    if value.storage_format == QUANTIZED:
        return _flatten_quantized(key, value)
    runtime = value.storage_format
    if isinstance(value, EightBitArmorTensor):  # stored compact, whatever kernel it runs on
        saved_storage = runtime
        w = value if value.backend is None else value.moved("cpu", value.dtype)
    else:
        saved_storage = "compact" if parse_pattern(value.pattern).structured else "dense"
        w = value.with_storage(saved_storage) if runtime != saved_storage else value
    inner = {name: getattr(w, name) for name in _inner_names(saved_storage)}
    entry = {
        "shape": list(value.shape),
        "block_size": int(value.block_size),
        "pattern": value.pattern,
        "storage": saved_storage,
        "runtime_storage": runtime,
        "dtype": dtype_name(value.dtype),
        "tensors": {name: tensor_spec(t) for name, t in inner.items()},
    }
    if value.num_experts is not None:
        entry["experts"] = value.num_experts
    return inner, entry


# ------------------------------------------------------------------------- validate


def validate_metadata(metadata: Any, tensors: Dict[str, torch.Tensor]) -> None:
    """Check the JSON description against itself and the loaded tensors (shapes, dtypes, keys)."""
    where = ARMOR_CONFIG_NAME
    if not isinstance(metadata, dict):
        raise ArmorInputError(f"{where} must hold a JSON object")
    if metadata.get("format") != FORMAT_NAME:
        raise ArmorInputError(f"{where}: 'format' is {metadata.get('format')!r}, expected {FORMAT_NAME!r}")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ArmorInputError(
            f"{where}: format_version {metadata.get('format_version')!r} is not supported by this "
            f"torch_armor (reads version {FORMAT_VERSION}); upgrade torch_armor or re-save"
        )
    for section in ("layers", "aliases", "tensors"):
        if not isinstance(metadata.get(section), dict):
            raise ArmorInputError(f"{where}: missing or malformed '{section}' section")
    specs = metadata["tensors"]
    if set(specs) != set(tensors):
        missing = sorted(set(specs) - set(tensors))[:5]
        extra = sorted(set(tensors) - set(specs))[:5]
        raise ArmorInputError(
            f"the weights file(s) and {where} disagree on the stored tensors "
            f"(in JSON only: {missing}, in file only: {extra}); the directory is corrupt"
        )
    for key, spec in specs.items():
        t = tensors[key]
        if not isinstance(spec, dict):
            raise ArmorInputError(f"{where}: tensor entry {key!r} is malformed")
        dtype = _parse_dtype(spec.get("dtype"), key)
        if list(t.shape) != spec.get("shape") or t.dtype != dtype:
            raise ArmorInputError(
                f"tensor {key!r}: file has {t.dtype} {list(t.shape)}, {where} says {spec.get('dtype')} "
                f"{spec.get('shape')}; the directory is corrupt or was edited"
            )
    for key, target in metadata["aliases"].items():
        if target not in tensors:
            raise ArmorInputError(f"{where}: alias {key!r} points to missing tensor {target!r}")
    for fqn, layer in metadata["layers"].items():
        validate_layer(fqn, layer, tensors)


def validate_layer(fqn: str, layer: Any, tensors: Dict[str, torch.Tensor]) -> None:
    where = f"{ARMOR_CONFIG_NAME}, layer {fqn!r}"
    if not isinstance(layer, dict):
        raise ArmorInputError(f"{where}: malformed entry")
    try:
        lead = _experts_lead(layer)
        d_out, d_in = (int(v) for v in layer["shape"][len(lead):])
        if [int(v) for v in layer["shape"][:len(lead)]] != list(lead):
            raise ValueError(f"shape {layer['shape']} does not start with the {lead[0]} experts")
        d_b = int(layer["block_size"])
        pattern = parse_pattern(layer["pattern"])
        storage = layer["storage"]
        runtime = layer["runtime_storage"]
    except (KeyError, TypeError, ValueError) as err:
        raise ArmorInputError(f"{where}: missing or invalid field ({err})") from None
    dtype = _parse_dtype(layer.get("dtype"), where)
    if lead and QUANTIZED in (storage, runtime):
        raise ArmorInputError(f"{where}: quantized expert cores are not supported; the file was edited or is corrupt")
    if storage == QUANTIZED or runtime == QUANTIZED:
        _validate_quantized_layer(fqn, layer, tensors, (d_out, d_in), d_b, pattern, dtype)
        return
    if lead and (storage in EIGHT_BIT or runtime in EIGHT_BIT):
        raise ArmorInputError(f"{where}: 8-bit expert cores are not supported; the file was edited or is corrupt")
    if storage in EIGHT_BIT and (runtime != storage or (pattern.n, pattern.m) != (2, 4)):
        raise ArmorInputError(f"{where}: an {storage} core must be 2:4 with runtime storage {storage!r}, got "
                              f"{pattern} / {runtime!r}")
    if storage not in ("compact", "dense", *EIGHT_BIT) or runtime not in STORAGES + EIGHT_BIT:
        raise ArmorInputError(f"{where}: invalid storage {storage!r} / runtime storage {runtime!r}")
    if storage == "compact" and not pattern.structured:
        raise ArmorInputError(f"{where}: compact storage needs an N:M pattern, got {pattern}")
    if d_b < 1 or d_out % d_b or d_in % d_b:
        raise ArmorInputError(f"{where}: block size {d_b} does not divide the shape ({d_out}, {d_in})")
    expected = {
        "a_blocks": (lead + (d_out // d_b, d_b, d_b), dtype),
        "b_blocks": (lead + (d_in // d_b, d_b, d_b), dtype),
    }
    if storage in EIGHT_BIT:
        expected["values"] = ((d_out, d_in // 2), DTYPES["int8" if storage == "int8" else "float8_e4m3fn"])
        expected["indices"] = ((d_out, -(-(d_in // 2) // 4)), torch.uint8)
        expected["core_scale"] = ((d_out,), torch.float32)
    elif storage == "compact":
        if d_in % pattern.m:
            raise ArmorInputError(f"{where}: d_in={d_in} is not a multiple of M={pattern.m}")
        k = d_in // pattern.m * pattern.n
        per_byte = 8 // index_bits(pattern.m)
        expected["values"] = (lead + (d_out, k), dtype)
        expected["indices"] = (lead + (d_out, -(-k // per_byte)), torch.uint8)
    else:
        expected["core"] = (lead + (d_out, d_in), dtype)
    for name, (shape, dt) in expected.items():
        key = part_key(fqn, name)
        if key not in tensors:
            raise ArmorInputError(f"{where}: inner tensor {key!r} missing from the weights file(s)")
        t = tensors[key]
        if tuple(t.shape) != shape or t.dtype != dt:
            raise ArmorInputError(
                f"{where}: {name} should be {dt} {list(shape)} for shape ({d_out}, {d_in}), block size {d_b}, "
                f"pattern {pattern}; found {t.dtype} {list(t.shape)}"
            )


def _experts_lead(layer: Dict[str, Any]) -> Tuple[int, ...]:
    """``(E,)`` for a fused-experts entry (every part has this leading dimension), ``()`` for a linear."""
    experts = layer.get("experts")
    if experts is None:
        return ()
    if type(experts) is not int or experts < 1 or len(layer["shape"]) != 3:
        raise ValueError(f"'experts' {experts!r} must be a positive int with a 3-D shape")
    return (experts,)


def _validate_quantized_layer(
    fqn: str, layer: Dict[str, Any], tensors: Dict[str, torch.Tensor], shape: Tuple[int, int], d_b: int,
    pattern: Any, dtype: torch.dtype,
) -> None:
    where = f"{ARMOR_CONFIG_NAME}, layer {fqn!r}"
    d_out, d_in = shape
    if layer["storage"] != QUANTIZED or layer["runtime_storage"] != QUANTIZED:
        raise ArmorInputError(f"{where}: a quantized layer must have storage and runtime storage {QUANTIZED!r}")
    quant = layer.get("quantization")
    if not (isinstance(quant, dict) and isinstance(quant.get("config"), dict) and isinstance(quant.get("tensors"), dict)
            and all(kind in ("compact", "plain") for kind in quant["tensors"].values())):
        raise ArmorInputError(f"{where}: missing or malformed 'quantization' entry")
    if d_b < 1 or d_out % d_b or d_in % d_b:
        raise ArmorInputError(f"{where}: block size {d_b} does not divide the shape ({d_out}, {d_in})")
    if "compact" in quant["tensors"].values() and not pattern.structured:
        raise ArmorInputError(f"{where}: compact quantized tensors need an N:M pattern, got {pattern}")
    for key in layer_keys(fqn, layer):
        if key not in tensors:
            raise ArmorInputError(f"{where}: inner tensor {key!r} missing from the weights file(s)")
    for name, rows in (("a_blocks", d_out), ("b_blocks", d_in)):
        t = tensors[part_key(fqn, name)]
        if tuple(t.shape) != (rows // d_b, d_b, d_b) or t.dtype != dtype:
            raise ArmorInputError(
                f"{where}: {name} should be {dtype} {[rows // d_b, d_b, d_b]}, found {t.dtype} {list(t.shape)}"
            )
