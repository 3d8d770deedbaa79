"""Per-layer ARMOR optimization: ``factors = factorize(weight, act_sq_norm, config)``."""

from __future__ import annotations

import time
from typing import Optional

import torch

from .blockdiag import block_diag_left, block_diag_right
from .config import ArmorConfig
from .factors import ArmorFactors
from .proxy import mask_from_scores, normalize_weight, nowag_scores, validate_layer
from .sparse_core import core_gradient, select_groups, sparse_core_step

__all__ = ["factorize", "reconstruct_normalized"]


def reconstruct_normalized(a: torch.Tensor, core: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``A · core · B`` with block-diagonal ``A``, ``B`` given as block stacks."""
    return block_diag_right(block_diag_left(a, core), b)


def _weighted_sq(residual: torch.Tensor, act_sq_norm: torch.Tensor) -> torch.Tensor:
    return (residual.square() * act_sq_norm).sum()


def factorize(
    weight: torch.Tensor,
    act_sq_norm: torch.Tensor,
    config: Optional[ArmorConfig] = None,
    *,
    name: Optional[str] = None,
) -> ArmorFactors:
    """Factorize one linear weight as ``W_hat = A · (W' ⊙ M) · B`` (ARMOR).

    Starts from NoWag-P (``A = B = I``, ``W' = W_bar``, top-N of ``W_bar² h`` per group) and
    alternates a joint Adam step on ``A``, ``B``, ``W'`` with the sparse-core step (one group
    per tile, all ``C(M, N)`` supports solved, best kept). The best iterate is returned, so the
    proxy loss is never above NoWag-P's. Unstructured patterns run the Adam step only, on the
    NoWag-P mask.

    Args:
        weight: ``(d_out, d_in)`` float weight (fp16/bf16 are optimized in ``config.dtype``
            and the factors returned in the weight's dtype).
        act_sq_norm: ``(d_in,)`` ``Σ_tokens x_j²`` from calibration.
        config: :class:`ArmorConfig` (defaults if ``None``).
        name: layer name used in error messages.

    Example::

        >>> w, h = torch.randn(64, 64), torch.rand(64) + 0.1
        >>> f = factorize(w, h, ArmorConfig(block_size=16, num_iters=20))
        >>> f.relative_loss <= 1.0, f.dense().shape
        (True, torch.Size([64, 64]))
    """
    config = config or ArmorConfig()
    pattern = validate_layer(weight, act_sq_norm, config.pattern, config.block_size, name)
    if config.optimizer != "adam":
        raise NotImplementedError(f"optimizer {config.optimizer!r} is not available yet; use 'adam'")
    device = torch.device(config.device) if config.device is not None else weight.device
    dtype = config.dtype
    d_out, d_in = weight.shape
    d_b = config.block_size
    p, q = d_out // d_b, d_in // d_b

    w = weight.detach().to(device=device, dtype=dtype)
    h = act_sq_norm.detach().to(device=device, dtype=dtype)
    w_bar, row_norm, col_norm = normalize_weight(w)
    mask = mask_from_scores(nowag_scores(w_bar, h), pattern).contiguous()

    eye = torch.eye(d_b, device=device, dtype=dtype)
    a = eye.repeat(p, 1, 1).requires_grad_(True)
    b = eye.repeat(q, 1, 1).requires_grad_(True)
    w_prime = w_bar.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([a, b, w_prime], lr=config.lr)
    generator = torch.Generator(device=device).manual_seed(config.seed)

    nowag_loss = _weighted_sq(w_bar - w_bar * mask, h).detach()
    best = {"a": a.detach().clone(), "b": b.detach().clone(), "core": (w_bar * mask).clone(), "mask": mask.clone()}
    best_loss = nowag_loss.clone()
    best_iter = torch.zeros((), dtype=torch.long, device=device)

    n_iters = config.num_iters
    log_iters = sorted(set(range(0, n_iters + 1, config.log_every)) | {n_iters})
    losses = torch.empty(len(log_iters), dtype=dtype, device=device)
    times = torch.zeros(len(log_iters), dtype=torch.float64)
    losses[0] = nowag_loss
    log_pos = 1
    start = time.perf_counter()

    def track_best(loss: torch.Tensor, it: int, core_now: torch.Tensor, mask_now: torch.Tensor) -> None:
        nonlocal best_loss
        better = loss < best_loss
        best["a"] = torch.where(better, a.detach(), best["a"])
        best["b"] = torch.where(better, b.detach(), best["b"])
        best["core"] = torch.where(better, core_now, best["core"])
        best["mask"] = torch.where(better, mask_now, best["mask"])
        best_iter.copy_(torch.where(better, torch.full_like(best_iter, it), best_iter))
        best_loss = torch.minimum(loss, best_loss)

    structured = pattern.structured and nowag_loss > 0
    for it in range(1, n_iters + 2):
        core = w_prime * mask
        residual = w_bar - reconstruct_normalized(a, core, b)
        loss = _weighted_sq(residual, h)
        done = it - 1  # `loss` is that of the iterate after `done` iterations
        if done > 0:
            track_best(loss.detach(), done, core.detach(), mask)
            if log_pos < len(log_iters) and log_iters[log_pos] == done:
                losses[log_pos] = loss.detach()
                times[log_pos] = time.perf_counter() - start
                log_pos += 1
        if it > n_iters:
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if not structured:
            continue
        with torch.no_grad():
            core = (w_prime * mask).contiguous()
            residual = w_bar - reconstruct_normalized(a, core, b)
            grad = core_gradient(residual, a, b, h)
            rows, groups = select_groups(grad, d_b, pattern.m, config.selection, generator)
            sparse_core_step(core, mask, a, b, h, grad, pattern.n, pattern.m, rows, groups)
            # Write the re-solved groups back into W' (off-mask values of W' are unused).
            w_prime.copy_(torch.where(mask, core, w_prime))

    history = (losses / nowag_loss) if nowag_loss > 0 else torch.zeros_like(losses)
    a_blocks = row_norm.reshape(p, d_b, 1) * best["a"]
    b_blocks = best["b"] * col_norm.reshape(q, 1, d_b)
    out_dtype = weight.dtype
    return ArmorFactors(
        a_blocks=a_blocks.to(out_dtype),
        core=best["core"].to(out_dtype),
        b_blocks=b_blocks.to(out_dtype),
        mask=best["mask"],
        pattern=str(pattern),
        history=history.detach().cpu().double(),
        history_iters=torch.tensor(log_iters, dtype=torch.long),
        history_time_s=times,
        nowag_loss=float(nowag_loss),
        best_iter=int(best_iter),
    )
