"""The CLI's thread count: one per physical core, fewer on a busy machine, the user's setting untouched."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
from hypothesis import given, strategies as st

from torch_armor.cli import commands as cli_commands
from torch_armor.threads import choose_threads, load_average, physical_cores


@given(physical=st.integers(1, 256), load=st.floats(0, 1000), more=st.floats(0, 100))
def test_threads_fit_the_idle_cores_and_fall_as_the_load_rises(physical, load, more):
    threads, why = choose_threads(physical, load)
    assert 1 <= threads <= physical
    assert threads >= choose_threads(physical, load + more)[0]  # never more threads on a busier machine
    assert (why is None) == (threads == physical)
    if why:
        assert f"using {threads} thread" in why and "--threads" in why


def test_idle_and_saturated_machines():
    assert choose_threads(2, 0.0) == (2, None)
    assert choose_threads(2, 0.4) == (2, None)
    assert choose_threads(2, 0.6)[0] == 1  # one core kept busy by another process
    assert choose_threads(2, 12.0)[0] == 1
    assert choose_threads(16, 3.2)[0] == 13


def test_physical_cores_counts_cores_not_hyperthreads():
    cores = physical_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))


def test_a_busy_loop_in_another_process_is_seen():
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 20: pass"])
    try:
        time.sleep(0.5)
        assert load_average() >= 1  # at least the spinner (this process is not counted)
    finally:
        spinner.kill()


def test_setup_applies_the_choice_and_says_why(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cli_commands, "physical_cores", lambda: 2)
    args = argparse.Namespace(threads=None, no_progress=True)
    monkeypatch.setattr(cli_commands, "load_average", lambda: 7.0)
    cli_commands.setup(args)
    assert torch.get_num_threads() == 1
    assert "the machine is busy (7 other processes running on 2 physical cores): using 1 thread" in capsys.readouterr().err
    monkeypatch.setattr(cli_commands, "load_average", lambda: 0.0)
    cli_commands.setup(args)
    assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's own setting: left alone, nothing said
    torch.set_num_threads(2)
    monkeypatch.setattr(cli_commands, "load_average", lambda: 7.0)
    cli_commands.setup(args)
    assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""
    cli_commands.setup(argparse.Namespace(threads=1, no_progress=True))
    assert torch.get_num_threads() == 1
