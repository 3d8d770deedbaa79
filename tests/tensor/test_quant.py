"""Tests for torch_armor.tensor.quant: torchao int8 configs on the ARMOR core, eager and compiled, saved and loaded."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

from torch_armor.core.factors import ArmorFactors
from torch_armor.calibration.observer import decoder_linear_names
from torch_armor.tensor.quant import (
    ArmorCoreConfig,
    dequantize_armor_core,
    is_armor_linear,
    quantize_armor_core,
)
from torch_armor.format.serialization import load_pretrained, save_pretrained
from torch_armor.sparsifier import ArmorSparsifier
from torch_armor.tensor.armor_tensor import ArmorTensor, armor_linear_from_factors

from conftest import make_tiny_llama
from torch_armor import ArmorConfig
from torch_armor.config.armor import BcdConfig

# set_inductor_config=False: torchao's recommended inductor settings change global state; the
# tests do not need them (and they only tune GPU kernels).
WO = Int8WeightOnlyConfig(set_inductor_config=False)
DA = Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
CONFIGS = {"int8_weight_only": WO, "int8_dynamic": DA}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().float(), ref.detach().float()
    return float((out - ref).norm() / ref.norm())


def random_factors(d_out: int, d_in: int, d_b: int, seed: int = 0) -> ArmorFactors:
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.rand(d_out, d_in // 4, 4, generator=gen).argsort(-1).argsort(-1)
    mask = (ranks < 2).reshape(d_out, d_in)
    core = torch.randn(d_out, d_in, generator=gen) * mask
    eye = torch.eye(d_b)
    a = eye + 0.2 * torch.randn(d_out // d_b, d_b, d_b, generator=gen)
    b = eye + 0.2 * torch.randn(d_in // d_b, d_b, d_b, generator=gen)
    return ArmorFactors(a, core, b, mask, "2:4")


def converted_mlp(seed: int = 0) -> nn.Module:
    """Two converted linears (64 → 128 → 64) around a ReLU, plus a dense head."""
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.Linear(64, 8)).eval()
    armor_linear_from_factors(model[0], random_factors(128, 64, 16, seed))
    armor_linear_from_factors(model[2], random_factors(64, 128, 16, seed + 1))
    return model


@pytest.fixture(scope="module")
def llamas():
    """(dense, converted): the tiny random Llama of conftest and its ARMOR conversion (block 16, BCD)."""
    dense = make_tiny_llama()
    model = copy.deepcopy(dense)
    sparsifier = ArmorSparsifier(ArmorConfig(block_size=16, optimizer=BcdConfig(iters=5)), progress=False)
    sparsifier.prepare(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model(torch.randint(0, 128, (8, 32), generator=gen))
    return dense, sparsifier.convert(model)


@pytest.fixture(scope="module")
def converted_llama(llamas):
    return llamas[1]


@pytest.fixture(scope="module")
def eval_ids():
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


# --------------------------------------------------------------------------- config


def test_config_validation():
    assert ArmorCoreConfig(WO).inner is WO
    with pytest.raises(TypeError, match="config instance"):
        ArmorCoreConfig("int8")
    with pytest.raises(TypeError, match=r"write Int8WeightOnlyConfig\(\)"):
        ArmorCoreConfig(Int8WeightOnlyConfig)
    with pytest.raises(TypeError, match="another ArmorCoreConfig"):
        ArmorCoreConfig(ArmorCoreConfig(WO))


# ---------------------------------------------------------------------- single layer


@pytest.mark.parametrize("name, bound", [("int8_weight_only", 0.01)])
def test_quantize_core_keeps_wrappers(name, bound):
    f = random_factors(64, 128, 16)
    w = ArmorTensor.from_factors(f, storage="compact")
    q = quantize_armor_core(w, CONFIGS[name])
    assert q.storage_format == "quantized" and type(q.core).__name__ == "Int8Tensor"
    assert q.core.qdata.dtype == torch.int8 and q.core.qdata.shape == (64, 128)
    assert q.a_blocks is w.a_blocks and q.b_blocks is w.b_blocks  # A, B untouched, fp32
    assert q.dtype == torch.float32 and q.shape == w.shape and q.quant_config is CONFIGS[name]
    # symmetric int8 maps 0 to 0: the int8 core stays inside the 2:4 support (tiny values may round to 0)
    assert not bool(((q.core.qdata != 0) & ~f.mask).any())
    x = torch.randn(5, 7, 128)
    ref = F.linear(x, w)
    out = F.linear(x, q)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert rel_err(out, ref) < bound
    # the quantized linear equals A · dequantized core · B for weight-only (same math, fp rounding)
    if name == "int8_weight_only":
        torch.testing.assert_close(out, x @ q.dense_weight().T, rtol=1e-4, atol=1e-4)


def test_bf16_activation_dtype():
    w = ArmorTensor.from_factors(random_factors(32, 64, 16), dtype=torch.bfloat16)
    q = quantize_armor_core(w, WO)
    assert q.a_blocks.dtype == q.b_blocks.dtype == torch.bfloat16 and q.core.qdata.dtype == torch.int8
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    out = F.linear(x, q)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, F.linear(x, w)) < 0.03
    # .to(dtype) casts A and B; the int8 core and its scales are moved, not cast
    q32 = q.to(torch.float32)
    assert q32.a_blocks.dtype == torch.float32 and q32.storage_format == "quantized"
    assert torch.equal(q32.core.qdata, q.core.qdata)


def test_quantized_core_errors_and_dequantize():
    w = ArmorTensor.from_factors(random_factors(32, 64, 16))
    q = quantize_armor_core(w, WO)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_armor_core(q, WO)
    with pytest.raises(ValueError, match="dequantize_armor_core"):
        q.with_storage("compact")
    assert q.with_storage("quantized") is q
    with pytest.raises(TypeError, match="ArmorTensor"):
        quantize_armor_core(torch.randn(4, 4), WO)
    d = dequantize_armor_core(q, "compact")
    assert d.storage_format == "compact"
    x = torch.randn(4, 64)
    torch.testing.assert_close(F.linear(x, d), F.linear(x, q), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- quantize_


def test_quantize_only_touches_armor_linears():
    model = converted_mlp()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    ref = model(x)
    quantize_(model, ArmorCoreConfig(WO))
    assert model[0].weight.storage_format == model[2].weight.storage_format == "quantized"
    assert type(model[3].weight) is nn.Parameter and type(model[3].weight.data) is torch.Tensor
    assert "core=Int8Tensor" in repr(model[0])
    assert rel_err(model(x), ref) < 0.02  # int8 weights: about 1% (the input was unseeded before)
    before = model[0].weight.core
    quantize_(model, ArmorCoreConfig(WO))  # a second call leaves quantized cores alone
    assert model[0].weight.core is before


def test_apply_to_dense_quantizes_the_rest():
    model = converted_mlp()
    quantize_(model, ArmorCoreConfig(WO, apply_to_dense=True))
    assert model[0].weight.storage_format == "quantized"
    assert type(model[3].weight).__name__ == "Int8Tensor"


def test_plain_config_on_converted_model_says_use_armor_core_config():
    model = converted_mlp()
    for cfg in (WO, DA):
        with pytest.raises(NotImplementedError, match="ArmorCoreConfig"):
            quantize_(copy.deepcopy(model), cfg)
    # the documented way to quantize only the dense layers with a plain config
    quantize_(model, WO, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and not is_armor_linear(m))
    assert isinstance(model[0].weight, ArmorTensor) and model[0].weight.storage_format == "compact"
    assert type(model[3].weight).__name__ == "Int8Tensor"


# ---------------------------------------------------------------- whole model, eager


@pytest.mark.parametrize("name, bound", [("int8_weight_only", 0.05), ("int8_dynamic", 0.10)])
def test_tiny_llama_error_vs_fp32(llamas, eval_ids, name, bound):
    """Relative logit error of the int8-core model vs the fp32 converted model (numbers in quant.py).

    The random tiny Llama amplifies weight noise; torchao's own int8 on the *dense* model's
    decoder linears has the same error, which is the fair yardstick.
    """
    dense, converted = llamas
    model = copy.deepcopy(converted)
    with torch.no_grad():
        ref = model(eval_ids).logits
        quantize_(model, ArmorCoreConfig(CONFIGS[name]))
        out = model(eval_ids).logits
        dense_ref = dense(eval_ids).logits
        dense_q = copy.deepcopy(dense)
        names = set(decoder_linear_names(dense))
        quantize_(dense_q, CONFIGS[name], filter_fn=lambda m, fqn: fqn in names)
        dense_err = rel_err(dense_q(eval_ids).logits, dense_ref)
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    # weight-only: torchao's dense Int8Tensor core; dynamic activations: the int8 2:4 core (tensor/eight_bit.py)
    assert q_proj.storage_format == {"int8_weight_only": "quantized", "int8_dynamic": "int8"}[name]
    assert q_proj.a_blocks.dtype == torch.float32
    assert type(model.lm_head.weight.data) is torch.Tensor  # not a decoder linear: untouched
    err = rel_err(out, ref)
    print(f"{name}: relative logit error vs fp32: ARMOR core {err:.4%}, torchao on the dense model {dense_err:.4%}")
    assert err < bound
    assert err < 1.5 * dense_err


@pytest.mark.parametrize("name", ["int8_weight_only"])  # int8 2:4 cores: tests/tensor/test_eight_bit.py
def test_save_load_quantized_bit_identical(converted_llama, eval_ids, tmp_path, name):
    model = copy.deepcopy(converted_llama)
    save_pretrained(model, tmp_path / "fp32")
    quantize_(model, ArmorCoreConfig(CONFIGS[name]))
    save_pretrained(model, tmp_path / "int8")
    loaded = load_pretrained(tmp_path / "int8")
    w = loaded.model.layers[1].mlp.down_proj.weight
    assert w.storage_format == "quantized" and type(w.core).__name__ == "Int8Tensor"
    assert w.quant_config == CONFIGS[name]
    with torch.no_grad():
        assert torch.equal(loaded(eval_ids).logits, model(eval_ids).logits)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "int8" / "model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
        values = fh.get_tensor("model.layers.0.mlp.up_proj.weight.core.qdata.values")
    assert values.dtype == torch.int8 and values.shape == (128, 32)  # int8 qdata stored 2:4-compact
    assert "model.layers.0.mlp.up_proj.weight.core.scale" in keys
    assert (tmp_path / "int8" / "model.safetensors").stat().st_size < (tmp_path / "fp32" / "model.safetensors").stat().st_size


# ------------------------------------------------------------------------- compiled


@pytest.mark.parametrize("name", ["int8_weight_only", "int8_dynamic"])
def test_compiled_matches_eager(name):
    """Inductor, fullgraph, zero graph breaks; compiled output matches eager (small model: fast compile)."""
    torch._dynamo.reset()
    model = converted_mlp(seed=3)
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        ref = model(x)
        quantize_(model, ArmorCoreConfig(CONFIGS[name]))
        eager = model(x)
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 0 and explained.graph_count == 1
        compiled = torch.compile(model, fullgraph=True)(x)
    # weight-only: same math, float rounding; dynamic: rounding can flip an activation's int8 value
    assert rel_err(compiled, eager) < (1e-5 if name == "int8_weight_only" else 1e-2)
    assert rel_err(compiled, ref) < (0.01 if name == "int8_weight_only" else 0.03)
