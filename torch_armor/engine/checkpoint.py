"""Stream a local Hugging Face checkpoint one submodule at a time.

:class:`LazyCheckpoint` builds the causal LM on the ``meta`` device (no memory for weights) and
reads tensors from the ``*.safetensors`` files only when a submodule is materialized, one tensor at
a time (file names and keys come from :func:`safetensors.safe_open`; tensor bytes are read with a
plain ``readinto`` at the header's offsets, not through a memory map, whose touched pages would
count in the process's RSS a second time), so the peak memory of materializing a decoder block is
about that block's size. Materialized tensors are ordinary memory, independent of the files. :meth:`LazyCheckpoint.release` puts a submodule back on ``meta``.

Typical use (one decoder block resident at a time)::

    ckpt = LazyCheckpoint("./Llama-3.2-1B", dtype=torch.bfloat16)
    ckpt.materialize_non_decoder()            # embeddings + rotary inv_freq
    prefix, layers = ckpt.decoder_layers()    # ("model.layers", ModuleList)
    for i in range(len(layers)):
        block = ckpt.materialize(f"{prefix}.{i}")
        ...                                   # run / prune the block
        ckpt.release(f"{prefix}.{i}")
    for p in ckpt.post_decoder_prefixes():    # ["model.norm", "lm_head"]
        ckpt.materialize(p)

Only checkpoints whose tensor names equal the model's ``state_dict`` names are supported (the case
for Llama-family checkpoints written by ``save_pretrained``); anything else fails at construction
with the first unmatched key.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import re
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from torch_armor.calibration.blocks import decoder_blocks
from torch_armor.errors import ArmorInputError
from torch_armor.format.file_checks import check_weight_files

__all__ = ["LazyCheckpoint"]

INDEX_NAME = "model.safetensors.index.json"
logger = logging.getLogger("torch_armor")
_CHUNK = 16 << 20


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _header(path: Path) -> tuple:
    """(data start offset, {key: entry}) of a safetensors file: 8-byte length, JSON, data."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def _read_tensor(path: Path, start: int, entry: dict) -> Optional[torch.Tensor]:
    """Read one tensor with a plain ``readinto`` (no mmap: only the tensor's own bytes become
    resident); ``None`` for dtypes not in ``_DTYPES`` (the caller falls back to safe_open)."""
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
        return None
    t = torch.empty(entry["shape"], dtype=dtype)
    a, b = entry["data_offsets"]
    if t.numel():
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        with open(path, "rb") as f:
            f.seek(start + a)
            if f.readinto(view) != b - a:
                raise ArmorInputError(f"{path} is truncated: tensor data ends before byte {start + b}; re-save the checkpoint")
    return t


def _stacked_shape(experts: list) -> Optional[list]:
    """``[E, out, in]`` of per-expert 2-D parts concatenated by rows, then stacked; ``None`` if they do not fit."""
    if any(len(shape) != 2 for parts in experts for shape in parts):
        return None
    per_expert = [[sum(shape[0] for shape in parts), *sorted({shape[1] for shape in parts})] for parts in experts]
    return [len(experts), *per_expert[0]] if all(e == per_expert[0] for e in per_expert) else None


class LazyCheckpoint:
    """A local HF causal-LM checkpoint whose model lives on ``meta`` until asked for.

    ``directory`` holds ``config.json`` and ``model.safetensors`` (or shards listed in
    ``model.safetensors.index.json``). ``dtype``: cast floating tensors to it on load (default:
    each tensor keeps the checkpoint's dtype). ``device``: where materialized tensors go.
    """

    def __init__(self, directory, dtype: Optional[torch.dtype] = None, device="cpu"):
        self.directory = Path(directory)
        self.dtype = dtype
        self.device = torch.device(device)
        d = self.directory
        if not d.is_dir():
            raise ArmorInputError(f"checkpoint directory {d} does not exist; pass a local folder with config.json and *.safetensors")
        if not (d / "config.json").is_file():
            raise ArmorInputError(f"{d / 'config.json'} is missing; the checkpoint folder needs the model's config.json")
        # plain shard names inside d, every header checked, before safetensors opens one
        self._shapes = {k: e["shape"] for header in check_weight_files(d).values() for k, e in header.items()}
        self._files = self._find_files(d)  # file name -> list of keys
        self._where: dict[str, str] = {}
        index = d / INDEX_NAME
        weight_map = None
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ArmorInputError(f"{index} has no 'weight_map' object; re-save the checkpoint with save_pretrained")
            for k, name in weight_map.items():
                if not (d / name).is_file():
                    raise ArmorInputError(f"{index} names shard {name!r} (for {k!r}) but {d / name} is missing; restore the shard or re-save the checkpoint")
        for name in self._files:
            with safe_open(str(d / name), framework="pt") as f:
                keys = list(f.keys())
            self._files[name] = keys
            for k in keys:
                self._where.setdefault(k, name)
        if weight_map is not None:
            for k, name in weight_map.items():
                if k not in self._files[name]:
                    raise ArmorInputError(f"{index} says tensor {k!r} is in {name} but that file has no such tensor; re-save the checkpoint")
            self._where = dict(weight_map)

        self.config = AutoConfig.from_pretrained(str(d))
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(self.config)
        self.model.eval()
        self._hash: Optional[str] = None
        self._headers: dict = {}
        self._map_names()

    # ----------------------------------------------------------------- discovery
    @staticmethod
    def _find_files(d: Path) -> dict:
        index = d / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text()).get("weight_map") or {}
            except json.JSONDecodeError as e:
                raise ArmorInputError(f"{index} is not valid JSON ({e}); re-save the checkpoint") from None
            return {name: [] for name in sorted(set(weight_map.values()))}
        files = sorted(p.name for p in d.glob("*.safetensors"))
        if files:
            return {name: [] for name in files}
        if any(d.glob("*.bin")) or any(d.glob("*.pt")) or any(d.glob("*.pth")):
            raise ArmorInputError(
                f"{d} holds only PyTorch .bin/.pt weights; only safetensors can be streamed: convert with "
                "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
            )
        raise ArmorInputError(f"{d} has no *.safetensors files; save the model with save_pretrained (safetensors)")

    def _map_names(self) -> None:
        """Map every state-dict name to its module slot(s) and to the checkpoint key holding it."""
        self._slots: dict[str, list] = {}  # state name -> [(module, attr, is_param)]
        by_id: dict[int, list] = {}
        for mod_name, mod in self.model.named_modules(remove_duplicate=False):
            for attr, p in mod._parameters.items():
                if p is None:
                    continue
                name = f"{mod_name}.{attr}" if mod_name else attr
                self._slots.setdefault(name, []).append((mod, attr, True))
                by_id.setdefault(id(p), []).append(name)
            for attr, b in mod._buffers.items():
                if b is None or attr in mod._non_persistent_buffers_set:
                    continue
                name = f"{mod_name}.{attr}" if mod_name else attr
                self._slots.setdefault(name, []).append((mod, attr, False))
        # tied parameters: every alias's slots, and a source key taken from any alias in the files
        self._source: dict[str, str] = {}
        self._aliases: dict[str, list] = {}
        for names in by_id.values():
            present = [n for n in names if n in self._where]
            for n in names:
                self._aliases[n] = names
                if present:
                    self._source[n] = n if n in self._where else present[0]
        for n in self._slots:
            if n not in self._source and n in self._where:
                self._source[n] = n
        self._fused = self._per_expert_keys()
        consumed = {k for parts in self._fused.values() for keys in parts for k in keys}
        self._drop_ignored({k for k in self._where if k not in self._slots and k not in consumed})
        for k, name in self._where.items():
            if k not in self._slots and k not in consumed:
                raise ArmorInputError(
                    f"checkpoint tensor {k!r} (in {self.directory / name}) matches no parameter of "
                    f"{type(self.model).__name__}; its keys are renamed on load, which streaming does not "
                    "support: re-save it with save_pretrained from transformers>=5"
                )
        for n in self._slots:
            if n not in self._source and n not in self._fused:
                raise ArmorInputError(
                    f"{type(self.model).__name__} needs tensor {n!r} but no file in {self.directory} "
                    "holds it; the checkpoint is incomplete or for another architecture"
                )
        self._check_shapes()

    def _check_shapes(self) -> None:
        """Every stored tensor has the shape ``config.json`` gives its parameter (before any block runs)."""
        for n, slots in self._slots.items():
            mod, attr, is_param = slots[0]
            want = list((mod._parameters if is_param else mod._buffers)[attr].shape)
            if n in self._fused:
                key = self._fused[n][0][0]
                got = _stacked_shape([[self._shapes[k] for k in keys] for keys in self._fused[n]])
            else:
                key = self._source[n]
                got = list(self._shapes[key])
            if got != want:
                stored = f"{tuple(got)}" if got is not None else "per-expert shapes that do not stack"
                target = "it" if key == n else repr(n)
                raise ArmorInputError(
                    f"checkpoint tensor {key!r} (in {self.directory / self._where[key]}) is stored as {stored}, but "
                    f"{self.directory / 'config.json'} makes {target} {tuple(want)} in {type(self.model).__name__}; "
                    "the weights do not match their config.json: fix config.json or re-save the checkpoint")

    def _drop_ignored(self, unmatched: set) -> None:
        """Forget the checkpoint tensors that transformers' ``from_pretrained`` drops without a word: the
        model's ``_keys_to_ignore_on_load_unexpected`` and the per-layer rotary ``inv_freq`` (and
        ``position_ids``) buffers that older checkpoints stored and models now compute."""
        patterns = set(getattr(self.model, "_keys_to_ignore_on_load_unexpected", None) or ())
        buffers = [name for name, _ in self.model.named_buffers()]
        if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
            patterns.add(r"rotary_emb\.inv_freq")
        if any(name.endswith("position_ids") for name in buffers):
            patterns.add(r"(^|\.)position_ids$")
        ignored = sorted(k for k in unmatched if any(re.search(p, k) for p in patterns))
        if ignored:
            logger.debug(f"{self.directory}: ignoring {len(ignored)} checkpoint tensor(s) that "
                         f"{type(self.model).__name__} does not use, as transformers does: {ignored[:4]}")
        for k in ignored:
            del self._where[k]

    def _per_expert_keys(self) -> dict:
        """Fused 3-D expert parameters stored per expert (``experts.{e}.gate_proj.weight``, the
        layout transformers writes): ``{param name: [[checkpoint keys of expert e], ...]}``; the
        keys of one expert are concatenated along the output rows, the experts stacked."""
        parts_of = {"gate_up_proj": ("gate_proj", "up_proj"), "up_proj": ("up_proj",), "down_proj": ("down_proj",)}
        out = {}
        for n, slots in self._slots.items():
            mod, attr, is_param = slots[0]
            shape = mod._parameters[attr].shape if is_param else None
            if n in self._where or attr not in parts_of or shape is None or len(shape) != 3:
                continue
            owner = n.rsplit(".", 1)[0]
            keys = [[f"{owner}.{e}.{part}.weight" for part in parts_of[attr]] for e in range(shape[0])]
            if all(k in self._where for ks in keys for k in ks):
                out[n] = keys
        return out

    def keys(self) -> list:
        """Checkpoint tensor names, in file order."""
        return list(self._where)

    def nbytes(self, key: str) -> int:
        """Stored size of tensor ``key`` in bytes, from its file's header (no data is read)."""
        if key not in self._where:
            raise ArmorInputError(f"tensor {key!r} is not in the checkpoint at {self.directory}")
        fname = self._where[key]
        if fname not in self._headers:
            self._headers[fname] = _header(self.directory / fname)
        a, b = self._headers[fname][1][key]["data_offsets"]
        return b - a

    def content_hash(self) -> str:
        """sha256 of the safetensors files' bytes (sorted by name) and ``config.json``; cached."""
        if self._hash is None:
            h = hashlib.sha256()
            for name in sorted(self._files) + ["config.json"]:
                with open(self.directory / name, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)
            self._hash = h.hexdigest()
        return self._hash

    def decoder_layers(self) -> tuple:
        """``(name, ModuleList)`` of the decoder blocks, found as the engine finds them
        (:func:`~torch_armor.calibration.blocks.decoder_blocks`)."""
        return decoder_blocks(self.model)

    def post_decoder_prefixes(self) -> list:
        """Top-level prefixes of modules with tensors registered after the decoder blocks."""
        return self._split_outside()[1]

    def _split_outside(self) -> tuple:
        prefix, _ = self.decoder_layers()
        before, after, seen = [], [], False
        for name in self._slots:
            if name.startswith(prefix + "."):
                seen = True
                continue
            owner = name.rsplit(".", 1)[0]
            target = after if seen else before
            if owner not in target:
                target.append(owner)
        return before, after

    # ----------------------------------------------------------------- loading
    def read_tensors(self, keys: Iterable[str]) -> dict:
        """Raw tensors by checkpoint key (checkpoint dtype, CPU, own memory), read one at a time."""
        keys = list(keys)
        by_file: dict[str, list] = {}
        for k in keys:
            if k not in self._where:
                raise ArmorInputError(f"tensor {k!r} is not in the checkpoint at {self.directory}")
            by_file.setdefault(self._where[k], []).append(k)
        out = {}
        for name, ks in by_file.items():
            for k in ks:
                out[k] = self._get(name, k)
        return {k: out[k] for k in keys}

    def _get(self, fname: str, key: str) -> torch.Tensor:
        """One tensor from one file, in its own (not file-mapped) CPU memory."""
        path = self.directory / fname
        if fname not in self._headers:
            self._headers[fname] = _header(path)
        start, header = self._headers[fname]
        if key not in header:
            raise ArmorInputError(f"tensor {key!r} is missing from {path}; re-save the checkpoint")
        t = _read_tensor(path, start, header[key])
        if t is None:  # a dtype torch reads only through safetensors (e.g. float8)
            with safe_open(str(path), framework="pt") as f:
                t = f.get_tensor(key).clone()
        return t

    def _names_under(self, prefix: str) -> list:
        if prefix == "":
            return list(self._slots)
        names = [n for n in self._slots if n.startswith(prefix + ".")]
        try:
            self.model.get_submodule(prefix)
        except AttributeError:
            raise ArmorInputError(f"{type(self.model).__name__} has no submodule {prefix!r}") from None
        return names

    def _set(self, name: str, tensor: torch.Tensor) -> None:
        param = None  # one Parameter shared by all tied aliases, as in the eager model
        for alias in self._aliases.get(name, [name]):
            for mod, attr, is_param in self._slots[alias]:
                if is_param:
                    if param is None:
                        param = nn.Parameter(tensor, requires_grad=mod._parameters[attr].requires_grad)
                    mod._parameters[attr] = param
                else:
                    mod._buffers[attr] = tensor

    def materialize(self, prefix: str) -> nn.Module:
        """Load every tensor of the submodule at ``prefix`` onto ``device``; return the submodule."""
        names = self._names_under(prefix)
        for n in [n for n in names if n in self._fused]:  # per-expert keys -> one (E, out, in) tensor
            t = torch.stack([torch.cat([self._get(self._where[k], k) for k in ks]) for ks in self._fused[n]])
            dtype = self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype
            self._set(n, t.to(device=self.device, dtype=dtype))
            del t
        by_file: dict[str, list] = {}
        for n in names:
            if n in self._fused:
                continue
            key = self._source[n]
            by_file.setdefault(self._where[key], []).append((n, key))
        for fname, pairs in by_file.items():
            for n, key in pairs:
                t = self._get(fname, key)
                dtype = self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype
                self._set(n, t.to(device=self.device, dtype=dtype))
                del t
        module = self.model.get_submodule(prefix)
        self._rebuild_buffers(module)
        return module

    def materialize_non_decoder(self) -> None:
        """Materialize what the forward needs before the first block (embeddings, rotary buffers)."""
        before, _ = self._split_outside()
        for owner in before:
            self.materialize(owner)
        prefix, _ = self.decoder_layers()
        for name, mod in self.model.named_modules():
            if not (name == prefix or name.startswith(prefix + ".")):
                self._rebuild_buffers(mod, recurse=False)

    def release_non_decoder(self) -> None:
        """Undo :meth:`materialize_non_decoder` (the embeddings go back to ``meta``)."""
        for owner in self._split_outside()[0]:
            self.release(owner)

    def _rebuild_buffers(self, module: nn.Module, recurse: bool = True) -> None:
        """Recreate non-persistent meta buffers (e.g. rotary ``inv_freq``) by re-running __init__."""
        mods = module.modules() if recurse else [module]
        for mod in mods:
            stale = [a for a in mod._non_persistent_buffers_set if mod._buffers.get(a) is not None and mod._buffers[a].is_meta]
            if not stale:
                continue
            cls = type(mod)
            params = inspect.signature(cls.__init__).parameters
            try:
                with torch.device("cpu"):
                    if "config" in params:
                        fresh = cls(config=getattr(mod, "config", self.config))
                    else:
                        fresh = cls(getattr(mod, "config", self.config))
            except Exception as e:
                raise ArmorInputError(
                    f"cannot rebuild the non-computed buffers {stale} of {cls.__name__} (not stored in the "
                    f"checkpoint): re-creating it from the config failed ({e})"
                ) from None
            for a in stale:
                mod._buffers[a] = fresh._buffers[a].to(self.device)
            for a, v in vars(fresh).items():  # plain attributes set in __init__ (e.g. attention_scaling)
                if a != "training" and not a.startswith("_") and not isinstance(v, (nn.Module, torch.Tensor)):
                    setattr(mod, a, v)

    def release(self, prefix: str) -> None:
        """Put the submodule at ``prefix`` back on ``meta`` (tied aliases elsewhere follow)."""
        for n in self._names_under(prefix):
            mod, attr, is_param = self._slots[n][0]
            t = mod._parameters[attr] if is_param else mod._buffers[attr]
            if not t.is_meta:  # by shape and dtype: a pruned block may hold ArmorTensor weights
                self._set(n, torch.empty(t.shape, dtype=t.dtype, device="meta"))
        for mod in self.model.get_submodule(prefix).modules():
            for a in mod._non_persistent_buffers_set:
                b = mod._buffers.get(a)
                if b is not None and not b.is_meta:
                    mod._buffers[a] = torch.empty_like(b, device="meta")
