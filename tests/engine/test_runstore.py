"""The run store: atomic layer files, manifest identity checks, damaged files (the loop over it: test_layers)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from torch_armor import ArmorConfig
from torch_armor.config.armor import BcdConfig
from torch_armor.core.factorize import factorize
from torch_armor.core.factors import ArmorFactors
from torch_armor.calibration.observer import LayerStatistics
from torch_armor.armor.layers import factorize_layers
from torch_armor.engine.identity import hash_statistics, hash_tensors
from torch_armor.engine.runstore import MANIFEST_NAME, RunMismatchError, RunStore

SHAPES = [(128, 256), (256, 128), (128, 128), (64, 256), (256, 64), (128, 192)]
CFG = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=20))
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


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, no thread sync


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
    f = factorize(w, h, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1)))
    for name in ("../escape", "a/b", ".hidden", "x" * 400):
        path = store.save(name, f)
        assert path.parent == tmp_path / "layers" and not path.name.startswith(".")
        assert store.load(name).core.shape == f.core.shape
    assert len(list((tmp_path / "layers").iterdir())) == 4


def test_load_of_unfinished_layer_says_so(tmp_path):
    store = RunStore(tmp_path, CFG, "m", "h")
    with pytest.raises(KeyError, match="not finished"):
        store.load("nope")


# ---------------------------------------------------------------------------- refusals


def test_other_config_is_refused_naming_the_fields(tmp_path):
    layers = make_layers(1)
    store = RunStore(tmp_path, CFG, "synthetic", stats_hash(layers))
    factorize_layers(layers, CFG, store, progress=False)
    other = ArmorConfig(block_size=32, seed=1, optimizer=BcdConfig(iters=20))
    with pytest.raises(RunMismatchError) as info:
        RunStore(tmp_path, other, "synthetic", stats_hash(layers))
    message = str(info.value)
    assert "block_size: run has 16, now 32" in message and "seed: run has 0, now 1" in message
    assert "optimizer.iters" not in message and "new run directory" in message
    # the device may change between resumes
    RunStore(tmp_path, ArmorConfig(block_size=16, device="cpu", optimizer=BcdConfig(iters=20)), "synthetic",
             stats_hash(layers))


def test_other_model_or_statistics_is_refused(tmp_path):
    layers = make_layers(1)
    RunStore(tmp_path, CFG, "model-a", stats_hash(layers)).plan(layers)
    with pytest.raises(RunMismatchError, match="model_id: run has 'model-a', now 'model-b'"):
        RunStore(tmp_path, CFG, "model-b", stats_hash(layers))
    with pytest.raises(RunMismatchError, match="stats_hash.*calibration statistics differ"):
        RunStore(tmp_path, CFG, "model-a", stats_hash(make_layers(1, seed=1)))


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




def test_layer_files_are_byte_identical_across_saves(tmp_path):
    """Issue #14: the same layer saved twice gives the same bytes (safetensors' own writer orders
    the metadata by a randomly seeded hash map); the file still reads back exactly."""
    from torch_armor import ArmorConfig
    from torch_armor.config.armor import BcdConfig
    from torch_armor.core.factorize import factorize
    from torch_armor.engine.identity import hash_statistics
    from torch_armor.engine.runstore import RunStore

    g = torch.Generator().manual_seed(0)
    w, h = torch.randn(16, 32, generator=g), torch.rand(32, generator=g) + 0.1
    cfg = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2))
    f = factorize(w, h, cfg)
    blobs = []
    for i in range(3):
        store = RunStore(tmp_path / str(i), cfg, model_id="toy", stats_hash=hash_statistics({"fc": h}))
        blobs.append(store.save("fc", f).read_bytes())
        back = store.load("fc")
        assert torch.equal(back.core, f.core) and torch.equal(back.a_blocks, f.a_blocks)
    assert blobs[0] == blobs[1] == blobs[2]


# ---------------------------------------------------------------------------- any method's payload


def test_a_method_of_its_own_keeps_its_payload_in_the_run_store(tmp_path):
    """The store writes what the run's method gives it (``Method.to_store``) and reads it back with
    the method's ``from_store``: a payload type the engine has never heard of, bit-identical."""
    import dataclasses

    from torch_armor.config.methods import MethodConfig
    from torch_armor.engine.methods import METHODS, Method, register_method
    from torch_armor.engine.solution import StoredSolution
    from torch_armor.errors import ArmorInputError

    @dataclasses.dataclass(frozen=True)
    class StoredScaleConfig(MethodConfig):
        pattern: str = "2:4"

    @dataclasses.dataclass
    class StoredScale:  # a method's own result: a weight and a scale
        weight: torch.Tensor
        scale: float

    class StoredScaleMethod(Method):
        stores_layers = True

        def to_store(self, payload):
            return StoredSolution({"weight": payload.weight}, {"scale": repr(payload.scale)},
                                  {"shape": list(payload.weight.shape), "device": str(payload.weight.device)})

        def from_store(self, tensors, header):
            return StoredScale(tensors["weight"], float(header["scale"]))

    register_method(StoredScaleConfig, name="stored_scale", needs_statistics=False, kind=StoredScaleMethod)(
        lambda weight, stats, config, name="": StoredScale(weight, 0.5))
    try:
        weight = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
        store = RunStore(tmp_path, StoredScaleConfig(), "m", "h")
        store.save("fc", StoredScale(weight, 0.1), seconds=2.0)
        back = RunStore(tmp_path, StoredScaleConfig(), "m", "h").load("fc")
        assert isinstance(back, StoredScale) and torch.equal(back.weight, weight) and back.scale == 0.1
        entry = json.loads((tmp_path / MANIFEST_NAME).read_text())["layers"]["fc"]
        assert entry["shape"] == [8, 16] and entry["device"] == "cpu" and entry["seconds"] == 2.0
        with pytest.raises(ArmorInputError, match="'fc'.*ArmorFactors"):
            RunStore(tmp_path / "armor", CFG, "m", "h").save("fc", StoredScale(weight, 0.1))
    finally:
        METHODS.pop(StoredScaleConfig, None)
