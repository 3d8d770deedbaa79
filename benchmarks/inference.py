"""Forward time and memory of dense vs ARMOR-converted SmolLM2-135M: one layer and the whole model.

    python benchmarks/inference.py [--seq-len 128] [--batches 1 16] [--repeats 5]

What is measured (CPU; fp32; the threads torch uses are printed):

* **per layer**: ``model.layers[0].mlp.up_proj`` (576 → 1536) on ``x (batch, seq_len, 576)``;
* **whole model**: ``model(input_ids, use_cache=False, logits_to_keep=1)`` on ``(batch, seq_len)``
  token ids (a prefill: every decoder layer runs on every token; only the last position's
  logits are computed so the 49k-vocab head does not hide the decoder linears);

for these variants, interleaved (each round runs every variant once, in a rotating order;
the reported time is the median over rounds, after warm-up; whole model: ``--repeats`` rounds at
batch 1, half as many (at least 3) at larger batches):

* ``dense``: the original ``nn.Linear`` weights;
* ``armor compact``: ARMOR weights, 2:4 core stored compact (values + 2-bit indices, the CPU
  default), unpacked to dense in every call;
* ``armor dense-core``: ARMOR weights with the core stored as a dense matrix with zeros;
* ``... compiled``: ``torch.compile(..., fullgraph=True)`` (inductor), compiled once per batch size
  (compile time is printed separately, never included in forward times);
* ``armor int8-wo`` / ``armor int8-dyn``: the core quantized with
  ``ArmorCoreConfig(Int8WeightOnlyConfig())`` / ``ArmorCoreConfig(Int8DynamicActivationInt8WeightConfig())``.

Memory columns:

* ``weights MB``: bytes of the parameters and buffers the variant keeps resident (for ARMOR
  weights: every inner tensor; shared tensors counted once);
* ``peak act MB``: the peak, during one forward, of bytes held by tensors allocated *during*
  that forward through PyTorch's CPU allocator (activations, temporaries such as an unpacked
  compact core, outputs), from ``torch.profiler`` allocation events. It excludes the weights
  and memory that libraries allocate outside PyTorch's allocator (e.g. oneDNN scratch).

``rel err``: relative Frobenius error of the full logits vs the dense model on real text
windows (eager variants; compiled variants are compared with their eager twin). With the cheap
factors used here this is a sanity check, not a quality number (see the quality protocol in the
design notes); the int8 lines below the per-layer table compare int8 cores with the fp32 ARMOR
model, which is what quantization adds.

With a CUDA device the same tables are printed for fp16 on CUDA, adding ``armor semi-structured``
(``torch.sparse`` 2:4 kernels); there peak memory is ``torch.cuda.max_memory_allocated`` above
the resident weights. No CUDA numbers exist unless this script ran on a CUDA machine. For the
bf16 GPU benchmark (Llama-2-7B / Llama-3-70B layer shapes, a ~1B random Llama, plain 2:4 and ARMOR
at several block sizes) use ``benchmarks/inference_gpu.py`` (``--dry-run`` checks it on CPU).

The converted model uses cheap factors (BCD, 1 iteration, a few calibration windows): speed and
memory do not depend on the factor values.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

if importlib.util.find_spec("torch_armor") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

from torch_armor.recipes.assets import load_smollm2, sotu_text, wiki_text
from torch_armor.recipes.data import calibration_windows, eval_windows, tokenize_text
from torch_armor.tensor.quant import ArmorCoreConfig
from torch_armor.sparsifier import ArmorSparsifier
from torch_armor import ArmorConfig
from torch_armor.config.armor import BcdConfig
from torch_armor.tensor.armor_tensor import ArmorTensor

LAYER = "model.layers.0.mlp.up_proj"
Variant = Tuple[str, nn.Module, Callable[[torch.Tensor], torch.Tensor]]


# ------------------------------------------------------------------------------ measuring


def tensor_bytes(t: torch.Tensor, seen: set) -> int:
    """Bytes of ``t``'s data, recursing into wrapper subclasses; storages in ``seen`` count once."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, name), seen) for name in names)
    if isinstance(t, nn.Parameter):
        t = t.data
    key = (t.device, t.untyped_storage().data_ptr())
    if key in seen:
        return 0
    seen.add(key)
    return t.untyped_storage().nbytes()


def resident_bytes(module: nn.Module) -> int:
    seen: set = set()
    total = sum(tensor_bytes(p.data if type(p) is nn.Parameter else p, seen) for p in module.parameters())
    return total + sum(tensor_bytes(b, seen) for b in module.buffers())


def cpu_peak_alloc(fn: Callable[[], object]) -> int:
    """Peak bytes of CPU tensors allocated (and not yet freed) while ``fn`` runs (torch.profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events: List[Tuple[int, int]] = []

    def walk(nodes) -> None:
        for node in nodes:
            if node.tag == _EventType.Allocation and str(node.extra_fields.device).startswith("cpu"):
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    current = peak = 0
    for _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak


def cuda_peak_alloc(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - base


def time_interleaved(fns: Dict[str, Callable[[], object]], repeats: int, warmup: int, cuda: bool) -> Dict[str, List[float]]:
    """Seconds per call of each function: warm-up, then ``repeats`` rounds in a rotating order."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            sync()
            start = time.perf_counter()
            fns[name]()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().float(), ref.detach().float()
    return float((out - ref).norm() / ref.norm())


# ------------------------------------------------------------------------------ models


def convert(model: nn.Module, calib: torch.Tensor, block_size: int, num_iters: int) -> nn.Module:
    sparsifier = ArmorSparsifier(ArmorConfig(block_size=block_size, optimizer=BcdConfig(iters=num_iters)), progress=False)
    sparsifier.prepare(model)
    with torch.no_grad():
        for row in calib:
            model(row[None].to(next(model.parameters()).device), use_cache=False)
    return sparsifier.convert(model)


def restore(model: nn.Module, storage: str) -> nn.Module:
    """Copy of ``model`` with every ArmorTensor core re-stored as ``storage``."""
    model = copy.deepcopy(model)
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, ArmorTensor):
            module.weight = nn.Parameter(w.with_storage(storage), requires_grad=False)
    return model


def quantized(model: nn.Module, inner) -> nn.Module:
    model = copy.deepcopy(model)
    quantize_(model, ArmorCoreConfig(inner))
    return model


def build_variants(dense: nn.Module, armor: nn.Module, device: str, compile_: bool) -> Dict[str, nn.Module]:
    """Eager modules by name; compiled ones are created per batch size (see ``run_table``)."""
    variants = {"dense": dense, "armor compact": restore(armor, "compact"), "armor dense-core": restore(armor, "dense")}
    if device == "cuda":
        variants["armor semi-structured"] = restore(armor, "semi_structured")
    else:  # torchao's int8 CPU paths; on CUDA they would hide the 2:4 kernel comparison
        variants["armor int8-wo"] = quantized(variants["armor compact"], Int8WeightOnlyConfig(set_inductor_config=False))
        variants["armor int8-dyn"] = quantized(
            variants["armor compact"], Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
        )
    return variants


def compiled_names(device: str) -> List[str]:
    return ["dense", "armor compact"] + (["armor semi-structured"] if device == "cuda" else [])


# ------------------------------------------------------------------------------ tables


def run_table(
    title: str,
    modules: Dict[str, nn.Module],
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    make_input: Callable[[int], torch.Tensor],
    batches: Sequence[int],
    repeats: Dict[int, int],
    device: str,
    compile_: bool,
    errors: Dict[str, float],
    warmup: int = 2,
) -> None:
    cuda = device == "cuda"
    print(f"\n## {title}")
    header = f"{'variant':<28}{'batch':>6}{'median ms':>11}{'min ms':>9}{'weights MB':>12}{'peak act MB':>13}{'rel err':>10}"
    print(header)
    print("-" * len(header))
    for batch in batches:
        x = make_input(batch)
        fns: Dict[str, Callable[[], object]] = {}
        weights: Dict[str, int] = {}
        errs: Dict[str, str] = {}
        with torch.no_grad():
            for name, module in modules.items():
                fns[name] = (lambda m=module: call(m, x))
                weights[name] = resident_bytes(module)
                errs[name] = f"{errors[name]:.4f}" if name in errors else ""
            if compile_:
                torch._dynamo.reset()  # once per table row group: earlier compiled models are done
                for name in compiled_names(device):
                    compiled = torch.compile(modules[name], fullgraph=True, dynamic=False)
                    start = time.perf_counter()
                    out = call(compiled, x)
                    seconds = time.perf_counter() - start
                    eager = call(modules[name], x)
                    key = f"{name} compiled"
                    fns[key] = (lambda m=compiled: call(m, x))
                    weights[key] = weights[name]
                    errs[key] = f"{rel_err(out, eager):.1e}*"
                    print(f"  (compiled {name!r} for batch {batch} in {seconds:.0f} s)")
            times = time_interleaved(fns, repeats[batch], warmup=warmup, cuda=cuda)
            peaks = {name: (cuda_peak_alloc if cuda else cpu_peak_alloc)(fn) for name, fn in fns.items()}
        for name in fns:
            t = times[name]
            print(f"{name:<28}{batch:>6}{statistics.median(t) * 1e3:>11.2f}{min(t) * 1e3:>9.2f}"
                  f"{weights[name] / 1e6:>12.2f}{peaks[name] / 1e6:>13.2f}{errs[name]:>10}")
    print("rel err: vs dense, eager, full logits on real text (per layer: the layer's output on random x); "
          "* = compiled vs its eager twin")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="ARMOR inference benchmark on SmolLM2-135M")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per batch size (whole model)")
    parser.add_argument("--layer-repeats", type=int, default=30, help="timed rounds per batch size (one layer)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-iters", type=int, default=1)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument("--skip-model", action="store_true", help="only the per-layer table")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice). On a busy machine use 1: "
                             "OpenMP threads that wait for a descheduled sibling make multi-thread timings meaningless")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print("reproduce: python benchmarks/inference.py " + " ".join(shlex.quote(a) for a in (argv or [])))
    print(f"torch {torch.__version__}, CPU {platform.processor() or platform.machine()}, "
          f"torch threads {torch.get_num_threads()}, CUDA available: {torch.cuda.is_available()}")
    compile_ = not args.no_compile

    torch.manual_seed(0)
    dense, tok = load_smollm2(torch.float32)
    calib = calibration_windows(tokenize_text(sotu_text()[:200_000], tok), None, n_windows=4, seq_len=args.seq_len)
    text = eval_windows(tokenize_text(wiki_text()[:100_000], tok), None, n_windows=4, seq_len=args.seq_len)
    vocab = dense.config.vocab_size
    start = time.perf_counter()
    armor = convert(copy.deepcopy(dense), calib, args.block_size, args.num_iters)
    print(f"converted 210 decoder linears (block size {args.block_size}, BCD x{args.num_iters}) "
          f"in {time.perf_counter() - start:.0f} s")

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        dtype = torch.float32 if device == "cpu" else torch.float16
        d_model = dense if device == "cpu" else copy.deepcopy(dense).to(device=device, dtype=dtype)
        a_model = armor if device == "cpu" else copy.deepcopy(armor).to(device=device, dtype=dtype)
        models = build_variants(d_model, a_model, device, compile_)
        label = f"{device} {str(dtype).removeprefix('torch.')}"

        # --- one layer
        layers = {name: m.get_submodule(LAYER) for name, m in models.items()}
        gen = torch.Generator().manual_seed(1)
        d_in, d_out = layers["dense"].in_features, layers["dense"].out_features
        xs = {b: torch.randn(b, args.seq_len, d_in, generator=gen).to(device=device, dtype=dtype) for b in args.batches}
        with torch.no_grad():
            ref = layers["dense"](xs[args.batches[0]])
            layer_err = {n: rel_err(layer(xs[args.batches[0]]), ref) for n, layer in layers.items()}
        run_table(
            f"one layer: {LAYER} ({d_in} -> {d_out}), x = (batch, {args.seq_len}, {d_in}), {label}",
            layers, lambda m, x: m(x), lambda b: xs[b], args.batches,
            {b: args.layer_repeats for b in args.batches}, device, compile_, layer_err,
        )
        if args.skip_model:
            continue

        # --- whole model
        text_dev = text.to(device)
        with torch.no_grad():
            ref = models["dense"](text_dev, use_cache=False).logits
            logits = {n: m(text_dev, use_cache=False).logits for n, m in models.items()}
            model_err = {n: rel_err(out, ref) for n, out in logits.items()}
            for name in (n for n in logits if "int8" in n):
                print(f"{name}: relative logit error vs the fp32 ARMOR model = "
                      f"{rel_err(logits[name], logits['armor compact']):.4f} ({len(text)} real-text windows)")
            del logits
        gen = torch.Generator().manual_seed(2)
        ids = {b: torch.randint(0, vocab, (b, args.seq_len), generator=gen).to(device) for b in args.batches}
        run_table(
            f"whole model: SmolLM2-135M prefill, ids = (batch, {args.seq_len}), logits_to_keep=1, {label}",
            models, lambda m, x: m(x, use_cache=False, logits_to_keep=1).logits, lambda b: ids[b], args.batches,
            {b: (args.repeats if b < 8 else max(3, args.repeats // 2)) for b in args.batches}, device, compile_,
            model_err, warmup=1,
        )
    if not torch.cuda.is_available():
        print("\nno CUDA device: no semi-structured (2:4 kernel) numbers were measured.")
        print("GPU benchmark (bf16, Llama-7B/70B layer shapes, ~1B Llama): benchmarks/inference_gpu.py")


if __name__ == "__main__":
    main(sys.argv[1:])
