"""The files of a run directory besides the layers: manifest names and format, reading a
manifest, per-layer file names, and how two runs' identities differ (for
:class:`~torch_armor.engine.runstore.RunStore`).

Example::

    >>> layer_filename("model.layers.0.mlp.up_proj")
    'model.layers.0.mlp.up_proj.safetensors'
    >>> config_diff({"block_size": 16, "device": "cpu", "optimizer": {"type": "BcdConfig", "iters": 2}},
    ...             {"block_size": 32, "device": "cuda", "optimizer": {"type": "BcdConfig", "iters": 5}})
    ['block_size: run has 16, now 32', 'optimizer.iters: run has 2, now 5']
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping
from urllib.parse import quote

import torch

from torch_armor.config.serialized import config_changes
from torch_armor.errors import ArmorInputError, RunMismatchError

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "LAYERS_DIR", "SHARD_PREFIX", "NOT_IDENTITY",
           "STATUS_RANK", "config_diff", "read_manifest", "layer_filename", "default_rank", "identity_diff"]

FORMAT_NAME = "torch_armor.run"
FORMAT_VERSION = 2  # 2: configs in the nested form of torch_armor.config.serialized
MANIFEST_NAME = "manifest.json"
LAYERS_DIR = "layers"
SHARD_PREFIX = "manifest.rank-"
#: Config fields that do not define a run: where a layer was optimized may change between
#: resumes (a GPU run finished on CPU, ``cuda:0`` and ``cuda:1`` ranks); it is recorded per layer.
NOT_IDENTITY = ("device",)
STATUS_RANK = {"pending": 0, "failed": 1, "done": 2}

def config_diff(stored: Mapping[str, Any], current: Mapping[str, Any]) -> List[str]:
    changes = config_changes({k: v for k, v in stored.items() if k not in NOT_IDENTITY},
                             {k: v for k, v in current.items() if k not in NOT_IDENTITY})
    return [f"{k}: run has {old!r}, now {new!r}" for k, (old, new) in changes.items()]


# --------------------------------------------------------------------------- manifest files


def read_manifest(path: Path) -> Dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as err:
        raise RunMismatchError(
            f"{path} cannot be read ({err}); it is not a torch_armor run manifest. Use another run "
            "directory, or delete this one to start over"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise RunMismatchError(
            f"{path} is not a torch_armor run manifest (format {data.get('format') if isinstance(data, dict) else None!r}); "
            "use another run directory"
        )
    if data.get("version") != FORMAT_VERSION:
        raise RunMismatchError(
            f"{path} has run format version {data.get('version')!r}, this torch_armor writes {FORMAT_VERSION}; "
            "finish it with the torch_armor version that started it, or start a new run directory"
        )
    return data


def layer_filename(fqn: str) -> str:
    if not isinstance(fqn, str) or not fqn:
        raise ArmorInputError(f"layer names must be non-empty strings, got {fqn!r}")
    safe = quote(fqn, safe="")
    if safe.startswith("."):
        safe = "%2E" + safe[1:]
    if len(safe) > 180:  # file-name limits: keep a readable prefix and make it unique
        safe = f"{safe[:140]}-{hashlib.sha256(fqn.encode()).hexdigest()[:24]}"
    return f"{safe}.safetensors"


def default_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:16] + "…"


def identity_diff(stored: Any, current: str) -> List[str]:
    """What differs between two run identities; JSON identities (``prune_model``'s: content hash of
    the weights, of the calibration data, method, layers, …) are compared key by key."""
    try:
        old, new = json.loads(stored), json.loads(current)
    except (TypeError, ValueError):
        old = new = None
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [f"  model_id: run has {stored!r}, now {current!r}"]
    why = {"model": " (other weights: a changed checkpoint at the same path?)",
           "calibration": " (other calibration token ids)"}
    return [f"  model_id.{k}: run has {_short(old.get(k))}, now {_short(new.get(k))}{why.get(k, '')}"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
