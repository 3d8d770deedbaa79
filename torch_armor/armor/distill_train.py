"""The training loop of end-to-end distillation (:mod:`torch_armor.armor.distill`), one for every
student: Adam on the ARMOR layers' wrappers (and cores) — linears' and every fused expert's — towards
the teacher, the held-out KL every ``eval_every`` steps, the best iterate kept; resumable at a step
boundary from a state file."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

from torch_armor._io import atomic_write
from torch_armor.calibration.experts import transposed_experts

from torch_armor.core.blockdiag import block_diag_left, block_diag_right
from torch_armor.core.factors import ArmorFactors
from torch_armor.config.levers import DistillConfig
from torch_armor.armor.distill_kl import TopK, Window, logits_of, window_kl
from torch_armor.armor.reconstruct_data import set_scheduled_lr
from torch_armor.errors import ArmorInputError
from torch_armor.progress import tqdm
from torch_armor.tensor.armor_tensor import ArmorTensor, armor_linear_from_factors
from torch_armor.tensor.experts import armor_experts_from_factors

__all__ = ["DistillResult", "fast_bf16", "training_autocast", "ArmorWeight", "armor_layers", "core_of", "layer_weight",
           "float_leaves", "Student",
           "InMemoryStudent", "result_tensors", "TrainingState", "distill_model", "summed_over_ranks",
           "gradients_summed_over_ranks", "held_out_split", "training_order", "windows_needed"]

logger = logging.getLogger("torch_armor")


@dataclass
class DistillResult:
    """``before``/``after``: the held-out KL (nats per token) of the pruned model before
    distillation and of the kept iterate; ``curve``: ``(step, held-out KL)`` at every check;
    ``best_step``: the kept iterate (0: none helped, the model is unchanged)."""

    before: float
    after: float
    best_step: int = 0
    curve: List[Tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    teacher_seconds: float = 0.0


def fast_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices natively (CUDA with bf16 support; a CPU
    with oneDNN's bf16 kernels, e.g. AVX512-BF16 or AMX): where bfloat16 autocast saves time."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):
            return False
    return False


def training_autocast(device: torch.device, config: DistillConfig, log: Callable[[str], None]):
    """The context of a training step's forward: bfloat16 autocast when ``config.bf16_steps`` and
    the device has fast bfloat16, else none (with one log line when asked for but unavailable)."""
    if not config.bf16_steps:
        return contextlib.nullcontext
    if not fast_bf16(device):
        log(f"distillation: bf16_steps asked for, but {device.type} has no fast bfloat16 matrix products: "
            "the steps run in float32")
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


@dataclass(frozen=True)
class ArmorWeight:
    """An ARMOR weight distillation trains: a linear's ``weight`` (:class:`ArmorTensor`) or a fused
    experts parameter (an ``(E, d_out, d_in)`` :class:`ArmorTensor`, every expert's parts
    stacked along a leading dimension), ``module.<attr>``; ``param`` is its parameter path in the
    model that :func:`armor_layers` was called on (the key ``functional_call`` replaces)."""

    module: nn.Module
    attr: str
    param: str

    @property
    def tensor(self) -> ArmorTensor:
        return self.module._parameters[self.attr]

    def dense(self, a: torch.Tensor, core: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The weight ``A · (core ⊙ M) · B`` as the module's forward takes a dense one: a fused
        parameter of a transposed experts module (gpt-oss, Llama-4) as ``(E, in, out)``."""
        w = layer_weight(a, core, b, mask)
        return w.transpose(-1, -2) if w.dim() == 3 and transposed_experts(self.module) else w

    def write(self, a: torch.Tensor, core: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, storage: str,
              name: str) -> None:
        """Replace the weight by the ARMOR weight of ``a``, ``core ⊙ mask``, ``b`` (its dtype and pattern kept)."""
        w = self.tensor
        a, core, b = (t.to(device=w.device, dtype=w.dtype) for t in (a, core * mask, b))
        if w.num_experts is not None:
            armor_experts_from_factors(self.module, self.attr,
                                       [ArmorFactors(a[e], core[e], b[e], mask[e], w.pattern) for e in range(len(a))],
                                       storage=storage, name=name)
        else:
            armor_linear_from_factors(self.module, ArmorFactors(a, core, b, mask, w.pattern), storage=storage,
                                      name=name)


def armor_layers(model: nn.Module) -> Dict[str, ArmorWeight]:
    """Every ARMOR weight of ``model`` by layer name: a linear's module name, a fused experts
    parameter's path (``model.layers.0.mlp.experts.gate_up_proj``)."""
    out = {}
    for name, m in model.named_modules():
        for attr, p in m._parameters.items():
            if isinstance(p, ArmorTensor) and (p.num_experts is not None or attr == "weight"):
                path = f"{name}.{attr}" if name else attr
                out[name if attr == "weight" else path] = ArmorWeight(m, attr, path)
    return out


def core_of(weight: ArmorTensor) -> torch.Tensor:
    """The dense ``core ⊙ M`` of an ARMOR weight (``(E, out, in)`` for fused experts)."""
    if weight.num_experts is not None:
        return torch.stack([w.core_dense() for w in weight.experts()])
    return weight.core_dense()


def _one_weight(a: torch.Tensor, core: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return block_diag_right(block_diag_left(a, core), b)


def layer_weight(a: torch.Tensor, core: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``A · (core ⊙ M) · B`` as a dense matrix, differentiable in ``a``, ``core`` and ``b``; with a
    leading experts dimension (``a`` 4-D) one matrix per expert."""
    if a.dim() == 4:
        return torch.vmap(_one_weight)(a, core * mask, b)
    return _one_weight(a, core * mask, b)


def float_leaves(weight: ArmorTensor, train_core: bool,
                 keep_core: bool = True) -> List[Optional[torch.Tensor]]:
    """``[a, core, b]`` of an ARMOR weight as float32 copies, ``a`` and ``b`` (and the core with
    ``train_core``) requiring gradients; the core ``None`` when neither trained nor ``keep_core``."""
    core = core_of(weight).detach().float() if train_core or keep_core else None
    out = [t.detach().float().clone(memory_format=torch.contiguous_format) if t is not None else None
           for t in (weight.a_blocks, core, weight.b_blocks)]
    for j, t in enumerate(out):
        if t is not None and (j != 1 or train_core):
            t.requires_grad_(True)
    return out


class Student(Protocol):
    """The pruned model being distilled. ``leaves``: per ARMOR layer ``[a, core, b]`` in float32,
    resident for the whole run (the tensors that require gradients are the ones trained; a core that
    is not trained may be ``None`` and read when needed)."""

    leaves: Dict[str, List[Optional[torch.Tensor]]]

    def kl_sum(self, windows: Sequence[Window], teachers: Sequence[TopK]) -> Tuple[float, int]:
        """The summed per-token KL over the windows' real positions and their count (no gradients)."""

    def backward(self, windows: Sequence[Window], teachers: Sequence[TopK], count: int,
                 context: Callable[[], Any]) -> float:
        """Accumulate the gradients of ``Σ KL / count`` into the trained leaves; returns that value."""

    def finish(self, kept: Optional[Dict[str, List[Optional[torch.Tensor]]]], storage: str) -> None:
        """Write ``kept`` (trained tensors by layer; ``None`` entries: unchanged) into the model."""

    def close(self) -> None:
        """Give back what the student holds, leaving the model as it was (after an interruption)."""

    def result_tensors(self, train_core: bool) -> Dict[str, torch.Tensor]:
        """After :meth:`finish`: every ARMOR layer's ``a_blocks``, ``b_blocks`` (and ``core``) as the model holds them."""


class InMemoryStudent:
    """A pruned model in memory: its ARMOR weights replaced by ``A · (core ⊙ M) · B`` from the
    leaves (``torch.func.functional_call``; the model is not modified until :meth:`finish`)."""

    def __init__(self, model: nn.Module, config: DistillConfig) -> None:
        self.model = model
        self.layers = armor_layers(model)
        if not self.layers:
            raise ArmorInputError("distillation: the model has no ARMOR layers (nothing was pruned with ArmorConfig)")
        self.leaves = {name: float_leaves(site.tensor, config.train_core) for name, site in self.layers.items()}
        self.masks = {name: ts[1] != 0 for name, ts in self.leaves.items()}
        self.frozen = [p for p in model.parameters() if p.requires_grad]
        for p in self.frozen:
            p.requires_grad_(False)

    def _weights(self) -> Dict[str, torch.Tensor]:
        return {self.layers[name].param: self.layers[name].dense(a, core, b, self.masks[name])
                for name, (a, core, b) in self.leaves.items()}

    @torch.no_grad()
    def kl_sum(self, windows: Sequence[Window], teachers: Sequence[TopK]) -> Tuple[float, int]:
        total, count, weights = 0.0, 0, self._weights()
        for window, teacher in zip(windows, teachers):
            s, n = window_kl(logits_of(self.model, window, weights), teacher, window)
            total, count = total + float(s), count + n
        return total, count

    def backward(self, windows: Sequence[Window], teachers: Sequence[TopK], count: int,
                 context: Callable[[], Any]) -> float:
        loss = 0.0
        for window, teacher in zip(windows, teachers):  # one window's graph at a time (its logits are the big tensors)
            with context():
                logits = logits_of(self.model, window, self._weights())
            part = window_kl(logits, teacher, window)[0] / max(count, 1)
            part.backward()
            loss += float(part.detach())
        return loss

    def close(self) -> None:
        for p in self.frozen:
            p.requires_grad_(True)

    def finish(self, kept: Optional[Dict[str, List[Optional[torch.Tensor]]]], storage: str) -> None:
        self.close()
        if kept is None:
            return
        for name, site in self.layers.items():
            a, core, b = (k if k is not None else t.detach() for k, t in zip(kept[name], self.leaves[name]))
            site.write(a, core, b, self.masks[name], storage, name)

    def result_tensors(self, train_core: bool) -> Dict[str, torch.Tensor]:
        return result_tensors({name: site.tensor for name, site in self.layers.items()}, train_core)


def result_tensors(weights: Dict[str, ArmorTensor], train_core: bool) -> Dict[str, torch.Tensor]:
    """What a finished distillation keeps of each ARMOR weight (by layer name): its wrappers, and its
    core when trained."""
    tensors = {}
    for name, w in weights.items():
        tensors[f"{name}.a_blocks"] = w.a_blocks.detach().contiguous()
        tensors[f"{name}.b_blocks"] = w.b_blocks.detach().contiguous()
        if train_core:
            tensors[f"{name}.core"] = core_of(w).detach().contiguous()
    return tensors


class TrainingState:
    """A distillation's state at a step boundary in one file (written atomically after every step):
    the trained tensors, Adam's moments, the kept iterate and the curve, bound to ``identity``."""

    def __init__(self, path: Path, identity: str) -> None:
        self.path, self.identity = path, identity

    def save(self, step: int, trained: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
             kept: Optional[List[torch.Tensor]], record: Dict[str, Any]) -> None:
        tensors = {f"param.{i:06d}": t.detach().contiguous() for i, t in enumerate(trained)}
        for i, moments in optimizer.state_dict()["state"].items():
            tensors.update({f"adam.{i:06d}.{key}": v.detach().reshape(v.shape).contiguous() for key, v in moments.items()})
        tensors.update({f"kept.{i:06d}": t.contiguous() for i, t in enumerate(kept or [])})
        meta = {"identity": self.identity, "record": json.dumps(dict(record, step=step, kept=kept is not None))}
        atomic_write(self.path, save(tensors, metadata=meta))

    def load(self, trained: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> Optional[Tuple[Dict[str, Any], Optional[List[torch.Tensor]]]]:
        """Restore the tensors and Adam's state; returns ``(record, kept)``, or ``None`` when there is no
        state of this run."""
        if not self.path.exists():
            return None
        with safe_open(str(self.path), framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("identity") != self.identity:
                return None
            record = json.loads(meta["record"])
            with torch.no_grad():
                for i, t in enumerate(trained):
                    t.copy_(fh.get_tensor(f"param.{i:06d}"))
            state = optimizer.state_dict()
            moments: Dict[int, Dict[str, torch.Tensor]] = {}
            for key in fh.keys():
                if key.startswith("adam."):
                    _, i, name = key.split(".")
                    moments.setdefault(int(i), {})[name] = fh.get_tensor(key)
            state["state"] = moments
            optimizer.load_state_dict(state)
            kept = [fh.get_tensor(f"kept.{i:06d}") for i in range(len(trained))] if record["kept"] else None
        return record, kept

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def distill_model(student: Student, windows: Sequence[Window], teacher: Dict[int, TopK], config: DistillConfig, *,
                  seed: int = 0, storage: str = "dense", sampled: Sequence[Window] = (), device: torch.device,
                  state: Optional[TrainingState] = None, log: Optional[Callable[[str], None]] = None,
                  progress: bool = False, rank: int = 0, world_size: int = 1) -> DistillResult:
    """Adam on the trained leaves of ``student`` towards ``teacher`` (``progress``: a bar per step,
    its status the last held-out KL).

    Args:
        student: the pruned model (:class:`InMemoryStudent`, or one streamed block by block).
        windows: the calibration windows; the last ``config.held_out`` are held out.
        teacher: the dense model's top-k by window index (the held-out windows and every training
            window the steps reach).
        config: steps, learning rate and its schedule, micro-batch, held-out windows, ``train_core``.
        seed: the order of the training windows.
        storage: the core storage of the weights written back (as the block pass used).
        sampled: windows sampled from the dense model, trained on besides the calibration windows and
            indexed after them in ``teacher``; never held out.
        device: where the steps run (bfloat16 autocast is chosen for it).
        state: where the state at each step boundary is kept; a run with a saved state resumes from it.
        rank, world_size: under ``torchrun``, data-parallel over the windows: each rank runs every
            ``world_size``-th window of each step (and of the held-out ones), the gradients and the
            KL sums are summed over the ranks (``torch.distributed.all_reduce``), so every rank takes
            the same steps, equal to one process's up to the order of the sums; rank 0 keeps the state.

    Returns:
        :class:`DistillResult`; the student's model holds the kept iterate (masks unchanged,
        bit-identical weights when no step lowered the held-out KL).
    """
    start = time.perf_counter()
    log = log or logger.info
    held, train = held_out_split(len(windows), config, len(sampled))
    windows = [*windows, *sampled]
    trained = [t for ts in student.leaves.values() for t in ts if t is not None and t.requires_grad]
    optimizer = torch.optim.Adam([{"params": [t], "lr": config.lr * (float(t.detach().square().mean().sqrt()) or 1.0)}
                                  for t in trained])
    peaks = [g["lr"] for g in optimizer.param_groups]
    warmup_steps = round(config.warmup * config.steps)

    def held_out_kl() -> float:
        mine = held[rank::world_size]
        total, count = student.kl_sum([windows[j] for j in mine], [teacher[j] for j in mine]) if mine else (0.0, 0)
        total, count = summed_over_ranks([total, count], world_size)
        return total / max(count, 1)

    bar = tqdm(total=config.steps, desc="distillation", unit="step", disable=not progress)
    kept: Optional[List[torch.Tensor]] = None
    try:
        restored = state.load(trained, optimizer) if state is not None else None
        if restored is None:
            before = held_out_kl()
            record = {"before": before, "best": before, "best_step": 0, "curve": [[0, before]], "step": 0}
            log(f"distillation: held-out KL {before:.5f} nats/token before ({len(held)} windows)")
        else:
            record, kept = restored
            log(f"distillation: resuming after step {record['step']} of {config.steps}")
            bar.update(record["step"])
        order = training_order(len(train), config, seed)
        step_context = training_autocast(device, config, log)
        for step in range(record["step"] + 1, config.steps + 1):
            optimizer.zero_grad(set_to_none=True)
            set_scheduled_lr(optimizer, peaks, step, config.steps, warmup_steps, config.decay)
            chosen = [train[i] for i in order[(step - 1) * config.windows_per_step:step * config.windows_per_step]]
            count = sum(int(windows[j][1].sum()) if windows[j][1] is not None else windows[j][0].shape[1]
                        for j in chosen)
            mine = chosen[rank::world_size]
            loss = student.backward([windows[j] for j in mine], [teacher[j] for j in mine], count,
                                    step_context) if mine else 0.0
            loss = gradients_summed_over_ranks(trained, loss, world_size)
            optimizer.step()
            bar.update(1)
            if step % config.eval_every == 0 or step == config.steps:
                kl = held_out_kl()
                bar.set_postfix_str(f"held-out KL {kl:.5f}")
                record["curve"].append([step, kl])
                log(f"distillation step {step}/{config.steps}: train KL {loss:.5f}, held-out KL {kl:.5f}")
                if kl < record["best"]:
                    record.update(best=kl, best_step=step)
                    kept = [t.detach().clone() for t in trained]
            if state is not None and rank == 0:
                state.save(step, trained, optimizer, kept, record)
            record["step"] = step
    except BaseException:
        student.close()  # the model as it was (a resumed run starts from the saved state)
        raise
    finally:
        bar.close()  # in a log: one line, or where it stopped
    by_layer = None
    if kept is not None:
        it = iter(kept)
        by_layer = {name: [next(it) if t is not None and t.requires_grad else None for t in ts]
                    for name, ts in student.leaves.items()}
    student.finish(by_layer, storage)
    return DistillResult(record["before"], record["best"], record["best_step"], [tuple(c) for c in record["curve"]],
                         time.perf_counter() - start)


def summed_over_ranks(values: Sequence[float], world_size: int) -> List[float]:
    """``values`` summed over the ranks of the process group (as they are in one process)."""
    if world_size == 1:
        return list(values)
    buffer = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(buffer)
    return buffer.tolist()


def gradients_summed_over_ranks(trained: Sequence[torch.Tensor], loss: float, world_size: int) -> float:
    """Every trained tensor's gradient (and the step's loss) summed over the ranks, in one all-reduce."""
    if world_size == 1:
        return loss
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in trained]
    buffer = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor([loss], dtype=grads[0].dtype,
                                                                      device=grads[0].device)])
    dist.all_reduce(buffer)
    start = 0
    for t, g in zip(trained, grads):
        t.grad = buffer[start:start + g.numel()].view_as(t).clone()
        start += g.numel()
    return float(buffer[-1])


def held_out_split(n_windows: int, config: DistillConfig, n_sampled: int = 0) -> Tuple[List[int], List[int]]:
    """``(held-out, training)`` window indices: the last ``config.held_out`` of the ``n_windows``
    calibration windows are held out; the ``n_sampled`` sampled windows (indexed after them) train."""
    if config.held_out >= n_windows:
        raise ArmorInputError(f"DistillConfig.held_out={config.held_out} leaves no training window among the "
                              f"{n_windows} calibration windows: lower held_out or give more calibration windows")
    return (list(range(n_windows - config.held_out, n_windows)),
            [*range(n_windows - config.held_out), *range(n_windows, n_windows + n_sampled)])


def training_order(n_train: int, config: DistillConfig, seed: int) -> List[int]:
    """Positions into the training windows, ``steps × windows_per_step`` of them: seeded epochs."""
    need = config.steps * config.windows_per_step
    gen = torch.Generator().manual_seed(seed)
    order: List[int] = []
    while len(order) < need:
        order += torch.randperm(n_train, generator=gen).tolist()
    return order[:need]


def windows_needed(n_windows: int, config: DistillConfig, seed: int, n_sampled: int = 0) -> List[int]:
    """The windows whose teacher distillation reads: the held-out ones and every training window reached."""
    held, train = held_out_split(n_windows, config, n_sampled)
    return sorted(set(held) | {train[i] for i in training_order(len(train), config, seed)})


