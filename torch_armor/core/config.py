"""Configuration for ARMOR factorization: sparsity patterns and optimizer settings."""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, field
import fnmatch
from typing import Mapping, Optional, Tuple, Union

import torch

__all__ = ["SparsityPattern", "ArmorConfig", "parse_pattern"]

_SELECTIONS = ("l1-random", "l2-random", "l1-greedy", "random", "decrease-greedy", "mixed")
_DEFAULT_SELECTION = {"adam": "l1-random", "bcd": "mixed"}
_OPTIMIZERS = ("adam", "bcd")
_FLOAT_DTYPES = (torch.float32, torch.float64)
_DEFAULT_ITERS = {"adam": 1000, "bcd": 30}
_REFINES = ("output", None)
_NAMED_BLOCK_SIZES = ("auto", "budget")


def _block_sizes(value) -> Tuple[Tuple[str, int], ...]:
    """``block_sizes`` as a tuple of ``(layer-name pattern, size)`` pairs (a mapping is accepted)."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = tuple((pat, size) for pat, size in items)
    except (TypeError, ValueError):
        raise ValueError(f"block_sizes must map layer-name patterns to block sizes, e.g. {{'*.mlp.*': 8}}, "
                         f"got {value!r}") from None
    for pat, size in pairs:
        if not isinstance(pat, str) or isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"block_sizes entry {pat!r}: {size!r} — expected a layer-name pattern (str) and a "
                             "positive integer block size")
    return pairs


@dataclass(frozen=True)
class SparsityPattern:
    """A sparsity pattern: ``N:M`` semi-structured (keep ``n`` of every ``m``
    consecutive input columns in each row) or unstructured with a ``sparsity`` fraction.

    Example::

        >>> parse_pattern("2:4")
        SparsityPattern(n=2, m=4, sparsity=0.5)
        >>> parse_pattern("unstructured:0.5").structured
        False
    """

    n: int = 2
    m: int = 4
    sparsity: float = 0.5
    structured: bool = field(default=True, repr=False)

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.structured else f"unstructured:{self.sparsity:g}"


def parse_pattern(pattern: Union[str, SparsityPattern]) -> SparsityPattern:
    """Parse ``"N:M"`` (e.g. ``"2:4"``, ``"4:8"``) or ``"unstructured:F"`` (F = fraction pruned)."""
    if isinstance(pattern, SparsityPattern):
        return pattern
    if not isinstance(pattern, str):
        raise ValueError(f"pattern must be a string like '2:4' or 'unstructured:0.5', got {pattern!r}")
    text = pattern.strip().lower()
    if text.startswith("unstructured"):
        _, _, frac = text.partition(":")
        try:
            sparsity = float(frac) if frac else 0.5
        except ValueError:
            raise ValueError(f"pattern {pattern!r}: expected 'unstructured:F' with F a number in (0, 1)") from None
        if not 0.0 < sparsity < 1.0:
            raise ValueError(f"pattern {pattern!r}: the pruned fraction must lie strictly between 0 and 1")
        return SparsityPattern(n=0, m=0, sparsity=sparsity, structured=False)
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"pattern {pattern!r}: expected 'N:M' such as '2:4', or 'unstructured:0.5'")
    n, m = int(parts[0]), int(parts[1])
    if not 0 < n < m:
        raise ValueError(f"pattern {pattern!r}: need 0 < N < M (keep N of every M weights)")
    if m > 16:
        raise ValueError(f"pattern {pattern!r}: M > 16 makes C(M, N) supports per group too many to enumerate")
    return SparsityPattern(n=n, m=m, sparsity=1.0 - n / m, structured=True)


_Block = Union[int, str]


@dataclass(frozen=True)
class ArmorConfig:
    """Settings for :func:`torch_armor.core.factorize` (one linear layer), immutable.

    The defaults are THE defaults of torch_armor (the sparsifier, :func:`~torch_armor.prune_model`,
    ``torch-armor prune`` and ``torch-armor demo`` all start from ``ArmorConfig()``): block size
    16, 2:4, ``"bcd"``, 30 sweeps per layer. A fixed number of sweeps, not a time budget, so
    the result does not depend on the machine's load (bit-identical for the same thread count);
    the cost grows with ``d_out·d_in·d_b``.

    Fields hold what was given; ``None`` means "derive it", and the derived values are
    read-only properties (:attr:`sparsity`, :attr:`iterations`, :attr:`group_updates_per_sweep`,
    :attr:`selection_rule`), so ``dataclasses.replace(cfg, block_size=32)`` gets block 32's
    defaults. :meth:`for_layer` resolves the config for one layer's shape.

    Args:
        block_size: size ``d_b`` of the diagonal blocks of ``A`` and ``B`` (default 16); must
            divide both ``d_out`` and ``d_in`` of every layer it is applied to. ``"auto"``:
            per layer (:meth:`for_layer`), the largest valid block size whose wrappers add at
            most ``max_overhead`` parameters. ``"budget"``: one overhead budget for the whole
            model — :func:`~torch_armor.prune_model` gives each layer the block size that buys
            the most loss within ``max_overhead`` of all the pruned weights
            (:mod:`torch_armor.engine.allocate`) and writes the choice into ``block_sizes``.
        block_sizes: per-layer block sizes, ``{layer-name pattern: size}`` (``fnmatch`` patterns,
            e.g. ``{"*.mlp.*": 8}``; the first match wins; stored as a tuple of pairs); layers
            that match none get ``block_size``.
        pattern: ``"2:4"`` (default), any ``"N:M"`` with ``M`` dividing ``block_size``,
            or ``"unstructured:F"``.
        num_iters: iterations (``None``: the optimizer's default, see :attr:`iterations`): for
            ``"adam"``, (Adam step, sparse-core step) pairs (default 1000); for ``"bcd"``,
            sweeps (default 30). Optimization also stops at ``time_budget_s`` or when a logged
            step improves the loss by less than ``tol``.
        optimizer: ``"bcd"`` (default) or ``"adam"`` — the paper's joint Adam on ``A``, ``B``, ``W'``, one sparse-core
            group per tile per iteration; ``"bcd"`` — exact block-coordinate sweeps: closed-form
            ``A`` and ``B``, preconditioned CG on the kept core values, then
            ``group_updates`` exact sparse-core group updates per tile.
        lr: Adam learning rate (paper: 1e-4).
        time_budget_s: stop after this much wall time per layer (``None``: no limit).
        tol: stop when the relative loss improves by less than this between two logged
            points (0: never stop early).
        cg_steps: conjugate-gradient steps on the core per ``"bcd"`` sweep.
        group_updates: sparse-core group updates per tile per ``"bcd"`` sweep
            (``None``: ``max(1, block_size // 2)``, see :attr:`group_updates_per_sweep`).
        ridge: relative proximal ridge of the ``"bcd"`` closed-form solves.
        selection: how each tile picks the groups its sparse-core steps update (see
            :func:`~torch_armor.core.sparse_core.select_groups`; ``None``: the optimizer's
            default, see :attr:`selection_rule`): ``"l1-random"`` (paper; default
            for ``"adam"``), ``"l2-random"``, ``"l1-greedy"``, ``"random"``,
            ``"decrease-greedy"`` (the groups whose step alone would lower the loss most) or
            ``"mixed"`` (half each of ``"decrease-greedy"`` and ``"l1-random"``; default for
            ``"bcd"``, measured by ``python benchmarks/optimizer.py selection``).
        seed: seed of the group selection; the same seed gives bit-identical factors on CPU.
        device: where to optimize (``None``: the weight's device).
        dtype: optimization dtype, ``torch.float32`` (default) or ``torch.float64``.
            Half-precision weights are always optimized in this dtype and returned in theirs.
        log_every: record the relative proxy loss every this many iterations (1 = all).
        max_overhead: wrapper-overhead budget of ``block_size="auto"``: the extra parameters
            ``d_b·(d_out + d_in)`` as a fraction of the layer's ``d_out·d_in`` (default 0.05).
        refine: ``"output"`` (default): after the optimizer, refine ``A``, the kept core values
            and ``B`` (mask fixed) under the output-space loss ``tr((W − Ŵ) H (W − Ŵ)ᵀ)``,
            ``H = XᵀX`` (:func:`torch_armor.core.refine.refine_output`) — wherever ``XᵀX`` is
            known: :func:`~torch_armor.prune_model` and the sparsifiers collect it, a direct
            :func:`~torch_armor.factorize` call refines when given ``xtx=``. ``None``: off.
        refine_rounds: alternations of exact ``A`` / CG on the core / CG on ``B`` (default 3).
        refine_cg_steps: CG steps per core and ``B`` update (default 30).
        refine_damp: dampening of ``H`` as a fraction of its mean diagonal (default 0.01).
        reconstruct_steps: block reconstruction in :func:`~torch_armor.prune_model` (default 8;
            0: off; the sparsifiers, which see no blocks, ignore it): after a decoder block's
            linears are factorized, this many Adam steps (one calibration batch each) on the
            block's ``A``, ``B`` and kept core values, masks fixed, towards the dense block's
            outputs (:mod:`torch_armor.engine.reconstruct`).
        reconstruct_lr: Adam's step relative to each factor's RMS (default 5e-3).

    Example::

        >>> cfg = ArmorConfig()
        >>> cfg.block_size, cfg.optimizer, cfg.iterations, cfg.group_updates_per_sweep, cfg.selection_rule
        (16, 'bcd', 30, 8, 'mixed')
        >>> import dataclasses
        >>> dataclasses.replace(cfg, block_size=32).group_updates_per_sweep
        16
        >>> ArmorConfig(block_size="auto").for_layer(576, 1536).block_size
        16
    """

    block_size: _Block = 16
    pattern: str = "2:4"
    num_iters: Optional[int] = None
    optimizer: str = "bcd"
    lr: float = 1e-4
    time_budget_s: Optional[float] = None
    tol: float = 0.0
    cg_steps: int = 2
    group_updates: Optional[int] = None
    ridge: float = 1e-6
    selection: Optional[str] = None
    seed: int = 0
    device: Optional[Union[str, torch.device]] = None
    dtype: torch.dtype = torch.float32
    log_every: int = 1
    max_overhead: float = 0.05
    block_sizes: Tuple[Tuple[str, int], ...] = ()
    refine: Optional[str] = "output"
    refine_rounds: int = 3
    refine_cg_steps: int = 30
    refine_damp: float = 0.01
    reconstruct_steps: int = 8
    reconstruct_lr: float = 5e-3

    def __post_init__(self) -> None:
        auto = self.block_size in _NAMED_BLOCK_SIZES
        object.__setattr__(self, "block_sizes", _block_sizes(self.block_sizes))
        if not auto and (not isinstance(self.block_size, int) or isinstance(self.block_size, bool)
                         or self.block_size < 1):
            raise ValueError(f"block_size must be a positive integer, 'auto' or 'budget', got {self.block_size!r}")
        sparsity = parse_pattern(self.pattern)
        object.__setattr__(self, "pattern", str(sparsity))  # the one normalization: "2:4", "unstructured:0.5"
        if not auto and sparsity.structured and self.block_size % sparsity.m != 0:
            raise ValueError(
                f"block_size={self.block_size} is not a multiple of M={sparsity.m} in pattern "
                f"{self.pattern!r}: groups must not straddle tiles; pick a block size divisible by {sparsity.m}"
            )
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {_OPTIMIZERS}, got {self.optimizer!r}")
        if self.num_iters is not None and (not isinstance(self.num_iters, int) or isinstance(self.num_iters, bool)
                                           or self.num_iters < 0):
            raise ValueError(f"num_iters must be a non-negative integer or None, got {self.num_iters!r}")
        if self.time_budget_s is not None and not (self.time_budget_s > 0):
            raise ValueError(f"time_budget_s must be positive seconds or None, got {self.time_budget_s!r}")
        if not (isinstance(self.tol, (int, float)) and 0.0 <= self.tol < 1.0):
            raise ValueError(f"tol must be in [0, 1), got {self.tol!r}")
        if not isinstance(self.cg_steps, int) or self.cg_steps < 0:
            raise ValueError(f"cg_steps must be a non-negative integer, got {self.cg_steps!r}")
        if self.group_updates is not None and (not isinstance(self.group_updates, int) or self.group_updates < 0):
            raise ValueError(f"group_updates must be a non-negative integer or None, got {self.group_updates!r}")
        if not (isinstance(self.ridge, (int, float)) and 0.0 <= self.ridge < 1.0):
            raise ValueError(f"ridge must be in [0, 1), got {self.ridge!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if self.selection is not None and self.selection not in _SELECTIONS:
            raise ValueError(f"selection must be one of {_SELECTIONS} or None, got {self.selection!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2**63 - 1] (torch generators), got {self.seed!r}")
        if self.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"dtype must be torch.float32 or torch.float64 for optimization, got {self.dtype}; "
                "half-precision weights are optimized in fp32 and returned in their own dtype"
            )
        if not isinstance(self.log_every, int) or self.log_every < 1:
            raise ValueError(f"log_every must be a positive integer, got {self.log_every!r}")
        if (isinstance(self.max_overhead, bool) or not isinstance(self.max_overhead, (int, float))
                or not self.max_overhead > 0):
            raise ValueError(f"max_overhead must be a positive fraction (0.05 = 5%), got {self.max_overhead!r}")
        if self.refine not in _REFINES:
            raise ValueError(f"refine must be one of {_REFINES}, got {self.refine!r}")
        if not (isinstance(self.reconstruct_lr, (int, float)) and math.isfinite(self.reconstruct_lr)
                and self.reconstruct_lr > 0):
            raise ValueError(f"reconstruct_lr must be a positive finite number, got {self.reconstruct_lr!r}")
        for key in ("refine_rounds", "refine_cg_steps", "reconstruct_steps"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
        if (isinstance(self.refine_damp, bool) or not isinstance(self.refine_damp, (int, float))
                or not 0.0 <= self.refine_damp < 1.0):
            raise ValueError(f"refine_damp must be in [0, 1), got {self.refine_damp!r}")

    # -- derived values ------------------------------------------------------------------------
    @property
    def sparsity(self) -> SparsityPattern:
        """The parsed :attr:`pattern`."""
        return parse_pattern(self.pattern)

    @property
    def iterations(self) -> int:
        """``num_iters`` if given, else the optimizer's default (``"bcd"``: 30 sweeps, ``"adam"``: 1000 steps)."""
        return self.num_iters if self.num_iters is not None else _DEFAULT_ITERS[self.optimizer]

    @property
    def group_updates_per_sweep(self) -> int:
        """``group_updates`` if given, else ``max(1, block_size // 2)``.

        Raises:
            ValueError: ``block_size`` is ``"auto"`` and ``group_updates`` is not set: resolve
                the block size with :meth:`for_layer` first.
        """
        if self.group_updates is not None:
            return self.group_updates
        if self.block_size in _NAMED_BLOCK_SIZES:
            raise ValueError(f"block_size={self.block_size!r} is chosen per layer: call config.for_layer(d_out, d_in) first")
        return max(1, self.block_size // 2)

    @property
    def selection_rule(self) -> str:
        """``selection`` if given, else the optimizer's default (``"bcd"``: ``"mixed"``, ``"adam"``: ``"l1-random"``)."""
        return self.selection if self.selection is not None else _DEFAULT_SELECTION[self.optimizer]

    # -- per layer -----------------------------------------------------------------------------
    def for_layer(self, d_out: int, d_in: int, name: Optional[str] = None) -> "ArmorConfig":
        """This config for one ``(d_out, d_in)`` layer: a concrete integer block size
        (``"auto"``: the largest valid one within ``max_overhead``, see
        :func:`~torch_armor.core.proxy.auto_block_size`), checked against the shape.

        Returns ``self`` when the block size is already an integer that fits.

        Raises:
            ValueError: the pattern or block size cannot serve this shape; the message names
                the layer (``name``) and the block sizes that would fit.

        Example::

            >>> ArmorConfig(block_size="auto", max_overhead=0.05).for_layer(4096, 4096).block_size
            64
            >>> ArmorConfig(block_size=32).for_layer(48, 32, name="fc")
            Traceback (most recent call last):
            ...
            ValueError: layer 'fc': block_size=32 does not divide the weight shape (48, 32); block sizes that fit this layer: [4, 8, 16]
        """
        from torch_armor.core.proxy import auto_block_size, check_layer_shape

        sparsity = self.sparsity
        chosen = next((size for pat, size in self.block_sizes if name is not None and fnmatch.fnmatchcase(name, pat)),
                      None)
        if chosen is not None:
            check_layer_shape(d_out, d_in, sparsity, chosen, name=name)
            return dataclasses.replace(self, block_size=chosen)
        if self.block_size == "budget":
            raise ValueError(
                f"layer {name!r}: block_size='budget' is one overhead budget for the whole model, resolved by "
                "prune_model (torch_armor.engine.allocate); give this layer a size in block_sizes, or use "
                "block_size='auto' (per layer) or an integer")
        if self.block_size == "auto":
            check_layer_shape(d_out, d_in, sparsity, None, name=name)
            try:
                block = auto_block_size(d_out, d_in, self.max_overhead, sparsity.m if sparsity.structured else 1)
            except ValueError as err:
                raise ValueError(f"layer {name!r}: {err}" if name else str(err)) from None
            return dataclasses.replace(self, block_size=block)
        check_layer_shape(d_out, d_in, sparsity, self.block_size, name=name)
        return self
