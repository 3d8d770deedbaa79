"""docs/moe.md's architecture table is what tools/moe_table.py finds: every mixture-of-experts
causal LM of the installed transformers has a row (a new one shows up as a failure here, not as a
silently dense model), no row reads "silently dense", and (slow) a tiny prune of each gives the
status its row states."""

from __future__ import annotations

from pathlib import Path

import pytest

from _tiny_moe import moe_table_tool

ROOT = Path(__file__).resolve().parents[2]
moe_table = moe_table_tool()
STATED = moe_table.stated((ROOT / "docs" / "moe.md").read_text(encoding="utf-8")) or {}


def test_every_moe_model_type_of_the_installed_transformers_has_a_row():
    found = moe_table.moe_model_types()
    assert "gpt_oss" in found and "mixtral" in found and "dbrx" in found
    missing, extra = sorted(set(found) - set(STATED)), sorted(set(STATED) - set(found))
    assert not missing and not extra, (f"docs/moe.md's table is stale: missing {missing}, no longer shipped {extra}; "
                                       "run python tools/moe_table.py --write")


def test_no_row_reads_silently_dense_and_gpt_oss_dbrx_jetmoe_are_pruned():
    assert STATED, "docs/moe.md has no generated architecture table"
    assert not [t for t, s in STATED.items() if s.startswith("silently dense")]
    assert STATED["gpt_oss"] == STATED["dbrx"] == STATED["jetmoe"] == "pruned"
    kinds = ("pruned", "experts dense (", "refused (", "fails (", "untested (")
    assert all(s.startswith(kinds) for s in STATED.values()), STATED


def test_the_check_sees_an_expert_left_dense_without_a_reason(monkeypatch):
    """The table's own check, not the project's lists: an experts weight left dense with no reason."""
    import torch_armor.engine.plan as plan
    from torch_armor.calibration.selection import prunable_names

    real = plan.dense_weights
    monkeypatch.setattr(plan, "select_layers", lambda model, layers: [
        n for n in prunable_names(model) if ".experts." not in n])
    monkeypatch.setattr(plan, "dense_weights", lambda model, names, prefix, why=None: {
        k: (c, "not selected" if ".experts." in k else w) for k, (c, w) in real(model, names, prefix, why).items()})
    assert moe_table.status("qwen3_moe") == "silently dense"


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(STATED))
def test_a_tiny_prune_gives_the_stated_status(model_type):
    assert moe_table.status(model_type) == STATED[model_type]
