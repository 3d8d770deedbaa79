"""Sparsity patterns and the shapes they fit: ``"N:M"`` / ``"unstructured:F"``, block sizes.

Pure functions of strings and integers (no tensors): every method config, the core math, the
tensor formats and the engine read patterns and check layer shapes here.

Example::

    >>> parse_pattern("2:4")
    SparsityPattern(n=2, m=4, sparsity=0.5)
    >>> auto_block_size(576, 1536, 0.05, 4), candidate_block_sizes(576, 1536, 4)
    (16, [8, 16, 32, 64])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Union

from torch_armor.errors import ArmorInputError

__all__ = [
    "SparsityPattern",
    "parse_pattern",
    "valid_block_sizes",
    "auto_block_size",
    "candidate_block_sizes",
    "check_layer_shape",
    "layer_prefix",
]


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

    @property
    def group(self) -> int:
        """The width a block size must be a multiple of: ``M`` (``N:M``) or 1 (unstructured)."""
        return self.m if self.structured else 1


def parse_pattern(pattern: Union[str, SparsityPattern]) -> SparsityPattern:
    """Parse ``"N:M"`` (e.g. ``"2:4"``, ``"4:8"``) or ``"unstructured:F"`` (F = fraction pruned)."""
    if isinstance(pattern, SparsityPattern):
        return pattern
    if not isinstance(pattern, str):
        raise ArmorInputError(f"pattern must be a string like '2:4' or 'unstructured:0.5', got {pattern!r}")
    text = pattern.strip().lower()
    if text.startswith("unstructured"):
        _, _, frac = text.partition(":")
        try:
            sparsity = float(frac) if frac else 0.5
        except ValueError:
            raise ArmorInputError(f"pattern {pattern!r}: expected 'unstructured:F' with F a number in (0, 1)") from None
        if not 0.0 < sparsity < 1.0:
            raise ArmorInputError(f"pattern {pattern!r}: the pruned fraction must lie strictly between 0 and 1")
        return SparsityPattern(n=0, m=0, sparsity=sparsity, structured=False)
    parts = text.split(":")
    # ASCII digits only: str.isdigit() also accepts '²', which int() refuses
    if len(parts) != 2 or not all(p.strip().isascii() and p.strip().isdigit() for p in parts):
        raise ArmorInputError(f"pattern {pattern!r}: expected 'N:M' such as '2:4', or 'unstructured:0.5'")
    n, m = int(parts[0]), int(parts[1])
    if not 0 < n < m:
        raise ArmorInputError(f"pattern {pattern!r}: need 0 < N < M (keep N of every M weights)")
    if m > 16:
        raise ArmorInputError(f"pattern {pattern!r}: M > 16 makes C(M, N) supports per group too many to enumerate")
    return SparsityPattern(n=n, m=m, sparsity=1.0 - n / m, structured=True)


def layer_prefix(name: Optional[str]) -> str:
    """``"layer 'name': "`` for error messages (``""`` without a name)."""
    return f"layer {name!r}: " if name else ""


def valid_block_sizes(d_out: int, d_in: int, m: int = 1) -> List[int]:
    """Block sizes that divide both dimensions and are multiples of ``m``."""
    g = math.gcd(d_out, d_in)
    return [b for b in range(1, g + 1) if g % b == 0 and b % m == 0]


def auto_block_size(d_out: int, d_in: int, max_overhead: float = 0.05, multiple_of: int = 4) -> int:
    """Largest ARMOR block size for a ``(d_out, d_in)`` layer within a wrapper-overhead budget.

    Picks the largest ``d_b`` that divides both ``d_out`` and ``d_in``, is a multiple of
    ``multiple_of`` (the ``M`` of an ``N:M`` pattern, so groups do not straddle tiles), and
    keeps the wrappers' extra parameters ``d_b·(d_in + d_out)`` within ``max_overhead`` of
    the layer's ``d_in·d_out``.

    Raises:
        ArmorInputError: bad arguments, or no block size fits (then the message gives the
            smallest valid one and the overhead it would cost).

    Example::

        >>> auto_block_size(4096, 4096, 0.05, 4)     # 64 · 8192 / 4096² = 3.1 %
        64
        >>> auto_block_size(576, 1536, 0.05, 4)      # SmolLM2 down_proj: 16 · 2112 / 884736 = 3.8 %
        16
    """
    for label, value in (("d_out", d_out), ("d_in", d_in), ("multiple_of", multiple_of)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArmorInputError(f"{label} must be a positive integer, got {value!r}")
    if isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float)) or not max_overhead > 0:
        raise ArmorInputError(f"max_overhead must be a positive fraction (0.05 = 5%), got {max_overhead!r}")
    g = math.gcd(d_out, d_in)
    divisors = sorted({d for i in range(1, math.isqrt(g) + 1) if g % i == 0 for d in (i, g // i)})
    valid = [b for b in divisors if b % multiple_of == 0]
    fitting = [b for b in valid if b * (d_in + d_out) / (d_in * d_out) <= max_overhead]
    if not fitting:
        if not valid:
            raise ArmorInputError(
                f"no block size divides both dimensions of a ({d_out}, {d_in}) layer and is a multiple "
                f"of {multiple_of}; skip this layer or use another pattern"
            )
        smallest = valid[0]
        cost = smallest * (d_in + d_out) / (d_in * d_out)
        raise ArmorInputError(
            f"no block size fits a ({d_out}, {d_in}) layer within {max_overhead:.1%} wrapper overhead: "
            f"the smallest valid one, {smallest}, costs {cost:.1%}; raise max_overhead or give an integer block size"
        )
    return fitting[-1]


def candidate_block_sizes(d_out: int, d_in: int, multiple_of: int, lo: int = 8, hi: int = 64) -> List[int]:
    """Block sizes in ``[lo, hi]`` that divide both dimensions and are multiples of ``multiple_of``:
    the powers of two among them if there are any (fewer candidates to measure), else all.
    ``block_size="budget"`` chooses among these.

    Example::

        >>> candidate_block_sizes(576, 1536, 4), candidate_block_sizes(36, 36, 4)
        ([8, 16, 32, 64], [12, 36])
    """
    g = math.gcd(d_out, d_in)
    valid = [b for b in range(lo, hi + 1) if g % b == 0 and b % multiple_of == 0]
    powers = [b for b in valid if b & (b - 1) == 0]
    return powers or valid


def check_layer_shape(
    d_out: int,
    d_in: int,
    pattern: Union[str, SparsityPattern] = "2:4",
    block_size: Optional[int] = None,
    name: Optional[str] = None,
) -> None:
    """Check that ``pattern`` and ``block_size`` can serve a ``(d_out, d_in)`` weight.

    Raises:
        ArmorInputError: they cannot; the message names the layer and what would fit.
    """
    where = layer_prefix(name)
    pat = parse_pattern(pattern)
    if pat.structured and d_in % pat.m != 0:
        raise ArmorInputError(
            f"{where}d_in={d_in} is not a multiple of M={pat.m} for pattern '{pat}': "
            "use a pattern whose M divides d_in, or skip this layer"
        )
    if block_size is not None and (d_out % block_size or d_in % block_size):
        options = valid_block_sizes(d_out, d_in, pat.group)
        raise ArmorInputError(
            f"{where}block_size={block_size} does not divide the weight shape ({d_out}, {d_in}); "
            f"block sizes that fit this layer: {options}"
        )
