"""Robustness cases of model directories as users have them (registered by ``robustness.py``): the Hugging
Face hub cache's symlinks, stale tensors of older checkpoints, weights that do not match their
config.json, Unicode and spaces in paths, another N:M pattern, and arguments that name no usable value.

A case that should prune or load verifies the result against a prune of the same tiny model in a
plain directory (byte-identical files, equal logits); at the command line a failure is classified by
its exit status and message. Tiny random Llama of the tests (``tests/_tiny_dir.py``), one thread.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import torch

from robustness_fixtures import STATE, tmp_dir


def _plain():
    """The tiny model in a plain directory and what ``prune`` writes for it (once)."""
    from _tiny_dir import fast_prune_args, save_tiny_model
    from torch_armor.cli.parser import main

    if "plain46" not in STATE:
        folder = tmp_dir()
        model_dir = save_tiny_model(folder)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert main(["prune", str(model_dir), "--out", str(folder / "out"), *fast_prune_args(folder)]) == 0
        STATE["plain46"] = (model_dir, folder / "out")
    return STATE["plain46"]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(12)[None] % 20).logits


def register(case, cli_case, _cli, check, check_kept) -> None:  # noqa: C901 - a list of cases
    """Add the cases to ``robustness.py``'s list."""
    from _tiny_dir import fast_prune_args

    def same_prune(source: Path, out: Path, *extra: str):
        """``prune SOURCE --out OUT``: the plain directory's files, loading to its logits; else the CLI's outcome."""
        from torch_armor import ArmorTensor, load_pretrained

        model_dir, plain = _plain()
        res = _cli(["prune", str(source), "--out", str(out), *fast_prune_args(model_dir.parent), *extra])
        if res.code != 0:
            return res
        for f in sorted(plain.iterdir()):
            if not f.name.startswith("prune_report"):
                check((out / f.name).is_file() and (out / f.name).read_bytes() == f.read_bytes(), f"{f.name} differs")
        loaded = load_pretrained(out)
        check(sum(isinstance(p, ArmorTensor) for p in loaded.parameters()) == 14, "not 14 ARMOR layers loaded back")
        check(torch.equal(_logits(loaded), _logits(load_pretrained(plain))), "logits differ from the plain prune")
        return None

    @cli_case("layouts", "CLI prune of a hub-cache snapshot (files are symlinks into blobs/)", "")
    def _():
        from _hub_cache import hub_cache_layout

        return same_prune(hub_cache_layout(_plain()[0], tmp_dir() / "hub"), tmp_dir() / "out")

    @case("layouts", "load_pretrained / from_pretrained of an ARMOR directory in the hub-cache layout")
    def _():
        from transformers import AutoModelForCausalLM

        from _hub_cache import hub_cache_layout
        from torch_armor import load_pretrained

        plain = _plain()[1]
        snapshot = hub_cache_layout(plain, tmp_dir() / "hub", repo="models--org--pruned")
        want = _logits(load_pretrained(plain))
        for load in (load_pretrained, AutoModelForCausalLM.from_pretrained):
            check(torch.equal(_logits(load(snapshot)), want), f"{load.__name__}: logits differ")

    @cli_case("layouts", "CLI prune of a checkpoint holding stale per-block rotary_emb.inv_freq tensors", "")
    def _():
        from safetensors.torch import load_file, save_file

        source = Path(shutil.copytree(_plain()[0], tmp_dir() / "stale"))
        tensors = load_file(source / "model.safetensors")
        for i in range(2):
            tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
        save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
        return same_prune(source, tmp_dir() / "out")

    @cli_case("layouts", "CLI prune of a checkpoint whose q_proj of block 0 has the wrong shape", "q_proj")
    def _():
        from safetensors.torch import load_file, save_file

        source = Path(shutil.copytree(_plain()[0], tmp_dir() / "bad"))
        tensors = load_file(source / "model.safetensors")
        key = "model.layers.0.self_attn.q_proj.weight"
        tensors[key] = tensors[key][:, :32].contiguous()
        save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
        out = tmp_dir() / "out"
        res = _cli(["prune", str(source), "--out", str(out), *fast_prune_args(_plain()[0].parent)])
        check(res.code != 0, "a checkpoint that does not match its config.json was pruned")
        return res

    @cli_case("layouts", "CLI prune and load back through paths with Unicode letters and spaces", "")
    def _():
        source = Path(shutil.copytree(_plain()[0], tmp_dir() / "modèle ü 模型" / "my model"))
        return same_prune(source, tmp_dir() / "sortie ü 出力" / "pruned out")

    @cli_case("layouts", "CLI prune --pattern 3:4: saved, loaded and described as 3:4", "")
    def _():
        from transformers import AutoModelForCausalLM

        from torch_armor import ArmorTensor, load_pretrained

        model_dir = _plain()[0]
        out = tmp_dir() / "out"
        res = _cli(["prune", str(model_dir), "--out", str(out), "--pattern", "3:4", *fast_prune_args(model_dir.parent)])
        if res.code != 0:
            return res
        quant = json.loads((out / "config.json").read_text())["quantization_config"]
        check(quant["pattern"] == "3:4" and {e["pattern"] for e in quant["layers"].values()} == {"3:4"},
              f"config.json says {quant['pattern']!r}")
        for model in (load_pretrained(out), AutoModelForCausalLM.from_pretrained(out)):
            weights = [p for p in model.parameters() if isinstance(p, ArmorTensor)]
            check(len(weights) == 14 and {w.pattern for w in weights} == {"3:4"}, "patterns read back are not 3:4")
            for w in weights:
                kept = (w.core_dense() != 0).reshape(w.shape[0], -1, 4).sum(-1)
                check(bool((kept == 3).all()), "a core does not keep 3 of every 4")
        return None

    def args_case(label: str, names: str, extra):
        @cli_case("cli", label, names)
        def _():
            model_dir = _plain()[0]
            work = tmp_dir()
            argv = [e(work) if callable(e) else e for e in extra]
            method = argv[argv.index("--method") + 1] if "--method" in argv else "armor"
            res = _cli(["prune", str(model_dir), "--out", str(work / "out"), *fast_prune_args(model_dir.parent, method),
                        *argv])
            check(not (work / "out").exists() or res.code == 0, "a refused prune left --out behind")
            return res

    @cli_case("overwrite", "--out '' (an unset shell variable)", "--out")
    def _():
        model_dir = _plain()[0]
        work = tmp_dir()
        cwd = Path.cwd()
        os.chdir(work)  # an empty --out used to mean the working directory
        try:
            res = _cli(["prune", str(model_dir), "--out", "", *fast_prune_args(model_dir.parent)])
        finally:
            os.chdir(cwd)
        check(not list(work.iterdir()), f"wrote {sorted(p.name for p in work.iterdir())[:3]} into the working directory")
        return res

    def binary_file(work: Path) -> str:
        (work / "calib.bin").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)
        return str(work / "calib.bin")

    for label, names, extra in (
        ("--n-calib 99999999999999999999", "--n-calib", ["--n-calib", "99999999999999999999"]),
        ("--calib a binary file", "--calib", ["--calib", binary_file]),
        ("--pattern '\u00b2:4' (a digit str.isdigit() accepts)", "--pattern", ["--pattern", "\u00b2:4"]),
        ("--method sparsegpt --sparsegpt-block-size 3", "--sparsegpt-block-size",
         ["--method", "sparsegpt", "--sparsegpt-block-size", "3"]),
    ):
        args_case(label, names, extra)
