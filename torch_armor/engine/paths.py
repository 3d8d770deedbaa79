"""Where a prune may write: never over, or around, what it reads.

``check_prune_paths`` runs before any work: ``out`` (and the run and hidden-state directories),
with symlinks resolved, may not be or contain the input checkpoint; an existing file is not a
directory to write into.

Example::

    >>> import tempfile, os
    >>> with tempfile.TemporaryDirectory() as d:
    ...     check_prune_paths(inputs=[d], out=os.path.join(d, "pruned"))   # inside the input: allowed
    ...     try:
    ...         check_prune_paths(inputs=[d], out=d)
    ...     except ValueError as err:
    ...         print(str(err).split("=")[0])
    out
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, List, Optional, Union

from torch_armor._io import atomic_write, file_sha256
from torch_armor.errors import ArmorInputError
from torch_armor.format.armor_format import ARMOR_CONFIG_NAME

__all__ = ["check_prune_paths", "model_source_dirs", "mark_run_target", "mark_written", "resumes_into"]

TARGET_NAME = "target"
WRITTEN_NAME = "written"

PathLike = Union[str, "os.PathLike[str]"]


def model_source_dirs(model_or_path: Any) -> List[Path]:
    """Local directories a model was read from: the path itself, or a loaded model's ``name_or_path``."""
    if isinstance(model_or_path, (str, os.PathLike)):
        found = [model_or_path]
    else:
        found = [getattr(model_or_path, "name_or_path", None),
                 getattr(getattr(model_or_path, "config", None), "_name_or_path", None)]
    dirs = []
    for f in found:
        if isinstance(f, (str, os.PathLike)) and str(f) and Path(f).expanduser().is_dir():
            dirs.append(Path(f).expanduser())
    return dirs


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_prune_paths(inputs: Iterable[PathLike] = (), out: Optional[PathLike] = None,
                      run_dir: Optional[PathLike] = None, hidden_dir: Optional[PathLike] = None) -> None:
    """Refuse an output that is (or holds) an input, and an existing file given as a directory."""
    sources = [Path(p).expanduser().resolve() for p in inputs]
    for flag, target in (("out", out), ("run_dir", run_dir), ("hidden_dir", hidden_dir)):
        if target is None:
            continue
        path = Path(target).expanduser()
        if path.exists() and not path.is_dir():
            raise ArmorInputError(f"{flag}={path} exists and is not a directory; give a directory path")
        resolved = path.resolve()
        for src in sources:
            if _within(src, resolved):
                what = "is" if src == resolved else "contains"
                raise ArmorInputError(
                    f"{flag}={path} {what} the input checkpoint {src}: writing there would replace the model "
                    f"being read (also with overwrite=True); choose another directory"
                )


def mark_run_target(run_dir: PathLike, out: PathLike) -> None:
    """Record in the (locked) run directory the output it is writing, for :func:`resumes_into`."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write(Path(run_dir) / TARGET_NAME, str(Path(out).expanduser().resolve()).encode())


def mark_written(run_dir: PathLike, out: PathLike) -> None:
    """Record in the run directory which finished checkpoint it wrote into ``out`` (the sha256 of
    ``out/armor_config.json``, which lists every weights file's sha256), for :func:`resumes_into`."""
    atomic_write(Path(run_dir) / WRITTEN_NAME, file_sha256(Path(out) / ARMOR_CONFIG_NAME).encode())


def resumes_into(run_dir: PathLike, out: PathLike) -> bool:
    """Whether ``run_dir`` is an unfinished run that was writing ``out``, and ``out`` holds no finished
    checkpoint but the one this run wrote there: the same command may write into that non-empty ``out``
    again (it resumes, finishing only what is missing), never over another run's finished model."""
    run_dir, out = Path(run_dir), Path(out).expanduser()
    try:
        if (run_dir / TARGET_NAME).read_text() != str(out.resolve()):
            return False
        if not (out / ARMOR_CONFIG_NAME).is_file():
            return True
        return (run_dir / WRITTEN_NAME).read_text() == file_sha256(out / ARMOR_CONFIG_NAME)
    except OSError:
        return False
