"""End-to-end distillation: the KL against a float64 reference by hand, the top-k bound, the kept
iterate, masks and cores, resume, the config."""

from __future__ import annotations

import dataclasses
import json

import copy
import math

import pytest
import torch

from conftest import make_tiny_llama
from _helpers import check_mask
from torch_armor import ArmorConfig, prune_model, PruneOptions
from torch_armor.config.armor import BcdConfig, ReconstructConfig, RefineConfig
from torch_armor.config.levers import DistillConfig
from torch_armor.armor.distill import DISTILLED_NAME
from torch_armor.armor.distill_kl import TopK, coarse_kl, windows_of
from torch_armor.armor.distill_train import fast_bf16, training_autocast
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import ArmorTensor

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 128
CALIB = torch.randint(0, VOCAB, (12, 32), generator=torch.Generator().manual_seed(3))
BASE = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=RefineConfig(rounds=1), reconstruct=None,
                   distill=None)
# top_k = the vocabulary: the coarse KL is the full KL, so the float64 reference below is exact
DISTILL = DistillConfig(steps=6, lr=3e-3, windows_per_step=2, held_out=3, top_k=VOCAB, eval_every=2)


def _probs64(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), dim=-1)


def _top(logits: torch.Tensor, k: int) -> TopK:
    """The teacher's top-k, by hand in float64."""
    p = _probs64(logits)
    values, idx = p.sort(dim=-1, descending=True)
    rest = 1.0 - values[:, :k].sum(-1)
    return TopK(values[:, :k].log().float(), idx[:, :k].int(), rest.clamp_min(0).log().float())


def _kl_by_hand(p_logits: torch.Tensor, q_logits: torch.Tensor, k: int):
    """(full KL, coarse KL, p_rest · KL of the rest's conditionals) per position, loops in float64."""
    p, q = _probs64(p_logits), _probs64(q_logits)
    full, coarse, tail = [], [], []
    for t in range(p.shape[0]):
        order = sorted(range(p.shape[1]), key=lambda i: -float(p[t, i]))
        top, rest = order[:k], order[k:]
        f = sum(float(p[t, i]) * math.log(float(p[t, i]) / float(q[t, i])) for i in order)
        c = sum(float(p[t, i]) * math.log(float(p[t, i]) / float(q[t, i])) for i in top)
        pr, qr = sum(float(p[t, i]) for i in rest), sum(float(q[t, i]) for i in rest)
        if rest:
            c += pr * math.log(pr / qr)
        # p_rest · Σ_rest (p_i / p_rest) log((p_i / p_rest) / (q_i / q_rest))
        g = sum(float(p[t, i]) * math.log((float(p[t, i]) / pr) / (float(q[t, i]) / qr)) for i in rest)
        full.append(f)
        coarse.append(c)
        tail.append(g)
    return tuple(torch.tensor(v, dtype=torch.float64) for v in (full, coarse, tail))


@pytest.mark.parametrize("k", [1, 5, 20, 40])
def test_coarse_kl_against_float64_by_hand_and_the_top_k_gap(k):
    gen = torch.Generator().manual_seed(k)
    teacher_logits = 2 * torch.randn(6, 40, generator=gen, dtype=torch.float64)
    student_logits = teacher_logits + torch.randn(6, 40, generator=gen, dtype=torch.float64)
    full, coarse, tail = _kl_by_hand(teacher_logits, student_logits, k)
    got = coarse_kl(student_logits.float(), _top(teacher_logits, k)).double()
    assert torch.allclose(got, coarse, rtol=1e-4, atol=1e-5)
    # the chain rule: full KL = coarse KL + p_rest · KL(p(·|rest) ‖ q(·|rest)) ≥ coarse KL
    assert torch.allclose(full, coarse + tail, rtol=1e-9, atol=1e-12)
    assert (full - got >= -1e-5).all()
    if k == 40:
        assert torch.allclose(got, full, rtol=1e-4, atol=1e-5)


def _armor_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m._parameters.get("weight"), ArmorTensor)}


def _held_out_kl_by_hand(dense, pruned, windows) -> float:
    """Mean KL per token of the pruned model (its ArmorTensor weights, run the ordinary way)
    against the dense model's full distributions, float64."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, _ in windows:
            p = _probs64(dense(ids).logits[0])
            q = _probs64(pruned(ids).logits[0])
            total += float((p * (p.log() - q.log())).sum())
            count += ids.shape[1]
    return total / count


def _prune(config, model=None, **options):
    model = make_tiny_llama() if model is None else model
    report = prune_model(model, CALIB, config, options=PruneOptions(progress=False, **options))
    return model, report


def test_distillation_keeps_the_best_held_out_iterate_measured_independently():
    dense = make_tiny_llama()
    model, report = _prune(ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=RefineConfig(rounds=1),
                                       reconstruct=None, distill=DISTILL), model=copy.deepcopy(dense))
    d = report.stages["distillation"]
    held = windows_of([CALIB])[-DISTILL.held_out:]
    assert d["after"] <= d["before"]
    assert d["after"] == min(kl for _, kl in d["curve"])
    assert [s for s, _ in d["curve"]] == [0, 2, 4, 6]
    assert d["after"] == pytest.approx(_held_out_kl_by_hand(dense, model, held), rel=1e-4)
    if d["best_step"] == 0:  # nothing helped: the model is the undistilled one
        undistilled, _ = _prune(BASE)
        assert d["after"] == pytest.approx(_held_out_kl_by_hand(dense, undistilled, held), rel=1e-4)


@pytest.mark.skipif(not fast_bf16(torch.device("cpu")), reason="this CPU has no fast bfloat16 matrix products")
def test_bf16_steps_train_in_bfloat16_but_choose_the_kept_iterate_in_float32():
    dense = make_tiny_llama()
    runs = {}
    for bf16 in (False, True):
        cfg = dataclasses.replace(BASE, distill=dataclasses.replace(DISTILL, bf16_steps=bf16))
        runs[bf16] = _prune(cfg, model=copy.deepcopy(dense))
    held = windows_of([CALIB])[-DISTILL.held_out:]
    (_, fp32), (model, bf16) = runs[False], runs[True]
    assert bf16.stages["distillation"]["before"] == fp32.stages["distillation"]["before"]  # the same block pass, measured in float32
    assert bf16.stages["distillation"]["curve"][1:] != fp32.stages["distillation"]["curve"][1:]  # the steps themselves differ
    assert bf16.stages["distillation"]["after"] <= bf16.stages["distillation"]["before"]
    assert bf16.stages["distillation"]["after"] == pytest.approx(_held_out_kl_by_hand(dense, model, held), rel=1e-4)


def test_training_autocast_is_bfloat16_only_when_asked_for_and_fast():
    x = torch.randn(4, 8)
    lines = []
    with training_autocast(torch.device("cpu"), DistillConfig(bf16_steps=False), lines.append)():
        assert (x @ x.T).dtype == torch.float32
    with training_autocast(torch.device("meta"), DistillConfig(bf16_steps=True), lines.append)():
        assert (x @ x.T).dtype == torch.float32
    assert len(lines) == 1 and "bf16_steps" in lines[0] and "float32" in lines[0]
    if fast_bf16(torch.device("cpu")):
        with training_autocast(torch.device("cpu"), DistillConfig(bf16_steps=True), lines.append)():
            assert (x @ x.T).dtype == torch.bfloat16
        assert len(lines) == 1


def test_the_held_out_kl_before_is_the_undistilled_model():
    dense = make_tiny_llama()
    undistilled, _ = _prune(BASE)
    _, report = _prune(ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=RefineConfig(rounds=1),
                                   reconstruct=None, distill=DISTILL))
    held = windows_of([CALIB])[-DISTILL.held_out:]
    assert report.stages["distillation"]["before"] == pytest.approx(_held_out_kl_by_hand(dense, undistilled, held), rel=1e-4)


@pytest.mark.parametrize("train_core", [False, True])
def test_masks_unchanged_and_cores_2_4(train_core):
    reference, _ = _prune(BASE)
    # a large step so that the kept iterate moves (a bad step is still kept if it is the best seen)
    cfg = DistillConfig(steps=4, lr=1e-3, held_out=3, top_k=16, eval_every=1, train_core=train_core)
    model, report = _prune(ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=RefineConfig(rounds=1),
                                       reconstruct=None, distill=cfg))
    ref_layers, layers = _armor_layers(reference), _armor_layers(model)
    assert set(ref_layers) == set(layers) and layers
    moved = False
    for name, module in layers.items():
        w, r = module.weight, ref_layers[name].weight
        core, ref_core = w.core_dense(), r.core_dense()
        assert not core[ref_core == 0].any()  # nothing grows off the mask
        assert check_mask(ref_core != 0, "2:4") and check_mask(core != 0, "2:4")
        if not train_core:
            assert torch.equal(core, ref_core)
        moved |= not torch.equal(w.a_blocks, r.a_blocks)
    assert moved == (report.stages["distillation"]["best_step"] > 0)


@pytest.mark.parametrize("warmup,decay", [(0.0, "constant"), (0.25, "cosine"), (0.0, "linear")])
def test_each_step_runs_at_the_scheduled_learning_rate(monkeypatch, warmup, decay):
    steps, lr = 8, 1e-3
    seen = []
    real_step = torch.optim.Adam.step

    def spy(self, *args, **kwargs):  # the real step, after recording each group's learning rate
        seen.append([g["lr"] for g in self.param_groups])
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", spy)
    cfg = DistillConfig(steps=steps, lr=lr, held_out=3, top_k=16, eval_every=4, warmup=warmup, decay=decay)
    model, _ = _prune(dataclasses.replace(BASE, distill=cfg))
    assert len(seen) == steps
    # by hand: warm-up `step / w` for w = round(warmup · steps) steps, then the decay over the rest
    w = round(warmup * steps)
    expected = []
    for step in range(1, steps + 1):
        p = (step - w - 1) / (steps - w)
        expected.append(step / w if step <= w else {"constant": 1.0, "linear": 1.0 - p,
                                                     "cosine": (1 + math.cos(math.pi * p)) / 2}[decay])
    peaks = [lr_g / expected[0] for lr_g in seen[0]]  # lr × each tensor's RMS
    for rates, factor in zip(seen, expected):
        assert rates == pytest.approx([peak * factor for peak in peaks], rel=1e-12)
    if decay == "constant":
        assert len({tuple(r) for r in seen}) == 1


def test_resume_applies_a_finished_distillation_without_redoing_it(tmp_path):
    cfg = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=RefineConfig(rounds=1), reconstruct=None,
                      distill=DistillConfig(steps=2, held_out=3, top_k=16, eval_every=1, lr=1e-3))
    first, report = _prune(cfg, run_dir=tmp_path / "run")
    assert (tmp_path / "run" / DISTILLED_NAME).exists()
    lines = []
    second, again = _prune(cfg, run_dir=tmp_path / "run", log=lines.append)
    assert any("already finished" in line for line in lines)
    assert not any("cached" in line for line in lines)  # no teacher, no training
    assert again.stages["distillation"] == report.stages["distillation"]
    for name, module in _armor_layers(first).items():
        w = _armor_layers(second)[name].weight
        assert torch.equal(w.dense_weight(), module.weight.dense_weight())


@pytest.mark.parametrize("reconstruct", [None, ReconstructConfig(steps=2), ReconstructConfig(steps=2, target="model")])
def test_a_skipped_distillation_warns_once_naming_the_way_out_and_the_cost(reconstruct):
    cfg = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), reconstruct=reconstruct,
                      distill=DistillConfig(held_out=12))
    with pytest.warns(UserWarning, match="distillation skipped: .*leave none to train on.*distill=None") as caught:
        _, report = _prune(cfg)
    messages = [str(w.message) for w in caught if "distillation skipped" in str(w.message)]
    assert len(messages) == 1 and "\n" not in messages[0]
    # reconstruction fitted to the dense block is pointed at the dense model's hidden states
    assert ('target="model"' in messages[0]) == (reconstruct is not None and reconstruct.target == "block")
    assert "41.13 Wikipedia perplexity, with it 34.87" in messages[0]  # what it costs, from the ablation
    # the report (and prune_report.json) says what the run skipped, and why
    assert set(report.stages["distillation"]) == {"skipped", "expected_cost"} and "leave none to train on" in report.stages["distillation"]["skipped"]
    assert not any(line.startswith("distillation") for line in report.stage_lines())
    assert json.loads(json.dumps(report.to_dict()))["stages"]["distillation"]["skipped"] == report.stages["distillation"]["skipped"]


def test_a_skipped_distillation_says_the_block_pass_goes_without_its_sampled_windows():
    cfg = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), reconstruct=None,
                      distill=DistillConfig(held_out=12, sampled_windows=4, sampled_in_block_pass=True))
    with pytest.warns(UserWarning, match="distillation skipped: .*its 4 sampled windows are not drawn, so the block "
                                         "pass calibrates on the calibration windows alone"):
        _prune(cfg)


def test_too_many_held_out_windows_skip_distillation_naming_the_field():
    cfg = dataclasses.replace(BASE, distill=DistillConfig(held_out=12))
    with pytest.warns(UserWarning, match="12 calibration windows leave none to train on.*DistillConfig.held_out"):
        _, report = _prune(cfg)
    assert report.stages["distillation"]["skipped"].startswith("12 calibration windows leave none") and "after" not in report.stages["distillation"]


@pytest.mark.parametrize("field,value", [("steps", 0), ("steps", 1.5), ("lr", 0.0), ("lr", float("nan")),
                                         ("windows_per_step", 0), ("held_out", 0), ("top_k", True),
                                         ("eval_every", -1), ("train_core", 1), ("warmup", 1.0),
                                         ("warmup", -0.1), ("decay", "exponential"), ("bf16_steps", 1)])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ArmorInputError, match=f"DistillConfig.{field}"):
        DistillConfig(**{field: value})


def test_armor_config_serializes_distillation_nested():
    assert ArmorConfig().to_dict()["distill"] == {"type": "DistillConfig", **dataclasses.asdict(DistillConfig())}
    assert ArmorConfig(distill=None).to_dict()["distill"] is None
    assert ArmorConfig(distill=DistillConfig(steps=8)).to_dict()["distill"]["steps"] == 8
    assert ArmorConfig(distill=DistillConfig(lr=1e-2, train_core=True)).to_dict()["distill"]["train_core"] is True
    with pytest.raises(ArmorInputError, match="ArmorConfig.distill"):
        ArmorConfig(distill=8)
