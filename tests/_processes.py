"""Real ``torch-armor`` processes for the tests that stop, resume or kill one mid-save.

:func:`start_cli` runs ``python -m torch_armor ARGS`` on the torch_armor under test; with ``stop_at`` the
process stops itself (``SIGSTOP``) on reaching that point of its save: the test-only environment variable
``TORCH_ARMOR_TEST_STOP_AT``, read in one place, :func:`torch_armor._io.stop_here_for_tests` (points
``"save"`` and ``"first-shard-moved"``). :func:`wait_stopped` waits until it has stopped there; the test
then sends ``SIGCONT`` or ``SIGKILL``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch_armor

STOP_AT_ENV = "TORCH_ARMOR_TEST_STOP_AT"
CODE = Path(torch_armor.__file__).resolve().parents[1]  # the checkout whose torch_armor these tests import


def start_cli(args: list, log: Path, stop_at: Optional[str] = None) -> subprocess.Popen:
    """``python -m torch_armor *args`` with its stderr in ``log`` (a file: a stopped process cannot fill a pipe)."""
    env = dict(os.environ, PYTHONPATH=str(CODE), OMP_NUM_THREADS="1")
    env.pop(STOP_AT_ENV, None)
    env.pop("TORCH_ARMOR_DEBUG", None)
    if stop_at is not None:
        env[STOP_AT_ENV] = stop_at
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "torch_armor", *map(str, args)], env=env, cwd=log.parent,
                                stdout=subprocess.DEVNULL, stderr=err)


def wait_stopped(proc: subprocess.Popen, log: Path) -> None:
    """Until ``proc`` has stopped itself; an error with its stderr if it ended instead."""
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"the process ended (status {status}) without stopping: {log.read_text()[-2000:]}"
