"""Checkpoints are untrusted input: crafted files and configs give one error naming the file."""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from _helpers import random_pattern_factors
from _hub_cache import hub_cache_layout
from conftest import make_tiny_llama
from torch_armor.core.pattern import parse_pattern
from torch_armor.errors import ArmorInputError
from torch_armor.format.file_checks import check_layer_values, check_shard_name, read_safetensors_header


def _st_bytes(tensors: dict) -> bytes:
    import safetensors.torch

    return safetensors.torch.save(tensors)


# ------------------------------------------------------------------------- safetensors headers
def test_valid_files_pass_and_match_safetensors(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"x": torch.randn(3, 4), "y": torch.zeros(0, 2, dtype=torch.int64), "z": torch.ones(5, dtype=torch.bool)},
              path, metadata={"k": "v"})
    header = read_safetensors_header(path)
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        ref = json.loads(fh.read(n))
    ref.pop("__metadata__")
    assert header == ref


def _corruptions(data: bytes):
    """Damaged forms of a valid safetensors file: each must be refused, naming the file."""
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    yield "empty", b""
    yield "pickle", pickle.dumps({"x": [1.0, 2.0]})
    yield "torch.save zip", _torch_save_bytes()
    yield "truncated data", data[:-5]
    yield "truncated header", data[:8 + n // 2]
    yield "header length huge", struct.pack("<Q", 1 << 40) + data[8:]
    yield "header not json", data[:8] + b"{" * n + data[8 + n:]
    for key in [k for k in header if k != "__metadata__"]:
        for mutate in ("offsets past end", "shape too big", "bad dtype", "negative offset"):
            h = json.loads(json.dumps(header))
            e = h[key]
            if mutate == "offsets past end":
                e["data_offsets"][1] += 4
            elif mutate == "shape too big":
                e["shape"] = [d + 1 for d in e["shape"]] or [2]
            elif mutate == "bad dtype":
                e["dtype"] = "Q9"
            else:
                e["data_offsets"][0] = -1
            text = json.dumps(h).encode()
            text += b" " * ((-len(text)) % 8)
            yield f"{key}: {mutate}", struct.pack("<Q", len(text)) + text + data[8 + n:]


def _torch_save_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"w": torch.randn(2, 2)}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("seed", range(3))
def test_every_damaged_file_is_refused_naming_it(tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    data = _st_bytes({"a": torch.randn(4, 3, generator=g), "b": torch.randint(0, 9, (5,), generator=g)})
    for what, bad in _corruptions(data):
        path = tmp_path / f"case-{seed}.safetensors"
        path.write_bytes(bad)
        with pytest.raises(ArmorInputError, match=str(path).replace("\\", "\\\\")) as info:
            read_safetensors_header(path)
        assert "\n" not in str(info.value), what


@settings(max_examples=80, deadline=None)
@given(st.binary(min_size=0, max_size=64))
def test_random_bytes_never_pass_silently_or_raw(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("blob") / "x.safetensors"
    path.write_bytes(blob)
    try:
        read_safetensors_header(path)
    except ArmorInputError:
        return
    from safetensors import safe_open  # accepted: safetensors itself must agree

    with safe_open(str(path), framework="pt") as fh:
        list(fh.keys())


@pytest.mark.parametrize("name", ["../other/model.safetensors", "/etc/passwd", "sub/model.safetensors", "..", ".",
                                  "", 7, None, "model.bin", "model.safetensors\0", "a\\b.safetensors"])
def test_shard_names_must_be_plain(tmp_path, name):
    with pytest.raises(ArmorInputError, match="index.json"):
        check_shard_name(tmp_path, name, "x/model.safetensors.index.json")


def test_a_symlink_out_of_the_directory_is_refused(tmp_path):
    (tmp_path / "outside.safetensors").write_bytes(b"")
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(ArmorInputError, match="outside"):
        check_shard_name(d, "model.safetensors", "index")


def test_hub_cache_links_into_the_repository_pass_and_links_out_of_it_are_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    save_file({"x": torch.ones(2)}, src / "model.safetensors")
    snapshot = hub_cache_layout(src, tmp_path / "hub")
    assert check_shard_name(snapshot, "model.safetensors", "index") == snapshot / "model.safetensors"
    other = hub_cache_layout(src, tmp_path / "hub", repo="models--org--other")  # another model's blob
    link = snapshot / "model.safetensors"
    link.unlink()
    link.symlink_to(os.path.relpath((other / "model.safetensors").resolve(), snapshot))
    with pytest.raises(ArmorInputError, match=r"a symlink to .*models--org--other.* outside .*models--org--tiny;"):
        check_shard_name(snapshot, "model.safetensors", "index")


@pytest.mark.parametrize("writer", ["torch_armor", "transformers"])
def test_an_armor_directory_in_the_hub_cache_layout_loads(tmp_path, writer):
    from transformers import AutoModelForCausalLM

    from torch_armor import ArmorConfig, PruneOptions, load_pretrained, prune_model, save_pretrained
    from torch_armor.config.armor import BcdConfig

    model = make_tiny_llama()
    calib = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    prune_model(model, calib, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1)), options=PruneOptions(progress=False))
    saved = tmp_path / "saved"
    save_pretrained(model, saved) if writer == "torch_armor" else model.save_pretrained(saved)
    snapshot = hub_cache_layout(saved, tmp_path / "hub", repo="models--org--pruned")
    ids = torch.arange(12)[None]
    with torch.no_grad():
        want = model(ids).logits
        for loaded in (load_pretrained(snapshot), AutoModelForCausalLM.from_pretrained(snapshot)):
            assert torch.equal(loaded(ids).logits, want)


# ------------------------------------------------------------------------- stored values
def _compact(d_out=4, d_in=8, seed=0):
    from torch_armor.tensor.packing import pack_nm

    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(d_out, d_in // 4, 4, generator=g).argsort(-1)[..., :2]
    mask = torch.zeros(d_out, d_in // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(d_out, d_in)
    core = torch.randn(d_out, d_in, generator=g) * mask
    return pack_nm(core, 2, 4)


def _ref_pack(pos: torch.Tensor) -> torch.Tensor:
    """2-bit positions ``(rows, k)`` to bytes, four per byte, lowest bits first (the documented layout)."""
    rows, k = pos.shape
    out = torch.zeros(rows, -(-k // 4), dtype=torch.uint8)
    for r in range(rows):
        for j in range(k):
            out[r, j // 4] |= int(pos[r, j]) << (2 * (j % 4))
    return out


def _ref_unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    return torch.tensor([[(int(packed[r, j // 4]) >> (2 * (j % 4))) & 3 for j in range(k)]
                         for r in range(packed.shape[0])])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), st.integers(0, 3), st.integers(0, 10))
def test_compact_indices_strictly_increasing(row, group, a, b, seed):
    values, indices = _compact(d_in=16, seed=seed)
    k = values.shape[1]
    assert torch.equal(_ref_pack(_ref_unpack(indices, k)), indices)
    check_layer_values("L", "2:4", {"values": values, "indices": indices})  # as packed: fine
    pos = _ref_unpack(indices, k).reshape(values.shape[0], -1, 2)
    pos[row, group] = torch.tensor([a, b])
    crafted = _ref_pack(pos.reshape(values.shape[0], k))
    if a < b:
        check_layer_values("L", "2:4", {"values": values, "indices": crafted})
    else:
        with pytest.raises(ArmorInputError, match=f"'L'.*row {row}, group {group}"):
            check_layer_values("L", "2:4", {"values": values, "indices": crafted})


@pytest.mark.parametrize("pattern", ["1:2", "2:4", "1:4", "4:8", "3:16"])
def test_packed_cores_of_every_pattern_pass_the_position_check(pattern):
    """Positions take index_bits(M) bits each (one for M = 2), as pack_nm packs them."""
    from torch_armor.tensor.packing import pack_nm

    f, p = random_pattern_factors(8, 32, 8, pattern=pattern), parse_pattern(pattern)
    values, indices = pack_nm(f.core, p.n, p.m, mask=f.mask)
    check_layer_values("L", pattern, {"values": values, "indices": indices})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("part", ["a_blocks", "b_blocks", "values", "core"])
def test_non_finite_parts_are_refused(part, bad):
    t = torch.randn(2, 4, 4)
    t.view(-1)[5] = bad
    with pytest.raises(ArmorInputError, match="NaN or Inf"):
        check_layer_values("L", "2:4", {part: t})
