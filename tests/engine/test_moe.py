"""Mixture-of-experts models through prune_model: every expert matrix pruned (its ARMOR core 2:4),
the router dense, the logits equal a slow reference built from the stored factors (per-expert
``A·core·B`` run through the model's own eager experts forward)."""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import (MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from torch_armor import load_pretrained, save_pretrained
from torch_armor.calibration.experts import split_expert_name
from torch_armor.config.levers import RefineConfig
from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.core.factors import ArmorFactors
from torch_armor.engine.methods import config_for_method, method_names
from torch_armor.engine.prune import PruneOptions, prune_model
from torch_armor.errors import ArmorInputError

E = 4
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
              num_experts_per_tok=2)


class _Expert(nn.Module):  # Mixtral-style ModuleList expert (w1 gate, w3 up, w2 down)
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(32, 16, bias=False), nn.Linear(32, 16, bias=False), nn.Linear(16, 32, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _ListMoe(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(32, E, bias=False)
        self.experts = nn.ModuleList(_Expert() for _ in range(E))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        top_w, top_i = torch.topk(self.gate(flat).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, pos = torch.where(top_i == e)
            if len(tok):
                out.index_add_(0, tok, expert(flat[tok]) * top_w[tok, pos, None])
        return out.reshape(x.shape)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(32, 32, bias=False)
        self.mlp = _ListMoe()

    def forward(self, hidden_states, **kwargs):
        h = hidden_states + self.attn(hidden_states)
        return h + self.mlp(h)


class ListMoeForCausalLM(nn.Module):
    """A tiny decoder with ModuleList experts (transformers 5 ships none any more)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.lm_head = nn.Linear(32, 64, bias=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, **kwargs):
        h = self.embed(input_ids)
        for block in self.layers:
            h = block(h)
        return self.lm_head(h)


def _build(arch):
    torch.manual_seed(0)
    if arch == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=E,
                                                   **COMMON))
    elif arch == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=16, num_local_experts=E, **COMMON))
    elif arch == "olmoe":
        model = OlmoeForCausalLM(OlmoeConfig(intermediate_size=16, num_experts=E, **COMMON))
    elif arch == "qwen2_moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=16, num_experts=E,
                                                   shared_expert_intermediate_size=32, **COMMON))
    else:
        model = ListMoeForCausalLM()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # spread the tokens over the experts
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model.eval()


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _stored(run_dir: Path, name: str) -> ArmorFactors:
    t = load_file(str(run_dir / "layers" / f"{name}.safetensors"))
    return ArmorFactors(t["a_blocks"], t["core"], t["b_blocks"], t["mask"].bool())


def _routers(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()
            if n.endswith("mlp.gate.weight") or "shared_expert_gate" in n}


CALIB = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
ARCHS = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "modulelist"]


@pytest.mark.parametrize("arch", ARCHS)
def test_armor_prunes_every_expert_keeps_the_router_dense_and_matches_the_slow_reference(arch, tmp_path):
    model = _build(arch)
    original = copy.deepcopy(model)
    routers = _routers(model)
    refine = RefineConfig(rounds=1, cg_steps=5) if arch == "qwen3_moe" else None  # output space (XᵀX) on one
    cfg = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2), reconstruct=None, refine=refine, distill=None)
    report = prune_model(model, CALIB, cfg, options=PruneOptions(progress=False, run_dir=tmp_path))
    names = [r.name for r in report.layers]
    fused = [n for n in names if split_expert_name(n) is not None]
    if arch == "modulelist":
        assert sum(".experts." in n for n in names) == 2 * E * 3 and not fused
    else:
        assert sorted(fused) == sorted(f"model.layers.{i}.mlp.experts.{a}.{e}" for i in range(2)
                                       for a in ("gate_up_proj", "down_proj") for e in range(E))
        assert len(report.expert_tokens) == 2 * E and sum(report.expert_tokens.values()) == 2 * 2 * CALIB.numel()
    assert not any(n.endswith(".gate") or n.endswith("shared_expert_gate") for n in names)
    for n, p in routers.items():  # routers untouched and listed as dense
        assert torch.equal(model.get_parameter(n), p), n
    assert any("router" in why for _, why in report.dense_weights.values())
    reference = original
    for n in names:
        f = _stored(tmp_path, n)
        groups = f.mask.reshape(f.mask.shape[0], -1, 4).sum(-1)
        assert bool((groups == 2).all()) and bool((f.core[~f.mask] == 0).all()), n
        split = split_expert_name(n)
        if split is None:
            reference.get_submodule(n).weight.data = f.dense()
        else:
            reference.get_parameter(split[0]).data[split[1]] = f.dense()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))
    logits = _logits(model, ids)
    torch.testing.assert_close(logits, _logits(reference, ids), rtol=1e-4, atol=1e-5)
    if arch == "modulelist":  # a plain nn.Module: no config.json to save
        return
    save_pretrained(model, tmp_path / "saved")
    loaded = load_pretrained(tmp_path / "saved")
    if hasattr(loaded, "set_experts_implementation"):
        loaded.set_experts_implementation("eager")
    assert torch.equal(_logits(loaded.eval(), ids), logits)


@pytest.mark.parametrize("method", [m for m in method_names() if m != "armor"])
def test_every_baseline_prunes_every_expert_to_2_4(method):
    model = _build("qwen3_moe")
    routers = _routers(model)
    report = prune_model(model, CALIB, config_for_method(method), options=PruneOptions(progress=False))
    assert sum(split_expert_name(r.name) is not None for r in report.layers) == 2 * 2 * E
    for i in range(2):
        for attr in ("gate_up_proj", "down_proj"):
            w = model.get_parameter(f"model.layers.{i}.mlp.experts.{attr}")
            nonzero = (w != 0).reshape(E, w.shape[1], -1, 4).sum(-1)
            assert bool((nonzero <= 2).all()), (method, attr)
    for n, p in routers.items():
        assert torch.equal(model.get_parameter(n), p)


def test_rarely_routed_experts_fall_back_with_a_warning_each():
    model = _build("qwen3_moe")
    with pytest.warns(UserWarning, match="routed calibration tokens") as caught:
        prune_model(model, CALIB[:1], config_for_method("nowag"),
                    options=PruneOptions(progress=False, min_expert_tokens=10_000))
    named = {str(w.message).split(" received")[0] for w in caught if "routed calibration tokens" in str(w.message)}
    assert named == {f"expert model.layers.{i}.mlp.experts.{e}" for i in range(2) for e in range(E)}


def test_a_run_directory_resumes_expert_layers_bit_identically(tmp_path):
    cfg = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2), reconstruct=None, refine=None, distill=None)
    first = _build("qwen3_moe")
    prune_model(first, CALIB, cfg, options=PruneOptions(progress=False, run_dir=tmp_path))
    lines = []
    second = _build("qwen3_moe")
    prune_model(second, CALIB, cfg, options=PruneOptions(progress=False, run_dir=tmp_path, log=lines.append))
    assert any("already finished" in line for line in lines)
    for i in range(2):
        for attr in ("gate_up_proj", "down_proj"):
            n = f"model.layers.{i}.mlp.experts.{attr}"
            assert torch.equal(first.get_parameter(n).dense_weight(), second.get_parameter(n).dense_weight())


def test_a_checkpoint_with_per_expert_keys_streams_and_equals_the_in_memory_prune(tmp_path):
    from transformers import AutoModelForCausalLM  # only this test loads from a directory

    model = _build("qwen3_moe")
    model.save_pretrained(tmp_path / "ckpt")  # transformers writes experts.{e}.gate_proj.weight, …
    cfg = config_for_method("nowag")
    prune_model(str(tmp_path / "ckpt"), CALIB, cfg, options=PruneOptions(progress=False, out=tmp_path / "out"))
    prune_model(model, CALIB, cfg, options=PruneOptions(progress=False))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    for n, p in model.named_parameters():
        assert torch.equal(loaded.get_parameter(n), p), n


def test_armor_on_part_of_a_fused_parameters_experts_is_refused_before_any_work():
    model = _build("qwen3_moe")
    with pytest.raises(ArmorInputError, match="all 4 experts of a fused parameter together"):
        prune_model(model, CALIB, ArmorConfig(block_size=16), layers=["model.layers.0.mlp.experts.down_proj.1"],
                    options=PruneOptions(progress=False))
    report = prune_model(model, CALIB, config_for_method("wanda"), layers="experts.down_proj.1$",
                         options=PruneOptions(progress=False))
    assert [r.name for r in report.layers] == [f"model.layers.{i}.mlp.experts.down_proj.1" for i in range(2)]


@pytest.mark.parametrize("refine", [None, RefineConfig(rounds=1, cg_steps=5)])
def test_experts_of_a_fused_parameter_are_factorized_as_one_batch_equal_to_the_serial_loop(refine, monkeypatch,
                                                                                          tmp_path):
    import torch_armor.core.factorize_batched as batched_module  # patched below: count the batched calls
    import torch_armor.armor.layers as layers_module  # patched below: the serial loop as the reference

    cfg = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=3), reconstruct=None, refine=refine, distill=None)
    batches = []
    real = batched_module.factorize_batched

    def counting(weights, *args, **kwargs):
        batches.append((len(weights), kwargs.get("names")))
        return real(weights, *args, **kwargs)

    monkeypatch.setattr("torch_armor.armor.layers.factorize_batched", counting)
    batched = _build("qwen3_moe")
    prune_model(batched, CALIB, cfg, options=PruneOptions(progress=False, run_dir=tmp_path / "batched"))
    expected = [(E, [f"model.layers.{i}.mlp.experts.{attr}.{e}" for e in range(E)])
                for i in range(2) for attr in ("gate_up_proj", "down_proj")]
    assert sorted(batches) == sorted(expected)

    monkeypatch.setattr(layers_module, "expert_batches", lambda todo, configs: [[n] for n in todo])
    serial = _build("qwen3_moe")
    prune_model(serial, CALIB, cfg, options=PruneOptions(progress=False, run_dir=tmp_path / "serial"))
    assert len(batches) == len(expected)  # the serial run never batched
    stored = sorted(f.name for f in (tmp_path / "batched" / "layers").glob("*.safetensors"))
    assert stored == sorted(f.name for f in (tmp_path / "serial" / "layers").glob("*.safetensors"))
    assert {f"{n}.safetensors" for _, names in expected for n in names} <= set(stored)  # saved per expert layer
    for name in stored:
        one, two = (load_file(str(tmp_path / run / "layers" / name)) for run in ("batched", "serial"))
        assert one.keys() == two.keys(), name
        assert [k for k in one if k != "history_time_s" and not torch.equal(one[k], two[k])] == [], name
    for (n, p), (n2, p2) in zip(batched.named_parameters(), serial.named_parameters()):
        assert n == n2
        dense = (p.dense_weight(), p2.dense_weight()) if hasattr(p, "dense_weight") else (p, p2)
        assert torch.equal(*dense), n
