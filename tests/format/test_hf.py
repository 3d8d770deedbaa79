"""Tests for torch_armor.format.hf: ARMOR as a transformers quantizer (model.save_pretrained /
AutoModelForCausalLM.from_pretrained), and the two torch_armor save/load aliases on the same layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from safetensors import safe_open
from torchao.quantization import Int8WeightOnlyConfig, quantize_
from transformers import AutoModelForCausalLM

from conftest import make_tiny_llama
from torch_armor import ArmorConfig, ArmorCoreConfig, ArmorTensor, load_pretrained, prune_model, PruneOptions, save_pretrained
from torch_armor.config.armor import BcdConfig
from torch_armor.format.armor_format import flatten_armor_state

VOCAB = 128
IDS = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))


def pruned_llama(kind: str = "fp32", tie: bool = False):
    model = make_tiny_llama(tie=tie)
    windows = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    prune_model(model, windows, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2)), options=PruneOptions(progress=False))
    if kind == "bf16":
        model = model.to(torch.bfloat16)
    elif kind == "int8":
        quantize_(model, ArmorCoreConfig(Int8WeightOnlyConfig(set_inductor_config=False)))
    return model.eval()


def assert_same_model(a, b, ids=IDS):
    """Same classes, same stored parts bit for bit (ArmorTensors by their parts), same buffers and dtypes, same logits."""
    assert type(a) is type(b)
    ta, ma = flatten_armor_state(a)
    tb, mb = flatten_armor_state(b)
    assert ma["layers"] == mb["layers"] and sorted(ta) == sorted(tb)
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key
    bufs_a, bufs_b = dict(a.named_buffers()), dict(b.named_buffers())
    assert sorted(bufs_a) == sorted(bufs_b)
    for key in bufs_a:
        assert bufs_a[key].dtype == bufs_b[key].dtype and torch.equal(bufs_a[key], bufs_b[key]), key
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_save_pretrained_from_pretrained_bit_identical(kind, tmp_path, one_thread):
    model = pruned_llama(kind)
    model.save_pretrained(tmp_path)  # failed before: TypeError: 'str' object is not callable
    config = json.loads((tmp_path / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "armor" and quant["pattern"] == "2:4"
    assert len(quant["layers"]) == 14 and {v["block_size"] for v in quant["layers"].values()} == {16}
    layer = quant["layers"]["model.layers.0.mlp.up_proj.weight"]
    assert layer["storage"] == ("quantized" if kind == "int8" else "compact")
    assert ("quantization" in layer) == (kind == "int8")
    # compact parts on disk: no dense (d_out, d_in) floating matrix for a converted layer
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
        # the weight's own key holds A's blocks (3-D): a loader that does not know ARMOR fails on it
        assert fh.get_slice("model.layers.0.mlp.up_proj.weight").get_shape() == [128 // 16, 16, 16]
        assert "model.layers.0.mlp.up_proj.weight.b_blocks" in keys
        if kind != "int8":
            assert fh.get_slice("model.layers.0.mlp.up_proj.weight.values").get_shape() == [128, 32]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded.model.layers[1].self_attn.o_proj.weight, ArmorTensor)
    assert loaded.dtype == model.dtype
    assert_same_model(model, loaded)
    # and saved again from the loaded model: the same files
    loaded.save_pretrained(tmp_path / "again")
    assert_same_model(model, AutoModelForCausalLM.from_pretrained(tmp_path / "again"))


def test_bf16_buffers_keep_their_dtype(tmp_path, one_thread):
    model = pruned_llama("bf16")
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16  # non-persistent: not in the file
    save_pretrained(model, tmp_path)
    for loaded in (load_pretrained(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path)):
        assert loaded.model.rotary_emb.inv_freq.dtype == torch.bfloat16
        assert_same_model(model, loaded)


def test_aliases_share_one_layout(tmp_path, one_thread):
    model = pruned_llama(tie=True)
    save_pretrained(model, tmp_path / "ours")      # torch_armor's writer (with armor_config.json)
    model.save_pretrained(tmp_path / "hf")         # transformers' writer through the quantizer
    assert_same_model(model, AutoModelForCausalLM.from_pretrained(tmp_path / "ours"))
    assert_same_model(model, load_pretrained(tmp_path / "hf"))
    assert_same_model(model, load_pretrained(tmp_path / "ours"))
    from torch_armor.recipes.models import is_armor_checkpoint

    assert is_armor_checkpoint(tmp_path / "hf") and is_armor_checkpoint(tmp_path / "ours")
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())


def test_from_pretrained_options(tmp_path, one_thread):
    model = pruned_llama()
    model.save_pretrained(tmp_path)
    for kwargs in ({"low_cpu_mem_usage": True}, {"device_map": "cpu"}, {"dtype": "auto"}):
        assert_same_model(model, AutoModelForCausalLM.from_pretrained(tmp_path, **kwargs))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")  # transformers' own sharding
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert_same_model(model, AutoModelForCausalLM.from_pretrained(tmp_path / "sharded"))
    dense = AutoModelForCausalLM.from_pretrained(tmp_path).dequantize()  # W = A·core·B materialized
    assert type(dense.model.layers[0].mlp.up_proj.weight) is nn.Parameter and not dense.is_quantized
    with torch.no_grad():
        torch.testing.assert_close(dense(IDS).logits, model(IDS).logits, rtol=1e-4, atol=1e-4)
    half = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    w, ref = half.model.layers[0].mlp.down_proj.weight, model.model.layers[0].mlp.down_proj.weight
    assert isinstance(w, ArmorTensor) and w.dtype == torch.bfloat16
    assert torch.equal(w.a_blocks, ref.a_blocks.bfloat16()) and torch.equal(w.core_dense(), ref.core_dense().bfloat16())
    with torch.no_grad():
        ref_logits = model(IDS).logits
        assert (half(IDS).logits.float() - ref_logits).abs().max() < 0.1 * ref_logits.abs().max()


def test_from_pretrained_dtype_when_the_loader_casts_the_parts_first(tmp_path, monkeypatch, one_thread):
    """transformers 5.17 casts every floating checkpoint tensor to ``from_pretrained(dtype=...)`` before the
    ARMOR conversion op sees it (emulated here on the installed release); before, the file checks refused
    the layer ("a_blocks should be torch.float32 ... found torch.bfloat16") and the load failed."""
    from torch_armor.format import hf

    real = hf.ArmorDeserialize.convert

    def cast_first(self, input_dict, *args, **kwargs):
        def cast(t):
            return t.to(torch.bfloat16) if t.is_floating_point() else t

        cast_dict = {k: [cast(t) for t in v] if isinstance(v, list) else cast(v) for k, v in input_dict.items()}
        return real(self, cast_dict, *args, **kwargs)

    monkeypatch.setattr(hf.ArmorDeserialize, "convert", cast_first)
    model = pruned_llama()
    model.save_pretrained(tmp_path)
    half = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        w, ref = half.get_submodule(f"model.layers.1.{name}").weight, model.get_submodule(f"model.layers.1.{name}").weight
        assert isinstance(w, ArmorTensor) and w.dtype == torch.bfloat16
        assert torch.equal(w.b_blocks, ref.b_blocks.bfloat16()) and torch.equal(w.core_dense(), ref.core_dense().bfloat16())


def test_loading_without_torch_armor_fails_loudly(tmp_path):
    pruned_llama().save_pretrained(tmp_path)
    code = ("import sys; from transformers import AutoModelForCausalLM; "
            f"AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}); "
            "sys.exit('torch_armor' in sys.modules and 3)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ""}, cwd=str(tmp_path))
    assert proc.returncode not in (0, 3)
    assert "Unknown quantization type, got armor" in proc.stderr and "mismatch" in proc.stderr.lower()


_ATTACH_ONLY = """
import sys
import torch
from torch_armor.format.hf import attach_quantizer  # the only torch_armor import before the model is saved
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
assert "armor" in AUTO_QUANTIZER_MAPPING, "importing attach_quantizer's module did not register the quantizer"
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=64)).eval()
linear = model.model.layers[0].mlp.up_proj
d_out, d_in = linear.weight.shape
core = torch.randn(d_out, d_in) * torch.tensor([1.0, 0.0, 0.0, 1.0]).repeat(d_out, d_in // 4)
a, b = torch.eye(16).repeat(d_out // 16, 1, 1), torch.eye(16).repeat(d_in // 16, 1, 1)
from_parts = sys.modules["torch_armor.tensor.armor_tensor"].from_parts  # loaded with the package, not imported here
weight = from_parts("dense", a, b, "2:4", torch.float32, core=core).with_storage("compact")
linear.weight = torch.nn.Parameter(weight, requires_grad=False)
attach_quantizer(model).save_pretrained(sys.argv[1])
loaded = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = torch.randint(0, 64, (1, 7))
with torch.no_grad():
    assert torch.equal(loaded(ids).logits, model(ids).logits)
print(type(loaded.model.layers[0].mlp.up_proj.weight).__name__)
"""


@pytest.mark.parametrize("argv0", ["-c", "torch-armor"])
def test_attach_quantizer_works_importing_only_its_module(argv0, tmp_path):
    """A fresh process that imports only the module defining attach_quantizer (under any argv[0]) saves a
    converted model with model.save_pretrained and loads it back with from_pretrained."""
    code = _ATTACH_ONLY if argv0 == "-c" else f"import sys; sys.argv[0] = {argv0!r}\n" + _ATTACH_ONLY
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], capture_output=True, text=True,
                          cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "CompactArmorTensor"


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_streamed_prune_directory_loads_with_from_pretrained(dtype, tmp_path, one_thread):
    """The block-streamed engine's assemble_checkpoint output is an ordinary from_pretrained directory."""
    dense = make_tiny_llama()
    dense.save_pretrained(tmp_path / "dense")
    windows = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    prune_model(str(tmp_path / "dense"), windows, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2)), options=PruneOptions(out=tmp_path / "out", progress=False, dtype=dtype))
    files = sorted(os.listdir(tmp_path / "out"))
    assert "model.safetensors.index.json" in files and "armor_config.json" in files  # one shard per block
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    w = loaded.model.layers[1].mlp.down_proj.weight
    assert isinstance(w, ArmorTensor) and w.dtype == (dtype or torch.float32) == loaded.dtype
    # the torch_armor reader without config.json's help: the saved tensors as they are
    from torch_armor.format.serialization import load_pretrained as armor_load

    legacy = armor_load(tmp_path / "out", lambda: make_tiny_llama().to(dtype or torch.float32))
    if dtype is None:
        assert_same_model(legacy, loaded)
    else:  # blocks are stored bf16, the rest (embeddings, norm, lm_head) as the source checkpoint had them;
        # from_pretrained builds the model in the blocks' dtype and casts the rest, as transformers does
        ta, ma = flatten_armor_state(legacy)
        tb, mb = flatten_armor_state(loaded)
        assert ma["layers"] == mb["layers"]
        for key in ta:
            assert torch.equal(ta[key].to(tb[key].dtype), tb[key]) and tb[key].dtype in (dtype, torch.uint8), key


# ----------------------------------------------------------------------------- mixture-of-experts models


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_moe_save_pretrained_from_pretrained_bit_identical(arch, tmp_path, one_thread):
    """Fused experts are saved as one entry per 3-D parameter (parts stacked, the model's own key names:
    no per-expert split, no Mixtral ".block_sparse_moe." renaming) and load back bit for bit."""
    from _tiny_moe import armor_moe

    model, _ = armor_moe(arch)
    model.save_pretrained(tmp_path)
    quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    fqn = "model.layers.0.mlp.experts.gate_up_proj"
    assert quant["layers"][fqn]["experts"] == 4 and quant["layers"][fqn]["shape"] == [4, 32, 32]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as fh:
        assert fh.get_slice(fqn).get_shape() == [4, 4, 8, 8]  # A's blocks, stacked per expert
        assert fh.get_slice(fqn + ".values").get_shape() == [4, 32, 16]  # 2:4: half of each row kept
        assert not any(".experts.0." in k or "block_sparse_moe" in k for k in fh.keys())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    w = loaded.get_submodule("model.layers.0.mlp.experts").gate_up_proj
    assert isinstance(w, ArmorTensor) and w.num_experts is not None
    assert loaded.config._experts_implementation == "armor"
    assert torch_armor_model_size(loaded) == torch_armor_model_size(model)
    assert_same_model(model, loaded, IDS % 64)
    loaded.save_pretrained(tmp_path / "again")
    assert_same_model(model, AutoModelForCausalLM.from_pretrained(tmp_path / "again"), IDS % 64)


def torch_armor_model_size(model):
    from torch_armor.tensor.finetune import model_size

    return model_size(model)


def test_moe_model_size_counts_expert_parts(one_thread):
    """Each expert counts A, B (d_b² per block) and its kept half of the core, as a linear does."""
    from _tiny_moe import armor_moe, experts_modules
    from torch_armor.tensor.finetune import model_size

    model, reference = armor_moe("qwen3_moe", block_size=8)
    dense, size = model_size(reference), model_size(model)
    delta = 0
    for module in experts_modules(model).values():
        for w in (module.gate_up_proj, module.down_proj):
            e, d_out, d_in = w.shape
            delta += e * ((d_out // 8 + d_in // 8) * 64 + d_out * d_in // 2) - w.numel()
    assert delta != 0 and size.dense_parameters == dense.parameters
    assert size.parameters == dense.parameters + delta


def test_moe_dequantize_gives_the_dense_reference(one_thread):
    from _tiny_moe import armor_moe

    model, reference = armor_moe("qwen3_moe")
    model.dequantize()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS % 64).logits, reference(IDS % 64).logits, rtol=1e-5, atol=1e-5)


def test_moe_from_pretrained_with_dtype_casts_every_expert(tmp_path, one_thread):
    from _tiny_moe import armor_moe

    model, _ = armor_moe("mixtral")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    w = loaded.get_submodule("model.layers.0.mlp.experts").down_proj
    assert isinstance(w, ArmorTensor) and w.num_experts is not None and w.dtype == w.a_blocks.dtype == w.values.dtype == torch.bfloat16
    want = model.get_submodule("model.layers.0.mlp.experts").down_proj.to(torch.bfloat16)
    assert torch.equal(w.values, want.values) and torch.equal(w.indices, want.indices)
    with torch.no_grad():
        got, ref = loaded(IDS % 64).logits.float(), model(IDS % 64).logits
    assert float((got - ref).norm() / ref.norm()) < 2e-2


def test_a_checkpoint_is_read_with_its_own_names_not_the_models_key_renamings(tmp_path, one_thread):
    """Laguna's conversion mapping renames the regex ``mlp.shared_expert.``, which also matches the
    model's own ``mlp.shared_experts.…`` names; an ARMOR checkpoint, written with the model's own
    names, must be read with none of them (before the fix: 'UNEXPECTED … shared_experts..down_proj')."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("moe_table", Path(__file__).resolve().parents[2] / "tools" / "moe_table.py")
    moe_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe_table)
    model = moe_table.tiny_model("laguna")
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    prune_model(model, ids, ArmorConfig(block_size=8, optimizer=BcdConfig(iters=1), refine=None, reconstruct=None,
                                        distill=None), options=PruneOptions(progress=False))
    shared = [n for n, p in model.named_parameters() if ".shared_experts." in n]
    assert shared and all(isinstance(model.get_parameter(n), ArmorTensor) for n in shared if n.endswith("weight"))
    save_pretrained(model, tmp_path)
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path)(ids).logits, model(ids).logits)
