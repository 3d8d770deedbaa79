"""The documentation: every relative link in README.md and docs/*.md resolves (file and #anchor),
no page is orphaned, no user-facing text speaks in issue numbers, and the README's quick start runs
— its Python blocks as written, its command lines on a tiny model directory."""

from __future__ import annotations

import ast
import math
import re
import shlex
import warnings
from pathlib import Path
from urllib.parse import unquote

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//")


# ---------------------------------------------------------------- markdown helpers


def prose_lines(text: str):
    """``(line number, line)`` of the lines outside fenced code blocks, inline code spans blanked."""
    in_code = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            yield number, re.sub(r"`[^`]*`", lambda m: " " * len(m.group()), line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set:
    """Every heading anchor of a markdown file, repeated headings numbered as GitHub does."""
    seen: dict = {}
    found = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            in_code = not in_code
            continue
        match = None if in_code else _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path):
    """``(line number, target)`` of every link and image in the prose that is not a URL."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(line):
            target = match.group(1)
            if not _SCHEME.match(target):
                yield number, target


def broken_links(path: Path, root: Path = ROOT) -> list:
    """One message per relative link of ``path`` whose file or #anchor does not exist."""
    problems = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path.resolve()
        where = f"{path.relative_to(root)}:{number}: ({target})"
        if not resolved.exists():
            problems.append(f"{where} {file_part!r} does not exist")
        elif root.resolve() not in (resolved, *resolved.parents):
            problems.append(f"{where} points outside the repository")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            problems.append(f"{where} no heading with anchor #{anchor} in {resolved.name}")
    return problems


def section(text: str, heading: str) -> str:
    """The text under the first heading named ``heading``, up to the next heading of its level or higher."""
    lines = text.splitlines()
    in_code = False
    start = level = None
    for i, line in enumerate(lines):
        if _FENCE.match(line):
            in_code = not in_code
            continue
        match = None if in_code else _HEADING.match(line)
        if not match:
            continue
        if start is None and match.group(2) == heading:
            start, level = i + 1, len(match.group(1))
        elif start is not None and len(match.group(1)) <= level:
            return "\n".join(lines[start:i])
    if start is None:
        raise AssertionError(f"no heading {heading!r}")
    return "\n".join(lines[start:])


def code_blocks(text: str, language: str) -> list:
    """The fenced code blocks of ``language``, in order."""
    return [m.group(1) for m in re.finditer(rf"^```{language}[ \t]*\n(.*?)^```", text, re.S | re.M)]


# ---------------------------------------------------------------- links


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in relative_links(README)}
    orphans = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert orphans == []


def test_link_checker_finds_missing_files_and_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## `torch.compile` and int8\n\n## Repeat\n\n## Repeat\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title: one, two\n\n"
        "[ok](docs/other.md) [ok](docs/other.md#torchcompile-and-int8) [ok](docs/other.md#repeat-1)\n"
        "[ok](#title-one-two) [url](https://example.org/x.md) ![img](docs/other.md)\n"
        "`[in code](missing.md)`\n```\n[in a block](missing.md)\n```\n"
        "[gone](docs/missing.md) [bad anchor](docs/other.md#nowhere) [bad self](#nope) [up](../x.md)\n"
    )
    (tmp_path.parent / "x.md").write_text("outside")
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": (")[1].split(")")[0] for p in problems] == [
        "docs/missing.md", "docs/other.md#nowhere", "#nope", "../x.md"
    ]


@pytest.mark.parametrize(
    "heading, expected",
    [
        ("`torch.compile` and int8 cores", "torchcompile-and-int8-cores"),
        ("Pruning from Python: `prune_model`", "pruning-from-python-prune_model"),
        ("The default and its levers: output-space refinement, block reconstruction, one budget",
         "the-default-and-its-levers-output-space-refinement-block-reconstruction-one-budget"),
        ("Quality on SmolLM2-135M", "quality-on-smollm2-135m"),
        ("ARMOR's nested configs", "armors-nested-configs"),
    ],
)
def test_slug_matches_githubs_anchors(heading, expected):
    assert slug(heading) == expected


# ---------------------------------------------------------------- shape of the text


def test_readme_is_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_numbers_in_user_facing_text(page):
    hits = [f"{page.name}:{n}: {line.strip()}" for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
            if re.search(r"\bissues?\s*#?\d|#\d+\b", line, re.I)]
    assert hits == []


# ---------------------------------------------------------------- the quick start runs


def quick_start() -> str:
    return section(README.read_text(encoding="utf-8"), "Quick start")


def test_quick_start_python_blocks_run(tmp_path, monkeypatch, one_thread):
    """The Python blocks of the quick start, exactly as written, each alone in a fresh namespace, in
    a fresh directory; then what their comments promise."""
    from torch_armor import ArmorTensor

    blocks = code_blocks(section(quick_start(), "Python"), "python")
    assert len(blocks) == 3, "the quick start's Python blocks changed: update the checks below"
    monkeypatch.chdir(tmp_path)

    def decoder_weights(model):
        return [m.weight for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}"]

    warned = []

    def run(i):
        namespace: dict = {"__name__": "__quick_start__"}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(compile(blocks[i], f"README.md quick start block {i + 1}", "exec"), namespace)
        warned.extend(caught)
        return namespace

    namespace = run(0)
    model, reloaded = namespace["model"], namespace["reloaded"]
    assert decoder_weights(model) and all(isinstance(w, ArmorTensor) for w in decoder_weights(model))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)  # "bit-identical"
    assert 0 < namespace["report"].overhead < 1

    assert "sparsegpt" in run(1)["report"].method.lower()

    loaded = run(2)["model"]
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert all(isinstance(w, ArmorTensor) for w in decoder_weights(loaded))
    assert (tmp_path / "runs" / "tiny-hf" / "config.json").exists()
    # the quick start shows the current API: no deprecated call form warns from its lines
    deprecated = [f"{w.filename}:{w.lineno}: {w.message}" for w in warned
                  if issubclass(w.category, DeprecationWarning) and w.filename.startswith("README.md")]
    assert deprecated == []


def _readme_python_blocks() -> list:
    return code_blocks(README.read_text(encoding="utf-8"), "python")


@pytest.mark.parametrize("index", range(len(_readme_python_blocks())), ids=lambda i: f"block{i + 1}")
def test_every_readme_python_block_runs_alone_in_a_fresh_process(index, tmp_path):
    """What a reader does: paste one block into a new Python. It runs without the others (no
    NameError) and prints no import noise (torchao's, pytree's: ``torch_armor`` is imported first).
    About 10 s a block."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _readme_python_blocks()[index]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    noise = [line for line in proc.stderr.splitlines() if re.search(r"torchao|pytree|Warning", line)]
    assert noise == [], proc.stderr[-3000:]


@pytest.fixture
def tiny_model_dir(tmp_path, smollm2_tokenizer):
    """A random tiny Llama with SmolLM2's vocabulary, saved as a plain Hugging Face directory."""
    from conftest import make_tiny_llama

    folder = tmp_path / "tiny-model"
    make_tiny_llama(vocab=len(smollm2_tokenizer)).save_pretrained(str(folder))
    smollm2_tokenizer.save_pretrained(str(folder))
    return folder


def test_quick_start_command_lines_run(tmp_path, monkeypatch, capsys, tiny_model_dir, one_thread):
    """Every ``torch-armor`` line of the quick start, through the console script's ``main``, in a
    fresh directory, with two changes: the model to prune is a tiny random Llama directory (the real
    ``smollm2`` takes ~10 minutes to prune, a local checkpoint does not exist here), and a few
    small-run flags are appended (2 windows of 32 tokens of this README as calibration and
    evaluation text, 2 ARMOR sweeps, no progress bars). Output paths and everything else stay as
    written, so ``eval`` reads what ``prune`` wrote."""
    from torch_armor.cli.parser import main

    text = tmp_path / "text.txt"
    text.write_text(README.read_text(encoding="utf-8"), encoding="utf-8")
    commands = [shlex.split(line, comments=True) for block in code_blocks(section(quick_start(), "Command line"), "bash")
                for line in block.splitlines() if line.strip().startswith("torch-armor")]
    assert [c[1] for c in commands] == ["prune", "eval", "prune"], "the quick start's commands changed"
    monkeypatch.chdir(tmp_path)
    small = ["--seq-len", "32", "--no-progress", "--threads", "1"]
    for command in commands:
        argv = command[1:]
        if argv[0] == "prune":
            argv[1] = str(tiny_model_dir)
            method = argv[argv.index("--method") + 1] if "--method" in argv else "armor"
            argv += ["--calib", str(text), "--n-calib", "2", *small] + (["--iters", "2"] if method == "armor" else [])
            assert main(argv) == 0, command
            out = Path(argv[argv.index("--out") + 1])
            assert (out / "armor_config.json").exists() and (out / "prune_report.json").exists()
        else:
            capsys.readouterr()
            assert main(argv + ["--data", str(text), "--n-eval", "2", *small]) == 0, command
            match = re.search(r"^perplexity: (\S+)", capsys.readouterr().out, re.M)
            assert match and math.isfinite(float(match.group(1))), command


# ---------------------------------------------------------------- the docs' code names the real API


def python_blocks(page: Path) -> list:
    return code_blocks(page.read_text(encoding="utf-8"), "python")


def test_every_documented_import_exists():
    """Every ``from torch_armor… import name`` in a Python block of the README or docs/ imports."""
    import importlib

    missing = []
    for page in PAGES:
        for block in python_blocks(page):
            try:
                tree = ast.parse(block)
            except SyntaxError:  # signatures in the API reference, not code
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch_armor":
                    module = importlib.import_module(node.module)
                    missing += [f"{page.name}: {node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
    assert missing == []


def test_api_reference_shows_every_field_with_its_real_default():
    """Each constructor shown in docs/api.md with keyword defaults (``BcdConfig(iters=30, …)``) lists
    exactly the dataclass's fields, each with the default the code has."""
    import dataclasses

    import torch_armor
    import torch_armor.config.armor as configs  # ARMOR's nested configs live there, not at the top level

    namespace = {"torch": torch, **{n: getattr(configs, n) for n in configs.__all__},
                 **{n: getattr(torch_armor, n) for n in torch_armor.__all__}}
    checked = set()
    for block in python_blocks(ROOT / "docs" / "api.md"):
        try:
            tree = ast.parse(block)
        except SyntaxError:  # a signature with ``*`` or ``->``: not a call
            continue
        for statement in tree.body:
            call = statement.value if isinstance(statement, ast.Expr) else None
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.keywords):
                continue
            cls = namespace[call.func.id]
            documented = {kw.arg: eval(compile(ast.Expression(kw.value), "api.md", "eval"), namespace)
                          for kw in call.keywords}
            actual = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                      for f in dataclasses.fields(cls) if f.init}
            assert documented == actual, call.func.id
            checked.add(call.func.id)
    assert checked == {"PruneOptions", "ArmorConfig", "SparseGPTConfig", "WandaConfig", "NoWagConfig",
                       "MagnitudeConfig", "BcdConfig", "AdamConfig", "RefineConfig", "ReconstructConfig",
                       "DistillConfig"}


def test_user_guide_config_examples_build():
    """The user guide's block of method configs builds every config it shows (validated on construction)."""
    guide = (ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8")
    blocks = code_blocks(section(guide, "Choosing a method and its settings"), "python")
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "docs/user-guide.md configs", "exec"), namespace)


def cli_flags(capsys) -> dict:
    """``{subcommand: its --flags}``, read from ``torch-armor SUBCOMMAND --help``."""
    from torch_armor.cli.parser import main

    flags = {}
    for command in ("prune", "eval", "demo"):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            main([command, "--help"])
        flags[command] = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", capsys.readouterr().out))
    return flags


def test_documented_command_lines_use_real_flags(capsys):
    """Every ``--flag`` of a ``torch-armor`` line in the README or docs/ exists for its subcommand, and
    every flag in the user guide's option table exists for some subcommand."""
    flags = cli_flags(capsys)
    unknown = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in code_blocks(text, "bash"):
            for line in block.splitlines():
                words = shlex.split(line, comments=True)
                if "torch-armor" in words or "torch_armor" in words:
                    start = words.index("torch-armor" if "torch-armor" in words else "torch_armor") + 1
                    command = words[start]
                    unknown += [f"{page.name}: {command} {w}" for w in words[start:]
                                if w.startswith("--") and w not in flags[command]]
    table = section((ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8"), "Command line")
    every = set().union(*flags.values())
    for row in (line for line in table.splitlines() if line.startswith("| `--")):
        unknown += [f"user-guide.md table: {f}" for f in re.findall(r"--[a-z][a-z0-9-]*", row.split("|")[1])
                    if f not in every]
    assert unknown == []
