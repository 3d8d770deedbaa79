"""The two ways an ARMOR linear ``y = x · (A · core · B)ᵀ`` lays out its three products.

* :func:`rowwise_linear` works on ``(T, d)`` rows: each block-diagonal product is a ``bmm`` over
  ``(n, T, d_b)`` followed by a transpose back to rows (two activation copies per call). It is
  what CPU cores (dense, compact, quantized) run, kept exactly as it was so CPU results stay
  bit-identical.
* :func:`transposed_linear` works in transposed space and copies no activation: ``x`` viewed as
  ``(n_B, d_b, T)`` (a permuted view), ``bmm(B, ·)`` writes ``(n_B, d_b, T)`` contiguous — which
  *is* the ``(d_in, T)`` operand a 2:4 GEMM reads —, the core GEMM gives ``(d_out, T)``, viewed as
  ``(n_A, d_b, T)`` for ``bmm(A, ·)`` (bias fused with ``baddbmm``), and the result is returned as
  its ``(T, d_out)`` transposed view. A following layer that receives that view finds its own
  ``(n_B, d_b, T)`` operand already contiguous. CUDA cores run it.

Example::

    >>> import torch
    >>> a, b, core = torch.randn(2, 4, 4), torch.randn(3, 4, 4), torch.randn(8, 12)
    >>> w = torch.block_diag(*a) @ core @ torch.block_diag(*b)
    >>> x = torch.randn(5, 12)
    >>> y = transposed_linear(x, a, b, lambda t: core @ t)
    >>> torch.allclose(y, x @ w.T, atol=1e-4), y.shape, y.is_contiguous()
    (True, torch.Size([5, 8]), False)
    >>> torch.allclose(rowwise_linear(x, a, b, lambda h: h @ core.T), x @ w.T, atol=1e-4)
    True
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["blockwise_right_t", "rowwise_linear", "transposed_linear"]


def blockwise_right_t(x2d: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``x2d @ blockdiag(blocks)ᵀ`` for ``x2d (T, n·d_b)``, one bmm over the ``n`` blocks."""
    n, d_b, _ = blocks.shape
    t = x2d.shape[0]
    out = torch.bmm(x2d.reshape(t, n, d_b).transpose(0, 1), blocks.transpose(1, 2))  # (n, T, d_b)
    return out.transpose(0, 1).reshape(t, n * d_b)


def rowwise_linear(x2d: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   core_mm_t: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``x2d (T, d_in)`` to ``(T, d_out)``: ``B`` product, ``core_mm_t(h) = h · coreᵀ``, ``A`` product."""
    return blockwise_right_t(core_mm_t(blockwise_right_t(x2d, b)), a)


def transposed_linear(x2d: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      core_mm: Callable[[torch.Tensor], torch.Tensor], bias: Optional[torch.Tensor] = None,
                      token_multiple: int = 1) -> torch.Tensor:
    """``x2d (T, d_in)`` to ``(T, d_out)`` (a transposed view) with no activation copy.

    ``core_mm(y)`` takes the ``(d_in, T')`` row-major operand and returns ``core · y``, ``(d_out, T')``.
    ``token_multiple``: ``T`` is padded up to a multiple of it for the core GEMM (the 2:4 kernels
    want 8; only a decode step with a handful of tokens ever needs it).
    """
    t, d_in = x2d.shape
    n_b, d_b, _ = b.shape
    n_a = a.shape[0]
    y = torch.bmm(b, x2d.reshape(t, n_b, d_b).permute(1, 2, 0)).view(d_in, t)
    extra = (-t) % token_multiple
    if extra:
        y = F.pad(y, (0, extra))
    z = core_mm(y)
    if extra:
        z = z.narrow(1, 0, t)
    z = z.view(n_a, d_b, t)
    out = torch.bmm(a, z) if bias is None else torch.baddbmm(bias.view(n_a, d_b, 1), a, z)
    return out.view(n_a * d_b, t).t()
