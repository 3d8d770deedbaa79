"""``torch-armor prune`` refuses a flag that does not apply to ``--method`` (exit 2, one line naming
it) before anything is loaded; which flags apply comes from the config types, and a flag that
applies is never dropped: it changes the config."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_armor.cli.commands as cli_commands
from torch_armor.cli.parser import build_parser, main
from torch_armor.cli.flags import METHOD_FLAGS, applies_to, field_exists, flag_field, flags_that_do_not_apply
from torch_armor.engine.methods import METHODS, method_names

ROOT = Path(__file__).resolve().parents[2]
#: a valid value of each method flag that differs from what the method gets without it
VALUES = {"--pattern": "4:8", "--preset": "max", "--block-size": "32", "--max-overhead": "0.1", "--optimizer": "adam",
          "--iters": "5", "--time-budget": "2", "--refine": "none", "--reconstruct-steps": "5", "--distill-steps": "4",
          "--sparsegpt-block-size": "64", "--damp": "0.5"}


def _prune_flags() -> set:
    parser = build_parser()
    prune = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "prune")[1]
    return {s for action in prune._actions for s in action.option_strings if s.startswith("--") and s != "--help"}


def flag_table() -> str:
    """The flag × method table (markdown): ✓ accepted, ✗ refused."""
    methods = method_names()
    lines = ["| flag | sets | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for flag in sorted(_prune_flags()):
        where = METHOD_FLAGS.get(flag, "(run option)")
        ok = applies_to(flag) if flag in METHOD_FLAGS else methods
        lines.append(f"| `{flag}` | {where} | " + " | ".join("✓" if m in ok else "✗" for m in methods) + " |")
    return "\n".join(lines)


def _no_loading(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli_commands, "cmd_prune", fail)
    monkeypatch.setattr(cli_commands, "pruning_source", fail)


def test_iters_with_wanda_is_refused_before_the_model_is_loaded(tmp_path, capsys, monkeypatch):
    _no_loading(monkeypatch)
    out = tmp_path / "X"
    assert main(["prune", "smollm2", "--method", "wanda", "--iters", "5", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == "torch-armor prune: error: --iters does not apply to --method wanda (it applies to: armor)\n"
    assert not out.exists()


def test_the_issue_command_names_every_flag_that_does_not_apply(tmp_path, capsys, monkeypatch):
    _no_loading(monkeypatch)
    argv = ["prune", "smollm2", "--method", "wanda", "--iters", "5", "--damp", "0.5", "--refine", "none",
            "--preset", "max", "--block-size", "32", "--out", str(tmp_path / "X")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    for flag in ("--iters", "--damp", "--refine", "--preset", "--block-size"):
        assert f"{flag} does not apply to --method wanda" in err


def test_every_method_flag_names_a_real_config_field():
    for flag in METHOD_FLAGS:
        kind, path = flag_field(flag)
        assert field_exists(kind, path), f"{flag}: {METHOD_FLAGS[flag]} is no field of {kind.__name__}"


@pytest.mark.parametrize("flag", sorted(VALUES))
def test_a_flag_applies_to_some_methods_and_is_refused_by_the_others(flag, capsys, monkeypatch):
    assert set(VALUES) == set(METHOD_FLAGS)
    assert applies_to(flag), f"{flag} applies to no method"
    _no_loading(monkeypatch)
    parser = build_parser()
    for method in method_names():
        argv = ["prune", "smollm2", "--method", method, flag, VALUES[flag], "--out", "never"]
        refused = flags_that_do_not_apply(parser.parse_args(argv), method)
        if method in applies_to(flag):
            assert refused == []
            # applied, not dropped: the config differs from the one without the flag
            base = parser.parse_args(["prune", "smollm2", "--method", method, "--out", "never"])
            assert cli_commands.method_config(parser.parse_args(argv)) != cli_commands.method_config(base)
        else:
            assert main(argv) == 2
            line = capsys.readouterr().err
            assert line == (f"torch-armor prune: error: {flag} does not apply to --method {method} "
                            f"(it applies to: {', '.join(applies_to(flag))})\n")


def test_run_options_and_defaults_are_refused_by_no_method():
    parser = build_parser()
    for method in method_names():
        args = parser.parse_args(["prune", "smollm2", "--method", method, "--out", "x", "--seed", "3", "--layers",
                                  "0", "--one-shot", "--run-dir", "r"])
        assert flags_that_do_not_apply(args, method) == []  # the parser's defaults are no flags given
    assert set(METHODS) and all(m.name in method_names() for m in METHODS.values())


def test_documented_prune_commands_use_flags_of_their_method():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    parser = build_parser()
    wrong = []
    for page in pages:
        for line in page.read_text(encoding="utf-8").splitlines():
            if "torch-armor prune " not in line:
                continue
            command = line[line.index("torch-armor prune "):].split("`")[0]  # in a code block or inline code
            try:
                args = parser.parse_args(shlex.split(command, comments=True)[1:])
            except (SystemExit, ValueError):
                continue  # placeholders, or flags that do not parse: test_docs' business
            wrong += [f"{page.name}: {w}" for w in flags_that_do_not_apply(args, args.method)]
    assert wrong == []


def test_the_table():
    table = flag_table()
    assert "| `--iters` | ArmorConfig.optimizer.iters | ✗ | ✗ | ✗ | ✗ | ✓ |" in table
    assert "| `--damp` | SparseGPTConfig.damp | ✗ | ✗ | ✓ | ✗ | ✗ |" in table


def _hand_built_armor_config(args):
    """``cli/commands.py armor_config`` as it was before the flags built every config (the reference):
    ARMOR's config assembled by hand from the flags."""
    import dataclasses

    from torch_armor.config.armor import ArmorConfig
    from torch_armor.config.levers import DEFAULT_RECONSTRUCT, DEFAULT_REFINE, OPTIMIZERS, DistillConfig

    base = ArmorConfig.preset(args.preset or "default")
    changes = {"pattern": args.pattern, "seed": args.seed}
    for key in ("block_size", "max_overhead"):
        if getattr(args, key) is not None:
            changes[key] = getattr(args, key)
    if args.optimizer is not None or args.iters is not None or args.time_budget is not None:
        kind = OPTIMIZERS[args.optimizer] if args.optimizer is not None else type(base.optimizer)
        optimizer = base.optimizer if isinstance(base.optimizer, kind) else kind()
        given = {"iters": args.iters, "time_budget_s": args.time_budget}
        changes["optimizer"] = dataclasses.replace(optimizer, **{k: v for k, v in given.items() if v is not None})
    if args.refine is not None:
        changes["refine"] = (base.refine or DEFAULT_REFINE) if args.refine == "output" else None
    if args.reconstruct_steps is not None:
        changes["reconstruct"] = (dataclasses.replace(base.reconstruct or DEFAULT_RECONSTRUCT,
                                                      steps=args.reconstruct_steps)
                                  if args.reconstruct_steps else None)
    if args.distill_steps is not None:
        changes["distill"] = (dataclasses.replace(base.distill or DistillConfig(), steps=args.distill_steps)
                              if args.distill_steps else None)
    return dataclasses.replace(base, **changes)


def _hand_built_config(args):
    """The reference config of ``--method``: ARMOR's by hand, a baseline's from ``--pattern`` (and
    SparseGPT's ``--sparsegpt-block-size``, ``--damp``)."""
    from torch_armor.config.armor import ArmorConfig
    from torch_armor.config.methods import SparseGPTConfig
    from torch_armor.engine.methods import method_named

    kind = method_named(args.method).config_type
    if issubclass(kind, ArmorConfig):
        return _hand_built_armor_config(args)
    fields = {"pattern": args.pattern}
    if issubclass(kind, SparseGPTConfig):
        given = {"block_size": args.sparsegpt_block_size, "damp": args.damp}
        fields.update({k: v for k, v in given.items() if v is not None})
    return kind(**fields)


def _outcome(build, args):
    from torch_armor.errors import ArmorInputError

    try:
        config = build(args)
    except ArmorInputError:
        return "refused"
    return type(config), repr(config)


_FLAG_VALUES = {  # None: not given; values the parser accepts, some of them refused by the configs
    "--pattern": [None, "2:4", "4:8", "unstructured:0.5"], "--preset": [None, "fast", "default", "max"],
    "--block-size": [None, "8", "16", "32", "auto", "budget"], "--max-overhead": [None, "0.02", "0.1"],
    "--optimizer": [None, "bcd", "adam"], "--iters": [None, "1", "5", "0", "-1"], "--time-budget": [None, "2", "0.5"],
    "--refine": [None, "output", "none"], "--reconstruct-steps": [None, "0", "5", "-2"],
    "--distill-steps": [None, "0", "4", "-1"], "--seed": [None, "0", "3"],
    "--sparsegpt-block-size": [None, "64", "128"], "--damp": [None, "0.5", "0.01", "-1"],
}


@settings(max_examples=300, deadline=None)
@given(method=st.one_of(st.just("armor"), st.sampled_from(method_names())),  # ARMOR has most flags
       flags=st.fixed_dictionaries({flag: st.sampled_from(values) for flag, values in _FLAG_VALUES.items()}))
def test_the_flags_give_the_config_the_hand_built_path_gave(method, flags):
    """One generic path (the flag table, its value mappings) builds every method's config: the same
    config, to its repr, as the hand-built path for any combination of flags, or refused by both."""
    argv = ["prune", "smollm2", "--method", method, "--out", "x"]
    for flag, value in flags.items():
        if value is not None:
            argv += [flag, value]
    args = build_parser().parse_args(argv)
    assert _outcome(cli_commands.method_config, args) == _outcome(_hand_built_config, args), argv
