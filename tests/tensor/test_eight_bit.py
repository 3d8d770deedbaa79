"""8-bit (int8, fp8 e4m3) 2:4 cores: the numbers, the formats, saving and loading, the CUDA path traced."""

from __future__ import annotations

import collections
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, Int4WeightOnlyConfig,
                                  Int8DynamicActivationInt8WeightConfig, quantize_)
from transformers import AutoModelForCausalLM

from _fake_cuda import fake_cuda, traced_ops
from _helpers import random_pattern_factors
from conftest import make_converted_tiny_llama

from torch_armor.errors import ArmorInputError
from torch_armor.kernels.quant8 import quantize_rows
from torch_armor.tensor import policy
from torch_armor.tensor.armor_tensor import ArmorTensor
from torch_armor.tensor.eight_bit import (Fp8ArmorTensor, Fp8CusparseltArmorTensor, Int8ArmorTensor,
                                          Int8CusparseltArmorTensor, quantize_core_8bit)
from torch_armor.tensor.quant import ArmorCoreConfig, dequantize_armor_core, quantize_armor_core
from torch_armor.format.serialization import load_pretrained, save_pretrained

CONFIGS = {"int8": Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
           "fp8": Float8DynamicActivationFloat8WeightConfig(set_inductor_config=False)}
CLASSES = {"int8": Int8ArmorTensor, "fp8": Fp8ArmorTensor}


def _weight(seed=0, d_out=64, d_in=128, dtype=torch.float32):
    return ArmorTensor.from_factors(random_pattern_factors(d_out, d_in, 16, seed=seed), storage="compact", dtype=dtype,
                                    name="model.layers.0.mlp.up_proj.weight")


def _rel(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_linear_computes_the_8bit_gemm_numbers(qdtype):
    """The output is ``A · (s_x ⊙ (q_core · q_x) ⊙ s_w) · B + bias``, computed here in float64 from the
    quantized values, and close to the floating weight's output (int8 < 2%, fp8 < 8% on these factors)."""
    w = _weight()
    q = quantize_core_8bit(w, qdtype)
    assert type(q) is CLASSES[qdtype] and q.storage_format == qdtype and q.values.dtype == q.q_core().dtype
    assert torch.equal(q.a_blocks, w.a_blocks) and torch.equal(q.b_blocks, w.b_blocks)
    gen = torch.Generator().manual_seed(1)
    x, bias = torch.randn(3, 5, 128, generator=gen), torch.randn(64, generator=gen)
    out = F.linear(x, q, bias)
    rows = x.reshape(-1, 128).double() @ torch.block_diag(*w.b_blocks.double()).T
    q_rows, row_scale = quantize_rows(rows.float(), qdtype)
    q_core, core_scale = quantize_rows(w.core_dense(), qdtype)
    sums = q_rows.double() @ q_core.double().T * row_scale.double()[:, None] * core_scale.double()[None, :]
    want = (sums @ torch.block_diag(*w.a_blocks.double()).T + bias.double()).reshape(3, 5, 64)
    assert out.shape == (3, 5, 64) and out.is_contiguous() and _rel(out, want) < 1e-5
    assert _rel(out, F.linear(x, w, bias)) < (0.02 if qdtype == "int8" else 0.08)
    # the 8-bit core keeps the 2:4 support (zeros stay zeros)
    assert not bool(((q.q_core().float() != 0) & (w.core_dense() == 0)).any())


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_moves_casts_copies_and_refusals(qdtype, tmp_path):
    q = quantize_core_8bit(_weight(dtype=torch.bfloat16), qdtype)
    f32 = q.to(torch.float32)  # A and B cast; the 8-bit values, positions and scales only moved
    assert type(f32) is type(q) and f32.a_blocks.dtype == torch.float32 and f32.dtype == torch.float32
    assert torch.equal(f32.values.view(torch.uint8), q.values.view(torch.uint8)) and torch.equal(f32.core_scale, q.core_scale)
    other = quantize_core_8bit(_weight(seed=5, dtype=torch.bfloat16), qdtype)
    other.copy_(q)
    assert torch.equal(other.values.view(torch.uint8), q.values.view(torch.uint8))
    holder, target = torch.nn.Linear(128, 64, bias=False), torch.nn.Linear(128, 64, bias=False)
    holder.weight, target.weight = torch.nn.Parameter(q, requires_grad=False), torch.nn.Parameter(other, requires_grad=False)
    other.values.zero_()
    target.load_state_dict(holder.state_dict())
    assert torch.equal(target.weight.values.view(torch.uint8), q.values.view(torch.uint8))
    torch.save({"w": q}, tmp_path / "w.pt")
    back = torch.load(tmp_path / "w.pt", weights_only=True)["w"]
    assert type(back) is type(q) and torch.equal(back.core_dense(), q.core_dense())
    with pytest.raises(ArmorInputError, match="dequantize"):
        q.with_storage("dense")
    with pytest.raises(ArmorInputError, match="already quantized"):
        quantize_core_8bit(q, qdtype)
    dense = dequantize_armor_core(q, "dense")
    assert dense.storage_format == "dense" and torch.equal(dense.core_dense(), q.core_dense())


def test_configs_that_cannot_keep_the_core_are_refused():
    with pytest.raises(ArmorInputError, match=r"Int4WeightOnlyConfig cannot quantize .*Int8DynamicActivationInt8WeightConfig"):
        quantize_armor_core(_weight(), Int4WeightOnlyConfig())
    with pytest.raises(ArmorInputError, match="must be 2:4"):
        quantize_core_8bit(ArmorTensor.from_factors(random_pattern_factors(64, 128, 16, pattern="4:8")), "int8")


@pytest.fixture(scope="module")
def converted_llama():
    return make_converted_tiny_llama(iters=2)


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_save_load_bit_identical_and_smaller(converted_llama, qdtype, tmp_path):
    """quantize_ with the torchao config, save_pretrained, then load_pretrained and from_pretrained: the same
    logits; the file holds the 8-bit values compact, their positions and a float32 scale per channel."""
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    model = copy.deepcopy(converted_llama)
    save_pretrained(model, tmp_path / "fp32")
    quantize_(model, ArmorCoreConfig(CONFIGS[qdtype]))
    assert type(model.model.layers[0].mlp.up_proj.weight) is CLASSES[qdtype]
    save_pretrained(model, tmp_path / qdtype)
    with torch.no_grad():
        want = model(ids).logits
        for loaded in (load_pretrained(tmp_path / qdtype), AutoModelForCausalLM.from_pretrained(tmp_path / qdtype)):
            assert type(loaded.model.layers[1].self_attn.k_proj.weight) is CLASSES[qdtype]
            assert torch.equal(loaded(ids).logits, want)
    key = "model.layers.0.mlp.up_proj.weight"
    with safe_open(str(tmp_path / qdtype / "model.safetensors"), "pt") as fh:
        values, scale = fh.get_tensor(f"{key}.values"), fh.get_tensor(f"{key}.core_scale")
        assert values.dtype == (torch.int8 if qdtype == "int8" else torch.float8_e4m3fn) and values.shape == (128, 32)
        assert scale.dtype == torch.float32 and scale.shape == (128,) and f"{key}.indices" in set(fh.keys())
    size = (tmp_path / qdtype / "model.safetensors").stat().st_size
    assert size < (tmp_path / "fp32" / "model.safetensors").stat().st_size


# ------------------------------------------------------------------------------------ CUDA, traced


def _cusparselt_8bit(cls, qdtype, d_out=4096, d_in=4096, d_b=16):
    a = torch.empty(d_out // d_b, d_b, d_b, device="cuda", dtype=torch.bfloat16)
    b = torch.empty(d_in // d_b, d_b, d_b, device="cuda", dtype=torch.bfloat16)
    qtype = torch.int8 if qdtype == "int8" else torch.float8_e4m3fn
    packed = torch.empty(d_out * d_in * 9 // 16, device="cuda", dtype=qtype).view(d_out, -1)
    return cls(a, b, packed, torch.empty(d_out, device="cuda"), "2:4", torch.bfloat16)


@pytest.mark.parametrize("qdtype, capability, cls", [("int8", (8, 0), Int8CusparseltArmorTensor),
                                                     ("fp8", (9, 0), Fp8CusparseltArmorTensor)])
@pytest.mark.parametrize("tokens", [2048, 1])
def test_cuda_forward_is_quantizing_b_pass_one_8bit_gemm_scaling_a_pass(monkeypatch, qdtype, capability, cls, tokens):
    """Traced on fake CUDA: one B-pass that quantizes, one 8-bit ``_cslt_sparse_mm``, one A-pass applying
    both scales; no host sync, no densified core, no separate pad or cast."""
    with fake_cuda(monkeypatch, capability=capability, backends=("cusparselt",)):
        w = _cusparselt_8bit(cls, qdtype)
        bias = torch.empty(4096, device="cuda", dtype=torch.bfloat16)
        ops, out = traced_ops(lambda t: F.linear(t, w, bias), torch.empty(tokens, 4096, device="cuda", dtype=torch.bfloat16))
    counts = collections.Counter(ops)
    print(f"\n{qdtype} 2:4 on sm{capability[0]}{capability[1]}, {tokens} tokens: {dict(counts)}")
    assert counts["torch_armor.quantizing_b_pass.default"] == 1 and counts["aten._cslt_sparse_mm.default"] == 1
    assert counts["torch_armor.scaled_a_pass.default"] == 1
    forbidden = ("_local_scalar_dense", "item", "nonzero", "mm", "bmm", "constant_pad_nd", "clone", "_to_copy")
    assert not [op for op in ops if op.startswith("aten.") and op.split(".")[1] in forbidden], ops
    assert out.shape == (tokens, 4096) and out.stride() == (4096, 1)


@pytest.mark.parametrize("qdtype, capability, expected", [("int8", (8, 0), Int8CusparseltArmorTensor),
                                                          ("fp8", (9, 0), Fp8CusparseltArmorTensor),
                                                          ("fp8", (8, 0), Fp8ArmorTensor)])
def test_policy_picks_the_8bit_kernel_per_gpu(monkeypatch, qdtype, capability, expected):
    """A CPU-quantized layer moved to the GPU gets cuSPARSELt's 8-bit core where the GPU has it (int8 sm80+,
    fp8 sm89+); elsewhere it keeps the compact 8-bit core, with one warning naming the layer and why."""
    monkeypatch.setattr(policy, "_WARNED", set())
    q = quantize_core_8bit(_weight(d_out=128, d_in=128), qdtype)
    with fake_cuda(monkeypatch, capability=capability, backends=("cusparselt",)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            on_gpu = q.to("cuda", torch.bfloat16)
    assert type(on_gpu) is expected and on_gpu.device.type == "cuda" and on_gpu.a_blocks.dtype == torch.bfloat16
    messages = [str(c.message) for c in caught if issubclass(c.category, policy.ArmorStorageWarning)]
    if expected is Fp8ArmorTensor:
        assert len(messages) == 1 and "mlp.up_proj" in messages[0] and "sm89" in messages[0]
    else:
        assert not messages
