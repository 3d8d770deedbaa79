"""Distillation on windows sampled from the dense model: the sampler against a no-cache reference
drawing from the model's softmax, the held-out windows staying calibration windows, the teacher."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from conftest import make_tiny_llama
from torch_armor import ArmorConfig, PruneOptions, prune_model
from torch_armor.config.armor import BcdConfig, RefineConfig
from torch_armor.config.levers import ReconstructConfig
from torch_armor.config.levers import DistillConfig
from torch_armor.armor.distill import Distillation
from torch_armor.armor.distill_kl import dense_top_k, sample_windows, windows_of
from torch_armor.armor.distill_train import held_out_split
from torch_armor.errors import ArmorInputError

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 128
CALIB = torch.randint(0, VOCAB, (12, 24), generator=torch.Generator().manual_seed(5))


def _sample_by_hand(model, prompt: torch.Tensor, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """Whole-prefix forward passes (no cache), one multinomial draw per position from the softmax."""
    ids = prompt
    with torch.no_grad():
        while ids.shape[1] < seq_len:
            probs = torch.softmax(model(ids).logits[:, -1].double(), dim=-1).float()
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return ids


@pytest.mark.parametrize("count,batch_size,prompt_tokens", [(5, 2, 1), (3, 8, 1), (5, 2, 6)])
def test_sampled_windows_are_the_models_own_draws_started_from_each_prompt(count, batch_size, prompt_tokens):
    model = make_tiny_llama()
    prompts = windows_of([CALIB[:4]])
    got = sample_windows(model, prompts, count, 20, seed=7, batch_size=batch_size, prompt_tokens=prompt_tokens)
    gen = torch.Generator().manual_seed(7)
    want = torch.cat([_sample_by_hand(model, CALIB[[(s + i) % 4 for i in range(min(batch_size, count - s))],
                                                   :prompt_tokens], 20, gen)
                      for s in range(0, count, batch_size)])
    assert [w[1] for w in got] == [None] * count
    assert torch.equal(torch.cat([w[0] for w in got]), want)
    assert torch.equal(want[:, :prompt_tokens], CALIB[[i % 4 for i in range(count)], :prompt_tokens])


@pytest.mark.parametrize("prompt_tokens", [0, 20, 25])
def test_a_prompt_that_is_empty_fills_the_window_or_outruns_a_prompt_is_named(prompt_tokens):
    with pytest.raises(ArmorInputError, match=f"prompt_tokens={prompt_tokens} must be"):
        sample_windows(make_tiny_llama(), windows_of([CALIB[:2]]), 2, 20, seed=0, prompt_tokens=prompt_tokens)


def test_sampling_is_seeded():
    model = make_tiny_llama()
    prompts = windows_of([CALIB[:2]])
    a, b, c = (sample_windows(model, prompts, 2, 16, seed=s) for s in (1, 1, 2))
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c))


def test_sampled_windows_train_and_are_never_held_out():
    cfg = DistillConfig(held_out=3)
    held, train = held_out_split(12, cfg, n_sampled=5)
    assert held == [9, 10, 11]
    assert train == [*range(9), *range(12, 17)]
    assert held_out_split(12, cfg) == (held, list(range(9)))


@pytest.mark.parametrize("prompt_tokens", [1, 5])
def test_the_teacher_covers_the_sampled_windows_as_the_dense_models_top_k(prompt_tokens):
    dense = make_tiny_llama()
    cfg = DistillConfig(steps=20, held_out=3, top_k=8, sampled_windows=4, sample_prompt_tokens=prompt_tokens)
    distillation = Distillation(cfg, [CALIB], seed=3)
    distillation.capture(dense)
    train_prompts = windows_of([CALIB[:9]])
    want = sample_windows(dense, train_prompts, 4, CALIB.shape[1], seed=3, prompt_tokens=prompt_tokens)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(distillation.sampled, want))
    assert all(torch.equal(x[0][0, :prompt_tokens], CALIB[i, :prompt_tokens])
               for i, x in enumerate(distillation.sampled))
    reached = [j for j in distillation.teacher if j >= 12]
    assert reached  # 20 steps of 2 windows over 13 training windows reach every sampled one
    for j in reached:
        top = dense_top_k(dense, [want[j - 12]], 8)[0]
        assert torch.equal(distillation.teacher[j].indices, top.indices)
        assert torch.allclose(distillation.teacher[j].log_probs, top.log_probs)


def test_prune_model_with_sampled_windows_measures_the_same_held_out_kl_before():
    base = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=RefineConfig(rounds=1), reconstruct=None)
    dense = make_tiny_llama()
    reports = []
    for sampled in (0, 4):
        cfg = dataclasses.replace(base, distill=DistillConfig(steps=4, held_out=3, top_k=16, eval_every=2,
                                                              sampled_windows=sampled))
        reports.append(prune_model(copy.deepcopy(dense), CALIB, cfg, options=PruneOptions(progress=False)).stages["distillation"])
    assert reports[0]["before"] == reports[1]["before"]  # the held-out windows are the calibration ones
    assert reports[0]["curve"] != reports[1]["curve"]  # and training saw other windows


def test_a_model_without_generate_is_refused_in_one_line():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

    with pytest.raises(ArmorInputError, match=r"^DistillConfig.sampled_windows: Plain .*sampled_windows=0$"):
        sample_windows(Plain(), windows_of([CALIB[:1]]), 1, 8, seed=0)


@pytest.mark.parametrize("value", [-1, 1.5, True])
@pytest.mark.parametrize("field", ["sampled_windows", "sample_prompt_tokens"])
def test_sampled_windows_validation_names_the_field(field, value):
    with pytest.raises(ArmorInputError, match=f"DistillConfig.{field}"):
        DistillConfig(**{field: value})


def test_sample_prompt_tokens_of_zero_is_refused():
    with pytest.raises(ArmorInputError, match="DistillConfig.sample_prompt_tokens"):
        DistillConfig(sample_prompt_tokens=0)


def _losses(report):
    return [(r.name, r.relative_proxy_loss, r.relative_output_loss) for r in report.layers]


_BLOCK_PASS = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=RefineConfig(rounds=1), reconstruct=None)
_IN_PASS = DistillConfig(steps=2, held_out=3, top_k=8, sampled_windows=4, sample_prompt_tokens=2,
                         sampled_in_block_pass=True)


def test_sampled_windows_in_the_block_pass_calibrate_it_as_leading_calibration_windows(tmp_path):
    dense = make_tiny_llama()
    sampled = sample_windows(dense, windows_of([CALIB[:9]]), 4, CALIB.shape[1], seed=0, prompt_tokens=2)
    explicit = torch.cat([*(w[0] for w in sampled), CALIB])
    opts = PruneOptions(progress=False, batch_size=4)
    got = prune_model(copy.deepcopy(dense), CALIB, dataclasses.replace(_BLOCK_PASS, distill=_IN_PASS), options=opts)
    by_hand = prune_model(copy.deepcopy(dense), explicit, _BLOCK_PASS, options=opts)
    without = prune_model(copy.deepcopy(dense), CALIB, dataclasses.replace(
        _BLOCK_PASS, distill=dataclasses.replace(_IN_PASS, sampled_in_block_pass=False)), options=opts)
    assert _losses(got) == _losses(by_hand)
    assert _losses(got) != _losses(without)
    assert got.settings["config"]["distill"]["sampled_in_block_pass"] is True


def test_block_reconstruction_holds_out_calibration_windows_only(monkeypatch):
    import torch_armor.armor.reconstruct as reconstruct

    held_batches = []
    real_split = reconstruct.split_windows

    def recording_split(*args, **kwargs):
        held, train = real_split(*args, **kwargs)
        held_batches.extend(u.batch for u in held)
        return held, train

    monkeypatch.setattr(reconstruct, "split_windows", recording_split)
    cfg = dataclasses.replace(_BLOCK_PASS, reconstruct=ReconstructConfig(steps=2, held_out=11), distill=_IN_PASS)
    prune_model(make_tiny_llama(), CALIB, cfg, options=PruneOptions(progress=False, batch_size=4))
    # batch 0 holds the 4 sampled windows; 11 held-out windows are every calibration window but one
    assert held_batches and 0 not in held_batches and sorted(set(held_batches)) == [1, 2, 3]


@pytest.mark.filterwarnings("ignore:run .* is missing; the layer will be recomputed")
def test_a_resumed_run_reuses_its_sampled_windows(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from torch_armor.armor.distill import SAMPLED_NAME

    dense = make_tiny_llama()
    cfg = dataclasses.replace(_BLOCK_PASS, distill=_IN_PASS)
    prune_model(copy.deepcopy(dense), CALIB, cfg, options=PruneOptions(progress=False, run_dir=tmp_path))
    with safe_open(str(tmp_path / SAMPLED_NAME), framework="pt") as fh:
        meta, ids = fh.metadata(), fh.get_tensor("ids")
    want = sample_windows(dense, windows_of([CALIB[:9]]), 4, CALIB.shape[1], seed=0, prompt_tokens=2)
    assert torch.equal(ids, torch.cat([w[0] for w in want]))
    # an interrupted run's samples are what its resume calibrates on, not a new draw
    other = torch.flip(ids, dims=[1]).contiguous()
    save_file({"ids": other}, str(tmp_path / SAMPLED_NAME), metadata=meta)
    for name in ("layers", "reconstructed", "hidden.safetensors", "distilled.safetensors"):
        path = tmp_path / name
        if path.is_dir():
            import shutil
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    resumed = prune_model(copy.deepcopy(dense), CALIB, cfg, options=PruneOptions(progress=False, run_dir=tmp_path))
    by_hand = prune_model(copy.deepcopy(dense), torch.cat([other, CALIB]), _BLOCK_PASS,
                          options=PruneOptions(progress=False))
    assert _losses(resumed) == _losses(by_hand)


@pytest.mark.parametrize("value", [1, "yes"])
def test_sampled_in_block_pass_must_be_a_bool(value):
    with pytest.raises(ArmorInputError, match="DistillConfig.sampled_in_block_pass must be True or False"):
        DistillConfig(sampled_windows=4, sampled_in_block_pass=value)


def test_sampled_in_block_pass_without_sampled_windows_names_the_fix():
    with pytest.raises(ArmorInputError, match=r"sampled_in_block_pass=True needs .*set sampled_windows"):
        DistillConfig(sampled_in_block_pass=True)


@pytest.mark.parametrize("masked", [False, True])
def test_block_pass_batches_lead_with_the_samples_in_the_calibrations_form(masked):
    from torch_armor.engine.batches import calibration_batches

    mask = torch.ones_like(CALIB)
    mask[0, -5:] = 0
    batches = calibration_batches({"input_ids": CALIB, "attention_mask": mask} if masked else CALIB, 4)
    distillation = Distillation(_IN_PASS, batches, seed=0)
    distillation.capture(make_tiny_llama())
    got, leading = distillation.block_pass_batches(batches, 3)
    assert leading == 4 and len(got) == 2 + len(batches) and all(a is b for a, b in zip(got[2:], batches))
    ids = [b[0] if masked else b for b in got[:2]]
    assert [tuple(t.shape) for t in ids] == [(3, CALIB.shape[1]), (1, CALIB.shape[1])]
    assert torch.equal(torch.cat(ids), torch.cat([w[0] for w in distillation.sampled]))
    if masked:
        assert all(b[1].dtype == torch.bool and bool(b[1].all()) for b in got[:2])
    plain = Distillation(dataclasses.replace(_IN_PASS, sampled_in_block_pass=False), batches, seed=0)
    plain.capture(make_tiny_llama())
    kept, none = plain.block_pass_batches(batches, 3)
    assert none == 0 and len(kept) == len(batches) and all(a is b for a, b in zip(kept, batches))
