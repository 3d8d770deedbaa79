"""Shared by the ``*_memory.py`` benchmarks: the peak resident memory of one call above what was
resident just before it (Linux: ``VmHWM`` reset through ``/proc/self/clear_refs``), and one
child process per implementation so that each peak is its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_above_resident(call: Callable[[], object]) -> int:
    """Bytes by which ``call()`` raised the resident set above its size when the call began."""
    Path("/proc/self/clear_refs").write_text("5")
    base = _status("VmRSS")
    call()
    return _status("VmHWM") - base


def run_each(script: str, argv, old: bool) -> None:
    """Re-run ``script`` as a child with ``--which new`` (and ``--which old`` when ``old``)."""
    for which in ("new", "old") if old else ("new",):
        subprocess.run([sys.executable, script, "--which", which, *argv], check=True)
