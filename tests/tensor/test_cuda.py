"""What only a GPU can check: the 2:4 kernels' numerics, the policy on a real device, the engine on CUDA.

Every test here skips without CUDA. ``python benchmarks/gpu_check.py`` runs them (with the fake-CUDA
traces of ``test_semi_structured.py``) and lists which passed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _helpers import random_pattern_factors

from torch_armor.tensor import policy
from torch_armor.tensor.armor_tensor import ArmorTensor, armor_linear_from_factors
from torch_armor.tensor.semi_structured import CusparseltArmorTensor, CutlassArmorTensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HALF = [torch.float16, torch.bfloat16]


def _backends():
    info = policy.device_info("cuda") if torch.cuda.is_available() else policy.DeviceInfo("cuda")
    out = []
    if "cusparselt" in info.backends:
        out.append("cusparselt")
    if "cutlass" in info.backends and info.capability and info.capability[0] == 8:
        out.append("cutlass")
    return out


def assert_close_rel(out: torch.Tensor, ref: torch.Tensor, rel: float = 1e-2) -> None:
    out, ref = out.float(), ref.float()
    assert (out - ref).norm() <= rel * ref.norm(), float((out - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("tokens", [1, 7, 64, 2048])
def test_semi_structured_linear_matches_dense(dtype, tokens):
    for backend in _backends():
        f = random_pattern_factors(512, 1024, 16, seed=tokens)
        w = ArmorTensor.from_factors(f, storage="semi_structured", dtype=dtype, device="cuda", backend=backend)
        assert w.storage_format == "semi_structured" and w.backend == backend
        x = torch.randn(2, tokens, 1024, device="cuda", dtype=dtype)
        bias = torch.randn(512, device="cuda", dtype=dtype)
        ref = x.float() @ f.dense().cuda().T + bias.float()
        assert_close_rel(F.linear(x, w, bias), ref)
        assert torch.equal(w.core_dense().cpu(), f.core.to(dtype))


def test_fp16_input_into_bf16_layer():
    f = random_pattern_factors(256, 512, 16, seed=1)
    w = ArmorTensor.from_factors(f, dtype=torch.bfloat16, device="cuda")
    assert w.storage_format == "semi_structured"
    x = torch.randn(33, 512, device="cuda", dtype=torch.float16)
    out = F.linear(x, w)
    assert out.dtype == torch.float16
    assert_close_rel(out, x.float() @ f.dense().cuda().T, rel=2e-2)


def test_auto_storage_follows_the_dtype_on_cuda(monkeypatch):
    monkeypatch.setattr(policy, "_WARNED", set())
    f = random_pattern_factors(256, 512, 16, seed=2)
    assert isinstance(ArmorTensor.from_factors(f, dtype=torch.bfloat16, device="cuda"),
                      (CusparseltArmorTensor, CutlassArmorTensor))
    with pytest.warns(policy.ArmorStorageWarning, match="float32"):
        w32 = ArmorTensor.from_factors(f, dtype=torch.float32, device="cuda", name="layer")
    assert w32.storage_format == "dense"
    assert w32.bfloat16().storage_format == "semi_structured"


def test_moves_between_cpu_and_cuda_are_exact():
    f = random_pattern_factors(256, 512, 16, seed=3)
    cpu = ArmorTensor.from_factors(f, storage="dense", dtype=torch.bfloat16)
    gpu = cpu.to("cuda")
    assert gpu.storage_format == "semi_structured"
    back = gpu.to("cpu")
    assert back.storage_format == "compact" and torch.equal(back.core_dense(), f.core.bfloat16())
    half = gpu.half()
    assert half.storage_format == "semi_structured" and torch.equal(half.core_dense().cpu(), f.core.half())
    if torch.cuda.device_count() > 1:
        other = gpu.to("cuda:1")
        assert other.device == torch.device("cuda:1") and torch.equal(other.core_dense().cpu(), f.core.bfloat16())


def test_small_shape_falls_back_to_dense_with_a_warning(monkeypatch):
    monkeypatch.setattr(policy, "_WARNED", set())
    f = random_pattern_factors(8, 16, 8, seed=11)  # 8 rows: below both kernels' minimum (16 and 32)
    with pytest.warns(policy.ArmorStorageWarning):
        w = ArmorTensor.from_factors(f, storage="auto", dtype=torch.float16, device="cuda")
    assert w.storage_format == "dense"
    x = torch.randn(3, 16, device="cuda", dtype=torch.float16)
    assert_close_rel(F.linear(x, w), x.float() @ f.dense().cuda().T)


@pytest.mark.parametrize("storage", ["compact", "dense"])
def test_cpu_formats_still_run_on_cuda(storage):
    f = random_pattern_factors(64, 128, 32, seed=12)
    w = ArmorTensor.from_factors(f, storage=storage, device="cuda")
    assert w.storage_format == storage and w.a_blocks.is_cuda
    x = torch.randn(5, 128, device="cuda")
    torch.testing.assert_close(F.linear(x, w), x @ f.dense().cuda().T, rtol=1e-4, atol=1e-4)


def test_load_state_dict_from_cpu_checkpoint_into_2to4_model(tmp_path):
    torch.manual_seed(0)
    src, dst = nn.Linear(512, 256), nn.Linear(512, 256)
    armor_linear_from_factors(src, random_pattern_factors(256, 512, 16, seed=4), storage="compact")
    armor_linear_from_factors(dst, random_pattern_factors(256, 512, 16, seed=5), storage="compact")
    dst.to("cuda", torch.bfloat16)
    assert dst.weight.storage_format == "semi_structured"
    torch.save(src.state_dict(), tmp_path / "sd.pt")
    dst.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    assert dst.weight.storage_format == "semi_structured"
    x = torch.randn(9, 512)
    assert_close_rel(dst(x.cuda().bfloat16()).cpu(), src(x))
    torch.save(dst.state_dict(), tmp_path / "gpu.pt")
    again = torch.load(tmp_path / "gpu.pt", weights_only=True)["weight"]
    assert type(again) is type(dst.weight) and torch.equal(again.core_dense().cpu(), dst.weight.core_dense().cpu())


def test_compiled_2to4_linear_matches_eager():
    torch._dynamo.reset()
    f = random_pattern_factors(512, 1024, 16, seed=6)
    lin = armor_linear_from_factors(nn.Linear(1024, 512, bias=False), f).to("cuda", torch.bfloat16)
    x = torch.randn(4, 128, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(lin, fullgraph=True)(x), lin(x), rtol=2e-2, atol=2e-2)


def test_optimizer_inner_loops_do_not_sync():
    from torch_armor.core.bcd import update_a, update_b

    gen = torch.Generator().manual_seed(7)
    w, h = torch.randn(64, 128, generator=gen).cuda(), (torch.rand(128, generator=gen) + 0.1).cuda()
    a = torch.eye(16).repeat(4, 1, 1).cuda()
    b = torch.eye(16).repeat(8, 1, 1).cuda()
    core = w * (torch.rand(64, 128, generator=gen) > 0.5).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        update_a(w, h, a, core, b)
        update_b(w, a, core, b)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_supports_made_once_per_gpu():
    from torch_armor.core.sparse_core import supports

    assert supports(2, 4, torch.device("cuda")) is supports(2, 4, torch.device("cuda"))


def test_prune_model_on_cuda_returns_the_model_where_it_was():
    """Issue #21 row 8: before, the decoder stayed on the GPU and embeddings/lm_head on the CPU."""
    from conftest import make_tiny_llama
    from torch_armor import ArmorConfig, PruneOptions, prune_model
    from torch_armor.config.armor import BcdConfig

    model = make_tiny_llama()
    calib = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", policy.ArmorStorageWarning)  # fp32 on the GPU: dense cores
        prune_model(model, calib, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2)),
                    options=PruneOptions(device="cuda", progress=False))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    with torch.no_grad():
        assert model(calib[:1]).logits.isfinite().all()


def test_pinned_hidden_states_when_blocks_run_on_cuda():
    from torch_armor.calibration.blocks import BlockInput, run_block

    block = nn.Linear(64, 64).cuda()
    inp = BlockInput(torch.randn(2, 8, 64))
    out = run_block(block, inp, torch.device("cuda"))
    assert inp.hidden.is_pinned() and out.is_pinned() and out.device.type == "cpu"
    torch.testing.assert_close(out, block.cpu()(inp.hidden).detach())


def test_from_pretrained_on_cuda_in_bf16_gets_2to4_cores(tmp_path):
    """Issue #21 row 6: before, a checkpoint pruned on CPU (dense cores) loaded dense on the GPU too."""
    from conftest import make_tiny_llama
    from transformers import AutoModelForCausalLM

    import torch_armor

    model = make_tiny_llama()
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and ".layers." in name:
            armor_linear_from_factors(mod, random_pattern_factors(mod.out_features, mod.in_features, 16,
                                                                  seed=len(name)), storage="dense")
    torch_armor.save_pretrained(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cuda", dtype=torch.bfloat16)
    w = loaded.model.layers[0].mlp.up_proj.weight
    assert w.device.type == "cuda" and w.storage_format == "semi_structured"
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        assert_close_rel(loaded(ids.cuda()).logits.float().cpu(), model(ids).logits, rel=5e-2)
