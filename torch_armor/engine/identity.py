"""Identities of runs: content hashes of tensors, statistics, models and calibration data.

One routine, :func:`hash_tensors`, hashes every kind of content (each tensor's name, dtype,
shape and raw bytes, in sorted name order); the run store compares the hashes to refuse a run
directory or a sparsifier state that belongs to other weights or other data.

Example::

    >>> import torch
    >>> hash_calibration([torch.zeros(2, 4, dtype=torch.long)]) == hash_calibration([torch.zeros(2, 4, dtype=torch.long)])
    True
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping, Sequence, Union

import torch
from torch import nn

from torch_armor.calibration.observer import LayerStatistics
from torch_armor.errors import ArmorInputError

__all__ = ["hash_tensors", "hash_statistics", "hash_model", "hash_calibration", "identity_string", "act_sq_norm_of"]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def hash_tensors(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over ``tensors`` in sorted key order: each key, dtype, shape and raw bytes.

    Independent of the mapping's order and of devices; any change of a value, dtype or shape
    changes it.

    Example::

        >>> a = hash_tensors({"x": torch.ones(2), "y": torch.zeros(3)})
        >>> a == hash_tensors({"y": torch.zeros(3), "x": torch.ones(2)})
        True
        >>> a == hash_tensors({"x": torch.ones(2, dtype=torch.float64), "y": torch.zeros(3)})
        False
    """
    digest = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key]
        if not isinstance(t, torch.Tensor):
            raise ArmorInputError(f"hash_tensors: {key!r} is a {type(t).__name__}, expected a torch.Tensor")
        if t.device.type == "meta":
            raise ArmorInputError(f"{key} is on the meta device: hash the checkpoint it comes from instead")
        head = json.dumps([key, str(t.dtype), list(t.shape)])
        digest.update(len(head).to_bytes(8, "little") + head.encode())
        data = _tensor_bytes(t)
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def act_sq_norm_of(value: Any, fqn: str) -> torch.Tensor:
    if isinstance(value, LayerStatistics):
        return value.act_sq_norm
    if isinstance(value, torch.Tensor):
        return value
    raise ArmorInputError(
        f"layer {fqn!r}: expected its act_sq_norm tensor or a LayerStatistics, got {type(value).__name__}"
    )


def hash_statistics(stats: Mapping[str, Union[torch.Tensor, LayerStatistics]]) -> str:
    """The statistics hash of a run: :func:`hash_tensors` of every layer's ``act_sq_norm`` (and
    ``xtx`` where a :class:`~torch_armor.calibration.observer.LayerStatistics` carries it: the
    output-space refinement reads it).

    Example::

        >>> h = torch.tensor([1.0, 2.0])
        >>> hash_statistics({"fc": h}) == hash_statistics({"fc": LayerStatistics(h, num_tokens=7)})
        True
    """
    tensors = {fqn: act_sq_norm_of(v, fqn) for fqn, v in stats.items()}
    tensors.update({f"{fqn}.xtx": v.xtx for fqn, v in stats.items() if getattr(v, "xtx", None) is not None})
    return hash_tensors(tensors)


def hash_model(model: nn.Module) -> str:
    """:func:`hash_tensors` of every parameter and buffer of ``model``."""
    return hash_tensors(dict(model.state_dict(keep_vars=False)))


def hash_calibration(batches: Sequence[torch.Tensor]) -> str:
    """:func:`hash_tensors` of the calibration token ids, batch by batch."""
    return hash_tensors({f"batch.{i:06d}": b.to(torch.int64) for i, b in enumerate(batches)})


def identity_string(**parts: Any) -> str:
    """A run identity as canonical JSON (what must not change between a run and its resume)."""
    return json.dumps(parts, sort_keys=True, default=str)
