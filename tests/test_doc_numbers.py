"""The README's headline numbers cannot drift from the measurements in docs/: its results table is
docs/results.md's quality table, row for row; every "gap closed" is computed from the perplexities
beside it; the introduction states the table's numbers; and every measured number in a sentence that
links to a docs section (``… 42.0% of its bytes on disk ([memory](docs/results.md#memory-…))``) is
stated in that section."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def read(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


def table(text: str, header: str) -> list[list[str]]:
    """The rows (cells stripped of bold) of the one markdown table whose header line is ``header``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == header]
    assert len(starts) == 1, f"{len(starts)} tables have the header {header!r}: update this test with the page"
    rows = []
    for line in lines[starts[0] + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("**", "") for cell in line.strip().strip("|").split("|")])
    return rows


README_RESULTS = "| method | settings | Wikipedia ppl | gap closed vs NoWag-P | overhead | prune time |"
DOCS_RESULTS = ("| method | settings (`--variants`) | ppl | gap closed vs NoWag-P | overhead | rel. proxy loss "
                "| rel. output loss | prune time |")
DOCS_SEQUENTIAL = ("| method | settings | ppl | gap closed vs NoWag-P | overhead | rel. proxy loss | prune time "
                   "| eval time |")


def numbers(text: str) -> list[str]:
    return re.findall(r"-?\d+(?:\.\d+)?", text)


def results_table_disagreements(readme: str, results: str) -> list[str]:
    """Each README row must be a row of results.md's table with the same method: the same perplexity,
    gap and overhead, and a prune time whose every number results.md's time cell states."""
    docs_rows = table(results, DOCS_RESULTS)
    wrong = []
    for method, _settings, ppl, gap, overhead, time in table(readme, README_RESULTS):
        same = [r for r in docs_rows if r[0] == method and (r[2], r[3], r[4]) == (ppl, gap, overhead)]
        if not same:
            wrong.append(f"README's {method!r} row ({ppl}, {gap}, {overhead}) is no row of docs/results.md")
        elif not any(set(numbers(time)) <= set(numbers(r[7])) for r in same):
            wrong.append(f"README's {method!r} prune time {time!r} is not docs/results.md's")
    return wrong


def gap_disagreements(rows: list[list[str]], ppl: int, gap: int) -> list[str]:
    """``gap closed = (ppl(NoWag-P) − ppl) / (ppl(NoWag-P) − ppl(dense))``, to the table's 0.1%: half of
    it for the rounding of the gap and 0.008 for the perplexities' (two decimals each), since a stated gap
    may have been computed from unrounded perplexities."""
    by_method = {r[0]: float(r[ppl]) for r in rows if r[0] in ("dense", "NoWag-P")}
    nowag, dense = by_method["NoWag-P"], by_method["dense"]
    wrong = []
    for r in rows:
        computed = 100 * (nowag - float(r[ppl])) / (nowag - dense)
        if abs(computed - float(r[gap].rstrip("%"))) > 0.058:
            wrong.append(f"{r[0]!r} at ppl {r[ppl]} closes {computed:.1f}% of the gap, not {r[gap]}")
    return wrong


def introduction_disagreements(readme: str) -> list[str]:
    rows = {r[0]: r for r in table(readme, README_RESULTS)}
    intro = " ".join(readme.split("## ", 1)[0].split())
    said = re.search(r"\(([\d.]+%) extra parameters.*default closes ([\d.]+%) of the perplexity gap.*"
                     r"SparseGPT closes ([\d.]+%)", intro)
    assert said, "README's introduction no longer says 'N% extra parameters … default closes N% … SparseGPT closes N%'"
    stated = said.groups()
    table_says = (rows["ARMOR, default"][4], rows["ARMOR, default"][3], rows["SparseGPT"][3])
    return [f"the introduction says {s}, the results table {t}" for s, t in zip(stated, table_says) if s != t]


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections(text: str) -> dict[str, str]:
    """Each heading's anchor -> its text up to the next heading of its level or above (whitespace folded)."""
    lines = text.splitlines()
    heads = [(i, len(m.group(1)), _slug(m.group(2))) for i, line in enumerate(lines)
             if (m := re.match(r"(#+) (.*)", line))]
    found = {}
    for k, (i, level, anchor) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1:] if lv <= level), len(lines))
        found[anchor] = " ".join(" ".join(lines[i + 1:end]).split())
    return found


#: a measured number: one with decimals, or a whole one with a unit; not a count of sweeps or tokens, nor
#: a version (``transformers 5.24``)
MEASURED = re.compile(r"(?<![\w.+-])(\d+\.\d+|\d+(?=\s?(?:%|×| s\b| min\b| minutes\b| GB\b| MB\b| CPU-hours\b"
                      r"| B-parameter)))")


VERSIONED = ("Python", "torch", "torchao", "transformers", "Triton", "CUDA")


def _states(body: str, number: str) -> bool:
    """Whether ``body`` states ``number``: the same whole number, or a decimal that rounds to it."""
    if "." not in number:
        return re.search(rf"(?<![\w.]){number}(?![\d]|\.\d)", body) is not None
    decimals = len(number.split(".")[1])
    return any(abs(round(float(n), decimals) - float(number)) < 1e-9
               for n in re.findall(r"(?<![\w.])\d+\.\d+", body))


def linked_number_disagreements(page: str, text: str) -> list[str]:
    """A sentence's measured numbers before a link to a docs page (``[…](results.md#anchor)``) must be
    stated in that section. Tables and code blocks are not sentences."""
    wrong = []
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.lstrip().startswith(("|", "```")):
            continue
        flat, previous = " ".join(paragraph.split()), 0
        for link in re.finditer(r"\]\(([\w./-]*\.md)(?:#([\w-]+))?\)", flat):
            start = max(previous, flat.rfind(". ", 0, link.start()) + 2)
            sentence = re.sub(r"`[^`]*`", "", flat[start:link.start()])
            previous = link.end()
            target = (ROOT / page).parent / link.group(1)
            if not target.is_file() or target.resolve() == (ROOT / page).resolve():
                continue
            target_text = target.read_text(encoding="utf-8")
            anchor = link.group(2)
            body = sections(target_text).get(anchor) if anchor else " ".join(target_text.split())
            if body is None:
                wrong.append(f"{page}: {link.group(0)} names no section of {link.group(1)}")
                continue
            for number in MEASURED.finditer(sentence):
                if not sentence[:number.start()].rstrip().endswith(VERSIONED) and not _states(body, number[1]):
                    wrong.append(f"{page}: {number[1]} is not in {link.group(1)}#{anchor}: …{sentence[-90:]}")
    return wrong


def test_readme_results_table_is_docs_results_table():
    assert results_table_disagreements(read("README.md"), read("docs/results.md")) == []


@pytest.mark.parametrize("page, header, ppl, gap", [
    ("README.md", README_RESULTS, 2, 3), ("docs/results.md", DOCS_RESULTS, 2, 3),
    ("docs/results.md", DOCS_SEQUENTIAL, 2, 3)])
def test_each_gap_closed_is_computed_from_its_perplexities(page, header, ppl, gap):
    assert gap_disagreements(table(read(page), header), ppl, gap) == []


def test_readme_introduction_states_the_results_tables_numbers():
    assert introduction_disagreements(read("README.md")) == []


@pytest.mark.parametrize("page", PAGES)
def test_numbers_beside_a_link_are_stated_where_it_points(page):
    assert linked_number_disagreements(page, read(page)) == []


def test_the_checks_see_a_changed_number():
    readme, results = read("README.md"), read("docs/results.md")
    assert readme.count("| **34.84** | **82.8%** |") == 1 and readme.count("11.0 min") == 1
    changed = readme.replace("| **34.84** | **82.8%** |", "| **33.84** | **82.8%** |")
    assert results_table_disagreements(changed, results) == ["README's 'ARMOR, default' row (33.84, 82.8%, "
                                                             "4.60%) is no row of docs/results.md"]
    assert gap_disagreements(table(changed, README_RESULTS), 2, 3) == [
        "'ARMOR, default' at ppl 33.84 closes 83.6% of the gap, not 82.8%"]
    assert results_table_disagreements(readme.replace("**14.3 min** (860 s", "**14.3 min** (850 s"), results)
    assert gap_disagreements(table(results.replace("| 32.23 | 84.9% |", "| 32.23 | 84.8% |"), DOCS_RESULTS), 2, 3)
    assert introduction_disagreements(readme.replace("SparseGPT closes 40.0%", "SparseGPT closes 41.0%"))
    assert linked_number_disagreements("README.md", readme.replace("11.0 min", "10.0 min"))[0].startswith(
        "README.md: 10.0 is not in docs/results.md#the-demos-time")


@pytest.mark.parametrize("number, body, states", [
    ("17.3", "13.15 GB = 17.28 GB", True), ("1.17", "1.170 B parameters", True), ("17.3", "17.24 GB", False),
    ("18", "18.4× and 17.7", False), ("18", "about 18 CPU-hours", True), ("44", "first row 44 s", True),
    ("44", "0.44 s and 144 s", False), ("4", "4.60%", False)])
def test_a_number_is_stated_only_by_itself_or_a_decimal_that_rounds_to_it(number, body, states):
    assert _states(body, number) is states
