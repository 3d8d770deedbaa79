"""Command line smoke tests: ``prune`` then ``eval`` end to end on the real SmolLM2 (two decoder
layers, tiny calibration), a local Hugging Face directory, argument errors, ``python -m``."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _helpers import assert_same_saved_model
from _tiny_dir import fast_prune_args, save_tiny_model
from torch_armor.cli.parser import REPORT_JSON, REPORT_PNG, main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def text_files(tmp_path_factory, sotu_available, wiki_available):
    """Heads of the protocol texts as files (tokenizing the full texts takes ~15 s)."""
    from torch_armor.recipes.assets import sotu_text, wiki_text

    folder = tmp_path_factory.mktemp("texts")
    (folder / "sotu.txt").write_text(sotu_text()[:20000], encoding="utf-8")
    (folder / "wiki.txt").write_text(wiki_text()[:20000], encoding="utf-8")
    return folder / "sotu.txt", folder / "wiki.txt"


def _perplexity_line(out: str) -> float:
    match = re.search(r"^perplexity: (\S+)", out, re.M)
    assert match, out
    return float(match.group(1))


@pytest.fixture
def keep_threads():
    """``--threads`` sets torch's global thread count: put it back afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_prune_then_eval_smollm2_two_layers(tmp_path, capsys, smollm2_tokenizer, text_files, keep_threads):
    calib, wiki = text_files
    out = tmp_path / "armor"
    # one thread: many small ops per ARMOR sweep, and the CI machine may be shared
    code = main(["prune", "smollm2", "--out", str(out), "--layers", "0-1", "--calib", str(calib),
                 "--n-calib", "2", "--seq-len", "64", "--iters", "2", "--block-size", "auto", "--threads", "1",
                 "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "pruned 14 linears" in printed and "wrapper overhead" in printed
    # the loss ARMOR minimised last (output space, refined by default) and the share of the gap it closes
    assert re.search(r"layer output loss 0\.\d{4} × NoWag-P's: closes \d+\.\d% of the gap", printed), printed
    assert "proxy" not in printed.split("\n")[0] and "NoWag-P = 1" not in printed

    for name in ("model.safetensors", "armor_config.json", "config.json", "tokenizer.json", REPORT_JSON, REPORT_PNG):
        assert (out / name).is_file(), name
    report = json.loads((out / REPORT_JSON).read_text())
    kinds = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert [entry["name"] for entry in report["layers"]] == [f"model.layers.{i}.{k}" for i in (0, 1) for k in kinds]
    for entry in report["layers"]:
        # refined in output space (the default): the output loss is what never exceeds NoWag-P's
        assert entry["relative_output_loss"] is not None and 0 < entry["relative_output_loss"] <= 1.0 + 1e-6
        assert 0 < entry["relative_proxy_loss"] < float("inf") and entry["seconds"] >= 0
        assert entry["details"]["block_size"] in (4, 12, 16)  # --block-size auto within 5%
    assert report["method"] == "armor" and report["command"].startswith("torch-armor prune smollm2")
    assert 0 < report["overhead"] <= 0.05
    assert (out / REPORT_PNG).read_bytes()[:4] == b"\x89PNG"

    code = main(["eval", str(out), "--data", str(wiki), "--n-eval", "2", "--seq-len", "64", "--no-progress"])
    assert code == 0
    ppl_cli = _perplexity_line(capsys.readouterr().out)
    assert math.isfinite(ppl_cli) and ppl_cli > 1

    from transformers import AutoTokenizer

    from torch_armor.recipes.data import eval_windows
    from torch_armor.recipes.evaluate import perplexity
    from torch_armor.format.serialization import load_pretrained
    from torch_armor.tensor.armor_tensor import ArmorTensor

    model = load_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer("Hello world", add_special_tokens=False).input_ids == [19556, 905]
    assert isinstance(model.model.layers[1].mlp.down_proj.weight, ArmorTensor)
    assert not isinstance(model.model.layers[2].self_attn.q_proj.weight, ArmorTensor)
    assert not isinstance(model.lm_head.weight, ArmorTensor)
    ppl = perplexity(model, eval_windows(str(wiki), tokenizer, n_windows=2, seq_len=64), progress=False)
    assert ppl_cli == pytest.approx(ppl, rel=1e-6)


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory, smollm2_tokenizer):
    """A random tiny Llama with SmolLM2's vocabulary, saved as a plain Hugging Face directory."""
    from conftest import make_tiny_llama

    folder = tmp_path_factory.mktemp("tiny_hf")
    model = make_tiny_llama(vocab=len(smollm2_tokenizer))
    model.save_pretrained(str(folder))
    smollm2_tokenizer.save_pretrained(str(folder))
    return folder


def test_prune_local_hf_directory_with_baseline(tmp_path, capsys, tiny_hf_dir, text_files):
    calib, wiki = text_files
    common = ["--n-calib", "4", "--seq-len", "32", "--no-progress"]
    code = main(["eval", str(tiny_hf_dir), "--data", str(wiki), "--n-eval", "2", "--seq-len", "32", "--no-progress", "--json"])
    assert code == 0
    dense = json.loads(capsys.readouterr().out)
    out = tmp_path / "sgpt"
    code = main(["prune", str(tiny_hf_dir), "--out", str(out), "--method", "sparsegpt", "--calib", str(calib), *common])
    assert code == 0
    capsys.readouterr()
    report = json.loads((out / REPORT_JSON).read_text())
    assert report["method"] == "sparsegpt" and len(report["layers"]) == 14 and report["overhead"] == 0
    from torch_armor.format.serialization import load_pretrained

    model = load_pretrained(out)
    w = model.model.layers[0].mlp.up_proj.weight.detach()
    assert int((w.reshape(w.shape[0], -1, 4) != 0).sum(-1).max()) <= 2
    assert main(["eval", str(out), "--data", str(wiki), "--n-eval", "2", "--seq-len", "32", "--no-progress", "--json"]) == 0
    pruned = json.loads(capsys.readouterr().out)
    assert math.isfinite(pruned["perplexity"]) and pruned["perplexity"] != dense["perplexity"]

    # errors: non-empty --out, a --layers restriction that selects nothing
    assert main(["prune", str(tiny_hf_dir), "--out", str(out), "--method", "wanda", *common]) == 2
    assert "not empty" in capsys.readouterr().err
    code = main(["prune", str(tiny_hf_dir), "--out", str(tmp_path / "x"), "--layers", "7-9", "--calib", str(calib), *common])
    assert code == 2 and "selects none" in capsys.readouterr().err


def _armor_args(model_dir, calib) -> list:
    return [str(model_dir), "--calib", str(calib), "--n-calib", "2", "--seq-len", "32", "--block-size", "16",
            "--iters", "3", "--threads", "1", "--no-progress"]


def test_interrupted_prune_resumes_from_run_dir(tmp_path, capsys, monkeypatch, tiny_hf_dir, text_files, keep_threads):
    import torch_armor.armor.method as engine_runner  # where the ARMOR method calls factorize

    calib, _ = text_files
    args = _armor_args(tiny_hf_dir, calib)
    reference = tmp_path / "reference"
    assert main(["prune", *args, "--out", str(reference)]) == 0
    assert not (reference / "armor_run").exists()  # the default run directory goes after a successful save
    capsys.readouterr()

    real_factorize = engine_runner.factorize
    calls = {"factorize": 0}

    def crashing_factorize(*a, **k):
        calls["factorize"] += 1
        if calls["factorize"] == 6:
            raise RuntimeError("simulated crash")
        return real_factorize(*a, **k)

    monkeypatch.setattr(engine_runner, "factorize", crashing_factorize)
    out, run_dir = tmp_path / "out", tmp_path / "run"
    # an unexpected error: one line on stderr and exit 1, no traceback (--debug shows it)
    assert main(["prune", *args, "--out", str(out), "--run-dir", str(run_dir)]) == 1
    assert "internal error: RuntimeError: simulated crash" in capsys.readouterr().err
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert sorted(e["status"] for e in manifest["layers"].values()).count("done") == 5
    assert calls == {"factorize": 6}

    counted = []
    monkeypatch.setattr(engine_runner, "factorize", lambda *a, **k: counted.append(1) or real_factorize(*a, **k))
    assert main(["prune", *args, "--out", str(out), "--run-dir", str(run_dir), "--overwrite"]) == 0
    assert "5 of 14 layers already finished" in capsys.readouterr().err
    assert len(counted) == 14 - 5  # finished layers are not recomputed
    assert_same_saved_model(out, reference)
    assert run_dir.is_dir()  # an explicit --run-dir is kept

    # the same run directory with other settings is refused, naming the difference
    code = main(["prune", *args[:-5], "--iters", "4", "--threads", "1", "--no-progress",
                 "--out", str(tmp_path / "other"), "--run-dir", str(run_dir)])
    assert code == 2
    err = capsys.readouterr().err
    assert "optimizer.iters: run has 3, now 4" in err


@pytest.mark.parametrize("reconstruct", ["0", "2"])
def test_torchrun_two_ranks_match_one_process(tmp_path, capsys, tiny_hf_dir, text_files, keep_threads, reconstruct):
    from _helpers import free_port

    calib, _ = text_files
    args = _armor_args(tiny_hf_dir, calib) + ["--reconstruct-steps", reconstruct]
    single = tmp_path / "single"
    assert main(["prune", *args, "--out", str(single)]) == 0
    sharded, run_dir = tmp_path / "sharded", tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LOGLEVEL="WARNING")
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "torch_armor", "prune", *args, "--out", str(sharded),
           "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("pruned 14 linears") == 1  # rank 0 alone assembles and saves
    assert_same_saved_model(sharded, single)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    # block reconstruction re-saves every layer from rank 0, hiding who factorized what
    assert {e["rank"] for e in manifest["layers"].values()} == ({0, 1} if reconstruct == "0" else {0})
    assert json.loads((sharded / REPORT_JSON).read_text())["ranks"] == 2


def test_baselines_refuse_torchrun(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["prune", "smollm2", "--method", "wanda", "--out", str(tmp_path / "x")]) == 2
    assert "only a method that stores finished layers (armor) runs on several ranks" in capsys.readouterr().err


def test_argument_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["prune", "smollm2", "--out", "x", "--block-size", "0"])
    assert exc.value.code == 2
    assert "block size must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["prune", "smollm2"])  # --out is required
    assert "--out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])


def test_python_dash_m_help():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-m", "torch_armor", "--help"], capture_output=True, text=True, env=env,
                         cwd=str(ROOT), timeout=120)
    assert run.returncode == 0, run.stderr
    assert "prune" in run.stdout and "eval" in run.stdout and "demo" in run.stdout


def test_block_size_default_is_the_config_default():
    from torch_armor import ArmorConfig
    from torch_armor.config.armor import ReconstructConfig
    from torch_armor.cli.parser import build_parser
    from torch_armor.cli.flags import config_from_flags

    def _armor_config(args):
        return config_from_flags(args, ArmorConfig)

    parser = build_parser()
    for argv in (["prune", "smollm2", "--out", "x"], ["demo"]):
        args = parser.parse_args(argv)
        assert _armor_config(args) == ArmorConfig()
    auto = parser.parse_args(["prune", "smollm2", "--out", "x", "--block-size", "auto", "--max-overhead", "0.1"])
    assert _armor_config(auto) == ArmorConfig(block_size="auto", max_overhead=0.1)
    adam = parser.parse_args(["prune", "smollm2", "--out", "x", "--optimizer", "adam"])
    assert _armor_config(adam).optimizer.iterations == 1000
    issue12 = parser.parse_args(["prune", "smollm2", "--out", "x", "--block-size", "budget", "--refine", "none",
                                 "--reconstruct-steps", "5"])
    assert _armor_config(issue12) == ArmorConfig(block_size="budget", refine=None, reconstruct=ReconstructConfig(steps=5))


def test_preset_then_the_options_given():
    import dataclasses

    from torch_armor import ArmorConfig
    from torch_armor.cli.parser import build_parser
    from torch_armor.cli.flags import config_from_flags

    def _armor_config(args):
        return config_from_flags(args, ArmorConfig)

    parser = build_parser()
    for name in ("fast", "default", "max"):
        args = parser.parse_args(["prune", "smollm2", "--out", "x", "--preset", name])
        assert _armor_config(args) == ArmorConfig.preset(name)
    fast = ArmorConfig.preset("fast")
    args = parser.parse_args(["prune", "smollm2", "--out", "x", "--preset", "fast", "--iters", "3",
                              "--reconstruct-steps", "7", "--block-size", "8"])
    assert _armor_config(args) == dataclasses.replace(
        fast, block_size=8, optimizer=dataclasses.replace(fast.optimizer, iters=3),
        reconstruct=dataclasses.replace(fast.reconstruct, steps=7))
    assert _armor_config(parser.parse_args(["prune", "smollm2", "--out", "x", "--preset", "max", "--refine", "none",
                                            "--reconstruct-steps", "0"])).reconstruct is None
    distilled = _armor_config(parser.parse_args(["prune", "smollm2", "--out", "x", "--preset", "max", "--distill-steps", "5"]))
    assert distilled.distill == dataclasses.replace(ArmorConfig.preset("max").distill, steps=5)
    assert _armor_config(parser.parse_args(["prune", "smollm2", "--out", "x", "--distill-steps", "0"])).distill is None
    with pytest.raises(SystemExit):
        parser.parse_args(["prune", "smollm2", "--out", "x", "--preset", "slow"])


def test_prune_prints_stored_and_dense_sizes(tmp_path, capsys, tiny_hf_dir, text_files):
    """The prune report gives both sizes: what is stored and what the dense model holds."""
    import re

    from torch_armor import load_pretrained
    from torch_armor.tensor.finetune import model_size

    calib, _ = text_files
    out = tmp_path / "armor"
    code = main(["prune", str(tiny_hf_dir), "--out", str(out), "--calib", str(calib), "--n-calib", "2",
                 "--seq-len", "32", "--iters", "2", "--threads", "1", "--no-progress"])
    assert code == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("size:"))
    stored, dense = (int(v.replace(",", "")) for v in re.findall(r"([\d,]+) (?:stored )?parameters", line))
    model = load_pretrained(out)
    assert stored == model_size(model).parameters < dense == model.num_parameters()


def test_eval_of_a_saved_moe_directory(tmp_path, capsys, smollm2_tokenizer, text_files, keep_threads):
    """``eval`` on a Qwen3-MoE directory with ARMOR experts (model.save_pretrained + tokenizer) runs the
    ARMOR experts and gives the perplexity of the model it was saved from."""
    from _tiny_moe import armor_moe
    from torch_armor.recipes.data import eval_windows
    from torch_armor.recipes.evaluate import perplexity

    _, wiki = text_files
    model, _ = armor_moe("qwen3_moe", vocab=len(smollm2_tokenizer))
    model.save_pretrained(tmp_path / "moe")
    smollm2_tokenizer.save_pretrained(str(tmp_path / "moe"))
    code = main(["eval", str(tmp_path / "moe"), "--data", str(wiki), "--n-eval", "2", "--seq-len", "32",
                 "--no-progress", "--json", "--threads", "1"])
    assert code == 0
    got = json.loads(capsys.readouterr().out)["perplexity"]
    want = perplexity(model, eval_windows(str(wiki), smollm2_tokenizer, n_windows=2, seq_len=32), progress=False)
    assert math.isfinite(got) and got == pytest.approx(want, rel=1e-6)



@pytest.fixture(scope="module")
def plain_prune(tmp_path_factory):
    """A tiny model in a plain directory and what ``prune`` writes for it."""

    folder = tmp_path_factory.mktemp("plain")
    model_dir = save_tiny_model(folder)
    threads = torch.get_num_threads()
    try:
        assert main(["prune", str(model_dir), "--out", str(folder / "out"), *fast_prune_args(folder)]) == 0
    finally:
        torch.set_num_threads(threads)
    return model_dir, folder / "out"


def _hub_cache(model_dir: Path, folder: Path) -> Path:
    from _hub_cache import hub_cache_layout

    return hub_cache_layout(model_dir, folder / "hub")  # every file a symlink to ../../blobs/<sha256>


def _stale_inv_freq(model_dir: Path, folder: Path) -> Path:
    from safetensors.torch import load_file, save_file

    copy = folder / "stale"
    shutil.copytree(model_dir, copy)
    tensors = load_file(copy / "model.safetensors")
    for i in range(2):  # the per-block buffer of Llama checkpoints written by transformers < 4.31
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


def _unicode_path(model_dir: Path, folder: Path) -> Path:
    return Path(shutil.copytree(model_dir, folder / "modèle ü 模型 v1" / "my model"))


@pytest.mark.parametrize("layout", ["hub cache", "stale inv_freq", "unicode path"])
def test_prune_of_the_same_model_in_another_layout_writes_the_same_files(layout, plain_prune, tmp_path, keep_threads):
    model_dir, plain_out = plain_prune
    source = {"hub cache": _hub_cache, "stale inv_freq": _stale_inv_freq, "unicode path": _unicode_path}[layout](
        model_dir, tmp_path)
    out = tmp_path / ("sortie ü 出力" if layout == "unicode path" else "") / "pruned out"
    assert main(["prune", str(source), "--out", str(out), *fast_prune_args(model_dir.parent)]) == 0
    written = sorted(p.name for p in plain_out.iterdir() if not p.name.startswith("prune_report"))
    assert "model.safetensors.index.json" in written and sorted(
        p.name for p in out.iterdir() if not p.name.startswith("prune_report")) == written
    for name in written:
        assert (out / name).read_bytes() == (plain_out / name).read_bytes(), name
    from torch_armor import ArmorTensor, load_pretrained

    loaded, reference = load_pretrained(out), load_pretrained(plain_out)
    assert sum(isinstance(p, ArmorTensor) for p in loaded.parameters()) == 14
    with torch.no_grad():
        assert torch.equal(loaded(torch.arange(12)[None]).logits, reference(torch.arange(12)[None]).logits)


def test_a_3_4_prune_is_saved_as_3_4_and_says_so(plain_prune, tmp_path, keep_threads):
    from transformers import AutoModelForCausalLM

    from torch_armor import ArmorTensor, load_pretrained

    model_dir = plain_prune[0]
    out = tmp_path / "out"
    assert main(["prune", str(model_dir), "--out", str(out), "--pattern", "3:4",
                 *fast_prune_args(model_dir.parent)]) == 0
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["pattern"] == "3:4" and {e["pattern"] for e in quant["layers"].values()} == {"3:4"}
    assert len(quant["layers"]) == 14 and json.loads((out / REPORT_JSON).read_text())["pattern"] == "3:4"
    ids = torch.arange(12)[None]
    logits = []
    for model in (load_pretrained(out), AutoModelForCausalLM.from_pretrained(out)):
        weights = [p for p in model.parameters() if isinstance(p, ArmorTensor)]
        assert len(weights) == 14 and {w.pattern for w in weights} == {"3:4"}
        for w in weights:  # 3 kept in every group of 4 consecutive inputs, read off the dense core
            kept = (w.core_dense() != 0).reshape(w.shape[0], -1, 4).sum(-1)
            assert bool((kept == 3).all())
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.equal(*logits)


def test_quantize_writes_8bit_cores_that_load_back(tmp_path, capsys):
    """``torch-armor quantize DIR --format int8|fp8 --out OUT``: the same model as quantize_ with the torchao
    config in Python, smaller on disk; a quantized directory, a directory without ARMOR layers and a
    non-empty --out are one-line errors."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    from conftest import make_converted_tiny_llama, make_tiny_llama
    from torch_armor import load_pretrained, save_pretrained
    from torch_armor.tensor.eight_bit import Int8ArmorTensor
    from torch_armor.tensor.quant import ArmorCoreConfig

    model = make_converted_tiny_llama(iters=1)
    save_pretrained(model, tmp_path / "pruned")
    assert main(["quantize", str(tmp_path / "pruned"), "--format", "int8", "--smooth", "0", "--out",
                 str(tmp_path / "int8")]) == 0
    assert "saved int8 2:4 cores" in capsys.readouterr().err
    loaded = load_pretrained(tmp_path / "int8")
    assert type(loaded.model.layers[0].mlp.down_proj.weight) is Int8ArmorTensor
    quantize_(model, ArmorCoreConfig(Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)))
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    size = lambda d: (d / "model.safetensors").stat().st_size  # noqa: E731
    assert size(tmp_path / "int8") < size(tmp_path / "pruned")
    save_pretrained(make_tiny_llama(), tmp_path / "dense")
    for argv, message in (([str(tmp_path / "int8"), "--out", str(tmp_path / "x")], "already has quantized cores"),
                          ([str(tmp_path / "dense"), "--out", str(tmp_path / "y")], "holds no ARMOR layers"),
                          ([str(tmp_path / "pruned"), "--out", str(tmp_path / "int8")], "is not empty"),
                          ([str(tmp_path / "pruned"), "--out", str(tmp_path / "pruned"), "--overwrite"],
                           f"--out {tmp_path / 'pruned'} is the input checkpoint")):
        assert main(["quantize", *argv, "--format", "fp8"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "quantize:" in line]
        assert len(err) == 1 and message in err[0], err


def test_quantize_int8_smooths_on_the_prunes_own_text_by_default(plain_prune, tmp_path, capsys):
    """int8 moves the cores' input outliers into B first (SmoothQuant's alpha 0.5) on the calibration text
    prune_report.json names: the same model as smooth_core_inputs + quantize_ in Python; a --calib that
    does not exist is one line naming --calib, given before the model is loaded."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    from torch_armor import load_pretrained
    from torch_armor.recipes.data import calibration_windows
    from torch_armor.recipes.models import load_tokenizer
    from torch_armor.tensor.quant import ArmorCoreConfig
    from torch_armor.tensor.smoothing import smooth_core_inputs

    model_dir, pruned = plain_prune
    text = model_dir.parent / "text.txt"
    capsys.readouterr()
    assert main(["quantize", str(pruned), "--format", "int8", "--n-calib", "3", "--out", str(tmp_path / "q")]) == 0
    assert f"alpha 0.5) on 3x32 tokens of {text}" in capsys.readouterr().err
    expected = load_pretrained(pruned)
    windows = calibration_windows(str(text), load_tokenizer(pruned), n_windows=3, seq_len=32)
    smooth_core_inputs(expected, windows.split(1), 0.5)
    quantize_(expected, ArmorCoreConfig(Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)))
    ids = windows[:1]
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path / "q")(ids).logits, expected(ids).logits)
    assert main(["quantize", str(pruned), "--format", "int8", "--calib", str(tmp_path / "nope.txt"), "--out",
                 str(tmp_path / "q2")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "--calib" in err[0] and "nope.txt" in err[0], err


def test_quantize_help_states_the_measured_smoothing_defaults():
    from torch_armor.cli.parser import build_parser
    from torch_armor.tensor.smoothing import DEFAULT_ALPHA

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    smooth = next(a for a in sub.choices["quantize"]._actions if a.dest == "smooth")
    assert f"default {DEFAULT_ALPHA['int8']:g} for int8, {DEFAULT_ALPHA['fp8']:g} for fp8" in smooth.help


def test_version_names_the_package_and_torch(capsys):
    import tomllib

    import torch_armor

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"torch-armor {torch_armor.__version__}, torch {torch.__version__}"
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert project["version"] == torch_armor.__version__  # the two places the version is written agree
