"""Tutorial 1: prune → calibrate → convert → quantize → compile → save → load → generate.

Runs end to end in well under a minute on a laptop CPU, with nothing to download: the model
is a tiny Llama built from a config (random weights) and calibration uses random token ids,
so no tokenizer or dataset is needed. Swap in your own ``LlamaForCausalLM`` and real text
(see ``torch_armor.recipes.data``) for a real run; every call stays the same.

    python tutorials/01_prune_compile_quantize.py [--output-dir DIR]

The steps:

1. ``ArmorSparsifier.prepare(model)`` attaches statistics hooks to every decoder linear
   (q, k, v, o, gate, up, down; never embeddings or ``lm_head``).
2. Calibrate: ordinary forward passes over calibration batches.
3. ``convert(model)`` solves each layer (``W ≈ A · (2:4 core) · B``) and swaps its weight for an
   ``ArmorTensor``; the model is still a plain ``LlamaForCausalLM``.
4. ``quantize_(model, ArmorCoreConfig(Int8WeightOnlyConfig()))``: torchao quantizes the 2:4
   core to int8; ``A`` and ``B`` stay in fp32.
5. ``torch.compile(model, fullgraph=True)``: one graph, no breaks; output matches eager.
6. ``save_pretrained`` writes ``model.safetensors`` (int8 2:4 core packed, no pickle) +
   ``armor_config.json`` + ``config.json``; ``load_pretrained(dir)`` rebuilds the model from
   them, bit-identical.
7. ``model.generate`` on the loaded model.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

if importlib.util.find_spec("torch_armor") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# torch_armor first: it keeps torchao's and torch's import-time warnings about CUDA-only
# extensions (irrelevant on a CPU build) out of your output
from torch_armor.tensor.quant import ArmorCoreConfig
from torch_armor.format.serialization import load_pretrained, save_pretrained
from torch_armor.sparsifier import ArmorSparsifier
from torch_armor.tensor.armor_tensor import ArmorTensor
from torch_armor import ArmorConfig
from torch_armor.config.armor import BcdConfig

import torch  # noqa: E402
from torchao.quantization import Int8WeightOnlyConfig, quantize_  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def build_model(seed: int = 0) -> LlamaForCausalLM:
    """A tiny random Llama (hidden 64, 2 layers, vocab 256): stands in for your pretrained model."""
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` (Frobenius)."""
    return float((out - ref).norm() / ref.norm())


def main(argv: Optional[Sequence[str]] = None, output_dir: Optional[str] = None) -> Dict[str, Any]:
    """Run every step, print what happens, and return the measurements (used by the tests).

    Returns a dict with ``converted_layers``, ``rel_error_converted`` (vs dense),
    ``rel_error_int8`` (vs the fp32 converted model), ``compiled_max_abs_diff``,
    ``graph_breaks``, ``saved_bytes``, ``loaded_bit_identical``, ``generated_shape``,
    ``generated_equal`` (loaded vs in-memory model) and ``seconds``.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default=output_dir, help="where to save (default: a temporary directory)")
    args = parser.parse_args([] if argv is None else list(argv))
    start = time.perf_counter()
    torch.manual_seed(0)
    results: Dict[str, Any] = {}

    # 1-3. prepare → calibrate → convert --------------------------------------------------------
    model = build_model()
    vocab = model.config.vocab_size
    eval_ids = torch.randint(0, vocab, (2, 32))
    with torch.no_grad():
        dense_logits = model(eval_ids).logits

    sparsifier = ArmorSparsifier(ArmorConfig(block_size=16, optimizer=BcdConfig(iters=5)), progress=False)
    sparsifier.prepare(model)  # hooks on the 14 decoder linears
    with torch.no_grad():
        for _ in range(4):  # calibration: 4 batches of 8 random 64-token windows
            model(torch.randint(0, vocab, (8, 64)))
    model = sparsifier.convert(model)  # in place; weights become ArmorTensor
    converted = [n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), ArmorTensor)]
    results["converted_layers"] = len(converted)
    with torch.no_grad():
        fp32_logits = model(eval_ids).logits
    results["rel_error_converted"] = relative_error(fp32_logits, dense_logits)
    print(f"converted {len(converted)} linears, e.g. {converted[0]}: {model.get_submodule(converted[0]).weight}")
    print(f"relative logit change from pruning (random weights: not compressible) = {results['rel_error_converted']:.3f}")

    # 4. quantize the 2:4 core to int8 with torchao's own config --------------------------------
    quantize_(model, ArmorCoreConfig(Int8WeightOnlyConfig()))
    with torch.no_grad():
        int8_logits = model(eval_ids).logits
    results["rel_error_int8"] = relative_error(int8_logits, fp32_logits)
    w = model.model.layers[0].mlp.up_proj.weight
    print(f"int8 core: {type(w.core).__name__} {w.core.qdata.dtype}, A/B {w.a_blocks.dtype}; "
          f"relative logit error vs fp32 converted = {results['rel_error_int8']:.4f}")

    # 5. compile: one graph, no breaks ------------------------------------------------------------
    with torch.no_grad():
        results["graph_breaks"] = torch._dynamo.explain(model)(eval_ids).graph_break_count
        compiled = torch.compile(model, fullgraph=True)
        compiled_logits = compiled(eval_ids).logits
    results["compiled_max_abs_diff"] = float((compiled_logits - int8_logits).abs().max())
    print(f"torch.compile(fullgraph=True): {results['graph_breaks']} graph breaks, "
          f"max |compiled − eager| = {results['compiled_max_abs_diff']:.2e}")

    # 6. save → load ------------------------------------------------------------------------------
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.output_dir or tmp) / "tiny-llama-armor-int8"
        save_pretrained(model, out_dir)  # the module itself, not the compiled wrapper
        results["saved_bytes"] = (out_dir / "model.safetensors").stat().st_size
        print(f"saved to {out_dir}: {sorted(p.name for p in out_dir.iterdir())}, "
              f"model.safetensors {results['saved_bytes'] / 1e3:.0f} kB")
        loaded = load_pretrained(out_dir)  # builds LlamaForCausalLM from config.json
    with torch.no_grad():
        loaded_logits = loaded(eval_ids).logits
    results["loaded_bit_identical"] = bool(torch.equal(loaded_logits, int8_logits))
    print(f"loaded model's logits bit-identical to the saved model's: {results['loaded_bit_identical']}")

    # 7. generate ---------------------------------------------------------------------------------
    prompt = eval_ids[:, :8]
    gen_kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                      pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        generated = loaded.generate(prompt, **gen_kwargs)
        reference = model.generate(prompt, **gen_kwargs)
    results["generated_shape"] = tuple(generated.shape)
    results["generated_equal"] = bool(torch.equal(generated, reference))
    print(f"generated ids {tuple(generated.shape)}: {generated[0].tolist()}")
    results["seconds"] = time.perf_counter() - start
    print(f"done in {results['seconds']:.1f} s")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
