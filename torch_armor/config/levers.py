"""The levers of :class:`~torch_armor.config.armor.ArmorConfig`, one frozen config each.

* the per-layer optimizer: :class:`BcdConfig` (default) or :class:`AdamConfig` (the paper's);
* output-space refinement: :class:`RefineConfig` (``ArmorConfig(refine=None)``: off);
* block reconstruction: :class:`ReconstructConfig` (``ArmorConfig(reconstruct=None)``: off);
* end-to-end distillation: :class:`DistillConfig` (the default; ``ArmorConfig(distill=None)``: off).

A new setting of a lever is a new field with a default here; :meth:`ArmorConfig.to_dict
<torch_armor.config.armor.ArmorConfig.to_dict>` serializes the levers nested
(:mod:`torch_armor.config.serialized`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Union

from torch_armor.config.serialized import serializable
from torch_armor.config.methods import check_count, check_fraction
from torch_armor.errors import ArmorInputError

__all__ = ["BcdConfig", "AdamConfig", "RefineConfig", "ReconstructConfig", "DistillConfig", "DECAYS", "RECONSTRUCT_TARGETS",
           "Optimizer",
           "OPTIMIZERS", "SELECTIONS", "DEFAULT_REFINE", "DEFAULT_RECONSTRUCT"]

#: How a tile picks the groups its sparse-core steps update
#: (:func:`~torch_armor.core.sparse_core.select_groups`).
SELECTIONS = ("l1-random", "l2-random", "l1-greedy", "random", "decrease-greedy", "mixed")


class _Loop:
    """What the optimizers share: iterations, group selection, the stopping rules, logging."""

    iters: int
    selection: Optional[str]
    time_budget_s: Optional[float]
    tol: float
    log_every: int
    default_selection: ClassVar[str]

    def _check_loop(self) -> None:
        owner = type(self).__name__
        check_count(owner, "iters", self.iters)
        if self.selection is not None and self.selection not in SELECTIONS:
            raise ArmorInputError(f"{owner}.selection must be one of {SELECTIONS} or None, got {self.selection!r}")
        budget = self.time_budget_s
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0):
            raise ArmorInputError(f"{owner}.time_budget_s must be positive seconds or None, got {self.time_budget_s!r}")
        check_fraction(owner, "tol", self.tol)
        check_count(owner, "log_every", self.log_every, minimum=1)

    @property
    def iterations(self) -> int:
        """Iterations per layer (BCD: sweeps; Adam: steps)."""
        return self.iters

    @property
    def selection_rule(self) -> str:
        """``selection`` if given, else the optimizer's default (BCD: ``"mixed"``, Adam: ``"l1-random"``)."""
        return self.selection if self.selection is not None else self.default_selection


@serializable
@dataclass(frozen=True)
class BcdConfig(_Loop):
    """Exact block-coordinate sweeps (the default optimizer): closed-form ``A`` and ``B``,
    preconditioned CG on the kept core values, then exact sparse-core group updates.

    Args:
        iters: sweeps per layer (default 20).
        cg_steps: CG steps on the core per sweep.
        group_updates: sparse-core group updates per tile per sweep (``None``: ``max(1, d_b // 2)``,
            see :meth:`group_updates_per_sweep`).
        ridge: relative proximal ridge of the closed-form solves.
        selection: how each tile picks its groups (``None``: ``"mixed"``, see :attr:`selection_rule`;
            one of :data:`SELECTIONS`).
        time_budget_s: also stop after this much wall time per layer (``None``: no limit).
        tol: stop when the relative loss improves by less than this between two logged points.
        log_every: record the relative proxy loss every this many sweeps.

    Example::

        >>> BcdConfig().group_updates_per_sweep(16), BcdConfig(group_updates=3).group_updates_per_sweep(16)
        (8, 3)
    """

    iters: int = 20
    cg_steps: int = 2
    group_updates: Optional[int] = None
    ridge: float = 1e-6
    selection: Optional[str] = None
    time_budget_s: Optional[float] = None
    tol: float = 0.0
    log_every: int = 1

    name: ClassVar[str] = "bcd"
    default_selection: ClassVar[str] = "mixed"

    def __post_init__(self) -> None:
        self._check_loop()
        check_count("BcdConfig", "cg_steps", self.cg_steps)
        if self.group_updates is not None:
            check_count("BcdConfig", "group_updates", self.group_updates)
        check_fraction("BcdConfig", "ridge", self.ridge)

    def group_updates_per_sweep(self, block_size: int) -> int:
        """``group_updates`` if given, else ``max(1, block_size // 2)``."""
        if self.group_updates is not None:
            return self.group_updates
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise ArmorInputError(f"block_size={block_size!r} is chosen per layer: call config.for_layer(d_out, d_in) "
                                  "first")
        return max(1, block_size // 2)


@serializable
@dataclass(frozen=True)
class AdamConfig(_Loop):
    """The paper's optimizer: one joint Adam step on ``A``, ``B``, ``W'`` and one sparse-core group
    per tile per iteration.

    Args:
        iters: (Adam step, sparse-core step) pairs per layer (default 1000).
        lr: Adam's learning rate (paper: 1e-4).
        selection, time_budget_s, tol, log_every: as in :class:`BcdConfig` (default selection
            ``"l1-random"``).
    """

    iters: int = 1000
    lr: float = 1e-4
    selection: Optional[str] = None
    time_budget_s: Optional[float] = None
    tol: float = 0.0
    log_every: int = 1

    name: ClassVar[str] = "adam"
    default_selection: ClassVar[str] = "l1-random"

    def __post_init__(self) -> None:
        self._check_loop()
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not (math.isfinite(self.lr)
                                                                                      and self.lr > 0):
            raise ArmorInputError(f"AdamConfig.lr must be a positive finite number, got {self.lr!r}")



@serializable
@dataclass(frozen=True)
class RefineConfig:
    """Output-space refinement after the optimizer: ``A``, the kept core values and ``B`` (mask
    fixed) re-fitted under ``tr((W − Ŵ) H (W − Ŵ)ᵀ)``, ``H = XᵀX``
    (:func:`torch_armor.core.refine.refine_output`), wherever ``XᵀX`` is known.

    Args:
        rounds: alternations of exact ``A`` / CG on the core / CG on ``B``.
        cg_steps: CG steps per core and ``B`` update.
        damp: dampening of ``H`` as a fraction of its mean diagonal.
        core_steps: full-``H`` sparse-core steps after the rounds (one group per ``d_b × d_b`` tile
            each, the mask may change; :mod:`torch_armor.core.sparse_core_fullh`), followed by
            ``rounds`` more rounds on the new mask; 0 (default): off.
    """

    rounds: int = 3
    cg_steps: int = 30
    damp: float = 0.01
    core_steps: int = 0

    def __post_init__(self) -> None:
        check_count("RefineConfig", "rounds", self.rounds)
        check_count("RefineConfig", "core_steps", self.core_steps)
        check_count("RefineConfig", "cg_steps", self.cg_steps)
        check_fraction("RefineConfig", "damp", self.damp)


#: How block reconstruction's learning rate decays after the warm-up (:func:`~torch_armor.armor.reconstruct.lr_factor`).
DECAYS = ("cosine", "linear", "constant")
#: :attr:`ReconstructConfig.target` values: ``"block"``, the dense block's output on the inputs
#: that reach it (the pruned stream); ``"model"``, the dense model's own hidden states after the
#: block (the dense stream), so that each block also makes up for the error it inherits.
RECONSTRUCT_TARGETS = ("block", "model")


@serializable
@dataclass(frozen=True)
class ReconstructConfig:
    """Block reconstruction in :func:`~torch_armor.prune_model` (the sparsifiers, which see no
    blocks, skip it): after a decoder block's linears are factorized, Adam on the block's ``A``,
    ``B`` and kept core values, masks fixed, towards the dense block's outputs on the pruned
    stream (:mod:`torch_armor.armor.reconstruct`).

    Args:
        steps: Adam steps per block (``ArmorConfig(reconstruct=None)`` turns reconstruction off);
            the steps walk epochs over the training micro-batches, each epoch in a new seeded order.
        lr: Adam's peak step relative to each factor's RMS.
        micro_batch: calibration windows per step (``None``: each calibration batch as it is);
            a step on 1 window costs about a quarter of one on 4 (the default, 1: the steps
            within the default's time; docs/results.md).
        warmup: fraction of the steps with a linear learning-rate warm-up from ``lr / warmup_steps``.
        decay: the learning rate after the warm-up, one of :data:`DECAYS` (``"cosine"``: to near 0).
        held_out: calibration windows never trained on; their error decides the kept iterate
            (at least one window is always trained on).
        checks: held-out evaluations per block (evenly spaced; the last step is always checked).
        patience: stop after this many checks in a row without a better held-out error
            (``None``: run every step).
        split_stages: one stage per top-level submodule (attention, then MLP), each with half of
            the steps and its own optimizer, instead of one joint stage.
        target: what the block's output is fitted to, one of :data:`RECONSTRUCT_TARGETS`:
            ``"block"``, the dense block's output on the pruned model's hidden states; ``"model"``,
            the dense model's hidden states after the block (the same thing in a one-shot prune,
            whose blocks see the dense model's inputs).
    """

    steps: int = 32
    lr: float = 5e-3
    micro_batch: Optional[int] = 1
    warmup: float = 0.1
    decay: str = "cosine"
    held_out: int = 4
    checks: int = 4
    patience: Optional[int] = None
    split_stages: bool = False
    target: str = "block"

    def __post_init__(self) -> None:
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ArmorInputError(f"ReconstructConfig.steps must be a positive integer, got {self.steps!r}; "
                                  "ArmorConfig(reconstruct=None) turns reconstruction off")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not (math.isfinite(self.lr)
                                                                                      and self.lr > 0):
            raise ArmorInputError(f"ReconstructConfig.lr must be a positive finite number, got {self.lr!r}")
        if self.micro_batch is not None:
            check_count("ReconstructConfig", "micro_batch", self.micro_batch, minimum=1)
        check_fraction("ReconstructConfig", "warmup", self.warmup)
        if self.decay not in DECAYS:
            raise ArmorInputError(f"ReconstructConfig.decay must be one of {DECAYS}, got {self.decay!r}")
        check_count("ReconstructConfig", "held_out", self.held_out, minimum=1)
        check_count("ReconstructConfig", "checks", self.checks, minimum=1)
        if self.patience is not None:
            check_count("ReconstructConfig", "patience", self.patience, minimum=1)
        if not isinstance(self.split_stages, bool):
            raise ArmorInputError(f"ReconstructConfig.split_stages must be True or False, got {self.split_stages!r}")
        if self.target not in RECONSTRUCT_TARGETS:
            raise ArmorInputError(f"ReconstructConfig.target must be one of {RECONSTRUCT_TARGETS}, got {self.target!r}")


def _positive_int(owner: str, name: str, value: object, minimum: int = 1, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArmorInputError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}{hint}")


@serializable
@dataclass(frozen=True)
class DistillConfig:
    """End-to-end distillation in :func:`~torch_armor.prune_model` (streamed checkpoints one block at a time): after
    the block pass, Adam on every ARMOR layer's ``A`` and ``B`` (and, with ``train_core``, the kept
    core values; masks fixed) towards the dense model's next-token distributions, measured by the
    KL divergence on the calibration windows (:mod:`torch_armor.armor.distill`). The dense model's
    top-``top_k`` log-probabilities (and the rest's total) are cached before pruning; the last
    ``held_out`` windows are never trained on and decide which iterate is kept.

    Args:
        steps: Adam steps, ``windows_per_step`` training windows each (seeded order).
        lr: Adam's step relative to each tensor's RMS.
        windows_per_step: calibration windows per step (the micro-batch).
        held_out: calibration windows kept out of training, for the kept iterate.
        top_k: dense log-probabilities cached per token (the KL is taken over these ``top_k``
            tokens and one bin for the rest: a lower bound of the full KL, exact at the vocabulary size).
        eval_every: measure the held-out KL every this many steps (and after the last).
        train_core: also train the kept core values (masks stay fixed).
        warmup: fraction of the steps with a linear learning-rate warm-up (0: none).
        decay: the learning rate after the warm-up, one of :data:`DECAYS` (as block reconstruction's).
        sampled_windows: extra training windows sampled from the dense model itself (temperature 1,
            seeded, as long as the calibration windows), so that the wrappers are fitted to the
            model's own distribution and not only to the calibration text; held-out windows stay
            calibration windows. Needs a model with transformers' ``generate``. 0: none.
        sample_prompt_tokens: each sampled window starts with this many of a training window's first
            tokens and the dense model continues it (1: from its first token alone; more keeps the
            samples on the calibration text's subjects). Below the window length.
        sampled_in_block_pass: the sampled windows also calibrate the block pass, placed before the
            calibration windows: every layer's statistics and block reconstruction's training steps
            see them (held-out windows stay calibration windows). Needs ``sampled_windows``.
        bf16_steps: run the training steps' forward and backward under bfloat16 autocast (the
            weights, Adam and the held-out checks that choose the kept iterate stay float32); on a
            device without fast bfloat16 matrix products the steps run in float32 (logged once).
    """

    steps: int = 16
    lr: float = 1e-3
    windows_per_step: int = 2
    held_out: int = 4
    top_k: int = 64
    eval_every: int = 4
    train_core: bool = False
    warmup: float = 0.0
    decay: str = "constant"
    sampled_windows: int = 0
    sample_prompt_tokens: int = 1
    sampled_in_block_pass: bool = False
    bf16_steps: bool = False

    def __post_init__(self) -> None:
        owner = "DistillConfig"
        _positive_int(owner, "steps", self.steps, hint="; ArmorConfig(distill=None) turns distillation off")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not (math.isfinite(self.lr)
                                                                                      and self.lr > 0):
            raise ArmorInputError(f"DistillConfig.lr must be a positive finite number, got {self.lr!r}")
        _positive_int(owner, "windows_per_step", self.windows_per_step)
        _positive_int(owner, "held_out", self.held_out)
        _positive_int(owner, "top_k", self.top_k)
        _positive_int(owner, "eval_every", self.eval_every)
        if not isinstance(self.train_core, bool):
            raise ArmorInputError(f"DistillConfig.train_core must be True or False, got {self.train_core!r}")
        if not isinstance(self.bf16_steps, bool):
            raise ArmorInputError(f"DistillConfig.bf16_steps must be True or False, got {self.bf16_steps!r}")
        check_fraction(owner, "warmup", self.warmup)
        if self.decay not in DECAYS:
            raise ArmorInputError(f"DistillConfig.decay must be one of {DECAYS}, got {self.decay!r}")
        _positive_int(owner, "sampled_windows", self.sampled_windows, minimum=0)
        _positive_int(owner, "sample_prompt_tokens", self.sample_prompt_tokens)
        if not isinstance(self.sampled_in_block_pass, bool):
            raise ArmorInputError("DistillConfig.sampled_in_block_pass must be True or False, got "
                                  f"{self.sampled_in_block_pass!r}")
        if self.sampled_in_block_pass and not self.sampled_windows:
            raise ArmorInputError("DistillConfig.sampled_in_block_pass=True needs windows to pass: set "
                                  "sampled_windows to a positive count")


Optimizer = Union[BcdConfig, AdamConfig]
#: The optimizers by name (``"bcd"``, ``"adam"``: the command line's ``--optimizer``).
OPTIMIZERS = {kind.name: kind for kind in (BcdConfig, AdamConfig)}
#: The refinement and reconstruction of ``ArmorConfig()``: one refinement round and 64 reconstruction
#: steps (its time moved from the factorization into reconstruction, chosen on held-out calibration
#: text: docs/results.md); ``RefineConfig()`` / ``ReconstructConfig()`` alone keep 3 rounds / 32 steps.
DEFAULT_REFINE = RefineConfig(rounds=1)
DEFAULT_RECONSTRUCT = ReconstructConfig(steps=64)
