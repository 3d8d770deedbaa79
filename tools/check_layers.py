#!/usr/bin/env python3
"""Check torch_armor's import structure: floors, cycles, private names; warn about long modules.

Pure ``ast`` (nothing is imported or executed). Every module of the package sits on a floor;
an import may point to the same floor or a lower one, never up:

    0  errors, _io, progress, threads     (no torch_armor imports besides each other)
    1  core, config, kernels              (pure math, sparsity patterns; the method configs; GPU kernels)
    2  calibration                        (hooks, statistics)
    3  tensor, format                     (ArmorTensor, storages; the save/load format, transformers)
    4  engine                             (the method hooks and registry, runner, pipeline, sources, run store,
                                          prune_model: it never names a method)
    5  armor, baselines                   (the methods: their hooks, registered on import)
    6  sparsifier, calibrated_sparsifier, sparsifier_state, cli, recipes, __main__   (front ends)
    7  torch_armor (the package's __init__: the public names)

Violations (each printed on one line; exit status 1 if there is any):

* ``upward``: a module imports a module on a higher floor;
* ``cycle``: modules that import each other, directly or through others (function-local
  imports count: they only hide a cycle);
* ``private``: a module imports another module's ``_private`` name (``from m import _x``, or
  ``m._x`` on an imported module ``m``);
* ``unplaced``: a module that the floors table does not place;
* ``local-import``: a function-local import without a comment on its line saying why it is local;
* ``method-import``: an engine module imports a method's package (``armor``, ``baselines``): the
  methods register themselves with the engine, which never imports them;
* ``config-type``: an engine module names a method's config type (``ArmorConfig``, ``SparseGPTConfig``,
  … every ``*Config`` class of ``core`` but the shared ``MethodConfig``), in code (docstrings may);
* ``method-data``: an engine module imports a method's own data or the code that makes it
  (``torch_armor.core.factors``, ``torch_armor.core.factorize``) or names its type (``ArmorFactors``),
  in code (docstrings may): a layer's solution is opaque to the engine, the method's hooks read it;
* ``method-test``: an engine module asks which method it runs (``.factorizes``, ``.needs_allocation``,
  ``.reconstructs``, ``.refines``) or reads a method's own setting off a config (``config.seed``,
  ``self.config.reconstruct``, … any field of a ``core`` config class but ``pattern``): it calls the
  method's hooks instead.

A module longer than ``--warn-lines`` (800) lines gets a ``warning: size`` line, which is not a
violation: a module is cut where its concepts part, not where a line count falls.

Modules listed in ``PENDING_REWRITE`` (being rewritten on another branch) are exempt from the
``local-import`` rule, never from the import rules.

The module table of ``docs/architecture.md`` (every module, its floor and the first sentence of its
docstring) is written from the same scan, so it cannot drift; a test fails when it is stale.

Usage::

    python tools/check_layers.py                        # this checkout's torch_armor/
    python tools/check_layers.py --root DIR             # the torch_armor/ inside DIR (e.g. an old commit)
    python tools/check_layers.py --write-architecture   # rewrite docs/architecture.md's module table
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

PACKAGE = "torch_armor"

#: (module-name prefix, floor); the longest matching prefix wins.
FLOORS: Tuple[Tuple[str, int], ...] = (
    ("torch_armor.errors", 0),
    ("torch_armor._io", 0),
    ("torch_armor._quiet", 0),
    ("torch_armor.progress", 0),
    ("torch_armor.threads", 0),
    ("torch_armor.core", 1),
    ("torch_armor.config", 1),
    ("torch_armor.kernels", 1),
    ("torch_armor.calibration", 2),
    ("torch_armor.tensor", 3),
    ("torch_armor.format", 3),
    ("torch_armor.engine", 4),
    ("torch_armor.armor", 5),
    ("torch_armor.baselines", 5),
    ("torch_armor.sparsifier", 6),
    ("torch_armor.calibrated_sparsifier", 6),
    ("torch_armor.sparsifier_state", 6),
    ("torch_armor.cli", 6),
    ("torch_armor.recipes", 6),
    ("torch_armor.__main__", 6),
    ("torch_armor", 7),  # the package's __init__ only: a new top-level module must be placed
)
FLOOR_NAMES = {0: "base", 1: "core", 2: "calibration", 3: "tensor/format", 4: "engine", 5: "methods", 6: "front end", 7: "package"}

#: Modules being rewritten elsewhere (issue #21: one class per storage format, a storage policy),
#: exempt from the ``local-import`` rule until that lands; the import rules (upward,
#: cycle, private) hold for them as for every module. Empty this when #21 is merged.
PENDING_REWRITE: Dict[str, str] = {}  # none: the tensor storages have landed

#: The loop that knows no method: these modules are held to the method-blind rules.
ENGINE = "torch_armor.engine"
#: The packages of the methods (each registers itself with the engine when imported).
METHOD_PACKAGES = ("torch_armor.armor", "torch_armor.baselines")
#: A method's own data (ARMOR's factors) and the modules that define or make it: opaque to the engine.
METHOD_DATA_MODULES = ("torch_armor.core.factors", "torch_armor.core.factorize")
METHOD_DATA_TYPES = ("ArmorFactors",)
#: Questions that tell one method from another.
METHOD_TESTS = ("factorizes", "needs_allocation", "reconstructs", "refines")
#: The config type every method's config shares (the engine may name it) and the fields it shares.
SHARED_CONFIG, SHARED_FIELDS = "MethodConfig", ("pattern",)
#: The names a config goes by in the engine's code.
CONFIG_NAMES = ("config", "cfg")


@dataclass
class Import:
    target: str  # the torch_armor module imported
    line: int
    names: Tuple[str, ...] = ()  # names taken from it (``from target import a, b``)
    local: bool = False  # inside a function
    commented: bool = False  # a comment on the import's line
    third_party: bool = False  # not a torch_armor module (only function-local ones are recorded)


@dataclass
class Module:
    name: str
    path: Path
    lines: int
    imports: List[Import] = field(default_factory=list)
    private_attrs: List[Tuple[int, str, str]] = field(default_factory=list)  # (line, module, attribute)
    names: List[Tuple[int, str]] = field(default_factory=list)  # (line, name) of every name the code uses
    attributes: List[Tuple[int, str, str]] = field(default_factory=list)  # (line, what it is read off, attribute)
    config_classes: Dict[str, Tuple[str, ...]] = field(default_factory=dict)  # ``*Config`` class -> its fields


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def floor_of(name: str) -> Optional[int]:
    best = None
    for prefix, floor in FLOORS:
        if name == prefix or (prefix != PACKAGE and name.startswith(prefix + ".")):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, floor)
    return None if best is None else best[1]


def _commented_lines(source: str) -> Set[int]:
    lines = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                lines.add(tok.start[0])
    except (tokenize.TokenError, SyntaxError):
        pass
    return lines


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: Module, known: Set[str], is_package: bool, comments: Set[int]) -> None:
        self.module = module
        self.known = known
        self.is_package = is_package
        self.comments = comments
        self.depth = 0  # function nesting
        self.aliases: Dict[str, str] = {}  # local name -> torch_armor module it is bound to

    def _resolve(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.module.name.split(".")
        if not self.is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _add(self, target: str, node: ast.AST, names: Tuple[str, ...] = ()) -> None:
        end = getattr(node, "end_lineno", node.lineno) or node.lineno
        commented = any(line in self.comments for line in range(node.lineno, end + 1))
        self.module.imports.append(Import(target, node.lineno, names, self.depth > 0, commented))

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def _third_party(self, what: str, node: ast.AST) -> None:
        if self.depth > 0:
            self._add(what, node)
            self.module.imports[-1].third_party = True

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                self._add(alias.name, node)
                if alias.asname:
                    self.aliases[alias.asname] = alias.name
            else:
                self._third_party(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._resolve(node)
        if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
            self._third_party(base, node)
            return
        plain: List[str] = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in self.known:  # ``from torch_armor.tensor import serialization``: a module
                self._add(sub, node)
                self.aliases[alias.asname or alias.name] = sub
            else:
                plain.append(alias.name)
        if plain or not node.names:
            self._add(base, node, tuple(plain))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id in self.aliases and _private(node.attr):
            self.module.private_attrs.append((node.lineno, self.aliases[node.value.id], node.attr))
        base = (node.value.id if isinstance(node.value, ast.Name)
                else node.value.attr if isinstance(node.value, ast.Attribute) else "")
        self.module.attributes.append((node.lineno, base, node.attr))
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        self.module.names.append((node.lineno, node.id))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if node.name.endswith("Config"):
            self.module.config_classes[node.name] = tuple(
                item.target.id for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
        self.generic_visit(node)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def scan(package_dir: Path) -> Dict[str, Module]:
    root = package_dir.parent
    paths = sorted(package_dir.rglob("*.py"))
    known = {module_name(p, root) for p in paths}
    modules: Dict[str, Module] = {}
    for path in paths:
        source = path.read_text(encoding="utf-8")
        name = module_name(path, root)
        module = Module(name, path, source.count("\n") + (not source.endswith("\n") and bool(source)))
        tree = ast.parse(source, filename=str(path))
        _Visitor(module, known, path.name == "__init__.py", _commented_lines(source)).visit(tree)
        modules[name] = module
    return modules


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check(package_dir: Path) -> List[str]:
    """Every violation, one line each (empty: the package is in order)."""
    modules = scan(package_dir)
    root = package_dir.parent
    problems: List[str] = []
    graph: Dict[str, Set[str]] = defaultdict(set)
    for name, mod in sorted(modules.items()):
        where = str(mod.path.relative_to(root))
        floor = floor_of(name)
        if floor is None:
            problems.append(f"unplaced: {where}: module {name} is on no floor; add it to FLOORS in tools/check_layers.py")
            continue
        pending = where in PENDING_REWRITE
        for imp in mod.imports:
            target = imp.target
            if imp.local and not imp.commented and not pending:
                problems.append(f"local-import: {where}:{imp.line}: function-local import of {target} without a "
                                "comment saying why it is not at the top")
            if imp.third_party:
                continue
            if target != name and target in modules:
                graph[name].add(target)
            elif target not in modules:
                problems.append(f"unplaced: {where}:{imp.line}: imports {target}, which is not a module of {PACKAGE}")
                continue
            t_floor = floor_of(target)
            if t_floor is not None and t_floor > floor:
                problems.append(f"upward: {where}:{imp.line}: {name} ({FLOOR_NAMES[floor]}, floor {floor}) imports "
                                f"{target} ({FLOOR_NAMES[t_floor]}, floor {t_floor})")
            if target != name:
                for n in imp.names:
                    if _private(n):
                        problems.append(f"private: {where}:{imp.line}: imports {target}.{n}; make it public or "
                                        "keep it in its module")
        for line, target, attr in mod.private_attrs:
            if target != name:
                problems.append(f"private: {where}:{line}: uses {target}.{attr}; make it public")
    for comp in _cycles(graph):
        problems.append(f"cycle: {' <-> '.join(comp)} import each other")
    return problems + method_blind(modules, root)


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def method_blind(modules: Dict[str, Module], root: Path) -> List[str]:
    """The engine's violations of the method-blind rules (``method-import``, ``config-type``, ``method-data``,
    ``method-test``)."""
    configs: Dict[str, Tuple[str, ...]] = {}
    for name, mod in modules.items():
        if _in(name, f"{PACKAGE}.config"):
            configs.update(mod.config_classes)
    types = set(configs) - {SHARED_CONFIG}
    fields = {f for kind in types for f in configs[kind]} - set(SHARED_FIELDS)
    problems: List[str] = []
    for name, mod in sorted(modules.items()):
        if not _in(name, ENGINE):
            continue
        where = str(mod.path.relative_to(root))
        for imp in mod.imports:
            if any(_in(imp.target, package) for package in METHOD_PACKAGES):
                problems.append(f"method-import: {where}:{imp.line}: the engine imports {imp.target}; a method "
                                "registers itself with the engine, which never imports it")
            if imp.target in METHOD_DATA_MODULES or any(n in METHOD_DATA_TYPES for n in imp.names):
                problems.append(f"method-data: {where}:{imp.line}: the engine imports {imp.target}, a method's own "
                                "data; carry a solution's payload and let the method's hooks read it")
            for n in imp.names:
                if n in types:
                    problems.append(f"config-type: {where}:{imp.line}: the engine imports {n}; ask the config's "
                                    "method (engine.methods.method_for) instead of naming its type")
        for line, n in mod.names:
            if n in types:
                problems.append(f"config-type: {where}:{line}: the engine names {n}; ask the config's method "
                                "(engine.methods.method_for) instead of naming its type")
            elif n in METHOD_DATA_TYPES:
                problems.append(f"method-data: {where}:{line}: the engine names {n}, a method's own data; carry a "
                                "solution's payload and let the method's hooks read it")
        for line, base, attr in mod.attributes:
            if attr in METHOD_DATA_TYPES:
                problems.append(f"method-data: {where}:{line}: the engine names {base}.{attr}, a method's own data; "
                                "carry a solution's payload and let the method's hooks read it")
            elif attr in METHOD_TESTS:
                problems.append(f"method-test: {where}:{line}: .{attr} asks which method runs; give the method a "
                                "hook (engine.methods.Method) and call it")
            elif attr in fields and base in CONFIG_NAMES:
                problems.append(f"method-test: {where}:{line}: {base}.{attr} reads one method's setting in the "
                                "engine; the method's hook reads it")
    return problems


def size_warnings(package_dir: Path, warn_lines: int = 800) -> List[str]:
    """One line per module longer than ``warn_lines`` (not violations)."""
    root = package_dir.parent
    return [f"warning: size: {m.path.relative_to(root)}: {m.lines} lines (over {warn_lines}); does it hold more "
            "than one concept?" for _, m in sorted(scan(package_dir).items()) if m.lines > warn_lines]


ARCHITECTURE = Path("docs") / "architecture.md"
TABLE_START = ("<!-- module table: written by `python tools/check_layers.py --write-architecture` from the "
               "checker's scan; do not edit by hand -->")
TABLE_END = "<!-- end of module table -->"


#: reStructuredText roles as a docstring writes them (:class:`~a.B`, :meth:`text <a.b>`): group 1 is
#: what a reader sees (the last dotted part of it where the target starts with ``~``)
_ROLE = re.compile(r":[a-z]+:`~?([^`<]+?)(?: <[^>]*>)?`")


def _summary(path: Path) -> str:
    """The first sentence of a module's docstring, on one line (``(package)`` for an empty ``__init__``)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    if not paragraph:
        return "(package)" if path.name == "__init__.py" else ""
    end = paragraph.find(". ")
    sentence = paragraph if end < 0 else paragraph[: end + 1]
    sentence = _ROLE.sub(lambda m: "`" + (m[1].rsplit(".", 1)[-1] if m[0].count("~") else m[1]) + "`", sentence)
    return sentence.replace("``", "`").replace("|", "\\|")


def module_table(package_dir: Path) -> str:
    """The markdown table of every module: its floor, its file and what it is, by floor then file."""
    root = package_dir.parent
    rows = sorted((-1 if floor_of(name) is None else floor_of(name), str(mod.path.relative_to(root)),
                   _summary(mod.path)) for name, mod in scan(package_dir).items())
    lines = ["| floor | module | what it is |", "| --- | --- | --- |"]
    lines += [f"| {'unplaced' if floor < 0 else f'{floor} {FLOOR_NAMES[floor]}'} | `{where}` | {what} |"
              for floor, where, what in rows]
    return "\n".join(lines)


def with_module_table(document: str, table: str) -> str:
    """``document`` with the text between the table's markers replaced by ``table``."""
    start, end = document.find(TABLE_START), document.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"{ARCHITECTURE}: the markers {TABLE_START!r} and {TABLE_END!r} are missing; put them "
                         "where the module table goes")
    return document[: start + len(TABLE_START)] + "\n" + table + "\n" + document[end:]


def local_imports(package_dir: Path) -> List[str]:
    """Every function-local import of a torch_armor module (for the report)."""
    root = package_dir.parent
    return [f"{m.path.relative_to(root)}:{i.line}: {i.target}" for m in scan(package_dir).values()
            for i in m.imports if i.local and not i.third_party]


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]),
                        help="directory holding the torch_armor/ package (default: this checkout)")
    parser.add_argument("--warn-lines", type=int, default=800,
                        help="warn about modules longer than this (default 800; not a violation)")
    parser.add_argument("--write-architecture", action="store_true",
                        help=f"rewrite the module table of {ARCHITECTURE} from the scan")
    parser.add_argument("--list-local", action="store_true", help="also list the function-local imports")
    args = parser.parse_args(list(argv) if argv is not None else None)
    package_dir = Path(args.root) / PACKAGE
    if not package_dir.is_dir():
        print(f"check_layers: {package_dir} is not a directory", file=sys.stderr)
        return 2
    if args.write_architecture:
        doc = Path(args.root) / ARCHITECTURE
        doc.write_text(with_module_table(doc.read_text(encoding="utf-8"), module_table(package_dir)), encoding="utf-8")
        print(f"check_layers: wrote the module table of {doc}", file=sys.stderr)
    problems = check(package_dir)
    for line in size_warnings(package_dir, args.warn_lines):
        print(line)
    if args.list_local:
        for line in local_imports(package_dir):
            print(f"local: {line}")
    for line in problems:
        print(line)
    modules = scan(package_dir)
    print(f"check_layers: {len(modules)} modules, {sum(not i.third_party for m in modules.values() for i in m.imports)} "
          f"torch_armor imports, {len(problems)} violation(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
