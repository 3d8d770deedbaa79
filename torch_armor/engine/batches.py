"""Calibration data as the engine takes it: token-id batches, optionally with attention masks.

Example::

    >>> [tuple(b.shape) for b in calibration_batches(torch.zeros(5, 8, dtype=torch.long), 2)]
    [(2, 8), (2, 8), (1, 8)]
"""

from __future__ import annotations

from typing import Any, List, Mapping, Sequence

import torch

from torch_armor.engine.identity import hash_calibration, hash_tensors
from torch_armor.errors import ArmorInputError

__all__ = ["calibration_batches", "hash_batches"]


def _ids_and_mask(item: Any) -> Any:
    """``ids`` or ``(ids, mask)`` from a tensor, an ``(ids, mask)`` pair or a tokenizer-style dict."""
    if isinstance(item, Mapping):
        if "input_ids" not in item:
            raise ArmorInputError(f"a calibration dict needs 'input_ids' (and optionally 'attention_mask'), got keys {sorted(item)}")
        ids, mask = item["input_ids"], item.get("attention_mask")
    elif isinstance(item, tuple) and len(item) == 2 and all(isinstance(t, torch.Tensor) for t in item):
        ids, mask = item
    else:
        ids, mask = item, None
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.numel() and not ids.dtype.is_floating_point):
        raise ArmorInputError("calibration must be an (n_windows, seq_len) tensor of token ids, a list of (batch, seq_len) "
                         "token-id tensors, or {'input_ids': …, 'attention_mask': …} / (ids, mask); got "
                         f"{type(ids).__name__} {tuple(getattr(ids, 'shape', ()))}")
    if mask is None:
        return ids
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        raise ArmorInputError(f"attention_mask must have the token ids' shape {tuple(ids.shape)}, got "
                         f"{type(mask).__name__} {tuple(getattr(mask, 'shape', ()))}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ArmorInputError("attention_mask must hold 0 (pad) and 1 (token) only")
    if not bool((mask != 0).any(dim=1).all()):
        raise ArmorInputError("attention_mask has a window with no token (every position is padding); drop that window")
    return ids, mask.to(torch.bool)


def calibration_batches(calibration: Any, batch_size: int = 4) -> List[Any]:
    """``(n, seq_len)`` token ids split into batches of ``batch_size`` windows, or a list of
    ``(b, seq_len)`` batches checked and kept.

    With padding, give ``{"input_ids": ids, "attention_mask": mask}`` (a tokenizer's output) or
    ``(ids, mask)``, or a list of them: batches are then ``(ids, mask)`` pairs, the model gets the
    mask, and pad positions (mask 0) are left out of every statistic.

    Example::

        >>> [tuple(b.shape) for b in calibration_batches(torch.zeros(5, 8, dtype=torch.long), 2)]
        [(2, 8), (2, 8), (1, 8)]
        >>> ids, mask = torch.zeros(3, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 0]] * 3)
        >>> [(tuple(i.shape), int(m.sum())) for i, m in calibration_batches({"input_ids": ids, "attention_mask": mask}, 2)]
        [((2, 4), 6), ((1, 4), 3)]
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ArmorInputError(f"batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(calibration, (torch.Tensor, Mapping)) or (isinstance(calibration, tuple) and len(calibration) == 2
                                                            and all(isinstance(t, torch.Tensor) for t in calibration)
                                                            and calibration[0].shape == calibration[1].shape):
        whole = _ids_and_mask(calibration)
        if isinstance(whole, torch.Tensor):
            return list(whole.split(batch_size))
        return list(zip(whole[0].split(batch_size), whole[1].split(batch_size)))
    batches = [_ids_and_mask(b) for b in calibration] if calibration is not None else []
    if not batches:
        raise ArmorInputError("calibration must be an (n_windows, seq_len) tensor of token ids or a list of "
                         "(batch, seq_len) token-id tensors")
    return batches


def hash_batches(batches: Sequence[Any]) -> str:
    """The calibration's identity: token ids (as before masks existed) and any attention masks."""
    if all(isinstance(b, torch.Tensor) for b in batches):
        return hash_calibration(batches)
    parts = {}
    for i, b in enumerate(batches):
        ids, mask = (b, None) if isinstance(b, torch.Tensor) else b
        parts[f"batch.{i:06d}"] = ids.to(torch.int64)
        if mask is not None:
            parts[f"mask.{i:06d}"] = mask.to(torch.int64)
    return hash_tensors(parts)
