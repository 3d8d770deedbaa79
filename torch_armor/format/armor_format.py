"""The ARMOR checkpoint format: how a converted layer is described, split into stored parts and
rebuilt, and how a whole state dict is flattened into plain tensors plus a JSON description.

A layer's stored parts are its ArmorTensor class's own ``__tensor_flatten__`` tensors
(``tensor_data_names``: ``a_blocks``, ``b_blocks``, then ``core`` / ``values`` + ``indices`` /
``core_scale``), rebuilt by the class's named constructor (:func:`~torch_armor.tensor.armor_tensor.from_parts`).
The format adds one rule on top, stated here once:

* a floating core with an N:M pattern is stored compact (``values`` + ``indices``: the
  :class:`~torch_armor.tensor.formats.CompactArmorTensor` of the weight), unstructured ones dense
  (``core``); an 8-bit core is stored as its compact class whatever kernel it runs on;
* ``a_blocks`` is stored under the weight's own key ``"{fqn}"`` (a loader that does not know ARMOR
  then fails on its shape instead of loading a random weight, see :func:`part_key`), every other
  part under ``"{fqn}.{name}"``;
* a core quantized with :mod:`torch_armor.tensor.quant` (a torchao tensor) is flattened through its
  own ``__tensor_flatten__`` into ``"{fqn}.core.{name}"`` (a ``(d_out, d_in)`` one that is N:M sparse,
  e.g. int8 ``qdata``, packed like a floating core into ``"{fqn}.core.{name}.values"`` /
  ``".indices"``), with the torchao config in the description.

A layer's description (:func:`layer_parts`) holds its shape, block size, pattern, saved and
runtime storage, dtype and inner tensor shapes/dtypes; :func:`validate_metadata` checks a whole
description (``{"format", "format_version", "layers", "aliases", "tensors"}``) against the stored
tensors (each layer's parts against its storage class's
:meth:`~torch_armor.tensor.armor_tensor.ArmorTensor.part_specs`) and :func:`build_layer` rebuilds one
ArmorTensor. :func:`flatten_armor_state` / :func:`unflatten_armor_state` apply this to a model's state
dict; :mod:`torch_armor.format.serialization` writes it to files and :mod:`torch_armor.format.hf` loads
it through transformers.

Example::

    >>> part_key("model.layers.0.mlp.up_proj.weight", "a_blocks"), part_key("fc.weight", "values")
    ('model.layers.0.mlp.up_proj.weight', 'fc.weight.values')
    >>> stored_names("compact"), stored_names("dense")
    (('a_blocks', 'b_blocks', 'values', 'indices'), ('a_blocks', 'b_blocks', 'core'))
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from torch_armor.calibration.experts import out_in_shape
from torch_armor.core.pattern import parse_pattern
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import QUANTIZED, STORAGES, ArmorTensor, format_class, from_parts, restore_storage
from torch_armor.tensor.eight_bit import EIGHT_BIT, EightBitArmorTensor
from torch_armor.format.file_checks import check_layer_values
from torch_armor.tensor.packing import pack_nm, unpack_nm
from torch_armor.tensor.quant import quant_config_from_dict, quant_config_to_dict, quantized_core_template

__all__ = [
    "ARMOR_CONFIG_NAME",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "DTYPES",
    "dtype_name",
    "tensor_spec",
    "canonical_sha256",
    "SAVED_STORAGES",
    "stored_names",
    "part_key",
    "layer_keys",
    "layer_parts",
    "build_layer",
    "validate_metadata",
    "validate_layer",
    "flatten_armor_state",
    "flatten_state",
    "unflatten_armor_state",
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


#: the storages a layer is saved in (a semi-structured core is saved compact)
SAVED_STORAGES = ("compact", "dense", QUANTIZED, *EIGHT_BIT)


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


def stored_names(storage: str) -> Tuple[str, ...]:
    """The parts a layer saved as ``storage`` stores: its ArmorTensor class's ``tensor_data_names``
    (a quantized ``core`` is further flattened by its own torchao class, see :func:`layer_parts`)."""
    return tuple(format_class(storage).tensor_data_names)


def part_key(fqn: str, name: str) -> str:
    """The file key of a converted layer's part: ``a_blocks`` under the weight's own key (so a loader
    that does not know ARMOR meets a shape mismatch there and fails loudly), the others under
    ``"{fqn}.{name}"``."""
    return fqn if name == "a_blocks" else f"{fqn}.{name}"


def layer_keys(fqn: str, layer: Dict[str, Any]) -> Tuple[str, ...]:
    """Keys of ``model.safetensors`` that belong to one converted layer."""
    keys = []
    for name in stored_names(layer["storage"]):
        if name == "core" and layer["storage"] == QUANTIZED:
            for inner, kind in layer["quantization"]["tensors"].items():
                keys += [f"{fqn}.core.{inner}.values", f"{fqn}.core.{inner}.indices"] if kind == "compact" \
                    else [f"{fqn}.core.{inner}"]
        else:
            keys.append(part_key(fqn, name))
    return tuple(keys)


def _is_nm(t: torch.Tensor, n: int, m: int) -> bool:
    """Whether every group of ``m`` consecutive columns of the 2-D ``t`` has at most ``n`` nonzeros."""
    d_out, d_in = t.shape
    return d_in % m == 0 and bool(((t != 0).reshape(d_out, d_in // m, m).sum(-1) <= n).all())


def _core_parts(key: str, value: ArmorTensor, qcore: torch.Tensor) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """The stored parts (``"core.{name}"``…) and the ``quantization`` entry of a torchao quantized core,
    flattened through the torchao class's own ``__tensor_flatten__``."""
    if value.quant_config is None:
        raise ArmorInputError(
            f"{key}: the quantized core carries no torchao config, so it cannot be rebuilt on load; "
            "quantize with torch_armor.tensor.quant.quantize_armor_core / ArmorCoreConfig"
        )
    names, _ = qcore.__tensor_flatten__()
    pattern = parse_pattern(value.pattern)
    inner: Dict[str, torch.Tensor] = {}
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
    quantization = {"config": quant_config_to_dict(value.quant_config), "class": type(qcore).__name__, "tensors": kinds}
    return inner, quantization


def _build_core(fqn: str, layer: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, Any]:
    """The torchao quantized core and its config: structure from the config, data from the file, rebuilt
    by the torchao class's own ``__tensor_unflatten__``."""
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
    return type(template).__tensor_unflatten__(inner, ctx, template.shape, template.stride()), config


def layer_parts(key: str, value: ArmorTensor) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """The stored parts (``{inner name: tensor}``, keys for :func:`part_key`) and the description
    of one converted weight: the ``__tensor_flatten__`` tensors of its stored form (the module
    docstring's rule: the core compact for N:M patterns, dense otherwise, quantized as is). Fused
    experts (an ``(E, d_out, d_in)`` ArmorTensor) are one entry with ``"experts": E``, every part
    stacked along a leading ``E`` dimension."""
    runtime = value.storage_format
    if runtime == QUANTIZED:
        saved_storage, w = QUANTIZED, value
    elif isinstance(value, EightBitArmorTensor):  # stored compact, whatever kernel it runs on
        saved_storage = runtime
        w = value if value.backend is None else value.moved("cpu", value.dtype)
    else:
        saved_storage = "compact" if parse_pattern(value.pattern).structured else "dense"
        w = value.with_storage(saved_storage) if runtime != saved_storage else value
    entry: Dict[str, Any] = {
        "shape": list(value.shape),
        "block_size": int(value.block_size),
        "pattern": value.pattern,
        "storage": saved_storage,
        "runtime_storage": runtime,
        "dtype": dtype_name(value.dtype),
    }
    names, _ = w.__tensor_flatten__()
    inner: Dict[str, torch.Tensor] = {}
    for name in names:
        if name == "core" and saved_storage == QUANTIZED:  # a torchao tensor: stored as its own inner tensors
            parts, entry["quantization"] = _core_parts(key, value, w.core)
            inner.update(parts)
        else:
            inner[name] = getattr(w, name)
    entry["tensors"] = {name: tensor_spec(t) for name, t in inner.items()}
    if value.num_experts is not None:
        entry["experts"] = value.num_experts
    return inner, entry


def build_layer(fqn: str, layer: Dict[str, Any], tensors: Dict[str, torch.Tensor]) -> ArmorTensor:
    """The ArmorTensor of one (validated) layer entry, from its stored parts (keys :func:`part_key`),
    by its class's named constructor."""
    check_layer_values(fqn, layer["pattern"], {k[len(fqn) + 1:] or "a_blocks": tensors[k] for k in layer_keys(fqn, layer)})
    storage = layer["storage"]
    parts: Dict[str, Any] = {}
    for name in stored_names(storage):
        if name == "core" and storage == QUANTIZED:
            parts["core"], parts["quant_config"] = _build_core(fqn, layer, tensors)
        else:
            parts[name] = tensors[part_key(fqn, name)]
    w = from_parts(storage, pattern=str(parse_pattern(layer["pattern"])), dtype=DTYPES[layer["dtype"]], **parts)
    w.layer_name = fqn
    return w


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
    if storage in ("compact", *EIGHT_BIT) and d_in % pattern.m:
        raise ArmorInputError(f"{where}: d_in={d_in} is not a multiple of M={pattern.m}")
    expected = format_class(storage).part_specs(lead + (d_out, d_in), d_b, pattern, dtype)
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
    for name, (part_shape, part_dtype) in format_class(QUANTIZED).part_specs(shape, d_b, pattern, dtype).items():
        t = tensors[part_key(fqn, name)]
        if tuple(t.shape) != part_shape or t.dtype != part_dtype:
            raise ArmorInputError(
                f"{where}: {name} should be {part_dtype} {list(part_shape)}, found {t.dtype} {list(t.shape)}"
            )


# ------------------------------------------------------------------------- state dicts


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
        if isinstance(value, ArmorTensor):
            inner, layers[key] = layer_parts(key, value)
            for name, t in inner.items():
                raw[part_key(key, name)] = t
        elif isinstance(value, torch.Tensor):
            if type(value) not in (torch.Tensor, nn.Parameter):
                raise ArmorInputError(
                    f"state-dict entry {key!r} is a {type(value).__name__}; only plain tensors and "
                    "ArmorTensor weights can be saved. Dequantize or convert that layer first"
                )
            raw[key] = value.detach()
        else:  # extra state objects: not tensors, not supported
            raise ArmorInputError(f"state-dict entry {key!r} is a {type(value).__name__}, not a tensor; cannot save it")

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
            raise ArmorInputError(f"tensor {key!r} is on the meta device (no data); materialize the model before saving")
        tensors[key] = t.to("cpu").contiguous()
    metadata = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "layers": layers,
        "aliases": aliases,
        "tensors": {key: tensor_spec(t) for key, t in tensors.items()},
    }
    return tensors, metadata


# ------------------------------------------------------------------------ unflatten


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
    validate_metadata(metadata, tensors)
    if storage is not None and storage not in STORAGES + ("auto",):
        raise ArmorInputError(f"storage must be one of {STORAGES + ('auto',)} or None, got {storage!r}")
    layers = metadata["layers"]
    current = model.state_dict(keep_vars=True)

    # 1. check every converted layer against the model before changing anything
    targets = {}
    for fqn, layer in layers.items():
        module_path, _, pname = fqn.rpartition(".")
        try:
            module = model.get_submodule(module_path) if module_path else model
        except AttributeError:
            raise ArmorInputError(f"converted layer {fqn!r} has no module {module_path!r} in this model") from None
        if pname not in getattr(module, "_parameters", {}):
            raise ArmorInputError(f"module {module_path!r} has no parameter {pname!r} for converted layer {fqn!r}")
        old = module._parameters[pname]
        if old is not None and out_in_shape(module, pname) != tuple(layer["shape"]):
            raise ArmorInputError(
                f"converted layer {fqn!r} is {tuple(layer['shape'])} in the checkpoint but "
                f"{out_in_shape(module, pname)} in the model; build the model from the saved config"
            )
        targets[fqn] = (module, pname, old)

    # 2. plain tensors, on the device of what they replace (or `device`)
    inner_keys = {key for fqn, layer in layers.items() for key in layer_keys(fqn, layer)}
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
            raise ArmorInputError(
                f"tensor {key!r} is {tuple(t.shape)} in the checkpoint but {tuple(old.shape)} in the model; "
                "build the model from the saved config"
            )
    missing = [k for k in current if k not in plain and k not in layers]
    unexpected = [k for k in plain if k not in current]
    if strict and (missing or unexpected):
        raise ArmorInputError(
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
        w = build_layer(fqn, layer, tensors)
        dev = torch.device(device) if device is not None else (
            old.device if old is not None and old.device.type != "meta" else w.device
        )
        if dev != w.device:
            w = w.to(dev)
        w = restore_storage(w, layer["runtime_storage"], storage, fqn)
        setattr(module, pname, nn.Parameter(w, requires_grad=False))
    return model
