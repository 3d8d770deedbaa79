"""Every docstring example in the package runs and prints what it says."""

import doctest
import importlib
import pkgutil

import pytest

import torch_armor

SKIP = {"torch_armor.cli.parser", "torch_armor.__main__"}
SLOW = {"torch_armor.recipes.assets"}  # its examples load the real model
MODULES = sorted(
    m.name for m in pkgutil.walk_packages(torch_armor.__path__, "torch_armor.") if m.name not in SKIP
) + ["torch_armor"]


@pytest.mark.parametrize(
    "name", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW else m for m in MODULES]
)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
