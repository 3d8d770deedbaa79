"""Plan, then execute: every check and every decision of a prune, made once before any layer is
pruned, as one frozen :class:`PrunePlan` (:func:`plan_prune`); :func:`~torch_armor.engine.prune.prune_model`
executes it.

What a plan decides: the method (the config's type), the layers (the selection, less the weights
several decoder layers share and the layers the settings do not fit, each said once in a warning),
each layer's config (:mod:`torch_armor.engine.fit`), the weights left dense and why, the output and
run directories (checked: an input is never an output, ``out`` is new, empty or this run's own), the
device and the core storage, whether the model streams. Nothing is pruned, locked or written.

Example (a tiny random model)::

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    >>> model = LlamaForCausalLM(cfg).eval()
    >>> calib = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    >>> plan = plan_prune(model, calib, layers="1")
    >>> plan.method.name, len(plan.names), plan.names[0], plan.device.type, plan.storage
    ('armor', 7, 'model.layers.1.self_attn.q_proj', 'cpu', 'dense')
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from torch_armor.calibration.blocks import decoder_blocks
from torch_armor.calibration.experts import out_in_shape
from torch_armor.calibration.selection import LayerSelection, select_layers, shared_across_blocks
from torch_armor.calibration.validate import check_token_ids, vocab_size_of
from torch_armor.engine.batches import calibration_batches
from torch_armor.engine.experts import dense_weights, group_by_param, layer_module, no_expert_pruned
from torch_armor.engine.fit import dense_reasons, fit_layers, shared_warning, warn_unfit
from torch_armor.engine.methods import METHODS, Method, ModelPass, default_config, method_for
from torch_armor.engine.options import RUN_DIR_NAME, PathLike, PruneOptions, check_out
from torch_armor.engine.paths import check_prune_paths, model_source_dirs, resumes_into
from torch_armor.engine.sources import BlockSource, InMemory, Streamed
from torch_armor.engine.topology import launched_world_size
from torch_armor.errors import ArmorInputError

__all__ = ["PrunePlan", "PrunePaths", "check_paths", "plan_prune"]


@dataclass(frozen=True)
class PrunePlan:
    """A prune decided and checked, not yet run (:func:`plan_prune`).

    ``config`` is the method's config with each layer's fitted settings; ``names`` the layers to
    prune, in order; ``unfit`` the selected layers the settings did not fit (a smaller block size,
    or dense) and why; ``dense_weights`` the decoder weights the prune leaves dense and why;
    ``experts`` the fused expert parameters and their chosen experts; ``model_pass`` what the method
    does with the whole model around the block pass (``None``: nothing); ``paths`` where it writes
    (:class:`PrunePaths`).
    """

    method: Method
    config: Any
    source: BlockSource
    blocks_prefix: str
    blocks: nn.ModuleList
    names: Tuple[str, ...]
    unfit: Mapping[str, str]
    dense_weights: Mapping[str, Tuple[int, str]]
    experts: Mapping[str, List[str]]
    experts_left_dense: Optional[str]
    model_pass: Optional[ModelPass]
    batches: Sequence[Any]
    device: torch.device
    storage: str
    paths: PrunePaths
    options: PruneOptions

    @property
    def streamed(self) -> bool:
        """Whether the model streams from its checkpoint one decoder block at a time."""
        return isinstance(self.source, Streamed)

    @property
    def model(self) -> nn.Module:
        return self.source.model


@dataclass(frozen=True)
class PrunePaths:
    """Where a prune writes, checked (:func:`check_paths`): ``out`` (``None``: in place only), the run
    directory (``temporary_run_dir``: removed after a successful save), ``resuming`` (``out`` is this run
    directory's own earlier output) and ``out_allowed`` (the entries ``out`` may already hold)."""

    out: Optional[Path]
    run_dir: Optional[Path]
    temporary_run_dir: bool
    resuming: bool
    out_allowed: Tuple[str, ...]


def check_paths(model_or_path: Union[nn.Module, PathLike], options: PruneOptions) -> PrunePaths:
    """The output and run directories of a prune of ``model_or_path`` with ``options``, checked: an input
    is never an output, ``out`` is new, empty or this run's own, a checkpoint directory (streamed) has an
    ``out``. :func:`plan_prune` calls it; the command line calls it too, before the slow model load."""
    out = Path(options.out) if options.out is not None else None
    if not isinstance(model_or_path, nn.Module) and out is None:
        raise ArmorInputError("prune_model on a checkpoint directory streams it block by block and needs "
                              "PruneOptions(out=DIR) to write the pruned model")
    if options.run_dir is not None:
        run_dir, temporary = Path(options.run_dir), False
    else:
        run_dir, temporary = (out / RUN_DIR_NAME if out is not None else None), out is not None
    check_prune_paths(model_source_dirs(model_or_path), out=out, run_dir=options.run_dir,
                      hidden_dir=options.hidden_dir)  # inputs are never outputs, checked before any work
    resuming, allowed = False, ()
    if out is not None:
        inside = run_dir is not None and run_dir.parent.resolve() == out.resolve()
        resuming = run_dir is not None and resumes_into(run_dir, out)
        allowed = (run_dir.name,) if inside else ()
        check_out(out, options.overwrite or resuming, allowed=allowed)
    return PrunePaths(out=out, run_dir=run_dir, temporary_run_dir=temporary, resuming=resuming,
                      out_allowed=tuple(allowed))


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


def plan_prune(
    model_or_path: Union[nn.Module, PathLike],
    calibration: Any,
    config: Any = None,
    *,
    layers: LayerSelection = None,
    options: PruneOptions = PruneOptions(),
) -> PrunePlan:
    """Check and decide everything :func:`~torch_armor.engine.prune.prune_model` will do (its arguments,
    its errors and its warnings: see there), and prune nothing."""
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
    paths = check_paths(model_or_path, options)
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
        warnings.warn(shared_warning({n: why for n, why in shared.items() if n in names}), UserWarning, stacklevel=3)
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
        warnings.warn(experts_left_dense, UserWarning, stacklevel=3)
    model_pass = method.model_pass(config, batches, streamed=streamed)
    device = torch.device(options.device) if options.device is not None else torch.device("cpu")
    if not streamed and options.device is None:
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), device)
    storage = options.storage or ("auto" if device.type == "cuda" else "dense")
    return PrunePlan(method=method, config=config, source=source, blocks_prefix=blocks_prefix, blocks=blocks,
                     names=tuple(names), unfit=unfit, dense_weights=dense, experts=experts,
                     experts_left_dense=experts_left_dense, model_pass=model_pass, batches=batches, device=device, storage=storage, paths=paths,
                     options=options)
