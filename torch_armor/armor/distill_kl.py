"""The teacher and the loss of end-to-end distillation (:mod:`torch_armor.armor.distill`): the
dense model's top-``k`` next-token distributions per window, windows sampled from it, and the KL
between those distributions coarsened to ``k`` tokens plus one bin for the rest."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.func import functional_call

from torch_armor.errors import ArmorInputError
from torch_armor.progress import tqdm

__all__ = ["TopK", "Window", "windows_of", "logits_of", "top_k_of", "dense_top_k", "sample_windows", "coarse_kl",
           "window_kl"]

Window = Tuple[torch.Tensor, Optional[torch.Tensor]]


@dataclass
class TopK:
    """The dense model's next-token distribution at every position of one window, cut to its
    ``k`` most likely tokens: ``log_probs`` ``(seq, k)``, ``indices`` ``(seq, k)`` and
    ``log_rest`` ``(seq,)``, the log of the probability of every other token together."""

    log_probs: torch.Tensor
    indices: torch.Tensor
    log_rest: torch.Tensor



def windows_of(batches: Sequence[Any]) -> List[Window]:
    """Calibration batches (``(b, seq)`` ids or ``(ids, mask)`` pairs) as single windows."""
    out: List[Window] = []
    for item in batches:
        ids, mask = item if isinstance(item, (tuple, list)) else (item, None)
        for j in range(ids.shape[0]):
            out.append((ids[j:j + 1], None if mask is None else mask[j:j + 1]))
    return out


def logits_of(model: nn.Module, window: Window, weights: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
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
    return [top_k_of(logits_of(model, window), k)
            for window in tqdm(windows, desc=f"distillation: dense top-{k}", unit="window", disable=not progress)]


def top_k_of(logits: torch.Tensor, k: int) -> TopK:
    """The top-``k`` of the next-token distributions ``softmax(logits)`` (``(seq, vocab)``), on the CPU."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    top = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
    return TopK(top.values.cpu(), top.indices.to(torch.int32).cpu(), _rest(log_probs, top.indices).cpu())


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


def window_kl(logits: torch.Tensor, teacher: TopK, window: Window) -> Tuple[torch.Tensor, int]:
    """Sum of the per-token KL over the window's real (unpadded) positions, and their count."""
    kl = coarse_kl(logits, teacher)
    mask = window[1]
    if mask is None:
        return kl.sum(), kl.numel()
    keep = mask[0].to(device=kl.device, dtype=torch.bool)
    return kl[keep].sum(), int(keep.sum())

