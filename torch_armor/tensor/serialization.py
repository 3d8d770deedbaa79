"""Save and load ARMOR-converted models with safetensors (no pickle anywhere), whole or shard by shard.

A saved directory holds:

* the weights: ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` … when the
  checkpoint was written in pieces. Each file holds the flattened state of its part of the model
  (:func:`~torch_armor.tensor.flatten.flatten_armor_state`: plain tensors under their usual keys,
  every ArmorTensor as ``a_blocks``, ``b_blocks`` and a compact N:M core) and, in its safetensors
  header, its own part of the layer/tensor description plus that part's sha256, so every file is
  self-describing and bound to ``armor_config.json``.
* ``armor_config.json``: format version, the merged per-layer/per-tensor description, every
  weights file with its sha256 (``weights_files``; a single-file checkpoint keeps the
  ``weights_file``/``weights_sha256`` fields of format version 1, so older readers load it),
  and the model class.
* ``config.json`` when the model has a Hugging Face ``config``.

:func:`save_shard` writes one piece (e.g. one decoder block, then freed) atomically;
:func:`assemble_checkpoint` moves the pieces into the directory and writes
``armor_config.json`` last, so an interrupted save never leaves a directory that loads.
:func:`save_pretrained` is one shard of the whole model plus assembly.

Loading (:func:`load_pretrained`) refuses pickle files, checks every file's sha256 and its header
against the JSON, validates every shape/dtype, loads plain tensors with
``load_state_dict(assign=True)`` semantics (saved dtypes kept) and rebuilds the ArmorTensors, so
outputs are bit-identical.

Example::

    >>> import tempfile, torch
    >>> from torch import nn
    >>> from torch_armor.core.factors import ArmorFactors
    >>> from torch_armor.tensor.armor_tensor import armor_linear_from_factors
    >>> model = nn.Sequential(nn.Linear(8, 8))
    >>> core = torch.tensor([[1.0, 0.0, 0.0, 2.0]] * 8).repeat(1, 2)
    >>> f = ArmorFactors(torch.eye(4).repeat(2, 1, 1), core, torch.eye(4).repeat(2, 1, 1), core != 0, "2:4")
    >>> _ = armor_linear_from_factors(model[0], f)
    >>> with tempfile.TemporaryDirectory() as d:
    ...     save_pretrained(model, d)
    ...     loaded = load_pretrained(d, nn.Sequential(nn.Linear(8, 8)))
    ...     x = torch.randn(2, 8)
    ...     torch.equal(loaded(x), model(x))
    True
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from torch_armor._io import atomic_write, file_sha256, fsync_dir
from torch_armor.tensor.flatten import (
    ARMOR_CONFIG_NAME,
    FORMAT_NAME,
    FORMAT_VERSION,
    _canonical_sha256,
    flatten_armor_state,
    flatten_state,
    unflatten_armor_state,
)

__all__ = [
    "WEIGHTS_NAME",
    "ARMOR_CONFIG_NAME",
    "FORMAT_VERSION",
    "flatten_armor_state",
    "unflatten_armor_state",
    "save_shard",
    "assemble_checkpoint",
    "save_pretrained",
    "load_pretrained",
    "has_armor_quantization_config",
]

WEIGHTS_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_HEADER_KEY = "armor_metadata_sha256"  # sha256 of the file's part of the description
_HEADER_META = "armor_metadata"  # that part itself, canonical JSON
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _write_safetensors(fh: BinaryIO, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> None:
    """Stream a safetensors file with a deterministic layout (sorted header, data by alignment then key).

    ``safetensors.torch.save_file`` orders the header metadata by a randomly seeded hash map, so two
    saves of the same tensors differ; this writes the same bytes every time.
    """
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))  # keeps every tensor aligned
    header: Dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key in order:
        t = tensors[key]
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"tensor {key!r} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = t.numel() * t.element_size()
        header[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = _canonical_json(header).encode()
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
        raise ValueError(f"save_shard expects an nn.Module or a {{key: tensor}} mapping, got {type(module_or_tensors).__name__}")
    if not isinstance(prefix, str):
        raise ValueError(f"prefix must be a string, got {type(prefix).__name__}")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory; save_shard writes one .safetensors file")
    tensors, metadata = flatten_state(state, prefix)
    text = _canonical_json(metadata)
    header = {
        "format": "pt",
        "torch_armor_format": str(FORMAT_VERSION),
        _HEADER_KEY: hashlib.sha256(text.encode()).hexdigest(),
        _HEADER_META: text,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda fh: _write_safetensors(fh, tensors, header))
    return metadata


def _read_shard_metadata(path: Path) -> Dict[str, Any]:
    """The description stored in a :func:`save_shard` file's header (checked against its hash)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise ValueError(f"shard {path} does not exist")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            header = fh.metadata() or {}
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"shard {path} cannot be read as safetensors ({err}); the file is truncated or corrupt") from None
    text = header.get(_HEADER_META)
    if not isinstance(text, str) or hashlib.sha256(text.encode()).hexdigest() != header.get(_HEADER_KEY):
        raise ValueError(f"shard {path} has no valid torch_armor description in its header; write it with save_shard")
    metadata = json.loads(text)
    if metadata.get("format") != FORMAT_NAME or metadata.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"shard {path} is format {metadata.get('format')!r} version {metadata.get('format_version')!r}; "
            f"this torch_armor assembles {FORMAT_NAME!r} version {FORMAT_VERSION}"
        )
    return metadata


def _move(src: Path, dst: Path) -> None:
    """``os.replace``, or copy (atomically) + remove when ``src`` is on another file system."""
    if src.resolve() == dst.resolve():
        return
    try:
        os.replace(src, dst)
    except OSError as err:
        if err.errno != errno.EXDEV:
            raise
        with open(src, "rb") as fin:
            atomic_write(dst, lambda fout: shutil.copyfileobj(fin, fout, 1 << 24))
        os.remove(src)


def assemble_checkpoint(
    directory: Union[str, os.PathLike],
    shards: Sequence[Union[str, os.PathLike]],
    *,
    hf_config: Any = None,
    model_class: Optional[str] = None,
    buffers: Optional[Dict[str, str]] = None,
) -> None:
    """Turn files written by :func:`save_shard` into a checkpoint :func:`load_pretrained` reads
    (and, with ``hf_config``, ``AutoModelForCausalLM.from_pretrained`` too).

    The shards are moved (``os.replace``; copy + remove across file systems) into ``directory``
    as ``model-00001-of-0000N.safetensors`` … in the given order (a single shard becomes
    ``model.safetensors``); their descriptions are merged; ``hf_config`` (a transformers config
    or a dict) is written as ``config.json`` with the ARMOR ``quantization_config`` (``buffers``:
    dtypes of non-persistent buffers to restore on load), plus ``model.safetensors.index.json``
    for several files; ``armor_config.json`` (every file with its sha256,
    the merged description, ``model_class``) is written atomically LAST. An earlier
    ``armor_config.json`` and stale weights files in ``directory`` are removed first, so an
    interrupted assembly leaves a directory that does not load.

    Raises:
        ValueError: no shards, a shard missing or not written by :func:`save_shard`, a key in
            two shards, or a shard that would overwrite another one's destination.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     parts = [os.path.join(d, f"part{i}.safetensors") for i in range(2)]
        ...     _ = save_shard(parts[0], nn.Linear(4, 4), prefix="0.")
        ...     _ = save_shard(parts[1], nn.Linear(4, 2), prefix="1.")
        ...     assemble_checkpoint(os.path.join(d, "ckpt"), parts)
        ...     sorted(os.listdir(os.path.join(d, "ckpt")))
        ['armor_config.json', 'model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    if isinstance(shards, (str, bytes, os.PathLike)) or not shards:
        raise ValueError("shards must be a non-empty sequence of paths written by save_shard")
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    sources = [Path(s) for s in shards]
    total = len(sources)
    dests = [path / (WEIGHTS_NAME if total == 1 else SHARD_NAME.format(i + 1, total)) for i in range(total)]

    # 1. read and merge every description before anything is moved
    merged: Dict[str, Any] = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION,
                              "layers": {}, "aliases": {}, "tensors": {}}
    owner: Dict[Tuple[str, str], Path] = {}
    for src in sources:
        meta = _read_shard_metadata(src)
        for section in ("layers", "aliases", "tensors"):
            for key, value in meta[section].items():
                if (section, key) in owner:
                    raise ValueError(f"key {key!r} is in both shard {owner[section, key]} and shard {src}; "
                                     "shard prefixes must not overlap")
                owner[section, key] = src
                merged[section][key] = value
    src_resolved = [s.resolve() for s in sources]
    if len(set(src_resolved)) != total:
        raise ValueError("the same shard file is listed twice")
    dest_resolved = {d.resolve(): i for i, d in enumerate(dests)}
    for i, s in enumerate(src_resolved):
        if dest_resolved.get(s, i) != i:
            raise ValueError(f"shard {sources[i]} would be overwritten by another shard's destination; write shards elsewhere")

    # 2. from here until armor_config.json is written the directory is not a checkpoint
    path.mkdir(parents=True, exist_ok=True)
    (path / ARMOR_CONFIG_NAME).unlink(missing_ok=True)
    for old in path.iterdir():
        if (old.name == WEIGHTS_NAME or _SHARD_RE.fullmatch(old.name)) and old.resolve() not in dest_resolved \
                and old.resolve() not in src_resolved:
            old.unlink()
    fsync_dir(path)
    for src, dst in zip(sources, dests):
        _move(src, dst)
    fsync_dir(path)
    files = [{"file": d.name, "sha256": file_sha256(d)} for d in dests]
    (path / HF_INDEX_NAME).unlink(missing_ok=True)
    if hf_config is not None:
        from torch_armor.hf import write_hf_config, write_hf_index

        write_hf_config(path, hf_config, merged["layers"], buffers)
        if total > 1:
            write_hf_index(path, dests, {k: v for (sec, k), v in owner.items() if sec == "tensors"}, sources)
    config = dict(merged)
    if total == 1:  # exactly the single-file layout older torch_armor versions read
        config["weights_file"], config["weights_sha256"] = files[0]["file"], files[0]["sha256"]
    else:
        config["weights_files"] = files
    if model_class is not None:
        config["model_class"] = model_class
    text = json.dumps(config, indent=2, sort_keys=True)
    atomic_write(path / ARMOR_CONFIG_NAME, text.encode())


# ----------------------------------------------------------------------- save / load


def save_pretrained(model: nn.Module, directory: Union[str, os.PathLike]) -> None:
    """Write ``model`` to ``directory`` as ``model.safetensors`` + ``armor_config.json`` (+ ``config.json``).

    ArmorTensor cores are stored in compact N:M form (about half the dense core bytes for 2:4).
    Only safetensors is written; nothing is pickled. Same as :func:`save_shard` of the whole
    model followed by :func:`assemble_checkpoint`.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_pretrained(nn.Linear(4, 2), d)
        ...     sorted(os.listdir(d))
        ['armor_config.json', 'model.safetensors']
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"save_pretrained expects an nn.Module, got {type(model).__name__}")
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    if path.is_dir():
        _refuse_stale_pickles(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = getattr(model, "config", None)
    buffers = None
    if hf_config is not None and hasattr(hf_config, "save_pretrained"):
        import copy

        from torch_armor.hf import _nonpersistent_buffer_dtypes

        hf_config = copy.deepcopy(hf_config)
        if not getattr(hf_config, "architectures", None):
            hf_config.architectures = [type(model).__name__]
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        if dtype is not None:  # from_pretrained builds the model in this dtype
            hf_config.dtype = str(dtype).removeprefix("torch.")
        buffers = _nonpersistent_buffer_dtypes(model)
    else:
        hf_config = None
    shard = path / f".{WEIGHTS_NAME}.{os.getpid()}.shard"
    try:
        save_shard(shard, model)
        assemble_checkpoint(path, [shard], hf_config=hf_config, buffers=buffers,
                            model_class=f"{type(model).__module__}.{type(model).__qualname__}")
    finally:
        shard.unlink(missing_ok=True)


def _weights_files(config: Dict[str, Any], cfg_path: Path) -> List[Tuple[str, str]]:
    """``[(file name, sha256)]`` from ``armor_config.json`` (``weights_files``, or the single-file fields)."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{cfg_path}: {what}; the file was edited or is corrupt (re-save with save_pretrained)")

    listed = config.get("weights_files")
    if listed is None:  # written before sharding existed
        sha = config.get("weights_sha256")
        if not isinstance(sha, str):
            raise ValueError(f"{cfg_path} has no 'weights_sha256'; re-save with save_pretrained")
        files = [(config.get("weights_file", WEIGHTS_NAME), sha)]
    else:
        if not (isinstance(listed, list) and listed and all(
                isinstance(f, dict) and isinstance(f.get("file"), str) and isinstance(f.get("sha256"), str)
                for f in listed)):
            raise bad("malformed 'weights_files'")
        if "weights_sha256" in config or "weights_file" in config:
            raise bad("both 'weights_files' and 'weights_file'/'weights_sha256'")
        files = [(f["file"], f["sha256"]) for f in listed]
    for name, _ in files:
        if not isinstance(name, str) or Path(name).name != name or name.startswith(".") \
                or not name.endswith(".safetensors"):
            raise bad(f"weights file name {name!r} is not a plain .safetensors file name")
    if len({name for name, _ in files}) != len(files):
        raise bad("a weights file is listed twice")
    return files


def _shard_part(metadata: Dict[str, Any], keys: set) -> Dict[str, Any]:
    """The part of the merged description that belongs to the file holding ``keys`` (what its header hashes)."""
    return {
        "format": metadata["format"],
        "format_version": metadata["format_version"],
        "layers": {fqn: v for fqn, v in metadata["layers"].items() if fqn in keys or f"{fqn}.a_blocks" in keys},
        "aliases": {k: v for k, v in metadata["aliases"].items() if v in keys},
        "tensors": {k: v for k, v in metadata["tensors"].items() if k in keys},
    }


def _refuse_stale_pickles(path: Path) -> None:
    """Saving beside pickle weights would write a directory the loader refuses: say so first."""
    found = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix.lower() in _PICKLE_SUFFIXES)
    if found:
        raise ValueError(f"{path} holds pickle weights {found}: a checkpoint saved beside them could not be "
                         "loaded (pickles are refused); remove them or save to another directory")


def _refuse_pickles(path: Path) -> None:
    found = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix.lower() in _PICKLE_SUFFIXES)
    if found:
        raise ValueError(
            f"{path} contains pickle-based file(s) {found}: torch_armor loads safetensors only, because "
            "unpickling can run arbitrary code. Remove them, or re-save the model with "
            "torch_armor.save_pretrained"
        )


def _build_model(spec: Any, path: Path, config: Dict[str, Any]) -> nn.Module:
    if isinstance(spec, nn.Module):
        return spec
    if spec is None:
        if not (path / "config.json").exists():
            raise ValueError(
                f"{path} has no config.json: pass the model (an nn.Module of the saved architecture), "
                "a transformers config, or a callable that builds the model"
            )
        import transformers

        spec = transformers.AutoConfig.from_pretrained(str(path))
    try:
        from transformers import PretrainedConfig
    except ImportError:  # transformers is optional
        PretrainedConfig = ()  # type: ignore[assignment]
    if PretrainedConfig and isinstance(spec, PretrainedConfig):
        import transformers

        archs = getattr(spec, "architectures", None) or []
        cls = getattr(transformers, archs[0], None) if archs else None
        model = cls(spec) if cls is not None else transformers.AutoModelForCausalLM.from_config(spec)
        return model.eval()
    if callable(spec):
        model = spec()
        if not isinstance(model, nn.Module):
            raise ValueError(f"the model factory returned {type(model).__name__}, expected an nn.Module")
        return model
    raise ValueError(
        f"model_or_config must be an nn.Module, a transformers config, a callable returning a module, "
        f"or None (use config.json); got {type(spec).__name__}"
    )


def load_pretrained(
    directory: Union[str, os.PathLike],
    model_or_config: Union[nn.Module, Callable[[], nn.Module], Any, None] = None,
    *,
    device: Optional[Union[str, torch.device]] = None,
    storage: Optional[str] = None,
    strict: bool = True,
) -> nn.Module:
    """Load a directory written by :func:`save_pretrained` or :func:`assemble_checkpoint`; outputs are bit-identical.

    Args:
        directory: the saved directory.
        model_or_config: an ``nn.Module`` of the saved architecture (filled in place), a
            transformers config, a zero-argument callable building the module, or ``None``
            (build from the directory's ``config.json``).
        device: move the model there before re-storing the cores (e.g. ``"cuda"`` so 2:4
            layers saved as semi-structured become semi-structured again).
        storage: re-store every core as this (``"compact"``, ``"dense"``, ``"semi_structured"``,
            ``"auto"``); default: as saved. Quantized cores stay quantized.
        strict: error on state-dict keys missing from the file or not in the model.

    Raises:
        ValueError: pickle files in the directory, missing files (naming the missing shard), a
            truncated or modified weights file (sha256 mismatch or unreadable), an edited
            ``armor_config.json`` (hash or shape/dtype mismatch), or an architecture mismatch.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     save_pretrained(nn.Linear(4, 2), d)
        ...     load_pretrained(d, lambda: nn.Linear(4, 2)).weight.shape
        torch.Size([2, 4])
    """
    from safetensors import SafetensorError, safe_open

    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory written by torch_armor.save_pretrained")
    _refuse_pickles(path)
    cfg_path = path / ARMOR_CONFIG_NAME
    hf_quantized = model_or_config is None and has_armor_quantization_config(path)
    if not cfg_path.exists():
        if hf_quantized:  # written by model.save_pretrained: transformers loads it
            from torch_armor.hf import from_pretrained

            return from_pretrained(path, device, storage)
        raise ValueError(f"{path} has no {ARMOR_CONFIG_NAME}: not a torch_armor checkpoint (save with save_pretrained)")
    try:
        with open(cfg_path) as fh:
            config = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{cfg_path} is not valid JSON ({err}); the file is truncated or was edited") from None
    if not isinstance(config, dict):
        raise ValueError(f"{cfg_path} must hold a JSON object")
    files = _weights_files(config, cfg_path)
    metadata = {k: config.get(k) for k in ("format", "format_version", "layers", "aliases", "tensors")}
    for section in ("layers", "aliases", "tensors"):
        if not isinstance(metadata[section], dict):
            raise ValueError(f"{cfg_path}: missing or malformed '{section}' section (edited or corrupt?)")
    tensors: Dict[str, torch.Tensor] = {}
    for name, expected_hash in files:
        weights = path / name
        if not weights.is_file():
            raise ValueError(
                f"{path} has no {name} (listed in {ARMOR_CONFIG_NAME}): the checkpoint is incomplete; "
                "copy the missing file or re-save the model"
            )
        actual_hash = file_sha256(weights)
        if actual_hash != expected_hash:
            raise ValueError(
                f"{weights} does not match the sha256 recorded in {ARMOR_CONFIG_NAME} "
                f"(expected {expected_hash[:12]}…, got {actual_hash[:12]}…): the file is truncated, corrupt "
                "or was modified. Copy it again or re-save the model"
            )
        try:
            with safe_open(str(weights), framework="pt", device="cpu") as fh:
                header = fh.metadata() or {}
                part = {key: (None if hf_quantized else fh.get_tensor(key)) for key in sorted(fh.keys())}
        except (SafetensorError, OSError, RuntimeError, ValueError) as err:
            raise ValueError(f"{weights} cannot be read as safetensors ({err}); the file is truncated or corrupt") from None
        keys = set(part)
        if keys & tensors.keys():
            raise ValueError(f"{weights} repeats tensor(s) {sorted(keys & tensors.keys())[:5]} of another weights file")
        tensors.update(part)
        if header.get(_HEADER_KEY) != _canonical_sha256(_shard_part(metadata, keys)):
            raise ValueError(
                f"{ARMOR_CONFIG_NAME} does not match {name} (its layer/tensor description was edited "
                "after saving); restore the original file or re-save the model"
            )
    if hf_quantized:  # verified; transformers builds it on meta and loads the parts (no dense weight)
        from torch_armor.hf import from_pretrained

        return from_pretrained(path, device, storage)
    model = _build_model(model_or_config, path, config)
    model = unflatten_armor_state(model, tensors, metadata, strict=strict, storage=storage, device=device)
    from torch_armor.hf import attach_quantizer

    return attach_quantizer(model)


def has_armor_quantization_config(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path/config.json`` has ``quantization_config.quant_method == "armor"``."""
    try:
        with open(Path(path) / "config.json") as fh:
            quant = json.load(fh).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(quant, dict) and quant.get("quant_method") == "armor"
