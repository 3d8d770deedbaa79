"""Save and load ARMOR-converted models with safetensors (no pickle anywhere), whole or shard by shard.

A saved directory holds:

* the weights: ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` … when the
  checkpoint was written in pieces. Each file holds the flattened state of its part of the model
  (:func:`~torch_armor.format.armor_format.flatten_armor_state`: plain tensors under their usual keys,
  every ArmorTensor as ``a_blocks``, ``b_blocks`` and a compact N:M core) and, in its safetensors
  header, its own part of the layer/tensor description plus that part's sha256, so every file is
  self-describing and bound to ``armor_config.json``.
* ``armor_config.json``: format version, the merged per-layer/per-tensor description, every
  weights file with its sha256 (``weights_files``; a single-file checkpoint keeps the
  ``weights_file``/``weights_sha256`` fields of format version 1, so older readers load it),
  and the model class.
* ``config.json`` when the model has a Hugging Face ``config``.

:func:`~torch_armor.format.safetensors_io.save_shard` writes one piece (e.g. one decoder block, then freed) atomically;
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

import copy
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import transformers
from safetensors import SafetensorError, safe_open
from torch import nn

from torch_armor._io import atomic_write, file_sha256, fsync_dir, stop_here_for_tests
from torch_armor.errors import ArmorInputError
from torch_armor.format.armor_format import (ARMOR_CONFIG_NAME, FORMAT_NAME, FORMAT_VERSION, canonical_sha256,
                                             flatten_armor_state, unflatten_armor_state)
from torch_armor.format.hf import (HF_INDEX_NAME, attach_quantizer, has_armor_quantization_config, load_hf_quantized,
                                   mark_incomplete, nonpersistent_buffer_dtypes, write_hf_config, write_hf_index)
from torch_armor.format.safetensors_io import HEADER_KEY, read_shard_metadata, save_shard

__all__ = [
    "WEIGHTS_NAME",
    "ARMOR_CONFIG_NAME",
    "FORMAT_VERSION",
    "PICKLE_SUFFIXES",
    "flatten_armor_state",
    "unflatten_armor_state",
    "save_shard",
    "assemble_checkpoint",
    "save_pretrained",
    "load_pretrained",
    "has_armor_quantization_config",
]

WEIGHTS_NAME = "model.safetensors"
SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
#: Weight files that unpickle (and can run code): refused beside a checkpoint.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


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
    ``armor_config.json`` and stale weights files in ``directory`` are removed first, and with
    ``hf_config`` a ``config.json`` saying the directory is half-written stands until the new one
    is written, so an interrupted assembly leaves a directory that neither this loader nor
    transformers' ``from_pretrained`` loads.

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
        raise ArmorInputError("shards must be a non-empty sequence of paths written by save_shard")
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ArmorInputError(f"{path} exists and is not a directory")
    sources = [Path(s) for s in shards]
    total = len(sources)
    dests = [path / (WEIGHTS_NAME if total == 1 else SHARD_NAME.format(i + 1, total)) for i in range(total)]

    # 1. read and merge every description before anything is moved
    merged: Dict[str, Any] = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION,
                              "layers": {}, "aliases": {}, "tensors": {}}
    owner: Dict[Tuple[str, str], Path] = {}
    for src in sources:
        meta = read_shard_metadata(src)
        for section in ("layers", "aliases", "tensors"):
            for key, value in meta[section].items():
                if (section, key) in owner:
                    raise ArmorInputError(f"key {key!r} is in both shard {owner[section, key]} and shard {src}; "
                                     "shard prefixes must not overlap")
                owner[section, key] = src
                merged[section][key] = value
    src_resolved = [s.resolve() for s in sources]
    if len(set(src_resolved)) != total:
        raise ArmorInputError("the same shard file is listed twice")
    dest_resolved = {d.resolve(): i for i, d in enumerate(dests)}
    for i, s in enumerate(src_resolved):
        if dest_resolved.get(s, i) != i:
            raise ArmorInputError(f"shard {sources[i]} would be overwritten by another shard's destination; write shards elsewhere")

    # 2. from here until armor_config.json is written the directory is not a checkpoint, and until the new
    #    config.json is written, the one there says it is half-written (transformers reads config.json alone)
    path.mkdir(parents=True, exist_ok=True)
    (path / ARMOR_CONFIG_NAME).unlink(missing_ok=True)
    if hf_config is not None:
        mark_incomplete(path, hf_config)
    for old in path.iterdir():
        if (old.name == WEIGHTS_NAME or _SHARD_RE.fullmatch(old.name)) and old.resolve() not in dest_resolved \
                and old.resolve() not in src_resolved:
            old.unlink()
    fsync_dir(path)
    for i, (src, dst) in enumerate(zip(sources, dests)):
        _move(src, dst)
        if i == 0:
            stop_here_for_tests("first-shard-moved")
    fsync_dir(path)
    files = [{"file": d.name, "sha256": file_sha256(d)} for d in dests]
    (path / HF_INDEX_NAME).unlink(missing_ok=True)
    if hf_config is not None:
        if total > 1:
            write_hf_index(path, dests, {k: v for (sec, k), v in owner.items() if sec == "tensors"}, sources)
        write_hf_config(path, hf_config, merged["layers"], buffers)
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
    """Write ``model`` to ``directory`` as ``model.safetensors`` + ``armor_config.json`` (+ ``config.json``):
    torch_armor's one way to save.

    A model with a transformers ``config`` is written in the Hugging Face format (``config.json``
    with the ARMOR ``quantization_config``), which ``AutoModelForCausalLM.from_pretrained`` reads
    after ``import torch_armor``; ``armor_config.json`` adds the sha256 of every file, which
    :func:`load_pretrained` checks. ArmorTensor cores are stored in compact N:M form (about half the dense core bytes for 2:4).
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
        raise ArmorInputError(f"save_pretrained expects an nn.Module, got {type(model).__name__}")
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ArmorInputError(f"{path} exists and is not a directory")
    if path.is_dir():
        _refuse_stale_pickles(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = getattr(model, "config", None)
    buffers = None
    if hf_config is not None and hasattr(hf_config, "save_pretrained"):
        hf_config = copy.deepcopy(hf_config)
        if not getattr(hf_config, "architectures", None):
            hf_config.architectures = [type(model).__name__]
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        if dtype is not None:  # from_pretrained builds the model in this dtype
            hf_config.dtype = str(dtype).removeprefix("torch.")
        buffers = nonpersistent_buffer_dtypes(model)
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
    def bad(what: str) -> ArmorInputError:
        return ArmorInputError(f"{cfg_path}: {what}; the file was edited or is corrupt (re-save with save_pretrained)")

    listed = config.get("weights_files")
    if listed is None:  # written before sharding existed
        sha = config.get("weights_sha256")
        if not isinstance(sha, str):
            raise ArmorInputError(f"{cfg_path} has no 'weights_sha256'; re-save with save_pretrained")
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
    found = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES)
    if found:
        raise ArmorInputError(f"{path} holds pickle weights {found}: a checkpoint saved beside them could not be "
                         "loaded (pickles are refused); remove them or save to another directory")


def _refuse_pickles(path: Path) -> None:
    found = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES)
    if found:
        raise ArmorInputError(
            f"{path} contains pickle-based file(s) {found}: torch_armor loads safetensors only, because "
            "unpickling can run arbitrary code. Remove them, or re-save the model with "
            "torch_armor.save_pretrained"
        )


def _build_model(spec: Any, path: Path, config: Dict[str, Any]) -> nn.Module:
    if isinstance(spec, nn.Module):
        return spec
    if spec is None:
        if not (path / "config.json").exists():
            raise ArmorInputError(
                f"{path} has no config.json: pass the model (an nn.Module of the saved architecture), "
                "a transformers config, or a callable that builds the model"
            )
        spec = transformers.AutoConfig.from_pretrained(str(path))
    if isinstance(spec, transformers.PretrainedConfig):
        archs = getattr(spec, "architectures", None) or []
        cls = getattr(transformers, archs[0], None) if archs else None
        model = cls(spec) if cls is not None else transformers.AutoModelForCausalLM.from_config(spec)
        return model.eval()
    if callable(spec):
        model = spec()
        if not isinstance(model, nn.Module):
            raise ArmorInputError(f"the model factory returned {type(model).__name__}, expected an nn.Module")
        return model
    raise ArmorInputError(
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
    """Load a directory written by :func:`save_pretrained` or :func:`assemble_checkpoint` (or by transformers'
    ``model.save_pretrained`` of a converted model): torch_armor's one way to load; outputs are bit-identical.

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
    path = Path(directory)
    if not path.is_dir():
        raise ArmorInputError(f"{path} is not a directory written by torch_armor.save_pretrained")
    _refuse_pickles(path)
    cfg_path = path / ARMOR_CONFIG_NAME
    hf_quantized = model_or_config is None and has_armor_quantization_config(path)
    if not cfg_path.exists():
        if hf_quantized:  # written by model.save_pretrained: transformers loads it
            return load_hf_quantized(path, device, storage)
        raise ArmorInputError(f"{path} has no {ARMOR_CONFIG_NAME}: not a torch_armor checkpoint (save with save_pretrained)")
    try:
        with open(cfg_path) as fh:
            config = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArmorInputError(f"{cfg_path} is not valid JSON ({err}); the file is truncated or was edited") from None
    if not isinstance(config, dict):
        raise ArmorInputError(f"{cfg_path} must hold a JSON object")
    files = _weights_files(config, cfg_path)
    metadata = {k: config.get(k) for k in ("format", "format_version", "layers", "aliases", "tensors")}
    for section in ("layers", "aliases", "tensors"):
        if not isinstance(metadata[section], dict):
            raise ArmorInputError(f"{cfg_path}: missing or malformed '{section}' section (edited or corrupt?)")
    tensors: Dict[str, torch.Tensor] = {}
    for name, expected_hash in files:
        weights = path / name
        if not weights.is_file():
            raise ArmorInputError(
                f"{path} has no {name} (listed in {ARMOR_CONFIG_NAME}): the checkpoint is incomplete; "
                "copy the missing file or re-save the model"
            )
        actual_hash = file_sha256(weights)
        if actual_hash != expected_hash:
            raise ArmorInputError(
                f"{weights} does not match the sha256 recorded in {ARMOR_CONFIG_NAME} "
                f"(expected {expected_hash[:12]}…, got {actual_hash[:12]}…): the file is truncated, corrupt "
                "or was modified. Copy it again or re-save the model"
            )
        try:
            with safe_open(str(weights), framework="pt", device="cpu") as fh:
                header = fh.metadata() or {}
                part = {key: (None if hf_quantized else fh.get_tensor(key)) for key in sorted(fh.keys())}
        except (SafetensorError, OSError, RuntimeError, ValueError) as err:
            raise ArmorInputError(f"{weights} cannot be read as safetensors ({err}); the file is truncated or corrupt") from None
        keys = set(part)
        if keys & tensors.keys():
            raise ArmorInputError(f"{weights} repeats tensor(s) {sorted(keys & tensors.keys())[:5]} of another weights file")
        tensors.update(part)
        if header.get(HEADER_KEY) != canonical_sha256(_shard_part(metadata, keys)):
            raise ArmorInputError(
                f"{ARMOR_CONFIG_NAME} does not match {name} (its layer/tensor description was edited "
                "after saving); restore the original file or re-save the model"
            )
    if hf_quantized:  # verified; transformers builds it on meta and loads the parts (no dense weight)
        return load_hf_quantized(path, device, storage)
    model = _build_model(model_or_config, path, config)
    model = unflatten_armor_state(model, tensors, metadata, strict=strict, storage=storage, device=device)
    return attach_quantizer(model)
