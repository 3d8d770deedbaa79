"""Robustness tally of issue #14: bad inputs and faults thrown at torch_armor, each outcome classified.

    python benchmarks/robustness.py                    # every case
    python benchmarks/robustness.py --only "load options"   # the cases whose name contains the text
    python benchmarks/robustness.py --code /path/to/old/checkout --only i25   # the same cases on other code
    python benchmarks/robustness.py --case-limit 300   # a case running longer counts as a hang (default 600 s)

Every case either returns a result that the case itself verifies ("correct": finite, pattern
exact, loss ≤ NoWag-P, equal to a reference) or raises. A raise counts as a "clear error" when it
is a documented type (ValueError / torch_armor.errors.ArmorError / OSError from a write) whose
message names the thing at fault; at the command line, exit status 2 with one line on stderr and
no traceback. Anything else is "raw / internal" (a traceback, an internal assert, another type),
a verified-wrong result is "silent wrong", an input or finished result destroyed is "data loss",
and a case still running after ``--case-limit`` seconds (default 600), or a process it waits for,
is a "hang". Tiny random Llama models; about 20 minutes on 1 thread beside other jobs.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
# --code DIR: import torch_armor from another checkout (e.g. a worktree of an older commit) to
# classify the same cases there; the tests' helpers still come from this checkout.
CODE = Path(sys.argv[sys.argv.index("--code") + 1]).resolve() if "--code" in sys.argv else ROOT
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(CODE))

import torch  # noqa: E402

from torch_armor.errors import ArmorError  # noqa: E402
from torch_armor import PruneOptions, WandaConfig  # noqa: E402
from torch_armor.config.armor import AdamConfig  # noqa: E402

CASES: List[Tuple[str, str, Callable[[], object], str]] = []  # (group, name, run, what the message must name)


def case(group: str, name: str, names: str = ""):
    def wrap(fn):
        CASES.append((group, name, fn, names))
        return fn
    return wrap


class Wrong(AssertionError):
    """A case's own verification failed: a silent wrong result."""


class DataLost(AssertionError):
    """A case's own verification found an input or a finished result destroyed."""


class Hung(BaseException):
    """A case ran past its time limit (raised by the alarm in :func:`classify`; a BaseException, so that
    no ``except Exception`` of the code under test swallows it)."""


def check_kept(cond: bool, what: str) -> None:
    if not cond:
        raise DataLost(what)


def check(cond: bool, what: str) -> None:
    if not cond:
        raise Wrong(what)


# ------------------------------------------------------------------------------------------ core
def _factorize(w, h, name="blk.proj", **cfg):
    from torch_armor import ArmorConfig
    from torch_armor.config.armor import BcdConfig
    from torch_armor.core.factorize import factorize
    from torch_armor.core.proxy import nowag_prune, proxy_loss

    f = factorize(w, h, ArmorConfig(**{"block_size": 16, "optimizer": BcdConfig(iters=3), **cfg}), name=name)
    dense = f.dense().double()
    check(bool(torch.isfinite(dense).all()), "non-finite dense()")
    mask = f.mask.reshape(f.mask.shape[0], -1, 4).sum(-1)
    check(bool((mask == 2).all()), "2:4 pattern broken")
    _, pruned = nowag_prune(w.double(), h.double(), "2:4")
    ref = float(proxy_loss(w.double(), pruned, h.double()))
    got = float(proxy_loss(w.double(), dense, h.double()))
    check(got <= ref * (1 + 1e-3) + 1e-30, f"loss {got} above NoWag-P {ref}")
    check(abs(f.relative_loss - (got / ref if ref else 0.0)) < 1e-2, "reported loss differs from recomputation")
    return f


def _layer(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 64, generator=g, dtype=dtype), torch.rand(64, generator=g, dtype=dtype) + 0.1


@case("core", "16 input channels with zero statistics, fp32")
def _():
    w, h = _layer()
    h[:16] = 0
    _factorize(w, h)


@case("core", "16 input channels with zero statistics, fp64")
def _():
    w, h = _layer(dtype=torch.float64)
    h[:16] = 0
    _factorize(w, h, dtype=torch.float64)


@case("core", "zero statistics, adam")
def _():
    w, h = _layer()
    h[16:32] = 0
    _factorize(w, h, optimizer=AdamConfig(iters=3))


@case("core", "rank-one weight with zero tiles")
def _():
    w, h = _layer()
    w = torch.outer(w[:, 0], w[0])
    w[:16] = 0
    _factorize(w, h)


@case("core", "fp32 weight entries near 1e19")
def _():
    w, h = _layer()
    _factorize(w * 1e19, h)


@case("core", "fp32 weight entries near 1e-30")
def _():
    w, h = _layer()
    _factorize(w * 1e-30, h)


@case("core", "statistics near 1e37")
def _():
    w, h = _layer()
    _factorize(w, h * 1e37)


@case("core", "all-zero weight")
def _():
    w, h = _layer()
    f = _factorize_zero(torch.zeros_like(w), h)
    check(bool((f.dense() == 0).all()), "zero weight not reproduced")


def _factorize_zero(w, h):
    from torch_armor import ArmorConfig
    from torch_armor.config.armor import BcdConfig
    from torch_armor.core.factorize import factorize

    return factorize(w, h, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=3)), name="blk.proj")


@case("core", "NaN in the weight", "blk.proj")
def _():
    w, h = _layer()
    w[3, 3] = float("nan")
    _factorize(w, h)


@case("core", "weight on the meta device", "blk.proj")
def _():
    w, h = _layer()
    _factorize(w.to("meta"), h)


@case("core", "already converted ArmorTensor weight", "blk.proj")
def _():
    from torch_armor.tensor.armor_tensor import ArmorTensor

    w, h = _layer()
    _factorize(ArmorTensor.from_factors(_factorize(w, h)), h)


@case("core", "integer weight", "blk.proj")
def _():
    w, h = _layer()
    _factorize(w.to(torch.int32), h)


@case("core", "statistics of the wrong length", "blk.proj")
def _():
    w, h = _layer()
    _factorize(w, h[:32])


@case("core", "all-zero statistics", "blk.proj")
def _():
    w, h = _layer()
    _factorize(w, torch.zeros_like(h))


@case("core", "block size not dividing the layer", "blk.proj")
def _():
    w, h = _layer()
    _factorize(w[:, :60], h[:60])


@case("config", "seed = 2**70", "seed")
def _():
    from torch_armor import ArmorConfig

    ArmorConfig(seed=2**70)


@case("config", "pattern '5:4'", "pattern")
def _():
    from torch_armor import ArmorConfig

    ArmorConfig(pattern="5:4")


@case("config", "negative ridge", "ridge")
def _():
    from torch_armor import ArmorConfig
    from torch_armor.config.armor import BcdConfig

    ArmorConfig(optimizer=BcdConfig(ridge=-1.0))


# ------------------------------------------------------------------------------- calibration
@case("calibration", "padded batches with an attention mask")
def _():
    from conftest import make_tiny_llama
    from torch_armor.calibration.observer import collect_statistics, decoder_linear_names

    model = make_tiny_llama()
    names = decoder_linear_names(model)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 6 + [0] * 4, [1] * 10])
    got = collect_statistics(model, names, ids, attention_mask=mask, progress=False)
    refs = [collect_statistics(model, names, ids[r:r + 1, :n], progress=False) for r, n in ((0, 6), (1, 10))]
    for k in names:
        total = refs[0][k].act_sq_norm + refs[1][k].act_sq_norm
        check(got[k].num_tokens == 16, f"{k}: pads counted")
        check(torch.allclose(got[k].act_sq_norm, total, rtol=1e-4, atol=1e-4), f"{k}: statistics differ")


@case("calibration", "an attention mask of the wrong shape", "attention_mask")
def _():
    from conftest import make_tiny_llama
    from torch_armor import prune_model

    ids = torch.zeros(2, 8, dtype=torch.long)
    prune_model(make_tiny_llama(), {"input_ids": ids, "attention_mask": torch.ones(2, 7)}, WandaConfig(), options=PruneOptions(progress=False))


@case("calibration", "activations overflowing float32 (|x| ~ 1e20)", "0")
def _():
    from torch_armor.sparsifier import ArmorSparsifier

    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    sp = ArmorSparsifier(WandaConfig(), progress=False)
    sp.prepare(model, [{"tensor_fqn": "0.weight"}])
    model(torch.randn(4, 16) * 1e20)


@case("python api", "prune_model on an already pruned model", "already pruned")
def _():
    from conftest import make_tiny_llama
    from torch_armor import ArmorConfig, prune_model
    from torch_armor.config.armor import BcdConfig

    model = make_tiny_llama()
    ids = torch.randint(0, 128, (2, 8))
    prune_model(model, ids, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1)), options=PruneOptions(progress=False))
    prune_model(model, ids, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1)), options=PruneOptions(progress=False))


# ------------------------------------------------------------------------------------- files
def _saved_dir(tmp: Path) -> Path:
    from torch_armor.format.serialization import save_pretrained

    torch.manual_seed(0)
    folder = tmp / "ckpt"
    save_pretrained(torch.nn.Sequential(torch.nn.Linear(8, 8)), folder)
    return folder


def _load(folder: Path):
    from torch_armor.format.serialization import load_pretrained

    return load_pretrained(folder, torch.nn.Sequential(torch.nn.Linear(8, 8)))


@case("files", "load: weights file truncated", "model.safetensors")
def _():
    with tempfile.TemporaryDirectory() as d:
        f = _saved_dir(Path(d)) / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-7])
        _load(f.parent)


@case("files", "load: one bit flipped in the weights", "model.safetensors")
def _():
    with tempfile.TemporaryDirectory() as d:
        f = _saved_dir(Path(d)) / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[-3] ^= 4
        f.write_bytes(bytes(data))
        _load(f.parent)


@case("files", "load: armor_config.json missing", "armor_config.json")
def _():
    with tempfile.TemporaryDirectory() as d:
        folder = _saved_dir(Path(d))
        (folder / "armor_config.json").unlink()
        _load(folder)


@case("files", "load: a stale pytorch_model.bin beside the weights", "pytorch_model.bin")
def _():
    with tempfile.TemporaryDirectory() as d:
        folder = _saved_dir(Path(d))
        (folder / "pytorch_model.bin").write_bytes(b"x")
        _load(folder)


@case("files", "save over a directory holding a stale pytorch_model.bin", "pytorch_model.bin")
def _():
    from torch_armor.format.serialization import save_pretrained

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "pytorch_model.bin").write_bytes(b"x")
        save_pretrained(torch.nn.Linear(4, 4), d)


@case("faults", "save_pretrained interrupted by ENOSPC, then loaded", "armor_config.json")
def _():
    import torch_armor.format.serialization as ser

    with tempfile.TemporaryDirectory() as d:
        folder = _saved_dir(Path(d))
        real = ser.file_sha256
        ser.file_sha256 = _raise_enospc
        try:
            with contextlib.suppress(OSError):
                ser.save_pretrained(torch.nn.Sequential(torch.nn.Linear(8, 8)), folder)
        finally:
            ser.file_sha256 = real
        _load(folder)  # must not load a half-written model


def _raise_enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[0]) if args else None)


# --------------------------------------------------------------------------------------- CLI
_TINY: dict = {}


def _tiny_dir() -> Path:
    if "dir" not in _TINY:
        from conftest import make_tiny_llama
        from torch_armor.recipes.assets import smollm2_tokenizer

        tok = smollm2_tokenizer()
        folder = Path(tempfile.mkdtemp(prefix="armor_robust_"))
        make_tiny_llama(vocab=len(tok)).save_pretrained(str(folder / "model"))
        tok.save_pretrained(str(folder / "model"))
        (folder / "calib.txt").write_text(" ".join(f"Line {i} about the weather and the budget." for i in range(200)))
        _TINY["dir"] = folder
    return _TINY["dir"]


def _args(model) -> list:
    base = _tiny_dir()
    return [str(model), "--calib", str(base / "calib.txt"), "--n-calib", "2", "--seq-len", "32", "--block-size", "16",
            "--iters", "2", "--threads", "1", "--no-progress"]


class CliResult:
    def __init__(self, code, err):
        self.code, self.err = code, err


def _cli(argv) -> CliResult:
    from torch_armor.cli.parser import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return CliResult(code, err.getvalue())


def cli_case(*group_and_name: str, names: str = ""):
    """``@cli_case(name, names)`` (group "cli") or ``@cli_case(group, name, names)``."""
    if len(group_and_name) == 3:
        group, name, names = group_and_name
    else:
        (name, names), group = group_and_name, "cli"

    def wrap(fn):
        def run():
            res = fn()
            if isinstance(res, CliResult):
                raise CliOutcome(res)
        CASES.append((group, name, run, names))
        return fn
    return wrap


class CliOutcome(Exception):
    def __init__(self, res: CliResult):
        super().__init__(res.err.strip())
        self.res = res


@cli_case("prune a directory already pruned by torch_armor", "already pruned")
def _():
    base = _tiny_dir()
    out = base / "pruned"
    if not out.exists():
        check(_cli(["prune", *_args(base / "model"), "--out", str(out)]).code == 0, "reference prune failed")
    res = _cli(["prune", *_args(out), "--out", str(base / "again")])
    check(not (base / "again").exists(), "left OUT behind")
    return res


@cli_case("eval a directory that is not a model", "not a model directory")
def _():
    with tempfile.TemporaryDirectory() as d:
        return _cli(["eval", d, "--no-progress"])


@cli_case("--device cuda on a CPU-only torch" if not torch.cuda.is_available() else "--device cuda:99", "--device")
def _():
    return _cli(["eval", str(_tiny_dir() / "model"), "--device", "cuda" if not torch.cuda.is_available() else "cuda:99"])


@cli_case("--device meta", "--device meta")
def _():
    return _cli(["prune", *_args(_tiny_dir() / "model"), "--out", str(_tiny_dir() / "m"), "--device", "meta"])


@cli_case("a mistyped relative model name", "no such model directory")
def _():
    cwd = os.getcwd()
    os.chdir(_tiny_dir())
    try:
        return _cli(["eval", "model/../modle", "--no-progress"])
    finally:
        os.chdir(cwd)


@cli_case("--seed 2**70", "seed")
def _():
    return _cli(["prune", *_args(_tiny_dir() / "model"), "--out", str(_tiny_dir() / "s"), "--seed", str(2**70)])


@cli_case("prune --overwrite into a directory holding pytorch_model.bin", "pytorch_model.bin")
def _():
    out = _tiny_dir() / "stale"
    out.mkdir(exist_ok=True)
    (out / "pytorch_model.bin").write_bytes(b"x")
    return _cli(["prune", *_args(_tiny_dir() / "model"), "--out", str(out), "--overwrite"])


def _fault_run(err_no: int, tag: str) -> CliResult:
    import torch_armor.engine.runstore as runstore

    base = _tiny_dir()
    out, run = base / f"fault-{tag}", base / f"run-{tag}"
    real, calls = runstore.atomic_write, {"n": 0}

    def flaky(path, data):
        calls["n"] += 1
        if calls["n"] > 7:
            raise OSError(err_no, os.strerror(err_no), str(path))
        return real(path, data)

    runstore.atomic_write = flaky
    try:
        res = _cli(["prune", *_args(base / "model"), "--out", str(out), "--run-dir", str(run)])
    finally:
        runstore.atomic_write = real
    manifest = json.loads((run / "manifest.json").read_text())
    done = [k for k, e in manifest["layers"].items() if e["status"] == "done"]
    check(len(done) >= 2, "finished layers lost")
    again = _cli(["prune", *_args(base / "model"), "--out", str(out), "--run-dir", str(run), "--overwrite"])
    check(again.code == 0 and "resuming" in again.err, "the rerun did not resume")
    return res


@cli_case("ENOSPC during a prune (then resumed)", "No space left on device")
def _():
    return _fault_run(errno.ENOSPC, "enospc")


@cli_case("read-only run directory during a prune (then resumed)", "Read-only file system")
def _():
    return _fault_run(errno.EROFS, "erofs")


@cli_case("an unknown --method", "--method")
def _():
    return _cli(["prune", *_args(_tiny_dir() / "model"), "--out", str(_tiny_dir() / "u"), "--method", "nope"])


def _same_twice():
    base = _tiny_dir()
    outs = [base / "twice-a", base / "twice-b"]
    for out in outs:
        check(_cli(["prune", *_args(base / "model"), "--out", str(out)]).code == 0, "prune failed")
    for f in sorted(outs[0].iterdir()):
        if f.name.startswith("prune_report"):
            continue
        check(f.read_bytes() == (outs[1] / f.name).read_bytes(), f"{f.name} differs between two runs")


CASES.append(("cli", "the same prune twice: byte-identical files", _same_twice, ""))


from robustness_untrusted import register as _register_issue25  # noqa: E402  (issue #25's cases)

_register_issue25(case, cli_case, CliResult, _cli, check, check_kept, CODE)

from robustness_layouts import register as _register_layouts  # noqa: E402  (model directories as users have them)

_register_layouts(case, cli_case, _cli, check, check_kept)


# ------------------------------------------------------------------------------------ runner
def _hung(signum, frame):
    raise Hung()


def classify(run: Callable[[], object], names: str, limit_s: int = 600) -> Tuple[str, str]:
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(limit_s)
    try:
        return _classify(run, names)
    except Hung:
        return "hang", f"still running after {limit_s} s"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _classify(run: Callable[[], object], names: str) -> Tuple[str, str]:
    try:
        run()
    except subprocess.TimeoutExpired as err:
        return "hang", f"a process it waits for ran past {err.timeout} s: {' '.join(map(str, err.cmd))[:80]}"
    except CliOutcome as out:
        res = out.res
        lines = [ln for ln in res.err.splitlines() if ln.strip()]
        error_lines = [ln for ln in lines if "error" in ln]
        clear = (res.code == 2 and "Traceback" not in res.err and len(error_lines) == 1
                 and names.lower() in error_lines[0].lower())
        return ("clear error" if clear else "raw / internal"), (error_lines or lines or [f"exit {res.code}"])[-1]
    except DataLost as err:
        return "data loss", str(err)
    except Wrong as err:
        return "silent wrong", str(err)
    except (ValueError, ArmorError, OSError) as err:
        text = " ".join(str(err).split())
        return ("clear error" if names and names.lower() in text.lower() else "raw / internal"), text
    except Exception as err:  # noqa: BLE001
        return "raw / internal", f"{type(err).__name__}: {' '.join(str(err).split())}"
    return ("correct result" if not names else "silent wrong"), "verified" if not names else "no error raised"


def main() -> int:
    if "--help" in sys.argv or "-h" in sys.argv:
        print(__doc__)
        return 0
    from torch_armor.progress import quiet_third_party_progress

    torch.set_num_threads(1)
    quiet_third_party_progress()
    rows = []
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    limit = int(sys.argv[sys.argv.index("--case-limit") + 1]) if "--case-limit" in sys.argv else 600
    for group, name, run, names in CASES:
        if only is not None and not (group.startswith(only) or only in name):
            continue
        outcome, detail = classify(run, names, limit)
        rows.append((group, name, outcome, detail))
    if "dir" in _TINY:
        shutil.rmtree(_TINY["dir"], ignore_errors=True)
    from robustness_fixtures import cleanup

    cleanup()
    import torch_armor

    print(f"torch_armor imported from {Path(torch_armor.__file__).parent}")
    print()
    print("| group | bad input or fault | outcome | answer |")
    print("|---|---|---|---|")
    for group, name, outcome, detail in rows:
        short = detail if len(detail) <= 110 else detail[:107] + "…"
        print(f"| {group} | {name} | {outcome} | {short.replace('|', '/')} |")
    kinds = ("clear error", "correct result", "silent wrong", "raw / internal", "data loss", "hang")
    counts = {k: sum(r[2] == k for r in rows) for k in kinds}
    print()
    print(f"tried {len(rows)}: {counts['clear error']} clear errors, {counts['correct result']} correct results, "
          f"{counts['silent wrong']} silent wrong, {counts['raw / internal']} raw / internal errors, "
          f"{counts['data loss']} data loss, {counts['hang']} hang")
    return 0 if counts["silent wrong"] == counts["raw / internal"] == counts["data loss"] == counts["hang"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
