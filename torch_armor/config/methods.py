"""The baseline methods' configs, and what every method config shares (:class:`MethodConfig`).

A config's type is its method: :class:`MagnitudeConfig`, :class:`WandaConfig`,
:class:`NoWagConfig`, :class:`SparseGPTConfig` here and :class:`~torch_armor.config.armor.ArmorConfig`
(the method registry, :mod:`torch_armor.engine.methods`, maps each type to the code that runs it).
All are frozen dataclasses checked in ``__post_init__``; errors are
:class:`~torch_armor.errors.ArmorInputError` (a ``ValueError``).

Example::

    >>> SparseGPTConfig(pattern="4:8", damp=0.1)
    SparseGPTConfig(pattern='4:8', block_size=128, damp=0.1)
    >>> WandaConfig().for_layer(64, 30, name="fc")
    Traceback (most recent call last):
    ...
    torch_armor.errors.ArmorInputError: layer 'fc': d_in=30 is not a multiple of M=4 for pattern '2:4': use a pattern whose M divides d_in, or skip this layer
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from torch_armor.config.serialized import config_to_dict, serializable
from torch_armor.core.pattern import SparsityPattern, check_layer_shape, parse_pattern
from torch_armor.errors import ArmorInputError

__all__ = ["MethodConfig", "MagnitudeConfig", "WandaConfig", "NoWagConfig", "SparseGPTConfig"]


def check_count(owner: str, key: str, value: Any, minimum: int = 0) -> None:
    """``value`` must be an integer ``>= minimum`` (booleans are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive" if minimum == 1 else "a non-negative"
        raise ArmorInputError(f"{owner}.{key} must be {what} integer, got {value!r}")


def check_fraction(owner: str, key: str, value: Any) -> None:
    """``value`` must be a number in ``[0, 1)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ArmorInputError(f"{owner}.{key} must be in [0, 1), got {value!r}")


def normalized_pattern(owner: str, pattern: Any) -> str:
    """The one spelling of a pattern (``"2:4"``, ``"unstructured:0.5"``); errors name the owner."""
    try:
        return str(parse_pattern(pattern))
    except ArmorInputError as err:
        raise ArmorInputError(f"{owner}.pattern: {err}") from None


class MethodConfig:
    """What every method config offers: its :attr:`sparsity`, a per-layer resolution
    (:meth:`for_layer`), an up-front check (:meth:`check_layer`) and its serialized form
    (:meth:`to_dict`)."""

    pattern: str

    @property
    def sparsity(self) -> SparsityPattern:
        """The parsed :attr:`pattern`."""
        return parse_pattern(self.pattern)

    @property
    def needs_allocation(self) -> bool:
        """Whether the engine must choose per-layer settings from measurements first (ARMOR's
        ``block_size="budget"``)."""
        return False

    def with_override(self, override: Any, name: str) -> "MethodConfig":
        """This config with one layer's override applied: ``None`` (unchanged), a config of this type (used
        as it is) or a mapping of this type's fields. Derived defaults follow the override (ARMOR: a layer
        that overrides ``block_size`` gets that block size's ``group_updates``); errors name the layer.

        Example::

            >>> SparseGPTConfig().with_override({"damp": 0.1}, "fc").damp
            0.1
            >>> WandaConfig().with_override({"damp": 0.1}, "fc")
            Traceback (most recent call last):
            ...
            torch_armor.errors.ArmorInputError: layer 'fc': unknown WandaConfig fields in its override: ['damp']; valid: ['pattern']
        """
        if override is None or isinstance(override, type(self)):
            return self if override is None else override
        kind = type(self).__name__
        if not isinstance(override, Mapping):
            raise ArmorInputError(f"layer {name!r}: a per-layer override is a {kind} or a dict of its fields, "
                                  f"got {type(override).__name__}")
        fields = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(override) - set(fields))
        if unknown:
            raise ArmorInputError(f"layer {name!r}: unknown {kind} fields in its override: {unknown}; valid: {fields}")
        try:
            return dataclasses.replace(self, **override)
        except ValueError as err:
            raise ArmorInputError(f"layer {name!r}: invalid per-layer setting: {err}") from None

    def for_layer(self, d_out: int, d_in: int, name: Optional[str] = None) -> "MethodConfig":
        """This config for one ``(d_out, d_in)`` layer, checked against the shape (errors name ``name``)."""
        check_layer_shape(d_out, d_in, self.sparsity, None, name=name)
        return self

    def check_layer(self, d_out: int, d_in: int, name: Optional[str] = None) -> None:
        """Fail before anything is pruned if this config cannot serve a ``(d_out, d_in)`` layer."""
        self.for_layer(d_out, d_in, name)

    def to_dict(self) -> Dict[str, Any]:
        """The serialized form (report settings, run directories, sparsifier states): its own
        fields, nested, with ``"type"`` and ``"version"``
        (:func:`~torch_armor.config.serialized.config_to_dict`); :func:`config_from_dict` reads it back.

        Example::

            >>> WandaConfig().to_dict()
            {'type': 'WandaConfig', 'version': 1, 'pattern': '2:4'}
        """
        return config_to_dict(self)


_SPARSEGPT_BLOCK = 128
_SPARSEGPT_DAMP = 0.01


@dataclass(frozen=True)
class _PatternOnly(MethodConfig):
    """A method whose only setting is its pattern."""

    pattern: str = "2:4"

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", normalized_pattern(type(self).__name__, self.pattern))


@serializable
@dataclass(frozen=True)
class MagnitudeConfig(_PatternOnly):
    """Magnitude pruning: keep the largest ``|W_ij|`` (:func:`~torch_armor.core.baselines.magnitude_prune`)."""


@serializable
@dataclass(frozen=True)
class WandaConfig(_PatternOnly):
    """Wanda: keep the largest ``|W_ij|·‖x_j‖`` (:func:`~torch_armor.core.baselines.wanda_prune`)."""


@serializable
@dataclass(frozen=True)
class NoWagConfig(_PatternOnly):
    """NoWag-P: keep the largest normalized ``W̄_ij²·h_j`` (:func:`~torch_armor.core.proxy.nowag_prune`)."""


@serializable
@dataclass(frozen=True)
class SparseGPTConfig(MethodConfig):
    """SparseGPT (:func:`~torch_armor.core.baselines.sparsegpt_prune`).

    Args:
        pattern: ``"2:4"``, any ``"N:M"`` or ``"unstructured:F"``.
        block_size: the lazy-batch width (a multiple of ``M``).
        damp: dampening of ``XᵀX`` as a fraction of its mean diagonal.
    """

    pattern: str = "2:4"
    block_size: int = _SPARSEGPT_BLOCK
    damp: float = _SPARSEGPT_DAMP

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", normalized_pattern("SparseGPTConfig", self.pattern))
        check_count("SparseGPTConfig", "block_size", self.block_size, minimum=1)
        check_fraction("SparseGPTConfig", "damp", self.damp)
        group = parse_pattern(self.pattern).group
        if self.block_size % group:
            raise ArmorInputError(f"SparseGPTConfig.block_size={self.block_size} is not a multiple of M={group} of "
                                  f"pattern '{self.pattern}': an N:M group must not straddle two lazy blocks; use a "
                                  f"multiple of {group} such as {_SPARSEGPT_BLOCK}")
