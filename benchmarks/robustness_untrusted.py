"""Issue #25's robustness cases for ``benchmarks/robustness.py``: crafted checkpoints, concurrent runs,
outputs over inputs, signals, load-path options, calibration input.

Each case builds its own hostile input on a tiny random Llama, runs the public API (``prune_model``,
``load_pretrained``, ``from_pretrained``, the command line, in subprocesses where processes matter)
and verifies what it can: an input's bytes (``check_kept``: "data loss" if changed), a loaded
model's logits or completeness (``check``: "silent wrong"). Registered by ``robustness.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
_STATE: dict = {}


def _tmp() -> Path:
    if "tmp" not in _STATE:
        _STATE["tmp"] = Path(tempfile.mkdtemp(prefix="armor_i25_"))
    return Path(tempfile.mkdtemp(dir=_STATE["tmp"]))


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def _calib(vocab: int = 128, n: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (n, 16), generator=torch.Generator().manual_seed(0))


def _armor_cfg():
    from torch_armor import ArmorConfig

    return ArmorConfig(block_size=16, num_iters=1)


def _pruned_model():
    from conftest import make_tiny_llama
    from torch_armor import prune_model

    model = make_tiny_llama()
    prune_model(model, _calib(), "armor", _armor_cfg(), progress=False)
    return model


def _hf_dir() -> Path:
    """A pruned tiny Llama written by transformers' ``model.save_pretrained`` (a fresh copy per call)."""
    if "hf" not in _STATE:
        d = _tmp() / "hf"
        _pruned_model().save_pretrained(d)
        _STATE["hf"] = d
    dst = _tmp() / "m"
    shutil.copytree(_STATE["hf"], dst)
    return dst


def _dense_dir(shards: bool = False) -> Path:
    from conftest import make_tiny_llama

    d = _tmp() / "dense"
    make_tiny_llama().save_pretrained(d, max_shard_size="60KB" if shards else "1GB")
    return d


def _edit_qc(d: Path, fn) -> Path:
    from _helpers import edit_checkpoint  # tests/_helpers.py

    return edit_checkpoint(d, quantization_config=fn)


def _first(q: dict) -> str:
    return sorted(q["layers"])[0]


def _edit_tensors(d: Path, fn) -> Path:
    from _helpers import edit_checkpoint  # tests/_helpers.py

    return edit_checkpoint(d, tensors=fn)


def _load_checked(d: Path, **kwargs):
    """load_pretrained, then the case's own check: every weight finite and equal to the saved model's."""
    from torch_armor import load_pretrained

    return load_pretrained(d, **kwargs)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(12)[None] % 128).logits


def _reference_logits() -> torch.Tensor:
    if "ref" not in _STATE:
        from torch_armor import load_pretrained

        _hf_dir()
        _STATE["ref"] = _logits(load_pretrained(_STATE["hf"]))
    return _STATE["ref"]


def _loads_wrong(d: Path, check, **kwargs) -> None:
    """Load a damaged directory; if it loads, the logits must equal the undamaged model's (else silent wrong)."""
    ref = _reference_logits()
    model = _load_checked(d, **kwargs)
    got = _logits(model)
    check(bool(torch.isfinite(got).all()) and torch.allclose(got, ref, atol=1e-4), "loaded, logits differ from the saved model")


def _index_edit(d: Path, name) -> Path:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key] = name
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def _stream(d: Path, check, check_kept):
    from torch_armor import prune_model

    out = d.parent / "out"
    prune_model(str(d), _calib(), "magnitude", out=out, progress=False)
    check(False, "a damaged checkpoint was pruned")


def _env(code: Path) -> dict:
    return dict(os.environ, PYTHONPATH=f"{code}{os.pathsep}{ROOT / 'tests'}", OMP_NUM_THREADS="1")


_PRUNE_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from torch_armor import ArmorConfig, prune_model
model, run_dir, out = sys.argv[1:4]
calib = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
prune_model(model, calib, "armor", ArmorConfig(block_size=16, num_iters=2), run_dir=None if run_dir == "-" else run_dir,
            out=out, progress=False)
"""


def _wait(pred, proc, timeout=300.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        if proc.poll() is not None:
            return pred()
        time.sleep(0.02)
    return False


def register(case, cli_case, CliResult, _cli, check, check_kept, code: Path) -> None:  # noqa: C901 - a list of cases
    """Add issue #25's cases to ``robustness.py``'s list."""

    # ------------------------------------------------------------------ crafted checkpoints
    for label, name in (("'../other/model.safetensors'", "../other/model.safetensors"), ("'/etc/passwd'", "/etc/passwd"),
                        ("'sub/x.safetensors'", "sub/x.safetensors"), ("the number 3", 3), ("'..'", "..")):
        @case("i25 checkpoint", f"streamed prune: index names shard {label}", "index.json")
        def _(name=name):
            d = _dense_dir(shards=True)
            if isinstance(name, str) and name.startswith("../other/"):
                other = d.parent / "other"
                other.mkdir()
                first = sorted(d.glob("model-*.safetensors"))[0]
                shutil.copy(first, other / "model.safetensors")
            _stream(_index_edit(d, name), check, check_kept)

    @case("i25 checkpoint", "load_pretrained: ARMOR index names a shard outside the directory", "index.json")
    def _():
        from transformers import AutoModelForCausalLM

        src = _hf_dir()
        d = src.parent / "sharded"
        AutoModelForCausalLM.from_pretrained(src).save_pretrained(d, max_shard_size="100KB")
        index = json.loads((d / "model.safetensors.index.json").read_text())
        key = sorted(index["weight_map"])[0]
        shutil.copy(d / index["weight_map"][key], d.parent / "stolen.safetensors")
        _index_edit(d, "../stolen.safetensors")
        _loads_wrong(d, check)

    def _damage(path: Path, how: str) -> None:
        data = path.read_bytes()
        path.write_bytes({"pickle": b"\x80\x04\x95" + b"\0" * 64, "truncated": data[: len(data) // 2], "empty": b"",
                          "zip": _torch_save_bytes(), "past end": _past_end(data)}[how])

    for how in ("pickle", "truncated", "empty", "past end"):
        @case("i25 checkpoint", f"load_pretrained (HF format): {how} model.safetensors", "model.safetensors")
        def _(how=how):
            d = _hf_dir()
            _damage(d / "model.safetensors", how)
            _loads_wrong(d, check)

    for how in ("pickle", "truncated", "zip"):
        @case("i25 checkpoint", f"streamed prune: {how} model.safetensors", "model.safetensors")
        def _(how=how):
            d = _dense_dir()
            _damage(d / "model.safetensors", how)
            _stream(d, check, check_kept)

    @cli_case("i25 checkpoint", "CLI prune of a checkpoint whose weights file is a pickle", "model.safetensors")
    def _():
        d = _dense_dir()
        _damage(d / "model.safetensors", "pickle")
        shutil.copytree(_tokenizer_dir(), d, dirs_exist_ok=True)
        return _cli(["prune", str(d), "--calib", str(_text()), "--n-calib", "2", "--seq-len", "16", "--method",
                     "magnitude", "--no-progress", "--out", str(d.parent / "out")])

    @cli_case("i25 checkpoint", "CLI eval of an ARMOR directory with a truncated weights file", "model.safetensors")
    def _():
        d = _hf_dir()
        _damage(d / "model.safetensors", "truncated")
        shutil.copytree(_tokenizer_dir(), d, dirs_exist_ok=True)
        return _cli(["eval", str(d), "--data", str(_text()), "--n-eval", "1", "--seq-len", "16", "--no-progress"])

    qc_edits = {
        "block size 24 (does not divide)": lambda q: q["layers"][_first(q)].update(block_size=24),
        "block size 32 (divides, wrong)": lambda q: q["layers"][_first(q)].update(block_size=32),
        "block size the string '16'": lambda q: q["layers"][_first(q)].update(block_size="16"),
        "pattern '5:4'": lambda q: q["layers"][_first(q)].update(pattern="5:4"),
        "pattern '1:4' (valid, wrong)": lambda q: q["layers"][_first(q)].update(pattern="1:4"),
        "dtype 'float16' (valid, wrong)": lambda q: q["layers"][_first(q)].update(dtype="float16"),
        "dtype 'int8'": lambda q: q["layers"][_first(q)].update(dtype="int8"),
        "the 'tensors' key removed": lambda q: q["layers"][_first(q)].pop("tensors"),
        "'layers' as a list": lambda q: q.update(layers=list(q["layers"])),
        "a stored layer missing from 'layers'": lambda q: q["layers"].pop(_first(q)),
        "storage 'sparse'": lambda q: q["layers"][_first(q)].update(storage="sparse"),
        "shape transposed": lambda q: q["layers"][_first(q)].update(shape=[128, 64] if q["layers"][_first(q)]["shape"] == [64, 128] else [64, 32]),
    }
    for label, fn in qc_edits.items():
        @case("i25 checkpoint", f"load_pretrained: quantization_config {label}", "config.json")
        def _(fn=fn):
            d = _edit_qc(_hf_dir(), fn)
            _loads_wrong(d, check)
            check(False, "an edited quantization_config loaded")  # even equal logits: the entry is wrong

    @case("i25 checkpoint", "from_pretrained (transformers): quantization_config block size 32", "config.json")
    def _():
        from transformers import AutoModelForCausalLM

        d = _edit_qc(_hf_dir(), qc_edits["block size 32 (divides, wrong)"])
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
        @case("i25 checkpoint", f"load_pretrained (HF format): {label}", "layer 'model.layers")
        def _(fn=fn):
            d = _edit_tensors(_hf_dir(), fn)
            _loads_wrong(d, check)
            check(False, "corrupt factors loaded")

    @case("i25 checkpoint", "load_pretrained (torch_armor format): Inf in a saved factor", "up_proj")
    def _():
        from torch_armor import save_pretrained

        model = _pruned_model()
        model.model.layers[0].mlp.up_proj.weight.a_blocks.view(-1)[0] = float("inf")
        d = _tmp() / "m"
        save_pretrained(model, d)
        _load_checked(d)
        check(False, "an Inf factor loaded")

    @case("i25 checkpoint", "load_pretrained (HF format): a norm weight missing from the file", "post_attention_layernorm")
    def _():
        d = _edit_tensors(_hf_dir(), lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
        _loads_wrong(d, check)

    # ------------------------------------------------------------------ load-path options
    @case("i25 load options", "from_pretrained(device_map={'': 'meta'})", "meta")
    def _():
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(_hf_dir(), device_map={"": "meta"})
        _logits(model)

    @case("i25 load options", "load_pretrained(device='meta')", "meta")
    def _():
        _logits(_load_checked(_hf_dir(), device="meta"))

    @case("i25 load options", "load_pretrained(plain module, storage='semi_structured') on CPU", "semi_structured")
    def _():
        from torch_armor import save_pretrained
        from torch_armor.tensor.armor_tensor import ArmorTensor

        model = _pruned_model()
        d = _tmp() / "plain"
        save_pretrained(model.model.layers[0].mlp, d)  # no config.json: the torch_armor loader
        got = _load_checked(d, model_or_config=lambda: _pruned_mlp_template(), storage="semi_structured")
        w = got.up_proj.weight
        check(isinstance(w, ArmorTensor) and w.storage == "semi_structured", f"asked for semi_structured, got {w.storage}")

    @case("i25 load options", "load_pretrained(storage='bogus')", "storage")
    def _():
        _load_checked(_hf_dir(), storage="bogus")

    @case("i25 load options", "load_state_dict: block-16 state into a block-32 model", "block size 16")
    def _():
        from conftest import make_tiny_llama
        from torch_armor import ArmorConfig, prune_model

        a = _pruned_model()
        b = make_tiny_llama()
        prune_model(b, _calib(), "armor", ArmorConfig(block_size=32, num_iters=1), progress=False)
        try:
            b.load_state_dict(a.state_dict())
        except RuntimeError as err:  # torch's documented load_state_dict error; it must name layer and both sizes
            text = " ".join(str(err).split())
            if "model.layers.0" in text and "block size 16" in text and "block size 32" in text:
                raise ValueError(text[:400]) from None
            raise

    @case("i25 load options", "weight.copy_(weight of another block size)", "block size 32")
    def _():
        from conftest import make_tiny_llama
        from torch_armor import ArmorConfig, prune_model

        a = _pruned_model()
        b = make_tiny_llama()
        prune_model(b, _calib(), "armor", ArmorConfig(block_size=32, num_iters=1), progress=False)
        a.model.layers[0].mlp.up_proj.weight.copy_(b.model.layers[0].mlp.up_proj.weight)

    # ------------------------------------------------------------------ calibration input
    def _calib_case(calib):
        from conftest import make_tiny_llama
        from torch_armor import prune_model

        prune_model(make_tiny_llama(vocab=50), calib, "wanda", progress=False)

    for label, calib in (
        ("a bool tensor", lambda: torch.ones(2, 8, dtype=torch.bool)),
        ("ids equal to the vocabulary size", lambda: torch.full((2, 8), 50)),
        ("negative ids", lambda: torch.full((2, 8), -3)),
        ("a list whose second batch has id 10**6", lambda: [torch.zeros(1, 8, dtype=torch.long), torch.full((1, 8), 10**6)]),
        ("{input_ids, attention_mask} with id 99 at a pad position",
         lambda: {"input_ids": torch.cat([torch.zeros(2, 6, dtype=torch.long), torch.full((2, 2), 99)], 1),
                  "attention_mask": torch.tensor([[1] * 6 + [0] * 2] * 2)}),
        ("float64 ids", lambda: torch.zeros(2, 8, dtype=torch.float64)),
    ):
        @case("i25 calibration", f"prune_model with {label}", "calibration")
        def _(calib=calib):
            _calib_case(calib())

    for dtype in (torch.int32, torch.uint8):
        @case("i25 calibration", f"prune_model with {str(dtype).removeprefix('torch.')} ids (same result as int64)")
        def _(dtype=dtype):
            from conftest import make_tiny_llama
            from torch_armor import prune_model

            ids = _calib(vocab=50)
            a, b = make_tiny_llama(vocab=50), make_tiny_llama(vocab=50)
            prune_model(a, ids, "wanda", progress=False)
            prune_model(b, ids.to(dtype), "wanda", progress=False)
            check(all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values())),
                  "a different result from the same ids")

    # ------------------------------------------------------------------ outputs over inputs
    def _over_input(make_out, api: str, overwrite: bool = False):
        d = _dense_dir() if api == "python" else _tokenized_model(2)
        before = _tree(d.parent)
        out = make_out(d)
        try:
            if api == "python":
                from torch_armor import prune_model

                prune_model(str(d), _calib(), "magnitude", out=out, progress=False)
                res = None
            else:
                before = _tree(d.parent)
                res = _cli(["prune", str(d), "--calib", str(_text()), "--n-calib", "2", "--seq-len", "16", "--method",
                            "magnitude", "--no-progress", "--out", str(out)] + (["--overwrite"] if overwrite else []))
        finally:
            after = _tree(d.parent)
            after.pop("link", None)
            before.pop("link", None)
            check_kept({k: v for k, v in after.items() if k in before} == before, "the input checkpoint was modified")
        return res

    def _link(d: Path) -> Path:
        (d.parent / "link").symlink_to(d)
        return d.parent / "link"

    for label, make_out in (("out = the checkpoint", lambda d: d), ("out = a symlink to it", _link),
                            ("out = 'ckpt/../ckpt'", lambda d: d / ".." / d.name), ("out = its parent", lambda d: d.parent)):
        @case("i25 overwrite", f"prune_model(path, {label})", "input checkpoint")
        def _(make_out=make_out):
            _over_input(make_out, "python")

    for overwrite in (False, True):
        @cli_case("i25 overwrite", f"prune M --out M{' --overwrite' if overwrite else ''}", "input checkpoint")
        def _(overwrite=overwrite):
            return _over_input(lambda d: d, "cli", overwrite)

    @cli_case("i25 overwrite", "prune M --out LINK-TO-M --overwrite", "input checkpoint")
    def _():
        return _over_input(_link, "cli", True)

    @case("i25 overwrite", "prune_model(model loaded from DIR, out=DIR)", "input checkpoint")
    def _():
        from transformers import AutoModelForCausalLM
        from torch_armor import prune_model

        d = _dense_dir()
        before = _tree(d)
        try:
            prune_model(AutoModelForCausalLM.from_pretrained(d), _calib(), "magnitude", out=d, progress=False)
        finally:
            check_kept(_tree(d) == before, "the checkpoint the model came from was overwritten")

    for flag in ("run_dir", "hidden_dir"):
        @case("i25 overwrite", f"prune_model(path, {flag}=path)", "input checkpoint")
        def _(flag=flag):
            from torch_armor import prune_model

            d = _dense_dir()
            before = _tree(d)
            try:
                prune_model(str(d), _calib(), "armor", _armor_cfg(), out=d.parent / "out", progress=False, **{flag: d})
            finally:
                check_kept(_tree(d) == before, f"{flag} wrote into the input checkpoint")

    @case("i25 overwrite", "out = an existing file: refused before pruning", "not a directory")
    def _():
        from conftest import make_tiny_llama
        from torch_armor import prune_model

        target = _tmp() / "file"
        target.write_bytes(b"keep")
        model = make_tiny_llama()
        try:
            prune_model(model, _calib(), "armor", _armor_cfg(), out=target, progress=False)
        finally:
            check_kept(target.read_bytes() == b"keep", "the file was replaced")
            check(not any(hasattr(type(p), "__tensor_flatten__") for p in model.parameters()),
                  "pruned although out is refused")

    # ------------------------------------------------------------------ concurrency
    def _two_processes(shared_out: bool):
        d = _dense_dir()
        base = d.parent
        run = base / "run"
        outs = [base / "out-a", base / ("out-a" if shared_out else "out-b")]
        env = _env(code)
        first = subprocess.Popen([sys.executable, "-c", _PRUNE_SCRIPT, str(d), "-" if shared_out else str(run), str(outs[0])],
                                 env=env, cwd=_STATE['tmp'], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        run_dir = outs[0] / ".armor_run" if shared_out else run
        _wait(lambda: (run_dir / "manifest.json").is_file(), first)
        stopped = first.poll() is None
        if stopped:
            os.kill(first.pid, signal.SIGSTOP)
        try:
            second = subprocess.run([sys.executable, "-c", _PRUNE_SCRIPT, str(d), "-" if shared_out else str(run),
                                     str(outs[1])], env=env, cwd=_STATE['tmp'], capture_output=True, text=True, timeout=600)
        finally:
            if stopped:
                os.kill(first.pid, signal.SIGCONT)
        _, err1 = first.communicate(timeout=600)
        from torch_armor import load_pretrained

        finished = [o for o, rc in zip(outs, (first.returncode, second.returncode)) if rc == 0]
        check(first.returncode == 0, f"the first prune failed: {err1.strip().splitlines()[-1:]}")
        for o in set(finished):
            try:
                model = load_pretrained(o)
            except ValueError as err:
                raise DataLostProxy(f"{o.name} does not load: {err}") from None
            check(bool(torch.isfinite(_logits(model)).all()), f"{o.name} gives non-finite logits")
        if second.returncode == 0:
            check(False, "both processes pruned into one run directory and exited 0")
        last = second.stderr.strip().splitlines()[-1] if second.stderr.strip() else ""
        raise (ValueError if f"process {first.pid}" in last else RuntimeError)(last)

    class DataLostProxy(Exception):
        pass

    @case("i25 concurrency", "two prune processes, one --run-dir, two outs", "in use by process")
    def _():
        try:
            _two_processes(shared_out=False)
        except DataLostProxy as err:
            check_kept(False, str(err))

    @case("i25 concurrency", "two streamed prunes into one out (its default run directory)", "in use by process")
    def _():
        try:
            _two_processes(shared_out=True)
        except DataLostProxy as err:
            check_kept(False, str(err))

    # ------------------------------------------------------------------ signals and late failures
    def _signal_case(sig: int):
        model_dir = _tokenized_model(6)
        out = model_dir.parent / "out"
        argv = ["prune", str(model_dir), "--calib", str(_text()), "--n-calib", "2", "--seq-len", "32", "--block-size",
                "16", "--iters", "6", "--threads", "1", "--no-progress", "--out", str(out)]
        proc = subprocess.Popen([sys.executable, "-m", "torch_armor", *argv], env=_env(code), cwd=_STATE['tmp'], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        _wait(lambda: (out / "armor_run" / "hidden.safetensors").is_file(), proc)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGSTOP)
            os.kill(proc.pid, sig)
            os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=600)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        again = _cli(argv)
        check_kept(again.code == 0, f"the same command did not resume: {again.err.strip().splitlines()[-1:]}")
        ok = re.search(r"interrupted after block \d of 6; rerun the same command to resume from .*armor_run", lines[-1] if lines else "")
        if proc.returncode in (0, 1, 2) or not ok or "Traceback" in err:
            raise RuntimeError(f"exit {proc.returncode}: {lines[-1] if lines else 'no message'}")
        return f"exit {proc.returncode}: {lines[-1]}"

    @case("i25 signals", "SIGTERM during a CLI prune, then the same command")
    def _():
        _signal_case(signal.SIGTERM)

    @case("i25 signals", "SIGINT during a CLI prune, then the same command")
    def _():
        _signal_case(signal.SIGINT)

    def _late(target: str, overwrite: bool):
        import importlib

        model_dir = _tokenized_model(2)
        out = model_dir.parent / "out"
        argv = ["prune", str(model_dir), "--calib", str(_text()), "--n-calib", "2", "--seq-len", "32", "--block-size",
                "16", "--iters", "2", "--threads", "1", "--no-progress", "--out", str(out)]
        module_name, attr = target.rsplit(".", 1)
        owner = module_name
        obj = None
        parts = module_name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                for p in parts[i:]:
                    obj = getattr(obj, p)
                break
            except (ImportError, AttributeError):
                continue
        real = getattr(obj, attr)

        def fail(*a, **k):
            raise OSError(28, "No space left on device", str(out / owner))

        setattr(obj, attr, fail)
        try:
            first = _cli(argv)
        finally:
            setattr(obj, attr, real)
        check(first.code == 2, f"the injected failure gave exit {first.code}")
        again = _cli(argv + (["--overwrite"] if overwrite else []))
        check_kept(again.code == 0, f"rerun: {again.err.strip().splitlines()[-1:]}")
        from torch_armor import load_pretrained

        load_pretrained(out)

    for label, target in (("saving the report's plot", "torch_armor.engine.report.PruneReport.save_plot"),
                          ("assembling the checkpoint", "torch_armor.tensor.serialization.assemble_checkpoint"),
                          ("saving the tokenizer", "transformers.PreTrainedTokenizerBase.save_pretrained")):
        for overwrite in (False, True):
            @case("i25 signals", f"failure while {label}, then the same command"
                                 f"{' with --overwrite' if overwrite else ''}")
            def _(target=target, overwrite=overwrite):
                _late(target, overwrite)


def _torch_save_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"w": torch.randn(2, 2)}, buf)
    return buf.getvalue()


def _past_end(data: bytes) -> bytes:
    import struct

    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    key = next(k for k in sorted(header) if k != "__metadata__")
    header[key]["data_offsets"][1] += 1 << 20
    text = json.dumps(header).encode()
    text += b" " * ((-len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n:]


def _pruned_mlp_template():
    return _pruned_model().model.layers[0].mlp


def _tokenizer_dir() -> Path:
    if "tok" not in _STATE:
        from torch_armor.recipes.assets import smollm2_tokenizer

        d = _tmp() / "tok"
        smollm2_tokenizer().save_pretrained(str(d))
        _STATE["tok"] = d
    return _STATE["tok"]


def _text() -> Path:
    if "text" not in _STATE:
        p = _tmp() / "calib.txt"
        p.write_text(" ".join(f"Line {i} about the weather, the harvest and the budget." for i in range(300)))
        _STATE["text"] = p
    return _STATE["text"]


def _tokenized_model(layers: int) -> Path:
    """A random Llama with SmolLM2's vocabulary and tokenizer, ``layers`` blocks (fresh directory)."""
    key = f"model{layers}"
    if key not in _STATE:
        from transformers import LlamaConfig, LlamaForCausalLM

        from torch_armor.recipes.assets import smollm2_tokenizer

        tok = smollm2_tokenizer()
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256)
        torch.manual_seed(0)
        d = _tmp() / "model"
        LlamaForCausalLM(cfg).save_pretrained(str(d))
        shutil.copytree(_tokenizer_dir(), d, dirs_exist_ok=True)
        _STATE[key] = d
    dst = _tmp() / "model"
    shutil.copytree(_STATE[key], dst)
    return dst


def cleanup() -> None:
    if "tmp" in _STATE:
        shutil.rmtree(_STATE["tmp"], ignore_errors=True)
