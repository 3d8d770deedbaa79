"""Tests for torch_armor.tensor.armor_tensor.ArmorTensor: linear correctness, conversions, compile, interop."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from _helpers import random_pattern_factors
import torch.nn.functional as F
from torch import nn

from torch_armor.core.factors import ArmorFactors
from torch_armor.tensor.armor_tensor import ArmorTensor, armor_linear_from_factors


def assert_half_close(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-2) -> None:
    """Half-precision check relative to the output's scale (elementwise tolerances are too noisy)."""
    out, ref = out.float(), ref.float()
    assert (out - ref).norm() <= rel * ref.norm(), float((out - ref).norm() / ref.norm())
    assert (out - ref).abs().max() <= 5 * rel * ref.abs().max()


@pytest.mark.parametrize("storage", ["compact", "dense"])
@pytest.mark.parametrize("lead", [(), (3,), (2, 5), (2, 3, 4)])
def test_linear_matches_dense_fp32(storage, lead):
    f = random_pattern_factors(32, 64, 16)
    w = ArmorTensor.from_factors(f, storage=storage)
    x = torch.randn(*lead, 64)
    bias = torch.randn(32)
    ref = x @ f.dense().T + bias
    out = F.linear(x, w, bias)
    assert out.shape == (*lead, 32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(F.linear(x, w), x @ f.dense().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern, storage", [("4:8", "compact"), ("1:4", "dense"), ("unstructured:0.5", "dense")])
def test_linear_other_patterns(pattern, storage):
    f = random_pattern_factors(24, 48, 8, pattern=pattern, seed=1)
    w = ArmorTensor.from_factors(f, storage=storage)
    assert w.pattern == pattern and w.storage_format == storage
    x = torch.randn(4, 7, 48)
    torch.testing.assert_close(F.linear(x, w), x @ f.dense().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage", ["compact", "dense"])
def test_linear_bf16(storage):
    f = random_pattern_factors(64, 128, 32, seed=2)
    w = ArmorTensor.from_factors(f, storage=storage, dtype=torch.bfloat16)
    assert w.dtype == torch.bfloat16 and w.a_blocks.dtype == torch.bfloat16
    x = torch.randn(2, 6, 128)
    ref = x @ f.dense().T  # fp32 reference from the fp32 factors
    out = F.linear(x.bfloat16(), w, torch.zeros(64, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    assert_half_close(out, ref)


def test_core_and_dense_weight_are_exact():
    f = random_pattern_factors(32, 64, 16, seed=3)
    for storage in ("compact", "dense"):
        w = ArmorTensor.from_factors(f, storage=storage)
        assert torch.equal(w.core_dense(), f.core)
        assert torch.equal(w.dense_weight(), f.dense())
        assert w.block_size == 16 and w.nm == (2, 4) and w.shape == (32, 64)


def test_with_storage_roundtrip_exact():
    f = random_pattern_factors(32, 64, 16, seed=4)
    w = ArmorTensor.from_factors(f, storage="compact")
    d = w.with_storage("dense")
    assert d.storage_format == "dense" and type(d).__name__ == "DenseArmorTensor" and d.core is not None
    back = d.with_storage("compact")
    assert torch.equal(back.values, w.values) and torch.equal(back.indices, w.indices)
    assert w.with_storage("compact") is w
    assert w.with_storage("auto").storage_format == "compact"  # CPU N:M


def test_auto_storage_on_cpu():
    assert ArmorTensor.from_factors(random_pattern_factors(16, 32, 8)).storage_format == "compact"
    assert ArmorTensor.from_factors(random_pattern_factors(16, 32, 8, pattern="unstructured:0.5")).storage_format == "dense"


def test_compact_storage_is_smaller():
    f = random_pattern_factors(64, 128, 16, seed=5, dtype=torch.float16)
    w = ArmorTensor.from_factors(f, storage="compact")
    compact = w.values.numel() * w.values.element_size() + w.indices.numel()
    dense = f.core.numel() * f.core.element_size()
    assert compact == dense // 2 + f.core.numel() // 8


@pytest.mark.parametrize("storage", ["compact", "dense"])
def test_to_dtype_really_converts(storage):
    f = random_pattern_factors(32, 64, 16, seed=6)
    w = ArmorTensor.from_factors(f, storage=storage)
    for conv, dtype in [
        (lambda t: t.to(torch.bfloat16), torch.bfloat16),
        (lambda t: t.half(), torch.float16),
        (lambda t: t.bfloat16(), torch.bfloat16),
        (lambda t: t.to(dtype=torch.float64), torch.float64),
        (lambda t: t.to("cpu", torch.float16), torch.float16),
    ]:
        c = conv(w)
        assert isinstance(c, ArmorTensor) and c.dtype == dtype and c.storage_format == storage
        assert c.a_blocks.dtype == dtype and c.b_blocks.dtype == dtype
        if storage == "compact":
            assert c.values.dtype == dtype and c.indices.dtype == torch.uint8
            assert torch.equal(c.indices, w.indices)
        else:
            assert c.core.dtype == dtype
        torch.testing.assert_close(c.core_dense(), f.core.to(dtype))
        torch.testing.assert_close(c.a_blocks, f.a_blocks.to(dtype))
    assert w.to("cpu") is w and w.cpu().storage_format == storage
    assert torch.equal(w.float().dense_weight(), w.dense_weight())
    with pytest.raises(ValueError, match="cannot be cast to torch.int8"):
        w.to(torch.int8)


def test_repr():
    w = ArmorTensor.from_factors(random_pattern_factors(32, 64, 16), storage="compact")
    text = repr(w)
    for part in ("ArmorTensor", "shape=(32, 64)", "block_size=16", "pattern=2:4", "storage=compact", "float32"):
        assert part in text
    assert "storage=dense" in repr(w.with_storage("dense"))


def test_nn_linear_swap_and_module_conversions():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    bias = lin.bias
    f = random_pattern_factors(32, 64, 16, seed=7)
    assert armor_linear_from_factors(lin, f, storage="compact") is lin
    assert isinstance(lin.weight, nn.Parameter) and isinstance(lin.weight, ArmorTensor)
    assert not lin.weight.requires_grad
    assert lin.bias is bias
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(lin(x), x @ f.dense().T + bias, rtol=1e-5, atol=1e-5)
    # gradients still flow to the input (needed when calibrating later layers)
    xg = x.clone().requires_grad_(True)
    lin(xg).sum().backward()
    torch.testing.assert_close(xg.grad, f.dense().sum(0).expand_as(x), rtol=1e-4, atol=1e-4)
    # module-level dtype conversions convert the inner tensors
    lin.bfloat16()
    assert lin.weight.dtype == torch.bfloat16 and lin.weight.values.dtype == torch.bfloat16
    assert isinstance(lin.weight, nn.Parameter) and lin.bias.dtype == torch.bfloat16
    assert lin(x.bfloat16()).dtype == torch.bfloat16
    lin.to(torch.float32)
    assert lin.weight.dtype == torch.float32 and lin.weight.a_blocks.dtype == torch.float32
    assert_half_close(lin(x), x @ f.dense().T + bias.float())
    # state_dict, deepcopy, clone, detach keep the subclass
    assert isinstance(lin.state_dict()["weight"], ArmorTensor)
    dup = copy.deepcopy(lin)
    assert torch.equal(dup(x), lin(x))
    assert torch.equal(lin.weight.clone().values, lin.weight.values)
    assert isinstance(lin.weight.detach(), ArmorTensor)


def test_errors():
    f = random_pattern_factors(32, 64, 16)
    with pytest.raises(ValueError, match="storage must be one of"):
        ArmorTensor.from_factors(f, storage="csr")
    with pytest.raises(ValueError, match="CUDA"):
        ArmorTensor.from_factors(f, storage="semi_structured")
    with pytest.raises(ValueError, match="needs an N:M pattern"):
        ArmorTensor.from_factors(random_pattern_factors(16, 32, 8, pattern="unstructured:0.5"), storage="compact")
    bad = ArmorFactors(f.a_blocks[:1], f.core, f.b_blocks, f.mask, "2:4")
    with pytest.raises(ValueError, match="a_blocks must be"):
        ArmorTensor.from_factors(bad)
    off = f.core.clone()
    off[~f.mask] = 1.0
    with pytest.raises(ValueError, match="outside factors.mask"):
        ArmorTensor.from_factors(ArmorFactors(f.a_blocks, off, f.b_blocks, f.mask, "2:4"))
    full = torch.ones_like(f.mask)
    with pytest.raises(ValueError, match="2:4 pattern"):
        ArmorTensor.from_factors(ArmorFactors(f.a_blocks, f.core, f.b_blocks, full, "2:4"))
    w = ArmorTensor.from_factors(f)
    with pytest.raises(ValueError, match="d_in=64"):
        F.linear(torch.randn(2, 63), w)
    with pytest.raises(ValueError, match="factors are for"):
        armor_linear_from_factors(nn.Linear(32, 64), f)


class _TwoLayer(nn.Module):
    def __init__(self, storage_1: str, storage_2: str):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 64)
        armor_linear_from_factors(self.fc1, random_pattern_factors(32, 64, 16, seed=8), storage=storage_1)
        armor_linear_from_factors(self.fc2, random_pattern_factors(64, 32, 16, seed=9), storage=storage_2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("storages", [("compact", "dense"), ("dense", "compact")])
def test_compile_fullgraph_aot_eager(storages):
    torch._dynamo.reset()
    model = _TwoLayer(*storages).eval()
    x = torch.randn(2, 7, 64)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


def test_compile_fullgraph_inductor():
    torch._dynamo.reset()
    model = _TwoLayer("compact", "dense").eval()
    x = torch.randn(3, 64)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


# CUDA: tests/tensor/test_cuda.py (real GPU), tests/tensor/test_semi_structured.py (fake CUDA traces)


# ----------------------------------------------------------------- plain PyTorch interop (issue #13)


def _converted_llama():
    from conftest import make_tiny_llama

    model = make_tiny_llama()
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and ".layers." in name:
            f = random_pattern_factors(mod.out_features, mod.in_features, 16, seed=len(name))
            armor_linear_from_factors(mod, f, storage="compact")
    return model


def test_storage_is_the_tensor_method_and_says_how_to_save(tmp_path):
    """Before #13: safetensors.torch.save_model / save_pretrained died with "'str' object is not callable";
    before #21 the format name shadowed ``Tensor.storage`` (now ``storage_format``)."""
    from safetensors.torch import save_model

    model = _converted_llama()
    w = model.model.layers[0].mlp.up_proj.weight
    assert w.storage_format == "compact" and w.storage.__func__ is torch.Tensor.storage
    with pytest.raises(TypeError, match="no single storage"):
        w.storage()
    with pytest.raises(TypeError, match=r"torch_armor\.save_pretrained\(model, directory\)"):
        save_model(model, str(tmp_path / "x.safetensors"))
    with pytest.raises(TypeError, match=r"torch_armor\.save_pretrained\(model, directory\)"):
        model.save_pretrained(tmp_path / "hf")
    import torch_armor

    torch_armor.save_pretrained(model, tmp_path / "hf")  # the one way to save, by-hand conversions included
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_torch_save_state_dict_loads_with_weights_only(tmp_path):
    """Before: torch.load(..., weights_only=True) refused the ArmorTensor globals."""
    model = _converted_llama()
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    state = torch.load(tmp_path / "sd.pt", weights_only=True)
    w = state["model.layers.1.self_attn.k_proj.weight"]
    assert isinstance(w, ArmorTensor) and w.storage_format == "compact"
    other = _converted_llama()
    for p in other.parameters():  # different values, same structure
        if not isinstance(p, ArmorTensor):
            nn.init.normal_(p)
    for mod in other.modules():
        if isinstance(getattr(mod, "weight", None), ArmorTensor):
            mod.weight.values.mul_(2.0)
    other.load_state_dict(state)  # copies part by part into the existing ArmorTensors
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert torch.equal(other(ids).logits, model(ids).logits)


def test_armor_state_dict_into_dense_model_says_what_to_do():
    """Before: "'Parameter' object has no attribute 'tensor_data_names'"."""
    from conftest import make_tiny_llama

    state = _converted_llama().state_dict()
    with pytest.raises(RuntimeError, match=r"cannot be loaded into a dense model.*torch_armor\.load_pretrained\(directory\)"):
        make_tiny_llama().load_state_dict(state)
    dense = make_tiny_llama().state_dict()
    with pytest.raises(RuntimeError, match="dense tensor cannot be copied into an ArmorTensor"):
        _converted_llama().load_state_dict(dense)


@pytest.mark.parametrize("src_storage, dst_storage", [("compact", "dense"), ("dense", "compact"), ("dense", "dense")])
def test_load_state_dict_across_storages(src_storage, dst_storage, tmp_path):
    """Issue #21 row 7: a checkpoint loads into a model whose cores are in another storage (copy_ converts)."""
    torch.manual_seed(0)
    src, dst = nn.Linear(64, 32), nn.Linear(64, 32)
    armor_linear_from_factors(src, random_pattern_factors(32, 64, 16, seed=1), storage=src_storage)
    armor_linear_from_factors(dst, random_pattern_factors(32, 64, 16, seed=2), storage=dst_storage)
    torch.save(src.state_dict(), tmp_path / "sd.pt")
    dst.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    assert dst.weight.storage_format == dst_storage
    x = torch.randn(5, 64)
    torch.testing.assert_close(dst(x), src(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="block size differ"):
        armor_linear_from_factors(dst, random_pattern_factors(32, 64, 8, seed=2))
        dst.load_state_dict(src.state_dict())


def test_quantized_core_saves_and_loads_weights_only(tmp_path):
    from torchao.quantization import Int8WeightOnlyConfig

    from torch_armor.tensor.quant import quantize_armor_core

    w = quantize_armor_core(ArmorTensor.from_factors(random_pattern_factors(32, 64, 16)),
                            Int8WeightOnlyConfig(set_inductor_config=False))
    torch.save({"w": w}, tmp_path / "q.pt")
    back = torch.load(tmp_path / "q.pt", weights_only=True)["w"]
    assert back.storage_format == "quantized" and torch.equal(back.core.qdata, w.core.qdata)
    other = quantize_armor_core(ArmorTensor.from_factors(random_pattern_factors(32, 64, 16, seed=5)),
                                Int8WeightOnlyConfig(set_inductor_config=False))
    other.copy_(back)
    x = torch.randn(3, 64)
    torch.testing.assert_close(F.linear(x, other), F.linear(x, w))


def test_one_class_per_storage_and_no_storage_branch_in_forward():
    """Each format computes its own linear; the shared code never asks which storage it holds."""
    import inspect

    from torch_armor.tensor import armor_tensor, linear_layout

    forward = [inspect.getsource(linear_layout)] + [inspect.getsource(cls._linear) for cls in armor_tensor._FORMATS.values()]
    # dense, compact, cuSPARSELt, CUTLASS, quantized; int8 and fp8, each compact and cuSPARSELt
    assert len(forward) == 1 + 5 + 4
    assert not [src for src in forward if "storage" in src or "backend" in src]
    names = {type(ArmorTensor.from_factors(random_pattern_factors(32, 64, 16), storage=s)).__name__
             for s in ("compact", "dense")}
    assert names == {"CompactArmorTensor", "DenseArmorTensor"}


# ----------------------------------------------------------------- torchao's per-class op tables, named constructors

def _storage_classes():
    import torch_armor.tensor  # noqa: F401  (every storage registered)
    from torch_armor.tensor import armor_tensor

    return list(armor_tensor._FORMATS.values())


def test_handlers_live_in_the_base_class_tables_and_every_storage_inherits_them():
    """The handlers are registered with ``ArmorTensor.implements`` (torchao's per-class tables) and every
    storage class's own table holds each of them (a storage class defined before a handler would miss it)."""
    aten = torch.ops.aten
    ours = ArmorTensor._ATEN_OP_TABLE[ArmorTensor]
    for op in (aten.linear.default, aten._to_copy.default, aten.to.dtype_layout, aten.detach.default,
               aten.clone.default, aten.alias.default, aten.contiguous.default, aten.copy_.default, aten.t.default):
        assert op in ours, op
    functions = ArmorTensor._TORCH_FN_TABLE[ArmorTensor]
    for fn in (F.linear, torch.Tensor.to, torch.Tensor.storage, torch.Tensor.requires_grad_, torch.Tensor.t):
        assert fn in functions, fn
    for cls in _storage_classes():
        assert cls._ATEN_OP_TABLE[cls].items() >= ours.items(), cls.__name__
        assert cls._TORCH_FN_TABLE[cls].items() >= functions.items(), cls.__name__
    import torch_armor.tensor.armor_tensor as module
    assert not hasattr(module, "implements") and not hasattr(module, "_ATEN")


def test_unsupported_op_still_says_what_to_use():
    w = ArmorTensor.from_factors(random_pattern_factors(8, 16, 4), storage="compact")
    with pytest.raises(NotImplementedError, match="dense_weight"):
        w.abs()


def _reference_dense(f: ArmorFactors) -> torch.Tensor:
    """``blockdiag(A) · core · blockdiag(B)`` in float64 with torch.block_diag (independent of the package)."""
    a = torch.block_diag(*f.a_blocks.double())
    b = torch.block_diag(*f.b_blocks.double())
    return a @ f.core.double() @ b


@settings(max_examples=25, deadline=None)
@given(blocks_out=st.integers(1, 3), blocks_in=st.integers(1, 3), d_b=st.sampled_from([4, 8]),
       storage=st.sampled_from(["dense", "compact", "int8"]), experts=st.sampled_from([0, 1, 3]),
       seed=st.integers(0, 2**16))
def test_named_constructor_and_flatten_unflatten_round_trip(blocks_out, blocks_in, d_b, storage, experts, seed):
    """Each storage class takes its inner tensors and attributes by name; flatten -> unflatten rebuilds
    the same class with an equal ``dense_weight()``, for one linear's weight and for E experts (the same
    class, its inner tensors with a leading E dimension)."""
    from torch_armor.tensor.armor_tensor import stack_experts
    from torch_armor.tensor.eight_bit import quantize_core_8bit

    assume(not (experts and storage == "int8"))  # 8-bit expert cores are refused (tested in test_experts)
    fs = [random_pattern_factors(blocks_out * d_b, blocks_in * d_b, d_b, seed=seed + e) for e in range(max(experts, 1))]
    layers = [ArmorTensor.from_factors(f, storage="compact" if storage == "int8" else storage) for f in fs]
    w = stack_experts(layers) if experts else layers[0]
    if storage == "int8":
        w = quantize_core_8bit(w, "int8")
    assert w.num_experts == (experts or None)
    names, attributes = w.__tensor_flatten__()
    assert names[:2] == ["a_blocks", "b_blocks"] and set(attributes) >= {"pattern", "dtype"}
    by_name = type(w)(**{n: getattr(w, n) for n in names}, **attributes, layer_name="model.layers.0.q_proj")
    assert by_name.layer_name == "model.layers.0.q_proj" and by_name.shape == w.shape
    back = type(w).__tensor_unflatten__({n: getattr(w, n) for n in names}, attributes, w.shape, w.stride())
    assert type(back) is type(w) and type(by_name) is type(w) is type(layers[0] if storage != "int8" else w)
    assert torch.equal(back.dense_weight(), w.dense_weight())
    assert torch.equal(by_name.dense_weight(), w.dense_weight())
    if storage != "int8":
        reference = torch.stack([_reference_dense(f) for f in fs]) if experts else _reference_dense(fs[0])
        torch.testing.assert_close(back.dense_weight().double(), reference, rtol=1e-5, atol=1e-5)
