"""End-to-end distillation: after the block pass, tune every ARMOR layer's wrappers so that the
pruned model's next-token distributions match the dense model's.

Block reconstruction sees one block; errors that pile up across blocks, and how they reach the
logits, are seen only here. With the masks fixed, ``A``, ``B`` (and the kept core values) are
continuous, so Adam on KL(dense ‖ pruned) over the calibration windows applies. The weights
``Ŵ = A · (core ⊙ M) · B`` are built from leaf tensors (``torch.func.functional_call``; the
model is not modified until the end), and the iterate with the lowest KL on held-out windows
(calibration windows never trained on) is written back.

The dense teacher is cached before the block pass prunes the model in place: per token its
``top_k`` log-probabilities, their token ids and the log of the remaining mass
(:func:`dense_top_k`; 64 × 512 tokens at ``top_k=64``: 17 MB, where full fp32 logits of a
49152-token vocabulary would be 6.4 GB). The loss is the KL between the two distributions
coarsened to those ``top_k`` tokens plus one bin for the rest (:func:`coarse_kl`): by the chain
rule of the KL divergence it equals the full KL minus ``p_rest · KL(p(·|rest) ‖ q(·|rest))``, a
lower bound that is exact when ``top_k`` covers the vocabulary.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import nn
from torch.func import functional_call

from torch_armor._io import atomic_write

from torch_armor.core.blockdiag import block_diag_left, block_diag_right
from torch_armor.core.factors import ArmorFactors
from torch_armor.core.levers import DistillConfig
from torch_armor.engine.reconstruct_data import set_scheduled_lr
from torch_armor.errors import ArmorInputError
from torch_armor.progress import tqdm
from torch_armor.tensor.armor_tensor import ArmorTensor, armor_linear_from_factors

__all__ = ["TopK", "Window", "windows_of", "distill_skip_reason", "NO_DISTILL_COST", "dense_top_k", "coarse_kl",
           "sample_windows", "distill_model", "DistillResult", "Distillation", "DISTILLED_NAME", "SAMPLED_NAME"]

logger = logging.getLogger("torch_armor")

#: In a run directory: the distilled wrappers (and cores) of a finished distillation.
DISTILLED_NAME = "distilled.safetensors"
#: In a run directory: the windows sampled from the dense model (a resumed run reuses them).
SAMPLED_NAME = "sampled.safetensors"
#: one calibration window: ``(ids (1, seq), attention mask (1, seq) or None)``
Window = Tuple[torch.Tensor, Optional[torch.Tensor]]


@dataclass
class TopK:
    """The dense model's next-token distribution at every position of one window, cut to its
    ``k`` most likely tokens: ``log_probs`` ``(seq, k)``, ``indices`` ``(seq, k)`` and
    ``log_rest`` ``(seq,)``, the log of the probability of every other token together."""

    log_probs: torch.Tensor
    indices: torch.Tensor
    log_rest: torch.Tensor


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


def windows_of(batches: Sequence[Any]) -> List[Window]:
    """Calibration batches (``(b, seq)`` ids or ``(ids, mask)`` pairs) as single windows."""
    out: List[Window] = []
    for item in batches:
        ids, mask = item if isinstance(item, (tuple, list)) else (item, None)
        for j in range(ids.shape[0]):
            out.append((ids[j:j + 1], None if mask is None else mask[j:j + 1]))
    return out


def _logits(model: nn.Module, window: Window, weights: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
    ids, mask = window
    device = next(p.device for p in model.parameters())
    kwargs = {"attention_mask": mask.to(device)} if mask is not None else {}
    if weights is None:
        out = model(ids.to(device), **kwargs)
    else:
        out = functional_call(model, weights, (ids.to(device),), kwargs, strict=False)
    logits = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)
    return logits[0].float()


def _rest(log_probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """log of the total probability of the tokens not in ``indices`` (``log_probs`` over the vocabulary)."""
    return torch.logsumexp(log_probs.scatter(-1, indices, float("-inf")), dim=-1)


@torch.no_grad()
def dense_top_k(model: nn.Module, windows: Sequence[Window], k: int, progress: bool = False) -> List[TopK]:
    """The model's top-``k`` next-token log-probabilities at every position of each window (run
    it on the dense model, before pruning; ``progress``: a bar per window)."""
    out = []
    for window in tqdm(windows, desc=f"distillation: dense top-{k}", unit="window", disable=not progress):
        log_probs = torch.log_softmax(_logits(model, window), dim=-1)
        top = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
        out.append(TopK(top.values.cpu(), top.indices.to(torch.int32).cpu(), _rest(log_probs, top.indices).cpu()))
    return out


@torch.no_grad()
def sample_windows(model: nn.Module, prompts: Sequence[Window], count: int, seq_len: int, *, seed: int,
                   batch_size: int = 32, prompt_tokens: int = 1, progress: bool = False) -> List[Window]:
    """``count`` windows of ``seq_len`` tokens sampled from ``model`` (a transformers causal LM) at
    temperature 1 from its whole next-token distribution, the end-of-text token included (sampling
    goes on past it). Window ``i`` starts with the first ``prompt_tokens`` tokens of
    ``prompts[i % len(prompts)]``; the draws come from one CPU generator seeded with ``seed``.
    ``progress``: a bar per window, its status the token being sampled."""
    if not callable(getattr(model, "generate", None)):
        raise ArmorInputError(f"DistillConfig.sampled_windows: {type(model).__name__} is not a transformers causal LM "
                              "(no generate()), so windows cannot be sampled from it; set sampled_windows=0")
    shortest = min(int(w[0].shape[1]) for w in prompts)
    if not 1 <= prompt_tokens < seq_len or prompt_tokens > shortest:
        raise ArmorInputError(f"DistillConfig.sample_prompt_tokens={prompt_tokens} must be at least 1, below the "
                              f"window length {seq_len} and within the shortest calibration window ({shortest} "
                              "tokens): lower it or calibrate on longer windows")
    device = next(p.device for p in model.parameters())
    # transformers 5 renamed the key/value cache argument from past_key_values to cache
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    gen = torch.Generator().manual_seed(seed)
    out: List[Window] = []
    bar = tqdm(total=count, desc="distillation: sampling windows", unit="window", disable=not progress)
    for start in range(0, count, batch_size):
        n = min(batch_size, count - start)
        tokens = [torch.cat([prompts[(start + i) % len(prompts)][0][:, :prompt_tokens] for i in range(n)]).to(device)]
        step = model(tokens[0], use_cache=True)
        for position in range(tokens[0].shape[1], seq_len):
            bar.set_postfix_str(f"token {position + 1}/{seq_len}", refresh=False)
            probs = torch.softmax(step.logits[:, -1].float(), dim=-1).cpu()
            tokens.append(torch.multinomial(probs, 1, generator=gen).to(device))
            if position < seq_len - 1:
                cache = step.cache if getattr(step, "cache", None) is not None else step.past_key_values
                step = model(tokens[-1], **{cache_kwarg: cache}, use_cache=True)
        ids = torch.cat(tokens, dim=1).cpu()
        out.extend((ids[j:j + 1], None) for j in range(n))
        bar.update(n)
    bar.close()
    return out


def coarse_kl(logits: torch.Tensor, teacher: TopK) -> torch.Tensor:
    """Per position, KL(teacher ‖ softmax(logits)) over the teacher's ``k`` tokens and one bin for
    the rest (nats). ``logits``: ``(seq, vocab)``."""
    log_q = torch.log_softmax(logits, dim=-1)
    idx = teacher.indices.to(device=logits.device, dtype=torch.long)
    log_p = teacher.log_probs.to(logits.device)
    log_p_rest = teacher.log_rest.to(logits.device)
    kept = (log_p.exp() * (log_p - log_q.gather(-1, idx))).sum(-1)
    if idx.shape[-1] >= logits.shape[-1]:  # the whole vocabulary: no rest (its logsumexp over nothing has no gradient)
        return kept
    rest = torch.where(torch.isfinite(log_p_rest), log_p_rest.exp() * (log_p_rest - _rest(log_q, idx)),
                       torch.zeros_like(log_p_rest))
    return kept + rest


def _mean_kl(logits: torch.Tensor, teacher: TopK, window: Window) -> Tuple[torch.Tensor, int]:
    """Sum of the per-token KL over the window's real (unpadded) positions, and their count."""
    kl = coarse_kl(logits, teacher)
    mask = window[1]
    if mask is None:
        return kl.sum(), kl.numel()
    keep = mask[0].to(device=kl.device, dtype=torch.bool)
    return kl[keep].sum(), int(keep.sum())


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


def _armor_layers(model: nn.Module) -> Dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m._parameters.get("weight"), ArmorTensor)}


def distill_model(model: nn.Module, windows: Sequence[Window], teacher: Dict[int, TopK], config: DistillConfig, *,
                  seed: int = 0, storage: str = "dense", sampled: Sequence[Window] = (),
                  log: Optional[Callable[[str], None]] = None, progress: bool = False) -> DistillResult:
    """Adam on the ARMOR layers of ``model`` (pruned in place) towards ``teacher`` (``progress``: a bar
    per step, its status the last held-out KL).

    Args:
        model: a causal LM whose pruned linears hold :class:`ArmorTensor` weights.
        windows: the calibration windows; the last ``config.held_out`` are held out.
        teacher: :func:`dense_top_k` of the dense model, by window index (the held-out windows and
            every training window the steps reach).
        config: steps, learning rate and its schedule, micro-batch, held-out windows, ``train_core``.
        seed: the order of the training windows.
        storage: the core storage of the weights written back (as the block pass used).
        sampled: windows sampled from the dense model (:func:`sample_windows`), trained on besides
            the calibration windows and indexed after them in ``teacher``; never held out.

    Returns:
        :class:`DistillResult`; the model's ARMOR weights hold the kept iterate (masks unchanged,
        bit-identical weights when no step lowered the held-out KL).
    """
    start = time.perf_counter()
    layers = _armor_layers(model)
    if not layers:
        raise ArmorInputError("distillation: the model has no ARMOR layers (nothing was pruned with ArmorConfig)")
    held, train = held_out_split(len(windows), config, len(sampled))
    windows = [*windows, *sampled]
    leaves: Dict[str, List[torch.Tensor]] = {}
    masks: Dict[str, torch.Tensor] = {}
    groups = []
    for name, module in layers.items():
        w = module.weight
        core = w.core_dense().detach().float()
        masks[name] = core != 0
        tensors = [t.detach().float().clone(memory_format=torch.contiguous_format) for t in (w.a_blocks, core, w.b_blocks)]
        leaves[name] = tensors
        for j, t in enumerate(tensors):
            if j == 1 and not config.train_core:
                continue
            t.requires_grad_(True)
            scale = float(t.detach().square().mean().sqrt()) or 1.0
            groups.append({"params": [t], "lr": config.lr * scale})
    optimizer = torch.optim.Adam(groups)
    peaks = [g["lr"] for g in optimizer.param_groups]
    warmup_steps = round(config.warmup * config.steps)
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)

    def weights() -> Dict[str, torch.Tensor]:
        return {f"{name}.weight": block_diag_right(block_diag_left(a, core * masks[name]), b)
                for name, (a, core, b) in leaves.items()}

    def held_out_kl() -> float:
        total, count = 0.0, 0
        with torch.no_grad():
            w = weights()
            for j in held:
                s, n = _mean_kl(_logits(model, windows[j], w), teacher[j], windows[j])
                total, count = total + float(s), count + n
        return total / max(count, 1)

    def snapshot() -> Dict[str, List[torch.Tensor]]:
        return {name: [t.detach().clone() for t in ts] for name, ts in leaves.items()}

    bar = tqdm(total=config.steps, desc="distillation", unit="step", disable=not progress)
    try:
        before = best = held_out_kl()
        kept, best_step = None, 0
        curve = [(0, before)]
        (log or logger.info)(f"distillation: held-out KL {before:.5f} nats/token before ({len(held)} windows)")
        order = training_order(len(train), config, seed)
        step_context = training_autocast(next(p.device for p in model.parameters()), config, log or logger.info)
        for step in range(1, config.steps + 1):
            optimizer.zero_grad(set_to_none=True)
            set_scheduled_lr(optimizer, peaks, step, config.steps, warmup_steps, config.decay)
            chosen = [train[i] for i in order[(step - 1) * config.windows_per_step:step * config.windows_per_step]]
            count = sum(int(windows[j][1].sum()) if windows[j][1] is not None else windows[j][0].shape[1]
                        for j in chosen)
            loss = 0.0
            for j in chosen:  # one window's graph at a time (its full-vocabulary logits are the big tensors)
                with step_context():
                    logits = _logits(model, windows[j], weights())
                part, _ = _mean_kl(logits, teacher[j], windows[j])
                part = part / max(count, 1)
                part.backward()
                loss += float(part.detach())
            optimizer.step()
            bar.update(1)
            if step % config.eval_every == 0 or step == config.steps:
                kl = held_out_kl()
                bar.set_postfix_str(f"held-out KL {kl:.5f}")
                curve.append((step, kl))
                (log or logger.info)(f"distillation step {step}/{config.steps}: train KL {loss:.5f}, "
                                     f"held-out KL {kl:.5f}")
                if kl < best:
                    best, kept, best_step = kl, snapshot(), step
    finally:
        bar.close()  # in a log: one line, or where it stopped
        for p in frozen:
            p.requires_grad_(True)
    if kept is not None:
        for name, module in layers.items():
            a, core, b = kept[name]
            w = module.weight
            factors = ArmorFactors(a.to(w.dtype), (core * masks[name]).to(w.dtype), b.to(w.dtype), masks[name],
                                   w.pattern)
            armor_linear_from_factors(module, factors, storage=storage, name=name)
    return DistillResult(before, best, best_step, curve, time.perf_counter() - start)


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


#: what skipping distillation costs, from the ablation in docs/results.md ("Each lever on alone and off alone")
NO_DISTILL_COST = "on SmolLM2-135M the default without it measured 41.13 Wikipedia perplexity, with it 34.87"


def distill_skip_reason(config: DistillConfig, *, n_windows: int, streamed: bool, world_size: int) -> str:
    """Why :func:`~torch_armor.prune_model` cannot distill here (``""``: it can): distillation trains
    the whole pruned model in one process and needs training windows besides the held-out ones."""
    if streamed:
        return "it trains the whole pruned model and needs it in memory (load the model and pass the module)"
    if world_size > 1:
        return "it runs in one process (run without torchrun)"
    if n_windows <= config.held_out:
        return (f"{n_windows} calibration windows leave none to train on besides the {config.held_out} held-out ones "
                "(give more windows or lower DistillConfig.held_out)")
    return ""


class Distillation:
    """:func:`~torch_armor.prune_model`'s distillation: the dense teacher cached before the block
    pass (:meth:`capture`), the training after it (:meth:`run`), and, with a run directory, the
    finished result in :data:`DISTILLED_NAME` — written atomically once distillation ends, so a
    resumed run applies it instead of distilling again and a crash loses at most the distillation.
    """

    def __init__(self, config: DistillConfig, batches: Sequence[Any], *, seed: int = 0,
                 run_dir: Optional[Path] = None, identity: str = "", storage: str = "dense",
                 log: Optional[Callable[[str], None]] = None, progress: bool = False) -> None:
        self.config, self.seed, self.storage, self.log = config, seed, storage, log or logger.info
        self.progress = progress
        self.windows = windows_of(batches)
        self.needed = windows_needed(len(self.windows), config, seed, config.sampled_windows)  # checks held_out first
        self.sampled: List[Window] = []
        self.path = None if run_dir is None else Path(run_dir) / DISTILLED_NAME
        self.identity = json.dumps({"run": identity, "distill": asdict(config), "seed": seed}, sort_keys=True)
        self.teacher: Dict[int, TopK] = {}
        self.teacher_seconds = 0.0

    def _finished(self) -> bool:
        if self.path is None or not self.path.exists():
            return False
        with safe_open(str(self.path), framework="pt") as fh:
            return (fh.metadata() or {}).get("identity") == self.identity

    def capture(self, model: nn.Module) -> None:
        """Sample windows from the dense model (``sampled_windows``; a resumed run reads the run
        directory's) and cache its top-k distributions on the windows distillation reads (skipped
        when the run directory holds a finished distillation)."""
        start = time.perf_counter()
        if self.config.sampled_windows:
            self.sampled = self._sampled_windows(model)
        if self._finished():
            return
        every = [*self.windows, *self.sampled]
        tops = dense_top_k(model, [every[j] for j in self.needed], self.config.top_k, progress=self.progress)
        self.teacher = dict(zip(self.needed, tops))
        self.teacher_seconds = time.perf_counter() - start
        self.log(f"distillation: dense top-{self.config.top_k} cached on {len(self.needed)} windows "
                 f"({self.teacher_seconds:.0f} s)")

    def _sampled_windows(self, model: nn.Module) -> List[Window]:
        path = None if self.path is None else self.path.parent / SAMPLED_NAME
        if path is not None and path.exists():
            with safe_open(str(path), framework="pt") as fh:
                if (fh.metadata() or {}).get("identity") == self.identity:
                    return windows_of([fh.get_tensor("ids")])
        start = time.perf_counter()
        _, train = held_out_split(len(self.windows), self.config)
        sampled = sample_windows(model, [self.windows[j] for j in train], self.config.sampled_windows,
                                 max(w[0].shape[1] for w in self.windows), seed=self.seed,
                                 prompt_tokens=self.config.sample_prompt_tokens, progress=self.progress)
        self.log(f"distillation: {len(sampled)} windows sampled from the dense model "
                 f"({time.perf_counter() - start:.0f} s)")
        if path is not None:
            ids = torch.cat([w[0] for w in sampled]).contiguous()
            atomic_write(path, save({"ids": ids}, metadata={"identity": self.identity}))
        return sampled

    def block_pass_batches(self, batches: Sequence[Any], batch_size: int) -> Tuple[List[Any], int]:
        """The block pass's calibration batches and how many sampled windows lead them: with
        ``sampled_in_block_pass``, the sampled windows (after :meth:`capture`) in batches of
        ``batch_size`` before ``batches`` (with all-ones attention masks when ``batches`` carry
        masks); else ``batches`` as they are."""
        if not (self.config.sampled_in_block_pass and self.sampled):
            return list(batches), 0
        ids = torch.cat([w[0] for w in self.sampled])
        masked = any(isinstance(b, (tuple, list)) for b in batches)
        lead = [(part, torch.ones_like(part, dtype=torch.bool)) if masked else part for part in ids.split(batch_size)]
        self.log(f"block pass: {len(self.sampled)} sampled windows calibrate it besides the {len(self.windows)} "
                 "calibration windows")
        return [*lead, *batches], len(self.sampled)

    def run(self, model: nn.Module) -> Dict[str, Any]:
        """Distill ``model`` (pruned, in place), or apply the run directory's finished result;
        returns the report's ``distill`` entry."""
        if self._finished():
            return self._apply_saved(model)
        if not self.teacher:
            raise ArmorInputError("distillation: Distillation.capture(dense model) must run before the block pass")
        result = distill_model(model, self.windows, self.teacher, self.config, seed=self.seed, storage=self.storage,
                               sampled=self.sampled, log=self.log, progress=self.progress)
        result.teacher_seconds = self.teacher_seconds
        summary = {"before": result.before, "after": result.after, "best_step": result.best_step,
                   "curve": [list(c) for c in result.curve], "seconds": result.seconds,
                   "teacher_seconds": result.teacher_seconds}
        self.log(f"distillation: held-out KL {result.before:.5f} -> {result.after:.5f} (step {result.best_step}, "
                 f"{result.seconds:.0f} s)")
        if self.path is not None:
            tensors = {}
            for name, module in _armor_layers(model).items():
                w = module.weight
                tensors[f"{name}.a_blocks"] = w.a_blocks.detach().contiguous()
                tensors[f"{name}.b_blocks"] = w.b_blocks.detach().contiguous()
                if self.config.train_core:
                    tensors[f"{name}.core"] = w.core_dense().detach().contiguous()
            atomic_write(self.path, save(tensors, metadata={"identity": self.identity, "summary": json.dumps(summary)}))
        return summary

    def _apply_saved(self, model: nn.Module) -> Dict[str, Any]:
        with safe_open(str(self.path), framework="pt") as fh:
            keys = set(fh.keys())
            for name, module in _armor_layers(model).items():
                w = module.weight
                core = fh.get_tensor(f"{name}.core") if f"{name}.core" in keys else w.core_dense().detach()
                factors = ArmorFactors(fh.get_tensor(f"{name}.a_blocks"), core, fh.get_tensor(f"{name}.b_blocks"),
                                       w.core_dense() != 0, w.pattern)
                armor_linear_from_factors(module, factors, storage=self.storage, name=name)
            summary = json.loads((fh.metadata() or {})["summary"])
        self.log(f"distillation already finished in {self.path.parent}: applied")
        return summary
