"""Plan, then execute: ``plan_prune`` makes every decision and check of a prune and changes nothing;
``prune_model`` then does what the plan says (its report holds the plan's decisions)."""

import warnings

import pytest
import torch

from torch_armor.config.methods import WandaConfig
from torch_armor.engine.plan import plan_prune
from torch_armor.engine.options import RUN_DIR_NAME
from torch_armor.engine.prune import PruneOptions, execute, prune_model
from torch_armor.errors import ArmorInputError

from _helpers import FIT_CALIB, fit_config, fit_llama

CALIB, CONFIG = FIT_CALIB, fit_config()


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_plan_changes_nothing_and_the_prune_does_what_it_says(tmp_path):
    model = fit_llama()
    before = _state(model)
    out = tmp_path / "out"
    with warnings.catch_warnings(record=True) as planned:
        warnings.simplefilter("always")
        plan = plan_prune(model, CALIB, CONFIG, options=PruneOptions(progress=False, out=out))
    after = _state(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not out.exists()  # nothing written, nothing locked
    assert all(type(m.weight) is torch.nn.Parameter for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert plan.method.name == "armor" and plan.device == torch.device("cpu") and plan.storage == "dense"
    assert plan.paths.run_dir == out / RUN_DIR_NAME and plan.paths.temporary_run_dir and not plan.paths.resuming
    left_dense = sorted(n.split(".", 3)[3] for n in plan.unfit if n not in plan.names)
    assert left_dense == sorted(["self_attn.k_proj", "self_attn.v_proj"] * 2)

    with warnings.catch_warnings(record=True) as executed:
        warnings.simplefilter("always")
        report = execute(plan)
    assert [r.name for r in report.layers] == list(plan.names)
    assert report.unfit_layers == dict(plan.unfit) and report.dense_weights == dict(plan.dense_weights)
    # what the plan decided was said while planning, not again while executing
    said = [str(w.message) for w in planned if "settings do not fit" in str(w.message)]
    assert len(said) == 1 and not [w for w in executed if "settings do not fit" in str(w.message)]
    assert (out / "config.json").is_file()


def test_prune_model_is_the_plan_executed():
    """The same decisions and the same weights as executing the plan by hand."""
    first, second = fit_llama(), fit_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = prune_model(first, CALIB, CONFIG, options=PruneOptions(progress=False))
        by_hand = execute(plan_prune(second, CALIB, CONFIG, options=PruneOptions(progress=False)))
    assert [r.name for r in report.layers] == [r.name for r in by_hand.layers]
    for name, module in first.named_modules():
        if isinstance(module, torch.nn.Linear):
            other = second.get_submodule(name).weight
            assert type(module.weight) is type(other)
            assert torch.equal(torch.nn.functional.linear(torch.eye(module.in_features), module.weight),
                               torch.nn.functional.linear(torch.eye(module.in_features), other)), name


def test_a_plan_without_out_keeps_no_run_directory_and_refuses_what_the_prune_refuses():
    plan = plan_prune(fit_llama(), CALIB, WandaConfig(), options=PruneOptions(progress=False))
    assert plan.method.name == "wanda" and plan.paths.run_dir is None and plan.paths.out is None and not plan.unfit
    with pytest.raises(ArmorInputError, match="options must be a PruneOptions"):
        plan_prune(fit_llama(), CALIB, CONFIG, options="not options")
    with pytest.raises(ArmorInputError, match="streams it block by block and needs"):
        plan_prune("some/checkpoint", CALIB, CONFIG, options=PruneOptions(progress=False))
