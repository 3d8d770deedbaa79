"""tools/check_layers.py: the package's import structure holds (floors, no cycles, no private
imports), the checker finds each kind of violation in a package built to have it, and the module
table of docs/architecture.md is the one it writes."""

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
    assert not any("engine/runner.py" in p for p in problems), text  # long: a warning, not a violation
    assert [w for w in _tool().size_warnings(root / "torch_armor", 500) if "engine/runner.py" in w] == [
        "warning: size: torch_armor/engine/runner.py: 502 lines (over 500); does it hold more than one concept?"]
    assert any(p.startswith("unplaced:") and "nowhere.py" in p for p in problems), text
    proc = subprocess.run([sys.executable, str(TOOL), "--root", str(root)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "cycle:" in proc.stdout


def test_the_architecture_page_lists_every_module_as_the_checker_sees_it():
    tool = _tool()
    doc = (ROOT / tool.ARCHITECTURE).read_text(encoding="utf-8")
    fresh = tool.with_module_table(doc, tool.module_table(ROOT / "torch_armor"))
    assert doc == fresh, "docs/architecture.md's module table is stale: run python tools/check_layers.py --write-architecture"
    listed = {line.split("`")[1] for line in doc.splitlines() if line.startswith("| ") and "`torch_armor/" in line}
    assert listed == {str(p.relative_to(ROOT)) for p in (ROOT / "torch_armor").rglob("*.py")}


def test_the_module_table_follows_the_package(tmp_path):
    tool = _tool()
    root = _package(tmp_path, {"__init__.py": "", "errors.py": '"""Errors. More."""\n',
                               "core/__init__.py": "", "core/a.py": '"""See :class:`~torch_armor.core.a.Thing` | x."""\n'})
    doc = f"# A\n{tool.TABLE_START}\nold rows\n{tool.TABLE_END}\nafter\n"
    assert tool.with_module_table(doc, tool.module_table(root / "torch_armor")).splitlines() == [
        "# A", tool.TABLE_START, "| floor | module | what it is |", "| --- | --- | --- |",
        "| 0 base | `torch_armor/errors.py` | Errors. |",
        "| 1 core | `torch_armor/core/__init__.py` | (package) |",
        "| 1 core | `torch_armor/core/a.py` | See `Thing` \\| x. |",
        "| 7 package | `torch_armor/__init__.py` | (package) |",
        tool.TABLE_END, "after"]


def test_the_engine_knows_no_method(tmp_path):
    """The engine imports no method's package, names no config type (docstrings may) and asks no config
    which method it is; the shared ``MethodConfig`` and its ``pattern`` stay allowed."""
    root = _package(tmp_path, {
        "__init__.py": "",
        "config/__init__.py": "",
        "config/methods.py": "class MethodConfig:\n    pattern: str = '2:4'\n",
        "config/armor.py": "class ArmorConfig:\n    pattern: str = '2:4'\n    seed: int = 0\n    max_overhead: float = 0.05\n",
        "engine/__init__.py": "",
        "engine/methods.py": "class Method:\n    pass\n",
        "engine/loop.py": '''\
            """Runs ``ArmorConfig()`` and the baselines alike."""
            from torch_armor.config.armor import ArmorConfig
            from torch_armor.config.methods import MethodConfig
            from torch_armor.armor import method


            def run(config: MethodConfig, m):
                if m.factorizes:
                    return config.seed
                if isinstance(config, ArmorConfig):
                    return config.pattern, m.options.seed
                return config.max_overhead
        ''',
        "engine/clean.py": '''\
            """Example: ``>>> ArmorConfig().seed``."""
            from torch_armor.config.methods import MethodConfig


            def run(config: MethodConfig, method):
                return method.plan(config), config.pattern
        ''',
        "armor/__init__.py": "",
        "armor/method.py": "from torch_armor.config.armor import ArmorConfig\nfrom torch_armor.engine.methods import Method\n"
                           "def seed(config: ArmorConfig):\n    return config.seed\n",
    })
    problems = _tool().check(root / "torch_armor")
    engine = sorted((p.split(":")[0], int(p.split(":")[2])) for p in problems
                    if "engine/" in p and not p.startswith("upward"))
    assert engine == [("config-type", 2), ("config-type", 10), ("method-import", 4), ("method-test", 8),
                      ("method-test", 9), ("method-test", 12)], problems
    assert not any("engine/clean.py" in p or "armor/method.py" in p for p in problems), problems
    assert any(p.startswith("upward:") and "engine/loop.py:4" in p for p in problems), problems


def test_the_engine_carries_no_factors(tmp_path):
    """The engine imports neither ARMOR's factors nor the code that makes them and names no ``ArmorFactors``
    in code (docstrings may); a method's module may."""
    root = _package(tmp_path, {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/factors.py": "class ArmorFactors:\n    pass\n",
        "core/factorize.py": "def factorize(w):\n    return w\n",
        "engine/__init__.py": "",
        "engine/solution.py": '''\
            """Holds ``ArmorFactors`` or a pruned weight."""
            from torch_armor.core.factors import ArmorFactors
            import torch_armor.core.factorize


            def approximation(payload, kinds):
                if isinstance(payload, kinds.ArmorFactors):
                    return payload
                return ArmorFactors
        ''',
        "engine/clean.py": '''\
            """Example: ``>>> ArmorFactors(...)``."""


            def approximation(solution):
                return solution.method.approximation(solution.payload)
        ''',
        "armor/__init__.py": "",
        "armor/method.py": "from torch_armor.core.factors import ArmorFactors\n"
                           "def rebuild(t):\n    return ArmorFactors(t)\n",
    })
    problems = _tool().check(root / "torch_armor")
    data = sorted(int(p.split(":")[2]) for p in problems if p.startswith("method-data:"))
    assert data == [2, 3, 7, 9], problems
    assert all("engine/solution.py" in p for p in problems if p.startswith("method-data:")), problems
