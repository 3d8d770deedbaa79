"""Property-based fuzzing of the public entry points (issue #14).

Property everywhere: a correct result (finite, the pattern exact, loss ≤ the NoWag-P start, a
loaded model equal to the saved one) or an exception of a documented type — ``ValueError`` (incl.
:class:`~torch_armor.errors.ArmorInputError`), :class:`~torch_armor.errors.ArmorError` — whose message
names what is at fault. Never an internal assert, a ``RuntimeError`` from deep inside torch, a
non-finite result or a silently wrong model. Derandomized (the same examples every run) and small.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._helpers import check_mask
from torch_armor import ArmorConfig
from torch_armor.config.armor import AdamConfig, BcdConfig, ReconstructConfig, RefineConfig
from torch_armor.engine.methods import config_for_method
from torch_armor.core.factorize import factorize
from torch_armor.config.levers import OPTIMIZERS
from torch_armor.core.proxy import nowag_prune, proxy_loss
from torch_armor.errors import ArmorError

FAST = settings(max_examples=30, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DOCUMENTED = (ValueError, ArmorError)


# --------------------------------------------------------------------------- factorize

@st.composite
def layers(draw):
    d_b = draw(st.sampled_from([4, 8]))
    d_out, d_in = d_b * draw(st.integers(1, 3)), d_b * draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    kind = draw(st.sampled_from(["plain", "scaled", "zero-rows", "zero-cols", "rank1", "sparse", "integers"]))
    if kind == "scaled":
        w = w * 10.0 ** draw(st.integers(-30, 30))
    elif kind == "zero-rows":
        w[: d_b] = 0
    elif kind == "zero-cols":
        w[:, : d_b] = 0
    elif kind == "rank1":
        w = torch.outer(w[:, 0], w[0])
    elif kind == "sparse":
        w = w * (torch.rand(d_out, d_in, generator=g, dtype=torch.float64) < 0.2)
    elif kind == "integers":
        w = w.round()
    h = torch.rand(d_in, generator=g, dtype=torch.float64) + draw(st.sampled_from([0.0, 0.1]))
    if draw(st.booleans()):
        h[: draw(st.integers(1, d_in))] = 0  # channels never active (maybe all of them: an error)
    h = h * 10.0 ** draw(st.integers(-20, 20))
    iters = draw(st.integers(0, 3))
    config = dict(block_size=d_b, optimizer=OPTIMIZERS[draw(st.sampled_from(["bcd", "adam"]))](iters=iters),
                  pattern=draw(st.sampled_from(["2:4", "1:4", "unstructured:0.5"])), dtype=draw(
                      st.sampled_from([torch.float32, torch.float64])))
    return w.to(dtype), h.to(dtype), config


@FAST
@given(layers())
def test_factorize_is_correct_or_a_clear_error(case):
    w, h, cfg = case
    try:
        f = factorize(w, h, ArmorConfig(**cfg), name="fuzz.layer")
    except DOCUMENTED as err:
        assert "fuzz.layer" in str(err), err
        return
    dense = f.dense().double()
    assert torch.isfinite(dense).all()
    assert check_mask(f.mask, cfg["pattern"])
    assert math.isfinite(f.relative_loss) and f.relative_loss <= 1 + 1e-4
    _, pruned = nowag_prune(w.double(), h.double(), cfg["pattern"])
    ref = float(proxy_loss(w.double(), pruned, h.double()))
    got = float(proxy_loss(w.double(), dense, h.double()))
    assert got <= ref * (1 + 1e-3) + 1e-12 * float(h.double().sum())


@FAST
@given(st.sampled_from(["meta", "int", "3d", "nan", "inf", "shape", "neg", "complex", "empty"]))
def test_factorize_bad_inputs_name_the_layer(kind):
    w, h = torch.randn(8, 8), torch.rand(8) + 0.1
    if kind == "meta":
        w = w.to("meta")
    elif kind == "int":
        w = w.to(torch.int32)
    elif kind == "3d":
        w = w[None]
    elif kind == "nan":
        w[0, 0] = float("nan")
    elif kind == "inf":
        h[0] = float("inf")
    elif kind == "shape":
        h = h[:4]
    elif kind == "neg":
        h[0] = -1
    elif kind == "complex":
        w = w.to(torch.complex64)
    elif kind == "empty":
        w = torch.empty(0, 8)
    with pytest.raises(DOCUMENTED, match="layer 'bad.proj'"):
        factorize(w, h, ArmorConfig(block_size=4, optimizer=BcdConfig(iters=1)), name="bad.proj")


# --------------------------------------------------------------------------- ArmorConfig

_FIELDS = ["block_size", "max_overhead", "pattern", "seed", "dtype", "optimizer", "refine", "reconstruct"]
_LEVERS = {BcdConfig: ["iters", "cg_steps", "group_updates", "ridge", "selection", "time_budget_s", "tol", "log_every"],
           AdamConfig: ["iters", "lr", "selection", "time_budget_s", "tol", "log_every"],
           RefineConfig: ["rounds", "cg_steps", "damp"], ReconstructConfig: ["steps", "lr"]}
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=8), st.sampled_from(["auto", "2:4", "bcd", "adam", "4:8", "unstructured:0.3",
                                                          torch.float16, torch.float32, "mixed", BcdConfig(),
                                                          AdamConfig(), RefineConfig(), ReconstructConfig()]))


@FAST
@given(st.dictionaries(st.sampled_from(_FIELDS), _VALUES, max_size=3))
def test_armor_config_valid_or_names_the_field(kwargs):
    try:
        cfg = ArmorConfig(**kwargs)
    except DOCUMENTED as err:
        assert any(field in str(err) for field in kwargs) or "pattern" in str(err), err
        return
    assert cfg == ArmorConfig(**kwargs)  # frozen, reproducible


@FAST
@given(st.sampled_from(sorted(_LEVERS, key=lambda k: k.__name__)), st.data())
def test_lever_config_valid_or_names_the_field(kind, data):
    kwargs = data.draw(st.dictionaries(st.sampled_from(_LEVERS[kind]), _VALUES, max_size=3))
    try:
        cfg = kind(**kwargs)
    except DOCUMENTED as err:
        assert any(f"{kind.__name__}.{field}" in str(err) for field in kwargs), err
        return
    assert cfg == kind(**kwargs) and ArmorConfig(**{_lever_of(kind): cfg}) is not None


def _lever_of(kind: type) -> str:
    return {BcdConfig: "optimizer", AdamConfig: "optimizer", RefineConfig: "refine", ReconstructConfig: "reconstruct"}[kind]


# --------------------------------------------------------------------------- sparsifier

@FAST
@given(st.integers(0, 2**31), st.sampled_from(["armor", "wanda", "sparsegpt", "magnitude", "nowag"]),
       st.sampled_from(["plain", "zeros", "huge", "masked"]))
def test_sparsifier_correct_or_clear(seed, method, inputs):
    from torch_armor.sparsifier import ArmorSparsifier

    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 16))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    config = ArmorConfig(block_size=4, optimizer=BcdConfig(iters=2)) if method == "armor" else config_for_method(method)
    sp = ArmorSparsifier(config, progress=False)
    sp.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
    x = torch.randn(2, 5, 16, generator=g)
    if inputs == "zeros":
        x = torch.zeros_like(x)
    elif inputs == "huge":
        x = x * 1e20
    try:
        if inputs == "masked":
            sp.set_attention_mask(torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]))
        with torch.no_grad():
            model(x)
        sp.step()
        sp.convert(model)  # one class: ArmorTensor weights for ARMOR, pruned dense weights for a baseline
    except DOCUMENTED as err:
        assert "0.weight" in str(err) or "'0'" in str(err) or "layer" in str(err), err
        return
    finally:
        sp.set_attention_mask(None)
    for idx in (0, 2):
        w = model[idx].weight
        dense = w.dense_weight() if hasattr(w, "dense_weight") else w.detach()
        assert torch.isfinite(dense).all()
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(3, 16, generator=g))).all()


# --------------------------------------------------------------------------- the CLI

_OPTIONS = {
    "--block-size": ["16", "0", "-3", "auto", "x"], "--max-overhead": ["0.05", "0", "nan", "-1"],
    "--iters": ["1", "-1", "x"], "--seed": ["0", str(2**70), "-5", "1.5"], "--device": ["cpu", "meta", "cuda:7", "nope"],
    "--dtype": ["bf16", "int3"], "--pattern": ["2:4", "5:4", "junk"], "--n-calib": ["0", "2"], "--seq-len": ["8", "-1"],
    "--layers": ["0-1", "(", "5-1"], "--method": ["wanda", "bogus"], "--time-budget": ["0", "1"],
}


@FAST
@given(st.sampled_from(["prune", "eval"]), st.sampled_from(["missing", "not-a-model", "file", "typo"]),
       st.dictionaries(st.sampled_from(sorted(_OPTIONS)), st.integers(0, 4), max_size=4))
def test_cli_argument_space(command, model_kind, picks):
    from torch_armor.cli.parser import main

    with tempfile.TemporaryDirectory() as d:
        model = {"missing": os.path.join(d, "nope"), "not-a-model": d, "file": os.path.join(d, "f.txt"),
                 "typo": "smolm2"}[model_kind]
        Path(d, "f.txt").write_text("x")
        argv = [command, model]
        if command == "prune":
            argv += ["--out", os.path.join(d, "out")]
        for opt, i in picks.items():
            if command == "eval" and opt not in ("--device", "--dtype", "--seq-len"):
                continue
            argv += [opt, _OPTIONS[opt][i % len(_OPTIONS[opt])]]
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse: a usage error, status 2
            assert exc.code == 2
            return
        assert code == 2  # every model here is bad: a one-line error


# --------------------------------------------------------------------------- load_pretrained

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from torch_armor.sparsifier import ArmorSparsifier
    from torch_armor.format.serialization import save_pretrained

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8))
    sp = ArmorSparsifier(ArmorConfig(block_size=4, optimizer=BcdConfig(iters=1)), progress=False)
    sp.prepare(model, [{"tensor_fqn": "0.weight"}])
    model(torch.randn(4, 16))
    sp.step()
    sp.convert(model)
    folder = tmp_path_factory.mktemp("saved")
    save_pretrained(model, folder)
    x = torch.randn(3, 16)
    return folder, x, model(x).detach()


def _fresh():
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8))


@FAST
@given(st.sampled_from(["truncate", "flip", "delete", "json", "extra-pickle", "rename"]), st.integers(0, 2**31))
def test_load_pretrained_on_corrupted_directories(saved, how, seed):
    import random
    import shutil

    from torch_armor.format.serialization import load_pretrained

    folder, x, expected = saved
    rnd = random.Random(seed)
    with tempfile.TemporaryDirectory() as d:
        target = Path(d) / "ckpt"
        shutil.copytree(folder, target)
        files = sorted(p for p in target.iterdir() if p.is_file())
        victim = rnd.choice(files)
        data = victim.read_bytes()
        if how == "truncate":
            victim.write_bytes(data[: rnd.randrange(len(data))])
        elif how == "flip":
            i = rnd.randrange(len(data))
            victim.write_bytes(data[:i] + bytes([data[i] ^ (1 << rnd.randrange(8))]) + data[i + 1:])
        elif how == "delete":
            victim.unlink()
        elif how == "json":
            cfg = target / "armor_config.json"
            obj = json.loads(cfg.read_text())
            key = rnd.choice(sorted(obj))
            obj[key] = rnd.choice([None, 0, "x", [], {}])
            cfg.write_text(json.dumps(obj))
        elif how == "extra-pickle":
            (target / "pytorch_model.bin").write_bytes(b"\x80\x04")
        elif how == "rename":
            victim.rename(target / ("x" + victim.name))
        try:
            model = load_pretrained(target, _fresh())
        except DOCUMENTED as err:
            assert str(target) in str(err) or "armor_config" in str(err) or victim.name in str(err), err
            return
        # loaded: it must be the saved model, exactly
        torch.testing.assert_close(model(x).detach(), expected, rtol=0, atol=0)
