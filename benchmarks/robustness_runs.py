"""Issue #25's robustness cases about runs (registered by ``robustness_untrusted.register``): calibration
input, outputs over inputs, two processes on one run directory, signals and late failures."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch

from torch_armor import MagnitudeConfig, PruneOptions, WandaConfig  # noqa: E402
from robustness_fixtures import (  # noqa: E402
    PRUNE_SCRIPT,
    STATE,
    armor_cfg,
    calib_ids,
    dense_dir,
    logits_of,
    subprocess_env,
    text_file,
    tmp_dir,
    tokenized_model,
    tree_hash,
    wait_for,
)


def register(case, cli_case, CliResult, _cli, check, check_kept, code: Path) -> None:  # noqa: C901 - a list of cases
    """Add the run cases to ``robustness.py``'s list."""
    # ------------------------------------------------------------------ calibration input
    def _calib_case(calib):
        from conftest import make_tiny_llama
        from torch_armor import prune_model

        prune_model(make_tiny_llama(vocab=50), calib, WandaConfig(), options=PruneOptions(progress=False))

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
        @case("calibration", f"prune_model with {label}", "calibration")
        def _(calib=calib):
            _calib_case(calib())

    for dtype in (torch.int32, torch.uint8):
        @case("calibration", f"prune_model with {str(dtype).removeprefix('torch.')} ids (same result as int64)")
        def _(dtype=dtype):
            from conftest import make_tiny_llama
            from torch_armor import prune_model

            ids = calib_ids(vocab=50)
            a, b = make_tiny_llama(vocab=50), make_tiny_llama(vocab=50)
            prune_model(a, ids, WandaConfig(), options=PruneOptions(progress=False))
            prune_model(b, ids.to(dtype), WandaConfig(), options=PruneOptions(progress=False))
            check(all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values())),
                  "a different result from the same ids")

    # ------------------------------------------------------------------ outputs over inputs
    def _over_input(make_out, api: str, overwrite: bool = False):
        d = dense_dir() if api == "python" else tokenized_model(2)
        before = tree_hash(d.parent)
        out = make_out(d)
        try:
            if api == "python":
                from torch_armor import prune_model

                prune_model(str(d), calib_ids(), MagnitudeConfig(), options=PruneOptions(out=out, progress=False))
                res = None
            else:
                before = tree_hash(d.parent)
                res = _cli(["prune", str(d), "--calib", str(text_file()), "--n-calib", "2", "--seq-len", "16", "--method",
                            "magnitude", "--no-progress", "--out", str(out)] + (["--overwrite"] if overwrite else []))
        finally:
            after = tree_hash(d.parent)
            after.pop("link", None)
            before.pop("link", None)
            check_kept({k: v for k, v in after.items() if k in before} == before, "the input checkpoint was modified")
        return res

    def _link(d: Path) -> Path:
        (d.parent / "link").symlink_to(d)
        return d.parent / "link"

    for label, make_out in (("out = the checkpoint", lambda d: d), ("out = a symlink to it", _link),
                            ("out = 'ckpt/../ckpt'", lambda d: d / ".." / d.name), ("out = its parent", lambda d: d.parent)):
        @case("overwrite", f"prune_model(path, {label})", "input checkpoint")
        def _(make_out=make_out):
            _over_input(make_out, "python")

    for overwrite in (False, True):
        @cli_case("overwrite", f"prune M --out M{' --overwrite' if overwrite else ''}", "input checkpoint")
        def _(overwrite=overwrite):
            return _over_input(lambda d: d, "cli", overwrite)

    @cli_case("overwrite", "prune M --out LINK-TO-M --overwrite", "input checkpoint")
    def _():
        return _over_input(_link, "cli", True)

    @case("overwrite", "prune_model(model loaded from DIR, out=DIR)", "input checkpoint")
    def _():
        from transformers import AutoModelForCausalLM
        from torch_armor import prune_model

        d = dense_dir()
        before = tree_hash(d)
        try:
            prune_model(AutoModelForCausalLM.from_pretrained(d), calib_ids(), MagnitudeConfig(), options=PruneOptions(out=d, progress=False))
        finally:
            check_kept(tree_hash(d) == before, "the checkpoint the model came from was overwritten")

    for flag in ("run_dir", "hidden_dir"):
        @case("overwrite", f"prune_model(path, {flag}=path)", "input checkpoint")
        def _(flag=flag):
            from torch_armor import prune_model

            d = dense_dir()
            before = tree_hash(d)
            try:
                prune_model(str(d), calib_ids(), armor_cfg(), options=PruneOptions(out=d.parent / "out", progress=False, **{flag: d}))
            finally:
                check_kept(tree_hash(d) == before, f"{flag} wrote into the input checkpoint")

    @case("overwrite", "out = an existing file: refused before pruning", "not a directory")
    def _():
        from conftest import make_tiny_llama
        from torch_armor import prune_model

        target = tmp_dir() / "file"
        target.write_bytes(b"keep")
        model = make_tiny_llama()
        try:
            prune_model(model, calib_ids(), armor_cfg(), options=PruneOptions(out=target, progress=False))
        finally:
            check_kept(target.read_bytes() == b"keep", "the file was replaced")
            check(not any(hasattr(type(p), "__tensor_flatten__") for p in model.parameters()),
                  "pruned although out is refused")

    # ------------------------------------------------------------------ concurrency
    def _two_processes(shared_out: bool):
        d = dense_dir()
        base = d.parent
        run = base / "run"
        outs = [base / "out-a", base / ("out-a" if shared_out else "out-b")]
        env = subprocess_env(code)
        first = subprocess.Popen([sys.executable, "-c", PRUNE_SCRIPT, str(d), "-" if shared_out else str(run), str(outs[0])],
                                 env=env, cwd=STATE['tmp'], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        run_dir = outs[0] / "armor_run" if shared_out else run
        wait_for(lambda: (run_dir / "manifest.json").is_file(), first)
        stopped = first.poll() is None
        if stopped:
            os.kill(first.pid, signal.SIGSTOP)
        try:
            second = subprocess.run([sys.executable, "-c", PRUNE_SCRIPT, str(d), "-" if shared_out else str(run),
                                     str(outs[1])], env=env, cwd=STATE['tmp'], capture_output=True, text=True, timeout=600)
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
            check(bool(torch.isfinite(logits_of(model)).all()), f"{o.name} gives non-finite logits")
        if second.returncode == 0:
            check(False, "both processes pruned into one run directory and exited 0")
        last = second.stderr.strip().splitlines()[-1] if second.stderr.strip() else ""
        raise (ValueError if f"process {first.pid}" in last else RuntimeError)(last)

    class DataLostProxy(Exception):
        pass

    @case("concurrency", "two prune processes, one --run-dir, two outs", "in use by process")
    def _():
        try:
            _two_processes(shared_out=False)
        except DataLostProxy as err:
            check_kept(False, str(err))

    @case("concurrency", "two streamed prunes into one out (its default run directory)", "in use by process")
    def _():
        try:
            _two_processes(shared_out=True)
        except DataLostProxy as err:
            check_kept(False, str(err))

    def _cli_process(argv, log: Path, stop_at=None) -> subprocess.Popen:
        env = subprocess_env(code)
        if stop_at is not None:
            env["TORCH_ARMOR_TEST_STOP_AT"] = stop_at  # a test-only stop point (torch_armor._io.stop_here_for_tests)
        with open(log, "w") as err:
            return subprocess.Popen([sys.executable, "-m", "torch_armor", *map(str, argv)], env=env, cwd=STATE["tmp"],
                                    stdout=subprocess.DEVNULL, stderr=err)

    @case("concurrency", "two CLI prunes into one --out at once, each with its own --run-dir", "saved in")
    def _():
        from _tiny_dir import fast_prune_args, save_tiny_model
        from torch_armor import load_pretrained

        base = tmp_dir()
        model_dir = save_tiny_model(base)
        out = base / "out"
        procs = {name: _cli_process(["prune", model_dir, "--out", out, "--run-dir", base / f"run-{name}", "--seed", seed,
                                     *fast_prune_args(base)], base / f"{name}.log") for name, seed in (("a", "0"), ("b", "1"))}
        codes = {name: proc.wait(timeout=600) for name, proc in procs.items()}
        check_kept(sorted(codes.values()) != [0, 0], "both exited 0: one finished model was silently replaced")
        if sorted(codes.values()) != [0, 2]:
            raise RuntimeError(f"exit statuses {codes}")
        loser = next(name for name, c in codes.items() if c == 2)
        for d in (out, base / f"run-{loser}" / "pruned"):
            try:
                logits_of(load_pretrained(d))
            except (OSError, ValueError) as err:
                check_kept(False, f"{d} does not load: {err}")
        raise ValueError((base / f"{loser}.log").read_text().strip().splitlines()[-1])

    @case("overwrite", "prune --overwrite of a finished sharded OUT killed after its first new shard, then loaded",
          "half-written")
    def _():
        import time

        from transformers import AutoModelForCausalLM

        from _tiny_dir import fast_prune_args, save_tiny_model
        from torch_armor import load_pretrained

        base = tmp_dir()
        model_dir = save_tiny_model(base)
        out = base / "out"
        argv = ["prune", model_dir, "--out", out, *fast_prune_args(base)]
        check(_cli(list(map(str, argv))).code == 0, "the first prune failed")
        first = out / "model-00001-of-00003.safetensors"
        inode = first.stat().st_ino
        proc = _cli_process(argv + ["--overwrite", "--seed", "1"], base / "again.log", stop_at="first-shard-moved")
        end = time.monotonic() + 600
        while time.monotonic() < end:  # stopped there, or (code without the stop point) the first shard replaced
            pid, status = os.waitpid(proc.pid, os.WNOHANG | os.WUNTRACED)
            if (pid and os.WIFSTOPPED(status)) or not first.exists() or first.stat().st_ino != inode:
                break
            if pid:
                raise RuntimeError("the re-prune ended before its first shard was moved in")
            time.sleep(0.0005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        loaded = []
        for load in (AutoModelForCausalLM.from_pretrained, load_pretrained):
            try:
                loaded.append(load(out))
            except ValueError as err:
                refused = err
        check(not loaded, "a directory holding shards of two runs loaded")
        raise refused

    # ------------------------------------------------------------------ signals and late failures
    def _signal_case(sig: int):
        model_dir = tokenized_model(6)
        out = model_dir.parent / "out"
        argv = ["prune", str(model_dir), "--calib", str(text_file()), "--n-calib", "2", "--seq-len", "32", "--block-size",
                "16", "--iters", "6", "--threads", "1", "--no-progress", "--out", str(out)]
        proc = subprocess.Popen([sys.executable, "-m", "torch_armor", *argv], env=subprocess_env(code), cwd=STATE['tmp'], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        wait_for(lambda: (out / "armor_run" / "hidden.safetensors").is_file(), proc)
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

    @case("signals", "SIGTERM during a CLI prune, then the same command")
    def _():
        _signal_case(signal.SIGTERM)

    @case("signals", "SIGINT during a CLI prune, then the same command")
    def _():
        _signal_case(signal.SIGINT)

    def _late(target: str, overwrite: bool):
        import importlib

        model_dir = tokenized_model(2)
        out = model_dir.parent / "out"
        argv = ["prune", str(model_dir), "--calib", str(text_file()), "--n-calib", "2", "--seq-len", "32", "--block-size",
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
                          ("assembling the checkpoint", "torch_armor.engine.sources.assemble_checkpoint"),
                          ("saving the tokenizer", "transformers.PreTrainedTokenizerBase.save_pretrained")):
        for overwrite in (False, True):
            @case("signals", f"failure while {label}, then the same command"
                                 f"{' with --overwrite' if overwrite else ''}")
            def _(target=target, overwrite=overwrite):
                _late(target, overwrite)


