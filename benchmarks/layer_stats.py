"""Real single-layer problems for benchmarks: SmolLM2 weights + sotu activation statistics.

``layer_problem()`` returns, for one decoder layer of SmolLM2-135M, each requested linear's
fp32 weight ``(d_out, d_in)`` and its ``act_sq_norm`` (``Σ x_j²`` over the calibration
tokens, fp32 ``(d_in,)``), calibrated on the sotu text under the quality protocol (random
512-token windows, ``torch.Generator().manual_seed(seed)``). Only that layer's linears are
hooked. Results are cached in ``benchmarks/out/`` (git-ignored); all seven linears of the
layer are stored, so any subset of names hits the cache.

Run ``python benchmarks/layer_stats.py`` to build the default cache and print a summary.

Example::

    from layer_stats import layer_problem
    weight, h = layer_problem(10, names=("q_proj",))["q_proj"]
    # weight: (576, 576) fp32, h: (576,) fp32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_armor.recipes.assets import load_smollm2  # noqa: E402
from torch_armor.recipes.data import calibration_windows  # noqa: E402
from torch_armor.calibration.observer import collect_statistics  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent / "out"
ALL_SHORT_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cache_path(layer_idx: int, n_windows: int, seq_len: int, seed: int) -> Path:
    """Where ``layer_problem`` caches its result."""
    return OUT_DIR / f"layer{layer_idx}_stats_{n_windows}x{seq_len}_seed{seed}.pt"


def _compute(layer_idx: int, n_windows: int, seq_len: int, seed: int) -> dict:
    model, tokenizer = load_smollm2(torch.float32)
    n_layers = model.config.num_hidden_layers
    if not 0 <= layer_idx < n_layers:
        raise ValueError(f"layer_idx must be in [0, {n_layers}), got {layer_idx}")
    prefix = f"model.layers.{layer_idx}."
    full_names = {}
    for name, module in model.named_modules():
        if name.startswith(prefix) and isinstance(module, torch.nn.Linear):
            short = name.rsplit(".", 1)[-1]
            full_names[short] = name
    missing = [s for s in ALL_SHORT_NAMES if s not in full_names]
    if missing:
        raise ValueError(f"layer {layer_idx} has no linears named {missing}; found {sorted(full_names)}")
    windows = calibration_windows("sotu", tokenizer, n_windows=n_windows, seq_len=seq_len, seed=seed)
    stats = collect_statistics(model, list(full_names.values()), windows, batch_size=4)
    modules = dict(model.named_modules())
    problems = {
        short: (
            modules[full].weight.detach().to(torch.float32).clone(),
            stats[full].act_sq_norm.to(torch.float32).cpu().clone(),
        )
        for short, full in full_names.items()
    }
    num_tokens = {short: stats[full].num_tokens for short, full in full_names.items()}
    return {
        "problems": problems,
        "num_tokens": num_tokens,
        "module_names": full_names,
        "protocol": {"layer_idx": layer_idx, "n_windows": n_windows, "seq_len": seq_len, "seed": seed, "source": "sotu"},
    }


def layer_problem(
    layer_idx: int = 10,
    names: Sequence[str] = ("q_proj", "k_proj", "up_proj", "down_proj"),
    n_windows: int = 16,
    seq_len: int = 512,
    seed: int = 0,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{short_name: (weight fp32 (d_out, d_in), act_sq_norm fp32 (d_in,))}`` for one layer.

    ``names`` are short names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj.
    """
    if isinstance(names, str):
        names = (names,)
    unknown = [n for n in names if n not in ALL_SHORT_NAMES]
    if unknown:
        raise ValueError(f"unknown linear names {unknown}; choose from {ALL_SHORT_NAMES}")
    path = cache_path(layer_idx, n_windows, seq_len, seed)
    if path.exists():
        data = torch.load(path, weights_only=True)
    else:
        data = _compute(layer_idx, n_windows, seq_len, seed)
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(data, tmp)
        tmp.replace(path)
    return {n: data["problems"][n] for n in names}


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--n-windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    problems = layer_problem(args.layer, ALL_SHORT_NAMES, args.n_windows, args.seq_len, args.seed)
    data = torch.load(cache_path(args.layer, args.n_windows, args.seq_len, args.seed), weights_only=True)
    print(f"layer {args.layer}: {args.n_windows}x{args.seq_len} sotu windows, seed {args.seed} "
          f"({time.perf_counter() - t0:.1f} s, cache {cache_path(args.layer, args.n_windows, args.seq_len, args.seed)})")
    print(f"{'name':<10} {'weight':>12} {'tokens':>7} {'h min':>10} {'h median':>10} {'h max':>10} {'max/median':>10}")
    for short, (w, h) in problems.items():
        med = h.median().item()
        print(f"{short:<10} {str(tuple(w.shape)):>12} {data['num_tokens'][short]:>7} {h.min().item():>10.4g} "
              f"{med:>10.4g} {h.max().item():>10.4g} {h.max().item() / med:>10.3g}")


if __name__ == "__main__":
    _main()
