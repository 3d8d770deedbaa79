"""Packings of the N:M sparse core, as pure functions on plain tensors.

* **Compact N:M** (:func:`pack_nm` / :func:`unpack_nm`): any ``N:M`` pattern, any device,
  any floating dtype. The kept values of every group of ``M`` consecutive input columns are
  stored in order (``values``: ``(d_out, d_in·N/M)``), and their positions inside the group
  as bit-packed ``uint8`` indices (2 bits each for ``M ≤ 4``, 4 bits each for ``M ≤ 16``;
  1 bit for ``M = 2``). For 2:4 the metadata is ``d_out·d_in/8`` bytes, the same as
  CUTLASS's, so the core costs half the dense bytes plus one bit per dense entry.
  The round trip is exact (bit for bit), which is what serialization relies on.
* **CUTLASS 2:4** (:func:`cutlass_pack` / :func:`cutlass_unpack`): the layout the CUTLASS
  sparse GEMM reads (fp16/bf16, reordered ``int16`` metadata). PyTorch's packer is pure
  Python, so it runs (and is tested) on CPU.

Which packing a layer uses on which device is :mod:`torch_armor.tensor.policy`'s call; the CUDA
kernels' own formats live in :mod:`torch_armor.tensor.semi_structured`.

Example::

    >>> import torch
    >>> core = torch.tensor([[0.0, 1.5, 0.0, -2.0, 3.0, 0.0, 0.0, 4.0]])
    >>> values, indices = pack_nm(core, 2, 4)
    >>> values
    tensor([[ 1.5000, -2.0000,  3.0000,  4.0000]])
    >>> torch.equal(unpack_nm(values, indices, 2, 4, d_in=8), core)
    True
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch_armor.errors import ArmorInputError

__all__ = [
    "index_bits",
    "packed_nm_shapes",
    "pack_nm",
    "unpack_nm",
    "scatter_groups",
    "check_nm_mask",
    "packed_nbytes",
    "cutlass_pack",
    "cutlass_unpack",
]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
# CUTLASS sparse GEMM minimum sparse-operand shape for fp16/bf16 (rows, cols);
# both dimensions must also be multiples of these.
_CUTLASS_MIN_SHAPE = (32, 64)


def index_bits(m: int) -> int:
    """Bits used to store one in-group position for group size ``m`` (1, 2 or 4).

    Example::

        >>> index_bits(4), index_bits(8)
        (2, 4)
    """
    if not isinstance(m, int) or m < 2 or m > 16:
        raise ArmorInputError(f"group size M must be an integer in [2, 16], got {m!r}")
    if m <= 2:
        return 1
    if m <= 4:
        return 2
    return 4


def _check_nm(n: int, m: int) -> None:
    if not (isinstance(n, int) and isinstance(m, int)) or isinstance(n, bool) or isinstance(m, bool):
        raise ArmorInputError(f"N and M must be integers, got N={n!r}, M={m!r}")
    if not 0 < n < m:
        raise ArmorInputError(f"need 0 < N < M for an N:M pattern, got {n}:{m}")
    index_bits(m)  # validates m ≤ 16


def check_nm_mask(mask: torch.Tensor, n: int, m: int) -> None:
    """Raise ``ValueError`` unless every group of ``m`` consecutive columns keeps at most ``n``.

    Example::

        >>> check_nm_mask(torch.tensor([[True, False, True, False]]), 2, 4)
        >>> check_nm_mask(torch.tensor([[True, True, True, False]]), 2, 4)
        Traceback (most recent call last):
        ...
        torch_armor.errors.ArmorInputError: ...
    """
    _check_nm(n, m)
    if mask.dim() != 2:
        raise ArmorInputError(f"expected a 2-D (d_out, d_in) mask, got shape {tuple(mask.shape)}")
    d_out, d_in = mask.shape
    if d_in % m != 0:
        raise ArmorInputError(
            f"d_in={d_in} is not a multiple of M={m}: an {n}:{m} pattern needs whole groups of {m} columns"
        )
    counts = mask.reshape(d_out, d_in // m, m).sum(-1)
    bad = counts > n
    if bool(bad.any()):
        row, group = (int(v) for v in bad.nonzero()[0])
        raise ArmorInputError(
            f"the core/mask breaks the {n}:{m} pattern: row {row}, columns {group * m}..{group * m + m - 1} "
            f"keep {int(counts[row, group])} entries (at most {n} allowed); "
            f"{int(bad.sum())} group(s) in all. Re-project the mask to {n}:{m} before packing."
        )


def _pack_bits(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack small non-negative ints ``idx (rows, k)`` into ``uint8 (rows, ceil(k·bits/8))``."""
    per_byte = 8 // bits
    rows, k = idx.shape
    pad = (-k) % per_byte
    if pad:
        idx = torch.cat([idx, idx.new_zeros(rows, pad)], dim=1)
    idx = idx.to(torch.uint8).reshape(rows, -1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=idx.device)
    return (idx << shifts).sum(-1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of :func:`_pack_bits`: ``uint8 (rows, nbytes)`` to ``int64 (rows, k)``."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    low = (1 << bits) - 1
    idx = (packed.unsqueeze(-1) >> shifts) & low
    return idx.reshape(packed.shape[0], -1)[:, :k].to(torch.int64)


def packed_nm_shapes(d_out: int, d_in: int, n: int, m: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """The shapes of :func:`pack_nm`'s ``values`` and ``indices`` for a ``(d_out, d_in)`` core, ``d_in`` a
    multiple of ``m``: ``(d_out, d_in·n/m)`` kept values, and their positions ``index_bits(m)`` bits each.

    Example::

        >>> packed_nm_shapes(8, 16, 2, 4), packed_nm_shapes(8, 16, 1, 2)
        (((8, 8), (8, 2)), ((8, 8), (8, 1)))
    """
    k = d_in // m * n
    return (d_out, k), (d_out, -(-k // (8 // index_bits(m))))


def packed_nbytes(d_out: int, d_in: int, n: int, m: int, itemsize: int) -> int:
    """Bytes taken by :func:`pack_nm`'s output (values + indices) for a ``(d_out, d_in)`` core.

    Example::

        >>> packed_nbytes(64, 64, 2, 4, itemsize=2)  # half of 8192 + 64·64/8
        4608
    """
    _check_nm(n, m)
    (_, k), (_, nbytes) = packed_nm_shapes(d_out, d_in, n, m)
    return d_out * k * itemsize + d_out * nbytes


def pack_nm(
    core: torch.Tensor, n: int, m: int, mask: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pack an N:M sparse ``core (d_out, d_in)`` into ``(values, indices)``.

    Args:
        core: 2-D floating tensor, zero outside its N:M support.
        n, m: the pattern (keep ``n`` of every ``m`` consecutive input columns).
        mask: optional bool ``(d_out, d_in)`` support. When given, its positions are the ones
            stored (so kept entries that happen to be exactly zero keep their place) and the core
            must be zero off it. Without it the support is ``core != 0``, padded per group with
            the lowest zero positions when a group has fewer than ``n`` nonzeros.

    Returns:
        ``values``: ``(d_out, d_in·n/m)`` in ``core.dtype``, the kept entries group by group in
        increasing column order; ``indices``: ``uint8 (d_out, ceil(d_in·n/m / (8/b)))`` with the
        in-group positions packed ``b = index_bits(m)`` bits each, low bits first.

    Raises:
        ValueError: if ``d_in`` is not a multiple of ``m``, a group keeps more than ``n``
            entries, or the core is nonzero off the given mask.

    Example::

        >>> core = torch.zeros(2, 8); core[0, 1] = 1.0; core[1, 6] = 2.0
        >>> values, indices = pack_nm(core, 2, 4)
        >>> values.shape, indices.shape, indices.dtype
        (torch.Size([2, 4]), torch.Size([2, 1]), torch.uint8)
    """
    _check_nm(n, m)
    if not isinstance(core, torch.Tensor) or core.dim() != 2:
        raise ArmorInputError(f"core must be a 2-D (d_out, d_in) tensor, got {type(core).__name__} "
                         f"with shape {tuple(getattr(core, 'shape', ()))}")
    d_out, d_in = core.shape
    if mask is None:
        support = core != 0
    else:
        if mask.shape != core.shape or mask.dtype != torch.bool:
            raise ArmorInputError(
                f"mask must be a bool tensor shaped like the core {tuple(core.shape)}, "
                f"got {mask.dtype} {tuple(mask.shape)}"
            )
        support = mask.to(core.device)
        off = (core != 0) & ~support
        if bool(off.any()):
            raise ArmorInputError(
                f"the core has {int(off.sum())} nonzero entries outside its mask; "
                "zero them (core * mask) before packing"
            )
    check_nm_mask(support, n, m)
    groups = d_in // m
    grouped = support.reshape(d_out, groups, m)
    # Kept positions first (stable keeps increasing order), then fill with the lowest free ones.
    order = torch.argsort((~grouped).to(torch.uint8), dim=-1, stable=True)[..., :n]
    pos, _ = torch.sort(order, dim=-1)
    values = torch.gather(core.reshape(d_out, groups, m), -1, pos).reshape(d_out, groups * n)
    indices = _pack_bits(pos.reshape(d_out, groups * n), index_bits(m))
    return values.contiguous(), indices.contiguous()


def unpack_nm(values: torch.Tensor, indices: torch.Tensor, n: int, m: int, d_in: int) -> torch.Tensor:
    """Rebuild the dense ``(d_out, d_in)`` core from :func:`pack_nm`'s output (exactly).

    Pure tensor ops (shift, mask, scatter), so it runs on any device and under ``torch.compile``.

    Example::

        >>> core = torch.tensor([[0.0, 0.0, 5.0, 6.0]])
        >>> torch.equal(unpack_nm(*pack_nm(core, 2, 4), 2, 4, d_in=4), core)
        True
    """
    _check_nm(n, m)
    if d_in % m != 0:
        raise ArmorInputError(f"d_in={d_in} is not a multiple of M={m}")
    groups = d_in // m
    k = groups * n
    if values.dim() != 2 or values.shape[1] != k:
        raise ArmorInputError(
            f"values must be (d_out, {k}) for d_in={d_in} and {n}:{m}, got {tuple(values.shape)}"
        )
    d_out = values.shape[0]
    _, indices_shape = packed_nm_shapes(d_out, d_in, n, m)
    if indices.dtype != torch.uint8 or tuple(indices.shape) != indices_shape:
        raise ArmorInputError(
            f"indices must be uint8 of shape {indices_shape} for {n}:{m} and d_in={d_in}, "
            f"got {indices.dtype} {tuple(indices.shape)}"
        )
    return scatter_groups(values, _unpack_bits(indices, index_bits(m), k).reshape(d_out, groups, n), m)


def scatter_groups(values: torch.Tensor, positions: torch.Tensor, m: int) -> torch.Tensor:
    """The dense ``(d_out, groups·m)`` core with ``values (d_out, groups·n)`` at their in-group
    ``positions`` (int64 ``(d_out, groups, n)``) and zeros elsewhere; its gradient is a gather."""
    d_out, groups, n = positions.shape
    out = values.new_zeros(d_out, groups, m).scatter(-1, positions, values.reshape(d_out, groups, n))
    return out.reshape(d_out, groups * m)


# ----------------------------------------------------------------------------- CUTLASS 2:4


def _check_cutlass_input(dense: torch.Tensor) -> None:
    if not isinstance(dense, torch.Tensor) or dense.dim() != 2:
        raise ArmorInputError("CUTLASS 2:4 packing needs a 2-D tensor")
    if dense.dtype not in _HALF_DTYPES:
        raise ArmorInputError(
            f"CUTLASS 2:4 packing takes float16 or bfloat16, got {dense.dtype}; convert with .half() or .bfloat16()"
        )
    rows, cols = dense.shape
    min_r, min_c = _CUTLASS_MIN_SHAPE
    if rows < min_r or rows % min_r or cols < min_c or cols % min_c:
        raise ArmorInputError(
            f"CUTLASS 2:4 packing needs rows a multiple of {min_r} and columns a multiple of {min_c}, "
            f"got {tuple(dense.shape)}; keep such layers dense"
        )


def cutlass_pack(dense: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pack a 2:4 fp16/bf16 matrix into CUTLASS's ``(packed values, reordered int16 metadata)``.

    Runs on CPU (PyTorch's packer is pure Python), so the layout can be checked without a GPU.

    Raises:
        ValueError: wrong dtype, a shape the CUTLASS kernel cannot take (rows multiple of 32,
            columns multiple of 64), or a group of 4 with more than 2 nonzeros.

    Example::

        >>> dense = torch.tensor([1.0, 0.0, 0.0, 2.0]).repeat(32, 16).half()
        >>> packed, meta = cutlass_pack(dense)
        >>> packed.shape, meta.dtype
        (torch.Size([32, 32]), torch.int16)
        >>> torch.equal(cutlass_unpack(packed, meta), dense)
        True
    """
    from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass  # local: only this function needs it

    _check_cutlass_input(dense)
    check_nm_mask(dense != 0, 2, 4)
    return sparse_semi_structured_from_dense_cutlass(dense.contiguous())


def cutlass_unpack(packed: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`cutlass_pack`: the dense 2:4 matrix (exact).

    Example::

        >>> dense = torch.tensor([0.0, 3.0, 0.0, 2.0]).repeat(64, 32).bfloat16()
        >>> torch.equal(cutlass_unpack(*cutlass_pack(dense)), dense)
        True
    """
    from torch.sparse._semi_structured_conversions import sparse_semi_structured_to_dense_cutlass  # local: only this function needs it

    if packed.dim() != 2 or meta.dim() != 2 or meta.dtype != torch.int16:
        raise ArmorInputError(
            "expected packed (rows, cols/2) values and int16 (rows, cols/16) metadata from cutlass_pack, "
            f"got {tuple(packed.shape)} {packed.dtype} and {tuple(meta.shape)} {meta.dtype}"
        )
    return sparse_semi_structured_to_dense_cutlass(packed, meta)
