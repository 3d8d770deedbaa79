"""Distillation of a streamed checkpoint (one block resident): the same teacher, gradients and result
as in memory, resume in the middle of it, and what a prune still skips."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from _helpers import free_port
from _processes import CODE
from conftest import make_tiny_llama
from _helpers import assert_same_saved_model  # the same check as the CLI's resume test
from torch_armor import ArmorConfig, prune_model, PruneOptions
from torch_armor.config.armor import BcdConfig, RefineConfig
from torch_armor.config.levers import DistillConfig
from torch_armor.engine.blocks import BLOCKS_DIR
from torch_armor.armor.distill import STATE_NAME, distill_skip_reason
from torch_armor.armor.distill_kl import dense_top_k, windows_of
from torch_armor.armor.distill_stream import BlockStream, StreamedStudent
from torch_armor.armor.distill_train import InMemoryStudent, distill_model
from torch_armor.engine.sources import ShardWriter, Streamed
from torch_armor.format.serialization import load_pretrained

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 128
CALIB = torch.randint(0, VOCAB, (10, 24), generator=torch.Generator().manual_seed(5))
DISTILL = DistillConfig(steps=4, lr=3e-3, windows_per_step=2, held_out=3, top_k=32, eval_every=1)


def _config(distill, **changes):
    return ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=RefineConfig(rounds=0), reconstruct=None,
                       distill=distill, **changes)


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """A tiny checkpoint (tied embeddings, as SmolLM2's), its streamed prune without distillation (the
    run directory keeps the block shards) and the same pruned model loaded in memory."""
    root = tmp_path_factory.mktemp("stream")
    dense = make_tiny_llama(tie=True)
    dense.save_pretrained(root / "ckpt")
    prune_model(root / "ckpt", CALIB, _config(None), options=PruneOptions(out=root / "out", run_dir=root / "run",
                                                                             progress=False))
    return root, dense, load_pretrained(root / "out")


def _students(root, in_memory, config, run=None):
    shards = ShardWriter((run or root / "run") / BLOCKS_DIR)
    stream = BlockStream(Streamed(root / "ckpt"), "model.layers", 2, shards, torch.device("cpu"))
    return InMemoryStudent(in_memory, config), StreamedStudent(stream, config), stream


@pytest.mark.parametrize("train_core", [False, True])
def test_a_streamed_step_has_the_in_memory_teacher_and_gradients(pruned, train_core):
    root, dense, in_memory = pruned
    config = DistillConfig(train_core=train_core, top_k=32)
    windows = windows_of([CALIB[:3]])
    teacher = dense_top_k(dense, windows, 32)
    memory, streamed, stream = _students(root, in_memory, config)
    for got, want in zip(stream.dense_top_k(windows, 32), teacher):
        assert torch.equal(got.indices, want.indices)
        assert torch.allclose(got.log_probs, want.log_probs, atol=1e-5)
    assert streamed.leaves.keys() == memory.leaves.keys() and len(memory.leaves) == 14
    count = 3 * 24
    loss_memory = memory.backward(windows, teacher, count, contextlib.nullcontext)
    loss_streamed = streamed.backward(windows, teacher, count, contextlib.nullcontext)
    assert loss_streamed == pytest.approx(loss_memory, rel=1e-5)
    compared = 0
    for name, tensors in memory.leaves.items():
        for mine, theirs in zip(tensors, streamed.leaves[name]):
            if mine.requires_grad:
                assert theirs.requires_grad and mine.grad.abs().max() > 0
                assert torch.allclose(theirs.grad, mine.grad, rtol=1e-4, atol=1e-6), name
                compared += 1
            else:
                assert theirs is None  # an untrained core stays on disk
    assert compared == 14 * (3 if train_core else 2)
    held = (memory.kl_sum(windows, teacher), streamed.kl_sum(windows, teacher))
    assert held[1][1] == held[0][1] and held[1][0] == pytest.approx(held[0][0], rel=1e-5)
    memory.close()
    streamed.close()


def test_untied_embeddings_and_output_layer_are_never_resident_while_a_block_runs(tmp_path):
    """With untied embeddings (each as big as several blocks in a large-vocabulary model) a streamed
    step holds the embeddings only to compute the first block's inputs and the output layer only for
    the logits; its teacher, loss and gradients are still the in-memory ones."""
    dense = make_tiny_llama(tie=False)
    dense.save_pretrained(tmp_path / "ckpt")
    prune_model(tmp_path / "ckpt", CALIB, _config(None), options=PruneOptions(out=tmp_path / "out",
                                                                              run_dir=tmp_path / "run", progress=False))
    config = DistillConfig(top_k=32)
    windows = windows_of([CALIB[:3]])
    teacher = dense_top_k(dense, windows, 32)
    memory, streamed, stream = _students(tmp_path, load_pretrained(tmp_path / "out"), config)
    model = stream.source.model
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    resident = []

    def note(where):
        def hook(module, args):
            if not next(module.parameters()).is_meta:  # runs, not the capture of block 0's arguments
                resident.append((where, embeddings.weight.is_meta, head.weight.is_meta))
        return hook

    hooks = [layer.register_forward_pre_hook(note("block")) for layer in model.model.layers]
    hooks.append(head.register_forward_pre_hook(note("head")))
    got_teacher = stream.dense_top_k(windows, 32)
    loss_streamed = streamed.backward(windows, teacher, 3 * 24, contextlib.nullcontext)
    for hook in hooks:
        hook.remove()
    assert {where for where, _, _ in resident} == {"block", "head"}
    assert all(emb_meta and head_meta for where, emb_meta, head_meta in resident if where == "block")
    assert all(emb_meta and not head_meta for where, emb_meta, head_meta in resident if where == "head")
    assert embeddings.weight.is_meta and head.weight.is_meta  # released after the step
    for got, want in zip(got_teacher, teacher):
        assert torch.equal(got.indices, want.indices)
    assert loss_streamed == pytest.approx(memory.backward(windows, teacher, 3 * 24, contextlib.nullcontext), rel=1e-5)
    for name, tensors in memory.leaves.items():
        for mine, theirs in zip(tensors, streamed.leaves[name]):
            if mine.requires_grad:
                assert torch.allclose(theirs.grad, mine.grad, rtol=1e-4, atol=1e-6), name


def test_a_few_streamed_steps_keep_the_same_iterate_as_in_memory(pruned, tmp_path):
    root, dense, _ = pruned
    shutil.copytree(root / "run", tmp_path / "run")  # the shards get the distilled wrappers: not the fixture's
    windows = windows_of([CALIB])
    teacher = dict(enumerate(dense_top_k(dense, windows, DISTILL.top_k)))
    memory, streamed, stream = _students(root, load_pretrained(root / "out"), DISTILL, tmp_path / "run")
    results = [distill_model(s, windows, teacher, DISTILL, seed=1, device=torch.device("cpu"))
               for s in (memory, streamed)]
    assert results[0].best_step > 0 and results[1].best_step == results[0].best_step
    assert [kl for _, kl in results[1].curve] == pytest.approx([kl for _, kl in results[0].curve], rel=1e-4)
    want = memory.result_tensors(False)
    got = streamed.result_tensors(False)
    assert got.keys() == want.keys() and len(want) == 28
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=1e-4, atol=1e-6), key
    seen = {}  # the shards hold what the streamed student kept
    stream.for_each_layer(lambda name, site: seen.update({name: site.tensor.a_blocks.clone()}), write=False)
    assert all(torch.equal(a, got[f"{name}.a_blocks"]) for name, a in seen.items()) and len(seen) == 14


def _distilled_prune(root, out, **options):
    return prune_model(root / "ckpt", CALIB, _config(DISTILL), options=PruneOptions(out=out, progress=False, **options))


def _state_dict(directory):
    """Every weight of a saved pruned model, ARMOR ones as their dense matrices."""
    return {k: (v.dense_weight() if hasattr(v, "dense_weight") else v).detach()
            for k, v in load_pretrained(directory).state_dict().items()}


def test_an_interrupted_streamed_distillation_resumes_to_the_uninterrupted_result(pruned, tmp_path, monkeypatch):
    root = pruned[0]
    reference = _distilled_prune(root, tmp_path / "reference")
    assert reference.stages["distillation"]["best_step"] > 0
    real_step, calls = torch.optim.Adam.step, []

    def third_step_interrupted(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", third_step_interrupted)
    with pytest.raises(KeyboardInterrupt):
        _distilled_prune(root, tmp_path / "out", run_dir=tmp_path / "run")
    monkeypatch.setattr(torch.optim.Adam, "step", real_step)
    assert (tmp_path / "run" / STATE_NAME).exists()
    lines = []
    resumed = _distilled_prune(root, tmp_path / "out", run_dir=tmp_path / "run", log=lines.append)
    assert any("resuming after step 2 of 4" in line for line in lines)
    assert not (tmp_path / "run" / STATE_NAME).exists()
    assert resumed.stages["distillation"]["curve"] == reference.stages["distillation"]["curve"]
    assert_same_saved_model(tmp_path / "reference", tmp_path / "out")  # the files, bit for bit


def test_a_streamed_prune_distills_like_the_in_memory_one(pruned, tmp_path):
    root = pruned[0]
    streamed = _distilled_prune(root, tmp_path / "streamed")
    model = make_tiny_llama(tie=True)
    in_memory = prune_model(model, CALIB, _config(DISTILL), options=PruneOptions(out=tmp_path / "memory",
                                                                                progress=False))
    assert "skipped" not in streamed.stages["distillation"] and streamed.stages["distillation"]["best_step"] == in_memory.stages["distillation"]["best_step"]
    assert streamed.stages["distillation"]["after"] == pytest.approx(in_memory.stages["distillation"]["after"], rel=1e-4)
    want, got = _state_dict(tmp_path / "memory"), _state_dict(tmp_path / "streamed")
    for key in want:
        assert torch.allclose(got[key].float(), want[key].float(), rtol=1e-4, atol=1e-6), key


def test_a_streamed_prune_says_it_distills_without_its_sampled_windows(pruned, tmp_path):
    root = pruned[0]
    cfg = _config(DistillConfig(steps=1, held_out=3, sampled_windows=4, sampled_in_block_pass=True))
    with pytest.warns(UserWarning, match="distillation runs on the calibration windows alone: its 4 sampled windows "
                                         "are not drawn.*streamed.*and the block pass calibrates on the calibration "
                                         "windows alone"):
        report = prune_model(root / "ckpt", CALIB, cfg, options=PruneOptions(out=tmp_path / "out", progress=False))
    assert report.stages["distillation"]["sampled_windows_skipped"].startswith("its 4 sampled windows are not drawn")
    assert json.loads(json.dumps(report.to_dict()))["stages"]["distillation"]["best_step"] >= 0


def test_what_is_still_skipped_says_why():
    assert distill_skip_reason(DISTILL, n_windows=10) == ""
    assert "3 calibration windows leave none to train on" in distill_skip_reason(DISTILL, n_windows=3)


WORKER = """
import json, sys
import torch
torch.set_num_threads(1)
from torch_armor import ArmorConfig, prune_model, PruneOptions
from torch_armor.config.armor import BcdConfig, RefineConfig
from torch_armor.config.levers import DistillConfig
ckpt, calib, out, distill = sys.argv[1:5]
config = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=RefineConfig(rounds=0), reconstruct=None,
                     distill=DistillConfig(**json.loads(distill)))
report = prune_model(ckpt, torch.load(calib), config, options=PruneOptions(out=out, progress=False))
if report.rank == 0:
    sys.stdout.write("distill " + json.dumps(report.stages["distillation"]) + "\\n")
"""


@pytest.mark.slow  # three processes (two ranks and one) of about 40 s each on a loaded machine
def test_two_ranks_distill_data_parallel_as_one_process_does(pruned, tmp_path):
    root = pruned[0]
    script, calib = tmp_path / "worker.py", tmp_path / "calib.pt"
    script.write_text(WORKER)
    torch.save(CALIB, calib)
    settings = json.dumps(dataclasses.asdict(DISTILL))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(CODE))
    env.pop("WORLD_SIZE", None)
    runs = {}
    for ranks in (1, 2):
        out = tmp_path / f"out{ranks}"
        launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                                          "127.0.0.1", "--master-port", str(free_port())]
        proc = subprocess.run([sys.executable, *launcher, str(script), str(root / "ckpt"), str(calib), str(out),
                               settings], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = [line for line in proc.stdout.splitlines() if line.startswith("distill ")]
        assert len(lines) == 1  # rank 0 reports
        runs[ranks] = json.loads(lines[0][len("distill "):]), _state_dict(out)
    (one, one_weights), (two, two_weights) = runs[1], runs[2]
    assert one["best_step"] > 0 and two["best_step"] == one["best_step"]
    assert [kl for _, kl in two["curve"]] == pytest.approx([kl for _, kl in one["curve"]], rel=1e-5)
    assert two_weights.keys() == one_weights.keys()
    for key in one_weights:
        assert torch.allclose(two_weights[key], one_weights[key], rtol=1e-5, atol=1e-7), key


def test_each_streamed_block_gets_its_own_attention_mask(tmp_path):
    """A model whose layers mix sliding-window and full attention: the streamed teacher (block by
    block) equals the model's own forward only if every block gets its own layer type's mask, not
    block 0's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64,
                      use_sliding_window=True, sliding_window=4, layer_types=["full_attention", "sliding_attention"])
    torch.manual_seed(0)
    dense = Qwen3ForCausalLM(cfg).eval()
    dense.save_pretrained(tmp_path / "ckpt")
    full = Qwen3ForCausalLM(Qwen3Config(**{**cfg.to_dict(), "layer_types": ["full_attention"] * 2})).eval()
    full.load_state_dict(dense.state_dict())
    windows = windows_of([CALIB[:2]])
    want, everywhere_full = dense_top_k(dense, windows, 16), dense_top_k(full, windows, 16)
    assert not torch.allclose(want[0].log_probs, everywhere_full[0].log_probs, atol=1e-3)  # the masks matter here
    stream = BlockStream(Streamed(tmp_path / "ckpt"), "model.layers", 2, ShardWriter(tmp_path / "shards"),
                         torch.device("cpu"))
    for got, expected in zip(stream.dense_top_k(windows, 16), want):
        assert torch.equal(got.indices, expected.indices)
        assert torch.allclose(got.log_probs, expected.log_probs, atol=1e-5)
