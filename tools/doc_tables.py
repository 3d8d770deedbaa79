#!/usr/bin/env python3
"""The documentation's tables that state what the code decides, generated from the code.

Each table stands in a page between a begin marker ``<!-- generated: NAME (tools/doc_tables.py) -->``
and ``<!-- end generated: NAME -->``; ``tests/test_doc_tables.py`` regenerates every table and fails
when a page's copy differs (a default or a preset changed in the code but not in the docs, or the
other way round). After changing a default, rewrite the tables:

    python tools/doc_tables.py --write

Tables:

* ``prune options`` (docs/user-guide.md): every option of ``torch-armor prune``, its default and its
  help text, read from the parser itself (what ``torch-armor prune --help`` prints);
* ``presets`` (docs/api.md): every field each ARMOR preset changes, from
  ``torch_armor.config.presets.PRESETS``, a nested config shown with only its fields that differ from
  that config's own defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

ROOT = Path(__file__).resolve().parents[1]


def _markers(name: str) -> Tuple[str, str]:
    return f"<!-- generated: {name} (tools/doc_tables.py) -->", f"<!-- end generated: {name} -->"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def prune_options() -> str:
    """Markdown table of ``torch-armor prune``'s options: option, default, help."""
    from torch_armor.cli.parser import build_parser  # the package: only when a table is built

    parser = build_parser()
    prune = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["prune"]
    rows = ["| option | default | what it does (`torch-armor prune --help`) |", "|---|---|---|"]
    for action in prune._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.metavar or action.dest}`"
        help_text = (action.help or "") % {"default": action.default, "prog": "torch-armor prune"}
        if isinstance(action, argparse._StoreTrueAction):
            default = "off"
        elif action.required or not action.option_strings:
            default = "required"
        elif action.default is not None:
            default = f"`{action.default}`"
        else:  # None: not given keeps the preset's (or the loader's) value, which the help states
            said = re.search(r"\(default:? ([^;)]*)", help_text)
            default = said.group(1) if said else "–"
        if action.choices is not None:
            help_text += " (one of: " + ", ".join(str(c) for c in action.choices) + ")"
        rows.append(f"| {flags} | {default} | {_cell(help_text)} |")
    return "\n".join(rows)


def _short(value: Any) -> str:
    """A config as its type and the fields that differ from that type's defaults; else ``repr``."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return repr(value)
    base = type(value)()
    changed = [f"{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(value)
               if f.init and getattr(value, f.name) != getattr(base, f.name)]
    return f"{type(value).__name__}({', '.join(changed)})"


def presets() -> str:
    """Markdown table of every ARMOR preset's changes of ``ArmorConfig()``."""
    from torch_armor.config.presets import PRESETS  # the package: only when a table is built

    rows = ["| preset | `ArmorConfig` field | value |", "|---|---|---|"]
    for name, changes in PRESETS.items():
        if not changes:
            rows.append(f"| `{name}` | (none: `ArmorConfig()`) | |")
        for field, value in changes.items():
            rows.append(f"| `{name}` | `{field}` | `{_short(value)}` |")
    return "\n".join(rows)


#: table name -> (the page that holds it, the function that builds it)
TABLES: Dict[str, Tuple[str, Callable[[], str]]] = {
    "prune options": ("docs/user-guide.md", prune_options),
    "presets": ("docs/api.md", presets),
}


def stated(text: str, name: str) -> str:
    """The table ``name`` as a page states it (between its markers); a missing marker is an error."""
    begin, end = _markers(name)
    match = _block(text, begin, end)
    if match is None:
        raise ValueError(f"no '{begin}' ... '{end}' block; add the markers where the table belongs")
    return match.group(1).strip("\n")


def _block(text: str, begin: str, end: str):
    return re.search(re.escape(begin) + r"\n(.*?)" + re.escape(end), text, re.S)


def rewrite(text: str, name: str, table: str) -> str:
    """``text`` with the table ``name`` replaced by ``table``."""
    begin, end = _markers(name)
    stated(text, name)  # the markers are there
    match = _block(text, begin, end)
    return text[:match.start()] + f"{begin}\n{table}\n{end}" + text[match.end():]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the tables in the pages (default: check)")
    args = parser.parse_args(argv)
    stale = []
    for name, (page, build) in TABLES.items():
        path = ROOT / page
        text = path.read_text(encoding="utf-8")
        table = build()
        if stated(text, name) != table:
            stale.append(f"{page}: {name}")
            if args.write:
                path.write_text(rewrite(text, name, table), encoding="utf-8")
    verb = "rewritten" if args.write else "out of date (python tools/doc_tables.py --write)"
    for line in stale:
        print(f"{line}: {verb}")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
