"""A prune stopped by SIGINT / SIGTERM: one line saying how far it got and how to resume.

``prune_model`` turns a :class:`KeyboardInterrupt` (SIGINT, or SIGTERM at the command line, which
installs :func:`terminate_as_interrupt`) into :class:`PruneInterrupted` — still a
``KeyboardInterrupt`` — whose message counts the blocks whose results are on disk. Every file of
the run directory is written atomically, so what is there is consistent and a rerun resumes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Iterator, Optional

from safetensors import safe_open
__all__ = ["PruneInterrupted", "Terminated", "terminate_as_interrupt", "interrupted_line", "interrupted_message", "blocks_on_disk"]


class PruneInterrupted(KeyboardInterrupt):
    """A prune stopped by a signal; ``str()`` is the one-line message, ``signum`` the signal."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = int(signum)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so every ``finally`` runs (the command line installs it)."""

    signum = int(signal.SIGTERM)


def _raise_terminated(signum, frame):  # noqa: ARG001
    raise Terminated()


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM raises :class:`Terminated` (main thread only; the old handler comes back after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted_line(err: BaseException) -> str:
    """The command line's one line for an interrupt."""
    if isinstance(err, PruneInterrupted):
        return str(err)
    return "interrupted; finished layers are kept in the run directory, rerun the same command to resume"


def blocks_on_disk(run_dir: Optional[Path], n_blocks: int) -> int:
    """Leading decoder blocks whose results the run directory holds (hidden states or block shards)."""
    if run_dir is None:
        return 0
    done = 0
    hidden = run_dir / "hidden.safetensors"
    if hidden.is_file():
        try:
            with safe_open(str(hidden), framework="pt") as fh:
                done = int((fh.metadata() or {}).get("block", 0))
        except Exception:  # noqa: BLE001 - a count for a message only
            done = 0
    shards = run_dir / "blocks"
    while done < n_blocks and (shards / f"block-{done:05d}.safetensors").is_file():
        done += 1
    return min(done, n_blocks)


def interrupted_message(err: BaseException, run_dir: Optional[Path], n_blocks: int) -> PruneInterrupted:
    signum = getattr(err, "signum", signal.SIGINT)
    done = blocks_on_disk(run_dir, n_blocks)
    if run_dir is None:
        return PruneInterrupted(f"interrupted after block {done} of {n_blocks}; nothing was kept (pass run_dir "
                                "to make a prune resumable)", signum)
    return PruneInterrupted(f"interrupted after block {done} of {n_blocks}; rerun the same command to resume from "
                            f"{run_dir}", signum)
