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

import json
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Union

from torch import nn

from torch_armor._io import atomic_write
from torch_armor.errors import ArmorInputError

__all__ = ["evaluate", "require_lm_eval", "results_table", "write_results", "parse_tasks", "PAPER_TASKS"]

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
    from lm_eval.tasks import TaskManager  # optional extra, as above

    names = parse_tasks(tasks)
    if include_path is not None and not isinstance(include_path, (list, tuple)):
        include_path = [include_path]
    paths = [str(p) for p in include_path or ()]
    for p in paths:
        if not Path(p).is_dir():
            raise ArmorInputError(f"include_path={p}: not a directory of task YAMLs")
    # the harness's own index (thousands of YAMLs) takes seconds to build: skip it when the
    # include paths hold every task asked for
    manager = TaskManager(include_path=paths, include_defaults=False) if paths else None
    if manager is None or any(t not in manager.all_tasks for t in names):
        manager = TaskManager(include_path=paths or None)
    unknown = [t for t in names if t not in manager.all_tasks and not Path(t).is_file()]
    if unknown:
        raise ArmorInputError(
            f"tasks={','.join(names)}: lm-evaluation-harness knows no task {', '.join(unknown)}; check the names "
            "(lm-eval ls tasks) or add the directory of your task YAML to include_path="
        )
    with _quiet_wrapper_warning():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    return lm_eval.simple_evaluate(
        model=lm, tasks=names, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
        log_samples=log_samples, bootstrap_iters=bootstrap_iters, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=seed,
    )


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
