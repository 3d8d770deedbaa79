"""Optional dependencies stay optional: without an extra, the feature that needs it is skipped
(the prune report's plot) or refused in one line naming the extra, never an internal error."""

from __future__ import annotations

import sys

import pytest

from _tiny_dir import save_tiny_model
from torch_armor.cli.parser import REPORT_JSON, REPORT_PNG, main
from torch_armor.errors import ArmorError, MissingExtraError, _EXTRAS, require_extra


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("module", sorted(_EXTRAS))
def test_missing_extra_names_the_pip_command(module, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # what `import module` sees when it is not installed
    package, extra = _EXTRAS[module]
    with pytest.raises(MissingExtraError) as info:
        require_extra(module, "this feature")
    message = str(info.value)
    assert f"pip install 'torch_armor[{extra}]'" in message and f"pip install {package}" in message
    assert "\n" not in message and isinstance(info.value, ArmorError)


def test_require_extra_returns_an_installed_module():
    assert require_extra("json", "anything") is sys.modules["json"]


def test_prune_without_matplotlib_skips_the_plot_and_succeeds(tmp_path, capsys, monkeypatch, tiny_dir):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "out"
    code = main(["prune", str(tiny_dir), "--out", str(out), "--calib", str(tiny_dir.parent / "text.txt"),
                 "--n-calib", "2", "--seq-len", "16", "--iters", "1", "--reconstruct-steps", "0", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert (out / REPORT_JSON).is_file() and not (out / REPORT_PNG).exists()
    skipped = [line for line in captured.err.splitlines() if REPORT_PNG in line]
    assert len(skipped) == 1 and "pip install 'torch_armor[plot]'" in skipped[0], captured.err
    assert REPORT_PNG not in captured.out and REPORT_JSON in captured.out


def test_gguf_file_without_gguf_is_one_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    code = main(["eval", str(tmp_path), "--gguf-file", "model.gguf", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "pip install 'torch_armor[gguf]'" in err, err
