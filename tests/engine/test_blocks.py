"""The block-by-block engine against independent references: one-shot statistics equal one dense
pass of the whole model; sequential statistics equal a whole-model pass after pruning the blocks
before; a SIGKILL mid-block or at a block boundary resumes bit-identically; other weights or
calibration are refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_llama
from torch_armor.calibration.blocks import block_statistics, capture_block_inputs, decoder_blocks
from torch_armor.calibration.observer import collect_statistics, decoder_linear_names
from torch_armor import ArmorConfig, NoWagConfig, PruneOptions, SparseGPTConfig, WandaConfig, prune_model
from torch_armor.config.armor import BcdConfig
from torch_armor.core.proxy import nowag_prune
from torch_armor.engine.options import RUN_DIR_NAME
from torch_armor.errors import RunMismatchError

ROOT = Path(__file__).resolve().parents[2]
CALIB = torch.randint(0, 128, (6, 24), generator=torch.Generator().manual_seed(1))


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, no thread sync


def _weights(model) -> dict:
    return {n: model.get_submodule(n).weight.detach().clone() for n in decoder_linear_names(model)}


def _reference_nowag(model, sequential: bool) -> dict:
    """NoWag-P the slow, obvious way: statistics from whole-model forward passes (the dense model's,
    or — sequential — the model with every earlier block already pruned), one block at a time."""
    names = decoder_linear_names(model)
    dense_stats = collect_statistics(model, names, CALIB, batch_size=4, progress=False)
    for i in range(len(model.model.layers)):
        block_names = [n for n in names if n.startswith(f"model.layers.{i}.")]
        stats = collect_statistics(model, block_names, CALIB, batch_size=4, progress=False) if sequential \
            else dense_stats
        for n in block_names:
            module = model.get_submodule(n)
            _, pruned = nowag_prune(module.weight.detach(), stats[n].act_sq_norm, "2:4")
            module.weight = torch.nn.Parameter(pruned)
    return _weights(model)


@pytest.mark.parametrize("sequential", [False, True])
def test_statistics_match_whole_model_passes(sequential):
    reference = _reference_nowag(make_tiny_llama(), sequential)
    model = make_tiny_llama()
    report = prune_model(model, CALIB, NoWagConfig(), options=PruneOptions(sequential=sequential, progress=False))
    got = _weights(model)
    assert [layer.name for layer in report.layers] == list(reference)
    for name, w in reference.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=0, msg=name)


def test_sequential_changes_later_blocks_only():
    one_shot, seq = make_tiny_llama(), make_tiny_llama()
    prune_model(one_shot, CALIB, WandaConfig(), options=PruneOptions(sequential=False, progress=False))
    prune_model(seq, CALIB, WandaConfig(), options=PruneOptions(sequential=True, progress=False))
    a, b = _weights(one_shot), _weights(seq)
    assert all(torch.equal(a[n], b[n]) for n in a if n.startswith("model.layers.0."))  # same inputs
    assert any(not torch.equal(a[n], b[n]) for n in a if n.startswith("model.layers.1."))


def test_shared_inputs_are_observed_once():
    model = make_tiny_llama()
    prefix, blocks = decoder_blocks(model)
    inputs = capture_block_inputs(model, blocks[0], list(CALIB.split(4)))
    layers = {n: model.get_submodule(n) for n in decoder_linear_names(model) if n.startswith(prefix + ".0.")}
    stats = block_statistics(blocks[0], layers, inputs, device=torch.device("cpu"))
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    assert stats[attn + "q_proj"].act_sq_norm is stats[attn + "v_proj"].act_sq_norm
    assert stats[mlp + "gate_proj"].act_sq_norm is stats[mlp + "up_proj"].act_sq_norm
    assert stats[attn + "o_proj"].act_sq_norm is not stats[attn + "q_proj"].act_sq_norm
    assert stats[mlp + "down_proj"].act_sq_norm.shape == (128,)
    assert stats[attn + "q_proj"].num_tokens == CALIB.numel()


def test_sparsegpt_gets_xtx_and_armor_is_at_most_nowag():
    model = make_tiny_llama()
    report = prune_model(model, CALIB, SparseGPTConfig(block_size=32), options=PruneOptions(progress=False))
    assert len(report.layers) == 14
    model = make_tiny_llama()
    report = prune_model(model, CALIB, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2)), options=PruneOptions(progress=False))
    assert all(layer.relative_proxy_loss <= 1.0 + 1e-6 for layer in report.layers)
    assert report.overhead > 0


def test_changed_weights_or_calibration_are_refused(tmp_path):
    cfg = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1))
    prune_model(make_tiny_llama(), CALIB, cfg, options=PruneOptions(run_dir=tmp_path / "run", progress=False))
    changed = make_tiny_llama()
    with torch.no_grad():
        changed.model.embed_tokens.weight[0, 0] += 1.0  # not even a pruned layer
    with pytest.raises(RunMismatchError, match="model_id"):
        prune_model(changed, CALIB, cfg, options=PruneOptions(run_dir=tmp_path / "run", progress=False))
    with pytest.raises(RunMismatchError):
        prune_model(make_tiny_llama(), CALIB[:, :20], cfg, options=PruneOptions(run_dir=tmp_path / "run", progress=False))
    # the same weights and data resume (nothing to compute) and give the same model
    again = make_tiny_llama()
    prune_model(again, CALIB, cfg, options=PruneOptions(run_dir=tmp_path / "run", progress=False))


def test_layers_outside_blocks_are_refused():
    model = make_tiny_llama()
    with pytest.raises(ValueError, match="lm_head.*decoder block"):
        prune_model(model, CALIB, WandaConfig(), layers=["lm_head"], options=PruneOptions(progress=False))


_SCRIPT = textwrap.dedent("""
    import dataclasses, os, signal, sys
    import torch
    sys.path.insert(0, {tests!r})
    from conftest import make_tiny_llama
    import torch_armor.engine.blocks as blocks
    import torch_armor.armor.method as engine_runner  # where the ARMOR method calls factorize
    import torch_armor.engine.runstore as runstore
    from torch_armor import ArmorConfig, PruneOptions, prune_model
    from torch_armor.config.armor import BcdConfig

    torch.set_num_threads(1)
    kind, count = (os.environ.get("KILL_AT") or "none:0").split(":")
    calls = {{"save": 0, "hidden": 0, "factorize": 0}}
    real_save, real_hidden, real_fact = runstore.RunStore.save, blocks.BlockPipeline._save_hidden, engine_runner.factorize

    def save(self, *a, **k):
        path = real_save(self, *a, **k)
        calls["save"] += 1
        if kind == "layer" and calls["save"] == int(count):
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    def hidden(self, *a, **k):
        real_hidden(self, *a, **k)
        calls["hidden"] += 1
        if kind == "hidden" and calls["hidden"] == int(count):
            os.kill(os.getpid(), signal.SIGKILL)

    def fact(*a, **k):
        calls["factorize"] += 1
        return real_fact(*a, **k)

    runstore.RunStore.save, blocks.BlockPipeline._save_hidden, engine_runner.factorize = save, hidden, fact
    calib = torch.randint(0, 128, (6, 24), generator=torch.Generator().manual_seed(1))
    cfg = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=3))
    cfg = dataclasses.replace(cfg, reconstruct=dataclasses.replace(cfg.reconstruct, target=os.environ["TARGET"]))
    prune_model(make_tiny_llama(), calib, cfg, options=PruneOptions(run_dir=sys.argv[1], out=sys.argv[2], progress=False))
    print("factorized", calls["factorize"])
""")


def _run(script: Path, run_dir: Path, out: Path, kill_at: str = "", target: str = "block") -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", KILL_AT=kill_at, TARGET=target, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(script), str(run_dir), str(out)], capture_output=True, text=True,
                          env=env, timeout=300)


def _same_files(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert sorted(ta) == sorted(tb)
    assert [k for k in ta if not torch.equal(ta[k], tb[k])] == []


@pytest.mark.parametrize("kill_at, finished, target", [("layer:3", 3, "block"), ("hidden:1", 7, "block"),
                                                        ("hidden:1", 7, "model")])
def test_sigkill_then_resume_is_bit_identical(tmp_path, kill_at, finished, target):
    """``target="model"``: the dense stream the next block is fitted to is resumed from disk too."""
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT.format(tests=str(ROOT / "tests")))
    reference = _run(script, tmp_path / "ref_run", tmp_path / "ref", target=target)
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert "factorized 14" in reference.stdout
    killed = _run(script, tmp_path / "run", tmp_path / "out", kill_at, target)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = _run(script, tmp_path / "run", tmp_path / "out", target=target)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"factorized {14 - finished}" in resumed.stdout  # finished layers are not recomputed
    _same_files(tmp_path / "out", tmp_path / "ref")


@pytest.mark.parametrize("method", ["armor", "sparsegpt"])
def test_streamed_checkpoint_equals_in_memory(tmp_path, method):
    from torch_armor.format.serialization import load_pretrained

    ckpt = tmp_path / "ckpt"
    make_tiny_llama().save_pretrained(str(ckpt), max_shard_size="100KB")  # several shards
    assert len(list(ckpt.glob("*.safetensors"))) > 2
    cfg = (ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2), distill=None) if method == "armor"  # streamed: no distillation
           else SparseGPTConfig(block_size=32))
    streamed = prune_model(ckpt, CALIB, cfg, options=PruneOptions(out=tmp_path / "streamed", progress=False))
    in_memory = make_tiny_llama()
    reference = prune_model(in_memory, CALIB, cfg, options=PruneOptions(out=tmp_path / "memory", progress=False))
    assert [(r.name, r.relative_proxy_loss) for r in streamed.layers] == \
        [(r.name, r.relative_proxy_loss) for r in reference.layers]
    assert not (tmp_path / "streamed" / RUN_DIR_NAME).exists()  # the temporary run directory is gone
    loaded = load_pretrained(tmp_path / "streamed")
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, in_memory(x).logits)


def test_streaming_needs_out(tmp_path):
    make_tiny_llama().save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="out=DIR"):
        prune_model(tmp_path, CALIB, WandaConfig(), options=PruneOptions(progress=False))


@pytest.mark.parametrize("sequential", [True, False])
def test_hidden_states_on_disk_and_in_bf16(tmp_path, sequential):
    in_memory = make_tiny_llama()
    prune_model(in_memory, CALIB, WandaConfig(), options=PruneOptions(sequential=sequential, progress=False))
    on_disk = make_tiny_llama()
    prune_model(on_disk, CALIB, WandaConfig(), options=PruneOptions(sequential=sequential, hidden_dir=tmp_path / "h", progress=False))
    assert sorted(p.name for p in (tmp_path / "h").iterdir()) == [f"batch-{j:06d}.safetensors" for j in range(2)]
    a, b = _weights(in_memory), _weights(on_disk)
    assert all(torch.equal(a[n], b[n]) for n in a)
    half = make_tiny_llama()
    prune_model(half, CALIB, WandaConfig(), options=PruneOptions(sequential=sequential, hidden_dtype=torch.bfloat16, progress=False))
    c = _weights(half)
    block1 = [n for n in a if n.startswith("model.layers.1.")]
    assert any(not torch.equal(a[n], c[n]) for n in block1)  # bf16 hidden states change the statistics


def test_changed_checkpoint_at_the_same_path_is_refused(tmp_path):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    make_tiny_llama(seed=0).save_pretrained(str(ckpt))
    cfg = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1))
    prune_model(ckpt, CALIB, cfg, options=PruneOptions(run_dir=run, out=tmp_path / "a", progress=False))
    make_tiny_llama(seed=1).save_pretrained(str(ckpt))  # replaced in place: same path, same shapes
    with pytest.raises(RunMismatchError, match="model_id"):
        prune_model(ckpt, CALIB, cfg, options=PruneOptions(run_dir=run, out=tmp_path / "b", progress=False))
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").glob("*.safetensors"))


def test_the_pipeline_holds_nothing_the_plan_decides():
    """The block pass runs a plan plus the state of its execution: no setting of the plan (or of its
    options) is copied into a field of the pipeline or of the execution state."""
    from dataclasses import fields

    from torch_armor.engine.blocks import BlockPipeline
    from torch_armor.engine.methods import RunState
    from torch_armor.engine.plan import PrunePlan

    planned = {f.name for f in fields(PrunePlan)} | {f.name for f in fields(PruneOptions)}
    pipeline = {f.name for f in fields(BlockPipeline)}
    assert {f.name for f in fields(RunState)} & planned == set()
    assert pipeline - {"plan", "state"} == {"run_config", "bar"}  # both exist only while the loop runs
    assert pipeline & planned == set()
