"""Zero-shot accuracy with lm-evaluation-harness (the ``eval`` extra: ``pip install 'torch_armor[eval]'``).

:func:`evaluate` runs ``lm_eval.simple_evaluate`` over a model already in memory — an ARMOR
model from ``prune_model`` or ``from_pretrained``, or any causal LM — wrapped in the harness's
``HFLM``, so the harness scores exactly the model you hold (no reload, no second copy). Tasks are
the harness's (``arc_easy``, ``hellaswag``…: their datasets come from the Hugging Face hub) or
your own task YAMLs in ``include_path`` directories.

The paper's seven zero-shot tasks::

    torch-armor eval runs/smollm2-armor --tasks arc_challenge,arc_easy,boolq,hellaswag,openbookqa,rte,winogrande

Example::

    >>> results = evaluate(model, tokenizer, ["arc_easy"], limit=100)        # doctest: +SKIP
    >>> results["results"]["arc_easy"]["acc,none"]                           # doctest: +SKIP
    0.43
"""

from __future__ import annotations

import functools
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple, Union

from torch import nn

from torch_armor._io import atomic_write
from torch_armor.errors import ArmorInputError

__all__ = ["evaluate", "require_lm_eval", "results_table", "write_results", "parse_tasks", "PAPER_TASKS",
           "check_tasks", "task_datasets", "missing_task_data", "OFFLINE_HINT"]

#: The zero-shot tasks of the ARMOR paper's accuracy tables.
PAPER_TASKS = ("arc_challenge", "arc_easy", "boolq", "hellaswag", "openbookqa", "rte", "winogrande")

INSTALL_HINT = "pip install 'torch_armor[eval]'"


def require_lm_eval() -> None:
    """Raise :class:`~torch_armor.errors.ArmorInputError` (one line naming the extra) if the
    harness is not installed."""
    try:
        import lm_eval  # noqa: F401
        from lm_eval.models.huggingface import HFLM  # noqa: F401
    except ImportError as err:
        raise ArmorInputError(
            f"evaluating tasks= needs lm-evaluation-harness, which is not installed ({err}); {INSTALL_HINT}"
        ) from None


def parse_tasks(tasks: Union[str, Sequence[str]]) -> list:
    """Task names from ``"t1,t2"`` or a list (blanks dropped).

    Example::

        >>> parse_tasks("arc_easy, boolq,")
        ['arc_easy', 'boolq']
    """
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    names = [str(t).strip() for t in names if str(t).strip()]
    if not names:
        raise ArmorInputError("tasks= names no task; give harness task names, e.g. tasks=arc_easy,boolq")
    return names


@contextmanager
def _quiet_wrapper_warning() -> Iterator[None]:
    # HFLM warns that "many arguments are ignored" whenever it is handed a model object: that is
    # the point here, so that one logger is silenced while the wrapper is built.
    logger = logging.getLogger("lm_eval.models.huggingface")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def evaluate(
    model: nn.Module,
    tokenizer: Any,
    tasks: Union[str, Sequence[str]],
    *,
    include_path: Union[str, Path, Sequence[Union[str, Path]], None] = None,
    num_fewshot: Optional[int] = None,
    limit: Union[int, float, None] = None,
    batch_size: int = 1,
    log_samples: bool = False,
    bootstrap_iters: int = 1000,
    seed: int = 0,
) -> Dict[str, Any]:
    """Run lm-evaluation-harness ``tasks`` on ``model`` (in memory) and return the harness's result dict.

    Args:
        model: a causal LM (``transformers.PreTrainedModel``), e.g. an ARMOR model; evaluated
            where it is, in its dtype.
        tokenizer: its tokenizer.
        tasks: harness task names (a list or ``"t1,t2"``), also groups and tags.
        include_path: directories (or one) of extra task YAMLs, e.g. your own local tasks.
        num_fewshot: few-shot examples (default: each task's own, zero for the paper's tasks).
        limit: evaluate only the first ``limit`` documents of each task (a float: that fraction).
        batch_size: requests per forward pass.
        log_samples: keep every document's requests and scores under ``"samples"``.
        bootstrap_iters: bootstrap resamples for the standard errors (0: none).
        seed: the harness's random, numpy, torch and few-shot seeds.

    Returns:
        ``lm_eval.simple_evaluate``'s dict: ``results[task]["acc,none"]``, ``"acc_norm,none"``…,
        plus the configs and versions the harness records.

    Raises:
        ArmorInputError: lm-evaluation-harness is not installed (``pip install 'torch_armor[eval]'``),
            no task is named, or a task is unknown to the harness.
    """
    require_lm_eval()
    import lm_eval  # optional extra (eval): imported only when used
    from lm_eval.models.huggingface import HFLM  # optional extra, as above

    names = parse_tasks(tasks)
    manager = _task_manager(names, _include_paths(include_path))
    with _quiet_wrapper_warning():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    return lm_eval.simple_evaluate(
        model=lm, tasks=names, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
        log_samples=log_samples, bootstrap_iters=bootstrap_iters, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=seed,
    )


def _include_paths(include_path: Union[str, Path, Sequence[Union[str, Path]], None]) -> Tuple[str, ...]:
    if include_path is not None and not isinstance(include_path, (list, tuple)):
        include_path = [include_path]
    paths = tuple(str(p) for p in include_path or ())
    for p in paths:
        if not Path(p).is_dir():
            raise ArmorInputError(f"include_path={p}: not a directory of task YAMLs")
    return paths


def _task_manager(names: Sequence[str], paths: Tuple[str, ...]) -> Any:
    """The harness's task index for ``names`` (refusing unknown names), built once per include paths."""
    manager = _index(paths, False) if paths else None  # the include paths alone, when they hold every task
    if manager is None or any(t not in manager.all_tasks for t in names):
        manager = _index(paths, True)
    unknown = [t for t in names if t not in manager.all_tasks and not Path(t).is_file()]
    if unknown:
        raise ArmorInputError(
            f"tasks={','.join(names)}: lm-evaluation-harness knows no task {', '.join(unknown)}; check the names "
            "(lm-eval ls tasks) or add the directory of your task YAML to include_path="
        )
    return manager


@functools.lru_cache(maxsize=4)
def _index(paths: Tuple[str, ...], defaults: bool) -> Any:
    """lm-evaluation-harness's task index (thousands of YAMLs: seconds to build, so built once)."""
    from lm_eval.tasks import TaskManager  # optional extra (eval): imported only when used

    if not defaults:
        return TaskManager(include_path=list(paths), include_defaults=False)
    return TaskManager(include_path=list(paths) or None)


#: dataset builders that read local files (``data_files``), never the hub
_LOCAL_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow", "pandas"})

OFFLINE_HINT = ("run it once where the Hugging Face hub can be reached (that fills the cache), then offline "
                "with HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1, or copy a filled ~/.cache/huggingface here "
                "(HF_HOME=DIR points at it), or give your own task YAMLs with local data_files (include_path=)")


def task_datasets(manager: Any, names: Sequence[str]) -> Dict[str, Tuple[str, Optional[str]]]:
    """``{task: (dataset_path, dataset_name)}`` of every task behind ``names`` (groups and tags expanded)."""
    out: Dict[str, Tuple[str, Optional[str]]] = {}
    index = manager.task_index
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen or name not in index:
            continue
        seen.add(name)
        cfg = index[name].cfg or {}
        if cfg.get("dataset_path"):
            out[name] = (str(cfg["dataset_path"]), cfg.get("dataset_name"))
        members = cfg.get("task")
        todo += [m for m in (members if isinstance(members, list) else []) if isinstance(m, str)]
        if not cfg:  # a tag: every task that carries it
            todo += [n for n, entry in index.items() if name in entry.tags]
    return out


def missing_task_data(datasets: Dict[str, Tuple[str, Optional[str]]], online: bool,
                      cache_dirs: Sequence[Path]) -> Optional[str]:
    """One line naming the tasks whose data can be had neither from the hub (``online``) nor from a local
    file or cache (``cache_dirs``: the datasets and the hub caches), and how to run offline; ``None`` when
    every task's data is at hand.

        >>> missing_task_data({"arc_easy": ("allenai/ai2_arc", "ARC-Easy")}, online=False, cache_dirs=[])[:51]
        'tasks=arc_easy: its data (allenai/ai2_arc ARC-Easy)'
    """
    if online:
        return None

    def cached(path: str) -> bool:
        if path in _LOCAL_BUILDERS or Path(path).expanduser().exists():
            return True
        folders = (path.replace("/", "___"), "datasets--" + path.replace("/", "--"))
        return any((Path(d) / f).exists() for d in cache_dirs for f in folders)

    missing = {task: data for task, data in datasets.items() if not cached(data[0])}
    if not missing:
        return None
    names = ", ".join(sorted(missing))
    data = ", ".join(sorted({" ".join(p for p in d if p) for d in missing.values()}))
    its = "its data" if len(missing) == 1 else "their data"
    return (f"tasks={names}: {its} ({data}) is not in the local cache and the Hugging Face hub cannot be "
            f"reached from here; {OFFLINE_HINT}")


def check_tasks(tasks: Union[str, Sequence[str]],
                include_path: Union[str, Path, Sequence[Union[str, Path]], None] = None) -> list:
    """Before a model is loaded: the harness is installed, every task is known and its data can be had
    (the hub answers, or it is a local file or cached). Returns the task names.

    Raises:
        ArmorInputError: one line: the extra to install, the unknown names, or the tasks whose data
            cannot be had and how to run offline (:data:`OFFLINE_HINT`).
    """
    require_lm_eval()
    from datasets import config as datasets_config  # a dependency; only when tasks are checked
    from huggingface_hub import constants as hub_constants  # transformers' dependency, as above

    from torch_armor.recipes.models import hub_reachable  # loads transformers: only when tasks are checked

    names = parse_tasks(tasks)
    manager = _task_manager(names, _include_paths(include_path))
    offline = any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
                  for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    problem = missing_task_data(task_datasets(manager, names), online=not offline and hub_reachable(),
                                cache_dirs=[Path(datasets_config.HF_DATASETS_CACHE), Path(hub_constants.HF_HUB_CACHE)])
    if problem:
        raise ArmorInputError(problem)
    return names


def results_table(results: Dict[str, Any]) -> str:
    """The harness's own markdown table of ``results`` (and of its groups, if any)."""
    from lm_eval.utils import make_table  # optional extra, as above

    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table


def write_results(results: Dict[str, Any], path: Union[str, Path]) -> Path:
    """Write ``results`` as JSON (what the harness could not serialize as text); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps(results, indent=2, default=str) + "\n").encode())
    return path
