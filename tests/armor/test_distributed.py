"""Sharding layers across ranks: LPT balance, and 2 CPU ranks (gloo) == one process, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from _helpers import free_port
from torch_armor.armor.distributed import distributed_factorize, layer_cost, shard_layers
from torch_armor.engine.topology import Topology, init_distributed
from torch_armor.armor.layers import factorize_layers
from torch_armor.engine.identity import hash_tensors
from torch_armor.engine.runstore import MANIFEST_NAME, RunStore

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))  # test_runstore's helpers
from test_runstore import CFG, assert_same_factors, make_layers, stats_hash  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, no thread sync


# ---------------------------------------------------------------------------- sharding


costs_strategy = st.dictionaries(st.text("abcdefgh.", min_size=1, max_size=6),
                                 st.floats(0, 1e6, allow_nan=False) | st.integers(0, 1000), max_size=40)


@settings(max_examples=200, deadline=None)
@given(costs=costs_strategy, world=st.integers(1, 9))
def test_shard_layers_assigns_each_layer_once_and_balances(costs, world):
    shards = shard_layers(costs, world)
    assert len(shards) == world
    flat = [n for shard in shards for n in shard]
    assert sorted(flat) == sorted(costs)  # every layer exactly once
    order = list(costs)
    for shard in shards:  # each shard keeps the input order
        assert shard == sorted(shard, key=order.index)
    loads = [sum(float(costs[n]) for n in shard) for shard in shards]
    if costs:  # list scheduling bound: busiest ≤ idlest + largest single job
        assert max(loads) <= min(loads) + max(float(c) for c in costs.values()) + 1e-6 * max(1.0, max(loads))
    # deterministic, and independent of the mapping's order
    assert shard_layers(dict(reversed(list(costs.items()))), world) == [sorted(s, key=lambda n: order[::-1].index(n))
                                                                       for s in shards]
    assert shard_layers(costs, world) == shards


def test_shard_layers_small_cases():
    assert shard_layers({}, 3) == [[], [], []]
    assert shard_layers({"a": 1.0}, 3) == [["a"], [], []]
    assert shard_layers({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, 2) == [["a", "c"], ["b", "d"]]
    # 7B-like decoder layer: three big MLP linears and four attention ones on 2 ranks
    costs = {n: layer_cost(s, 128) for n, s in [("q", (4096, 4096)), ("k", (4096, 4096)), ("v", (4096, 4096)),
                                                 ("o", (4096, 4096)), ("gate", (11008, 4096)),
                                                 ("up", (11008, 4096)), ("down", (4096, 11008))]}
    loads = [sum(costs[n] for n in s) for s in shard_layers(costs, 2)]
    assert max(loads) / min(loads) < 1.2


def test_shard_layers_rejects_bad_input():
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        shard_layers({"a": 1.0}, 0)
    with pytest.raises(ValueError, match="layer 'a': cost must be a finite number"):
        shard_layers({"a": float("nan")}, 2)
    with pytest.raises(ValueError, match="cost must be"):
        shard_layers({"a": -1.0}, 2)


def test_layer_cost():
    assert layer_cost(torch.empty(8, 16), 4) == 8 * 16 * 4
    with pytest.raises(ValueError, match="d_out, d_in"):
        layer_cost((8,), 4)
    with pytest.raises(ValueError, match="block_size"):
        layer_cost((8, 8), 0)


# ---------------------------------------------------------------------------- one process


def test_single_process_is_factorize_layers(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed() == Topology(0, 1, 0, False)
    layers = make_layers(3)
    reference = factorize_layers(layers, CFG, progress=False)
    out = distributed_factorize(layers, CFG, RunStore(tmp_path, CFG, "m", stats_hash(layers)), progress=False)
    for name in layers:
        assert_same_factors(out[name], reference[name])


def test_lazy_layers_need_costs():
    from torch_armor.armor.distributed import _costs_for

    layers = make_layers(2)
    lazy = {n: (lambda v=v: v) for n, v in layers.items()}
    configs = {n: CFG for n in layers}
    with pytest.raises(ValueError, match="given lazily.*costs="):
        _costs_for(list(lazy), lazy, configs, None)
    assert _costs_for(list(layers), layers, configs, None)["model.layers.0.proj"] == 128 * 256 * 16


# ---------------------------------------------------------------------------- two ranks


WORKER = """
import os, sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
from test_runstore import CFG, make_layers
from torch_armor.armor.distributed import distributed_factorize, layer_cost, shard_layers
from torch_armor.engine.topology import init_distributed
from torch_armor.engine.identity import hash_statistics, hash_tensors
from torch_armor.engine.runstore import RunStore

fresh, resumed, failing = sys.argv[1:4]
topo = init_distributed()  # the CLI's path: one group for every call
rank = topo.rank
layers = make_layers()
digest = hash_statistics({{n: h for n, (w, h) in layers.items()}})

def say(line):  # one write per line: two ranks share the pipe, and print() writes the newline apart
    sys.stdout.write(line + "\\n")
    sys.stdout.flush()

def report(tag):
    return lambda name, f: say(f"rank {{rank}} {{tag}} {{name}}")

def fingerprint(factors):
    keys = ("a_blocks", "core", "b_blocks", "mask", "history", "history_iters")
    return hash_tensors({{f"{{n}}/{{k}}": getattr(f, k) for n, f in factors.items() for k in keys}})

out = distributed_factorize(layers, CFG, RunStore(fresh, CFG, "synthetic", digest), progress=False,
                            on_layer_done=report("fresh"))
say(f"rank {{rank}} fresh-returned {{len(out)}} {{fingerprint(out) if rank == 0 else ''}}")

lazy = {{n: (lambda v=v: v) for n, v in layers.items()}}
costs = {{n: layer_cost(w.shape, CFG.block_size) for n, (w, h) in layers.items()}}
out = distributed_factorize(lazy, CFG, RunStore(resumed, CFG, "synthetic", digest), costs=costs, progress=False,
                            on_layer_done=report("resumed"))
say(f"rank {{rank}} resumed-returned {{len(out)}}")

bad = shard_layers(costs, 2)[1][0]  # a layer rank 1 gets
broken = dict(layers)
broken[bad] = (torch.full_like(layers[bad][0], float("nan")), layers[bad][1])
try:
    distributed_factorize(broken, CFG, RunStore(failing, CFG, "synthetic", digest), progress=False)
except Exception as err:  # named by its builtin kind: torch_armor's errors subclass ValueError, RuntimeError
    kind = next(c.__name__ for c in type(err).__mro__ if c.__module__ == "builtins")
    say(f"rank {{rank}} failing raised {{kind}}: {{err}}".replace("\\n", " "))
dist.destroy_process_group()
"""



def test_two_cpu_ranks_match_one_process_bit_for_bit(tmp_path):
    layers = make_layers()
    names = list(layers)
    reference = factorize_layers(layers, CFG, progress=False)
    fresh, resumed, failing = tmp_path / "fresh", tmp_path / "resumed", tmp_path / "failing"
    # the resumed run already holds two layers, from a single-process run that stopped early
    factorize_layers({n: layers[n] for n in names[:2]}, CFG, RunStore(resumed, CFG, "synthetic", stats_hash(layers)),
                     progress=False)

    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER.format(root=str(ROOT), tests=str(Path(__file__).parents[1] / "engine"))))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LOGLEVEL="WARNING")
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), str(fresh), str(resumed), str(failing)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln.split(" ", 3) for ln in proc.stdout.splitlines() if ln.startswith("rank ")]

    def by(tag):
        return [(int(r), rest) for _, r, t, rest in lines if t == tag]

    # fresh run: each layer computed exactly once, both ranks busy, rank 0 returns everything
    fresh_done = by("fresh")
    assert sorted(n for _, n in fresh_done) == sorted(names)
    assert {r for r, _ in fresh_done} == {0, 1}
    returned = dict(by("fresh-returned"))
    assert returned[0].split()[0] == "6" and int(returned[1]) == len([r for r, _ in fresh_done if r == 1])
    keys = ("a_blocks", "core", "b_blocks", "mask", "history", "history_iters")
    expected = hash_tensors({f"{n}/{k}": getattr(f, k) for n, f in reference.items() for k in keys})
    assert returned[0].split()[1] == expected
    store = RunStore(fresh, CFG, "synthetic", stats_hash(layers))
    assert sorted(store.finished()) == sorted(names)
    for name in names:
        assert_same_factors(store.load(name), reference[name])
    manifest = json.loads((fresh / MANIFEST_NAME).read_text())
    assert {e["rank"] for e in manifest["layers"].values()} == {0, 1}
    assert not list(fresh.glob("manifest.rank-*")) and not list(fresh.rglob("*.tmp-*"))

    # resumed run: only the four missing layers were computed, sharded; results identical
    assert sorted(n for _, n in by("resumed")) == sorted(names[2:])
    assert dict(by("resumed-returned"))[0] == "6"
    store = RunStore(resumed, CFG, "synthetic", stats_hash(layers))
    for name in names:
        assert_same_factors(store.load(name), reference[name])

    # a failure on rank 1 reaches rank 0 (no hang), and what finished is kept
    failures = dict(by("failing"))
    bad_layer = failures[1].split("'")[1]
    assert "ValueError" in failures[1] and "NaN" in failures[1]
    assert "RuntimeError: rank 1 failed" in failures[0] and "rerun the same command" in failures[0]
    failed_store = RunStore(failing, CFG, "synthetic", stats_hash(layers))
    assert len(failed_store.finished(names)) >= 1
    manifest = json.loads((failing / MANIFEST_NAME).read_text())  # rank 1's failure merged in
    assert manifest["layers"][bad_layer]["status"] == "failed" and not list(failing.glob("manifest.rank-*"))
