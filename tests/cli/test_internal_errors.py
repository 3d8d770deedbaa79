"""Only torch_armor's own error types are input errors (exit status 2); anything else reaching the
command line is a bug: one line ``internal error: …`` saying where its traceback is, exit status 1,
never relabelled as "your input is wrong". Library messages name API parameters; the command line
prints them with its flags."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from _tiny_dir import fast_prune_args, save_tiny_model
from torch_armor.cli.parser import main
from torch_armor.cli.flags import PARAMETER_FLAGS, with_flags
from torch_armor.config.methods import WandaConfig
from torch_armor.engine.runner import solve_layer
from torch_armor.errors import ArmorError, ArmorInputError

INPUT_ERROR, INTERNAL_ERROR = 2, 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    return folder, save_tiny_model(folder)


def _planted_bug(monkeypatch):
    """Tensor.topk (inside torch, used by Wanda's mask) raises a ValueError as a torch bug would."""
    def topk(self, *args, **kwargs):
        raise ValueError("planted: topk(): k out of range")

    monkeypatch.setattr(torch.Tensor, "topk", topk)


def _wanda_args(folder: Path) -> list:
    return fast_prune_args(folder, method="wanda")


def test_a_valueerror_from_inside_torch_is_an_internal_error(tiny, tmp_path, capsys, monkeypatch):
    folder, model = tiny
    _planted_bug(monkeypatch)
    code = main(["prune", str(model), "--method", "wanda", *_wanda_args(folder), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == INTERNAL_ERROR and code != INPUT_ERROR
    lines = [line for line in err.strip().splitlines() if "error" in line]  # after the log lines
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err
    match = re.fullmatch(r"torch-armor prune: internal error: ValueError: planted: topk\(\): k out of range — please "
                         r"report; full traceback in (\S+) or with --debug", lines[0])
    assert match, lines[0]
    assert " error: " not in lines[0].replace("internal error: ", "")  # not an input error
    trace = Path(match.group(1))
    try:
        text = trace.read_text(encoding="utf-8")
        assert "Traceback (most recent call last)" in text and "planted: topk" in text and "solve_layer" in text
    finally:
        trace.unlink()


def test_debug_raises_the_bug_itself(tiny, tmp_path, monkeypatch):
    folder, model = tiny
    _planted_bug(monkeypatch)
    with pytest.raises(ValueError, match="planted") as info:
        main(["prune", str(model), "--method", "wanda", *_wanda_args(folder), "--out", str(tmp_path / "o"),
              "--debug"])
    assert not isinstance(info.value, ArmorError)


def test_solve_layer_names_the_layer_of_its_own_errors_only(monkeypatch):
    weight, h = torch.randn(8, 16), torch.rand(16) + 0.1
    with pytest.raises(ArmorInputError, match="layer 'fc': .*pattern"):  # ours: named, still an input error
        solve_layer(torch.randn(8, 6), torch.rand(6), WandaConfig(), name="fc")
    _planted_bug(monkeypatch)
    with pytest.raises(ValueError, match="^planted") as info:  # torch's: as it is, never an input error
        solve_layer(weight, h, WandaConfig(), name="fc")
    assert type(info.value) is ValueError


def test_an_input_error_names_the_flag(tiny, tmp_path, capsys):
    folder, model = tiny
    out = tmp_path / "full"
    out.mkdir()
    (out / "x").write_text("x")
    assert main(["prune", str(model), *fast_prune_args(folder), "--out", str(out)]) == INPUT_ERROR
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == f"torch-armor prune: error: --out {out} is not empty; pass --overwrite to write into it"


def test_library_messages_name_parameters_and_the_cli_maps_them():
    assert with_flags("out=/x is not empty; pass overwrite=True to write into it") == \
        "--out /x is not empty; pass --overwrite to write into it"
    assert with_flags("layers='0-9' selects none; or give another run_dir= / out=") == \
        "--layers '0-9' selects none; or give another --run-dir / --out"
    assert with_flags("needs PruneOptions(out=DIR), PruneOptions(progress=False, out=DIR)") == \
        "needs PruneOptions(out=DIR), PruneOptions(progress=False, out=DIR)"  # an API spelling stays
    assert PARAMETER_FLAGS["out"] == "--out" and PARAMETER_FLAGS["run_dir"] == "--run-dir"


def test_the_library_speaks_no_command_line():
    """No message of the library (outside the command line's own modules) names a CLI flag."""
    root = Path(__file__).resolve().parents[2] / "torch_armor"
    front = {"__main__.py", "__init__.py"}  # and the command line's own package, cli/
    flag = re.compile(r"""f?["'][^"'\n]*(?<![\w-])--(""" + "|".join(f[2:] for f in PARAMETER_FLAGS.values())
                      + r"""|method|max-overhead)\b""")
    found = [f"{p.relative_to(root)}:{n}" for p in sorted(root.rglob("*.py"))
             if p.name not in front and p.relative_to(root).parts[0] != "cli"
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if flag.search(line) and not line.lstrip().startswith("#")]
    assert found == []
