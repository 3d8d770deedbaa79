"""Issue #25's robustness cases for ``benchmarks/robustness.py``: crafted checkpoints, concurrent runs,
outputs over inputs, signals, load-path options, calibration input.

Each case builds its own hostile input on a tiny random Llama, runs the public API (``prune_model``,
``load_pretrained``, ``from_pretrained``, the command line, in subprocesses where processes matter)
and verifies what it can: an input's bytes (``check_kept``: "data loss" if changed), a loaded
model's logits or completeness (``check``: "silent wrong"). Registered by ``robustness.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


from torch_armor import ArmorConfig, PruneOptions  # noqa: E402
from torch_armor.config.armor import BcdConfig  # noqa: E402
from robustness_fixtures import (  # noqa: E402
    calib_ids,
    dense_dir,
    edit_qc,
    edit_tensors,
    first_layer,
    hf_dir,
    index_edit,
    load_checked,
    loads_wrong,
    logits_of,
    past_end,
    pruned_mlp_template,
    pruned_model,
    stream,
    text_file,
    tmp_dir,
    tokenizer_dir,
    torch_save_bytes,
)


def register(case, cli_case, CliResult, _cli, check, check_kept, code: Path) -> None:  # noqa: C901 - a list of cases
    """Add issue #25's cases to ``robustness.py``'s list."""

    # ------------------------------------------------------------------ crafted checkpoints
    for label, name in (("'../other/model.safetensors'", "../other/model.safetensors"), ("'/etc/passwd'", "/etc/passwd"),
                        ("'sub/x.safetensors'", "sub/x.safetensors"), ("the number 3", 3), ("'..'", "..")):
        @case("checkpoint", f"streamed prune: index names shard {label}", "index.json")
        def _(name=name):
            d = dense_dir(shards=True)
            if isinstance(name, str) and name.startswith("../other/"):
                other = d.parent / "other"
                other.mkdir()
                first = sorted(d.glob("model-*.safetensors"))[0]
                shutil.copy(first, other / "model.safetensors")
            stream(index_edit(d, name), check, check_kept)

    @case("checkpoint", "load_pretrained: ARMOR index names a shard outside the directory", "index.json")
    def _():
        from transformers import AutoModelForCausalLM

        src = hf_dir()
        d = src.parent / "sharded"
        AutoModelForCausalLM.from_pretrained(src).save_pretrained(d, max_shard_size="100KB")
        index = json.loads((d / "model.safetensors.index.json").read_text())
        key = sorted(index["weight_map"])[0]
        shutil.copy(d / index["weight_map"][key], d.parent / "stolen.safetensors")
        index_edit(d, "../stolen.safetensors")
        loads_wrong(d, check)

    def _damage(path: Path, how: str) -> None:
        data = path.read_bytes()
        path.write_bytes({"pickle": b"\x80\x04\x95" + b"\0" * 64, "truncated": data[: len(data) // 2], "empty": b"",
                          "zip": torch_save_bytes(), "past end": past_end(data)}[how])

    for how in ("pickle", "truncated", "empty", "past end"):
        @case("checkpoint", f"load_pretrained (HF format): {how} model.safetensors", "model.safetensors")
        def _(how=how):
            d = hf_dir()
            _damage(d / "model.safetensors", how)
            loads_wrong(d, check)

    for how in ("pickle", "truncated", "zip"):
        @case("checkpoint", f"streamed prune: {how} model.safetensors", "model.safetensors")
        def _(how=how):
            d = dense_dir()
            _damage(d / "model.safetensors", how)
            stream(d, check, check_kept)

    @cli_case("checkpoint", "CLI prune of a checkpoint whose weights file is a pickle", "model.safetensors")
    def _():
        d = dense_dir()
        _damage(d / "model.safetensors", "pickle")
        shutil.copytree(tokenizer_dir(), d, dirs_exist_ok=True)
        return _cli(["prune", str(d), "--calib", str(text_file()), "--n-calib", "2", "--seq-len", "16", "--method",
                     "magnitude", "--no-progress", "--out", str(d.parent / "out")])

    @cli_case("checkpoint", "CLI eval of an ARMOR directory with a truncated weights file", "model.safetensors")
    def _():
        d = hf_dir()
        _damage(d / "model.safetensors", "truncated")
        shutil.copytree(tokenizer_dir(), d, dirs_exist_ok=True)
        return _cli(["eval", str(d), "--data", str(text_file()), "--n-eval", "1", "--seq-len", "16", "--no-progress"])

    qc_edits = {
        "block size 24 (does not divide)": lambda q: q["layers"][first_layer(q)].update(block_size=24),
        "block size 32 (divides, wrong)": lambda q: q["layers"][first_layer(q)].update(block_size=32),
        "block size the string '16'": lambda q: q["layers"][first_layer(q)].update(block_size="16"),
        "pattern '5:4'": lambda q: q["layers"][first_layer(q)].update(pattern="5:4"),
        "pattern '1:4' (valid, wrong)": lambda q: q["layers"][first_layer(q)].update(pattern="1:4"),
        "dtype 'float16' (valid, wrong)": lambda q: q["layers"][first_layer(q)].update(dtype="float16"),
        "dtype 'int8'": lambda q: q["layers"][first_layer(q)].update(dtype="int8"),
        "the 'tensors' key removed": lambda q: q["layers"][first_layer(q)].pop("tensors"),
        "'layers' as a list": lambda q: q.update(layers=list(q["layers"])),
        "a stored layer missing from 'layers'": lambda q: q["layers"].pop(first_layer(q)),
        "storage 'sparse'": lambda q: q["layers"][first_layer(q)].update(storage="sparse"),
        "shape transposed": lambda q: q["layers"][first_layer(q)].update(shape=[128, 64] if q["layers"][first_layer(q)]["shape"] == [64, 128] else [64, 32]),
        "buffer rotary_emb.inv_freq given dtype 'int8'": lambda q: q["buffers"].update({"model.rotary_emb.inv_freq": "int8"}),
    }
    for label, fn in qc_edits.items():
        @case("checkpoint", f"load_pretrained: quantization_config {label}", "config.json")
        def _(fn=fn):
            d = edit_qc(hf_dir(), fn)
            loads_wrong(d, check)
            check(False, "an edited quantization_config loaded")  # even equal logits: the entry is wrong

    @case("checkpoint", "from_pretrained (transformers): quantization_config block size 32", "config.json")
    def _():
        from transformers import AutoModelForCausalLM

        d = edit_qc(hf_dir(), qc_edits["block size 32 (divides, wrong)"])
        AutoModelForCausalLM.from_pretrained(d)
        check(False, "an edited quantization_config loaded")

    def _nan(suffix, value=float("nan")):
        def fn(t):
            key = next(k for k in sorted(t) if k.endswith(suffix))
            t[key] = t[key].clone()
            t[key].view(-1)[3] = value
        return fn

    def _swap_positions(t):  # first group's two positions written in decreasing order
        key = next(k for k in sorted(t) if k.endswith(".indices"))
        t[key] = t[key].clone()
        b = int(t[key][0, 0])
        lo, hi = b & 3, (b >> 2) & 3
        t[key][0, 0] = (b & 0xF0) | hi | (lo << 2)

    def _dup_positions(t):
        key = next(k for k in sorted(t) if k.endswith(".indices"))
        t[key] = t[key].clone()
        t[key][0, 0] = 0

    for label, fn in (("NaN in an A block", _nan("q_proj.weight")), ("Inf in a B block", _nan(".b_blocks", float("inf"))),
                      ("NaN in the compact values", _nan(".values")), ("duplicate 2:4 positions", _dup_positions),
                      ("2:4 positions out of order", _swap_positions)):
        @case("checkpoint", f"load_pretrained (HF format): {label}", "layer 'model.layers")
        def _(fn=fn):
            d = edit_tensors(hf_dir(), fn)
            loads_wrong(d, check)
            check(False, "corrupt factors loaded")

    @case("checkpoint", "load_pretrained (HF format): duplicate 2:4 positions in an int8 core", "layer 'model.layers")
    def _():
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        from torch_armor import ArmorCoreConfig

        model = pruned_model()
        quantize_(model, ArmorCoreConfig(Int8WeightOnlyConfig(set_inductor_config=False)))
        d = tmp_dir() / "int8"
        model.save_pretrained(d)
        edit_tensors(d, _dup_positions)
        load_checked(d)
        check(False, "an int8 core with duplicate positions loaded")

    @case("checkpoint", "load_pretrained (torch_armor format): Inf in a saved factor", "up_proj")
    def _():
        from torch_armor import save_pretrained

        model = pruned_model()
        model.model.layers[0].mlp.up_proj.weight.a_blocks.view(-1)[0] = float("inf")
        d = tmp_dir() / "m"
        save_pretrained(model, d)
        load_checked(d)
        check(False, "an Inf factor loaded")

    @case("checkpoint", "load_pretrained (HF format): a norm weight missing from the file", "post_attention_layernorm")
    def _():
        d = edit_tensors(hf_dir(), lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
        loads_wrong(d, check)

    # ------------------------------------------------------------------ load-path options
    @case("load options", "from_pretrained(device_map={'': 'meta'})", "meta")
    def _():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir(), device_map={"": "meta"})
        logits_of(model)

    @case("load options", "load_pretrained(device='meta')", "meta")
    def _():
        logits_of(load_checked(hf_dir(), device="meta"))

    @case("load options", "load_pretrained(plain module, storage='semi_structured') on CPU")
    def _():
        from torch_armor import save_pretrained
        from torch_armor.tensor.armor_tensor import ArmorTensor

        model = pruned_model()
        d = tmp_dir() / "plain"
        save_pretrained(model.model.layers[0].mlp, d)  # no config.json: the torch_armor loader
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = load_checked(d, model_or_config=lambda: pruned_mlp_template(), storage="semi_structured")
        w = got.up_proj.weight
        said = [str(c.message) for c in caught if "semi_structured" in str(c.message)]
        # no 2:4 kernel on a CPU: compact cores (the same function), with one warning saying what 2:4 needs
        check(isinstance(w, ArmorTensor) and w.storage_format == "compact" and len(said) >= 1,
              f"asked for semi_structured on CPU: got {w.storage_format}, warnings {said}")

    @case("load options", "load_pretrained(storage='bogus')", "storage")
    def _():
        load_checked(hf_dir(), storage="bogus")

    @case("load options", "load_state_dict: block-16 state into a block-32 model", "block size 16")
    def _():
        from conftest import make_tiny_llama
        from torch_armor import prune_model

        a = pruned_model()
        b = make_tiny_llama()
        prune_model(b, calib_ids(), ArmorConfig(block_size=32, optimizer=BcdConfig(iters=1)), options=PruneOptions(progress=False))
        try:
            b.load_state_dict(a.state_dict())
        except RuntimeError as err:  # torch's documented load_state_dict error; it must name layer and both sizes
            text = " ".join(str(err).split())
            if "model.layers.0" in text and "block size 16" in text and "block size 32" in text:
                raise ValueError(text[:400]) from None
            raise

    @case("load options", "weight.copy_(weight of another block size)", "block size 32")
    def _():
        from conftest import make_tiny_llama
        from torch_armor import prune_model

        a = pruned_model()
        b = make_tiny_llama()
        prune_model(b, calib_ids(), ArmorConfig(block_size=32, optimizer=BcdConfig(iters=1)), options=PruneOptions(progress=False))
        a.model.layers[0].mlp.up_proj.weight.copy_(b.model.layers[0].mlp.up_proj.weight)

    from robustness_runs import register as register_runs

    register_runs(case, cli_case, CliResult, _cli, check, check_kept, code)
