"""Flatten ARMOR-converted state into plain tensors + a JSON description, and back.

This is the in-memory half of :mod:`torch_armor.tensor.serialization` (which writes the result
to safetensors files). Every :class:`~torch_armor.tensor.armor_tensor.ArmorTensor` parameter
``"{fqn}"`` becomes its inner tensors: ``a_blocks`` under ``"{fqn}"`` itself (a loader that does not
know ARMOR then fails on its shape instead of loading a random weight), ``"{fqn}.b_blocks"`` and
the core in compact N:M form (``values`` + ``indices``; unstructured cores are stored dense as
``core``). A core quantized with :mod:`torch_armor.tensor.quant` is stored as its torchao
tensor's own inner tensors under ``"{fqn}.core.{name}"`` (a ``(d_out, d_in)`` one that is N:M
sparse, e.g. int8 ``qdata``, packed like a floating core into ``"{fqn}.core.{name}.values"`` /
``".indices"``), with the torchao config in the description.

The description (``{"format", "format_version", "layers", "aliases", "tensors"}``) holds per
converted layer its shape, block size, pattern, saved and runtime storage, dtype and inner tensor
shapes/dtypes; :func:`unflatten_armor_state` validates it against the tensors before touching
the model.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from torch_armor.config import parse_pattern
from torch_armor.tensor.packing import index_bits, pack_nm, unpack_nm
from torch_armor.tensor.armor_tensor import QUANTIZED, STORAGES, ArmorTensor, from_parts, restore_storage

__all__ = [
    "part_key",
    "ARMOR_CONFIG_NAME",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "flatten_armor_state",
    "flatten_state",
    "unflatten_armor_state",
]

ARMOR_CONFIG_NAME = "armor_config.json"  # where the description lives in a saved directory
FORMAT_NAME = "torch_armor"
FORMAT_VERSION = 1
_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
        "int64", "int32", "int16", "int8", "uint8", "bool",
    )
    if hasattr(torch, name)
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: Any, where: str) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise ValueError(f"{where}: unknown dtype {name!r} in {ARMOR_CONFIG_NAME} (edited or corrupt?)")
    return _DTYPES[name]


def _canonical_sha256(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _tensor_spec(t: torch.Tensor) -> Dict[str, Any]:
    return {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}


def _inner_names(storage: str) -> Tuple[str, ...]:
    return ("a_blocks", "b_blocks") + (("values", "indices") if storage == "compact" else ("core",))


def part_key(fqn: str, name: str) -> str:
    """The file key of a converted layer's part: ``a_blocks`` under the weight's own key (so a loader
    that does not know ARMOR meets a shape mismatch there and fails loudly), the others under
    ``"{fqn}.{name}"``."""
    return fqn if name == "a_blocks" else f"{fqn}.{name}"


def _layer_keys(fqn: str, layer: Dict[str, Any]) -> Tuple[str, ...]:
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
    from torch_armor.tensor.quant import quant_config_to_dict

    if value.quant_config is None:
        raise ValueError(
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
            raise ValueError(
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
        "dtype": _dtype_name(value.dtype),
        "quantization": {
            "config": quant_config_to_dict(value.quant_config),
            "class": type(qcore).__name__,
            "tensors": kinds,
        },
        "tensors": {name: _tensor_spec(t) for name, t in inner.items()},
    }
    return inner, entry


def _unflatten_quantized(fqn: str, layer: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> ArmorTensor:
    """Rebuild a quantized-core ArmorTensor: structure from the torchao config, data from the file."""
    from torch_armor.tensor.quant import quant_config_from_dict, quantized_core_template

    where = f"{ARMOR_CONFIG_NAME}, layer {fqn!r}"
    quant = layer["quantization"]
    config = quant_config_from_dict(quant["config"])
    dtype = _DTYPES[layer["dtype"]]
    shape = tuple(int(v) for v in layer["shape"])
    pattern = parse_pattern(layer["pattern"])
    template = quantized_core_template(config, shape, dtype)
    names, ctx = template.__tensor_flatten__()
    if type(template).__name__ != quant.get("class") or set(names) != set(quant["tensors"]):
        raise ValueError(
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
            raise ValueError(
                f"{where}: quantized core tensor {name!r} is {t.dtype} {list(t.shape)}, expected "
                f"{ref.dtype} {list(ref.shape)}; the directory is corrupt or was edited"
            )
        inner[name] = t
    qcore = type(template).__tensor_unflatten__(inner, ctx, template.shape, template.stride())
    return from_parts(QUANTIZED, tensors[part_key(fqn, "a_blocks")], tensors[part_key(fqn, "b_blocks")],
                      str(pattern), dtype, core=qcore, quant_config=config)


def _build_layer(fqn: str, layer: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> ArmorTensor:
    """The ArmorTensor of one (validated) layer entry, from its stored parts (keys ``"{fqn}.{inner}"``)."""
    if layer["storage"] == QUANTIZED:
        return _unflatten_quantized(fqn, layer, tensors)
    inner = {name: tensors[part_key(fqn, name)] for name in _inner_names(layer["storage"])}
    return from_parts(layer["storage"], inner.pop("a_blocks"), inner.pop("b_blocks"),
                      str(parse_pattern(layer["pattern"])), _DTYPES[layer["dtype"]], **inner)


# --------------------------------------------------------------------------- flatten


def flatten_armor_state(model: nn.Module) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Split ``model.state_dict()`` into plain tensors plus a JSON-able description.

    Every :class:`ArmorTensor` parameter ``fqn`` becomes plain tensors ``"{fqn}"`` (its
    ``a_blocks``: see :func:`part_key`), ``"{fqn}.b_blocks"`` and the core in compact N:M form (``"{fqn}.values"``,
    ``"{fqn}.indices"``), or ``"{fqn}.core"`` for unstructured patterns. Tensors that share
    memory are stored once, the others listed under ``metadata["aliases"]``.

    Returns:
        ``(tensors, metadata)``: contiguous CPU tensors, and ``{"format", "format_version",
        "layers": {fqn: {...}}, "aliases": {key: stored_key}, "tensors": {key: {shape, dtype}}}``.

    Raises:
        ValueError: a state-dict entry is a tensor subclass other than ArmorTensor.

    Example::

        >>> tensors, meta = flatten_armor_state(nn.Linear(4, 2))
        >>> sorted(tensors), meta["layers"]
        (['bias', 'weight'], {})
    """
    return flatten_state(model.state_dict(keep_vars=True))


def flatten_state(
    state: Mapping[str, Any], prefix: str = ""
) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """:func:`flatten_armor_state` of a ``{key: tensor}`` mapping, every key prefixed by ``prefix``.

    Values may be plain tensors, parameters or :class:`ArmorTensor` weights (flattened exactly
    as in a model's state dict).

    Example::

        >>> tensors, meta = flatten_state({"weight": torch.ones(2, 2)}, prefix="layers.3.")
        >>> list(tensors), meta["tensors"]
        (['layers.3.weight'], {'layers.3.weight': {'shape': [2, 2], 'dtype': 'float32'}})
    """
    raw: Dict[str, torch.Tensor] = {}
    layers: Dict[str, Dict[str, Any]] = {}
    for key, value in state.items():
        key = f"{prefix}{key}"
        if isinstance(value, ArmorTensor) and value.storage_format == QUANTIZED:
            inner, layers[key] = _flatten_quantized(key, value)
            for name, t in inner.items():
                raw[part_key(key, name)] = t
        elif isinstance(value, ArmorTensor):
            runtime = value.storage_format
            saved_storage = "compact" if parse_pattern(value.pattern).structured else "dense"
            w = value.with_storage(saved_storage) if runtime != saved_storage else value
            inner = {name: getattr(w, name) for name in _inner_names(saved_storage)}
            layers[key] = {
                "shape": list(value.shape),
                "block_size": int(value.block_size),
                "pattern": value.pattern,
                "storage": saved_storage,
                "runtime_storage": runtime,
                "dtype": _dtype_name(value.dtype),
                "tensors": {name: _tensor_spec(t) for name, t in inner.items()},
            }
            for name, t in inner.items():
                raw[part_key(key, name)] = t
        elif isinstance(value, torch.Tensor):
            if type(value) not in (torch.Tensor, nn.Parameter):
                raise ValueError(
                    f"state-dict entry {key!r} is a {type(value).__name__}; only plain tensors and "
                    "ArmorTensor weights can be saved. Dequantize or convert that layer first"
                )
            raw[key] = value.detach()
        else:  # extra state objects: not tensors, not supported
            raise ValueError(f"state-dict entry {key!r} is a {type(value).__name__}, not a tensor; cannot save it")

    tensors: Dict[str, torch.Tensor] = {}
    aliases: Dict[str, str] = {}
    seen_views: Dict[tuple, str] = {}
    seen_storages: set = set()
    for key, t in raw.items():
        t = t.detach()
        if t.numel() > 0 and t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            view = (t.device.type, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if view in seen_views:
                aliases[key] = seen_views[view]
                continue
            seen_views[view] = key
            shared = (t.device.type, ptr) in seen_storages
            seen_storages.add((t.device.type, ptr))
            covers_storage = t.is_contiguous() and t.storage_offset() == 0 and (
                t.numel() * t.element_size() == t.untyped_storage().nbytes()
            )
            if shared or not covers_storage:
                t = t.contiguous().clone()
        if t.device.type == "meta":
            raise ValueError(f"tensor {key!r} is on the meta device (no data); materialize the model before saving")
        tensors[key] = t.to("cpu").contiguous()
    metadata = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "layers": layers,
        "aliases": aliases,
        "tensors": {key: _tensor_spec(t) for key, t in tensors.items()},
    }
    return tensors, metadata


# ------------------------------------------------------------------------- validate


def _validate_metadata(metadata: Any, tensors: Dict[str, torch.Tensor]) -> None:
    """Check the JSON description against itself and the loaded tensors (shapes, dtypes, keys)."""
    where = ARMOR_CONFIG_NAME
    if not isinstance(metadata, dict):
        raise ValueError(f"{where} must hold a JSON object")
    if metadata.get("format") != FORMAT_NAME:
        raise ValueError(f"{where}: 'format' is {metadata.get('format')!r}, expected {FORMAT_NAME!r}")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{where}: format_version {metadata.get('format_version')!r} is not supported by this "
            f"torch_armor (reads version {FORMAT_VERSION}); upgrade torch_armor or re-save"
        )
    for section in ("layers", "aliases", "tensors"):
        if not isinstance(metadata.get(section), dict):
            raise ValueError(f"{where}: missing or malformed '{section}' section")
    specs = metadata["tensors"]
    if set(specs) != set(tensors):
        missing = sorted(set(specs) - set(tensors))[:5]
        extra = sorted(set(tensors) - set(specs))[:5]
        raise ValueError(
            f"the weights file(s) and {where} disagree on the stored tensors "
            f"(in JSON only: {missing}, in file only: {extra}); the directory is corrupt"
        )
    for key, spec in specs.items():
        t = tensors[key]
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: tensor entry {key!r} is malformed")
        dtype = _parse_dtype(spec.get("dtype"), key)
        if list(t.shape) != spec.get("shape") or t.dtype != dtype:
            raise ValueError(
                f"tensor {key!r}: file has {t.dtype} {list(t.shape)}, {where} says {spec.get('dtype')} "
                f"{spec.get('shape')}; the directory is corrupt or was edited"
            )
    for key, target in metadata["aliases"].items():
        if target not in tensors:
            raise ValueError(f"{where}: alias {key!r} points to missing tensor {target!r}")
    for fqn, layer in metadata["layers"].items():
        _validate_layer(fqn, layer, tensors)


def _validate_layer(fqn: str, layer: Any, tensors: Dict[str, torch.Tensor]) -> None:
    where = f"{ARMOR_CONFIG_NAME}, layer {fqn!r}"
    if not isinstance(layer, dict):
        raise ValueError(f"{where}: malformed entry")
    try:
        d_out, d_in = (int(v) for v in layer["shape"])
        d_b = int(layer["block_size"])
        pattern = parse_pattern(layer["pattern"])
        storage = layer["storage"]
        runtime = layer["runtime_storage"]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{where}: missing or invalid field ({err})") from None
    dtype = _parse_dtype(layer.get("dtype"), where)
    if storage == QUANTIZED or runtime == QUANTIZED:
        _validate_quantized_layer(fqn, layer, tensors, (d_out, d_in), d_b, pattern, dtype)
        return
    if storage not in ("compact", "dense") or runtime not in STORAGES:
        raise ValueError(f"{where}: invalid storage {storage!r} / runtime storage {runtime!r}")
    if storage == "compact" and not pattern.structured:
        raise ValueError(f"{where}: compact storage needs an N:M pattern, got {pattern}")
    if d_b < 1 or d_out % d_b or d_in % d_b:
        raise ValueError(f"{where}: block size {d_b} does not divide the shape ({d_out}, {d_in})")
    expected = {
        "a_blocks": ((d_out // d_b, d_b, d_b), dtype),
        "b_blocks": ((d_in // d_b, d_b, d_b), dtype),
    }
    if storage == "compact":
        if d_in % pattern.m:
            raise ValueError(f"{where}: d_in={d_in} is not a multiple of M={pattern.m}")
        k = d_in // pattern.m * pattern.n
        per_byte = 8 // index_bits(pattern.m)
        expected["values"] = ((d_out, k), dtype)
        expected["indices"] = ((d_out, -(-k // per_byte)), torch.uint8)
    else:
        expected["core"] = ((d_out, d_in), dtype)
    for name, (shape, dt) in expected.items():
        key = part_key(fqn, name)
        if key not in tensors:
            raise ValueError(f"{where}: inner tensor {key!r} missing from the weights file(s)")
        t = tensors[key]
        if tuple(t.shape) != shape or t.dtype != dt:
            raise ValueError(
                f"{where}: {name} should be {dt} {list(shape)} for shape ({d_out}, {d_in}), block size {d_b}, "
                f"pattern {pattern}; found {t.dtype} {list(t.shape)}"
            )


def _validate_quantized_layer(
    fqn: str, layer: Dict[str, Any], tensors: Dict[str, torch.Tensor], shape: Tuple[int, int], d_b: int,
    pattern: Any, dtype: torch.dtype,
) -> None:
    where = f"{ARMOR_CONFIG_NAME}, layer {fqn!r}"
    d_out, d_in = shape
    if layer["storage"] != QUANTIZED or layer["runtime_storage"] != QUANTIZED:
        raise ValueError(f"{where}: a quantized layer must have storage and runtime storage {QUANTIZED!r}")
    quant = layer.get("quantization")
    if not (isinstance(quant, dict) and isinstance(quant.get("config"), dict) and isinstance(quant.get("tensors"), dict)
            and all(kind in ("compact", "plain") for kind in quant["tensors"].values())):
        raise ValueError(f"{where}: missing or malformed 'quantization' entry")
    if d_b < 1 or d_out % d_b or d_in % d_b:
        raise ValueError(f"{where}: block size {d_b} does not divide the shape ({d_out}, {d_in})")
    if "compact" in quant["tensors"].values() and not pattern.structured:
        raise ValueError(f"{where}: compact quantized tensors need an N:M pattern, got {pattern}")
    for key in _layer_keys(fqn, layer):
        if key not in tensors:
            raise ValueError(f"{where}: inner tensor {key!r} missing from the weights file(s)")
    for name, rows in (("a_blocks", d_out), ("b_blocks", d_in)):
        t = tensors[part_key(fqn, name)]
        if tuple(t.shape) != (rows // d_b, d_b, d_b) or t.dtype != dtype:
            raise ValueError(
                f"{where}: {name} should be {dtype} {[rows // d_b, d_b, d_b]}, found {t.dtype} {list(t.shape)}"
            )


# ------------------------------------------------------------------------ unflatten


def _upgrade_legacy_keys(tensors: Dict[str, torch.Tensor], metadata: Any) -> Tuple[Dict[str, torch.Tensor], Any]:
    """Files written before ``a_blocks`` moved to the weight's own key hold it as ``"{fqn}.a_blocks"``."""
    if not isinstance(metadata, dict) or not isinstance(metadata.get("layers"), dict) \
            or not isinstance(metadata.get("tensors"), dict):
        return tensors, metadata
    old = {f"{fqn}.a_blocks": fqn for fqn in metadata["layers"]
           if f"{fqn}.a_blocks" in tensors and fqn not in tensors}
    if not old:
        return tensors, metadata
    tensors = {old.get(k, k): v for k, v in tensors.items()}
    metadata = dict(metadata, tensors={old.get(k, k): v for k, v in metadata["tensors"].items()})
    return tensors, metadata


def unflatten_armor_state(
    model: nn.Module,
    tensors: Dict[str, torch.Tensor],
    metadata: Dict[str, Any],
    *,
    strict: bool = True,
    storage: Optional[str] = None,
    device: Optional[Union[str, torch.device]] = None,
) -> nn.Module:
    """Inverse of :func:`flatten_armor_state`: load ``tensors`` into ``model`` (in place) and return it.

    Plain tensors go through ``model.load_state_dict(..., assign=True)`` (saved dtypes and values
    kept exactly; each lands on the device of the parameter it replaces, or on ``device``); every
    layer in ``metadata["layers"]`` gets an ``nn.Parameter(ArmorTensor, requires_grad=False)``,
    re-stored as ``storage`` (default: as it was when saved; a semi-structured layer that cannot
    be rebuilt here, e.g. on CPU, becomes compact; a quantized core stays quantized).

    Raises:
        ValueError: metadata/tensors inconsistent, a layer path missing from ``model`` or of
            the wrong shape, a plain tensor of the wrong shape, or (``strict``) keys missing
            or unexpected. Layer paths and shapes are checked before ``model`` is touched.

    Example::

        >>> src = nn.Linear(4, 2)
        >>> t, meta = flatten_armor_state(src)
        >>> dst = unflatten_armor_state(nn.Linear(4, 2), t, meta)
        >>> torch.equal(dst.weight, src.weight)
        True
    """
    tensors, metadata = _upgrade_legacy_keys(tensors, metadata)
    _validate_metadata(metadata, tensors)
    if storage is not None and storage not in STORAGES + ("auto",):
        raise ValueError(f"storage must be one of {STORAGES + ('auto',)} or None, got {storage!r}")
    layers = metadata["layers"]
    current = model.state_dict(keep_vars=True)

    # 1. check every converted layer against the model before changing anything
    targets = {}
    for fqn, layer in layers.items():
        module_path, _, pname = fqn.rpartition(".")
        try:
            module = model.get_submodule(module_path) if module_path else model
        except AttributeError:
            raise ValueError(f"converted layer {fqn!r} has no module {module_path!r} in this model") from None
        if pname not in getattr(module, "_parameters", {}):
            raise ValueError(f"module {module_path!r} has no parameter {pname!r} for converted layer {fqn!r}")
        old = module._parameters[pname]
        if old is not None and tuple(old.shape) != tuple(layer["shape"]):
            raise ValueError(
                f"converted layer {fqn!r} is {tuple(layer['shape'])} in the checkpoint but "
                f"{tuple(old.shape)} in the model; build the model from the saved config"
            )
        targets[fqn] = (module, pname, old)

    # 2. plain tensors, on the device of what they replace (or `device`)
    inner_keys = {key for fqn, layer in layers.items() for key in _layer_keys(fqn, layer)}
    plain = {k: v for k, v in tensors.items() if k not in inner_keys}
    for key, target in metadata["aliases"].items():
        plain[key] = tensors[target]
    moved: Dict[int, torch.Tensor] = {}  # keep aliases aliased after moving

    def place(key: str, t: torch.Tensor) -> torch.Tensor:
        old = current.get(key)
        dev = torch.device(device) if device is not None else (
            old.device if isinstance(old, torch.Tensor) and old.device.type != "meta" else t.device
        )
        if dev == t.device:
            return t
        if id(t) not in moved:
            moved[id(t)] = t.to(dev)
        return moved[id(t)]

    plain = {k: place(k, v) for k, v in plain.items()}
    for key, t in plain.items():
        old = current.get(key)
        if isinstance(old, torch.Tensor) and tuple(old.shape) != tuple(t.shape):
            raise ValueError(
                f"tensor {key!r} is {tuple(t.shape)} in the checkpoint but {tuple(old.shape)} in the model; "
                "build the model from the saved config"
            )
    missing = [k for k in current if k not in plain and k not in layers]
    unexpected = [k for k in plain if k not in current]
    if strict and (missing or unexpected):
        raise ValueError(
            "the saved tensors do not match the model's architecture: "
            f"missing {missing[:8]}{' …' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' …' if len(unexpected) > 8 else ''}; "
            "build the model from the saved config, or pass strict=False"
        )
    model.load_state_dict(plain, strict=False, assign=True)
    if device is not None:
        model.to(device)

    # 3. converted layers
    for fqn, layer in layers.items():
        module, pname, old = targets[fqn]
        w = _build_layer(fqn, layer, tensors)
        dev = torch.device(device) if device is not None else (
            old.device if old is not None and old.device.type != "meta" else w.device
        )
        if dev != w.device:
            w = w.to(dev)
        w = restore_storage(w, layer["runtime_storage"], storage, fqn)
        setattr(module, pname, nn.Parameter(w, requires_grad=False))
    return model
