"""Bytes on disk of ARMOR-converted linears vs the same linears saved dense in fp32 (SmolLM2-135M).

    python benchmarks/storage.py [--block-size 16] [--num-iters 1]

Converts all 210 decoder linears of SmolLM2-135M-Instruct (fp32) with
``ArmorSparsifier(ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1)))`` after a tiny calibration on a
few random-token windows (this benchmark is about bytes, not quality: the factor values do not
change their size), saves the model with ``torch_armor.save_pretrained`` and compares, per
projection type, the bytes of the converted linears' tensors inside ``model.safetensors``
(2:4 values + packed index metadata + block-diagonal A/B) with the bytes of the same linears'
dense fp32 weights written with ``safetensors.torch.save_file``. Byte counts come from the
safetensors headers (each tensor's ``data_offsets``), so they are exactly what is on disk;
file sizes (headers included) are printed too.

It saves the converted model with ``model.save_pretrained`` too and measures, in a fresh process
each (``resource.getrusage``), the peak RSS of ``AutoModelForCausalLM.from_pretrained`` on it and
on the dense fp32 model saved the same way, against the dense fp32 model's parameter bytes.

It also reloads the directory with ``load_pretrained`` and checks that the loaded model's
logits are bit-identical to the in-memory converted model's on a few windows; then does the
same for the model with its cores quantized to int8 (``ArmorCoreConfig(Int8WeightOnlyConfig())``).

Target (issue): converted linears ≤ 0.60 × dense fp32 bytes at block size 16.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import struct
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

if importlib.util.find_spec("torch_armor") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import save_file
from torchao.quantization import Int8WeightOnlyConfig, quantize_

from torch_armor.recipes.assets import load_smollm2
from torch_armor.calibration.observer import decoder_linear_names
from torch_armor.tensor.quant import ArmorCoreConfig
from torch_armor.format.serialization import WEIGHTS_NAME, load_pretrained, save_pretrained
from torch_armor.sparsifier import ArmorSparsifier
from torch_armor import ArmorConfig
from torch_armor.config.armor import BcdConfig

TARGET_RATIO = 0.60


def safetensors_nbytes(path: Path) -> Dict[str, int]:
    """``{key: bytes}`` of every tensor in a safetensors file, read from its header."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def component(key: str, prefix: str) -> str:
    """Group an inner-tensor key of a converted layer: ``values``, ``indices``, ``scales`` or ``A/B``."""
    rest = key[len(prefix):]
    if key == prefix.rstrip(".") or rest in ("a_blocks", "b_blocks"):  # A lives under the weight's own key
        return "A/B"
    if rest.endswith("indices"):
        return "indices"
    if rest.startswith("core.") and not rest.startswith("core.qdata"):
        return "scales"  # a quantized core's scales / zero points
    return "values"  # compact values (fp32 or int8 qdata), or a dense core


ORDER = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def linear_table(title: str, armor_bytes: Dict[str, int], dense_bytes: Dict[str, int], names: List[str]) -> Dict[str, int]:
    """Print bytes per projection type (dense fp32 vs ARMOR by component); return the totals."""
    rows: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for name in names:
        kind = name.rsplit(".", 1)[-1]
        rows[kind]["count"] += 1
        rows[kind]["dense"] += dense_bytes[f"{name}.weight"]
        prefix = f"{name}.weight."
        keys = [k for k in armor_bytes if k.startswith(prefix) or k == f"{name}.weight"]
        if not keys:
            raise RuntimeError(f"{name} was not saved as a converted layer")
        for key in keys:
            rows[kind][component(key, prefix)] += armor_bytes[key]
            rows[kind]["armor"] += armor_bytes[key]
    print(f"\n## {title}")
    header = (f"{'linear':<10}{'count':>6}{'dense fp32 MB':>15}{'2:4 values':>12}{'indices':>10}{'scales':>9}"
              f"{'A/B':>9}{'ARMOR MB':>11}{'ratio':>8}")
    print(header)
    print("-" * len(header))
    total: Dict[str, int] = defaultdict(int)

    def line(label: str, r: Dict[str, int]) -> None:
        print(f"{label:<10}{r['count']:>6}{r['dense'] / 1e6:>15.2f}{r['values'] / 1e6:>12.2f}{r['indices'] / 1e6:>10.2f}"
              f"{r['scales'] / 1e6:>9.2f}{r['A/B'] / 1e6:>9.2f}{r['armor'] / 1e6:>11.2f}{r['armor'] / r['dense']:>8.3f}")

    for kind in sorted(rows, key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER)):
        line(kind, rows[kind])
        for key, value in rows[kind].items():
            total[key] += value
    print("-" * len(header))
    line("all", total)
    return total


_RSS_CODE = """
import resource, sys, torch
torch.set_num_threads(1)
import torch_armor
from transformers import AutoModelForCausalLM
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
n = sum(isinstance(m.weight, torch_armor.ArmorTensor) for m in model.modules() if hasattr(m, "weight"))
with torch.no_grad():  # touches every weight (mmap-backed pages become resident)
    model(torch.zeros(1, 16, dtype=torch.long))
forward = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(base, peak, n, forward)
"""


def from_pretrained_peak_rss(directory: Path) -> Dict[str, int]:
    """Peak resident memory (bytes, ``resource.getrusage(RUSAGE_SELF).ru_maxrss``) of a fresh process
    that imports torch_armor and runs ``AutoModelForCausalLM.from_pretrained(directory)``, and the
    same right after the imports (``base``)."""
    import os
    import subprocess

    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # Launched through a small intermediate Python: Linux carries the RSS high-water mark of the
    # process that forks into the child's ru_maxrss across exec, and this benchmark process is large.
    hop = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"
    out = subprocess.run([sys.executable, "-c", hop, sys.executable, "-c", _RSS_CODE, str(directory)],
                         capture_output=True, text=True, env=env, check=True).stdout.split()
    base, peak, n, forward = (int(v) for v in out[-4:])
    return {"base": base, "peak": peak, "armor_layers": n, "forward": forward}


def save_dense_copy(model, dense: Dict[str, torch.Tensor], directory: Path) -> int:
    """Save the dense fp32 SmolLM2 (the converted model's plain tensors + the original dense linears)
    as an ordinary Hugging Face directory; return the bytes of all its parameters."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        twin = AutoModelForCausalLM.from_config(model.config.__class__.from_dict(
            {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}))
    state = {k: v for k, v in model.state_dict().items() if not hasattr(v, "a_blocks")}
    state.update({f"{n}.weight": w for n, w in dense.items()})
    twin.load_state_dict(state, strict=False, assign=True)
    twin.tie_weights()
    twin.save_pretrained(directory)
    return sum(p.numel() * p.element_size() for p in twin.parameters())


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    parser = argparse.ArgumentParser(description="ARMOR storage benchmark on SmolLM2-135M")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-iters", type=int, default=1, help="BCD iterations per layer (bytes do not depend on it)")
    parser.add_argument("--calib-windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--check-windows", type=int, default=4, help="windows for the bit-identical reload check")
    args = parser.parse_args(argv)
    print("reproduce: python benchmarks/storage.py " + " ".join(shlex.quote(a) for a in (argv or [])))
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")

    torch.manual_seed(0)
    model, _ = load_smollm2(torch.float32)
    names = decoder_linear_names(model)
    dense = {name: model.get_submodule(name).weight.detach().clone() for name in names}
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    calib = torch.randint(0, vocab, (args.calib_windows, args.seq_len), generator=gen)
    check = torch.randint(0, vocab, (args.check_windows, args.seq_len), generator=gen)

    start = time.perf_counter()
    sparsifier = ArmorSparsifier(ArmorConfig(block_size=args.block_size, optimizer=BcdConfig(iters=args.num_iters)),
                                 progress=False)
    sparsifier.prepare(model)
    with torch.no_grad():
        for row in calib:
            model(row[None])
    model = sparsifier.convert(model)
    convert_s = time.perf_counter() - start
    print(f"converted {len(names)} decoder linears (block size {args.block_size}, BCD x{args.num_iters}) "
          f"in {convert_s:.0f} s")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        armor_dir = tmp / "armor"
        save_pretrained(model, armor_dir)
        dense_file = tmp / "dense_linears.safetensors"
        save_file({f"{n}.weight": w.contiguous() for n, w in dense.items()}, str(dense_file))
        armor_bytes = safetensors_nbytes(armor_dir / WEIGHTS_NAME)
        dense_bytes = safetensors_nbytes(dense_file)
        armor_file_size = (armor_dir / WEIGHTS_NAME).stat().st_size
        dense_file_size = dense_file.stat().st_size

        total = linear_table("fp32 ARMOR (what convert() gives)", armor_bytes, dense_bytes, names)
        ratio = total["armor"] / total["dense"]
        other_bytes = sum(armor_bytes.values()) - total["armor"]
        print()
        print(f"ratio (converted linears / dense fp32 linears) = {ratio:.4f}  "
              f"(target <= {TARGET_RATIO:.2f}: {'PASS' if ratio <= TARGET_RATIO else 'FAIL'})")
        print(f"  of which: 2:4 values {total['values'] / total['dense']:.4f}, index metadata "
              f"{total['indices'] / total['dense']:.4f}, A/B {total['A/B'] / total['dense']:.4f}")
        print(f"files: {WEIGHTS_NAME} {armor_file_size / 1e6:.2f} MB (linears {total['armor'] / 1e6:.2f} MB + embeddings, "
              f"norms, lm_head {other_bytes / 1e6:.2f} MB + header); dense linears file {dense_file_size / 1e6:.2f} MB")

        loaded = load_pretrained(armor_dir)
        hf_dir = tmp / "armor_hf"
        model.save_pretrained(hf_dir)  # transformers' writer through the ARMOR quantizer: the same layout
        dense_model_dir = tmp / "dense_model"
        dense_model_bytes = save_dense_copy(model, dense, dense_model_dir)
        rss = {kind: from_pretrained_peak_rss(d) for kind, d in (("armor", hf_dir), ("dense", dense_model_dir))}
    print("\n## peak RSS of AutoModelForCausalLM.from_pretrained (fresh process, 1 thread, ru_maxrss)")
    print(f"dense fp32 model bytes (all parameters): {dense_model_bytes / 2**20:.1f} MiB")
    for kind, r in rss.items():
        print(f"{kind:>6}: peak RSS {r['peak'] / 2**20:.1f} MiB = {r['base'] / 2**20:.1f} MiB after imports "
              f"+ {(r['peak'] - r['base']) / 2**20:.1f} MiB for loading; {r['armor_layers']} ArmorTensor weights; "
              f"after one 16-token forward {r['forward'] / 2**20:.1f} MiB")
    print("(safetensors memory-maps the file: pages a load does not touch are not resident until a forward "
          "pass reads them, hence the dense model's small loading increase)")
    armor_load = rss["armor"]["peak"] - rss["armor"]["base"]
    print(f"ARMOR load increase / dense fp32 model bytes = {armor_load / dense_model_bytes:.3f}; "
          f"ARMOR peak RSS (whole process) {'below' if rss['armor']['peak'] < dense_model_bytes else 'ABOVE'} "
          f"the dense fp32 model's bytes")
    identical = True
    max_diff = 0.0
    with torch.no_grad():
        for row in check:
            a = model(row[None]).logits
            b = loaded(row[None]).logits
            identical &= bool(torch.equal(a, b))
            max_diff = max(max_diff, float((a - b).abs().max()))
    print(f"reloaded logits bit-identical to the in-memory converted model on {len(check)} windows of "
          f"{args.seq_len} tokens: {identical} (max |diff| = {max_diff:.1e})")
    del loaded

    # the same model with its cores quantized to int8 (A, B stay fp32), saved the same way
    quantize_(model, ArmorCoreConfig(Int8WeightOnlyConfig(set_inductor_config=False)))
    with tempfile.TemporaryDirectory() as tmp:
        int8_dir = Path(tmp) / "armor_int8"
        save_pretrained(model, int8_dir)
        int8_total = linear_table(
            "ARMOR with int8 core (quantize_(model, ArmorCoreConfig(Int8WeightOnlyConfig())))",
            safetensors_nbytes(int8_dir / WEIGHTS_NAME), dense_bytes, names,
        )
        int8_ratio = int8_total["armor"] / int8_total["dense"]
        loaded = load_pretrained(int8_dir)
        with torch.no_grad():
            int8_identical = all(torch.equal(model(row[None]).logits, loaded(row[None]).logits) for row in check)
    print(f"\nint8-core ratio (vs dense fp32 linears) = {int8_ratio:.4f}; reloaded logits bit-identical: {int8_identical}")
    return {"ratio": ratio, "bit_identical": float(identical), "int8_ratio": int8_ratio,
            "armor_peak_rss": rss["armor"]["peak"], "dense_peak_rss": rss["dense"]["peak"],
            "dense_model_bytes": dense_model_bytes,
            "int8_bit_identical": float(int8_identical), "convert_s": convert_s}


if __name__ == "__main__":
    main(sys.argv[1:])
