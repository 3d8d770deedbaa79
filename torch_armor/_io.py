"""Crash-safe file writes and streamed file hashes, shared by the run store and the checkpoints.

:func:`atomic_write` writes to a temporary file in the target's directory (named
``.<name>.tmp-<pid>``: hidden, and recognizable by :data:`TMP_MARK` so stale ones can be
cleaned up), flushes and ``fsync``-s it, renames it over the target with ``os.replace``
(atomic on POSIX and Windows) and ``fsync``-s the directory. A crash (even ``SIGKILL`` or a
power cut) leaves either the old file or the new one, never a torn one; an error while writing
leaves the old file and removes the temporary one.

Example::

    >>> import os, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     path = os.path.join(d, "notes.txt")
    ...     atomic_write(path, b"first")
    ...     atomic_write(path, lambda fh: fh.write(b"second"))
    ...     open(path, "rb").read(), file_sha256(path) == hashlib.sha256(b"second").hexdigest()
    (b'second', True)
"""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import BinaryIO, Callable, Union

from torch_armor.errors import ArmorInputError

__all__ = ["RUN_DIR_NAME", "TMP_MARK", "STOP_AT_ENV", "atomic_write", "fsync_dir", "file_sha256", "temp_path",
           "stop_here_for_tests"]

#: Marks the temporary files of :func:`atomic_write`: ``.<name>.tmp-<pid>``.
TMP_MARK = ".tmp-"

PathLike = Union[str, "os.PathLike[str]"]
Writer = Callable[[BinaryIO], object]


#: The run directory inside ``out`` when none is given: kept while pruning (a rerun resumes from
#: it), removed after a successful save.
RUN_DIR_NAME = "armor_run"


def temp_path(path: PathLike) -> Path:
    """The temporary file :func:`atomic_write` uses for ``path`` in this process."""
    path = Path(path)
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def fsync_dir(path: PathLike) -> None:
    """``fsync`` a directory, so a rename or removal inside it survives a power cut.

    Does nothing where directories cannot be opened (e.g. Windows: a rename there is
    atomic anyway).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: PathLike, data_or_writer: Union[bytes, bytearray, memoryview, Writer]) -> None:
    """Replace ``path`` atomically by ``data_or_writer``: bytes, or a callable that gets the
    binary file handle and writes the content.

    Temp file in the same directory (:func:`temp_path`), flush, ``fsync``, ``os.replace``,
    ``fsync`` of the directory. On any error (the callable's too) the temp file is removed, the
    old file (if any) is left untouched and the error propagates.
    """
    if isinstance(data_or_writer, (bytes, bytearray, memoryview)):
        data = data_or_writer

        def write(fh: BinaryIO) -> None:
            fh.write(data)
    elif callable(data_or_writer):
        write = data_or_writer
    else:
        raise ArmorInputError(
            f"atomic_write needs bytes or a callable writing to the file handle, got {type(data_or_writer).__name__}"
        )
    path = Path(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def file_sha256(path: PathLike, chunk_size: int = 1 << 22) -> str:
    """Hex sha256 of a file's content, read in ``chunk_size`` pieces (never whole in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()


#: Test hook (read only by :func:`stop_here_for_tests`): ``TORCH_ARMOR_TEST_STOP_AT=<point>`` makes a process
#: stop itself (``SIGSTOP``) when it reaches that point of a save, so a test can kill it exactly there or let
#: it go on (``SIGCONT``). Points: ``"save"`` (a prune holding its output's lock, before it checks the output
#: again) and ``"first-shard-moved"`` (an assembly that has moved its first weights file into place).
STOP_AT_ENV = "TORCH_ARMOR_TEST_STOP_AT"


def stop_here_for_tests(point: str) -> None:
    """Stop this process at ``point`` when :data:`STOP_AT_ENV` names it (nothing otherwise)."""
    if os.environ.get(STOP_AT_ENV) == point and hasattr(signal, "SIGSTOP"):
        os.kill(os.getpid(), signal.SIGSTOP)
