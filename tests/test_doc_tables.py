"""The docs cannot drift from the code on defaults and presets: the generated tables
(tools/doc_tables.py: ``prune``'s options from its parser, the presets from PRESETS) match what the
pages hold, and every count of sweeps, reconstruction steps or distillation steps stated for a preset
in prose (README, user guide, the presets module) is the preset's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from torch_armor import ArmorConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import doc_tables  # noqa: E402


@pytest.mark.parametrize("name", sorted(doc_tables.TABLES))
def test_generated_tables_match_the_code(name):
    page, build = doc_tables.TABLES[name]
    stated = doc_tables.stated((ROOT / page).read_text(encoding="utf-8"), name)
    assert stated == build(), f"{page}: the {name} table is out of date: run python tools/doc_tables.py --write"


def test_the_check_sees_a_changed_default():
    """The user guide once said --reconstruct-steps defaults to 32 while --help said 64."""
    page, build = doc_tables.TABLES["prune options"]
    text = (ROOT / page).read_text(encoding="utf-8")
    table = doc_tables.stated(text, "prune options")
    row = next(line for line in table.splitlines() if line.startswith("| `--reconstruct-steps`"))
    stale = doc_tables.rewrite(text, "prune options", table.replace(row, row.replace("| 64 |", "| 32 |")))
    assert doc_tables.stated(stale, "prune options") != build()
    assert doc_tables.stated(doc_tables.rewrite(stale, "prune options", build()), "prune options") == build()
    with pytest.raises(ValueError, match="add the markers"):
        doc_tables.stated("no table here", "prune options")


def test_the_presets_table_names_max_distillation_steps():
    """api.md once said max distils 48 steps while PRESETS says 96."""
    table = doc_tables.presets()
    steps = ArmorConfig.preset("max").distill.steps
    assert re.search(rf"\| `max` \| `distill` \| `DistillConfig\(steps={steps},", table), table


#: a preset's numbers as prose states them: (pattern with one number, the config's value)
_STATED = [
    (r"(\d+) sweeps", lambda c: c.optimizer.iters),
    (r"(\d+) reconstruction steps|reconstruction (\d+) steps", lambda c: c.reconstruct.steps),
    (r"(\d+) distillation steps|distillation (\d+) steps", lambda c: c.distill.steps),
]


def stated_numbers(text: str, preset: str) -> list:
    """``(what was stated, the preset's value)`` for every number the prose ``text`` gives for it."""
    config = ArmorConfig.preset(preset)
    found = []
    for pattern, value in _STATED:
        for match in re.finditer(pattern, text):
            number = int(next(g for g in match.groups() if g is not None))
            found.append((match.group(0), number, value(config)))
    return found


def _rows(page: str, starts: str) -> list:
    return [line for line in (ROOT / page).read_text(encoding="utf-8").splitlines() if line.startswith(starts)]


@pytest.mark.parametrize("page, starts, preset", [
    ("docs/user-guide.md", "| `fast` |", "fast"),
    ("docs/user-guide.md", "| `default` |", "default"),
    ("docs/user-guide.md", "| `max` |", "max"),
    ("README.md", "| **ARMOR, default** |", "default"),
    ("README.md", "| **ARMOR, `max` preset** |", "max"),
])
def test_prose_states_each_presets_numbers(page, starts, preset):
    rows = _rows(page, starts)
    assert len(rows) == 1, f"{page}: no single row starting {starts!r}: update this test with the page"
    settings = rows[0].split("|")[2]  # the settings cell: not the measured numbers beside it
    found = stated_numbers(settings, preset)
    assert found, f"{page}: the {preset} row states no sweeps or steps"
    assert [f for f in found if f[1] != f[2]] == [], f"{page}: {preset} row disagrees with the code"


def test_the_presets_module_states_its_own_numbers():
    from torch_armor.config import presets

    doc = presets.__doc__
    for preset in ("fast", "default", "max"):
        bullet = re.search(rf'\* ``"{preset}"``:(.*?)(?=\n\* |\Z)', doc, re.S).group(1)
        found = stated_numbers(" ".join(bullet.split()).replace("exact sweeps", "sweeps"), preset)
        assert found and [f for f in found if f[1] != f[2]] == [], (preset, found)


def test_the_prose_check_sees_a_wrong_number():
    assert stated_numbers("bcd 20 sweeps, 512 reconstruction steps, 48 distillation steps", "max")[-1][1:] == (48, 96)


@pytest.mark.parametrize("page", ["README.md", "docs/user-guide.md"])
def test_the_quick_demo_is_described_as_it_runs(page):
    """The user guide once said the quick demo runs ARMOR with 10 sweeps and 32 reconstruction steps
    after they became 8 and 24."""
    from torch_armor.cli.names import QUICK_PROTOCOL

    text = " ".join((ROOT / page).read_text(encoding="utf-8").split())
    said = re.search(r"(\d+) \+ (\d+) windows[^)]*?ARMOR with (\d+) sweeps, (\d+) reconstruction and (\d+) "
                     r"distillation steps", text)
    assert said, f"{page}: no 'N + N windows … ARMOR with N sweeps, N reconstruction and N distillation steps'"
    assert tuple(int(g) for g in said.groups()) == tuple(QUICK_PROTOCOL[k] for k in (
        "n_calib", "n_eval", "iters", "reconstruct_steps", "distill_steps")), (page, said.group(0))
