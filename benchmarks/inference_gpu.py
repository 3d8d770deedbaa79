"""GPU inference benchmark: dense vs plain 2:4 vs ARMOR, per layer and on a ~1B random Llama.

    python benchmarks/inference_gpu.py [--shapes 4096x4096 ...] [--tokens 1 16 ...] [--json out.json]
    python benchmarks/inference_gpu.py --dry-run      # CPU, tiny shapes: runs every code path here
    python benchmarks/inference_gpu.py --flops-only   # meta-device FLOP trace only (no GPU needed)

(``python benchmarks/gpu_check.py`` runs this and the CUDA tests in one go.) Per layer (bf16;
Llama-2-7B and Llama-3-70B linears, ``d_out x d_in``), at each token count: ``dense``
(``F.linear(x, W)``), ``2:4`` (torch's own ``to_sparse_semi_structured(W ⊙ M)``, backend as the storage
policy picks, ``M`` the magnitude 2:4 mask) and ``armor d_b=k`` (``from_factors(...,
storage="semi_structured")`` of random ``A``, ``B`` and 2:4 core; the block sizes include the library's
default, 16), each eager and ``torch.compile(fullgraph=True, dynamic=False)``d (one compile per
variant, shape and token count, not timed). Two times per row, CUDA events:

* ``flushed ms``: median of ``--repeats`` single calls, each after a 256 MB write that flushes L2
  *and a synchronize*, so the GPU waits for the host to launch the call (host overhead counted);
* ``b2b ms``: ``--repeats`` calls back to back, per call: the steady state.

``x dense`` / ``x 2:4``: speed-up (flushed) against the same mode's dense / 2:4 row. ``check``: the
row's output against the dense product of the same weights (``W``, ``W ⊙ M``, ``A·core·B``) in fp32,
relative Frobenius error, ``ok`` below 2e-2, else ``FAIL``. Every row is built, compiled, checked and
timed on its own: a refused kernel shows ``refused`` and why, an error its message, the rest go on.

Whole model: a random-weight bf16 Llama (hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 kv
heads, vocab 32000: ~1.1B parameters), prefill ``model(ids, use_cache=False, logits_to_keep=1)`` at
``--prefill`` tokens and decode tokens/s (``--new-tokens`` greedy steps with a ``DynamicCache``, batch
1), for dense / 2:4 / ARMOR (``--model-block-size``, default 16) decoder linears; ``check`` compares
last-token logits with the same model holding the dense equivalents of its weights; ``peak MB``:
``torch.cuda.max_memory_allocated`` during that workload.

FLOPs: the meta-device table of ``benchmarks/armor_flops.py``. ``--dry-run`` runs the same control
flow on CPU (fp32, ``time.perf_counter``, dense cores, ``torch.compile(backend="eager")``, a tiny
Llama): its numbers mean nothing. No CUDA number exists unless this script ran on a CUDA machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

if importlib.util.find_spec("torch_armor") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

from torch_armor.config.armor import ArmorConfig
from torch_armor.core.factors import ArmorFactors
from torch_armor.core.proxy import nm_mask_from_scores
from torch_armor.tensor import policy
from torch_armor.tensor.armor_tensor import ArmorTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from armor_flops import FLOP_COLS, SHAPES, flop_rows  # noqa: E402  (benchmarks/armor_flops.py)

NO_CUDA = "no CUDA device: run this on an NVIDIA GPU (sm80+; Hopper uses cuSPARSELt)"
TOKENS = [1, 16, 128, 1024, 8192, 16384]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_BLOCK = ArmorConfig().block_size
CHECK_TOL = 2e-2
Row = Dict[str, object]


# ------------------------------------------------------------------------------ timing


class Clock:
    """Milliseconds of calls: CUDA events on CUDA, ``time.perf_counter`` on CPU.

    :meth:`time` is one call after an L2 flush and a synchronize (host overhead counted);
    :meth:`back_to_back` is the mean of ``n`` calls launched back to back.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda") if cuda else None

    def time(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        self.flush.zero_()
        torch.cuda.synchronize()  # the GPU is idle when the call starts: its launch cost is timed
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    def back_to_back(self, fn: Callable[[], object], n: int) -> float:
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - start) * 1e3 / n
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n


def median_ms(run: Callable[[], float], warmup: int, repeats: int) -> float:
    """Median of ``repeats`` values of ``run()`` (milliseconds) after ``warmup`` unrecorded calls."""
    for _ in range(warmup):
        run()
    return statistics.median(run() for _ in range(repeats))


def refusal(err: BaseException, mode: str = "eager") -> str:
    """One line for a call that raised: a kernel refusing the shape, (compiled rows) a failed compile, or
    (``mode="build"``) a weight that could not be built."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:100]
    return {"compiled": "compile failed: ", "build": "error: "}.get(mode, "refused: ") + first


def ratio(ref, t) -> Optional[float]:
    """Speed-up ``ref / t``; ``None`` when either is not a time."""
    return ref / t if isinstance(ref, float) and isinstance(t, float) and t > 0 else None


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:  # ‖out − ref‖ / ‖ref‖ in float32
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def check_note(err: Optional[float]) -> str:
    return "" if err is None else (f"ok {err:.1e}" if err <= CHECK_TOL else f"FAIL {err:.1e}")


# ------------------------------------------------------------------------------ weights


def random_24(d_out: int, d_in: int, device, dtype, gen: torch.Generator) -> torch.Tensor:
    """A random weight, magnitude-pruned to 2:4."""
    w = torch.randn(d_out, d_in, device=device, dtype=dtype, generator=gen) * d_in**-0.5
    return w * nm_mask_from_scores(w.abs(), 2, 4)


def sparse_weight(w24: torch.Tensor, semi: bool):
    """``(weight, note)``: ``w24`` as torch's own semi-structured tensor (the backend the storage policy
    picks for it), or ``None`` and why the kernel refused it."""
    if not semi:
        return w24, ""
    from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

    choice = policy.choose_storage(policy.device_info(w24.device), w24.dtype, tuple(w24.shape), "2:4")
    if choice.storage != "semi_structured":
        return None, "refused: " + choice.reason
    previous = SparseSemiStructuredTensor._FORCE_CUTLASS
    SparseSemiStructuredTensor._FORCE_CUTLASS = choice.backend == "cutlass"
    try:
        return to_sparse_semi_structured(w24.contiguous()), ""
    except (RuntimeError, ValueError, NotImplementedError) as err:
        return None, refusal(err)
    finally:
        SparseSemiStructuredTensor._FORCE_CUTLASS = previous


def armor_weight(d_out: int, d_in: int, d_b: int, device, dtype, semi: bool, gen: torch.Generator):
    """``(ArmorTensor, note)`` from random factors; ``None`` and why if the 2:4 kernel refused the core."""
    eye = torch.eye(d_b, device=device, dtype=dtype)
    a = eye + 0.1 * torch.randn(d_out // d_b, d_b, d_b, device=device, dtype=dtype, generator=gen)
    b = eye + 0.1 * torch.randn(d_in // d_b, d_b, d_b, device=device, dtype=dtype, generator=gen)
    core = random_24(d_out, d_in, device, dtype, gen)
    factors = ArmorFactors(a, core, b, core != 0, "2:4")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = ArmorTensor.from_factors(factors, storage="semi_structured" if semi else "dense")
    if semi and w.storage_format != "semi_structured":
        why = str(caught[0].message).split(" because ")[-1].split(";")[0] if caught else "kernel refused the core"
        return None, "refused: " + why
    return w, ""


def dense_of(w) -> torch.Tensor:
    """The dense matrix a weight stands for (the reference its row is checked against)."""
    if isinstance(w, ArmorTensor):
        return w.dense_weight()
    return w.to_dense() if type(w) is not torch.Tensor else w


# ------------------------------------------------------------------------------ per layer


def build_weights(args, shape: str, device: str, dtype: torch.dtype, semi: bool, gen) -> Dict[str, tuple]:
    """``{variant: (weight or None, note, dense reference in fp32 or None)}``, each built on its own."""
    d_out, d_in = (int(s) for s in shape.split("x"))
    w24 = random_24(d_out, d_in, device, dtype, gen)
    builders: Dict[str, Callable] = {
        "dense": lambda: (torch.randn(d_out, d_in, device=device, dtype=dtype, generator=gen), ""),
        "2:4": lambda: sparse_weight(w24, semi),
    }
    for d_b in args.block_sizes:
        builders[f"armor d_b={d_b}"] = (
            (lambda d_b=d_b: armor_weight(d_out, d_in, d_b, device, dtype, semi, gen))
            if d_out % d_b == 0 and d_in % d_b == 0 else (lambda d_b=d_b: (None, f"skipped: d_b={d_b} does not divide {shape}")))
    weights = {}
    for name, build in builders.items():
        try:
            w, note = build()
            ref = None
            if w is not None:
                ref = (w24 if name == "2:4" else w.dense_weight(torch.float32) if isinstance(w, ArmorTensor) else w).float()
            weights[name] = (w, note, ref)
        except Exception as err:  # noqa: BLE001 - one variant failing is a result, the others go on
            weights[name] = (None, refusal(err, "build"), None)
    return weights


def time_row(args, clock: Clock, w, ref: torch.Tensor, x: torch.Tensor, mode: str) -> Row:
    """Compile (``mode == "compiled"``), check against ``ref`` and time one variant; a failure is its note."""
    fn: Callable = lambda t: F.linear(t, w)  # noqa: E731
    try:
        if mode == "compiled":
            fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=args.compile_backend)
        with torch.no_grad():
            start = time.perf_counter()
            out = fn(x)  # compiles the compiled variants for this token count
            compile_s = time.perf_counter() - start if mode == "compiled" else 0.0
            err = rel_error(out, F.linear(x.float(), ref))
            ms = median_ms(lambda: clock.time(lambda: fn(x)), args.warmup, args.repeats)
            b2b = clock.back_to_back(lambda: fn(x), args.repeats)
        return {"ms": ms, "b2b_ms": b2b, "check": check_note(err), "error": err, "compile_s": compile_s, "note": ""}
    except Exception as err:  # noqa: BLE001 - a kernel refusing a shape is a result
        return {"note": refusal(err, mode), "compile_s": 0.0}


def bench_layers(args, clock: Clock, device: str, dtype: torch.dtype, semi: bool) -> List[Row]:
    rows: List[Row] = []
    modes = ["eager"] + ([] if args.no_compile else ["compiled"])
    gen = torch.Generator(device).manual_seed(0)
    for shape in args.shapes:
        d_in = int(shape.split("x")[1])
        weights = build_weights(args, shape, device, dtype, semi, gen)
        compile_s = 0.0
        for tokens in args.tokens:
            # fresh compiles per token count: the variants share one code object, whose recompile limit
            # (8) would otherwise be hit; fail_on_recompile_limit_hit makes that an error, not eager runs
            torch._dynamo.reset()
            torch._dynamo.config.fail_on_recompile_limit_hit = True
            x = torch.randn(tokens, d_in, device=device, dtype=dtype, generator=gen)
            results: Dict[tuple, Row] = {}
            for mode in modes:
                for name, (w, note, ref) in weights.items():
                    results[name, mode] = time_row(args, clock, w, ref, x, mode) if w is not None else {"note": note}
                    compile_s += results[name, mode].get("compile_s", 0.0)
            for mode in modes:
                for name in weights:
                    r = results[name, mode]
                    refs = {k: results[k, mode].get("ms") for k in ("dense", "2:4")}
                    rows.append({"shape": shape, "tokens": tokens, "variant": name, "mode": mode,
                                 "ms": r.get("ms"), "b2b_ms": r.get("b2b_ms"),
                                 "x_dense": ratio(refs["dense"], r.get("ms")), "x_24": ratio(refs["2:4"], r.get("ms")),
                                 "check": r.get("check", ""), "error": r.get("error"), "note": r.get("note", "")})
            del x
        if "compiled" in modes:
            print(f"  (compiled the variants of {shape} for {len(args.tokens)} token counts in {compile_s:.0f} s)",
                  file=sys.stderr)
        del weights
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------ whole model


def llama_config(dry_run: bool):
    from transformers import LlamaConfig

    if dry_run:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    return LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, vocab_size=32000, max_position_embeddings=16384)


def build_model(cfg, variant: str, d_b: int, device: str, dtype: torch.dtype, semi: bool):
    """``(model, note, check)``: the random Llama with its decoder linears as ``variant``; ``check`` compares
    its last-token logits with the same model holding the dense equivalents of those weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    gen = torch.Generator(device).manual_seed(1)
    kept = total = 0
    swapped = []
    for name, module in model.named_modules():
        if not (isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS) or variant == "dense":
            continue
        d_out, d_in = module.weight.shape
        total += 1
        if variant == "2:4":
            w24 = module.weight.detach() * nm_mask_from_scores(module.weight.detach().abs(), 2, 4)
            w, _ = sparse_weight(w24, semi)
            w = w24 if w is None else w
            kept += int(w is not w24)
            dense = w24
        else:
            w, _ = armor_weight(d_out, d_in, d_b, device, dtype, semi, gen)
            if w is None:  # the kernel refused the core: keep ARMOR with a dense core
                w, _ = armor_weight(d_out, d_in, d_b, device, dtype, False, gen)
            else:
                kept += int(w.storage_format == "semi_structured")
            dense = w.dense_weight()
        module.weight = nn.Parameter(dense, requires_grad=False)
        swapped.append((module, w))
    ids = torch.randint(0, cfg.vocab_size, (1, 64), device=device, generator=torch.Generator(device).manual_seed(3))
    with torch.no_grad():
        ref = model(ids, use_cache=False, logits_to_keep=1).logits
        for module, w in swapped:
            module.weight = nn.Parameter(w, requires_grad=False)
        err = rel_error(model(ids, use_cache=False, logits_to_keep=1).logits, ref)
    note = f"{kept}/{total} linears semi-structured" if semi and total else ""
    return model, note, (check_note(err) if swapped else "")


def resident_mb(model: nn.Module) -> float:
    def nbytes(t: torch.Tensor) -> int:
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            return sum(nbytes(getattr(t, n)) for n in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()

    return sum(nbytes(p.data if type(p) is nn.Parameter else p) for p in model.parameters()) / 1e6


def decode_ms(model, prompt: torch.Tensor, new_tokens: int, clock: Clock) -> float:
    """Milliseconds of ``new_tokens`` greedy single-token steps after an (untimed) prompt prefill."""
    from transformers import DynamicCache

    cache = DynamicCache()
    tok = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)

    def steps():
        nonlocal tok
        for _ in range(new_tokens):
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)

    return clock.time(steps)


def bench_model(args, clock: Clock, device: str, dtype: torch.dtype, semi: bool) -> List[Row]:
    cfg = llama_config(args.dry_run)
    cuda = device == "cuda"
    rows: List[Row] = []
    work = [(f"prefill {n}", n, None) for n in args.prefill] + [(f"decode {args.new_tokens}", args.prompt_len,
                                                                 args.new_tokens)]
    for variant in ("dense", "2:4", f"armor d_b={args.model_block_size}"):
        try:
            model, note, check = build_model(cfg, variant, args.model_block_size, device, dtype, semi)
        except Exception as err:  # noqa: BLE001 - one variant failing is a result, the others go on
            rows += [{"variant": variant, "workload": label, "note": refusal(err, "build")} for label, _, _ in work]
            continue
        weights = resident_mb(model)
        gen = torch.Generator(device).manual_seed(2)
        for label, n, new in work:
            ids = torch.randint(0, cfg.vocab_size, (1, n), device=device, generator=gen)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            try:
                with torch.no_grad():
                    if new is None:
                        ms = median_ms(lambda: clock.time(lambda: model(ids, use_cache=False, logits_to_keep=1)),  # noqa: F821  (del at the loop's end, after the last call)
                                       1, args.model_repeats)
                    else:
                        ms = median_ms(lambda: decode_ms(model, ids, new, clock), 1, max(1, args.model_repeats // 2))  # noqa: F821  (del at the loop's end, after the last call)
            except Exception as err:  # noqa: BLE001
                rows.append({"variant": variant, "workload": label, "note": refusal(err), "check": check})
                continue
            rows.append({"variant": variant, "workload": label, "ms": ms,
                         "tok_s": (new if new else n) / ms * 1e3, "weights_mb": weights,
                         "peak_mb": torch.cuda.max_memory_allocated() / 1e6 if cuda else None, "note": note,
                         "check": check})
        del model
        if cuda:
            torch.cuda.empty_cache()
    for row in rows:
        ref = {r["variant"]: r.get("ms") for r in rows if r["workload"] == row["workload"]}
        row["x_dense"], row["x_24"] = ratio(ref.get("dense"), row.get("ms")), ratio(ref.get("2:4"), row.get("ms"))
    return rows


# ------------------------------------------------------------------------------ output


def fmt(v, spec: str = ".3f") -> str:
    return "—" if v is None else (f"{v:{spec}}" if isinstance(v, float) else str(v))


def table(title: str, cols: Sequence[tuple], rows: Sequence[Row]) -> str:
    """Markdown table: ``cols`` are ``(header, key, format)``."""
    lines = [f"\n### {title}\n", "| " + " | ".join(c[0] for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(k), f) for _, k, f in cols) + " |" for r in rows]
    return "\n".join(lines)


LAYER_COLS = [("shape", "shape", ""), ("tokens", "tokens", ""), ("variant", "variant", ""), ("mode", "mode", ""),
              ("flushed ms", "ms", ".4f"), ("b2b ms", "b2b_ms", ".4f"), ("x dense", "x_dense", ".2f"),
              ("x 2:4", "x_24", ".2f"), ("check", "check", ""), ("note", "note", "")]
MODEL_COLS = [("variant", "variant", ""), ("workload", "workload", ""), ("median ms", "ms", ".2f"),
              ("tokens/s", "tok_s", ".1f"), ("x dense", "x_dense", ".2f"), ("x 2:4", "x_24", ".2f"),
              ("weights MB", "weights_mb", ".1f"), ("peak MB", "peak_mb", ".1f"), ("check", "check", ""),
              ("note", "note", "")]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda"])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, fp32: exercise the code paths")
    p.add_argument("--flops-only", action="store_true", help="only the meta-device FLOP table")
    p.add_argument("--shapes", nargs="+", default=None, help=f"d_out x d_in (default: {' '.join(SHAPES)})")
    p.add_argument("--tokens", type=int, nargs="+", default=None, help=f"default: {TOKENS}")
    p.add_argument("--block-sizes", type=int, nargs="+", default=None,
                   help=f"default: {DEFAULT_BLOCK} (the library's) 64 128")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=50, help="timed calls per layer row")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; dry run eager)")
    p.add_argument("--skip-layers", action="store_true")
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--prefill", type=int, nargs="+", default=None, help="prefill lengths (default 2048 8192)")
    p.add_argument("--prompt-len", type=int, default=None, help="decode prompt length (default 128)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode steps (default 128)")
    p.add_argument("--model-block-size", type=int, default=None,
                   help=f"ARMOR d_b of the model (default: the library's, {DEFAULT_BLOCK})")
    p.add_argument("--model-repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="also save every row here")
    args = p.parse_args(argv)
    dry = args.dry_run
    defaults = dict(shapes=["64x128"] if dry else SHAPES, tokens=[1, 16] if dry else TOKENS,
                    block_sizes=[DEFAULT_BLOCK, 32, 64] if dry else sorted({DEFAULT_BLOCK, 64, 128}), prefill=[16, 32] if dry else [2048, 8192],
                    prompt_len=8 if dry else 128, new_tokens=4 if dry else 128, model_block_size=DEFAULT_BLOCK,
                    compile_backend="eager" if dry else "inductor")
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if dry:
        args.warmup, args.repeats = min(args.warmup, 1), min(args.repeats, 3)
        args.model_repeats = min(args.model_repeats, 2)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not (args.dry_run or args.flops_only or torch.cuda.is_available()):
        print(NO_CUDA, file=sys.stderr)
        return 2
    command = "python benchmarks/inference_gpu.py " + " ".join(shlex.quote(a) for a in argv)
    flops = flop_rows(args.shapes, args.block_sizes)
    out = [f"reproduce: `{command.strip()}`", f"torch {torch.__version__}"]
    result: Dict[str, object] = {"command": command.strip(), "torch": torch.__version__, "flops": flops}
    if not args.flops_only:
        device = "cpu" if args.dry_run else "cuda"
        dtype = torch.float32 if args.dry_run else torch.bfloat16
        name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run: numbers mean nothing)"
        if device == "cuda":
            info = policy.device_info("cuda")
            name += f" (sm{info.capability[0]}{info.capability[1]}, 2:4 backends: {', '.join(sorted(info.backends))})"
        out.append(f"device: {name}, {str(dtype).removeprefix('torch.')}")
        result["device"] = name
        clock = Clock(device == "cuda")
        if not args.skip_layers:
            result["layers"] = bench_layers(args, clock, device, dtype, semi=device == "cuda")
            out.append(table("per layer: F.linear(x (tokens, d_in), W (d_out, d_in))", LAYER_COLS, result["layers"]))
        if not args.skip_model:
            result["model"] = bench_model(args, clock, device, dtype, semi=device == "cuda")
            out.append(table("whole model: random Llama, batch 1", MODEL_COLS, result["model"]))
    out.append(table("FLOPs per token (meta device; tokens cancel)", FLOP_COLS, flops))
    failed = [r for r in result.get("layers", []) + result.get("model", []) if str(r.get("check", "")).startswith("FAIL")]
    result["failed_checks"] = len(failed)
    print("\n".join(out))
    if failed:
        print(f"{len(failed)} row(s) disagree with their dense reference (check column FAIL)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
