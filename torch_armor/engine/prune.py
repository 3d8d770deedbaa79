"""``prune_model``: the one entry point — a model (or a checkpoint directory), calibration token
ids and a method config to a pruned model and a :class:`~torch_armor.engine.report.PruneReport`.

The config's type is the method (:mod:`torch_armor.engine.methods`); how the run is carried out
(where to save, resume, which device, …) is one :class:`PruneOptions`. Plan, then execute: every check
and decision is made once, before any layer is pruned, as a :class:`~torch_armor.engine.plan.PrunePlan`
(:func:`~torch_armor.engine.plan.plan_prune`: the layers and their settings, the weights left dense,
the output and run directories, the device); :func:`execute` runs it (``torchrun``'s process group,
the run directory's lock and store, the block pass, the save). The command line (``torch-armor
prune``) only builds these objects, runs the plan's path checks
(:func:`~torch_armor.engine.plan.check_paths`) before its slow model load, then plans and executes.

Example (a tiny random model; pruned in place)::

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from torch_armor.config.armor import ArmorConfig, BcdConfig
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    >>> model = LlamaForCausalLM(cfg).eval()
    >>> calib = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    >>> report = prune_model(model, calib, ArmorConfig(optimizer=BcdConfig(iters=2)),
    ...                      options=PruneOptions(progress=False))
    >>> len(report.layers), type(model.model.layers[1].mlp.up_proj.weight).__name__
    (14, 'DenseArmorTensor')
"""

from __future__ import annotations

import logging
import shutil
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence, Union

import contextlib
import dataclasses

import torch.distributed as dist
from torch import nn

from torch_armor._io import stop_here_for_tests
from torch_armor.calibration.selection import LayerSelection
from torch_armor.engine.batches import hash_batches
from torch_armor.engine.blocks import BLOCKS_DIR, BlockPipeline
from torch_armor.engine.topology import init_distributed
from torch_armor.engine.fit import uncalled_warning
from torch_armor.engine.experts import dense_lines, routed_token_lines, with_dense_layers
from torch_armor.engine.identity import identity_string
from torch_armor.engine.interrupt import interrupted_message
from torch_armor.engine.lock import OutputBusy, output_lock, run_lock
from torch_armor.engine.methods import ModelPassRun, RunState
from torch_armor.engine.options import RUN_DIR_NAME, PathLike, PruneOptions, out_contents
from torch_armor.engine.plan import PrunePlan, plan_prune
from torch_armor.engine.paths import mark_run_target, mark_written, resumes_into
from torch_armor.engine.report import PruneReport
from torch_armor.engine.runstore import RunStore
from torch_armor.engine.sources import ShardWriter
from torch_armor.errors import ArmorError, ArmorInputError, write_failed
from torch_armor.format.hf import attach_quantizer
from torch_armor.format.serialization import save_pretrained

__all__ = ["prune_model", "execute", "PruneOptions", "RUN_DIR_NAME"]

logger = logging.getLogger("torch_armor")

#: Where a run keeps its pruned model (in its run directory) when another process wrote ``out`` first.
KEPT_NAME = "pruned"


def _save_output(write: Callable[[Path], None], out: Path, overwrite: bool, resuming: bool, allowed: Sequence[str],
                 run_path: Path, log: Callable[[str], None]) -> None:
    """``write(out)``, one writer at a time, with ``out`` checked again under the lock: it was new or empty
    (or this run's own, ``resuming``) when the prune began, but another process may have written there
    since. Then this run's model goes to ``run_path/pruned`` instead, and an error says so (without
    ``overwrite``, another run's finished model in ``out`` is never replaced)."""
    try:
        with output_lock(out, on_wait=lambda: log(f"waiting for out={out}: another process is writing it")):
            stop_here_for_tests("save")
            found = out_contents(out, allowed)
            if overwrite or not found or (resuming and resumes_into(run_path, out)):
                write(out)
                mark_written(run_path, out)
                return
        why = (f"another process wrote {[p.name for p in found[:3]]} there while this one pruned (it was new or "
               "empty when this one began)")
    except OutputBusy as err:
        why = str(err)
    kept = run_path / KEPT_NAME
    write(kept)
    raise ArmorInputError(f"out={out}: {why}, so nothing of this run was written there; its pruned model is saved "
                          f"in {kept} instead: move it where you want it, or rerun the same call with overwrite=True "
                          "to replace what out= holds")


def prune_model(
    model_or_path: Union[nn.Module, PathLike],
    calibration: Any,
    config: Any = None,
    *,
    layers: LayerSelection = None,
    options: PruneOptions = PruneOptions(),
) -> PruneReport:
    """Prune every linear of the decoder blocks, block by block, with ``config``'s method.

    Args:
        model_or_path: a model (pruned in place), or a local Hugging Face checkpoint directory
            (``config.json`` + safetensors, sharded or not): built on the meta device and streamed
            one decoder block at a time — peak memory about one block plus the calibration hidden
            states; needs ``options.out``.
        calibration: ``(n_windows, seq_len)`` token ids (:func:`torch_armor.recipes.data.calibration_windows`)
            or a list of ``(batch, seq_len)`` tensors; with padding, ``{"input_ids", "attention_mask"}``
            or ``(ids, mask)`` (or a list of them): pad positions are left out of every statistic.
        config: the method and its settings: :class:`~torch_armor.config.armor.ArmorConfig` (``None``:
            its defaults, ``ArmorConfig()``) or a baseline's (:class:`~torch_armor.config.methods.SparseGPTConfig`, ``WandaConfig``,
            ``NoWagConfig``, ``MagnitudeConfig``).
        layers: the linears to prune: names, a selection such as ``"0-3"`` (decoder block indices)
            or a regular expression, or a predicate ``(name, module) -> bool``
            (:func:`~torch_armor.calibration.selection.select_layers`); default: every decoder linear.
            A linear whose weight several decoder layers share (Zamba's shared transformer block)
            stays dense, with one warning and its reason in ``PruneReport.dense_weights``
            (:func:`~torch_armor.calibration.selection.shared_across_blocks`).
        options: :class:`PruneOptions` (output, run directory, device, …).

    Raises:
        ArmorInputError: bad arguments, a layer outside the decoder blocks, with
            ``options.strict`` a layer the settings do not fit (block size, pattern; otherwise it gets
            a smaller block size or stays dense, with one warning: :mod:`torch_armor.engine.fit`), a
            layer whose weight is on the meta device — every layer is checked before any is pruned —, a non-empty ``out``, a run directory of another run
            (:class:`~torch_armor.errors.RunMismatchError`), a method that stores no finished
            layers (a baseline) under ``torchrun``.
    """
    return execute(plan_prune(model_or_path, calibration, config, layers=layers, options=options))


def execute(plan: PrunePlan) -> PruneReport:
    """Run a :class:`~torch_armor.engine.plan.PrunePlan`: the block pass over its layers, then (with
    ``out``) the save; the report of :func:`prune_model`."""
    options, method, source, model, config = plan.options, plan.method, plan.source, plan.model, plan.config
    names, batches, dev, run_path, out = list(plan.names), plan.batches, plan.device, plan.paths.run_dir, plan.paths.out
    blocks_prefix, blocks, streamed, experts = plan.blocks_prefix, plan.blocks, plan.streamed, plan.experts
    dense, model_pass = dict(plan.dense_weights), plan.model_pass
    topo = init_distributed(device=dev)
    try:
        if topo.world_size > 1 and run_path is None:
            raise ArmorInputError(f"prune_model on {topo.world_size} ranks needs a run directory (PruneOptions(run_dir="
                                  "...) or out=...): the ranks share finished layers through it")
        # one process owns a run directory (a second one is refused, naming the holder's PID)
        owned = run_lock(run_path) if run_path is not None and topo.rank == 0 else contextlib.nullcontext()
        with owned:
            try:
                if run_path is not None and out is not None and topo.rank == 0:
                    mark_run_target(run_path, out)
                store, identity = None, ""
                if run_path is not None and method.stores_layers:
                    calib_hash = hash_batches(batches)
                    moe = dict(expert_calibration=options.expert_calibration,
                               min_expert_tokens=options.min_expert_tokens) if experts else {}
                    identity = identity_string(model=source.content_hash(), calibration=calib_hash, method=method.name,
                                               sequential=options.sequential, layers=names, hidden_dtype=options.hidden_dtype,
                                               **moe)
                    store = RunStore(run_path, config, identity, calib_hash, rank=topo.rank)
                    finished = len(store.finished(names))
                    if finished and topo.rank == 0:
                        (options.log or logger.info)(f"resuming {run_path}: {finished} of {len(names)} layers already finished")
                state = RunState(store=store, identity=identity, rank=topo.rank, world_size=topo.world_size,
                                 sink=ShardWriter(run_path / BLOCKS_DIR) if streamed else None)
                passing = model_pass.before_blocks(plan, state) if model_pass is not None else ModelPassRun(batches)
                state = dataclasses.replace(state, held_out_from=passing.held_out_from)
                pipeline = BlockPipeline(plan, state)
                report = pipeline.run(passing.batches)
                if report.uncalled_layers:
                    dense = with_dense_layers(dense, report.uncalled_layers, blocks_prefix)
                    if topo.rank == 0:
                        warnings.warn(uncalled_warning(report.uncalled_layers), UserWarning, stacklevel=3)
                passing.after_model(model, report)
                report.settings.update(sequential=options.sequential)
                report.dense_weights = dense
                report.unfit_layers = dict(plan.unfit)
                if (experts or plan.experts_left_dense) and topo.rank == 0:
                    for line in dense_lines(dense) + routed_token_lines(report.expert_tokens):
                        logger.info(line)
                if not streamed:
                    attach_quantizer(model)  # model.save_pretrained now writes the ARMOR format
                if topo.rank == 0 and out is not None:
                    write = (partial(state.sink.finish, source, blocks_prefix) if streamed
                             else partial(save_pretrained, model))
                    try:
                        _save_output(write, out, options.overwrite, plan.paths.resuming, plan.paths.out_allowed,
                                     run_path,
                                     options.log or logger.info)
                    except OSError as err:
                        if isinstance(err, ArmorError):
                            raise
                        raise write_failed(err, f"free space or fix permissions, then prune again: the finished "
                                                f"layers are kept in {run_path}") from err
                    if plan.paths.temporary_run_dir:
                        shutil.rmtree(run_path, ignore_errors=True)
                return report
            except KeyboardInterrupt as err:
                raise interrupted_message(err, run_path, len(blocks)) from None
    finally:
        if topo.initialized_here:
            dist.destroy_process_group()
