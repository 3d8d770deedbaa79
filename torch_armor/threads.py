"""How many threads a command-line job uses when ``--threads`` is not given: the machine's physical cores,
fewer when other processes already keep some of them busy.

PyTorch's default (one thread per physical core) is right on an idle machine and badly wrong on a busy
one: its parallel regions wait for their slowest thread, so a thread that shares its core with another
process holds every region up (a prune on 2 cores at load 9-14 ran 3-30x slower than with one thread,
issue 47). The library itself never changes the thread count; the CLI calls :func:`choose_threads`.

Example::

    >>> choose_threads(physical=8, load=0.2)
    (8, None)
    >>> choose_threads(physical=2, load=1.1)[0]
    1
"""

from __future__ import annotations

import os
import time
from typing import Optional, Tuple

__all__ = ["physical_cores", "load_average", "choose_threads"]


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyper-threads counted once); the CPU count
    where ``/proc/cpuinfo`` does not say."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores, cpu, package = set(), None, "0"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key == "processor":
                    cpu = int(value)
                elif key == "physical id":
                    package = value
                elif key == "core id" and cpu in allowed:
                    cores.add((package, value))
    except (OSError, ValueError):
        cores = set()
    return len(cores) or len(allowed) or 1


def load_average(samples: int = 5, interval_s: float = 0.02) -> float:
    """How many other processes are running right now: the median over ``samples`` reads of the kernel's
    count of runnable tasks (``procs_running`` in ``/proc/stat``), this process not counted; the 1-minute
    load average where ``/proc`` does not say (it lags: a job that just ended still counts)."""
    counts = []
    for i in range(samples):
        try:
            with open("/proc/stat") as f:
                counts.extend(int(line.split()[1]) - 1 for line in f if line.startswith("procs_running"))
        except (OSError, ValueError, IndexError):
            break
        if i + 1 < samples:
            time.sleep(interval_s)
    if counts:
        return float(max(0, sorted(counts)[len(counts) // 2]))
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def choose_threads(physical: int, load: float) -> Tuple[int, Optional[str]]:
    """``(threads, why)``: one thread per physical core not already kept busy by ``load`` runnable
    processes, at least 1; ``why`` is a line to show when that is fewer than ``physical``, else ``None``."""
    busy = int(load + 0.5)
    threads = max(1, min(physical, physical - busy))
    if threads == physical:
        return threads, None
    return threads, (f"the machine is busy ({load:g} other processes running on {physical} physical cores): using "
                     f"{threads} thread{'s' if threads > 1 else ''} instead of {physical}; --threads N sets it")
