"""What a sparsifier's ``state_dict`` holds: plain values only (``torch.load(weights_only=True)``
reads it) — statistics, finished layers (ARMOR factors or a pruned weight and mask) and the
hashes of the weights they came from.

Example::

    >>> plain({"dtype": torch.float16, "sizes": (1, 2)})
    {'dtype': 'torch.float16', 'sizes': [1, 2]}
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from torch_armor.core.factors import ArmorFactors
from torch_armor.engine.methods import Method
from torch_armor.engine.runner import LayerSolution
from torch_armor.errors import ArmorInputError

__all__ = ["STATE_DICT_VERSION", "MODULE_KEYS", "plain", "solution_state", "solution_from_state"]

#: 2: weight hashes (``"weight_hashes"``), factors as ``to_tensors()`` + ``"factor_metadata"``;
#: 3: each layer's config nested (:mod:`torch_armor.config.serialized`).
STATE_DICT_VERSION = 3
MODULE_KEYS = ("module", "module_fqn", "tensor_name")  # filled in by BaseSparsifier.prepare


def plain(value: Any) -> Any:
    """``value`` with dtypes/devices as strings, tensors on CPU: safe for ``weights_only`` loads."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def solution_state(sol: LayerSolution) -> Dict[str, Any]:
    """One finished layer as tensors and numbers: ARMOR factors, or the pruned weight and mask."""
    if isinstance(sol.payload, ArmorFactors):
        return {"factors": sol.payload.to_tensors(), "factor_metadata": sol.payload.metadata(),
                "seconds": float(sol.seconds)}
    return {"pruned": sol.payload.detach().cpu(), "mask": sol.mask.detach().cpu(), "seconds": float(sol.seconds)}


def solution_from_state(fqn: str, method: Method, entry: Dict[str, Any], shape: tuple) -> Optional[LayerSolution]:
    """The inverse of :func:`solution_state` (``method``: the sparsifier's), checked against the layer's ``shape``."""
    seconds = float(entry.get("seconds") or 0.0)
    if "factors" in entry:
        try:
            factors = ArmorFactors.from_tensors(entry["factors"], **entry.get("factor_metadata", {}))
        except ValueError as err:
            raise ArmorInputError(f"layer {fqn!r}: saved factors: {err}") from None
        sol = LayerSolution(fqn, method, factors, seconds, factors.mask)
    elif "pruned" in entry:
        sol = LayerSolution(fqn, method, entry["pruned"], seconds, entry.get("mask"))
    else:
        return None
    saved = tuple(sol.payload.shape)
    if saved != shape:
        raise ArmorInputError(f"layer {fqn!r}: the saved result is for a {saved} weight, the layer is {shape}; "
                         "the state comes from a different model")
    return sol
