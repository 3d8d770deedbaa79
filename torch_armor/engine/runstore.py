"""Resumable factorization runs: every finished layer goes to disk atomically, with a manifest.

A run directory holds::

    manifest.json                 identity (format, model id, statistics hash, config) and
                                  per-layer status ("pending" / "done" / "failed"), file, sha256,
                                  size, shape, seconds, relative loss
    manifest.rank-<r>.json        (distributed runs only) the entries written by rank r ≥ 1,
                                  merged into manifest.json by rank 0 at the end
    layers/<fqn>.safetensors      one finished layer: its method's tensors (ARMOR: a_blocks, core,
                                  b_blocks, mask, history, history_iters, history_time_s) and the
                                  method's text fields in the header
    hidden.safetensors            (block-by-block engine, ARMOR runs) the calibration hidden
                                  states at the last finished decoder-block boundary: one tensor
                                  per calibration batch, the index of the block they feed and the
                                  run identity in the header; rewritten by rank 0 after every
                                  block, a rerun resumes at that block
    blocks/block-NNNNN.safetensors
                                  (streamed checkpoints only) each finished decoder block, written
                                  by :func:`~torch_armor.format.safetensors_io.save_shard`; at the
                                  end ``blocks/rest.safetensors`` (the weights outside the decoder
                                  blocks) joins them and all are moved into the output checkpoint
                                  by :func:`~torch_armor.format.serialization.assemble_checkpoint`

What a layer file and its manifest entry hold of the layer, the run's method says
(:meth:`~torch_armor.engine.methods.Method.to_store`, :meth:`~torch_armor.engine.methods.Method.from_store`).
The last two are written by :class:`~torch_armor.engine.blocks.BlockPipeline` and
:func:`~torch_armor.engine.prune.prune_model` (which streams a model when given a checkpoint
directory instead of a module); the store itself writes the manifests and ``layers/``.

Every file is written with :func:`torch_armor._io.atomic_write`: to a temporary name in the same
directory, flushed and ``fsync``-ed, renamed over the final name with ``os.replace`` (atomic on
POSIX and Windows) and the directory is ``fsync``-ed, so a crash (even ``SIGKILL`` or a power
cut) leaves either the old or the new file, never a torn one. A layer counts as done only when
its manifest entry says so *and* the file's size and sha256 match the entry; anything else (a
file without an entry, a truncated or edited file) is recomputed, with a warning for the damaged
ones.

Re-running the same command resumes: :func:`~torch_armor.armor.layers.factorize_layers` skips
the layers the store holds. Factorization with the same seed and the same number of threads is
bit-identical on CPU, so a resumed run gives exactly the factors of an uninterrupted one
(another thread count changes the order of floating-point reductions: equally good factors,
different last bits). A directory started with a different config, model id or statistics hash
is refused with :class:`RunMismatchError` naming what differs, never mixed.

Writers: one process per run directory, or the ranks of one distributed run (rank 0 writes
``manifest.json``, rank ``r ≥ 1`` only ``manifest.rank-<r>.json`` and its own layer files; see
:mod:`torch_armor.armor.distributed`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch
from safetensors import safe_open

from torch_armor._io import TMP_MARK, atomic_write, file_sha256
from torch_armor.config.serialized import config_to_dict
from torch_armor.engine.manifest import (FORMAT_NAME, FORMAT_VERSION, LAYERS_DIR, MANIFEST_NAME, SHARD_PREFIX,
                                         STATUS_RANK, config_diff, default_rank, identity_diff, layer_filename,
                                         read_manifest)
from torch_armor.engine.methods import method_for
from torch_armor.errors import ArmorInputError, ArmorIOError, RunMismatchError
from torch_armor.format.safetensors_io import write_safetensors

__all__ = [
    "RunStore",
    "RunMismatchError",
    "MANIFEST_NAME",
]

PathLike = Union[str, "os.PathLike[str]"]


def _deterministic_safetensors(tensors: Mapping[str, Any], metadata: Dict[str, str]) -> bytes:
    """safetensors bytes with a sorted header: the same layer always gives the same file
    (``safetensors.torch.save`` orders metadata by a randomly seeded hash map)."""
    buf = io.BytesIO()
    write_safetensors(buf, dict(tensors), metadata)
    return buf.getvalue()



class RunStore:
    """A run directory: finished layers as safetensors files plus an atomically written manifest.

    Args:
        directory: the run directory (created if missing).
        config: the run's base method config (an :class:`~torch_armor.config.armor.ArmorConfig`); an existing run with another config is
            refused (``device`` excepted: it may change between resumes and is kept per layer).
        model_id: identifies the model (and anything else that must not change, e.g. the
            calibration settings); any string.
        stats_hash: :func:`hash_statistics` of the calibration statistics.
        rank: the writer's rank in a distributed run (``None``: ``torch.distributed``'s rank
            if initialized, else ``$RANK``, else 0). Rank 0 writes ``manifest.json``; rank
            ``r ≥ 1`` writes only ``manifest.rank-<r>.json`` (merged by :meth:`finalize`).

    Raises:
        RunMismatchError: the directory holds a run with another config, model id, statistics
            hash or format; the message names what differs.

    Example::

        >>> import tempfile
        >>> from torch_armor.config.armor import ArmorConfig, BcdConfig
        >>> from torch_armor.core.factorize import factorize
        >>> from torch_armor.engine.identity import hash_statistics
        >>> w, h = torch.randn(16, 32), torch.rand(32) + 0.1
        >>> cfg = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     store = RunStore(d, cfg, model_id="toy", stats_hash=hash_statistics({"fc": h}))
        ...     path = store.save("fc", factorize(w, h, cfg))
        ...     store.done("fc"), path.name, store.load("fc").core.shape
        ...     try:
        ...         RunStore(d, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=5)), "toy", store.stats_hash)
        ...     except RunMismatchError as err:
        ...         print(str(err).splitlines()[1])
        (True, 'fc.safetensors', torch.Size([16, 32]))
          optimizer.iters: run has 2, now 5
    """

    def __init__(
        self,
        directory: PathLike,
        config: Any,
        model_id: str,
        stats_hash: str,
        *,
        rank: Optional[int] = None,
    ) -> None:
        if not isinstance(model_id, str) or not model_id:
            raise ArmorInputError(f"model_id must be a non-empty string naming the model, got {model_id!r}")
        if not isinstance(stats_hash, str) or not stats_hash:
            raise ArmorInputError(
                f"stats_hash must be a non-empty string, e.g. hash_statistics(stats), got {stats_hash!r}"
            )
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ArmorInputError(f"run directory {self.directory} exists and is not a directory")
        self.config = config
        self.config_dict = config_to_dict(config)
        self.model_id = model_id
        self.stats_hash = stats_hash
        self.rank = default_rank() if rank is None else int(rank)
        if self.rank < 0:
            raise ArmorInputError(f"rank must be >= 0, got {rank!r}")
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / LAYERS_DIR).mkdir(exist_ok=True)
        self.created = time.time()
        self._own: Dict[str, Dict[str, Any]] = {}  # entries this writer's manifest file holds
        self._known: Dict[str, Dict[str, Any]] = {}  # every entry seen (all manifest files)
        self._verified: Dict[str, Tuple[int, int, str]] = {}
        self._read_existing()

    # -- identity / reading --------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        """The manifest file this writer writes (``manifest.json`` for rank 0)."""
        name = MANIFEST_NAME if self.rank == 0 else f"{SHARD_PREFIX}{self.rank}.json"
        return self.directory / name

    def _shard_paths(self) -> List[Path]:
        def rank_of(p: Path) -> int:
            try:
                return int(p.name[len(SHARD_PREFIX):-len(".json")])
            except ValueError:
                return -1
        shards = [p for p in self.directory.glob(f"{SHARD_PREFIX}*.json") if rank_of(p) >= 1]
        return sorted(shards, key=rank_of)

    def _check_identity(self, data: Mapping[str, Any], path: Path) -> None:
        problems = []
        if data.get("model_id") != self.model_id:
            problems += identity_diff(data.get("model_id"), self.model_id)
        if data.get("stats_hash") != self.stats_hash:
            problems.append(
                f"  stats_hash: run has {str(data.get('stats_hash'))[:16]}…, now {self.stats_hash[:16]}… "
                "(the calibration statistics differ: other data, windows, seed or model)"
            )
        problems += [f"  {d}" for d in config_diff(data.get("config") or {}, self.config_dict)]
        if problems:
            raise RunMismatchError(
                f"run directory {self.directory} belongs to a different run ({path.name}):\n"
                + "\n".join(problems)
                + "\nResume it with the same model, statistics and settings, use a new run directory, "
                "or delete this one to start over."
            )

    def _read_existing(self) -> None:
        sources = []
        manifest = self.directory / MANIFEST_NAME
        if manifest.exists():
            sources.append(manifest)
        sources += self._shard_paths()
        for path in sources:
            data = read_manifest(path)
            self._check_identity(data, path)
            layers = data.get("layers") or {}
            if not isinstance(layers, dict):
                raise RunMismatchError(f"{path}: 'layers' is not a mapping; the manifest was edited or is corrupt")
            for fqn, entry in layers.items():
                if isinstance(entry, dict):
                    self._merge_entry(fqn, entry)
                    if path == self.manifest_path:
                        self._own[fqn] = entry
            if path == self.manifest_path:
                self.created = float(data.get("created", self.created))
        # what this writer's file will carry: its own entries plus, for rank 0, all finished ones
        if self.rank == 0:
            self._own.update({k: v for k, v in self._known.items() if v.get("status") == "done"})

    def _merge_entry(self, fqn: str, entry: Dict[str, Any]) -> None:
        old = self._known.get(fqn)
        if old is None:
            self._known[fqn] = entry
            return
        # done (the newest write wins) > failed > pending
        rank_old, rank_new = (STATUS_RANK.get(e.get("status"), -1) for e in (old, entry))
        if rank_new > rank_old or (rank_new == rank_old == 2 and entry.get("written_at", 0) >= old.get("written_at", 0)):
            self._known[fqn] = entry

    def _write_manifest(self) -> None:
        data = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "model_id": self.model_id,
            "stats_hash": self.stats_hash,
            "config": self.config_dict,
            "rank": self.rank,
            "created": self.created,
            "updated": time.time(),
            "torch_version": torch.__version__,
            "layers": {k: self._own[k] for k in sorted(self._own)},
        }
        self._write_or_explain(self.manifest_path, json.dumps(data, indent=1, sort_keys=True).encode(), "the manifest")

    def with_rank(self, rank: int) -> "RunStore":
        """The same run directory opened as writer ``rank`` (``self`` if it already is)."""
        if rank == self.rank:
            return self
        return RunStore(self.directory, self.config, self.model_id, self.stats_hash, rank=rank)

    # -- per layer -----------------------------------------------------------------------------
    def layer_path(self, fqn: str) -> Path:
        """Where layer ``fqn`` is (or will be) stored."""
        return self.directory / LAYERS_DIR / layer_filename(fqn)

    def layer_info(self, fqn: str) -> Dict[str, Any]:
        """The manifest entry of a layer (status, file, sha256, shape, seconds, …); ``{}`` if unknown."""
        return dict(self._known.get(fqn, {}))

    def _verify(self, fqn: str, entry: Mapping[str, Any]) -> bool:
        if not isinstance(entry.get("file"), str):
            self._damaged(fqn, self.directory, "entry has no file name")
            return False
        path = self.directory / entry["file"]
        try:
            st = path.stat()
        except OSError:
            self._damaged(fqn, path, "is missing")
            return False
        key = (st.st_size, st.st_mtime_ns, str(entry.get("sha256")))
        if self._verified.get(fqn) == key:
            return True
        if st.st_size != entry.get("bytes"):
            self._damaged(fqn, path, f"has {st.st_size} bytes, the manifest recorded {entry.get('bytes')}")
            return False
        if file_sha256(path) != entry.get("sha256"):
            self._damaged(fqn, path, "does not match the sha256 the manifest recorded (corrupt or edited)")
            return False
        self._verified[fqn] = key
        return True

    def _damaged(self, fqn: str, path: Path, what: str) -> None:
        warnings.warn(f"run {self.directory}: layer {fqn!r}: {path.name} {what}; the layer will be recomputed",
                      RuntimeWarning, stacklevel=4)
        self._known[fqn] = {"status": "pending", "note": f"file {what}"}
        self._own.pop(fqn, None)
        self._verified.pop(fqn, None)

    def done(self, fqn: str) -> bool:
        """Whether layer ``fqn`` is finished: a ``done`` entry whose file's size and sha256 match.

        A damaged file warns (``RuntimeWarning``) and counts as not done. The sha256 of each file
        is computed once per store (again only if the file changes).
        """
        entry = self._known.get(fqn)
        return bool(entry) and entry.get("status") == "done" and self._verify(fqn, entry)

    def finished(self, names: Optional[Iterable[str]] = None) -> List[str]:
        """The finished (verified) layers among ``names`` (default: all the manifests know)."""
        return [n for n in (self._known if names is None else names) if self.done(n)]

    def plan(self, names: Iterable[str]) -> None:
        """Record ``names`` as ``pending`` in this writer's manifest (finished ones are kept)."""
        changed = False
        for fqn in names:
            if self._known.get(fqn, {}).get("status") != "done" and fqn not in self._own:
                self._own[fqn] = self._known[fqn] = {"status": "pending"}
                changed = True
        if changed or not self.manifest_path.exists():
            self._write_manifest()

    def check_layer_config(self, fqn: str, config: Any) -> None:
        """Raise :class:`RunMismatchError` if finished layer ``fqn`` was computed with another config."""
        entry = self._known.get(fqn, {})
        stored = entry.get("config")
        if entry.get("status") != "done" or stored is None:
            return
        diff = config_diff(stored, config_to_dict(config))
        if diff:
            raise RunMismatchError(
                f"run directory {self.directory}: finished layer {fqn!r} was computed with other settings:\n  "
                + "\n  ".join(diff)
                + "\nUse the same per-layer settings to resume, a new run directory, or delete this one."
            )

    def save(
        self,
        fqn: str,
        payload: Any,
        *,
        config: Optional[Any] = None,
        seconds: Optional[float] = None,
        device: Optional[Any] = None,
    ) -> Path:
        """Write one finished layer atomically, then record it in the manifest (atomically too).

        Args:
            fqn: the layer name.
            payload: what the config's method made of it (ARMOR: its ``ArmorFactors``, moved to
                CPU for writing), written as the method's :meth:`~torch_armor.engine.methods.Method.to_store` says.
            config: the config it was computed with (default: the run's); kept per layer.
            seconds: how long it took (kept in the manifest).
            device: where it was computed, as the config asked (kept in the manifest; default: where
                the payload's tensors are).

        Returns:
            The layer file's path.
        """
        cfg = config or self.config
        try:
            stored = method_for(cfg).to_store(payload)
        except ArmorInputError as err:
            raise ArmorInputError(f"layer {fqn!r}: {err}") from None
        tensors = stored.tensors
        meta = {
            "format": FORMAT_NAME,
            "version": str(FORMAT_VERSION),
            "fqn": fqn,
            **stored.header,
            "model_id": self.model_id,
            "stats_hash": self.stats_hash,
            "config": json.dumps(config_to_dict(cfg), sort_keys=True),
        }
        data = _deterministic_safetensors(tensors, meta)
        path = self.layer_path(fqn)
        self._write_or_explain(path, data, f"layer {fqn!r}")
        st = path.stat()
        sha = hashlib.sha256(data).hexdigest()
        del data
        entry = {
            "status": "done",
            "file": f"{LAYERS_DIR}/{path.name}",
            "sha256": sha,
            "bytes": st.st_size,
            **stored.summary,
            "seconds": None if seconds is None else float(seconds),
            "device": stored.summary["device"] if device is None else str(device),
            "config": config_to_dict(cfg),
            "rank": self.rank,
            "written_at": time.time(),
        }
        self._own[fqn] = self._known[fqn] = entry
        self._verified[fqn] = (st.st_size, st.st_mtime_ns, sha)
        self._write_manifest()
        return path

    def mark_failed(self, fqn: str, error: BaseException) -> None:
        """Record that layer ``fqn`` failed (kept as ``failed`` with the message; retried on resume)."""
        if self._known.get(fqn, {}).get("status") == "done":
            return
        self._own[fqn] = self._known[fqn] = {"status": "failed", "error": f"{type(error).__name__}: {error}"}
        try:
            self._write_manifest()
        except OSError:  # the disk refused the record; the original error is the one to report
            pass

    def _write_or_explain(self, path: Path, data: Any, what: str) -> None:
        """``atomic_write``, turning an OSError (disk full, read-only) into an :class:`ArmorIOError`
        that names the file and says the finished layers are kept."""
        try:
            atomic_write(path, data)
        except OSError as err:
            done = sum(1 for e in self._known.values() if e.get("status") == "done")
            raise ArmorIOError(err.errno, f"cannot write {what} to {path}: {err.strerror or err}; the {done} "
                                          f"finished layer(s) in {self.directory} are kept: free space or fix "
                                          "permissions, then rerun the same command to resume") from err

    def load(self, fqn: str) -> Any:
        """Read a finished layer back: the payload :meth:`save` got (CPU tensors, bit-identical), by
        the run's method's :meth:`~torch_armor.engine.methods.Method.from_store`."""
        if not self.done(fqn):
            raise KeyError(
                f"layer {fqn!r} is not finished in run {self.directory} (status "
                f"{self._known.get(fqn, {}).get('status', 'unknown')!r}); factorize it first"
            )
        path = self.directory / self._known[fqn]["file"]
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("fqn") != fqn:
                raise ArmorInputError(
                    f"{path} holds layer {meta.get('fqn')!r}, expected layer {fqn!r}; the run directory was "
                    "edited: delete the file to recompute it"
                )
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        try:
            return method_for(self.config).from_store(tensors, meta)
        except ValueError as err:
            raise ArmorInputError(f"{path} (layer {fqn!r}): {err}; the run directory was edited: delete the file "
                             "to recompute it") from None

    def finalize(self) -> None:
        """Merge the rank manifests into ``manifest.json`` and remove them and stale temp files.

        Rank 0 only, once every rank has finished writing (after a barrier). Single-process
        runs call it at the end of :func:`~torch_armor.armor.layers.factorize_layers`.
        """
        if self.rank != 0:
            raise ArmorInputError(f"finalize() merges the rank manifests and must run on rank 0, not rank {self.rank}")
        shards = self._shard_paths()
        for path in shards:
            data = read_manifest(path)
            self._check_identity(data, path)
            for fqn, entry in (data.get("layers") or {}).items():
                if isinstance(entry, dict):
                    self._merge_entry(fqn, entry)
        self._own.update(self._known)
        self._write_manifest()
        for path in shards:
            path.unlink(missing_ok=True)
        for pattern in (f".*{TMP_MARK}*", f"{LAYERS_DIR}/.*{TMP_MARK}*"):
            for tmp in self.directory.glob(pattern):
                tmp.unlink(missing_ok=True)

    def __repr__(self) -> str:
        done = sum(1 for e in self._known.values() if e.get("status") == "done")
        return f"RunStore({str(self.directory)!r}, model_id={self.model_id!r}, rank={self.rank}, done={done})"
