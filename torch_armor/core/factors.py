"""The result of factorizing one layer: ``W_hat = A · core · B``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from torch_armor.core.blockdiag import block_diag_left, block_diag_right

__all__ = ["ArmorFactors"]


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

    @property
    def block_size(self) -> int:
        return self.a_blocks.shape[-1]

    @property
    def shape(self) -> torch.Size:
        return self.core.shape

    @property
    def relative_loss(self) -> float:
        """Relative proxy loss of the returned factors (÷ NoWag-P's)."""
        return float(self.history.min())

    def dense(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Materialize ``W_hat = A · core · B`` as a dense ``(d_out, d_in)`` matrix."""
        dtype = dtype or self.core.dtype
        a, core, b = (t.to(dtype) for t in (self.a_blocks, self.core, self.b_blocks))
        return block_diag_right(block_diag_left(a, core), b)

    def num_wrapper_params(self) -> int:
        """Extra parameters of ``A`` and ``B``: ``d_b · (d_out + d_in)``."""
        return self.a_blocks.numel() + self.b_blocks.numel()
