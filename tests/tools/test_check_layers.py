"""tools/check_layers.py: the package's import structure holds (floors, no cycles, no private
imports, module sizes), and the checker finds each kind of violation in a package built to have it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "check_layers.py"


def _tool():
    spec = importlib.util.spec_from_file_location("check_layers", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_this_checkout_is_in_order():
    proc = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 violation(s)" in proc.stderr


def _package(root: Path, files: dict) -> Path:
    for name, text in files.items():
        path = root / "torch_armor" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_each_kind_of_violation_is_found(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "errors.py": "",
        "core/__init__.py": "",
        "core/a.py": "from torch_armor.core.b import thing\n",
        "core/b.py": "from torch_armor.core import a\nthing = 1\n",                         # cycle a <-> b
        "core/c.py": "from torch_armor.engine.runner import solve\n",                      # core imports engine
        "core/d.py": "from torch_armor.core.b import _hidden\n",                           # another module's _private
        "core/e.py": "from torch_armor.core import b\nx = b._hidden\n",                   # the same, as an attribute
        "core/f.py": "def f():\n    import json\n    return json\n",                       # local import, no reason
        "core/g.py": "def g():\n    import json  # reason\n    return json\n",            # local import with a reason
        "engine/__init__.py": "",
        "engine/runner.py": "solve = None\n" + "x = 1\n" * 501,                            # too long
        "nowhere.py": "",                                                                 # on no floor
    })
    problems = _tool().check(root / "torch_armor")
    text = "\n".join(problems)
    assert any(p.startswith("cycle:") and "core.a" in p and "core.b" in p for p in problems), text
    assert any(p.startswith("upward:") and "core/c.py" in p for p in problems), text
    assert any(p.startswith("private:") and "core/d.py" in p and "_hidden" in p for p in problems), text
    assert any(p.startswith("private:") and "core/e.py" in p for p in problems), text
    assert any(p.startswith("local-import:") and "core/f.py" in p for p in problems), text
    assert not any("core/g.py" in p for p in problems), text
    assert any(p.startswith("size:") and "engine/runner.py" in p for p in problems), text
    assert any(p.startswith("unplaced:") and "nowhere.py" in p for p in problems), text
    proc = subprocess.run([sys.executable, str(TOOL), "--root", str(root)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "cycle:" in proc.stdout
