"""What 8-bit 2:4 cores cost in quality and save on disk: a pruned ARMOR model, bf16 / int8 / fp8 cores.

    torch-armor prune smollm2 --out runs/smol            # the default ARMOR prune (once)
    python benchmarks/quantized_cores.py runs/smol --threads 2

The pruned model in bf16 is the reference; ``quantize_(model, ArmorCoreConfig(
Int8DynamicActivationInt8WeightConfig()))`` (and the fp8 config) gives it 8-bit 2:4 cores
(``torch_armor/tensor/eight_bit.py``), run on the CPU with the numbers cuSPARSELt's 8-bit GEMM computes:
the core quantized per output channel, each token's B-pass output per token, the 8-bit products summed
exactly (int8) or in fp32 (fp8), both scales applied where the A-pass reads the sums. Per row: Wikipedia
perplexity over 64 x 512 tokens (the quality protocol), its change against bf16, and the bytes of the
saved model's tensors (``save_pretrained``, read back with ``checkpoint_size``) against the same model
with dense bf16 weights. ``--formats int8-weights fp8-weights`` split the error: the cores' 8-bit values
alone (dequantized into a bf16 core), activations not quantized.
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
from torch_armor.recipes.assets import smollm2_tokenizer
from torch_armor.recipes.data import eval_windows
from torch_armor.recipes.evaluate import perplexity
from torch_armor.tensor.finetune import checkpoint_size
from torch_armor.tensor.armor_tensor import ArmorTensor
from torch_armor.tensor.quant import ArmorCoreConfig, dequantize_armor_core
from torch_armor.tensor.serialization import save_pretrained

CONFIGS = {"int8": Int8DynamicActivationInt8WeightConfig, "fp8": Float8DynamicActivationFloat8WeightConfig}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="a pruned ARMOR output directory (torch-armor prune ... --out DIR)")
    p.add_argument("--formats", nargs="+", default=["bf16", "int8", "fp8"],
                   choices=["bf16", *CONFIGS, *(f"{q}-weights" for q in CONFIGS)])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--windows", type=int, default=64, help="Wikipedia windows of 512 tokens (protocol: 64)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    windows = eval_windows("wiki", smollm2_tokenizer(), n_windows=args.windows, seq_len=512)
    command = "python benchmarks/quantized_cores.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"reproduce: `{command}`\ntorch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.windows} x 512 Wikipedia tokens\n")
    print("| cores | Wikipedia ppl | vs bf16 | saved MB | dense bf16 MB | eval s |\n|---|---:|---:|---:|---:|---:|",
          flush=True)
    reference = None
    for fmt in args.formats:
        model = load_pretrained(args.model).to(torch.bfloat16).eval()
        if fmt != "bf16":
            quantize_(model, ArmorCoreConfig(CONFIGS[fmt.removesuffix("-weights")](set_inductor_config=False)))
        if fmt.endswith("-weights"):  # the 8-bit values as a bf16 core: no activation quantization
            for module in model.modules():
                if isinstance(getattr(module, "weight", None), ArmorTensor):
                    module.weight = torch.nn.Parameter(dequantize_armor_core(module.weight, "dense"), requires_grad=False)
        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(model, tmp)
            size = checkpoint_size(tmp)
        start = time.perf_counter()
        ppl = perplexity(model, windows, progress=False)
        seconds = time.perf_counter() - start
        if reference is None and fmt != "bf16":
            reference = float("nan")  # no bf16 row in this run: no change column
        reference = ppl if fmt == "bf16" else reference
        change = f"{(ppl / reference - 1):+.2%}" if fmt != "bf16" and reference == reference else "–"
        print(f"| {fmt} | {ppl:.2f} | {change} | {size.bytes / 1e6:.1f} | {size.dense_parameter_bytes / 1e6:.1f} "
              f"| {seconds:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
