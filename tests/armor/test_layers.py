"""The store-backed loop over many layers: resume, per-layer settings, failures, kill-and-resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torch_armor import ArmorConfig
from torch_armor.config.armor import BcdConfig
from torch_armor.config.serialized import config_from_dict
from torch_armor.armor.layers import factorize_layers
from torch_armor.engine.runstore import MANIFEST_NAME, RunMismatchError, RunStore

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))  # test_runstore's helpers
from test_runstore import CFG, assert_same_factors, make_layers, stats_hash  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, no thread sync


# ---------------------------------------------------------------------------- resume


def test_resume_skips_finished_layers_and_matches_an_uninterrupted_run(tmp_path, one_thread):
    layers = make_layers()
    names = list(layers)
    reference = factorize_layers(layers, CFG, progress=False)

    store = RunStore(tmp_path, CFG, "synthetic", stats_hash(layers))
    factorize_layers({n: layers[n] for n in names[:3]}, CFG, store, progress=False)

    loads = []

    def lazy(name):
        def load():
            loads.append(name)
            return layers[name]
        return load

    computed = []
    resumed_store = RunStore(tmp_path, CFG, "synthetic", stats_hash(layers))
    resumed = factorize_layers({n: lazy(n) for n in names}, CFG, resumed_store, progress=False,
                               on_layer_done=lambda n, f: computed.append(n))
    assert loads == computed == names[3:]  # finished layers: neither loaded nor recomputed
    assert list(resumed) == names
    for n in names:
        assert_same_factors(resumed[n], reference[n])
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert {e["status"] for e in manifest["layers"].values()} == {"done"} and len(manifest["layers"]) == 6


def test_return_factors_false_keeps_nothing_in_memory(tmp_path):
    layers = make_layers(2)
    store = RunStore(tmp_path, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1)), "m", stats_hash(layers))
    out = factorize_layers(layers, store.config, store, progress=False, return_factors=False)
    assert out == {} and len(store.finished()) == 2


def test_kill_and_resume_gives_the_uninterrupted_result(tmp_path, one_thread):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        import torch
        torch.set_num_threads(1)
        sys.path.insert(0, {str(ROOT)!r})
        sys.path.insert(0, {str(Path(__file__).parents[1] / "engine")!r})
        from test_runstore import CFG, make_layers, stats_hash
        from torch_armor.armor.layers import factorize_layers
        from torch_armor.engine.runstore import RunStore

        layers = make_layers()
        store = RunStore(sys.argv[1], CFG, "synthetic", stats_hash(layers))
        factorize_layers(layers, CFG, store, progress=False,
                         on_layer_done=lambda name, f: print("saved", name, flush=True))
        print("finished", flush=True)
    """))
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line.split())
            if len(seen) == 3:
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.stdout.close()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert all(s[0] == "saved" for s in seen) and len(seen) == 3

    layers = make_layers()
    killed = RunStore(run_dir, CFG, "synthetic", stats_hash(layers))
    done_after_kill = killed.finished(layers)
    assert 3 <= len(done_after_kill) < 6 and done_after_kill == list(layers)[:len(done_after_kill)]

    resumed = subprocess.run([sys.executable, str(script), str(run_dir)], capture_output=True, text=True,
                             env=env, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    lines = resumed.stdout.split("\n")
    recomputed = [ln.split()[1] for ln in lines if ln.startswith("saved")]
    assert recomputed == list(layers)[len(done_after_kill):] and "finished" in lines

    reference = factorize_layers(layers, CFG, RunStore(tmp_path / "uninterrupted", CFG, "synthetic",
                                                       stats_hash(layers)), progress=False)
    final = RunStore(run_dir, CFG, "synthetic", stats_hash(layers))
    for name in layers:
        assert_same_factors(final.load(name), reference[name])
    assert not list(run_dir.rglob("*.tmp-*"))


def test_auto_block_size_resolves_per_layer_and_resumes(tmp_path):
    layers = make_layers(2)
    cfg = ArmorConfig(block_size="auto", max_overhead=0.5, optimizer=BcdConfig(iters=2))
    first = factorize_layers(layers, cfg, RunStore(tmp_path, cfg, "m", stats_hash(layers)), progress=False)
    store = RunStore(tmp_path, cfg, "m", stats_hash(layers))
    for name, (w, _) in layers.items():
        want = cfg.for_layer(*w.shape).block_size
        assert first[name].block_size == want and store.layer_info(name)["config"]["block_size"] == want
    lazy = {name: (lambda v=v: v) for name, v in layers.items()}  # resumed: nothing recomputed, lazily given
    again = factorize_layers(lazy, cfg, store, progress=False)
    assert all(torch.equal(again[n].core, first[n].core) for n in layers)


# ---------------------------------------------------------------------------- refusals


def test_other_per_layer_settings_are_refused(tmp_path):
    layers = make_layers(2)
    store = RunStore(tmp_path, CFG, "m", stats_hash(layers))
    factorize_layers(layers, CFG, store, progress=False, per_layer_overrides={"model.layers.1.proj": {"block_size": 32}})
    assert store.load("model.layers.1.proj").block_size == 32
    stored = config_from_dict(store.layer_info("model.layers.1.proj")["config"])  # the config, read back
    assert stored.block_size == 32 and stored.optimizer.group_updates_per_sweep(32) == 16  # derived for 32
    with pytest.raises(RunMismatchError, match=r"'model.layers.1.proj'.*\n.*block_size: run has 32, now 16"):
        factorize_layers(layers, CFG, RunStore(tmp_path, CFG, "m", stats_hash(layers)), progress=False)


def test_other_shape_is_refused(tmp_path):
    layers = make_layers(1)
    store = RunStore(tmp_path, CFG, "m", "h")
    factorize_layers(layers, CFG, store, progress=False)
    name = next(iter(layers))
    with pytest.raises(RunMismatchError, match="shape"):
        factorize_layers({name: (torch.randn(256, 128), torch.rand(128))}, CFG, RunStore(tmp_path, CFG, "m", "h"),
                         progress=False)


def test_bad_layer_arguments_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="mapping"):
        factorize_layers([torch.randn(4, 4)], CFG)
    with pytest.raises(ValueError, match="not being factorized"):
        factorize_layers(make_layers(1), CFG, per_layer_overrides={"other": {"block_size": 32}})
    with pytest.raises(ValueError, match="unknown ArmorConfig fields"):
        factorize_layers(make_layers(1), CFG, per_layer_overrides={"model.layers.0.proj": {"blocksize": 32}})
    with pytest.raises(ValueError, match="distributed_factorize"):
        factorize_layers(make_layers(1), CFG, RunStore(tmp_path, CFG, "m", "h", rank=1))


# ---------------------------------------------------------------------------- failures


def test_failed_layer_is_recorded_and_retried(tmp_path):
    layers = make_layers(2)
    names = list(layers)
    bad = dict(layers)
    bad[names[1]] = (torch.full_like(layers[names[1]][0], float("nan")), layers[names[1]][1])
    store = RunStore(tmp_path, CFG, "m", "h")
    with pytest.raises(ValueError, match="NaN"):
        factorize_layers(bad, CFG, store, progress=False)
    info = RunStore(tmp_path, CFG, "m", "h").layer_info(names[1])
    assert info["status"] == "failed" and "NaN" in info["error"]
    out = factorize_layers(layers, CFG, RunStore(tmp_path, CFG, "m", "h"), progress=False)
    assert list(out) == names


def test_expert_layers_resume_mid_parameter_and_equal_the_serial_factorization(tmp_path):
    from torch_armor.core.factorize import factorize  # the serial per-layer reference
    from torch_armor.armor.layers import expert_batches  # which layers run as one batch

    gen = torch.Generator().manual_seed(7)
    names = [f"m.mlp.experts.down_proj.{e}" for e in range(5)]
    layers = {n: (torch.randn(16, 32, generator=gen), torch.rand(32, generator=gen) + 0.1) for n in names}
    store = RunStore(tmp_path, CFG, "synthetic", stats_hash(layers))
    factorize_layers({n: layers[n] for n in names[:2]}, CFG, store, progress=False)  # interrupted after 2 experts
    computed = []
    resumed = factorize_layers(layers, CFG, RunStore(tmp_path, CFG, "synthetic", stats_hash(layers)), progress=False,
                               on_layer_done=lambda n, f: computed.append(n))
    assert computed == names[2:]  # the other three as one batch, each saved as its own layer
    assert expert_batches(names[2:], dict.fromkeys(names, CFG)) == [names[2:]]
    for n in names:
        assert_same_factors(resumed[n], factorize(*layers[n], CFG.for_layer(16, 32)))
