"""Token-level perplexity of a causal language model on fixed token windows.

Example::

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                   num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    >>> ppl = perplexity(LlamaForCausalLM(cfg), torch.randint(0, 50, (4, 16)), progress=False)
    >>> 20 < ppl < 100   # a random model is close to uniform over 50 tokens
    True
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torch_armor.errors import ArmorInputError
from torch_armor.progress import tqdm

__all__ = ["perplexity"]


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ArmorInputError(
        f"cannot find logits in the model output of type {type(output).__name__}; the model "
        f"must return a tensor, a tuple starting with logits, or an object with .logits"
    )


def perplexity(
    model: nn.Module,
    windows: torch.Tensor,
    batch_size: int = 8,
    progress: bool = True,
) -> float:
    """Token-level perplexity of ``model`` on ``windows`` (``(n, seq_len)`` token ids).

    Each window is an independent sequence; every token after the first in each window is
    predicted from its prefix, so ``n * (seq_len - 1)`` tokens are scored. The result is
    ``exp(mean NLL)`` over all of them, with the sum of NLLs accumulated in float64.
    Runs under ``torch.no_grad`` in eval mode (the previous mode is restored), ``batch_size``
    windows at a time, on the device of the model's parameters.

    Example::

        >>> class Uniform(torch.nn.Module):
        ...     def forward(self, ids, **kw):
        ...         return torch.zeros(*ids.shape, 10)
        >>> round(perplexity(Uniform(), torch.zeros(2, 5, dtype=torch.long), progress=False), 6)
        10.0
    """
    if not isinstance(windows, torch.Tensor) or windows.dim() != 2:
        raise ArmorInputError(
            "windows must be a 2-D tensor of token ids (n_windows, seq_len), e.g. from "
            f"eval_windows(); got {type(windows).__name__} with shape "
            f"{tuple(getattr(windows, 'shape', ()))}"
        )
    if windows.dtype.is_floating_point or windows.shape[0] == 0:
        raise ArmorInputError(
            f"windows must be a non-empty batch of integer token ids, got dtype {windows.dtype} "
            f"and shape {tuple(windows.shape)}"
        )
    if windows.shape[1] < 2:
        raise ArmorInputError(
            f"each window needs at least 2 tokens (one to predict from, one to score), "
            f"got seq_len={windows.shape[1]}"
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ArmorInputError(f"batch_size must be a positive integer, got {batch_size!r}")

    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    config = getattr(model, "config", None)
    kwargs = {"use_cache": False} if getattr(config, "use_cache", None) is not None else {}

    total_nll = torch.zeros((), dtype=torch.float64)
    total_tokens = 0
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            for start in tqdm(
                range(0, windows.shape[0], batch_size),
                desc="perplexity",
                unit="batch",
                disable=not progress,
            ):
                batch = windows[start : start + batch_size].to(device=device, dtype=torch.long)
                logits = _logits(model(batch, **kwargs))
                pred = logits[:, :-1, :].float()
                target = batch[:, 1:]
                nll = F.cross_entropy(
                    pred.reshape(-1, pred.shape[-1]), target.reshape(-1), reduction="none"
                )
                if not bool(torch.isfinite(nll).all()):
                    raise ArmorInputError(
                        f"the model produced non-finite log-probabilities on windows "
                        f"{start}..{start + batch.shape[0] - 1}; check the weights and dtype"
                    )
                total_nll += nll.double().sum().cpu()
                total_tokens += nll.numel()
    finally:
        model.train(was_training)
    return math.exp(total_nll.item() / total_tokens)
