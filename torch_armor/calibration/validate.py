"""Calibration token ids checked against the model before any forward pass.

Token ids index the embedding table: a bool or floating tensor is not ids, and an id outside
``[0, vocab_size)`` would otherwise surface as ``IndexError: index out of range in self`` from
inside torch (or, on some devices, as garbage). One error names the first offending value and
where it is.

Example::

    >>> import torch
    >>> check_token_ids([torch.tensor([[1, 2], [3, 4]])], 5)
    >>> check_token_ids([torch.tensor([[1, 7]])], 5)
    Traceback (most recent call last):
    ...
    torch_armor.errors.ArmorInputError: calibration token id 7 (batch 0, row 0, position 1) is outside the model's vocabulary [0, 5); tokenize with the model's own tokenizer
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from torch_armor.errors import ArmorInputError

__all__ = ["check_token_ids", "vocab_size_of"]


def vocab_size_of(model: nn.Module) -> Optional[int]:
    """Rows of the model's input embedding (also on the meta device), else ``config.vocab_size``."""
    get = getattr(model, "get_input_embeddings", None)
    emb = None
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            emb = None
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if isinstance(size, int) and not isinstance(size, bool) else None


def _is_id_dtype(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def check_token_ids(batches: Sequence[Any], vocab_size: Optional[int], what: str = "calibration") -> None:
    """Every batch (``ids`` or ``(ids, mask)``) holds integer ids in ``[0, vocab_size)``."""
    for i, batch in enumerate(batches):
        ids = batch if isinstance(batch, torch.Tensor) else batch[0]
        if not _is_id_dtype(ids.dtype):
            raise ArmorInputError(
                f"{what} batch {i} is a {ids.dtype} tensor; token ids must be an integer tensor (torch.long), "
                "as a tokenizer returns them" + (" (a bool tensor is a mask, not ids)" if ids.dtype == torch.bool else "")
            )
        if vocab_size is None or ids.numel() == 0 or ids.device.type == "meta":
            continue
        bad = (ids < 0) | (ids >= vocab_size)
        if bool(bad.any()):
            where = [int(v) for v in bad.nonzero()[0]]
            value = int(ids[tuple(where)])
            place = f"row {where[0]}, position {where[1]}" if len(where) == 2 else f"index {tuple(where)}"
            raise ArmorInputError(
                f"{what} token id {value} (batch {i}, {place}) is outside the model's vocabulary [0, {vocab_size}); "
                "tokenize with the model's own tokenizer"
            )
