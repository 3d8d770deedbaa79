"""The demo's run directory: each finished row of the quality table is saved as soon as it is done
(``rows.json`` + ``table.md``), so an interrupted ``torch-armor demo`` resumes where it stopped.

A rerun with the same settings skips the finished rows; ARMOR's finished layers are kept in a
run store per row (``DIR/<row>/``), so an interrupted ARMOR row resumes layer by layer. Rows saved
under other settings are discarded (and said so), never mixed into a table they do not belong to.

Example::

    >>> import tempfile
    >>> from torch_armor.recipes.quality import QualityRow
    >>> runs = DemoRuns(tempfile.mkdtemp(), {"n_eval": 2})
    >>> runs.add(QualityRow("dense", 13.4, label="dense"))
    >>> sorted(DemoRuns(runs.directory, {"n_eval": 2}).finished)
    ['dense']
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from torch_armor._io import atomic_write
from torch_armor.recipes.quality import QualityRow, quality_table

__all__ = ["DemoRuns", "ROWS_JSON", "TABLE_MD"]

ROWS_JSON = "rows.json"
TABLE_MD = "table.md"


class DemoRuns:
    """Finished rows of one demo protocol (``settings``) in ``directory``."""

    def __init__(self, directory: Union[str, Path], settings: Mapping[str, Any],
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.directory = Path(directory)
        self.settings = json.loads(json.dumps(dict(settings), default=str))
        self.rows: List[QualityRow] = []
        path = self.directory / ROWS_JSON
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved.get("settings") == self.settings:
                self.rows = [QualityRow(**row) for row in saved.get("rows", [])]
            elif log is not None:
                log(f"{path} holds rows of other settings: starting over")

    @property
    def finished(self) -> Dict[str, QualityRow]:
        """Finished rows by label."""
        return {row.name: row for row in self.rows}

    def store_for(self, label: str) -> Path:
        """ARMOR's layer store of the row ``label``."""
        return self.directory / re.sub(r"[^A-Za-z0-9_.-]+", "_", label)

    def add(self, row: QualityRow) -> None:
        """Record a finished row: ``rows.json`` and ``table.md`` are rewritten atomically."""
        self.rows = [r for r in self.rows if r.name != row.name] + [row]
        self.directory.mkdir(parents=True, exist_ok=True)
        data = {"settings": self.settings, "rows": [dataclasses.asdict(r) for r in self.rows]}
        atomic_write(self.directory / ROWS_JSON, json.dumps(data, indent=2).encode())
        atomic_write(self.directory / TABLE_MD, (quality_table(self.rows) + "\n").encode())
