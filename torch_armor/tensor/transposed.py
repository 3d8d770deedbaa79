"""The transpose of an ARMOR weight, for models that multiply by stored ``(in, out)`` weights.

ARMOR runs ``F.linear(x, w)`` (``x·Wᵀ``) and never materializes ``Wᵀ``. Some models write that product
as ``x.matmul(w.T)`` (DBRX's ``w1``/``v1``) or ``torch.bmm(x, w.transpose(1, 2))`` (Inkling's shared experts), or
store a weight ``(in, out)`` and compute ``x.matmul(w)`` (DBRX's ``w2``, read as ``w2.view(-1, I, H)[e]``). :class:`ArmorTransposed` stands for ``wᵀ`` of an ARMOR
weight in those expressions: ``x.matmul(ArmorTransposed(w))`` (or ``x @ …``) is ``F.linear(x, w)``,
``ArmorTransposed(w).T`` is ``w`` again, and for ARMOR experts ``ArmorTransposed(w)[e]`` is expert
``e``'s and ``torch.bmm(x, ArmorTransposed(w))`` each expert's ARMOR linear on its ``x[e]`` (:func:`experts_linear`).
It is a transient value (never a parameter: nothing is saved through it); any other use
raises one line naming the operation.

Example::

    >>> import torch
    >>> from torch_armor.core.factors import ArmorFactors
    >>> from torch_armor.tensor.armor_tensor import ArmorTensor
    >>> core = torch.tensor([[1.0, 0.0, 0.0, 2.0]] * 4)
    >>> w = ArmorTensor.from_factors(ArmorFactors(torch.eye(4)[None], core, torch.eye(4)[None], core != 0, "2:4"))
    >>> x = torch.ones(1, 4)
    >>> torch.equal(x.matmul(w.T), torch.nn.functional.linear(x, w))
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ArmorTransposed", "experts_linear", "EXPERTS_HINT"]

#: what to do instead of an op ARMOR experts (an (E, out, in) ArmorTensor, or its transpose) do not run
EXPERTS_HINT = (
    "run the experts with experts_implementation='armor' (model.set_experts_implementation('armor'), or "
    "from_pretrained(..., experts_implementation='armor'); 'eager' works too), index one expert with "
    "weight[e] / weight.expert(e) (a 2-D ArmorTensor for F.linear), or materialize with weight.dense_weight()"
)

_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
_BMMS = (torch.bmm, torch.Tensor.bmm)


def experts_linear(x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """``(E, T, out)``: ``F.linear(x[e], experts[e])`` for every expert of ``experts`` (ARMOR experts ``(E, out, in)``),
    ``x`` ``(E, T, in)``: ``torch.bmm(x, Wᵀ)`` run as each expert's ARMOR linear."""
    if x.dim() != 3 or x.shape[0] != experts.shape[0] or x.shape[-1] != experts.shape[-1]:
        raise NotImplementedError(f"torch.bmm of a {tuple(x.shape)} input with ARMOR experts {tuple(experts.shape)} "
                                  "(E, out, in) read as (E, in, out): the input must be (E, tokens, in)")
    return torch.stack([F.linear(x[e], experts[e]) for e in range(experts.shape[0])])


class ArmorTransposed:
    """``weight``'s transpose (its last two dims swapped) as the right operand of a matmul; ``weight`` is a
    2-D ArmorTensor or 3-D ARMOR experts (then index one expert first)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    @property
    def shape(self) -> torch.Size:
        s = tuple(self.weight.shape)
        return torch.Size(s[:-2] + (s[-1], s[-2]))

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def dim(self) -> int:
        return self.weight.dim()

    @property
    def T(self) -> torch.Tensor:  # noqa: N802  (torch's name)
        return self.weight

    def t(self) -> torch.Tensor:
        return self.weight

    def __getitem__(self, index: Any) -> "ArmorTransposed":
        if self.weight.dim() != 3:
            raise NotImplementedError(f"{self!r}: only the expert dimension of ARMOR experts can be indexed; "
                                      "use x.matmul(w) on the 2-D transpose")
        return ArmorTransposed(self.weight[index])

    def __repr__(self) -> str:
        return f"ArmorTransposed(shape={tuple(self.shape)}, of {type(self.weight).__name__})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and len(args) == 2 and not kwargs and isinstance(args[1], cls) \
                and isinstance(args[0], torch.Tensor) and args[1].weight.dim() == 2:
            return F.linear(args[0], args[1].weight)
        if func in _BMMS and len(args) == 2 and not kwargs and isinstance(args[1], cls) \
                and isinstance(args[0], torch.Tensor) and args[1].weight.dim() == 3:
            return experts_linear(args[0], args[1].weight)
        raise NotImplementedError(
            f"the transpose of an ARMOR weight only runs x.matmul(w.T) / x @ w.T (as F.linear(x, w)) and, for ARMOR "
            f"experts, torch.bmm(x, w.transpose(1, 2)), not {getattr(func, '__name__', func)}; "
            + (EXPERTS_HINT if any(isinstance(a, cls) and a.weight.dim() == 3 for a in args) else
               "for the materialized matrix use weight.dense_weight()"))
