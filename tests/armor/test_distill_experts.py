"""End-to-end distillation trains the experts: every fused expert's ARMOR wrappers are trained
leaves like a linear's (their gradient equals a float64 reference built by hand), an experts-only
prune distills, and a prune that leaves every expert dense says so once and logs the dense weights."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings

import pytest
import torch
from torch.func import functional_call

from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.config.levers import DistillConfig
from torch_armor.armor.distill_kl import dense_top_k, windows_of
from torch_armor.armor.distill_train import InMemoryStudent
from torch_armor.engine.prune import PruneOptions, prune_model
from torch_armor.tensor.armor_tensor import ArmorTensor

from _tiny_moe import make_moe

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 64
CALIB = torch.randint(0, VOCAB, (10, 16), generator=torch.Generator().manual_seed(3))
EXPERTS = ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"]
# top_k = the vocabulary: the coarse KL is the full KL, which the reference computes by hand
DISTILL = DistillConfig(steps=4, lr=1e-2, windows_per_step=2, held_out=3, top_k=VOCAB, eval_every=1)


def _config(distill=None):
    return ArmorConfig(block_size=8, optimizer=BcdConfig(iters=1), refine=None, reconstruct=None, distill=distill)


def _prune(model, distill=None, layers="experts"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = prune_model(model, CALIB, _config(distill), layers=layers, options=PruneOptions(progress=False))
    return report, [str(w.message) for w in caught]


def _experts(model):
    return {n: p for n, p in model.named_parameters() if isinstance(p, ArmorTensor) and p.num_experts is not None}


def _dense_by_hand(a, core, b):
    """``blockdiag(A) · core · blockdiag(B)`` per expert, with torch.block_diag."""
    return torch.stack([torch.block_diag(*a[e]) @ core[e] @ torch.block_diag(*b[e]) for e in range(a.shape[0])])


def test_the_experts_wrapper_gradient_equals_a_float64_reference_by_hand():
    dense = make_moe("qwen3_moe", experts=4, vocab=VOCAB)
    model = copy.deepcopy(dense)
    _prune(model)
    assert sorted(_experts(model)) == EXPERTS
    model.set_experts_implementation("armor")  # the student runs torch_armor's experts loop, the reference not
    windows = windows_of([CALIB])[:3]
    teachers = dense_top_k(dense, windows, VOCAB)
    student = InMemoryStudent(model, DISTILL)
    assert sorted(student.leaves) == EXPERTS  # the experts' wrappers are the trained leaves
    count = sum(w[0].shape[1] for w in windows)
    student.backward(windows, teachers, count, contextlib.nullcontext)
    student.close()

    reference = copy.deepcopy(model).double()
    reference.set_experts_implementation("eager")  # transformers' own loop, F.linear on each dense expert
    leaves = {n: [t.detach().double().requires_grad_(j != 1) for j, t in enumerate(student.leaves[n])]
              for n in EXPERTS}
    loss = torch.zeros((), dtype=torch.float64)
    for ids, _ in windows:
        weights = {n: _dense_by_hand(*leaves[n]) for n in EXPERTS}
        q = torch.log_softmax(functional_call(reference, weights, (ids,)).logits[0], dim=-1)
        with torch.no_grad():
            p = torch.log_softmax(dense.double()(ids).logits[0], dim=-1)
        loss = loss + (p.exp() * (p - q)).sum() / count
    loss.backward()
    for n in EXPERTS:
        for mine, ref in ((student.leaves[n][0], leaves[n][0]), (student.leaves[n][2], leaves[n][2])):
            assert mine.grad is not None and bool(mine.grad.abs().sum() > 0), n
            torch.testing.assert_close(mine.grad.double(), ref.grad, rtol=2e-3, atol=1e-6)


def test_an_experts_only_prune_distills_and_changes_the_experts_wrappers():
    dense = make_moe("qwen3_moe", experts=4, vocab=VOCAB)
    undistilled, distilled = copy.deepcopy(dense), copy.deepcopy(dense)
    _prune(undistilled)
    report, _ = _prune(distilled, DISTILL)
    assert not any(isinstance(m._parameters.get("weight"), ArmorTensor) for m in distilled.modules())
    d = report.stages["distillation"]
    assert d["after"] < d["before"] and d["best_step"] > 0, d
    before, after = _experts(undistilled), _experts(distilled)
    assert sorted(after) == EXPERTS
    for n in EXPERTS:
        assert not torch.equal(after[n].a_blocks, before[n].a_blocks), n
        for e in range(4):  # the masks stay
            assert torch.equal(after[n].expert(e).core_dense() != 0, before[n].expert(e).core_dense() != 0)


def test_a_prune_that_leaves_every_expert_dense_says_so_once_and_logs_the_dense_weights(caplog):
    model = make_moe("qwen3_moe", experts=4, vocab=VOCAB)
    with caplog.at_level(logging.INFO, logger="torch_armor"):
        report, caught = _prune(model, layers="self_attn")
    about = [m for m in caught if "no expert" in m]
    assert len(about) == 1, caught
    assert "model.layers.*.mlp.experts.gate_up_proj (expert not selected by layers=)" in about[0]
    assert report.dense_weights["model.layers.*.mlp.experts.down_proj"] == (1, "expert not selected by layers=")
    assert "model.layers.*.mlp.experts.gate_up_proj: 1 dense (expert not selected by layers=)" in caplog.text
    assert not _experts(model)


def test_a_streamed_experts_only_prune_distills_the_experts_like_the_in_memory_one(tmp_path):
    from torch_armor import load_pretrained

    dense = make_moe("qwen3_moe", experts=4, vocab=VOCAB)
    dense.save_pretrained(tmp_path / "ckpt")  # per-expert keys: the streaming loader fuses them
    memory = copy.deepcopy(dense)
    report, _ = _prune(memory, DISTILL)
    streamed = prune_model(tmp_path / "ckpt", CALIB, _config(DISTILL), layers="experts",
                           options=PruneOptions(progress=False, out=tmp_path / "out"))
    assert streamed.stages["distillation"]["best_step"] == report.stages["distillation"]["best_step"] > 0
    assert streamed.stages["distillation"]["after"] == pytest.approx(report.stages["distillation"]["after"], rel=1e-4)
    loaded = load_pretrained(tmp_path / "out")
    for n in EXPERTS:
        got, want = loaded.get_parameter(n), memory.get_parameter(n)
        torch.testing.assert_close(got.a_blocks, want.a_blocks, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got.b_blocks, want.b_blocks, rtol=1e-4, atol=1e-6)
