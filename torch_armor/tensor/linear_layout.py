"""How an ARMOR linear ``y = x · (A · core · B)ᵀ + bias`` runs: three passes over rows, row-major out.

:func:`armor_linear_rows` is the one layout every core format uses:

1. the B-pass writes ``x · blockdiag(B)ᵀ`` as a row-major ``(T', d_in)`` tensor, ``T`` padded with
   zero rows to the core GEMM's token multiple;
2. ``core_mm_rows`` multiplies it by the core: ``(T', d_in) -> (T', d_out)`` (a dense ``mm``, or a 2:4
   GEMM reading the rows as its column-major operand and writing its result transposed);
3. the A-pass reads the first ``T`` rows, applies ``blockdiag(A)``, adds the bias and writes
   ``(T, d_out)`` row-major, as ``nn.Linear`` returns it (attention kernels need the last stride 1).

On CUDA with Triton each pass is one kernel (:func:`torch_armor.kernels.block_diag.block_diag_rows`,
which also reads any input dtype and writes the output dtype: no separate pad, cast or copy);
elsewhere the passes are batched matmuls (:func:`~torch_armor.kernels.block_diag.block_diag_rows_reference`),
exactly the CPU arithmetic of earlier versions.

Example::

    >>> import torch
    >>> a, b, core = torch.randn(2, 4, 4), torch.randn(3, 4, 4), torch.randn(8, 12)
    >>> w = torch.block_diag(*a) @ core @ torch.block_diag(*b)
    >>> x = torch.randn(5, 12)
    >>> y = armor_linear_rows(x, a, b, lambda rows: rows @ core.T, token_multiple=8)
    >>> torch.allclose(y, x @ w.T, atol=1e-4), y.shape, y.is_contiguous()
    (True, torch.Size([5, 8]), True)
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from torch_armor.kernels.block_diag import block_diag_rows, block_diag_rows_reference, fused_wrappers_available

__all__ = ["armor_linear_rows"]


def armor_linear_rows(x2d: torch.Tensor, a_blocks: torch.Tensor, b_blocks: torch.Tensor,
                      core_mm_rows: Callable[[torch.Tensor], torch.Tensor], bias: Optional[torch.Tensor] = None,
                      token_multiple: int = 1, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x2d (T, d_in)`` to ``(T, d_out)`` row-major in ``out_dtype`` (default ``x2d``'s), computed in
    the wrappers' dtype. ``core_mm_rows(y)`` maps the row-major ``(T', d_in)`` operand (``T'`` the
    token count rounded up to ``token_multiple``) to ``y · coreᵀ``, ``(T', d_out)``, any strides."""
    wrapper_pass = block_diag_rows if fused_wrappers_available(x2d.device) else block_diag_rows_reference
    tokens = x2d.shape[0]
    y = wrapper_pass(x2d, b_blocks, None, token_multiple, b_blocks.dtype)
    z = core_mm_rows(y)
    return wrapper_pass(z.narrow(0, 0, tokens), a_blocks, bias, 1, out_dtype or x2d.dtype)
