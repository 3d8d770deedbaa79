"""ARMOR's config: :class:`ArmorConfig`, one nested config per lever.

* the per-layer optimizer: :class:`BcdConfig` (default) or :class:`AdamConfig` (the paper's);
* output-space refinement: :class:`RefineConfig`, or ``None`` (off);
* block reconstruction: :class:`ReconstructConfig`, or ``None`` (off);
* end-to-end distillation: :class:`DistillConfig` (the default), or ``None`` (off);
* the allocation of wrapper parameters (``block_size``, ``block_sizes``, ``max_overhead``) and
  the rest stay top level.

Every config is frozen and checked in ``__post_init__``; fields hold what was given and derived
values are read-only properties, so ``dataclasses.replace(cfg, refine=None)`` turns refinement
off and ``dataclasses.replace(cfg, block_size=32)`` gets block 32's defaults.
:meth:`ArmorConfig.to_dict` writes the nested form of :mod:`torch_armor.config.serialized`
(the levers nested in it), which ``config_from_dict`` reads back to an equal config.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import KW_ONLY, dataclass
from typing import Any, Mapping, Optional, Tuple, Union

import torch

from torch_armor.config.serialized import serializable
from torch_armor.config.levers import (DEFAULT_RECONSTRUCT, DEFAULT_REFINE, SELECTIONS, AdamConfig, BcdConfig,
                                     DistillConfig, Optimizer, ReconstructConfig, RefineConfig)
from torch_armor.config.methods import MethodConfig, normalized_pattern
from torch_armor.core.pattern import auto_block_size, candidate_block_sizes, check_layer_shape
from torch_armor.config.presets import preset_changes
from torch_armor.errors import ArmorInputError

__all__ = ["ArmorConfig", "BcdConfig", "AdamConfig", "RefineConfig", "ReconstructConfig", "DistillConfig", "SELECTIONS"]

_FLOAT_DTYPES = (torch.float32, torch.float64)
_NAMED_BLOCK_SIZES = ("auto", "budget")


def _block_sizes(value: Any) -> Tuple[Tuple[str, int], ...]:
    """``block_sizes`` as a tuple of ``(layer-name pattern, size)`` pairs (a mapping is accepted)."""
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = tuple((pat, size) for pat, size in items)
    except (TypeError, ValueError):
        raise ArmorInputError(f"block_sizes must map layer-name patterns to block sizes, e.g. {{'*.mlp.*': 8}}, "
                              f"got {value!r}") from None
    for pat, size in pairs:
        if not isinstance(pat, str) or isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ArmorInputError(f"block_sizes entry {pat!r}: {size!r} — expected a layer-name pattern (str) and a "
                                  "positive integer block size")
    return pairs


_Block = Union[int, str]


@serializable
@dataclass(frozen=True)
class ArmorConfig(MethodConfig):
    """ARMOR's settings, for one layer (:func:`torch_armor.core.factorize.factorize`) or a whole model
    (:func:`torch_armor.prune_model`, the sparsifiers, ``torch-armor prune``), immutable.

    The defaults are THE defaults of torch_armor: block size 16, 2:4, 20 exact sweeps per layer
    (:class:`BcdConfig`), output-space refinement and block reconstruction on. A fixed number of
    sweeps, not a time budget, so the result does not depend on the machine's load
    (bit-identical for the same thread count); the cost grows with ``d_out·d_in·d_b``.

    Args:
        block_size: size ``d_b`` of the diagonal blocks of ``A`` and ``B`` (default 16); must
            divide both ``d_out`` and ``d_in`` of every layer it is applied to. ``"auto"``: per
            layer (:meth:`for_layer`), the largest valid block size whose wrappers add at most
            ``max_overhead`` parameters. ``"budget"``: one overhead budget for the whole model —
            :func:`~torch_armor.prune_model` gives each layer the block size that buys the most
            loss within ``max_overhead`` of all the pruned weights (:mod:`torch_armor.armor.allocate`)
            and writes the choice into ``block_sizes``.
        block_sizes: per-layer block sizes, ``{layer-name pattern: size}`` (``fnmatch`` patterns,
            e.g. ``{"*.mlp.*": 8}``; the first match wins; stored as a tuple of pairs); layers
            that match none get ``block_size``.
        max_overhead: the wrapper-overhead budget of ``"auto"``/``"budget"``: extra parameters
            ``d_b·(d_out + d_in)`` as a fraction of ``d_out·d_in`` (default 0.05).
        pattern: ``"2:4"`` (default), any ``"N:M"`` with ``M`` dividing ``block_size``, or
            ``"unstructured:F"``.
        seed: seed of the group selection (and of the reconstruction's batch order); the same
            seed gives bit-identical factors on CPU.
        dtype: optimization dtype, ``torch.float32`` (default) or ``torch.float64``; half-precision
            weights are optimized in it and returned in their own dtype.
        device: where to optimize (``None``: the weight's device); a ``torch.device`` is kept as
            its string (``"cuda:0"``).
        optimizer: :class:`BcdConfig` (default) or :class:`AdamConfig`.
        refine: :class:`RefineConfig` (default) or ``None``: no output-space refinement.
        reconstruct: :class:`ReconstructConfig` (default) or ``None``: no block reconstruction.
        distill: :class:`DistillConfig` (default) or ``None``: end-to-end distillation of the
            wrappers towards the dense model's next-token distributions after the block pass
            (in memory, on a streamed checkpoint one block at a time, or data-parallel under
            ``torchrun``; skipped with a warning when there are too few calibration windows).

    Every field after ``block_size`` is keyword-only.

    Example::

        >>> cfg = ArmorConfig()
        >>> cfg.block_size, cfg.optimizer.name, cfg.optimizer.iterations, cfg.optimizer.selection_rule
        (16, 'bcd', 20, 'mixed')
        >>> cfg.optimizer.group_updates_per_sweep(cfg.block_size)
        8
        >>> dataclasses.replace(cfg, refine=None).refine is None
        True
        >>> ArmorConfig(block_size="auto").for_layer(576, 1536).block_size
        16
    """

    block_size: _Block = 16
    _: KW_ONLY
    block_sizes: Tuple[Tuple[str, int], ...] = ()
    max_overhead: float = 0.05
    pattern: str = "2:4"
    seed: int = 0
    dtype: torch.dtype = torch.float32
    device: Optional[Union[str, torch.device]] = None
    optimizer: Optimizer = BcdConfig()
    refine: Optional[RefineConfig] = DEFAULT_REFINE
    reconstruct: Optional[ReconstructConfig] = DEFAULT_RECONSTRUCT
    distill: Optional[DistillConfig] = DistillConfig()

    def __post_init__(self) -> None:
        named = self.block_size in _NAMED_BLOCK_SIZES
        object.__setattr__(self, "block_sizes", _block_sizes(self.block_sizes))
        if not named and (not isinstance(self.block_size, int) or isinstance(self.block_size, bool)
                          or self.block_size < 1):
            raise ArmorInputError(f"block_size must be a positive integer, 'auto' or 'budget', got {self.block_size!r}")
        object.__setattr__(self, "pattern", normalized_pattern("ArmorConfig", self.pattern))
        if isinstance(self.device, torch.device):  # one spelling, so that the serialized form reads back equal
            object.__setattr__(self, "device", str(self.device))
        sparsity = self.sparsity
        if not named and sparsity.structured and self.block_size % sparsity.m != 0:
            raise ArmorInputError(
                f"block_size={self.block_size} is not a multiple of M={sparsity.m} in pattern "
                f"{self.pattern!r}: groups must not straddle tiles; pick a block size divisible by {sparsity.m}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ArmorInputError(f"seed must be an integer in [0, 2**63 - 1] (torch generators), got {self.seed!r}")
        if self.dtype not in _FLOAT_DTYPES:
            raise ArmorInputError(
                f"dtype must be torch.float32 or torch.float64 for optimization, got {self.dtype}; "
                "half-precision weights are optimized in fp32 and returned in their own dtype"
            )
        if (isinstance(self.max_overhead, bool) or not isinstance(self.max_overhead, (int, float))
                or not self.max_overhead > 0):
            raise ArmorInputError(f"max_overhead must be a positive fraction (0.05 = 5%), got {self.max_overhead!r}")
        for key, kinds in (("optimizer", (BcdConfig, AdamConfig)), ("refine", (RefineConfig, type(None))),
                           ("reconstruct", (ReconstructConfig, type(None))),
                           ("distill", (DistillConfig, type(None)))):
            if not isinstance(getattr(self, key), kinds):
                names = " or ".join("None" if k is type(None) else f"{k.__name__}()" for k in kinds)
                raise ArmorInputError(f"ArmorConfig.{key} must be {names}, got {getattr(self, key)!r}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "ArmorConfig":
        """The named preset (:data:`~torch_armor.config.presets.PRESETS`: ``"fast"``, ``"default"``
        — ``ArmorConfig()`` —, ``"max"``) with ``overrides`` applied on top.

        Example::

            >>> ArmorConfig.preset("default") == ArmorConfig()
            True
            >>> ArmorConfig.preset("fast", seed=1).optimizer.iters
            10
        """
        return cls(**{**preset_changes(name), **overrides})

    # -- derived values ------------------------------------------------------------------------
    @property
    def needs_allocation(self) -> bool:
        """``block_size="budget"`` without the per-layer sizes yet: the engine measures and allocates."""
        return self.block_size == "budget" and not self.block_sizes

    @property
    def refines(self) -> bool:
        """Whether output-space refinement is on."""
        return self.refine is not None

    @property
    def reconstructs(self) -> bool:
        """Whether block reconstruction is on."""
        return self.reconstruct is not None

    # -- per layer -----------------------------------------------------------------------------
    def for_layer(self, d_out: int, d_in: int, name: Optional[str] = None) -> "ArmorConfig":
        """This config for one ``(d_out, d_in)`` layer: a concrete integer block size
        (``"auto"``: the largest valid one within ``max_overhead``, see
        :func:`~torch_armor.core.pattern.auto_block_size`), checked against the shape.

        Returns ``self`` when the block size is already an integer that fits.

        Raises:
            ArmorInputError: the pattern or block size cannot serve this shape; the message names
                the layer (``name``) and the block sizes that would fit.

        Example::

            >>> ArmorConfig(block_size="auto", max_overhead=0.05).for_layer(4096, 4096).block_size
            64
            >>> ArmorConfig(block_size=32).for_layer(48, 32, name="fc")
            Traceback (most recent call last):
            ...
            torch_armor.errors.ArmorInputError: layer 'fc': block_size=32 does not divide the weight shape (48, 32); block sizes that fit this layer: [4, 8, 16]
        """
        sparsity = self.sparsity
        chosen = next((size for pat, size in self.block_sizes if name is not None and fnmatch.fnmatchcase(name, pat)),
                      None)
        if chosen is not None:
            check_layer_shape(d_out, d_in, sparsity, chosen, name=name)
            return dataclasses.replace(self, block_size=chosen)
        if self.block_size == "budget":
            raise ArmorInputError(
                f"layer {name!r}: block_size='budget' is one overhead budget for the whole model, resolved by "
                "prune_model (torch_armor.armor.allocate); give this layer a size in block_sizes, or use "
                "block_size='auto' (per layer) or an integer")
        if self.block_size == "auto":
            check_layer_shape(d_out, d_in, sparsity, None, name=name)
            try:
                block = auto_block_size(d_out, d_in, self.max_overhead, sparsity.group)
            except ArmorInputError as err:
                raise ArmorInputError(f"layer {name!r}: {err}" if name else str(err)) from None
            return dataclasses.replace(self, block_size=block)
        check_layer_shape(d_out, d_in, sparsity, self.block_size, name=name)
        return self

    def check_layer(self, d_out: int, d_in: int, name: Optional[str] = None) -> None:
        """Fail before anything is pruned if this config cannot serve a ``(d_out, d_in)`` layer
        (``"budget"``: some candidate block size must fit it)."""
        if self.needs_allocation:
            if not candidate_block_sizes(d_out, d_in, self.sparsity.group):
                raise ArmorInputError(
                    f"layer {name!r}: block_size='budget' found no block size in [8, 64] that divides its shape "
                    f"{(d_out, d_in)} and is a multiple of {self.sparsity.group}; exclude the layer or give it a "
                    "size in block_sizes")
            return
        self.for_layer(d_out, d_in, name)
