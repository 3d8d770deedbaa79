"""``prune_model``: the one entry point — a model (or a checkpoint directory), calibration token
ids and a method config to a pruned model and a :class:`~torch_armor.engine.report.PruneReport`.

The config's type is the method (:mod:`torch_armor.engine.methods`); how the run is carried out
(where to save, resume, which device, …) is one :class:`PruneOptions`. Every check and set-up of a
run happens here, once: the output directory, the run directory, whether a checkpoint streams,
``torchrun``'s ``WORLD_SIZE`` and process group. The command line (``torch-armor prune``) only
builds these objects and calls this.

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
from typing import Any, Callable, Optional, Sequence, Tuple, Union

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from torch_armor._io import stop_here_for_tests
from torch_armor.calibration.blocks import decoder_blocks
from torch_armor.calibration.experts import out_in_shape
from torch_armor.calibration.selection import LayerSelection, select_layers, shared_across_blocks
from torch_armor.calibration.validate import check_token_ids, vocab_size_of
from torch_armor.engine.batches import calibration_batches, hash_batches
from torch_armor.engine.blocks import BLOCKS_DIR, BlockPipeline
from torch_armor.engine.topology import init_distributed, launched_world_size
from torch_armor.engine.fit import dense_reasons, fit_layers, shared_warning, uncalled_warning, warn_unfit
from torch_armor.engine.experts import (dense_lines, dense_weights, group_by_param, layer_module, no_expert_pruned,
                                        routed_token_lines, with_dense_layers)
from torch_armor.engine.identity import identity_string
from torch_armor.engine.interrupt import interrupted_message
from torch_armor.engine.lock import OutputBusy, output_lock, run_lock
from torch_armor.engine.methods import METHODS, RunContext, default_config, method_for
from torch_armor.engine.options import RUN_DIR_NAME, PathLike, PruneOptions, check_out, out_contents
from torch_armor.engine.paths import (check_prune_paths, mark_run_target, mark_written, model_source_dirs,
                                      resumes_into)
from torch_armor.engine.report import PruneReport
from torch_armor.engine.runstore import RunStore
from torch_armor.engine.sources import InMemory, ShardWriter, Streamed
from torch_armor.errors import ArmorError, ArmorInputError, write_failed
from torch_armor.format.hf_format import attach_quantizer
from torch_armor.format.serialization import save_pretrained

__all__ = ["prune_model", "PruneOptions", "RUN_DIR_NAME"]

logger = logging.getLogger("torch_armor")

#: Where a run keeps its pruned model (in its run directory) when another process wrote ``out`` first.
KEPT_NAME = "pruned"


def _run_path(options: PruneOptions) -> Tuple[Optional[Path], bool]:
    """The run directory and whether it is temporary (removed after a successful save)."""
    if options.run_dir is not None:
        return Path(options.run_dir), False
    if options.out is not None:
        return Path(options.out) / RUN_DIR_NAME, True
    return None, False


def _check_layers(model: nn.Module, names: Sequence[str], streamed: bool) -> None:
    """Every layer checked before any is pruned: a failed call leaves the model untouched."""
    for name in names:
        weight = layer_module(model, name).weight
        if not streamed and weight.device.type == "meta":
            raise ArmorInputError(
                f"layer {name!r}: the weight is on the meta device (offloaded, e.g. by accelerate's device_map or "
                "cpu_offload); pruning needs the weights in memory: reload the model without offloading, or pass "
                "its checkpoint directory to stream it block by block"
            )
        if hasattr(type(weight), "__tensor_flatten__"):
            raise ArmorInputError(f"layer {name!r} is already pruned (its weight is of type {type(weight).__name__}); "
                                  "prune the original dense model")


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
    config = default_config() if config is None else config
    method = method_for(config)
    if not isinstance(options, PruneOptions):
        raise ArmorInputError(f"options must be a PruneOptions, got {type(options).__name__}")
    world = launched_world_size()
    if world > 1 and not method.stores_layers:
        sharded = [m.name for m in METHODS.values() if m.stores_layers]
        raise ArmorInputError(f"only a method that stores finished layers ({', '.join(sharded)}) runs on several ranks "
                              f"(WORLD_SIZE={world}): {method.label} keeps no per-layer run store to share out; run it "
                              "without torchrun")
    batches = calibration_batches(calibration, options.batch_size)
    streamed = not isinstance(model_or_path, nn.Module)
    out = Path(options.out) if options.out is not None else None
    if streamed and out is None:
        raise ArmorInputError("prune_model on a checkpoint directory streams it block by block and needs "
                              "PruneOptions(out=DIR) to write the pruned model")
    run_path, temp_run = _run_path(options)
    check_prune_paths(model_source_dirs(model_or_path), out=out, run_dir=options.run_dir,
                      hidden_dir=options.hidden_dir)  # inputs are never outputs, checked before any work
    resuming, allowed = False, ()
    if out is not None:
        inside = run_path is not None and run_path.parent.resolve() == out.resolve()
        resuming = run_path is not None and resumes_into(run_path, out)
        allowed = (run_path.name,) if inside else ()
        check_out(out, options.overwrite or resuming, allowed=allowed)
    source = Streamed(model_or_path, dtype=options.dtype) if streamed else InMemory(model_or_path)
    model = source.model
    blocks_prefix, blocks = decoder_blocks(model)
    names = select_layers(model, layers)
    if layers is None:  # every linear of the decoder blocks; one outside them (Gemma-4's per-layer projection) stays dense
        names = [n for n in names if n.startswith(blocks_prefix + ".")]
    check_token_ids(batches, vocab_size_of(model))
    shared = shared_across_blocks(model, names, blocks_prefix)  # one weight, several layers: left dense
    if shared:
        if all(n in shared for n in names):
            raise ArmorInputError(f"every selected layer's weight is shared by several decoder layers (layer {names[0]!r}: "
                                  f"{shared[names[0]]}), and prune_model leaves such weights dense; select other layers")
        warnings.warn(shared_warning({n: why for n, why in shared.items() if n in names}), UserWarning, stacklevel=2)
        names = [n for n in names if n not in shared]
    _check_layers(model, names, streamed)
    selected = names
    names, config, unfit = fit_layers(model, names, config, options.strict)
    if not names:
        first = next(iter(unfit))
        raise ArmorInputError(f"the settings fit none of the {len(selected)} selected layers (layer {first!r}: "
                              f"{unfit[first]}); choose a block size or pattern that fits them")
    warn_unfit(unfit)
    experts = group_by_param(names)
    for param, chosen in experts.items():
        module_name, _, attr = param.rpartition(".")
        total = out_in_shape(model.get_submodule(module_name), attr)[0]
        if method.stores_layers and len(chosen) != total:
            raise ArmorInputError(f"{param}: {method.label} converts all {total} experts of a fused parameter together, "
                                  f"the layer selection holds {len(chosen)}; select every expert of it or none")
    dense = dense_weights(model, names, blocks_prefix,
                          {**dense_reasons(unfit, names), **{f"{n}.weight": why for n, why in shared.items()}})
    experts_left_dense = no_expert_pruned(model, names, dense, blocks_prefix)
    if experts_left_dense:
        warnings.warn(experts_left_dense, UserWarning, stacklevel=2)
    model_pass = method.model_pass(config, batches, streamed=streamed)
    dev = torch.device(options.device) if options.device is not None else torch.device("cpu")
    if not streamed and options.device is None:
        dev = next((p.device for p in model.parameters() if p.device.type != "meta"), dev)
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
                writer = ShardWriter(run_path / BLOCKS_DIR) if streamed else None
                storage = options.storage or ("auto" if dev.type == "cuda" else "dense")
                block_batches, n_sampled = batches, 0
                if model_pass is not None:
                    block_batches, n_sampled = model_pass.before_blocks(model, batches, RunContext(
                        source=source, blocks_prefix=blocks_prefix, n_blocks=len(blocks), writer=writer, device=dev,
                        run_dir=run_path, identity=identity, storage=storage, rank=topo.rank,
                        world_size=topo.world_size, log=options.log, progress=options.progress and topo.rank == 0,
                        batch_size=options.batch_size))
                pipeline = BlockPipeline(
                    source=source, blocks_prefix=blocks_prefix, blocks=blocks, names=names, config=config,
                    sequential=options.sequential, store=store, identity=identity, device=dev,
                    hidden_dtype=options.hidden_dtype,
                    hidden_dir=Path(options.hidden_dir) if options.hidden_dir is not None else None,
                    storage=storage, progress=options.progress and topo.rank == 0, sink=writer, rank=topo.rank,
                    world_size=topo.world_size, expert_calibration=options.expert_calibration,
                    min_expert_tokens=options.min_expert_tokens, held_out_from=n_sampled,
                )
                report = pipeline.run(block_batches)
                if report.uncalled_layers:
                    dense = with_dense_layers(dense, report.uncalled_layers, blocks_prefix)
                    if topo.rank == 0:
                        warnings.warn(uncalled_warning(report.uncalled_layers), UserWarning, stacklevel=2)
                if model_pass is not None:
                    model_pass.after_model(model, report)
                report.settings.update(sequential=options.sequential)
                report.dense_weights = dense
                report.unfit_layers = unfit
                if (experts or experts_left_dense) and topo.rank == 0:
                    for line in dense_lines(dense) + routed_token_lines(report.expert_tokens):
                        logger.info(line)
                if not streamed:
                    attach_quantizer(model)  # model.save_pretrained now writes the ARMOR format
                if topo.rank == 0 and out is not None:
                    write = (partial(writer.finish, source, blocks_prefix) if streamed
                             else partial(save_pretrained, model))
                    try:
                        _save_output(write, out, options.overwrite, resuming, allowed, run_path,
                                     options.log or logger.info)
                    except OSError as err:
                        if isinstance(err, ArmorError):
                            raise
                        raise write_failed(err, f"free space or fix permissions, then prune again: the finished "
                                                f"layers are kept in {run_path}") from err
                    if temp_run:
                        shutil.rmtree(run_path, ignore_errors=True)
                return report
            except KeyboardInterrupt as err:
                raise interrupted_message(err, run_path, len(blocks)) from None
    finally:
        if topo.initialized_here:
            dist.destroy_process_group()
