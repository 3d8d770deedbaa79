"""ARMOR experts: fused 3-D expert weights (an (E, d_out, d_in) ArmorTensor) as E ARMOR layers, and the "armor" experts forward."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_armor  # noqa: F401  (registers the "armor" experts implementation)
from torch_armor.core.factors import ArmorFactors
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import ArmorTensor
from torch_armor.tensor import experts_forward
from torch_armor.tensor.armor_tensor import stack_experts
from torch_armor.tensor.experts import armor_experts_from_factors, experts_from_factors
from torch_armor.tensor.transposed import ArmorTransposed
from _helpers import random_factors
from _tiny_moe import ARCHS, EXPERT_PARAMS, armor_moe, experts_modules, make_moe


def _factors(e_count=3, d_out=8, d_in=16, d_b=4, seed=0, dtype=torch.float32):
    out = []
    for e in range(e_count):
        a, b, core, mask = random_factors(d_out, d_in, d_b, 2, 4, seed=seed + e, dtype=dtype)
        out.append(ArmorFactors(a, core, b, mask, "2:4"))
    return out


def _ids(vocab=64, seed=1):
    return torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- the tensor


@pytest.mark.parametrize("storage", ["compact", "dense"])
def test_from_factors_stacks_every_expert(storage):
    fs = _factors()
    w = experts_from_factors(fs, storage=storage, name="m.experts.gate_up_proj")
    assert isinstance(w, ArmorTensor) and w.num_experts is not None and tuple(w.shape) == (3, 8, 16) and w.storage_format == storage
    assert w.a_blocks.shape == (3, 2, 4, 4) and w.b_blocks.shape == (3, 4, 4, 4)
    dense = torch.stack([f.dense() for f in fs])
    assert torch.equal(w.dense_weight(), dense)
    for e in range(3):
        for got in (w.expert(e), w[e], w[torch.tensor(e)]):
            assert isinstance(got, ArmorTensor) and got.storage_format == storage and tuple(got.shape) == (8, 16)
            assert got.layer_name == f"m.experts.gate_up_proj.{e}"
            assert torch.equal(got.dense_weight(), fs[e].dense())
            assert torch.equal(got.core_dense() != 0, fs[e].mask)  # every expert core keeps its 2:4 mask
    x = torch.randn(5, 16, dtype=torch.float32)
    torch.testing.assert_close(F.linear(x, w[1]), x @ fs[1].dense().T, rtol=1e-5, atol=1e-5)


def test_expert_views_share_memory_with_the_stack():
    w = experts_from_factors(_factors(), storage="compact")
    assert w[2].values.untyped_storage().data_ptr() == w.values.untyped_storage().data_ptr()


def test_stored_parameters_counts_each_expert():
    fs = _factors()
    w = experts_from_factors(fs)
    by_hand = sum(f.a_blocks.numel() + f.b_blocks.numel() + int(f.mask.sum()) for f in fs)
    assert w.stored_parameters() == by_hand


def test_moves_and_casts_follow_the_policy():
    w = experts_from_factors(_factors(), storage="dense")
    h = w.to(torch.bfloat16)
    assert h.dtype == torch.bfloat16 and h.a_blocks.dtype == torch.bfloat16 and h.storage_format == "dense"
    assert torch.equal(h.dense_weight(torch.float32), torch.stack([x.dense_weight(torch.float32)
                                                                   for x in (e.to(torch.bfloat16) for e in w.experts())]))
    assert w.to("cpu") is w
    assert torch.equal(w.clone().dense_weight(), w.dense_weight()) and type(w.detach()) is type(w)


def test_copy_and_weights_only_load_round_trip():
    w = experts_from_factors(_factors(seed=0))
    other = experts_from_factors(_factors(seed=10))
    other.copy_(w)
    assert torch.equal(other.dense_weight(), w.dense_weight())
    buf = io.BytesIO()
    torch.save({"w": nn.Parameter(w, requires_grad=False)}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["w"]
    assert type(back) is type(w)
    for name in w.tensor_data_names:
        assert torch.equal(getattr(back, name), getattr(w, name))


@pytest.mark.parametrize("op, match", [
    (lambda w: w.transpose(0, 1), r"transpose\(0, 1\)"),
    (lambda w: w[torch.tensor([0, 1])], "batched_mm"),
    (lambda w: w + 1, "aten.add"),
    (lambda w: w.view(-1), "aten.view"),
])
def test_unsupported_ops_name_the_op_and_the_fix(op, match):
    w = experts_from_factors(_factors())
    with pytest.raises(NotImplementedError, match=match) as err:
        op(w)
    assert "experts_implementation='armor'" in str(err.value) and "\n" not in str(err.value)


def test_a_view_to_its_own_shape_is_itself_and_to_its_transpose_multiplies_as_f_linear():
    fs = _factors()  # 3 experts (8, 16)
    w = experts_from_factors(fs)
    assert w.view(-1, 8, 16) is w and w.view((3, 8, 16)) is w
    transposed = w.view(-1, 16, 8)  # how DBRX reads the experts it stores (E·in, out): w2.view(-1, I, H)[e]
    assert isinstance(transposed, ArmorTransposed) and tuple(transposed.shape) == (3, 16, 8)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    want = x @ fs[1].dense().T
    for got in (x.matmul(transposed[1]), x.matmul(w[1].T), x @ w[torch.tensor(1)].T, torch.matmul(x, w[1].t())):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert w[1].T.T is not None and torch.equal(w[1].T.T.dense_weight(), fs[1].dense())
    with pytest.raises(NotImplementedError, match="only runs x.matmul") as err:
        torch.add(w[1].T, 1)
    assert "\n" not in str(err.value)


def test_bmm_runs_each_experts_linear_on_its_own_rows():
    """``torch.bmm(x, w.transpose(1, 2))`` (Inkling's shared experts) and ``torch.bmm(x, w)`` by a module storing its
    experts (E, in, out) (Llama-4's, whose experts ARMOR holds transposed) are x[e]·W[e]ᵀ, W[e] = A·core·B in float64."""
    fs = _factors()  # 3 experts (8, 16)
    w = experts_from_factors(fs)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(4))
    want = torch.stack([x[e].double() @ fs[e].dense().double().T for e in range(3)])
    for got in (torch.bmm(x, w.transpose(1, 2)), torch.bmm(x, w.transpose(-1, -2)), torch.bmm(x, w),
                torch.bmm(x.expand(3, 5, 16), torch.transpose(w, 2, 1)), x.bmm(w)):
        assert got.shape == (3, 5, 8)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for bad in (lambda: torch.bmm(x[..., :8], w), lambda: torch.bmm(x[:2], w.transpose(1, 2))):
        with pytest.raises(NotImplementedError, match="torch.bmm of a") as err:
            bad()
        assert "\n" not in str(err.value)


def test_experts_must_agree():
    fs = _factors()
    other = _factors(d_b=8)[0]
    with pytest.raises(ArmorInputError, match=r"m\.w: expert 1 .*block size"):
        experts_from_factors([fs[0], other], name="m.w")
    with pytest.raises(ArmorInputError, match="none"):
        experts_from_factors([], name="m.w")
    with pytest.raises(ArmorInputError, match="not an ArmorTensor"):
        stack_experts([ArmorTensor.from_factors(fs[0]), torch.zeros(8, 16)], name="m.w")


def test_armor_experts_from_factors_checks_the_parameter():
    m = nn.Module()
    m.w = nn.Parameter(torch.zeros(3, 8, 16))
    with pytest.raises(ArmorInputError, match=r"m\.w: 2 ArmorFactors for 3 experts"):
        armor_experts_from_factors(m, "w", _factors()[:2], name="m.w")
    with pytest.raises(ArmorInputError, match=r"m\.w\.0: factors are for a \(8, 8\)"):
        armor_experts_from_factors(m, "w", _factors(d_in=8), name="m.w")
    with pytest.raises(ArmorInputError, match="3-D"):
        armor_experts_from_factors(m, "nope", _factors(), name="m.nope")
    armor_experts_from_factors(m, "w", _factors(), name="m.w")
    assert isinstance(m.w, ArmorTensor) and m.w.num_experts is not None and isinstance(m.w, nn.Parameter) and not m.w.requires_grad


# ----------------------------------------------------------------------------- in a model


@pytest.mark.parametrize("arch", ARCHS)
def test_model_logits_equal_the_slow_reference(arch, one_thread):
    model, reference = armor_moe(arch)
    for module in experts_modules(model).values():
        for pname in EXPERT_PARAMS:
            w = module._parameters[pname]
            assert isinstance(w, ArmorTensor) and w.num_experts is not None
            for e in range(w.shape[0]):  # every expert core is 2:4
                kept = (w[e].core_dense() != 0).reshape(w.shape[1], -1, 4).sum(-1)
                assert bool((kept <= 2).all())
    routers = {n: p for n, p in model.named_parameters() if ".mlp.gate." in n or "shared_expert_gate" in n}
    assert routers and all(type(p) is nn.Parameter for p in routers.values())  # the routers stay dense
    ids = _ids()
    with torch.no_grad():
        got = model(ids).logits
        want = reference(ids).logits
        model.set_experts_implementation("eager")
        eager = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)


def test_installing_armor_experts_switches_grouped_mm_with_one_warning(monkeypatch):
    monkeypatch.setattr(experts_forward, "_WARNED", set())  # once per process: earlier tests may have warned
    model = make_moe("qwen3_moe")
    model.set_experts_implementation("grouped_mm")
    module = next(iter(experts_modules(model).values()))
    p = module.gate_up_proj.detach()
    fs = []
    for e in range(p.shape[0]):
        a, b, core, mask = random_factors(p.shape[1], p.shape[2], 8, 2, 4, seed=e, dtype=torch.float32)
        fs.append(ArmorFactors(a, core, b, mask, "2:4"))
    with pytest.warns(UserWarning, match="'grouped_mm' needs dense 3-D expert weights; switched the model to 'armor'"):
        armor_experts_from_factors(module, "gate_up_proj", fs, name="x.gate_up_proj")
    assert model.config._experts_implementation == "armor"
    model.set_experts_implementation("grouped_mm")
    with pytest.raises(NotImplementedError, match="experts_implementation='armor'"):
        with torch.no_grad():
            model(_ids())


def test_armor_forward_runs_dense_experts_too(one_thread):
    model = make_moe("qwen3_moe")
    ids = _ids()
    with torch.no_grad():
        eager = model(ids).logits
        model.set_experts_implementation("armor")
        armor = model(ids).logits
    torch.testing.assert_close(armor, eager, rtol=1e-5, atol=1e-5)


def test_compiled_model_matches_eager(one_thread):
    torch._dynamo.reset()
    model, _ = armor_moe("qwen3_moe")
    ids = _ids()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = model(ids).logits
        compiled = torch.compile(model)
        got = compiled(ids).logits
        again = compiled(_ids(seed=7)).logits
        eager_again = model(_ids(seed=7)).logits
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, eager_again, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- CUDA policy (fake CUDA) and int8


def test_experts_moved_to_cuda_bf16_get_2to4_cores_and_run_the_sparse_gemm(monkeypatch):
    """On (fake) CUDA in bf16 every expert's core is cuSPARSELt 2:4, stacked; an expert runs as a linear does
    (``tests/tensor/test_semi_structured.py``): two wrapper kernels around one sparse GEMM, no copy."""
    pytest.importorskip("triton")
    from _fake_cuda import fake_cuda, traced_ops
    from torch_armor.tensor.semi_structured import CusparseltArmorTensor

    w = experts_from_factors(_factors(e_count=3, d_out=64, d_in=128, d_b=16), storage="compact",
                                        name="m.experts.down_proj")
    with fake_cuda(monkeypatch):
        cuda = w.to("cuda", torch.bfloat16)
        assert cuda.storage_format == "semi_structured" and cuda.backend == "cusparselt"
        assert cuda.packed.shape[0] == 3 and cuda.device.type == "cuda" and cuda.dtype == torch.bfloat16
        one = cuda.select(0, 2)  # w[e] (Python indexing) needs a CUDA device guard, which a CPU-only torch lacks
        assert isinstance(one, CusparseltArmorTensor) and one.layer_name == "m.experts.down_proj.2"
        x = torch.empty(256, 128, device="cuda", dtype=torch.bfloat16)
        ops, out = traced_ops(lambda t: F.linear(t, one), x)
    sparse = [op for op in ops if "cslt_sparse_mm" in op]
    assert len(sparse) == 1 and ops.count("torch_armor.block_diag_rows.default") == 2, ops
    assert not [op for op in ops if op.split(".")[1] in ("clone", "copy_", "mm", "addmm", "bmm", "contiguous")], ops
    assert out.shape == (256, 64) and out.is_contiguous()


def test_int8_core_quantization_is_refused_for_experts_and_leaves_them_floating(one_thread):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from torch_armor.tensor.quant import ArmorCoreConfig, quantize_armor_core

    model, reference = armor_moe("qwen3_moe")
    w = model.get_submodule("model.layers.0.mlp.experts").gate_up_proj
    with pytest.raises(ArmorInputError, match=r"experts\.gate_up_proj: quantizing the cores of fused experts is not "
                                              "supported yet"):
        quantize_armor_core(w, Int8WeightOnlyConfig(set_inductor_config=False))
    quantize_(model, ArmorCoreConfig(Int8WeightOnlyConfig(set_inductor_config=False), apply_to_dense=True))
    w = model.get_submodule("model.layers.0.mlp.experts").gate_up_proj
    assert isinstance(w, ArmorTensor) and w.num_experts is not None and w.storage_format == "compact"


def test_with_storage_is_free_when_nothing_changes_and_exact_otherwise():
    w = experts_from_factors(_factors(), storage="compact")
    assert w.with_storage("compact") is w and w.with_storage("auto") is w
    d = w.with_storage("dense")
    assert d.storage_format == "dense" and d.core.shape == (3, 8, 16)
    assert torch.equal(d.dense_weight(), w.dense_weight())
    assert torch.equal(d.with_storage("compact").values, w.values)


def test_experts_are_the_storage_classes_with_a_leading_expert_dimension():
    """No class is made at run time: the experts of each storage are instances of that storage's class, its
    inner tensors stacked; their ops (select, view, bmm, ...) are in ArmorTensor's own tables, which every
    storage class inherits; and a 2-D weight still refuses them."""
    import torch_armor.tensor.experts as experts_module
    from torch_armor.tensor.formats import CompactArmorTensor, DenseArmorTensor

    aten = torch.ops.aten
    for storage, cls in (("dense", DenseArmorTensor), ("compact", CompactArmorTensor)):
        w = experts_from_factors(_factors(), storage=storage)
        assert type(w) is cls and w.num_experts == 3 and type(w[1]) is cls and w[1].num_experts is None
        assert w.a_blocks.shape == (3, 2, 4, 4)
        assert {aten.select.int, aten.index.Tensor} <= set(cls._ATEN_OP_TABLE[cls])
        assert {torch.Tensor.view, torch.Tensor.transpose, torch.bmm} <= set(cls._TORCH_FN_TABLE[cls])
    ours = ArmorTensor._ATEN_OP_TABLE[ArmorTensor]
    assert {aten.select.int, aten.index.Tensor} <= set(ours)
    assert not [n for n, v in vars(experts_module).items() if isinstance(v, type) and issubclass(v, ArmorTensor)
                and v.__module__ == experts_module.__name__]
    one = ArmorTensor.from_factors(_factors()[0])
    with pytest.raises(NotImplementedError, match="dense_weight"):
        one[0]


@pytest.mark.parametrize("storage", ["dense", "compact"])
def test_experts_flatten_unflatten_round_trip(storage):
    w = experts_from_factors(_factors(), storage=storage)
    names, attributes = w.__tensor_flatten__()
    back = type(w).__tensor_unflatten__({n: getattr(w, n) for n in names}, attributes, w.shape, w.stride())
    by_name = type(w)(**{n: getattr(w, n) for n in names}, **attributes)
    assert type(back) is type(w) and back.shape == by_name.shape == (3, 8, 16)
    assert torch.equal(back.dense_weight(), torch.stack([f.dense() for f in _factors()]))
    assert torch.equal(by_name.dense_weight(), back.dense_weight())
