"""Checkpoints are untrusted input: checks run before any file is handed to safetensors or transformers.

* :func:`check_shard_name` — a weights file named by an index or a config is a plain
  ``*.safetensors`` file name inside the directory (no ``..``, no path, no symlink out of it; in the
  Hugging Face hub cache, links into the model's own ``blobs/`` are the normal case).
* :func:`read_safetensors_header` — the 8-byte length, the JSON header and every tensor's dtype,
  shape and byte range checked against the file's size: a pickle, a truncated file or another
  format gives one error naming the file (not safetensors' ``header too large``).
* :func:`check_weight_files` — both of the above for every weights file of a directory.
* :func:`refuse_incomplete` — a directory left half-written by an interrupted save is refused.
* :func:`check_quantization_config` — every ARMOR layer entry of ``config.json``'s
  ``quantization_config`` checked (types, block size against shape, pattern, dtype, inner tensors
  against its storage class's :meth:`~torch_armor.tensor.armor_tensor.ArmorTensor.part_specs` and the
  files' headers) and every ARMOR layer stored in the files listed, before transformers sees the
  directory.
* :func:`check_layer_values` — a converted layer's factors are finite and the indices of every
  compact core (a quantized core's packed ``qdata`` too) strictly increasing within each group (one
  pass over the layer, cheap next to reading it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from safetensors import safe_open

from torch_armor.core.pattern import parse_pattern
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import QUANTIZED, format_class
from torch_armor.tensor.eight_bit import EIGHT_BIT
from torch_armor.tensor.packing import index_bits

__all__ = [
    "check_shard_name",
    "read_safetensors_header",
    "check_weight_files",
    "check_index",
    "check_quantization_config",
    "INCOMPLETE_KEY",
    "refuse_incomplete",
    "check_layer_values",
    "check_armor_layers",
    "check_checkpoint_files",
    "check_layer_entries",
    "check_load_target",
    "refuse_meta_device_map",
    "refuse_missing_keys",
]

PathLike = Union[str, "os.PathLike[str]"]
INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER = 100 << 20  # safetensors' own limit
# safetensors dtype code -> bytes per element (8-bit and smaller floats included)
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
             "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8}
_TORCH_CODE = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
               "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
               "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_STORAGES = ("compact", "dense", "semi_structured", "quantized", "int8", "fp8")
_PART_SUFFIXES = (".b_blocks", ".values", ".indices", ".core")
#: ``quantization_config`` key that marks a directory whose weights files a save is replacing: from the
#: first file replaced until the new ``config.json`` is written (its value says which process)
INCOMPLETE_KEY = "incomplete"


def _bad(path: Path, why: str) -> ArmorInputError:
    return ArmorInputError(f"{path}: not a valid safetensors file ({why}); the file is truncated, corrupt or of "
                           "another format (a pickle?): copy it again or re-save the checkpoint")


def check_shard_name(directory: PathLike, name: Any, listed_in: str) -> Path:
    """``directory/name`` for a plain ``*.safetensors`` file name inside ``directory``; else an error naming ``listed_in``."""
    root = Path(directory)
    plain = (isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name
             and "/" not in name and "\\" not in name and "\0" not in name and name.endswith(".safetensors"))
    if not plain:
        raise ArmorInputError(f"{listed_in} names weights file {name!r}, which is not a plain *.safetensors file name "
                              f"inside {root}; the file was edited or is corrupt (re-save the checkpoint)")
    path = root / name
    if path.is_symlink():
        target, home = path.resolve(), _link_home(root)
        inside = home in target.parents if home != root.resolve() else target.parent == home
        if not inside:
            raise ArmorInputError(f"{listed_in} names weights file {name!r}, a symlink to {target} outside {home}; "
                                  "copy the file into the directory")
    return path


def _link_home(directory: PathLike) -> Path:
    """Where the symlinks of a checkpoint's files may point: the directory itself, or, for a snapshot of
    the Hugging Face hub cache (``models--org--name/snapshots/<revision>``, whose files are links to
    ``../../blobs/<sha256>``), the model's repository folder ``models--org--name``."""
    real = Path(directory).resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def read_safetensors_header(path: PathLike) -> Dict[str, Any]:
    """The header of a safetensors file (``__metadata__`` removed), checked against the file's size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise _bad(path, f"{size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > min(_MAX_HEADER, size - 8):
                raise _bad(path, f"header length {n} exceeds the file's {size} bytes")
            raw = fh.read(n)
    except OSError as err:
        raise ArmorInputError(f"{path}: cannot be read ({err.strerror or err}); check the file") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _bad(path, "the header is not JSON") from None
    if not isinstance(header, dict):
        raise _bad(path, "the header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise _bad(path, "__metadata__ is not a string map")
    data = size - 8 - n
    ends = []
    for key, entry in header.items():
        ok = (isinstance(entry, dict) and entry.get("dtype") in _ITEMSIZE and isinstance(entry.get("shape"), list)
              and all(type(d) is int and d >= 0 for d in entry["shape"])
              and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
              and all(type(o) is int for o in entry["data_offsets"]))
        if not ok:
            raise _bad(path, f"malformed entry for tensor {key!r}")
        a, b = entry["data_offsets"]
        numel = 1
        for d in entry["shape"]:
            numel *= d
        if not 0 <= a <= b <= data:
            raise _bad(path, f"tensor {key!r} lies outside the file's {data} data bytes")
        if b - a != numel * _ITEMSIZE[entry["dtype"]]:
            raise _bad(path, f"tensor {key!r} holds {b - a} bytes for {entry['dtype']} {entry['shape']}")
        ends.append((a, b))
    ends.sort()
    for (_, b0), (a1, _) in zip(ends, ends[1:]):
        if a1 < b0:
            raise _bad(path, "two tensors overlap")
    return header


def check_index(directory: PathLike) -> Optional[Dict[str, str]]:
    """``weight_map`` of ``model.safetensors.index.json`` (``None`` without one), every name checked."""
    index = Path(directory) / INDEX_NAME
    if not index.is_file():
        return None
    try:
        data = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, OSError) as err:
        raise ArmorInputError(f"{index} is not valid JSON ({err}); re-save the checkpoint") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
        raise ArmorInputError(f"{index} has no 'weight_map' object of tensor names to files; re-save the checkpoint")
    for name in set(map(str, weight_map.values())) | {v for v in weight_map.values() if not isinstance(v, str)}:
        check_shard_name(directory, name, str(index))
    return weight_map


def check_weight_files(directory: PathLike) -> Dict[str, Dict[str, Any]]:
    """Headers of every weights file of ``directory`` (the index's, or every ``*.safetensors``), each checked."""
    root = Path(directory)
    weight_map = check_index(root)
    names = sorted(set(weight_map.values())) if weight_map is not None else sorted(
        p.name for p in root.glob("*.safetensors"))
    headers = {}
    for name in names:
        path = check_shard_name(root, name, str(root / INDEX_NAME) if weight_map is not None else str(root))
        if not path.is_file():
            raise ArmorInputError(f"{root / INDEX_NAME} names {name}, which is missing; restore it or re-save the checkpoint")
        headers[name] = read_safetensors_header(path)
    if weight_map is not None:
        for key, name in weight_map.items():
            if key not in headers[name]:
                raise ArmorInputError(f"{root / INDEX_NAME} says tensor {key!r} is in {name}, but that file has no "
                                      "such tensor; re-save the checkpoint")
    return headers


def _int(value: Any) -> Optional[int]:
    return value if type(value) is int else None


def _layer_problem(fqn: str, layer: Any, stored: Mapping[str, Tuple[List[int], str]]) -> Optional[str]:
    """What is wrong with one ARMOR layer entry, or ``None``."""
    if not isinstance(layer, dict):
        return f"is a {type(layer).__name__}, not an object"
    full = layer.get("shape")
    experts = layer.get("experts")
    lead = [experts] if experts is not None else []
    if experts is not None and not (_int(experts) and experts > 0):
        return f"'experts' {experts!r} is not a positive integer"
    if not (isinstance(full, list) and len(full) == 2 + len(lead) and all(_int(d) and d > 0 for d in full)
            and full[:len(lead)] == lead):
        what = f"{experts} experts and two positive integers" if lead else "two positive integers"
        return f"'shape' {full!r} is not {what}"
    shape = full[len(lead):]
    if lead and layer.get("storage") not in ("compact", "dense"):
        return f"fused experts are stored compact or dense, not {layer.get('storage')!r}"
    d_b = _int(layer.get("block_size"))
    if d_b is None or d_b < 1 or shape[0] % d_b or shape[1] % d_b:
        return f"block_size {layer.get('block_size')!r} does not divide the shape {tuple(shape)}"
    try:
        pattern = parse_pattern(layer.get("pattern"))
    except (TypeError, ValueError) as err:
        return f"pattern {layer.get('pattern')!r} is invalid ({err})"
    if layer.get("dtype") not in _TORCH_CODE or not torch.empty(0, dtype=getattr(torch, layer["dtype"])).is_floating_point():
        return f"dtype {layer.get('dtype')!r} is not a floating dtype"
    storage, runtime = layer.get("storage"), layer.get("runtime_storage")
    if storage not in ("compact", "dense", QUANTIZED, *EIGHT_BIT) or runtime not in _STORAGES:
        return f"storage {storage!r} / runtime_storage {runtime!r} is not one of {_STORAGES}"
    if storage == "compact" and (not pattern.structured or shape[1] % pattern.m):
        return f"compact storage needs an N:M pattern dividing the {shape[1]} input columns, got {pattern}"
    if storage in EIGHT_BIT and ((pattern.n, pattern.m) != (2, 4) or runtime != storage or shape[1] % 4):
        return f"an {storage} core must be 2:4 with runtime_storage {storage!r}, got {pattern} / {runtime!r}"
    specs = layer.get("tensors")
    if not (isinstance(specs, dict) and specs and all(
            isinstance(s, dict) and isinstance(s.get("shape"), list) and s.get("dtype") in _TORCH_CODE
            for s in specs.values())):
        return "'tensors' is missing or not a map of {shape, dtype}"
    expected = format_class(storage).part_specs(full, d_b, pattern, getattr(torch, layer["dtype"]))
    for name, (part_shape, part_dtype) in expected.items():
        want_shape, want_dtype = list(part_shape), str(part_dtype).removeprefix("torch.")
        if name not in specs or list(specs[name]["shape"]) != want_shape or specs[name]["dtype"] != want_dtype:
            got = specs.get(name)
            return (f"inner tensor {name!r} should be {want_dtype} {want_shape} for shape {tuple(shape)}, block size "
                    f"{d_b}, pattern {pattern}; the entry says {got!r}")
    for name, spec in specs.items():
        key = fqn if name == "a_blocks" else f"{fqn}.{name}"
        if key not in stored:
            return f"inner tensor {key!r} is not in the weights files"
        got_shape, code = stored[key]
        if list(got_shape) != list(spec["shape"]) or code != _TORCH_CODE[spec["dtype"]]:
            return (f"inner tensor {key!r} is {code} {got_shape} in the weights files but {spec['dtype']} "
                    f"{spec['shape']} in the entry")
    return None


def refuse_incomplete(quant: Mapping[str, Any], where: str) -> None:
    """A ``quantization_config`` written while a save replaced the weights files (:data:`INCOMPLETE_KEY`):
    that save did not finish, so the files may belong to two models."""
    if quant.get(INCOMPLETE_KEY):
        raise ArmorInputError(
            f"{where}: the directory is half-written: a save replacing its weights files ({quant[INCOMPLETE_KEY]}) "
            "did not finish, so they may belong to two different models; rerun the command that wrote it (a prune "
            "resumes from its run directory) or restore the directory from a copy")


def check_quantization_config(directory: PathLike) -> None:
    """Validate an ARMOR ``quantization_config`` in ``directory/config.json`` against the weights files."""
    root = Path(directory)
    cfg_path = root / "config.json"
    try:
        quant = json.loads(cfg_path.read_text()).get("quantization_config")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        raise ArmorInputError(f"{cfg_path} cannot be read as a JSON object ({err}); restore the file") from None
    if not isinstance(quant, dict) or quant.get("quant_method") != "armor":
        return
    refuse_incomplete(quant, f"{cfg_path} (quantization_config)")
    headers = check_weight_files(root)
    check_armor_layers(quant.get("layers"), quant.get("buffers", {}), {root / n: h for n, h in headers.items()},
                       f"{cfg_path} (quantization_config)")


def check_armor_layers(layers: Any, buffers: Any, files: Mapping[Path, Mapping[str, Any]], where: str) -> None:
    """Every ARMOR layer entry against the files' headers (``{path: header}``), every stored layer listed,
    then every layer's stored values (finite, compact indices increasing)."""
    if not isinstance(layers, dict) or not layers:
        raise ArmorInputError(f"{where}: 'layers' must be a non-empty object of ARMOR layers, got "
                              f"{type(layers).__name__}; the file was edited or is corrupt (re-save the model)")
    if not isinstance(buffers, dict) or not all(isinstance(v, str) for v in buffers.values()):
        raise ArmorInputError(f"{where}: 'buffers' must map buffer names to dtype names; the file was edited")
    stored: Dict[str, Tuple[List[int], str]] = {}
    home: Dict[str, Path] = {}
    for path, header in files.items():
        stored.update({k: (e["shape"], e["dtype"]) for k, e in header.items()})
        home.update({k: path for k in header})
    for fqn, layer in layers.items():
        problem = _layer_problem(fqn, layer, stored)
        if problem:
            raise ArmorInputError(f"{where}, layer {fqn!r}: {problem}; the file was edited or is corrupt "
                                  "(re-save the model)")
    _check_buffer_dtypes(buffers, {layer["dtype"] for layer in layers.values()}, where)
    for key in stored:
        for suffix in _PART_SUFFIXES:
            base = key[: -len(suffix)]  # a layer's parts: A's blocks under its own key (fused experts too), the rest beside
            if key.endswith(suffix) and (base.endswith(".weight") or base in stored) and base not in layers:
                raise ArmorInputError(f"{where}: the weights files hold ARMOR layer {base!r} "
                                      f"(tensor {key!r}), which 'layers' does not list; the file was edited")
    for fqn, layer in layers.items():
        parts = {}
        for name in layer["tensors"]:
            key = fqn if name == "a_blocks" else f"{fqn}.{name}"
            with safe_open(str(home[key]), framework="pt", device="cpu") as fh:
                parts[name] = fh.get_tensor(key)
        check_layer_values(fqn, layer["pattern"], parts)


def _check_buffer_dtypes(buffers: Mapping[str, str], layer_dtypes: set, where: str) -> None:
    """``buffers`` records the non-persistent floating buffers (rotary ``inv_freq``…) as saved: in float32
    (how transformers computes them) or in the dtype the model, and so its layers, was cast to."""
    allowed = sorted({"float32"} | layer_dtypes)
    for name, dtype in buffers.items():
        if dtype not in allowed:
            raise ArmorInputError(f"{where}: 'buffers' gives {name!r} the dtype {dtype!r}, but a saved buffer is "
                                  f"one of {allowed} (float32 or the layers' dtype); the file was edited (re-save "
                                  "the model)")


def check_layer_entries(layers: Any, buffers: Any) -> None:
    """The types of a ``quantization_config``'s ``layers`` and ``buffers`` (no files at hand yet)."""
    where = "config.json (quantization_config)"
    if layers is not None and not (isinstance(layers, dict) and all(isinstance(v, dict) for v in layers.values())):
        raise ArmorInputError(f"{where}: 'layers' must be an object of layer name -> entry object, got "
                              f"{type(layers).__name__}; the file was edited or is corrupt (re-save the model)")
    if buffers is not None and not (isinstance(buffers, dict) and all(isinstance(v, str) for v in buffers.values())):
        raise ArmorInputError(f"{where}: 'buffers' must map buffer names to dtype names; the file was edited")


def check_checkpoint_files(files: Any, layers: Any, buffers: Any) -> None:
    """``check_armor_layers`` for the weights files transformers is about to load (``checkpoint_files``)."""
    paths = [Path(f) for f in (files or []) if str(f).endswith(".safetensors")]
    if not paths:
        return
    check_armor_layers(layers, buffers, {p: read_safetensors_header(p) for p in paths},
                       f"{paths[0].parent / 'config.json'} (quantization_config)")


def check_layer_values(fqn: str, pattern: Any, parts: Mapping[str, Any]) -> None:
    """A converted layer's stored parts: finite factors and core, and the positions of every compact core
    (``indices``, or a quantized core's ``core.<name>.indices``) strictly increasing per group."""
    for name, t in parts.items():
        if isinstance(t, torch.Tensor) and type(t) is torch.Tensor and t.is_floating_point() \
                and t.device.type != "meta" and not bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all()):
            raise ArmorInputError(f"layer {fqn!r}: stored {name} holds NaN or Inf; the checkpoint is corrupt "
                                  "(re-save or re-prune the model)")
    for name, indices in parts.items():
        if name == "indices" or name.endswith(".indices"):
            _check_positions(fqn, pattern, name, indices, parts.get(name[: -len("indices")] + "values"))


def _check_positions(fqn: str, pattern: Any, name: str, indices: Any, values: Any) -> None:
    """The packed positions of one compact core: below M and strictly increasing within each group of N."""
    if not (isinstance(indices, torch.Tensor) and isinstance(values, torch.Tensor)) or indices.device.type == "meta":
        return
    # fused experts stack their parts on a leading dim: check their rows one after the other
    indices, values = indices.reshape(-1, indices.shape[-1]), values.reshape(-1, values.shape[-1])
    p = parse_pattern(pattern)
    n, m = p.n, p.m
    bits = index_bits(m)
    k = values.shape[-1]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=indices.device)
    pos = ((indices.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(indices.shape[0], -1)[:, :k]
    groups = pos.reshape(indices.shape[0], -1, n).to(torch.int16)
    bad = (groups >= m).any(-1)
    if n > 1:
        bad |= (groups[..., 1:] <= groups[..., :-1]).any(-1)
    if bool(bad.any()):
        row, group = (int(v) for v in bad.nonzero()[0])
        raise ArmorInputError(
            f"layer {fqn!r}: compact {name} of row {row}, group {group} are {groups[row, group].tolist()}, not "
            f"{n} strictly increasing positions below {m}; the checkpoint is corrupt (re-save the model)")


def refuse_meta_device_map(device_map: Any) -> None:
    """``meta`` holds no values: a model loaded there could not run (nor hold its ARMOR factors)."""
    values = list(device_map.values()) if isinstance(device_map, Mapping) else [device_map]
    if any(str(v) == "meta" or (isinstance(v, torch.device) and v.type == "meta") for v in values):
        raise ArmorInputError(f"device_map {device_map!r} puts weights on the meta device, which holds no values; "
                              "load on 'cpu' or 'cuda' (build an empty model with torch.device('meta') instead)")


def check_load_target(directory: PathLike, device: Any = None) -> None:
    """Before transformers reads an ARMOR directory: the device, the weights files and ``quantization_config``."""
    if device is not None:
        refuse_meta_device_map(device)
    check_quantization_config(directory)


def refuse_missing_keys(directory: PathLike, loading_info: Mapping[str, Any]) -> None:
    """A checkpoint that lacks some of the model's weights is refused (transformers would initialise them randomly)."""
    missing = sorted(loading_info.get("missing_keys") or ())
    if missing:
        raise ArmorInputError(
            f"{directory} lacks {len(missing)} weight(s) of the model, e.g. {missing[:4]}; the checkpoint is incomplete "
            "(a shard was removed or the run was interrupted): copy the missing files or re-save the model")

