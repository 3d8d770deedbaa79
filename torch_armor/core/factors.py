"""The result of factorizing one layer: ``W_hat = A · core · B``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

import torch

from torch_armor.core.blockdiag import block_diag_left, block_diag_right
from torch_armor.errors import ArmorInputError

__all__ = ["ArmorFactors"]

#: The tensors of :class:`ArmorFactors`, in the order :meth:`ArmorFactors.to_tensors` gives them.
TENSOR_NAMES = ("a_blocks", "core", "b_blocks", "mask", "history", "history_iters", "history_time_s")
#: Its scalar fields (:meth:`ArmorFactors.metadata`).
SCALAR_NAMES = ("pattern", "nowag_loss", "best_iter", "relative_output_loss")


@dataclass
class ArmorFactors:
    """ARMOR factors of one weight ``W (d_out × d_in)``, normalization folded in.

    Attributes:
        a_blocks: ``(d_out / d_b, d_b, d_b)`` diagonal blocks of ``A`` (row scaling ``r`` folded in).
        core: ``(d_out, d_in)`` sparse core ``W' ⊙ M`` (exact zeros off the mask).
        b_blocks: ``(d_in / d_b, d_b, d_b)`` diagonal blocks of ``B`` (column scaling ``c`` folded in).
        mask: ``(d_out, d_in)`` bool, the kept entries of the core.
        pattern: the sparsity pattern the mask satisfies, e.g. ``"2:4"``.
        history: relative proxy loss (÷ NoWag-P's) at ``history_iters``; entry 0 is the init (1.0).
        history_iters: iteration index of each ``history`` entry.
        history_time_s: wall time since the start of optimization at each ``history`` entry.
        nowag_loss: the NoWag-P proxy loss this run started from.
        best_iter: iteration whose factors were returned (the best seen).
        relative_output_loss: after output-space refinement or block reconstruction
            (:func:`torch_armor.core.refine.with_losses`), ``tr((W − Ŵ) H (W − Ŵ)ᵀ)`` ÷ NoWag-P's;
            ``nan`` otherwise. Those changes append the new factors' proxy loss to ``history``.
    """

    a_blocks: torch.Tensor
    core: torch.Tensor
    b_blocks: torch.Tensor
    mask: torch.Tensor
    pattern: str = "2:4"
    history: torch.Tensor = field(default_factory=lambda: torch.ones(1))
    history_iters: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.long))
    history_time_s: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.float64))
    nowag_loss: float = float("nan")
    best_iter: int = 0
    relative_output_loss: float = float("nan")

    @property
    def block_size(self) -> int:
        return self.a_blocks.shape[-1]

    @property
    def shape(self) -> torch.Size:
        return self.core.shape

    @property
    def relative_loss(self) -> float:
        """Relative proxy loss of the returned factors (÷ NoWag-P's): the best of ``history``,
        or its last entry for refined factors (refinement optimizes another loss)."""
        return float(self.history[-1]) if self.refined else float(self.history.min())

    @property
    def refined(self) -> bool:
        """Whether a change after the optimizer (output-space refinement, block reconstruction)
        produced these factors: then ``history[-1]`` and ``relative_output_loss`` describe them."""
        return not math.isnan(self.relative_output_loss)

    def loss_text(self) -> str:
        """The loss these factors last minimised, relative to NoWag-P's: ``"output loss 0.4123 ×
        NoWag-P"`` for refined factors, else ``"proxy loss 0.8000 × NoWag-P"`` (after refinement
        the proxy is no longer what was minimised, and may exceed 1 while the output loss is lower)."""
        if self.refined:
            return f"output loss {self.relative_output_loss:.4f} × NoWag-P"
        return f"proxy loss {self.relative_loss:.4f} × NoWag-P"

    def dense(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Materialize ``W_hat = A · core · B`` as a dense ``(d_out, d_in)`` matrix."""
        dtype = dtype or self.core.dtype
        a, core, b = (t.to(dtype) for t in (self.a_blocks, self.core, self.b_blocks))
        return block_diag_right(block_diag_left(a, core), b)

    def num_wrapper_params(self) -> int:
        """Extra parameters of ``A`` and ``B``: ``d_b · (d_out + d_in)``."""
        return self.a_blocks.numel() + self.b_blocks.numel()

    # -- the one serialized form (run directories, sparsifier state dicts) ----------------------
    def to_tensors(self) -> Dict[str, torch.Tensor]:
        """The tensors, by field name: ``a_blocks``, ``core``, ``b_blocks``, ``mask``, ``history``,
        ``history_iters``, ``history_time_s`` (detached, on CPU, contiguous)."""
        return {k: getattr(self, k).detach().to("cpu").contiguous() for k in TENSOR_NAMES}

    def metadata(self) -> Dict[str, Any]:
        """The scalar fields as JSON-able values: ``pattern``, ``nowag_loss``, ``best_iter``,
        ``relative_output_loss``."""
        return {"pattern": str(self.pattern), "nowag_loss": float(self.nowag_loss), "best_iter": int(self.best_iter),
                "relative_output_loss": float(self.relative_output_loss)}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], **scalars: Any) -> "ArmorFactors":
        """Rebuild factors from :meth:`to_tensors` (and :meth:`metadata` as keywords), bit-identical.

        Raises:
            ValueError: a tensor is missing or unknown, an unknown scalar, or shapes that do not
                fit together (the message says which).

        Example::

            >>> f = ArmorFactors(torch.eye(4).repeat(2, 1, 1), torch.zeros(8, 4),
            ...                  torch.eye(4).repeat(1, 1, 1), torch.zeros(8, 4, dtype=torch.bool))
            >>> g = ArmorFactors.from_tensors(f.to_tensors(), **f.metadata())
            >>> torch.equal(g.core, f.core), g.pattern
            (True, '2:4')
        """
        missing = [k for k in TENSOR_NAMES if k not in tensors]
        unknown = sorted(set(tensors) - set(TENSOR_NAMES))
        if missing or unknown:
            raise ArmorInputError(
                f"ArmorFactors tensors: missing {missing}, unknown {unknown}; expected exactly {list(TENSOR_NAMES)}"
            )
        bad = sorted(set(scalars) - set(SCALAR_NAMES))
        if bad:
            raise ArmorInputError(f"ArmorFactors scalars: unknown {bad}; expected some of {list(SCALAR_NAMES)}")
        t = {k: tensors[k] for k in TENSOR_NAMES}
        not_tensor = [k for k, v in t.items() if not isinstance(v, torch.Tensor)]
        if not_tensor:
            raise ArmorInputError(f"ArmorFactors tensors: {not_tensor} are not torch.Tensors")
        a, core, b = t["a_blocks"], t["core"], t["b_blocks"]
        problems = []
        if core.dim() != 2:
            problems.append(f"core must be 2-D, got {tuple(core.shape)}")
        elif a.dim() != 3 or b.dim() != 3 or a.shape[-1] != a.shape[-2] or b.shape[-1] != b.shape[-2] \
                or a.shape[-1] != b.shape[-1]:
            problems.append(f"a_blocks {tuple(a.shape)} and b_blocks {tuple(b.shape)} must be (k, d_b, d_b) "
                            "stacks with one d_b")
        elif a.shape[0] * a.shape[-1] != core.shape[0] or b.shape[0] * b.shape[-1] != core.shape[1]:
            problems.append(f"a_blocks {tuple(a.shape)} and b_blocks {tuple(b.shape)} do not tile the "
                            f"core {tuple(core.shape)}")
        if t["mask"].shape != core.shape or t["mask"].dtype != torch.bool:
            problems.append(f"mask must be a bool tensor of the core's shape {tuple(core.shape)}, got "
                            f"{t['mask'].dtype} {tuple(t['mask'].shape)}")
        hist = [t[k] for k in ("history", "history_iters", "history_time_s")]
        if any(h.dim() != 1 for h in hist) or len({h.shape[0] for h in hist}) != 1:
            problems.append("history, history_iters and history_time_s must be 1-D of one length, got "
                            + ", ".join(str(tuple(h.shape)) for h in hist))
        if problems:
            raise ArmorInputError("ArmorFactors tensors do not fit together: " + "; ".join(problems))
        return cls(**t, **scalars)
