"""Block reconstruction: tune a decoder block's ARMOR factors so its output matches the dense block's.

Per-layer objectives do not see the block: how errors in ``q``/``k``/``v`` pass through the
softmax, or in ``gate``/``up`` through the SiLU product. ARMOR is well placed to fix that after
the fact: with the masks fixed, ``A``, ``B`` and the kept core values are continuous, so Adam on
the block's output error applies (as block-wise reconstruction does for quantization: BRECQ,
OmniQuant). The dense weights are swapped for ``Ŵ = A · (core ⊙ M) · B`` built from leaf tensors
(``torch.func.functional_call``; the block itself is not modified).

The loop (:class:`~torch_armor.config.levers.ReconstructConfig`): ``steps`` Adam steps walking
epochs over the training micro-batches (a new seeded order each epoch), a linear warm-up then a
cosine/linear decay of the step size, ``checks`` evaluations of the relative error on held-out
calibration windows — the best held-out iterate is kept (the input factors if none is better), so
reconstruction never makes the held-out error worse — with optional early stopping and optional
separate stages (attention, then MLP).

Memory: the trainable tensors are the kept core values only (half the core at 2:4), Adam runs
per tensor (no multi-tensor temporaries), a step's gradient is accumulated one window at a time
(one window's activations alive, not the micro-batch's), each linear's ``Ŵ`` and its matmul are one
checkpointed function (the graph keeps the linear's input, not ``Ŵ``, which the backward pass rebuilds:
:class:`~torch_armor.armor.reconstruct_weights.FactoredLinears`), and a snapshot is taken only
when the held-out error improves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Sequence, Tuple

import torch
from torch import nn
from torch.func import functional_call

from torch_armor.calibration.blocks import BlockInput, to_device as _to
from torch_armor.core.factors import ArmorFactors
from torch_armor.config.levers import ReconstructConfig
from torch_armor.armor.reconstruct_data import Unit, set_scheduled_lr, split_windows, take_rows
from torch_armor.armor.reconstruct_weights import (FactoredLinears, FactorLeaves, build_weights, expert_layouts,
                                                    weight_names)
from torch_armor.errors import ArmorInputError

__all__ = ["Reconstruction", "reconstruct_block", "stages_of"]


@dataclass
class Reconstruction:
    """What :func:`reconstruct_block` returns.

    Attributes:
        factors: the kept factors (masks unchanged; the input factors if no step helped).
        before, after: the held-out relative output error ``‖Y − Y_dense‖² / ‖Y_dense‖²`` of the
            input and of the kept factors.
        curve: ``(step, held-out error)`` at step 0 and at every check.
        steps: the Adam steps taken (fewer than configured after an early stop).
    """

    factors: Dict[str, ArmorFactors]
    before: float
    after: float
    curve: List[Tuple[int, float]] = field(default_factory=list)
    steps: int = 0


def _output(block: nn.Module, weights: Dict[str, torch.Tensor], inp: BlockInput, device: torch.device) -> torch.Tensor:
    out = functional_call(block, weights, (inp.hidden.to(device=device, dtype=torch.float32),),
                          _to(inp.kwargs, device), strict=False)
    return out[0] if isinstance(out, (tuple, list)) else out


def _error(block, weights, inp, target, device) -> torch.Tensor:
    """``‖Y − Y_dense‖²`` of one unit."""
    return (_output(block, weights, inp, device) - target.to(device=device, dtype=torch.float32)).square().sum()


def _squared(block, weights, inp, target, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(‖Y − Y_dense‖², ‖Y_dense‖²)`` of one unit."""
    target = target.to(device=device, dtype=torch.float32)  # once: _error's conversion is then a no-op
    return _error(block, weights, inp, target, device), target.square().sum()


def stages_of(names: Sequence[str]) -> List[List[str]]:
    """The factor names grouped by their first component (``self_attn``, ``mlp``, …), in order."""
    stages: Dict[str, List[str]] = {}
    for name in names:
        stages.setdefault(name.split(".", 1)[0], []).append(name)
    return list(stages.values())


def reconstruct_block(block: nn.Module, factors: Mapping[str, ArmorFactors], inputs: Sequence[BlockInput],
                      targets: Sequence[torch.Tensor], config: ReconstructConfig = ReconstructConfig(), *,
                      device: torch.device = torch.device("cpu"), seed: int = 0,
                      held_out_from: int = 0) -> Reconstruction:
    """Adam on the factors of ``block``'s linears against the dense block's outputs.

    Args:
        block: the decoder block, its linears still holding their dense weights (fp32 compute).
        factors: ``{name inside block: its ArmorFactors}`` (``P.e`` for expert ``e`` of a fused
            3-D parameter ``P``, see :mod:`torch_armor.armor.reconstruct_weights`).
        inputs: the calibration batches that reach the block.
        targets: the dense block's output for each batch.
        config: steps, schedule, micro-batches, held-out windows, stages.
        seed: the held-out windows and the batch order.
        held_out_from: held-out windows are drawn from this window on (in batch order; the
            windows before it, e.g. ones sampled from the dense model, are only trained on).
    """
    if len(inputs) != len(targets) or not inputs:
        raise ArmorInputError(f"reconstruct_block: {len(inputs)} input batches for {len(targets)} targets")
    held, train = split_windows([int(t.shape[0]) for t in targets], config.held_out, config.micro_batch, seed,
                                held_out_from)
    groups = weight_names(block, factors)
    leaves = {n: FactorLeaves(f, device) for n, f in factors.items()}
    layouts = expert_layouts(block, groups)
    with FactoredLinears(block, groups, leaves) as linears:
        return _reconstruct(block, factors, inputs, targets, config, device, seed, held, train, leaves, linears,
                            {p: m for p, m in groups.items() if p not in linears.params}, layouts)


def _reconstruct(block, factors, inputs, targets, config, device, seed, held, train, leaves, linears,
                 groups, layouts) -> Reconstruction:
    """:func:`reconstruct_block`'s loop; ``groups``: the weights built for ``functional_call``, ``layouts``:
    the experts parameters among them stored otherwise than ``(E, out, in)``."""

    def held_out_error() -> float:
        with torch.no_grad():
            weights = build_weights(groups, leaves, trainable=set(), layouts=layouts)
            err = den = 0.0
            for unit in held:
                e, d = _squared(block, weights, *take_rows(inputs[unit.batch], targets[unit.batch], unit), device)
                err, den = err + float(e), den + float(d)
        return err / max(den, torch.finfo(torch.float32).tiny)

    before = best_error = held_out_error()
    curve: List[Tuple[int, float]] = [(0, before)]
    best: Dict[str, List[torch.Tensor]] = {}  # names absent: their input factors (or the last stage's best)
    order: List[int] = []
    generator = torch.Generator().manual_seed(seed)
    stages = stages_of(list(factors)) if config.split_stages else [list(factors)]
    per_stage = max(1, config.steps // len(stages))
    taken = 0
    for stage in stages:
        trainable = linears.trainable = set(stage)
        frozen = None
        if len(stages) > 1:
            frozen = {p: w for p, w in build_weights(groups, leaves, trainable=set(), layouts=layouts).items()
                      if not any(m in trainable for m in groups[p])}
        tensors = [t for n in stage for t in leaves[n].tensors]
        optimizer = torch.optim.Adam([{"params": [t], "lr": config.lr * (float(t.detach().square().mean().sqrt()) or 1.0)}
                                      for t in tensors], foreach=False)
        peaks = [g["lr"] for g in optimizer.param_groups]
        warmup = round(config.warmup * per_stage)
        check_every = max(1, per_stage // config.checks)
        stale = 0
        for step in range(1, per_stage + 1):
            if not order:  # a new epoch over the training micro-batches
                order = torch.randperm(len(train), generator=generator).tolist()
            unit: Unit = train[order.pop(0)]
            set_scheduled_lr(optimizer, peaks, step, per_stage, warmup, config.decay)
            optimizer.zero_grad(set_to_none=True)
            inp, target = take_rows(inputs[unit.batch], targets[unit.batch], unit)
            den = target.to(device=device, dtype=torch.float32).square().sum().clamp_min(torch.finfo(torch.float32).tiny)
            for row in range(target.shape[0]):  # one window's graph at a time: its activations are the big tensors
                one = take_rows(inp, target, Unit(unit.batch, (row,))) if target.shape[0] > 1 else (inp, target)
                err = _error(block, build_weights(groups, leaves, trainable, frozen, layouts), *one, device)
                (err / den).backward()
                del err
            optimizer.step()
            taken += 1
            if step % check_every == 0 or step == per_stage:
                error = held_out_error()
                curve.append((taken, error))
                if error < best_error:
                    best_error, stale = error, 0
                    for n in stage:  # in place: two snapshots are never alive at once
                        if n in best:
                            for kept, t in zip(best[n], leaves[n].tensors):
                                kept.copy_(t.detach())
                        else:
                            best[n] = leaves[n].snapshot()
                else:
                    stale += 1
                    if config.patience is not None and stale >= config.patience:
                        break
        del optimizer
        if len(stages) > 1:  # the next stage starts from the kept iterate
            with torch.no_grad():
                for n in stage:
                    kept = best[n] if n in best else FactorLeaves(factors[n], device).tensors
                    for t, v in zip(leaves[n].tensors, kept):
                        t.copy_(v)
    out = {n: (leaves[n].factors(f, best[n]) if n in best else f) for n, f in factors.items()}
    return Reconstruction(out, before, best_error, curve, taken)
