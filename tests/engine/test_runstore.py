"""Resumable runs: atomic layer files, manifest identity checks, kill-and-resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from torch_armor import ArmorConfig, factorize
from torch_armor.core.factors import ArmorFactors
from torch_armor.calibration.observer import LayerStatistics
from torch_armor.engine.runstore import (
    MANIFEST_NAME,
    RunMismatchError,
    RunStore,
    factorize_layers,
    hash_statistics,
    hash_tensors,
)

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(128, 256), (256, 128), (128, 128), (64, 256), (256, 64), (128, 192)]
CFG = ArmorConfig(block_size=16, optimizer="bcd", num_iters=20)
# wall-clock seconds per logged point differ between runs; everything else must be identical
COMPARED = ("a_blocks", "core", "b_blocks", "mask", "history", "history_iters")


def make_layers(n: int = 6, seed: int = 0) -> dict:
    """Deterministic synthetic layers ``{name: (weight, act_sq_norm)}``."""
    layers = {}
    for i, (d_out, d_in) in enumerate(SHAPES[:n]):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        w = torch.randn(d_out, d_in, generator=g)
        h = torch.rand(d_in, generator=g).pow(3) * 10 + 1e-2
        layers[f"model.layers.{i}.proj"] = (w, h)
    return layers


def stats_hash(layers: dict) -> str:
    return hash_statistics({k: h for k, (_, h) in layers.items()})


def assert_same_factors(a: ArmorFactors, b: ArmorFactors) -> None:
    for key in COMPARED:
        x, y = getattr(a, key), getattr(b, key)
        assert x.dtype == y.dtype and torch.equal(x, y), key
    assert (a.pattern, a.best_iter) == (b.pattern, b.best_iter)
    assert a.nowag_loss == b.nowag_loss


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: determinism needs the same thread count as the subprocesses, and small
    problems run faster single-threaded (2 threads on a busy 2-core machine: ~30x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------- hashing


def test_hash_statistics_ignores_order_and_sees_every_change():
    h = {"a": torch.arange(4.0), "b": torch.ones(3)}
    base = hash_statistics(h)
    assert base == hash_statistics({"b": torch.ones(3), "a": torch.arange(4.0)})
    assert base == hash_statistics({"a": LayerStatistics(torch.arange(4.0), 5), "b": LayerStatistics(torch.ones(3), 5)})
    changed = dict(h, a=torch.tensor([0.0, 1.0, 2.0, 3.0000002]))
    assert base != hash_statistics(changed)
    assert base != hash_statistics(dict(h, a=torch.arange(4.0).double()))
    assert base != hash_statistics(dict(h, a=torch.arange(4.0).reshape(2, 2)))
    assert base != hash_statistics({"a2": h["a"], "b": h["b"]})
    assert hash_tensors({"m": torch.tensor([True, False])}) != hash_tensors({"m": torch.tensor([False, True])})


def test_hash_statistics_rejects_non_tensors():
    with pytest.raises(ValueError, match="'x'.*act_sq_norm"):
        hash_statistics({"x": [1.0, 2.0]})


# ---------------------------------------------------------------------------- save / load


def test_save_load_roundtrip_is_exact_and_atomic(tmp_path):
    layers = make_layers(1)
    (name, (w, h)), = layers.items()
    factors = factorize(w, h, CFG)
    store = RunStore(tmp_path, CFG, "synthetic", stats_hash(layers))
    path = store.save(name, factors, seconds=1.5)
    assert path.parent == tmp_path / "layers" and path.name == f"{name}.safetensors"
    assert store.done(name)
    loaded = store.load(name)
    assert_same_factors(loaded, factors)
    assert torch.equal(loaded.history_time_s, factors.history_time_s)
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    entry = manifest["layers"][name]
    assert manifest["model_id"] == "synthetic" and manifest["stats_hash"] == stats_hash(layers)
    assert manifest["config"]["block_size"] == 16 and manifest["config"]["dtype"] == "torch.float32"
    assert entry["status"] == "done" and entry["shape"] == [128, 256] and entry["seconds"] == 1.5
    assert entry["bytes"] == path.stat().st_size and len(entry["sha256"]) == 64
    leftovers = [p.name for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    assert leftovers == []
    # a fresh store (another process, later) sees the same thing
    again = RunStore(tmp_path, CFG, "synthetic", stats_hash(layers))
    assert again.finished() == [name]
    assert_same_factors(again.load(name), factors)


def test_layer_names_map_to_files_inside_the_run(tmp_path):
    store = RunStore(tmp_path, CFG, "m", "h")
    w, h = make_layers(1)["model.layers.0.proj"]
    f = factorize(w, h, ArmorConfig(block_size=16, num_iters=1))
    for name in ("../escape", "a/b", ".hidden", "x" * 400):
        path = store.save(name, f)
        assert path.parent == tmp_path / "layers" and not path.name.startswith(".")
        assert store.load(name).core.shape == f.core.shape
    assert len(list((tmp_path / "layers").iterdir())) == 4


def test_load_of_unfinished_layer_says_so(tmp_path):
    store = RunStore(tmp_path, CFG, "m", "h")
    with pytest.raises(KeyError, match="not finished"):
        store.load("nope")


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
    store = RunStore(tmp_path, ArmorConfig(block_size=16, num_iters=1), "m", stats_hash(layers))
    out = factorize_layers(layers, store.config, store, progress=False, return_factors=False)
    assert out == {} and len(store.finished()) == 2


def test_kill_and_resume_gives_the_uninterrupted_result(tmp_path, one_thread):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        import torch
        torch.set_num_threads(1)
        sys.path.insert(0, {str(ROOT)!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_runstore import CFG, make_layers, stats_hash
        from torch_armor.engine.runstore import RunStore, factorize_layers

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


# ---------------------------------------------------------------------------- refusals


def test_other_config_is_refused_naming_the_fields(tmp_path):
    layers = make_layers(1)
    store = RunStore(tmp_path, CFG, "synthetic", stats_hash(layers))
    factorize_layers(layers, CFG, store, progress=False)
    other = ArmorConfig(block_size=32, optimizer="bcd", num_iters=20, seed=1)
    with pytest.raises(RunMismatchError) as info:
        RunStore(tmp_path, other, "synthetic", stats_hash(layers))
    message = str(info.value)
    assert "block_size: run has 16, now 32" in message and "seed: run has 0, now 1" in message
    assert "num_iters" not in message and "new run directory" in message
    # the device may change between resumes
    RunStore(tmp_path, ArmorConfig(block_size=16, optimizer="bcd", num_iters=20, device="cpu"), "synthetic",
             stats_hash(layers))


def test_other_model_or_statistics_is_refused(tmp_path):
    layers = make_layers(1)
    RunStore(tmp_path, CFG, "model-a", stats_hash(layers)).plan(layers)
    with pytest.raises(RunMismatchError, match="model_id: run has 'model-a', now 'model-b'"):
        RunStore(tmp_path, CFG, "model-b", stats_hash(layers))
    with pytest.raises(RunMismatchError, match="stats_hash.*calibration statistics differ"):
        RunStore(tmp_path, CFG, "model-a", stats_hash(make_layers(1, seed=1)))


def test_other_per_layer_settings_are_refused(tmp_path):
    layers = make_layers(2)
    store = RunStore(tmp_path, CFG, "m", stats_hash(layers))
    factorize_layers(layers, CFG, store, progress=False, per_layer_overrides={"model.layers.1.proj": {"block_size": 32}})
    assert store.load("model.layers.1.proj").block_size == 32
    assert store.layer_info("model.layers.1.proj")["config"]["group_updates"] == 16  # derived for 32
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


def test_unreadable_manifest_is_refused(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(RunMismatchError, match="cannot be read.*delete"):
        RunStore(tmp_path, CFG, "m", "h")
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(RunMismatchError, match="not a torch_armor run manifest"):
        RunStore(tmp_path, CFG, "m", "h")


def test_bad_arguments_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="model_id"):
        RunStore(tmp_path, CFG, "", "h")
    with pytest.raises(ValueError, match="hash_statistics"):
        RunStore(tmp_path, CFG, "m", None)
    with pytest.raises(ValueError, match="mapping"):
        factorize_layers([torch.randn(4, 4)], CFG)
    with pytest.raises(ValueError, match="not being factorized"):
        factorize_layers(make_layers(1), CFG, per_layer_overrides={"other": {"block_size": 32}})
    with pytest.raises(ValueError, match="unknown ArmorConfig fields"):
        factorize_layers(make_layers(1), CFG, per_layer_overrides={"model.layers.0.proj": {"blocksize": 32}})
    with pytest.raises(ValueError, match="distributed_factorize"):
        factorize_layers(make_layers(1), CFG, RunStore(tmp_path, CFG, "m", "h", rank=1))


# ---------------------------------------------------------------------------- damage


def test_damaged_layer_files_are_recomputed_with_a_warning(tmp_path, one_thread):
    layers = make_layers(3)
    names = list(layers)
    store = RunStore(tmp_path, CFG, "m", stats_hash(layers))
    reference = factorize_layers(layers, CFG, store, progress=False)

    flipped = store.layer_path(names[0])
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0xFF
    flipped.write_bytes(bytes(data))
    truncated = store.layer_path(names[1])
    truncated.write_bytes(truncated.read_bytes()[:100])

    fresh = RunStore(tmp_path, CFG, "m", stats_hash(layers))
    with pytest.warns(RuntimeWarning) as record:
        assert not fresh.done(names[0]) and not fresh.done(names[1])
    text = " ".join(str(w.message) for w in record)
    assert "sha256" in text and "bytes" in text and "recomputed" in text
    assert fresh.done(names[2])

    computed = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # already reported: no second warning
        out = factorize_layers(layers, CFG, fresh, progress=False, on_layer_done=lambda n, f: computed.append(n))
    assert computed == names[:2]
    for n in names:
        assert_same_factors(out[n], reference[n])
    assert RunStore(tmp_path, CFG, "m", stats_hash(layers)).finished() == names


def test_layer_file_without_manifest_entry_is_recomputed(tmp_path):
    """A kill between the layer's rename and the manifest's leaves an unlisted file: not done."""
    layers = make_layers(1)
    name = next(iter(layers))
    store = RunStore(tmp_path, CFG, "m", "h")
    store.plan(layers)
    before = (tmp_path / MANIFEST_NAME).read_bytes()
    store.save(name, factorize(*layers[name], CFG))
    (tmp_path / MANIFEST_NAME).write_bytes(before)
    fresh = RunStore(tmp_path, CFG, "m", "h")
    assert not fresh.done(name)
    assert fresh.layer_info(name)["status"] == "pending"


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


def test_auto_block_size_resolves_per_layer_and_resumes(tmp_path):
    layers = make_layers(2)
    cfg = ArmorConfig(block_size="auto", max_overhead=0.5, num_iters=2)
    first = factorize_layers(layers, cfg, RunStore(tmp_path, cfg, "m", stats_hash(layers)), progress=False)
    store = RunStore(tmp_path, cfg, "m", stats_hash(layers))
    for name, (w, _) in layers.items():
        want = cfg.for_layer(*w.shape).block_size
        assert first[name].block_size == want and store.layer_info(name)["config"]["block_size"] == want
    lazy = {name: (lambda v=v: v) for name, v in layers.items()}  # resumed: nothing recomputed, lazily given
    again = factorize_layers(lazy, cfg, store, progress=False)
    assert all(torch.equal(again[n].core, first[n].core) for n in layers)
