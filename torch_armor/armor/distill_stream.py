"""End-to-end distillation of a streamed checkpoint, one decoder block resident at a time.

The teacher is the dense checkpoint run forward block by block (:meth:`BlockStream.dense_top_k`,
before the block pass). The student (:class:`StreamedStudent`) is the pruned model whose blocks
are the block pass's shards in the run directory. A training step runs the forward block by block
keeping only each block's input hidden states, then the backward from the top: each block is
loaded again and its forward re-run from the saved input, and the gradient with respect to that
input flows to the block below (the boundary-activation scheme of gradient checkpointing). Only the
trained tensors (:func:`~torch_armor.armor.distill_train.float_leaves`) and Adam's state stay
resident. The embeddings are loaded only to compute the first block's inputs, the final norm and the
output layer only to compute the logits: with untied embeddings of a large vocabulary each is as big as
several blocks, and neither is resident while a block runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open
from torch import nn
from torch.func import functional_call

from torch_armor.calibration.blocks import BlockInput, capture_block_inputs, to_device
from torch_armor.config.levers import DistillConfig
from torch_armor.armor.distill_kl import TopK, Window, top_k_of, window_kl
from torch_armor.armor.distill_train import ArmorWeight, armor_layers, core_of, float_leaves, result_tensors
from torch_armor.engine.sources import ShardWriter, Streamed
from torch_armor.errors import ArmorInputError
from torch_armor.progress import tqdm
from torch_armor.format.armor_format import unflatten_armor_state
from torch_armor.format.safetensors_io import read_shard_metadata

__all__ = ["BlockStream", "StreamedStudent"]


def _frozen(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        p.requires_grad_(False)
    return module


class BlockStream:
    """A streamed checkpoint run forward block by block on ``device``: dense blocks from the
    checkpoint, pruned ones from the block pass's ``shards``; the modules before the blocks
    (embeddings) are materialized in :meth:`block_inputs`, those after them (final norm, output
    layer) inside ``with stream.output_layers():``."""

    def __init__(self, source: Streamed, blocks_prefix: str, n_blocks: int, shards: ShardWriter,
                 device: torch.device) -> None:
        self.source, self.blocks_prefix, self.n_blocks = source, blocks_prefix, n_blocks
        self.shards, self.device = shards, device
        model = source.model
        base = blocks_prefix.rpartition(".")[0]
        self.norm = getattr(model.get_submodule(base), "norm", None) if base else None
        self.lm_head = model.get_output_embeddings()
        if not isinstance(self.norm, nn.Module) or not isinstance(self.lm_head, nn.Module):
            raise ArmorInputError(f"streamed distillation: {type(model).__name__} has no final norm at {base}.norm or no "
                                  "output embeddings; prune with ArmorConfig(distill=None), or load the model and pass "
                                  "the module")
        self.softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)

    @contextlib.contextmanager
    def input_layers(self) -> Iterator[None]:
        """The modules before the blocks (embeddings, rotary buffers) materialized on the device."""
        self.source.prepare_inputs()
        try:
            _frozen(self.source.model.get_input_embeddings()).to(self.device)
            yield
        finally:
            self.source.release_inputs()

    @contextlib.contextmanager
    def output_layers(self) -> Iterator[None]:
        """The final norm and the output layer materialized on the device (with the input embeddings
        when the output layer shares their weight)."""
        checkpoint = self.source.checkpoint
        after = checkpoint.post_decoder_prefixes()
        try:
            for prefix in after:
                checkpoint.materialize(prefix)
            tied = any(p.is_meta for m in (self.norm, self.lm_head) for p in m.parameters())
            with self.input_layers() if tied else contextlib.nullcontext():
                for module in (self.norm, self.lm_head):
                    _frozen(module).to(self.device)
                yield
        finally:
            for prefix in after:
                checkpoint.release(prefix)

    def prefix(self, index: int) -> str:
        return f"{self.blocks_prefix}.{index}"

    def block_inputs(self, windows: Sequence[Window]) -> List[BlockInput]:
        """What the first block receives for each window (hidden states and keyword arguments, on the device)."""
        batches = [ids if mask is None else (ids, mask) for ids, mask in windows]
        blocks = [self.source.model.get_submodule(self.prefix(i)) for i in range(self.n_blocks)]
        with self.input_layers():
            inputs = capture_block_inputs(self.source.model, blocks[0], batches, store_device=self.device,
                                          blocks=blocks, blocks_prefix=self.blocks_prefix)
        for inp in inputs:  # each block's own arguments: a sliding-window layer's mask is not a full layer's
            inp.kwargs = to_device(inp.kwargs, self.device)
            if inp.layer_kwargs is not None:
                inp.layer_kwargs = [to_device(kwargs, self.device) for kwargs in inp.layer_kwargs]
        return inputs

    @staticmethod
    def enter_block(inputs: Sequence[BlockInput], index: int) -> Sequence[BlockInput]:
        """``inputs`` with the arguments of block ``index``."""
        for inp in inputs:
            inp.enter_block(index)
        return inputs

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits ``(seq, vocab)`` in float32 of one window's last hidden states (inside
        :meth:`output_layers`)."""
        logits = self.lm_head(self.norm(hidden))
        if self.softcap:  # as transformers' causal LMs with a logit cap compute them
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits[0].float()

    def run(self, block: nn.Module, weights: Optional[Dict[str, torch.Tensor]], hidden: torch.Tensor,
            kwargs: Dict[str, Any]) -> torch.Tensor:
        out = block(hidden, **kwargs) if weights is None else functional_call(block, weights, (hidden,), kwargs,
                                                                               strict=False)
        return out[0] if isinstance(out, (tuple, list)) else out

    def dense_block(self, index: int) -> nn.Module:
        return _frozen(self.source.load_block(self.prefix(index))).to(self.device).eval()

    def pruned_block(self, index: int) -> nn.Module:
        """Block ``index`` as the block pass left it (its shard, ARMOR weights included)."""
        path = self.shards.path(index)
        metadata = read_shard_metadata(path)
        with safe_open(str(path), framework="pt") as fh:
            tensors = {key: fh.get_tensor(key) for key in fh.keys()}
        unflatten_armor_state(self.source.model, tensors, metadata, strict=False, storage="dense")
        return _frozen(self.source.model.get_submodule(self.prefix(index))).to(self.device).eval()

    def release(self, index: int) -> None:
        self.source.release_block(self.prefix(index))

    @torch.no_grad()
    def dense_top_k(self, windows: Sequence[Window], k: int, progress: bool = False) -> List[TopK]:
        """:func:`~torch_armor.armor.distill_kl.dense_top_k` of the dense checkpoint, block by block."""
        inputs = self.block_inputs(windows)
        hidden = [inp.hidden for inp in inputs]
        for index in tqdm(range(self.n_blocks), desc=f"distillation: dense top-{k}", unit="block",
                          disable=not progress):
            block = self.dense_block(index)
            hidden = [self.run(block, None, h, inp.kwargs) for h, inp in zip(hidden, self.enter_block(inputs, index))]
            self.release(index)
        with self.output_layers():
            return [top_k_of(self.head(h), k) for h in hidden]

    def for_each_layer(self, apply: Callable[[str, ArmorWeight], None], write: bool) -> None:
        """``apply(name, weight)`` on every ARMOR weight, block by block (``write``: each block's shard rewritten)."""
        for index in range(self.n_blocks):
            block = self.pruned_block(index)
            for name, site in armor_layers(block).items():
                apply(f"{self.prefix(index)}.{name}", site)
            if write:
                self.shards.write(index, self.prefix(index), block)
            self.release(index)


class StreamedStudent:
    """The pruned blocks of a :class:`BlockStream` as a distillation student
    (:class:`~torch_armor.armor.distill_train.Student`): the trained tensors resident, every
    other weight read from the shards when its block runs."""

    def __init__(self, stream: BlockStream, config: DistillConfig, writes: bool = True) -> None:
        self.stream, self.train_core, self.writes = stream, config.train_core, writes
        self.leaves: Dict[str, List[Optional[torch.Tensor]]] = {}
        self.weights: Dict[str, torch.Tensor] = {}
        for index in range(stream.n_blocks):
            block = stream.pruned_block(index)
            layers = armor_layers(block)
            for name, site in layers.items():
                self.leaves[f"{stream.prefix(index)}.{name}"] = [
                    t if t is None else t.to(stream.device) for t in float_leaves(site.tensor, config.train_core,
                                                                                   keep_core=False)]
            stream.release(index)
        if not self.leaves:
            raise ArmorInputError("distillation: the model has no ARMOR layers (nothing was pruned with ArmorConfig)")

    def _block_weights(self, index: int, block: nn.Module) -> Dict[str, torch.Tensor]:
        out = {}
        for name, site in armor_layers(block).items():
            stored = core_of(site.tensor).detach().float()
            a, core, b = self.leaves[f"{self.stream.prefix(index)}.{name}"]
            out[site.param] = site.dense(a, stored if core is None else core, b, stored != 0)
        return out

    def _forward(self, windows: Sequence[Window], context: Callable[[], Any],
                 keep: bool) -> Tuple[List[BlockInput], List[torch.Tensor], List[List[torch.Tensor]]]:
        """The block inputs, the last block's outputs and (``keep``) every block's input hidden states."""
        stream = self.stream
        inputs = stream.block_inputs(windows)
        hidden = [inp.hidden for inp in inputs]
        saved: List[List[torch.Tensor]] = []
        with torch.no_grad():
            for index in range(stream.n_blocks):
                block = stream.pruned_block(index)
                if keep:
                    saved.append(hidden)
                with context():
                    weights = self._block_weights(index, block)
                    hidden = [stream.run(block, weights, h, inp.kwargs)
                              for h, inp in zip(hidden, stream.enter_block(inputs, index))]
                stream.release(index)
        return inputs, hidden, saved

    def kl_sum(self, windows: Sequence[Window], teachers: Sequence[TopK]) -> Tuple[float, int]:
        _, last, _ = self._forward(windows, contextlib.nullcontext, keep=False)
        total, count = 0.0, 0
        with torch.no_grad(), self.stream.output_layers():
            for h, window, teacher in zip(last, windows, teachers):
                s, n = window_kl(self.stream.head(h), teacher, window)
                total, count = total + float(s), count + n
        return total, count

    def backward(self, windows: Sequence[Window], teachers: Sequence[TopK], count: int,
                 context: Callable[[], Any]) -> float:
        stream = self.stream
        inputs, last, saved = self._forward(windows, context, keep=True)
        grads, loss = [], 0.0
        with stream.output_layers():
            for h, window, teacher in zip(last, windows, teachers):
                h = h.detach().requires_grad_(True)
                with context():
                    logits = stream.head(h)
                part = window_kl(logits, teacher, window)[0] / max(count, 1)
                part.backward()
                grads.append(h.grad)
                loss += float(part.detach())
        for index in reversed(range(stream.n_blocks)):
            block = stream.pruned_block(index)
            below = []
            for h, grad, inp in zip(saved[index], grads, stream.enter_block(inputs, index)):
                x = h.detach().requires_grad_(index > 0)  # block 0's input gradient reaches nothing trained
                with context():
                    out = stream.run(block, self._block_weights(index, block), x, inp.kwargs)
                out.backward(grad)
                below.append(x.grad)
            grads = below
            stream.release(index)
        return loss

    def finish(self, kept: Optional[Dict[str, List[Optional[torch.Tensor]]]], storage: str) -> None:
        if not self.writes:  # another rank writes the shards (and keeps the result)
            return

        def apply(name: str, site: ArmorWeight) -> None:
            if kept is not None:
                stored = core_of(site.tensor)
                a, core, b = (k if k is not None else (t if t is not None else stored).detach()
                              for k, t in zip(kept[name], self.leaves[name]))
                site.write(a, core, b, stored != 0, storage, name)
            self.weights.update(result_tensors({name: site.tensor}, self.train_core))

        self.stream.for_each_layer(apply, write=kept is not None)

    def close(self) -> None:
        """Nothing to undo: no module stays materialized between the student's calls."""

    def result_tensors(self, train_core: bool) -> Dict[str, torch.Tensor]:
        return dict(self.weights)
