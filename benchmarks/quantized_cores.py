"""What 8-bit 2:4 cores cost in quality and save on disk: a pruned ARMOR model, bf16 / int8 / fp8 cores.

    torch-armor prune smollm2 --out runs/smol            # the default ARMOR prune (once)
    python benchmarks/quantized_cores.py runs/smol --threads 2 --smooth 0 0.5
    python benchmarks/quantized_cores.py runs/smol --threads 2 --formats int8 --smooth 0 0.35 0.5 0.65 0.8 --held-out

The pruned model in bf16 is the reference; ``quantize_(model, ArmorCoreConfig(
Int8DynamicActivationInt8WeightConfig()))`` (and the fp8 config) gives it 8-bit 2:4 cores
(``torch_armor/tensor/eight_bit.py``), run on the CPU with the numbers cuSPARSELt's 8-bit GEMM computes:
the core quantized per output channel, each token's B-pass output per token, the 8-bit products summed
exactly (int8) or in fp32 (fp8), both scales applied where the A-pass reads the sums. ``--smooth`` first
moves the cores' input outliers into ``B`` with SmoothQuant's alpha (``torch_armor/tensor/smoothing.py``;
0 = off), from 8 windows of the prune's calibration text — what ``torch-armor quantize`` does. Per row:
perplexity (Wikipedia over 64 x 512 tokens, the quality protocol; with ``--held-out``, 16 x 512 tokens of
held-out calibration text — the prune's source, seed 1 — where alpha is chosen), its change against bf16,
and the bytes of the saved model's tensors (``save_pretrained``, read back with ``checkpoint_size``) against
the same model with dense bf16 weights. ``--formats int8-weights fp8-weights`` split the error: the cores'
8-bit values alone (dequantized into a bf16 core), activations not quantized.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

if importlib.util.find_spec("torch_armor") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Int8DynamicActivationInt8WeightConfig, quantize_

from torch_armor import load_pretrained
from torch_armor.cli.commands import prune_calibration
from torch_armor.recipes.assets import smollm2_tokenizer
from torch_armor.recipes.data import calibration_windows, eval_windows
from torch_armor.recipes.evaluate import perplexity
from torch_armor.tensor.finetune import checkpoint_size
from torch_armor.tensor.armor_tensor import ArmorTensor
from torch_armor.tensor.quant import ArmorCoreConfig, dequantize_armor_core
from torch_armor.format.serialization import save_pretrained
from torch_armor.tensor.smoothing import smooth_core_inputs

CONFIGS = {"int8": Int8DynamicActivationInt8WeightConfig, "fp8": Float8DynamicActivationFloat8WeightConfig}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="a pruned ARMOR output directory (torch-armor prune ... --out DIR)")
    p.add_argument("--formats", nargs="+", default=["bf16", "int8", "fp8"],
                   choices=["bf16", *CONFIGS, *(f"{q}-weights" for q in CONFIGS)])
    p.add_argument("--smooth", nargs="+", type=float, default=[0.0], metavar="ALPHA",
                   help="int8 / fp8 rows once per alpha (0 = no smoothing)")
    p.add_argument("--held-out", action="store_true", help="held-out calibration text instead of Wikipedia")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--windows", type=int, default=None, help="windows of 512 tokens (Wikipedia: 64, held-out: 16)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = smollm2_tokenizer()
    calib_text, seq_len = prune_calibration(args.model)
    n = args.windows or (16 if args.held_out else 64)
    windows = (calibration_windows(calib_text, tokenizer, n_windows=n, seq_len=seq_len, seed=1) if args.held_out
               else eval_windows("wiki", tokenizer, n_windows=n, seq_len=512))
    text = f"held-out {calib_text} (seed 1)" if args.held_out else "Wikipedia"
    smoothing_windows = calibration_windows(calib_text, tokenizer, n_windows=8, seq_len=seq_len)  # as quantize does
    command = "python benchmarks/quantized_cores.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"reproduce: `{command}`\ntorch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{n} x {windows.shape[1]} tokens of {text}\n")
    print(f"| cores | alpha | {text} ppl | vs bf16 | saved MB | dense bf16 MB | eval s |\n"
          "|---|---:|---:|---:|---:|---:|---:|", flush=True)
    reference = float("nan")  # no bf16 row in this run: no change column
    for fmt in args.formats:
        for alpha in (args.smooth if fmt in CONFIGS else [0.0]):
            model = load_pretrained(args.model).to(torch.bfloat16).eval()
            if alpha > 0:
                smooth_core_inputs(model, smoothing_windows.split(1), alpha)
            if fmt != "bf16":
                quantize_(model, ArmorCoreConfig(CONFIGS[fmt.removesuffix("-weights")](set_inductor_config=False)))
            if fmt.endswith("-weights"):  # the 8-bit values as a bf16 core: no activation quantization
                for module in model.modules():
                    if isinstance(getattr(module, "weight", None), ArmorTensor):
                        module.weight = torch.nn.Parameter(dequantize_armor_core(module.weight, "dense"),
                                                           requires_grad=False)
            with tempfile.TemporaryDirectory() as tmp:
                save_pretrained(model, tmp)
                size = checkpoint_size(tmp)
            start = time.perf_counter()
            ppl = perplexity(model, windows, progress=False)
            seconds = time.perf_counter() - start
            reference = ppl if fmt == "bf16" else reference
            change = f"{(ppl / reference - 1):+.2%}" if fmt != "bf16" and reference == reference else "–"
            print(f"| {fmt} | {alpha:g} | {ppl:.3f} | {change} | {size.bytes / 1e6:.1f} | "
                  f"{size.dense_parameter_bytes / 1e6:.1f} | {seconds:.0f} |", flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
