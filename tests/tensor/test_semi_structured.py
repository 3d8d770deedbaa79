"""The CUDA 2:4 ARMOR layer without a GPU: traced graphs on fake CUDA, CPU-backed CUTLASS buffers.

What runs on a GPU is the AOTAutograd forward graph of ``F.linear`` through the layer; tracing it
on fake CUDA tensors (shapes only) shows every op the GPU would run. The 2:4 GEMM itself, its
numerics and its speed need a GPU: ``tests/tensor/test_cuda.py`` (``python benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _fake_cuda import fake_cuda, traced_ops
from _helpers import random_pattern_factors

from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.core.factorize import factorize
from torch_armor.kernels import block_diag as block_diag_kernels
from torch_armor.tensor import policy
from torch_armor.tensor.armor_tensor import ArmorTensor, armor_linear_from_factors
from torch_armor.tensor.packing import cutlass_pack
from torch_armor.tensor.semi_structured import CusparseltArmorTensor, CutlassArmorTensor

D, TOKENS = 4096, 2048
D_B = ArmorConfig().block_size  # the library's default block size (16)
COPIES = {"clone", "copy", "copy_", "_to_copy", "to_dense", "eye", "contiguous", "constant_pad_nd", "_unsafe_view"}


def _copies(ops, allowed=()):
    """The ops that copy an activation or build a dense core (``aten.clone.default`` -> ``clone``)."""
    return [op for op in ops if op.startswith("aten.") and op.split(".")[1] in COPIES - set(allowed)]


def _sparse_gemms(ops):
    return [op for op in ops if "cslt_sparse_mm" in op or "cusparselt_mm" in op or "semi_structured" in op]


def _cusparselt_layer(dtype=torch.bfloat16, d_out=D, d_in=D, d_b=D_B) -> CusparseltArmorTensor:
    """An ARMOR layer with a cuSPARSELt core, built from fake CUDA buffers (call inside fake_cuda)."""
    a = torch.empty(d_out // d_b, d_b, d_b, device="cuda", dtype=dtype)
    b = torch.empty(d_in // d_b, d_b, d_b, device="cuda", dtype=dtype)
    packed = torch.empty(d_out * d_in * 9 // 16, device="cuda", dtype=dtype).view(d_out, -1)
    return CusparseltArmorTensor(a, b, packed, "2:4", dtype)


def _report(title, ops):
    print(f"\n{title}: {len(ops)} ops: {dict(collections.Counter(ops))}\n  in order: {ops}")


WRAPPER_PASS = "torch_armor.block_diag_rows.default"


@pytest.fixture(params=["fused", "bmm"])
def wrapper_path(request, monkeypatch):
    """Both CUDA paths: the fused wrapper kernels (Triton installed) and the batched-matmul fallback."""
    if request.param == "bmm":
        monkeypatch.setattr(block_diag_kernels, "triton_importable", lambda: False)
    else:
        pytest.importorskip("triton")
    return request.param


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_linear_is_two_wrapper_kernels_around_one_sparse_gemm(monkeypatch, x_dtype):
    """Issue #41 row 2: before, bmm 2 around the GEMM (their activation passes separate kernels) and, for an
    fp16 input into a bf16 layer, two ``_to_copy`` casts; now the B-pass kernel reads the input in its own
    dtype and the A-pass writes it back: two wrapper kernels, one sparse GEMM, no bmm, cast, pad or copy."""
    pytest.importorskip("triton")
    with fake_cuda(monkeypatch):
        w = _cusparselt_layer()
        x = torch.empty(TOKENS, D, device="cuda", dtype=x_dtype)
        ops, out = traced_ops(lambda t: F.linear(t, w), x)
    _report(f"{str(x_dtype)[6:]} input, bf16 layer, {TOKENS} tokens", ops)
    assert not _copies(ops), ops
    assert ops.count(WRAPPER_PASS) == 2 and len(_sparse_gemms(ops)) == 1
    assert "aten.bmm.default" not in ops and not [op for op in ops if op in ("aten.mm.default", "aten.addmm.default")]
    assert out.shape == (TOKENS, D) and out.dtype == x_dtype


@pytest.mark.parametrize("tokens", [2048, 16, 13, 7, 1])
def test_output_is_row_major_like_nn_linear(monkeypatch, wrapper_path, tokens):
    """Issue #41 row 1: before, the output was the transposed view of a (d_out, T) tensor, stride (1, T)."""
    with fake_cuda(monkeypatch):
        w = _cusparselt_layer(d_out=1024, d_in=512)
        out = F.linear(torch.empty(tokens, 512, device="cuda", dtype=torch.bfloat16), w)
    assert out.shape == (tokens, 1024) and out.is_contiguous()
    if tokens > 1 or wrapper_path == "fused":  # (a single row's leading stride means nothing to any kernel)
        assert out.stride() == (1024, 1)


@pytest.mark.parametrize("tokens", [13, 7, 1])
def test_odd_token_counts_are_padded_inside_the_b_pass(monkeypatch, tokens):
    """Issue #41 row 5: before, any token count that is not a multiple of 8 added a ``constant_pad_nd``
    (and a copy back); now the B-pass writes the zero rows and the A-pass reads only the real ones."""
    pytest.importorskip("triton")
    with fake_cuda(monkeypatch):
        w = _cusparselt_layer()
        ops, out = traced_ops(lambda t: F.linear(t, w), torch.empty(1, tokens, D, device="cuda", dtype=torch.bfloat16))
    assert not _copies(ops), ops
    assert ops.count(WRAPPER_PASS) == 2 and len(_sparse_gemms(ops)) == 1
    assert out.shape == (1, tokens, D) and out.stride() == (tokens * D, D, 1)


@pytest.mark.parametrize("shared", [False, True], ids=["separate", "shared-input pass"])
def test_q_k_v_triple(monkeypatch, shared):
    """Llama-3-8B's q (4096x4096), k and v (1024x4096) on one 2048-token input: one sparse GEMM per linear,
    wrapper kernels around them, no bmm, pad, cast or copy; with the compile pass
    (``torch_armor.kernels.fusion``) the three B-passes are one launch that reads the input once."""
    pytest.importorskip("triton")
    from torch_armor.kernels.fusion import share_wrapper_inputs

    with fake_cuda(monkeypatch):
        q, k, v = _cusparselt_layer(), _cusparselt_layer(d_out=1024), _cusparselt_layer(d_out=1024)
        x = torch.empty(1, TOKENS, D, device="cuda", dtype=torch.bfloat16)
        ops, outs = traced_ops(lambda t: (F.linear(t, q), F.linear(t, k), F.linear(t, v)), x,
                               graph_pass=share_wrapper_inputs if shared else None)
    _report(f"q/k/v at {TOKENS} tokens ({'shared-input pass' if shared else 'separate B-passes'})", ops)
    assert not _copies(ops) and "aten.bmm.default" not in ops, ops
    assert len(_sparse_gemms(ops)) == 3
    assert ops.count(WRAPPER_PASS) == (3 if shared else 6)
    assert ops.count("torch_armor.block_diag_rows_shared.default") == (1 if shared else 0)
    assert [o.stride() for o in outs] == [(TOKENS * D, D, 1), (TOKENS * 1024, 1024, 1), (TOKENS * 1024, 1024, 1)]


def test_bmm_fallback_without_triton(monkeypatch):
    """Without Triton the wrappers are batched matmuls: still one sparse GEMM and a row-major output."""
    monkeypatch.setattr(block_diag_kernels, "triton_importable", lambda: False)
    with fake_cuda(monkeypatch):
        w = _cusparselt_layer(d_out=1024, d_in=512)
        ops, out = traced_ops(lambda t: F.linear(t, w), torch.empty(7, 512, device="cuda", dtype=torch.bfloat16))
    _report("bmm fallback, 7 tokens", ops)
    assert ops.count("aten.bmm.default") == 2 and len(_sparse_gemms(ops)) == 1 and WRAPPER_PASS not in ops
    assert out.stride() == (1024, 1)


def test_layer_moved_to_cuda_bf16_from_a_cpu_prune(monkeypatch):
    """Issue #21 rows 1 and 5: a CPU prune (dense fp32 core, prune_model's CPU default) moved with
    ``.to("cuda", torch.bfloat16)`` gets the 2:4 core; before it stayed dense (or compact)."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(D, D, generator=gen)
    factors = factorize(weight, torch.rand(D, generator=gen) + 0.1, ArmorConfig(optimizer=BcdConfig(iters=0)))
    lin = armor_linear_from_factors(nn.Linear(D, D, bias=False), factors, storage="dense", name="model.q_proj")
    assert lin.weight.storage_format == "dense" and lin.weight.block_size == D_B
    with fake_cuda(monkeypatch):
        lin.to("cuda", torch.bfloat16)
        w = lin.weight
        assert isinstance(w, CusparseltArmorTensor) and w.device.type == "cuda" and w.dtype == torch.bfloat16
        assert w.layer_name == "model.q_proj"
        x = torch.empty(2, TOKENS // 2, D, device="cuda", dtype=torch.bfloat16)
        ops, out = traced_ops(lin, x)
    _report("layer moved with .to('cuda', torch.bfloat16) from a CPU prune", ops)
    assert not _copies(ops), ops
    assert len(_sparse_gemms(ops)) == 1 and ops.count(WRAPPER_PASS) == 2
    assert out.shape == (2, TOKENS // 2, D) and out.is_contiguous()


def test_bias_is_fused_into_the_a_pass(monkeypatch, wrapper_path):
    with fake_cuda(monkeypatch):
        w = _cusparselt_layer(d_out=1024, d_in=512)
        bias = torch.empty(1024, device="cuda", dtype=torch.bfloat16)
        ops, _ = traced_ops(lambda t: F.linear(t, w, bias), torch.empty(64, 512, device="cuda", dtype=torch.bfloat16))
    assert "aten.add.Tensor" not in ops if wrapper_path == "fused" else ops.count("aten.add.Tensor") == 1
    assert not _copies(ops, allowed=("clone", "_unsafe_view") if wrapper_path == "bmm" else ()), ops


def test_chained_layers(monkeypatch):
    """A second 2:4 layer fed the first one's output copies nothing either."""
    pytest.importorskip("triton")
    with fake_cuda(monkeypatch):
        w1, w2 = _cusparselt_layer(d_out=1024, d_in=512), _cusparselt_layer(d_out=512, d_in=1024)
        x = torch.empty(4, 32, 512, device="cuda", dtype=torch.bfloat16)
        ops, out = traced_ops(lambda t: F.linear(torch.relu(F.linear(t, w1)), w2), x)
    assert not _copies(ops), ops
    assert len(_sparse_gemms(ops)) == 2 and out.shape == (4, 32, 512) and out.is_contiguous()


def test_cutlass_layer_traces_to_its_own_gemm(monkeypatch):
    with fake_cuda(monkeypatch, capability=(8, 0), backends=("cutlass",)):
        a = torch.empty(64, 16, 16, device="cuda", dtype=torch.float16)
        packed = torch.empty(1024, 512, device="cuda", dtype=torch.float16)
        meta = torch.empty(1024, 64, device="cuda", dtype=torch.int16)
        w = CutlassArmorTensor(a, a, packed, meta, "2:4", torch.float16)
        ops, out = traced_ops(lambda t: F.linear(t, w), torch.empty(256, 1024, device="cuda", dtype=torch.float16))
    assert ops.count("aten._sparse_semi_structured_mm.default") == 1
    assert not _copies(ops), ops
    assert out.stride() == (1024, 1)


# ----------------------------------------------------------------------------- the policy on moves


def test_fp32_on_cuda_stays_dense_with_one_warning_naming_the_layer_then_bf16_is_2to4(monkeypatch):
    """Issue #21 row 1: before, a float32 CUDA core was silently dense."""
    monkeypatch.setattr(policy, "_WARNED", set())
    w = ArmorTensor.from_factors(random_pattern_factors(256, 512, 16), storage="dense", name="layers.0.mlp.up")
    with fake_cuda(monkeypatch):
        with pytest.warns(policy.ArmorStorageWarning, match=r"layers\.0\.mlp\.up: .*float32.*bfloat16"):
            on_gpu = w.to("cuda")
        assert on_gpu.storage_format == "dense" and on_gpu.device.type == "cuda"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same reason is not warned twice
            w.to("cuda")
        assert isinstance(on_gpu.bfloat16(), CusparseltArmorTensor)
        assert isinstance(on_gpu.half(), CusparseltArmorTensor)


def test_compact_core_never_stays_compact_on_cuda(monkeypatch):
    """Issue #21 row 5: before, ``.to("cuda")`` kept a compact core (unpacked with int64 temporaries every call)."""
    w = ArmorTensor.from_factors(random_pattern_factors(256, 512, 16), storage="compact")
    with fake_cuda(monkeypatch):
        with pytest.warns(policy.ArmorStorageWarning):
            assert w.to("cuda").storage_format == "dense"  # fp32: no 2:4 kernel
        assert isinstance(w.to("cuda", torch.bfloat16), CusparseltArmorTensor)


def test_hopper_never_gets_cutlass(monkeypatch):
    """Issue #21 row 3: before, CUTLASS was chosen on sm90 (or a build without cuSPARSELt), and the first
    matmul raised "compute capability 8.x"."""
    monkeypatch.setattr(policy, "_WARNED", set())
    w = ArmorTensor.from_factors(random_pattern_factors(256, 512, 16), storage="dense")
    with fake_cuda(monkeypatch, capability=(9, 0), backends=("cutlass",)):
        with pytest.warns(policy.ArmorStorageWarning, match="sm8x only"):
            assert w.to("cuda", torch.bfloat16).storage_format == "dense"
    # (on sm8x the policy does pick CUTLASS there: tests/tensor/test_policy.py; its packer needs a CUDA build)


def test_loaded_checkpoint_gets_the_policy_on_cuda(monkeypatch):
    """Issue #21 row 6 (the part that runs here): a layer saved dense (CPU or fp32 prune) that lands on a GPU
    in bf16 is re-stored by the policy, not kept dense; on CPU the saved storage stays."""
    from torch_armor.tensor.armor_tensor import restore_storage

    w = ArmorTensor.from_factors(random_pattern_factors(256, 512, 16), storage="dense")
    assert restore_storage(w, "dense").storage_format == "dense"
    assert restore_storage(w, "semi_structured").storage_format == "compact"
    with fake_cuda(monkeypatch):
        on_gpu = w.to("cuda", torch.bfloat16).with_storage("dense")
        assert on_gpu.storage_format == "dense"
        assert isinstance(restore_storage(on_gpu, "dense", name="model.layers.0.self_attn.q_proj"),
                          CusparseltArmorTensor)


# ---------------------------------------------------------------- CPU-backed semi-structured buffers


def _cutlass_cpu(seed=0, dtype=torch.bfloat16):
    f = random_pattern_factors(64, 128, 16, seed=seed)
    core = f.core.to(dtype)
    packed, meta = cutlass_pack(core)
    return CutlassArmorTensor(f.a_blocks.to(dtype), f.b_blocks.to(dtype), packed, meta, "2:4", dtype), core


def test_cutlass_buffers_round_trip_and_copy(tmp_path):
    """Issue #21 row 7: before, ``copy_`` into a semi-structured core failed (torch's semi-structured tensor has
    no ``copy_``) and ``torch.load(weights_only=True)`` rejected its class."""
    w, core = _cutlass_cpu(seed=1)
    assert torch.equal(w.core_dense(), core)
    other, _ = _cutlass_cpu(seed=2)
    other.copy_(w)
    assert torch.equal(other.core_dense(), core) and torch.equal(other.a_blocks, w.a_blocks)
    torch.save({"w": w}, tmp_path / "sd.pt")
    back = torch.load(tmp_path / "sd.pt", weights_only=True)["w"]
    assert type(back) is CutlassArmorTensor and torch.equal(back.core_dense(), core)


def test_cusparselt_buffers_copy_and_load_weights_only(tmp_path):
    """The cuSPARSELt layer is plain buffers too: copy_ and weights_only loading work on any device."""
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(4, 16, 16, generator=gen), torch.randn(8, 16, 16, generator=gen),
             torch.randn(64 * 128 * 9 // 16, generator=gen).view(64, -1)]
    w = CusparseltArmorTensor(*[p.bfloat16() for p in parts], "2:4", torch.bfloat16)
    dst = CusparseltArmorTensor(*[torch.zeros_like(p).bfloat16() for p in parts], "2:4", torch.bfloat16)
    dst.copy_(w)
    assert torch.equal(dst.packed, w.packed) and torch.equal(dst.b_blocks, w.b_blocks)
    torch.save({"w": w}, tmp_path / "sd.pt")
    back = torch.load(tmp_path / "sd.pt", weights_only=True)["w"]
    assert type(back) is CusparseltArmorTensor and torch.equal(back.packed, w.packed)


@pytest.mark.parametrize("backend, why", [("cutlass", "trial matmul failed"), ("cusparselt", "compression failed")])
def test_refusing_kernel_falls_back_to_dense_with_one_warning(monkeypatch, backend, why):
    """The conversion-time checks: here the kernels really refuse (this CPU build has no 2:4 kernels: CUTLASS
    packs on CPU but cannot multiply, cuSPARSELt cannot even compress), so the layer keeps a dense core and
    says why, naming the layer."""
    monkeypatch.setattr(policy, "_WARNED", set())
    gpu = policy.DeviceInfo("cuda", (8, 0), frozenset({backend}))
    monkeypatch.setattr(policy, "device_info", lambda d: gpu)  # this CPU claims to be an sm80 GPU
    w = ArmorTensor.from_factors(random_pattern_factors(64, 128, 16), storage="dense", dtype=torch.bfloat16,
                                 name="layers.3.mlp.down")
    with pytest.warns(policy.ArmorStorageWarning, match=rf"layers\.3\.mlp\.down: .*{backend}.*{why}"):
        out = w.with_storage("semi_structured", backend=backend)
    assert out.storage_format == "dense" and torch.equal(out.core_dense(), w.core_dense())
