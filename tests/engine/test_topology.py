"""Where a process stands in a torchrun job: one process without a launcher, a clear refusal of a
half-set environment."""

from __future__ import annotations

import pytest

from torch_armor.engine.topology import Topology, init_distributed, launched_rank, launched_world_size


def test_a_plain_process_is_rank_0_of_1(monkeypatch):
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert init_distributed() == Topology(0, 1, 0, False)
    assert (launched_world_size(), launched_rank()) == (1, 0)


def test_world_size_without_launcher_says_use_torchrun(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node"):
        init_distributed()
