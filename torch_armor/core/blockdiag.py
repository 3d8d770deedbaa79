"""Products with block-diagonal matrices stored as ``(n_blocks, d_b, d_b)`` stacks."""

from __future__ import annotations

import torch

__all__ = ["block_diag_left", "block_diag_right"]


def block_diag_left(blocks: torch.Tensor, mat: torch.Tensor) -> torch.Tensor:
    """``blockdiag(blocks) @ mat`` for ``mat (n·d_b, k)`` without forming the big matrix."""
    n, d_b, _ = blocks.shape
    k = mat.shape[-1]
    return torch.bmm(blocks, mat.reshape(n, d_b, k)).reshape(n * d_b, k)


def block_diag_right(mat: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``mat @ blockdiag(blocks)`` for ``mat (k, n·d_b)`` without forming the big matrix."""
    n, d_b, _ = blocks.shape
    k = mat.shape[0]
    out = torch.bmm(mat.reshape(k, n, d_b).transpose(0, 1), blocks)  # (n, k, d_b)
    return out.transpose(0, 1).reshape(k, n * d_b)
