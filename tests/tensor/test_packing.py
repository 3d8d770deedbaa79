"""Tests for torch_armor.tensor.packing: compact N:M round trips, CUTLASS layout."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_armor.tensor.packing import (
    check_nm_mask,
    cutlass_pack,
    cutlass_unpack,
    index_bits,
    pack_nm,
    packed_nbytes,
    unpack_nm,
)

PATTERNS = [(1, 2), (1, 4), (2, 4), (3, 4), (2, 8), (4, 8), (3, 8), (5, 16), (8, 16), (2, 3), (2, 5)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def random_nm_mask(d_out: int, d_in: int, n: int, m: int, gen: torch.Generator, exact: bool = True) -> torch.Tensor:
    """A random mask keeping exactly ``n`` (or, with ``exact=False``, at most ``n``) of every ``m``."""
    groups = d_in // m
    order = torch.rand(d_out, groups, m, generator=gen).argsort(-1)
    keep = torch.full((d_out, groups, 1), n)
    if not exact:
        keep = torch.randint(0, n + 1, (d_out, groups, 1), generator=gen)
    ranks = order.argsort(-1)
    return (ranks < keep).reshape(d_out, d_in)


@settings(max_examples=60, deadline=None)
@given(
    d_out=st.integers(1, 9),
    groups=st.integers(1, 7),
    pattern=st.sampled_from(PATTERNS),
    dtype=st.sampled_from(DTYPES),
    exact=st.booleans(),
    use_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pack_unpack_roundtrip_exact(d_out, groups, pattern, dtype, exact, use_mask, seed):
    n, m = pattern
    d_in = groups * m
    gen = torch.Generator().manual_seed(seed)
    mask = random_nm_mask(d_out, d_in, n, m, gen, exact=exact)
    core = (torch.randn(d_out, d_in, generator=gen) * mask).to(dtype)
    values, indices = pack_nm(core, n, m, mask=mask if use_mask else None)
    k = groups * n
    assert values.shape == (d_out, k) and values.dtype == dtype
    assert indices.dtype == torch.uint8
    assert indices.shape == (d_out, -(-k // (8 // index_bits(m))))
    back = unpack_nm(values, indices, n, m, d_in)
    assert back.dtype == dtype
    assert torch.equal(back, core)
    if use_mask:  # the stored support is exactly the mask when it keeps n per group
        support = unpack_nm(torch.ones_like(values), indices, n, m, d_in) != 0
        assert torch.equal(support & mask, mask)


@settings(max_examples=25, deadline=None)
@given(d_out=st.integers(1, 6), groups=st.integers(1, 5), pattern=st.sampled_from(PATTERNS), seed=st.integers(0, 999))
def test_group_with_too_many_entries_rejected(d_out, groups, pattern, seed):
    n, m = pattern
    d_in = groups * m
    gen = torch.Generator().manual_seed(seed)
    mask = random_nm_mask(d_out, d_in, n, m, gen)
    row = int(torch.randint(0, d_out, (1,), generator=gen))
    group = int(torch.randint(0, groups, (1,), generator=gen))
    mask[row, group * m : group * m + n + 1] = True  # n + 1 kept entries in one group
    core = torch.randn(d_out, d_in, generator=gen).abs().add(0.1) * mask
    with pytest.raises(ValueError, match=f"{n}:{m} pattern"):
        pack_nm(core, n, m)
    with pytest.raises(ValueError, match=f"row {row}"):
        check_nm_mask(mask, n, m)


def test_core_nonzero_off_mask_rejected():
    core = torch.tensor([[1.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, False, True, False]])
    with pytest.raises(ValueError, match="outside its mask"):
        pack_nm(core, 2, 4, mask=mask)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(2, 6), 2, 4), "multiple of M=4"),
        ((torch.zeros(2, 8), 4, 4), "0 < N < M"),
        ((torch.zeros(2, 8), 0, 4), "0 < N < M"),
        ((torch.zeros(2, 34), 2, 17), r"\[2, 16\]"),
        ((torch.zeros(8), 2, 4), "2-D"),
    ],
)
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        pack_nm(*args)


def test_unpack_validates_shapes():
    values, indices = pack_nm(torch.zeros(3, 8), 2, 4)
    with pytest.raises(ValueError, match="indices must be uint8"):
        unpack_nm(values, indices.to(torch.int16), 2, 4, 8)
    with pytest.raises(ValueError, match="values must be"):
        unpack_nm(values, indices, 2, 4, 12)


def test_2to4_storage_is_half_plus_one_bit_per_entry():
    d_out, d_in = 64, 256
    gen = torch.Generator().manual_seed(0)
    core = (torch.randn(d_out, d_in, generator=gen) * random_nm_mask(d_out, d_in, 2, 4, gen)).half()
    values, indices = pack_nm(core, 2, 4)
    nbytes = values.numel() * values.element_size() + indices.numel()
    dense = core.numel() * core.element_size()
    assert nbytes == dense // 2 + d_out * d_in // 8 == packed_nbytes(d_out, d_in, 2, 4, 2)
    assert nbytes < dense


def test_unpack_runs_under_compile():
    gen = torch.Generator().manual_seed(1)
    core = torch.randn(16, 32, generator=gen) * random_nm_mask(16, 32, 2, 4, gen)
    values, indices = pack_nm(core, 2, 4)
    fn = torch.compile(lambda v, i: unpack_nm(v, i, 2, 4, 32), backend="aot_eager", fullgraph=True)
    assert torch.equal(fn(values, indices), core)


# ----------------------------------------------------------------------------- CUTLASS


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 64), (128, 256), (32, 128)])
def test_cutlass_roundtrip_cpu(shape, dtype):
    gen = torch.Generator().manual_seed(2)
    d_out, d_in = shape
    dense = (torch.randn(d_out, d_in, generator=gen) * random_nm_mask(d_out, d_in, 2, 4, gen, exact=False)).to(dtype)
    packed, meta = cutlass_pack(dense)
    assert packed.shape == (d_out, d_in // 2) and packed.dtype == dtype
    assert meta.dtype == torch.int16 and meta.numel() * 2 == d_out * d_in // 8
    assert torch.equal(cutlass_unpack(packed, meta), dense)
    if bool(((dense != 0).reshape(d_out, -1, 4).sum(-1) == 2).all()):
        # with exactly two nonzeros per group, CUTLASS keeps values in our compact order
        assert torch.equal(packed, pack_nm(dense, 2, 4)[0])


def test_cutlass_values_match_compact_values():
    gen = torch.Generator().manual_seed(3)
    dense = (torch.randn(64, 128, generator=gen) + 5.0) * random_nm_mask(64, 128, 2, 4, gen)
    dense = dense.half()
    assert torch.equal(cutlass_pack(dense)[0], pack_nm(dense, 2, 4)[0])


@pytest.mark.parametrize(
    "dense, match",
    [
        (torch.zeros(64, 64), "float16 or bfloat16"),
        (torch.zeros(48, 64, dtype=torch.float16), "multiple of 32"),
        (torch.zeros(32, 16, dtype=torch.float16), "multiple of 64"),
        (torch.ones(32, 64, dtype=torch.float16), "2:4 pattern"),
    ],
)
def test_cutlass_rejects(dense, match):
    with pytest.raises(ValueError, match=match):
        cutlass_pack(dense)
