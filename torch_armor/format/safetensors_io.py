"""safetensors files of the ARMOR format: deterministic writes and self-describing shards.

:func:`write_safetensors` writes the same bytes for the same tensors every time (a sorted header;
``safetensors.torch.save_file`` orders its metadata by a randomly seeded hash map).
:func:`save_shard` writes one piece of a checkpoint (e.g. one decoder block) with its part of the
layer/tensor description in the header; :func:`read_shard_metadata` reads it back, checked
against its hash. :mod:`torch_armor.format.serialization` assembles shards into checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO, Dict, Mapping, Union

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from torch_armor._io import atomic_write
from torch_armor.errors import ArmorInputError
from torch_armor.format.armor_format import FORMAT_NAME, FORMAT_VERSION, flatten_state

__all__ = ["HEADER_KEY", "HEADER_META", "canonical_json", "write_safetensors", "save_shard", "read_shard_metadata"]

HEADER_KEY = "armor_metadata_sha256"  # sha256 of the file's part of the description
HEADER_META = "armor_metadata"  # that part itself, canonical JSON

ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        ST_DTYPES[getattr(torch, _name)] = _code


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def write_safetensors(fh: BinaryIO, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> None:
    """Stream a safetensors file with a deterministic layout (sorted header, data by alignment then key).

    ``safetensors.torch.save_file`` orders the header metadata by a randomly seeded hash map, so two
    saves of the same tensors differ; this writes the same bytes every time.
    """
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))  # keeps every tensor aligned
    header: Dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key in order:
        t = tensors[key]
        if t.dtype not in ST_DTYPES:
            raise ArmorInputError(f"tensor {key!r} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = canonical_json(header).encode()
    text += b" " * (-len(text) % 8)
    fh.write(struct.pack("<Q", len(text)))
    fh.write(text)
    for key in order:
        t = tensors[key].detach().to("cpu").contiguous().reshape(-1)
        if t.numel():
            fh.write(t.view(torch.uint8).numpy().data)


# --------------------------------------------------------------------------- shards


def save_shard(
    path: Union[str, os.PathLike], module_or_tensors: Union[nn.Module, Mapping[str, torch.Tensor]], prefix: str = ""
) -> Dict[str, Any]:
    """Write one piece of a checkpoint (e.g. one decoder block) to the safetensors file ``path``.

    An ``nn.Module``'s state is flattened exactly as :func:`save_pretrained` does (ArmorTensors as
    compact cores); a ``{key: tensor}`` mapping is taken as is (ArmorTensor values flattened too).
    Every key is prefixed with ``prefix`` (e.g. ``"model.layers.3."``). The file's header holds
    its part of the layer/tensor description, so it is self-describing. The write is atomic (temp
    file in the same directory, fsync, ``os.replace``) and deterministic: the same input gives a
    byte-identical file. Combine shards with :func:`assemble_checkpoint`.

    Returns:
        the shard's description ``{"format", "format_version", "layers", "aliases", "tensors"}``.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     meta = save_shard(os.path.join(d, "block0.safetensors"), nn.Linear(4, 2), prefix="layers.0.")
        >>> sorted(meta["tensors"])
        ['layers.0.bias', 'layers.0.weight']
    """
    if isinstance(module_or_tensors, nn.Module):
        state: Mapping[str, Any] = module_or_tensors.state_dict(keep_vars=True)
    elif isinstance(module_or_tensors, Mapping):
        state = module_or_tensors
    else:
        raise ArmorInputError(f"save_shard expects an nn.Module or a {{key: tensor}} mapping, got {type(module_or_tensors).__name__}")
    if not isinstance(prefix, str):
        raise ArmorInputError(f"prefix must be a string, got {type(prefix).__name__}")
    path = Path(path)
    if path.is_dir():
        raise ArmorInputError(f"{path} is a directory; save_shard writes one .safetensors file")
    tensors, metadata = flatten_state(state, prefix)
    text = canonical_json(metadata)
    header = {
        "format": "pt",
        "torch_armor_format": str(FORMAT_VERSION),
        HEADER_KEY: hashlib.sha256(text.encode()).hexdigest(),
        HEADER_META: text,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda fh: write_safetensors(fh, tensors, header))
    return metadata


def read_shard_metadata(path: Path) -> Dict[str, Any]:
    """The description stored in a :func:`save_shard` file's header (checked against its hash)."""
    if not path.is_file():
        raise ArmorInputError(f"shard {path} does not exist")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            header = fh.metadata() or {}
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise ArmorInputError(f"shard {path} cannot be read as safetensors ({err}); the file is truncated or corrupt") from None
    text = header.get(HEADER_META)
    if not isinstance(text, str) or hashlib.sha256(text.encode()).hexdigest() != header.get(HEADER_KEY):
        raise ArmorInputError(f"shard {path} has no valid torch_armor description in its header; write it with save_shard")
    metadata = json.loads(text)
    if metadata.get("format") != FORMAT_NAME or metadata.get("format_version") != FORMAT_VERSION:
        raise ArmorInputError(
            f"shard {path} is format {metadata.get('format')!r} version {metadata.get('format_version')!r}; "
            f"this torch_armor assembles {FORMAT_NAME!r} version {FORMAT_VERSION}"
        )
    return metadata
