"""Issue #14 at the command line: every bad input and fault is one line naming what is at fault,
exit status 2, no traceback (``--debug`` shows it); finished work survives faults; the same
command writes the same bytes; logs stay short."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torch_armor.cli.parser import REPORT_JSON, REPORT_PNG, main

ROOT = Path(__file__).resolve().parents[2]
_TEXT = " ".join(f"Sentence number {i} talks about the weather, the budget and the railway." for i in range(300))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_tokenizer):
    from conftest import make_tiny_llama

    folder = tmp_path_factory.mktemp("tiny_hf")
    make_tiny_llama(vocab=len(smollm2_tokenizer)).save_pretrained(str(folder))
    smollm2_tokenizer.save_pretrained(str(folder))
    (folder.parent / "calib.txt").write_text(_TEXT, encoding="utf-8")
    return folder


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _args(model_dir) -> list:
    return [str(model_dir), "--calib", str(Path(model_dir).parent / "calib.txt"), "--n-calib", "2", "--seq-len",
            "32", "--block-size", "16", "--iters", "2", "--threads", "1", "--no-progress"]


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def pruned_dir(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pruned") / "out"
    assert main(["prune", *_args(tiny_dir), "--out", str(out)]) == 0
    return out


def test_prune_of_a_pruned_directory_is_refused_before_calibration(pruned_dir, tmp_path, capsys, monkeypatch):
    import torch_armor.recipes.data as data

    monkeypatch.setattr(data, "calibration_windows", lambda *a, **k: pytest.fail("calibrated"))
    out = tmp_path / "again"
    assert main(["prune", *_args(pruned_dir), "--out", str(out)]) == 2
    assert "already pruned" in _error(capsys)
    assert not out.exists()  # no OUT/armor_run left behind


def test_a_command_leaves_its_callers_thread_count(tmp_path, capsys):
    """main() sets the command's threads (--threads, or a choice by load) and gives the caller's back, even
    when the command fails: a notebook or test calling it keeps its own numerics."""
    torch.set_num_threads(1)
    assert main(["eval", str(tmp_path), "--threads", "2", "--no-progress"]) == 2
    assert "not a model directory" in _error(capsys) and torch.get_num_threads() == 1


def test_eval_of_a_directory_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["eval", str(tmp_path), "--no-progress"]) == 2
    line = _error(capsys)
    assert str(tmp_path) in line and "not a model directory" in line and "config.json" in line


@pytest.mark.parametrize("device, words", [
    ("meta", "holds no values"),
    ("bogus", "is not a device"),
    pytest.param("cuda", "sees no CUDA", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
])
def test_bad_device_is_one_line(tiny_dir, tmp_path, capsys, device, words):
    assert main(["prune", *_args(tiny_dir), "--out", str(tmp_path / "o"), "--device", device]) == 2
    line = _error(capsys)
    assert "--device" in line and words in line
    assert main(["eval", str(tiny_dir), "--device", device]) == 2
    assert words in _error(capsys)


def test_mistyped_relative_model_name_never_reaches_the_hub(tmp_path, capsys, monkeypatch):
    import transformers

    def no_hub(*a, **k):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(no_hub))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(no_hub))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for name in ("runs/smollm2-armr", "./smollm2-armor", "smolm2"):
        assert main(["eval", name, "--no-progress"]) == 2
        line = _error(capsys)
        assert repr(name) in line and ("no such model directory" in line or "did you mean 'smollm2'" in line)


def test_huge_seed_is_an_argument_error(tiny_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["prune", *_args(tiny_dir), "--out", str(tmp_path / "o"), "--seed", str(2**70)])
    assert exc.value.code == 2 and "seed must be in [0, 2**63 - 1]" in capsys.readouterr().err
    from torch_armor import ArmorConfig
    from torch_armor.recipes.data import calibration_windows

    with pytest.raises(ValueError, match="seed must be an integer in"):
        ArmorConfig(seed=2**70)
    with pytest.raises(ValueError, match="seed must be an integer in"):
        calibration_windows(torch.arange(100), None, n_windows=2, seq_len=8, seed=2**70)


def test_stale_pickle_weights_in_the_output(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "pytorch_model.bin").write_bytes(b"old")
    assert main(["prune", *_args(tiny_dir), "--out", str(out), "--overwrite"]) == 2
    assert "pytorch_model.bin" in _error(capsys)
    from torch_armor.format.serialization import save_pretrained

    with pytest.raises(ValueError, match=r"pickle weights \['pytorch_model.bin'\].*remove them"):
        save_pretrained(torch.nn.Linear(4, 4), out)
    assert sorted(os.listdir(out)) == ["pytorch_model.bin"]


def test_same_command_twice_writes_identical_bytes(tiny_dir, pruned_dir, tmp_path):
    out = tmp_path / "second"
    assert main(["prune", *_args(tiny_dir), "--out", str(out)]) == 0
    names = sorted(p.name for p in pruned_dir.iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    timed = {REPORT_JSON, REPORT_PNG}  # the report holds wall times by design
    for name in set(names) - timed:
        assert (pruned_dir / name).read_bytes() == (out / name).read_bytes(), name
    strip = lambda r: {k: v for k, v in r.items() if k not in ("seconds", "layers", "timings", "command")}  # noqa: E731
    a, b = (json.loads((d / REPORT_JSON).read_text()) for d in (pruned_dir, out))
    assert strip(a) == strip(b)
    assert [e["relative_proxy_loss"] for e in a["layers"]] == [e["relative_proxy_loss"] for e in b["layers"]]


def test_a_weight_of_another_shape_than_config_json_is_named_before_pruning(tiny_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    model_dir = Path(shutil.copytree(tiny_dir, tmp_path / "model"))
    tensors = load_file(model_dir / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    tensors[key] = tensors[key][:, :32].contiguous()
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "calib.txt").write_text(_TEXT, encoding="utf-8")
    out = tmp_path / "out"
    assert main(["prune", *_args(model_dir), "--out", str(out)]) == 2
    line = _error(capsys)
    assert f"checkpoint tensor '{key}'" in line and "(64, 32)" in line and "config.json makes it (64, 64)" in line
    assert not out.exists()


@pytest.mark.parametrize("extra, names", [
    (["--out", ""], "argument --out: an empty path"),
    (["--run-dir", ""], "argument --run-dir: an empty path"),
    (["--pattern", "\u00b2:4"], "argument --pattern: pattern '\u00b2:4': expected 'N:M'"),
])
def test_arguments_refused_by_the_parser_name_their_flag(tiny_dir, tmp_path, capsys, monkeypatch, extra, names):
    monkeypatch.chdir(tmp_path)  # an empty --out used to mean the working directory
    with pytest.raises(SystemExit) as exc:
        main(["prune", *_args(tiny_dir), "--out", "out", *extra])
    assert exc.value.code == 2 and names in capsys.readouterr().err.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("extra, names", [
    (["--n-calib", "99999999999999999999"], "--n-calib 99999999999999999999 × --seq-len 32 = "),
    (["--n-calib", "999999999999"], "of memory; ask for fewer windows (e.g. --n-calib 64)"),
    (["--calib", "BINARY"], "is not UTF-8 text (byte 0x89 at offset 0); give a text file"),
    (["--method", "sparsegpt", "--sparsegpt-block-size", "3"], "--sparsegpt-block-size 3: SparseGPTConfig.block_size=3 "
                                                                "is not a multiple of M=4"),
    (["--method", "sparsegpt", "--damp", "2"], "--damp 2.0: SparseGPTConfig.damp must be in [0, 1)"),
])
def test_bad_counts_texts_and_method_settings_name_their_flag(tiny_dir, tmp_path, capsys, extra, names):
    binary = tmp_path / "calib.bin"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    extra = [str(binary) if e == "BINARY" else e for e in extra]
    out = tmp_path / "out"
    args = _args(tiny_dir)
    if "--method" in extra:  # ARMOR's flags do not apply to a baseline
        args = [a for i, a in enumerate(args) if "--block-size" not in args[max(i - 1, 0):i + 1]
                and "--iters" not in args[max(i - 1, 0):i + 1]]
    assert main(["prune", *args, "--out", str(out), *extra]) == 2
    line = _error(capsys)
    assert names in line, line
    if "--calib" in extra:
        assert line.startswith(f"torch-armor prune: error: --calib '{binary}': {binary} is not UTF-8")
    assert not out.exists()


def _fail_after(monkeypatch, n_ok: int, err_no: int):
    import torch_armor.engine.runstore as runstore

    real = runstore.atomic_write
    calls = {"n": 0}

    def flaky(path, data):
        calls["n"] += 1
        if calls["n"] > n_ok:
            raise OSError(err_no, os.strerror(err_no), str(path))
        return real(path, data)

    monkeypatch.setattr(runstore, "atomic_write", flaky)


@pytest.mark.parametrize("err_no", [errno.ENOSPC, errno.EROFS])
def test_write_fault_keeps_finished_layers_and_resumes(tiny_dir, pruned_dir, tmp_path, capsys, monkeypatch, err_no):
    from safetensors.torch import load_file

    from torch_armor.core.factors import ArmorFactors

    out, run = tmp_path / "out", tmp_path / "run"
    _fail_after(monkeypatch, 7, err_no)  # a few layers (file + manifest each) get through
    assert main(["prune", *_args(tiny_dir), "--out", str(out), "--run-dir", str(run)]) == 2
    line = _error(capsys)
    assert os.strerror(err_no) in line and str(run) in line and "rerun the same command" in line
    manifest = json.loads((run / "manifest.json").read_text())
    done = [k for k, e in manifest["layers"].items() if e["status"] == "done"]
    assert len(done) >= 2
    for fqn in done:  # every finished layer is readable
        tensors = load_file(str(run / manifest["layers"][fqn]["file"]))
        assert torch.isfinite(ArmorFactors.from_tensors(tensors).dense()).all()
    monkeypatch.undo()
    assert main(["prune", *_args(tiny_dir), "--out", str(out), "--run-dir", str(run), "--overwrite"]) == 0
    resumed, reference = _all_tensors(out), _all_tensors(pruned_dir)
    assert resumed.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(resumed[key], value), key


def _all_tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    merged = {}
    for f in sorted(directory.glob("*.safetensors")):
        merged.update(load_file(str(f)))
    return merged


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_run_directory(tiny_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o500)
    try:
        assert main(["prune", *_args(tiny_dir), "--out", str(tmp_path / "o"), "--run-dir", str(run)]) == 2
        assert str(run) in _error(capsys)
    finally:
        run.chmod(0o700)


def test_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    with pytest.raises(ValueError, match="not a model directory"):
        main(["eval", str(tmp_path), "--debug"])
    monkeypatch.setenv("TORCH_ARMOR_DEBUG", "1")
    with pytest.raises(ValueError, match="not a model directory"):
        main(["eval", str(tmp_path)])


def test_no_progress_silences_transformers_bar(tiny_dir, tmp_path, capsys, monkeypatch):
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    try:
        assert main(["eval", str(tmp_path), "--no-progress"]) == 2
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.enable_progress_bar()


def _run(args, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("TORCH_ARMOR_DEBUG", None)
    return subprocess.run([sys.executable, *args], cwd=kw.pop("cwd", ROOT), env=env, capture_output=True,
                          text=True, timeout=600, **kw)


def test_log_of_a_prune_is_short_without_a_terminal(tiny_dir, tmp_path):
    """stderr to a pipe (not a terminal), progress left on: one line per stage, no bar refreshes."""
    proc = _run(["-m", "torch_armor", "prune", *_args(tiny_dir)[:-1], "--out", str(tmp_path / "o")])
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "Loading weights" not in proc.stderr and "Warning" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert 3 <= len(lines) <= 20, proc.stderr
    assert any(ln.startswith("prune ARMOR: 2/2 block in ") for ln in lines), proc.stderr
    bad = _run(["-m", "torch_armor", "eval", str(tmp_path)])
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_import_is_quiet():
    code = ("import torch_armor\nfrom transformers import LlamaForCausalLM\n"
            "import transformers.integrations.torchao\nimport torchao.prototype.mx_formats\n")
    proc = _run(["-c", code])
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_a_non_empty_out_is_refused_before_the_model_is_loaded(tmp_path, capsys, monkeypatch):
    """The command line runs plan_prune's own path checks (``out`` new or empty included) before the
    slow model load, not a copy of them."""
    import torch_armor.cli.commands as cli_commands

    monkeypatch.setattr(cli_commands, "pruning_source", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["prune", "smollm2", "--method", "wanda", "--out", str(out)]) == 2
    assert "is not empty" in _error(capsys)
    assert os.listdir(out) == ["notes.txt"]
