"""Flatten ARMOR-converted state into plain tensors + a JSON description, and back.

The in-memory half of saving (:mod:`torch_armor.format.serialization` writes the result to
safetensors files); each converted layer is split and described as :mod:`torch_armor.format.layout`
says. :func:`unflatten_armor_state` validates the description against the tensors before touching
the model.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from torch_armor.calibration.experts import out_in_shape
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import STORAGES, ArmorTensor, restore_storage
from torch_armor.format.layout import (FORMAT_NAME, FORMAT_VERSION, build_layer, layer_keys, layer_parts, part_key,
                                       tensor_spec, validate_metadata)

__all__ = ["flatten_armor_state", "flatten_state", "unflatten_armor_state"]


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
