"""The measurements of ``gpu_check.py --quick``: Llama-3-8B-shaped layers, an 8B-shaped model, a GPU prune.

Each step is a generator of rows (plain dicts) so that ``gpu_check.py`` writes every row the moment it
is measured; one failing row is a row with a ``note``, the rest go on.

* :func:`layer_rows`: ``F.linear`` at the three Llama-3-8B shapes (4096x4096, 14336x4096, 4096x14336)
  and 1, 16, 256, 2048 tokens, bf16, eager: ``dense`` (``A·core·B`` as one matrix), ``2:4`` (torch's own
  ``to_sparse_semi_structured`` of the same 2:4 core: the same masks), ``armor bmm`` (the wrappers as
  batched matmuls) and ``armor fused`` (the wrappers as the Triton kernels), each checked against the
  dense product of its own weights.
* :func:`model_rows`: a random-weight Llama-3-8B-shaped model (hidden 4096, MLP 14336, 32 heads, 8 kv
  heads, vocab 128256) with ``--layers`` decoder layers: prefill 2048 tokens, and 128 decode steps at
  batch 1 and 16 with transformers' static cache, eager and replayed from a CUDA graph, for dense /
  plain 2:4 / ARMOR linears.
* :func:`prune_rows`: the default ARMOR prune (``ArmorConfig()``) of one 8B-shaped decoder block on
  the GPU (64 x 512 random calibration tokens), projected to 8B (32 blocks) and 70B (80 blocks, 3.93x
  the parameters per block) assuming time proportional to parameters: a projection, not a measurement.

``dry=True`` runs the same code on a CPU at tiny sizes (fp32, dense cores, no CUDA graph): its numbers
mean nothing; it checks the script.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

if importlib.util.find_spec("torch_armor") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from inference_gpu import CHECK_TOL, Clock, armor_weight, median_ms, ratio, rel_error, sparse_weight
from torch_armor.kernels import block_diag
from torch_armor.kernels.quant8 import quantize_rows, scaled_core_mm_rows
from torch_armor.tensor.eight_bit import TOKEN_MULTIPLE_8BIT, quantize_core_8bit

Row = Dict[str, object]
SHAPES_8B = ["4096x4096", "14336x4096", "4096x14336"]
TOKENS = [1, 16, 256, 2048]
BLOCK_PARAMS_8B = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096
BLOCK_PARAMS_70B = 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 28672 * 8192
LAYER_VARIANTS = ["dense", "2:4", "armor bmm", "armor fused"]
# at 16 and 2048 tokens: the dense weight and the plain 2:4 core in the same 8 bits, then ARMOR's
EIGHT_BIT_VARIANTS = ["int8 dense", "int8 2:4", "armor int8", "fp8 dense", "fp8 2:4", "armor fp8"]
EIGHT_BIT_TOKENS = (16, 2048)


def _device_dtype(dry: bool):
    return ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _armor_call(w, fused: bool):
    """``F.linear`` through ``w`` with the wrappers as Triton kernels (``fused``) or batched matmuls."""
    def call(x):
        before = block_diag.FUSED_WRAPPERS
        block_diag.FUSED_WRAPPERS = fused
        try:
            return F.linear(x, w)
        finally:
            block_diag.FUSED_WRAPPERS = before
    return call


def eight_bit_baseline(weight: torch.Tensor, qdtype: str, sparse: bool, dry: bool):
    """``F.linear`` with ``weight`` (dense, or a 2:4 core when ``sparse``) quantized per output channel and
    each token quantized on the fly, as torch's own kernels run it: ``torch._int_mm`` / ``torch._scaled_mm``
    (rowwise scales) dense, an 8-bit ``torch._cslt_sparse_mm`` for 2:4; the activations quantized by plain
    torch ops (unfused, as an uncompiled torchao model runs them). On the dry run: the reference arithmetic."""
    q_w, s_w = quantize_rows(weight.float(), qdtype)
    if dry:
        return lambda x: scaled_core_mm_rows(x, q_w, s_w, qdtype, x.dtype)
    packed = torch._cslt_compress(q_w).view(q_w.shape[0], -1) if sparse else None  # as eight_bit.py keeps it

    def call(x):
        tokens = x.shape[0]
        # cuSPARSELt's 8-bit kernels want a multiple of 16 tokens, torch._int_mm more than 16 rows
        multiple = TOKEN_MULTIPLE_8BIT if sparse or qdtype == "fp8" else 8
        rows = max(tokens + (-tokens) % multiple, 32 if qdtype == "int8" and not sparse else 0)
        q_x, s_x = quantize_rows(F.pad(x, (0, 0, 0, rows - tokens)), qdtype)
        if sparse:
            sums = torch._cslt_sparse_mm(packed, q_x.t(), out_dtype=x.dtype, transpose_result=True)
            out = sums.float() * s_x[:, None] * s_w[None, :]
        elif qdtype == "int8":
            out = torch._int_mm(q_x, q_w.t()).float() * s_x[:, None] * s_w[None, :]
        else:
            out = torch._scaled_mm(q_x, q_w.t(), scale_a=s_x[:, None], scale_b=s_w[None, :], out_dtype=x.dtype)
        return out[:tokens].to(x.dtype)
    return call


# ------------------------------------------------------------------------------------------- layers


def layer_rows(dry: bool, block_size: int, repeats: int = 20) -> Iterator[Row]:
    device, dtype = _device_dtype(dry)
    clock = Clock(device == "cuda")
    gen = torch.Generator(device).manual_seed(0)
    shapes, tokens = (["64x128", "128x64"], [1, 16]) if dry else (SHAPES_8B, TOKENS)
    for shape in shapes:
        d_out, d_in = (int(s) for s in shape.split("x"))
        w, note = armor_weight(d_out, d_in, block_size, device, dtype, not dry, gen)
        if w is None:
            yield {"shape": shape, "variant": "armor", "note": note}
            continue
        dense = w.dense_weight()
        plain, plain_note = sparse_weight(w.core_dense(), not dry)
        calls = {"dense": (lambda x: F.linear(x, dense), dense, CHECK_TOL),  # noqa: F821  (del at the loop's end, after the last call)
                 "2:4": (None if plain is None else (lambda x: F.linear(x, plain)), w.core_dense(), CHECK_TOL),  # noqa: F821  (del at the loop's end, after the last call)
                 "armor bmm": (_armor_call(w, False), dense, CHECK_TOL),
                 "armor fused": (_armor_call(w, True), dense, CHECK_TOL)}
        for qdtype, tol in (("int8", 0.05), ("fp8", 0.15)):  # activations are quantized too: a looser check
            q = quantize_core_8bit(w, qdtype)
            calls[f"armor {qdtype}"] = (lambda x, q=q: F.linear(x, q), q.dense_weight(), tol)
            calls[f"{qdtype} dense"] = (eight_bit_baseline(dense, qdtype, False, dry), dense, tol)
            calls[f"{qdtype} 2:4"] = (eight_bit_baseline(w.core_dense(), qdtype, True, dry), w.core_dense(), tol)
        for n in tokens:
            x = torch.randn(n, d_in, device=device, dtype=dtype, generator=gen)
            measured: Dict[str, Row] = {}
            variants = LAYER_VARIANTS + (EIGHT_BIT_VARIANTS if n in EIGHT_BIT_TOKENS or dry else [])
            for variant in variants:
                fn, ref, tol = calls[variant]
                row: Row = {"shape": shape, "tokens": n, "variant": variant}
                if fn is None:
                    row["note"] = plain_note
                else:
                    try:
                        with torch.no_grad():
                            err = rel_error(fn(x), F.linear(x.float(), ref.float()))
                            row["check"] = f"ok {err:.1e}" if err <= tol else f"FAIL {err:.1e}"
                            row["ms"] = median_ms(lambda: clock.time(lambda: fn(x)), 3, repeats)
                            row["b2b_ms"] = clock.back_to_back(lambda: fn(x), repeats)
                    except Exception as err:  # noqa: BLE001 - a refused kernel is a row, the rest go on
                        row["note"] = f"error: {str(err).strip().splitlines()[0][:120]}"
                measured[variant] = row
                row["x_dense"] = ratio(measured["dense"].get("ms"), row.get("ms"))
                row["x_24"] = ratio(measured.get("2:4", {}).get("ms"), row.get("ms"))
                fmt = next((f for f in ("int8", "fp8") if f in variant.split()), None)
                if fmt:  # against the same 8 bits dense: what a user quantizing anyway gains from 2:4
                    row["x_8bit_dense"] = ratio(measured.get(f"{fmt} dense", {}).get("ms"), row.get("ms"))
                yield row
        del w, dense, plain
        if device == "cuda":
            torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------------- model


def model_config(dry: bool, layers: int):
    from transformers import LlamaConfig

    if dry:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)


def _static_cache(model, batch: int, length: int):
    from transformers import StaticCache

    try:  # transformers 5: lazily sized from the first update
        return StaticCache(config=model.config, max_cache_len=length)
    except TypeError:  # earlier releases size it up front
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=length,
                           device=model.device, dtype=model.dtype)


def _with_cache(model, cache) -> dict:
    """The static cache under the keyword this transformers calls it (``cache`` in 5.x, else ``past_key_values``)."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def decode_ms(model, batch: int, prompt_len: int, steps: int, clock: Clock, graph: bool, gen) -> float:
    """Milliseconds of ``steps`` greedy decode steps at ``batch`` after a ``prompt_len`` prefill, with
    the static cache; ``graph``: each step one replay of a captured CUDA graph (no Python per step)."""
    device = model.device
    cache = _with_cache(model, _static_cache(model, batch, prompt_len + steps + 1))
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device, generator=gen)
    with torch.no_grad():
        logits = model(prompt, cache_position=torch.arange(prompt_len, device=device), **cache).logits
        token = logits[:, -1:].argmax(-1)
        position = torch.tensor([prompt_len], device=device)

        def step():
            return model(token, cache_position=position, **cache).logits

        if not graph:
            def run():
                for _ in range(steps):
                    token.copy_(step()[:, -1:].argmax(-1))
                    position.add_(1)
            return clock.time(run)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as CUDA graphs require
            step()
        torch.cuda.current_stream().wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            out = step()

        def replay():
            for _ in range(steps):
                captured.replay()
                token.copy_(out[:, -1:].argmax(-1))
                position.add_(1)
        return clock.time(replay)


def model_rows(dry: bool, layers: int, block_size: int, prefill: int = 2048, steps: int = 128) -> Iterator[Row]:
    from inference_gpu import build_model

    device, dtype = _device_dtype(dry)
    clock = Clock(device == "cuda")
    cfg = model_config(dry, layers)
    prefill, steps = (32, 4) if dry else (prefill, steps)
    work = [("prefill", 1, False), ("decode eager", 1, False), ("decode graph", 1, True),
            ("decode eager", 16, False), ("decode graph", 16, True)]
    reference: Dict[tuple, float] = {}  # (variant, workload) -> ms, for the speed-up columns
    for variant in ("dense", "2:4", f"armor d_b={block_size}"):
        try:
            model, note, check = build_model(cfg, variant, block_size, device, dtype, not dry)
        except Exception as err:  # noqa: BLE001 - one variant failing is a row
            yield {"variant": variant, "workload": "build", "note": f"error: {str(err).splitlines()[0][:120]}"}
            continue
        gen = torch.Generator(device).manual_seed(2)
        for workload, batch, graph in work:
            row: Row = {"variant": variant, "workload": f"{workload} b{batch}", "check": check, "note": note}
            if graph and device != "cuda":
                row["note"] = "CUDA graphs need CUDA (dry run)"
                yield row
                continue
            try:
                if workload == "prefill":
                    ids = torch.randint(0, cfg.vocab_size, (batch, prefill), device=device, generator=gen)
                    with torch.no_grad():
                        ms = median_ms(lambda: clock.time(lambda: model(ids, use_cache=False, logits_to_keep=1)), 1, 3)  # noqa: F821  (del at the loop's end, after the last call)
                    row.update(ms=ms, tok_s=batch * prefill / ms * 1e3)
                else:
                    ms = decode_ms(model, batch, 128 if not dry else 8, steps, clock, graph, gen)
                    row.update(ms=ms, tok_s=batch * steps / ms * 1e3)
            except Exception as err:  # noqa: BLE001 - e.g. a host sync inside the capture: a row, not a crash
                row["note"] = f"error: {str(err).strip().splitlines()[0][:120]}"
            reference[variant, row["workload"]] = row.get("ms")
            row["x_dense"] = ratio(reference.get(("dense", row["workload"])), row.get("ms"))
            row["x_24"] = ratio(reference.get(("2:4", row["workload"])), row.get("ms"))
            yield row
        del model
        if device == "cuda":
            torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------------- prune


def prune_rows(dry: bool) -> Iterator[Row]:
    from transformers import LlamaForCausalLM

    from torch_armor import ArmorConfig, PruneOptions, prune_model

    device, _ = _device_dtype(dry)
    cfg = model_config(dry, 1)
    cfg.vocab_size = 128 if dry else 32000  # the embeddings play no part in a block's prune
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if not dry else torch.float32).eval()
    windows, length = (8, 32) if dry else (64, 512)
    calibration = torch.randint(0, cfg.vocab_size, (windows, length), generator=torch.Generator().manual_seed(0))
    _sync(device)
    start = time.perf_counter()
    report = prune_model(model, calibration, ArmorConfig(), options=PruneOptions(device=device))
    _sync(device)
    seconds = time.perf_counter() - start
    row: Row = {"what": "one 8B-shaped decoder block, ArmorConfig()", "seconds": seconds,
                "note": f"mean relative proxy loss {report.mean_relative_proxy_loss:.3f}"}
    yield row
    scale = BLOCK_PARAMS_70B / BLOCK_PARAMS_8B
    yield {"what": "projected: Llama-3-8B (32 blocks)", "seconds": seconds * 32, "note": "projection, not measured"}
    yield {"what": f"projected: Llama-3-70B (80 blocks, x{scale:.2f} parameters)", "seconds": seconds * 80 * scale,
           "note": "projection, not measured"}


def targets(layers: List[Row], model: List[Row]) -> List[str]:
    """The issue's targets against the measured rows: met, missed, or not measured."""
    def find(rows, **want) -> Optional[Row]:
        return next((r for r in rows if all(r.get(k) == v for k, v in want.items())), None)

    lines = []
    for shape in SHAPES_8B:
        fp8 = find(layers, shape=shape, tokens=2048, variant="armor fp8")
        x = (fp8 or {}).get("x_8bit_dense")
        lines.append(f"{shape} at 2048 tokens, ARMOR fp8 2:4: {x:.2f}x fp8 dense (target >= 1.30: "
                     f"{'met' if x >= 1.3 else 'missed'})" if isinstance(x, float)
                     else f"{shape} at 2048 tokens, ARMOR fp8 2:4 vs fp8 dense: not measured")
    armor = next((r for r in model if str(r.get("variant", "")).startswith("armor") and r.get("workload") == "prefill b1"), None)
    plain = find(model, variant="2:4", workload="prefill b1")
    x_dense, x_plain = (armor or {}).get("x_dense"), (plain or {}).get("x_dense")
    if isinstance(x_dense, float) and isinstance(x_plain, float):
        share = f"{(x_dense - 1) / (x_plain - 1):.0%}" if x_plain > 1 else "n/a (plain 2:4 not faster than dense)"
        met = x_plain > 1 and (x_dense - 1) / (x_plain - 1) >= 0.9
        lines.append(f"prefill 2048, whole 8B-shaped layers, ARMOR fused: {x_dense:.2f}x dense (target >= 1.30: "
                     f"{'met' if x_dense >= 1.3 else 'missed'}); share of plain 2:4's speed-up ({x_plain:.2f}x): "
                     f"{share} (target >= 90%: {'met' if met else 'missed'})")
    else:
        lines.append("prefill 2048 targets: not measured")
    graph = next((r for r in model if str(r.get("variant", "")).startswith("armor") and r.get("workload") == "decode graph b1"), None)
    x = (graph or {}).get("x_dense")
    lines.append(f"decode b1 with CUDA graphs, ARMOR: {x:.2f}x dense (target >= 1.20: {'met' if x >= 1.2 else 'missed'})"
                 if isinstance(x, float) else "decode b1 with CUDA graphs: not measured")
    return lines


if __name__ == "__main__":  # `python benchmarks/gpu_quick.py prune [--dry-run]`: gpu_check runs the prune so
    import json

    if sys.argv[1:2] != ["prune"]:
        sys.exit("usage: python benchmarks/gpu_quick.py prune [--dry-run]  (run by benchmarks/gpu_check.py --quick)")
    for prune_row in prune_rows(dry="--dry-run" in sys.argv):
        print(json.dumps(prune_row), flush=True)
