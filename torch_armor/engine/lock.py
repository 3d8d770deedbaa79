"""Ownership of a run directory, and of an output directory while it is written: one process at a time.

``run_lock(directory)`` takes an exclusive :func:`fcntl.flock` on ``directory/lock`` for as long as
the ``with`` block runs. The operating system drops the lock when the process dies (even by
SIGKILL), so a killed run never leaves a stale lock; the file only records the holder's PID for
the message a second process gets. The lock is re-entrant within one process (the command line
holds it around ``prune_model``, which takes it again).

``output_lock(directory)`` serializes the writers of one output directory: it locks the directory
itself (nothing is added to it) and a second writer waits for the first to finish.

Example::

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d, run_lock(d):
    ...     with run_lock(d):  # the same process may take it again
    ...         pass
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple, Union

from torch_armor.errors import ArmorInputError

__all__ = ["LOCK_NAME", "RunDirectoryBusy", "OutputBusy", "run_lock", "output_lock"]

LOCK_NAME = "lock"

_HELD: Dict[str, Tuple[int, int]] = {}  # resolved lock path -> (fd, depth) in this process


class RunDirectoryBusy(ArmorInputError):
    """Another live process holds the run directory."""


class OutputBusy(ArmorInputError):
    """Another process kept writing an output directory longer than a writer waits."""


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        return "another process"
    return f"process {text}" if text.isdigit() else "another process"


@contextlib.contextmanager
def run_lock(directory: Union[str, "os.PathLike[str]"]) -> Iterator[Path]:
    """Hold ``directory`` (created if missing) exclusively; a second process gets :class:`RunDirectoryBusy`."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    key = str(path.resolve())
    if key in _HELD:
        fd, depth = _HELD[key]
        _HELD[key] = (fd, depth + 1)
        try:
            yield path
        finally:
            fd, depth = _HELD[key]
            _HELD[key] = (fd, depth - 1)
        return
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirectoryBusy(
                f"run directory {root} is in use by {_holder(path)} (lock {path}); wait for it to finish, "
                "or give this run another run_dir= / out="
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:  # the holder removed the directory as we locked: take the new one
            same = False
        if same:
            break
        os.close(fd)
        root.mkdir(parents=True, exist_ok=True)
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _HELD[key] = (fd, 1)
    try:
        yield path
    finally:
        depth = _HELD[key][1] - 1
        if depth:
            _HELD[key] = (fd, depth)
        else:
            del _HELD[key]
            os.close(fd)  # drops the lock; the file stays (removing it would race a waiting process)


@contextlib.contextmanager
def output_lock(directory: Union[str, "os.PathLike[str]"], wait_s: float = 600.0,
                on_wait: Optional[Callable[[], None]] = None) -> Iterator[Path]:
    """Hold ``directory`` (created if missing) while writing into it: an exclusive :func:`fcntl.flock`
    on the directory itself, released when the block ends or the process dies. A second writer waits
    (``on_wait`` is called once when it starts waiting) up to ``wait_s`` seconds, then gets
    :class:`OutputBusy`."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, os.O_RDONLY)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                    on_wait = None
                if time.monotonic() > deadline:
                    raise OutputBusy(f"another process has been writing {root} for over {wait_s:.0f} s") from None
                time.sleep(0.05)
            except OSError:  # a file system without flock on directories: the caller's own checks still run
                break
        yield root
    finally:
        os.close(fd)
