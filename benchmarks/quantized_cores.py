"""What 8-bit 2:4 cores cost in quality: a pruned ARMOR model with int8 / fp8 cores, on the protocol.

    torch-armor prune smollm2 --out runs/smol            # the default ARMOR prune (once)
    python benchmarks/quantized_cores.py runs/smol --threads 2

Every decoder linear of the pruned model runs ``y = A · (s_x ⊙ (q_core · q_x) ⊙ s_w) · B`` with the
numbers a cuSPARSELt 8-bit GEMM computes (:mod:`torch_armor.kernels.quant8`): the core quantized per
output channel, the B-pass output quantized per token, dynamically, the 8-bit products summed
exactly (int8) or in fp32 (fp8), the scales applied to the sum, then the A-pass; wrappers and
activations in bf16. Rows: the bf16 ARMOR model (the reference), int8, fp8; Wikipedia perplexity over
64 x 512 tokens (the quality protocol), its change against bf16, and the bytes the decoder linears'
tensors take (A, B, the kept core values, their 2:4 positions, the scales), computed from their shapes:
no 8-bit storage class exists yet to save one.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import types
from pathlib import Path

if importlib.util.find_spec("torch_armor") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from torch_armor import load_pretrained
from torch_armor.kernels.quant8 import QDTYPES, quantize_rows, scaled_core_mm_rows
from torch_armor.recipes.assets import smollm2_tokenizer, wiki_text
from torch_armor.recipes.data import eval_windows
from torch_armor.recipes.evaluate import perplexity
from torch_armor.tensor.armor_tensor import ArmorTensor
from torch_armor.tensor.linear_layout import armor_linear_rows


def armor_linears(model: nn.Module):
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and isinstance(m.weight, ArmorTensor)]


def with_8bit_cores(module: nn.Linear, qdtype: str) -> None:
    """``module`` (an ARMOR linear, bf16) runs its core as the 8-bit GEMM would."""
    w = module.weight
    q_core, core_scale = quantize_rows(w.core_dense().float(), qdtype)

    def forward(self, x):
        d_out, d_in = w.shape
        y = armor_linear_rows(x.reshape(-1, d_in), w.a_blocks, w.b_blocks,
                              lambda rows: scaled_core_mm_rows(rows, q_core, core_scale, qdtype, rows.dtype),
                              self.bias)
        return y.view(*x.shape[:-1], d_out)

    module.forward = types.MethodType(forward, module)


def linear_bytes(model: nn.Module, qdtype: str = "") -> int:
    """Bytes of the decoder linears' stored tensors: A and B (bf16), the kept core values (bf16, or one
    byte each for 8-bit cores plus a float32 scale per output channel), 1 bit of position per entry."""
    total = 0
    for _, m in armor_linears(model):
        d_out, d_in = m.weight.shape
        total += 2 * (m.weight.a_blocks.numel() + m.weight.b_blocks.numel())
        total += d_out * d_in // 2 * (1 if qdtype else 2) + (4 * d_out if qdtype else 0)
        total += d_out * d_in // 8
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="a pruned ARMOR output directory (torch-armor prune ... --out DIR)")
    p.add_argument("--formats", nargs="+", default=["bf16", "int8", "fp8"], choices=["bf16", *sorted(QDTYPES)])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--windows", type=int, default=64, help="Wikipedia windows of 512 tokens (protocol: 64)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    windows = eval_windows(wiki_text(), smollm2_tokenizer(), n_windows=args.windows, seq_len=512)
    command = "python benchmarks/quantized_cores.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"reproduce: `{command}`\ntorch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.windows} x 512 Wikipedia tokens\n")
    print("| cores | Wikipedia ppl | vs bf16 | decoder linears MB | eval s |\n|---|---:|---:|---:|---:|", flush=True)
    reference = None
    for fmt in args.formats:
        model = load_pretrained(args.model).to(torch.bfloat16).eval()
        qdtype = "" if fmt == "bf16" else fmt
        if qdtype:
            for _, module in armor_linears(model):
                with_8bit_cores(module, qdtype)
        start = time.perf_counter()
        ppl = perplexity(model, windows, progress=False)
        seconds = time.perf_counter() - start
        reference = ppl if fmt == "bf16" else reference
        change = f"{(ppl / reference - 1):+.2%}" if reference and fmt != "bf16" else "–"
        print(f"| {fmt} | {ppl:.2f} | {change} | {linear_bytes(model, qdtype) / 1e6:.1f} | {seconds:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
