"""``prune_model``: the one entry point — a model (or a checkpoint directory), calibration
token ids, a method — to a pruned model and a :class:`~torch_armor.engine.report.PruneReport`.

The command line (``torch-armor prune``) only parses its arguments and calls this.

Example (a tiny random model; pruned in place)::

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    >>> model = LlamaForCausalLM(cfg).eval()
    >>> calib = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    >>> report = prune_model(model, calib, "armor", ArmorConfig(num_iters=2), progress=False)
    >>> len(report.layers), type(model.model.layers[1].mlp.up_proj.weight).__name__
    (14, 'DenseArmorTensor')
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, List, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from torch_armor.calibration.blocks import decoder_blocks
from torch_armor.config import ArmorConfig
from torch_armor.engine.blocks import BLOCKS_DIR, BlockPipeline
from torch_armor.engine.identity import hash_calibration, hash_model, hash_tensors, identity_string
from torch_armor.engine.report import PruneReport
from torch_armor.engine.runner import layer_config, method_config
from torch_armor.engine.runstore import RunStore

__all__ = ["prune_model", "calibration_batches"]

logger = logging.getLogger("torch_armor")

PathLike = Union[str, "os.PathLike[str]"]


class _InMemory:
    """A model already in memory: every block is there; pruned in place, and each block goes back to
    the device it was on (pruning on a GPU returns a CPU model on the CPU)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.homes: dict = {}

    def prepare_inputs(self) -> None:
        pass

    def release_inputs(self) -> None:
        pass

    def load_block(self, prefix: str) -> nn.Module:
        block = self.model.get_submodule(prefix)
        self.homes[prefix] = next((p.device for p in block.parameters() if p.device.type != "meta"), None)
        return block

    def release_block(self, prefix: str) -> None:
        home = self.homes.pop(prefix, None)
        if home is not None:
            self.model.get_submodule(prefix).to(home)

    def content_hash(self) -> str:
        return hash_model(self.model)


class _Streamed:
    """A local checkpoint built on the meta device; one block materialized at a time."""

    def __init__(self, checkpoint: Any) -> None:
        self.checkpoint = checkpoint
        self.model = checkpoint.model

    def prepare_inputs(self) -> None:
        self.checkpoint.materialize_non_decoder()

    def release_inputs(self) -> None:
        self.checkpoint.release_non_decoder()

    def load_block(self, prefix: str) -> nn.Module:
        return self.checkpoint.materialize(prefix)

    def release_block(self, prefix: str) -> None:
        from torch_armor.engine.memory import trim

        self.checkpoint.release(prefix)
        trim()

    def content_hash(self) -> str:
        return self.checkpoint.content_hash()


def is_streamable_checkpoint(path: PathLike) -> bool:
    """A local Hugging Face directory with ``config.json`` and safetensors weights (not an ARMOR one)."""
    from torch_armor.tensor.serialization import ARMOR_CONFIG_NAME, has_armor_quantization_config

    p = Path(path)
    return (p.is_dir() and (p / "config.json").is_file() and not (p / ARMOR_CONFIG_NAME).exists()
            and not has_armor_quantization_config(p) and any(p.glob("*.safetensors")))


def _ids_and_mask(item: Any) -> Any:
    """``ids`` or ``(ids, mask)`` from a tensor, an ``(ids, mask)`` pair or a tokenizer-style dict."""
    if isinstance(item, Mapping):
        if "input_ids" not in item:
            raise ValueError(f"a calibration dict needs 'input_ids' (and optionally 'attention_mask'), got keys {sorted(item)}")
        ids, mask = item["input_ids"], item.get("attention_mask")
    elif isinstance(item, tuple) and len(item) == 2 and all(isinstance(t, torch.Tensor) for t in item):
        ids, mask = item
    else:
        ids, mask = item, None
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.numel() and not ids.dtype.is_floating_point):
        raise ValueError("calibration must be an (n_windows, seq_len) tensor of token ids, a list of (batch, seq_len) "
                         "token-id tensors, or {'input_ids': …, 'attention_mask': …} / (ids, mask); got "
                         f"{type(ids).__name__} {tuple(getattr(ids, 'shape', ()))}")
    if mask is None:
        return ids
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        raise ValueError(f"attention_mask must have the token ids' shape {tuple(ids.shape)}, got "
                         f"{type(mask).__name__} {tuple(getattr(mask, 'shape', ()))}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 (pad) and 1 (token) only")
    if not bool((mask != 0).any(dim=1).all()):
        raise ValueError("attention_mask has a window with no token (every position is padding); drop that window")
    return ids, mask.to(torch.bool)


def calibration_batches(calibration: Any, batch_size: int = 4) -> List[Any]:
    """``(n, seq_len)`` token ids split into batches of ``batch_size`` windows, or a list of
    ``(b, seq_len)`` batches checked and kept.

    With padding, give ``{"input_ids": ids, "attention_mask": mask}`` (a tokenizer's output) or
    ``(ids, mask)``, or a list of them: batches are then ``(ids, mask)`` pairs, the model gets the
    mask, and pad positions (mask 0) are left out of every statistic.

    Example::

        >>> [tuple(b.shape) for b in calibration_batches(torch.zeros(5, 8, dtype=torch.long), 2)]
        [(2, 8), (2, 8), (1, 8)]
        >>> ids, mask = torch.zeros(3, 4, dtype=torch.long), torch.tensor([[1, 1, 1, 0]] * 3)
        >>> [(tuple(i.shape), int(m.sum())) for i, m in calibration_batches({"input_ids": ids, "attention_mask": mask}, 2)]
        [((2, 4), 6), ((1, 4), 3)]
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if isinstance(calibration, (torch.Tensor, Mapping)) or (isinstance(calibration, tuple) and len(calibration) == 2
                                                            and all(isinstance(t, torch.Tensor) for t in calibration)
                                                            and calibration[0].shape == calibration[1].shape):
        whole = _ids_and_mask(calibration)
        if isinstance(whole, torch.Tensor):
            return list(whole.split(batch_size))
        return list(zip(whole[0].split(batch_size), whole[1].split(batch_size)))
    batches = [_ids_and_mask(b) for b in calibration] if calibration is not None else []
    if not batches:
        raise ValueError("calibration must be an (n_windows, seq_len) tensor of token ids or a list of "
                         "(batch, seq_len) token-id tensors")
    return batches


def _hash_batches(batches: Sequence[Any]) -> str:
    """The calibration's identity: token ids (as before masks existed) and any attention masks."""
    if all(isinstance(b, torch.Tensor) for b in batches):
        return hash_calibration(batches)
    parts = {}
    for i, b in enumerate(batches):
        ids, mask = (b, None) if isinstance(b, torch.Tensor) else b
        parts[f"batch.{i:06d}"] = ids.to(torch.int64)
        if mask is not None:
            parts[f"mask.{i:06d}"] = mask.to(torch.int64)
    return hash_tensors(parts)


def prune_model(
    model_or_path: Union[nn.Module, PathLike],
    calibration: Any,
    method: str = "armor",
    config: Any = None,
    *,
    sequential: bool = True,
    run_dir: Optional[PathLike] = None,
    device: Union[str, torch.device, None] = None,
    progress: bool = True,
    out: Optional[PathLike] = None,
    layers: Optional[Sequence[str]] = None,
    pattern: Optional[str] = None,
    batch_size: int = 4,
    hidden_dtype: Optional[torch.dtype] = None,
    hidden_dir: Optional[PathLike] = None,
    storage: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
    log: Optional[Callable[[str], None]] = None,
) -> PruneReport:
    """Prune every linear of the decoder blocks, block by block.

    Args:
        model_or_path: a model (pruned in place), or a local Hugging Face checkpoint directory
            (``config.json`` + safetensors, sharded or not): built on the meta device and streamed
            one decoder block at a time — peak memory about one block plus the calibration hidden
            states; needs ``out``.
        calibration: ``(n_windows, seq_len)`` token ids (:func:`torch_armor.recipes.data.calibration_windows`)
            or a list of ``(batch, seq_len)`` tensors; with padding, ``{"input_ids", "attention_mask"}``
            or ``(ids, mask)`` (or a list of them): pad positions are left out of every statistic.
        method: ``"armor"`` (default) or a baseline: ``"sparsegpt"``, ``"wanda"``, ``"nowag"``,
            ``"magnitude"`` (:data:`~torch_armor.engine.runner.METHODS`).
        config: an :class:`ArmorConfig` for ARMOR (default ``ArmorConfig()``), a
            :class:`~torch_armor.engine.runner.BaselineConfig` otherwise.
        sequential: calibrate each block on the outputs of the already-pruned blocks before it
            (default, as SparseGPT and llm-compressor do); ``False``: on the dense model's.
        run_dir: keep every finished ARMOR layer and the hidden states at each block boundary
            there; rerunning resumes bit-identically; a directory of another run (other weights,
            calibration or settings) is refused. Required under ``torchrun``.
        device: where each block is calibrated and pruned (default: CPU, or the model's device).
        progress: a progress bar over the blocks.
        out: save the pruned model there (:func:`torch_armor.save_pretrained` format).
        layers: the linears to prune: names, or a selection such as ``"0-3"`` (decoder block
            indices) or a regular expression (:func:`~torch_armor.recipes.models.select_layers`);
            default: every decoder linear.
        pattern: overrides the config's sparsity pattern.
        batch_size: calibration windows per forward pass.
        hidden_dtype: dtype the calibration hidden states are kept in (default: the model's).
        hidden_dir: keep the calibration hidden states in files there instead of in memory (one
            per batch; each is read when its batch runs).
        storage: ARMOR core storage in the model (default ``"dense"`` on CPU, ``"auto"`` on CUDA).
        dtype: streamed checkpoints only: load the weights in this dtype.
        log: called with a line of text about resuming (default: the ``torch_armor`` logger).

    Raises:
        ValueError: bad arguments, a layer outside the decoder blocks, a layer the settings do
            not fit (block size, pattern) or whose weight is on the meta device — every layer is
            checked before any is pruned —, a run directory of another run
            (:class:`~torch_armor.engine.runstore.RunMismatchError`).
    """
    from torch_armor.engine.distributed import init_distributed

    cfg = method_config(method, config, pattern)
    batches = calibration_batches(calibration, batch_size)
    streamed = not isinstance(model_or_path, nn.Module)
    if streamed:
        if out is None:
            raise ValueError("prune_model on a checkpoint directory streams it block by block and needs out=DIR "
                             "to write the pruned model")
        from torch_armor.engine import memory
        from torch_armor.engine.checkpoint import LazyCheckpoint

        memory.fix_mmap_threshold()  # process-wide: freed blocks go back to the system (engine/memory.py)
        memory.trim()  # e.g. the tokenizer's temporaries
        source: Any = _Streamed(LazyCheckpoint(model_or_path, dtype=dtype))
    else:
        source = _InMemory(model_or_path)
    model = source.model
    blocks_prefix, blocks = decoder_blocks(model)
    if layers is None or isinstance(layers, str):
        from torch_armor.recipes.models import select_layers

        names = select_layers(model, layers)
    else:
        names = list(layers)
    if not names:
        raise ValueError("no layers to prune")
    for name in names:  # every layer checked before any is pruned: a failed call leaves the model untouched
        weight = model.get_submodule(name).weight
        if not streamed and weight.device.type == "meta":
            raise ValueError(
                f"layer {name!r}: the weight is on the meta device (offloaded, e.g. by accelerate's device_map or "
                "cpu_offload); pruning needs the weights in memory: reload the model without offloading, or pass "
                "its checkpoint directory to stream it block by block"
            )
        if hasattr(type(weight), "__tensor_flatten__"):
            raise ValueError(f"layer {name!r} is already pruned (its weight is of type {type(weight).__name__}); "
                             "prune the original dense model")
        _check_layer(method, cfg, tuple(weight.shape), name)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if not streamed and device is None:
        dev = next((p.device for p in model.parameters() if p.device.type != "meta"), dev)
    topo = init_distributed(device=dev)
    if topo.world_size > 1 and run_dir is None:
        raise ValueError(f"prune_model on {topo.world_size} ranks needs run_dir: the ranks share finished layers "
                         "through it")
    temp_run = streamed and run_dir is None
    run_path = Path(run_dir) if run_dir is not None else (Path(out) / ".armor_run" if temp_run else None)
    store = None
    identity = ""
    if run_path is not None:
        calib_hash = _hash_batches(batches)
        identity = identity_string(model=source.content_hash(), calibration=calib_hash, method=method,
                                   sequential=sequential, layers=names, hidden_dtype=hidden_dtype)
        if method == "armor":
            store = RunStore(run_path, cfg, identity, calib_hash, rank=topo.rank)
            finished = len(store.finished(names))
            if finished:
                (log or logger.info)(f"resuming {run_path}: {finished} of {len(names)} layers already finished")
    writer = _ShardWriter(run_path / BLOCKS_DIR) if streamed else None
    pipeline = BlockPipeline(
        source=source, blocks_prefix=blocks_prefix, blocks=blocks, names=names, method=method, config=cfg,
        sequential=sequential, store=store, identity=identity, device=dev, hidden_dtype=hidden_dtype,
        hidden_dir=Path(hidden_dir) if hidden_dir is not None else None,
        storage=storage or ("auto" if dev.type == "cuda" else "dense"), progress=progress and topo.rank == 0,
        write_block=writer.write if writer else None, block_done=writer.done if writer else None,
        rank=topo.rank, world_size=topo.world_size,
    )
    report = pipeline.run(batches)
    report.settings.update(sequential=sequential)
    if not streamed:
        from torch_armor.hf import attach_quantizer

        attach_quantizer(model)  # model.save_pretrained now writes the ARMOR format
    if topo.rank == 0 and out is not None:
        if streamed:
            writer.finish(source.checkpoint, blocks_prefix, Path(out))
        else:
            from torch_armor.tensor.serialization import save_pretrained

            save_pretrained(model, out)
        if temp_run:
            shutil.rmtree(run_path, ignore_errors=True)
    return report


def _check_layer(method: str, cfg: Any, shape: tuple, name: str) -> None:
    """Fail before pruning anything if the settings cannot serve this layer."""
    if method == "armor" and cfg.block_size == "budget" and not cfg.block_sizes:
        from torch_armor.engine.allocate import candidate_block_sizes

        multiple = cfg.sparsity.m if cfg.sparsity.structured else 1
        if not candidate_block_sizes(shape[0], shape[1], multiple):
            raise ValueError(f"layer {name!r}: block_size='budget' found no block size in [8, 64] that divides its "
                             f"shape {shape} and is a multiple of {multiple}; exclude the layer or give it a size in "
                             "block_sizes")
        return
    layer_config(method, cfg, shape, name)


class _ShardWriter:
    """Finished blocks of a streamed model, one safetensors shard each, assembled at the end."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, index: int) -> Path:
        return self.directory / f"block-{index:05d}.safetensors"

    def write(self, index: int, prefix: str, block: nn.Module) -> None:
        from torch_armor.tensor.serialization import save_shard

        self.directory.mkdir(parents=True, exist_ok=True)
        save_shard(self.path(index), block, prefix=prefix + ".")

    def done(self, index: int) -> bool:
        return self.path(index).is_file()

    def finish(self, checkpoint: Any, blocks_prefix: str, out: Path) -> None:
        from torch_armor.tensor.serialization import assemble_checkpoint, save_shard

        rest_keys = [k for k in checkpoint.keys() if not k.startswith(blocks_prefix + ".")]
        rest = []  # one shard per large tensor (embeddings, lm_head): never two of them in memory
        for j, keys in enumerate(_group_keys(rest_keys, checkpoint.nbytes, REST_SHARD_BYTES)):
            rest.append(self.directory / f"rest-{j:05d}.safetensors")
            save_shard(rest[-1], checkpoint.read_tensors(keys))
        shards = sorted(self.directory.glob("block-*.safetensors")) + rest
        model = checkpoint.model
        assemble_checkpoint(out, shards, hf_config=getattr(model, "config", None),
                            model_class=f"{type(model).__module__}.{type(model).__qualname__}")


REST_SHARD_BYTES = 64 << 20


def _group_keys(keys: Sequence[str], nbytes: Callable[[str], int], limit: int) -> List[List[str]]:
    """Consecutive keys in groups of at most ``limit`` bytes (a larger tensor alone in its group).

    Example::

        >>> _group_keys(["a", "b", "c", "d"], {"a": 1, "b": 9, "c": 1, "d": 1}.get, 4)
        [['a'], ['b'], ['c', 'd']]
    """
    groups: List[List[str]] = []
    size = limit + 1
    for k in keys:
        n = nbytes(k)
        if size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    return groups
