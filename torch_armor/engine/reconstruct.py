"""Block reconstruction: tune a decoder block's ARMOR factors so its output matches the dense block's.

Per-layer objectives do not see the block: how errors in ``q``/``k``/``v`` pass through the
softmax, or in ``gate``/``up`` through the SiLU product. ARMOR is well placed to fix that after
the fact: with the masks fixed, ``A``, ``B`` and the kept core values are continuous, so plain
Adam on the block's output error applies. The dense weights are swapped for
``Ŵ = A · (core ⊙ M) · B`` built from leaf tensors (``torch.func.functional_call``; the block
itself is not modified), and the best iterate on held-out batches is kept.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Sequence, Tuple

import torch
from torch import nn
from torch.func import functional_call

from torch_armor.calibration.blocks import BlockInput, to_device as _to
from torch_armor.core.blockdiag import block_diag_left, block_diag_right
from torch_armor.core.factors import ArmorFactors
from torch_armor.errors import ArmorInputError

__all__ = ["reconstruct_block"]


def _output(block: nn.Module, weights: Dict[str, torch.Tensor], inp: BlockInput, device: torch.device) -> torch.Tensor:
    out = functional_call(block, weights, (inp.hidden.to(device=device, dtype=torch.float32),),
                          _to(inp.kwargs, device), strict=False)
    return out[0] if isinstance(out, (tuple, list)) else out


def _relative_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().sum() / target.square().sum().clamp_min(torch.finfo(out.dtype).tiny)


def reconstruct_block(block: nn.Module, factors: Mapping[str, ArmorFactors], inputs: Sequence[BlockInput],
                      targets: Sequence[torch.Tensor], *, steps: int, lr: float = 1e-3,
                      device: torch.device = torch.device("cpu"), seed: int = 0,
                      ) -> Tuple[Dict[str, ArmorFactors], float, float]:
    """Adam on the factors of ``block``'s linears against the dense block's outputs.

    Args:
        block: the decoder block, its linears still holding their dense weights (fp32 compute).
        factors: ``{name of a linear inside block: its ArmorFactors}``.
        inputs: the calibration batches that reach the block.
        targets: the dense block's output for each batch.
        steps: Adam steps, one batch each (batches in a seeded random order); held-out: the
            first batch (the last when there is only one) is never trained on and decides
            which iterate is kept.
        lr: step size relative to each tensor's RMS (every factor moves by about ``lr`` of its scale).
        seed: the batch order.

    Returns:
        ``(factors, error_before, error_after)``: the kept factors (masks unchanged; the input
        factors if no step helped) and the held-out relative output error ``‖Y − Y_dense‖² / ‖Y_dense‖²``
        before and after.
    """
    if len(inputs) != len(targets) or not inputs:
        raise ArmorInputError(f"reconstruct_block: {len(inputs)} input batches for {len(targets)} targets")
    held_out = 0
    train = [j for j in range(len(inputs)) if j != held_out] or [held_out]
    leaves: Dict[str, List[torch.Tensor]] = {}
    masks: Dict[str, torch.Tensor] = {}
    groups = []
    for name, f in factors.items():
        # contiguous: factors fresh from the optimizer may be views (e.g. transposed), and the strides
        # pick the kernels — a resumed run reads contiguous copies and must get the same bits
        tensors = [t.detach().to(device=device, dtype=torch.float32).clone(memory_format=torch.contiguous_format)
                   .requires_grad_(True) for t in (f.a_blocks, f.core, f.b_blocks)]
        leaves[name] = tensors
        masks[name] = f.mask.to(device)
        for t in tensors:
            scale = float(t.detach().square().mean().sqrt()) or 1.0
            groups.append({"params": [t], "lr": lr * scale})
    optimizer = torch.optim.Adam(groups)

    def weights() -> Dict[str, torch.Tensor]:
        return {f"{name}.weight": block_diag_right(block_diag_left(a, core * masks[name]), b)
                for name, (a, core, b) in leaves.items()}

    def held_out_error() -> float:
        with torch.no_grad():
            return float(_relative_error(_output(block, weights(), inputs[held_out], device),
                                         targets[held_out].to(device=device, dtype=torch.float32)))

    def snapshot() -> Dict[str, List[torch.Tensor]]:
        return {name: [t.detach().clone() for t in ts] for name, ts in leaves.items()}

    before = best_error = held_out_error()
    best = snapshot()
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    check_every = max(1, steps // 4)
    for step in range(1, steps + 1):
        j = train[order[(step - 1) % len(train)]]
        optimizer.zero_grad(set_to_none=True)
        loss = _relative_error(_output(block, weights(), inputs[j], device),
                               targets[j].to(device=device, dtype=torch.float32))
        loss.backward()
        optimizer.step()
        if step % check_every == 0 or step == steps:
            error = held_out_error()
            if error < best_error:
                best_error, best = error, snapshot()
    out = {}
    for name, f in factors.items():
        a, core, b = best[name]
        out[name] = dataclasses.replace(f, a_blocks=a.to(f.a_blocks.device, f.a_blocks.dtype),
                                        core=(core * masks[name]).to(f.core.device, f.core.dtype),
                                        b_blocks=b.to(f.b_blocks.device, f.b_blocks.dtype))
    return out, before, best_error
