"""Calibration token ids checked: integer dtype, 0 <= id < vocab size, the first bad value named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_tiny_llama
from torch_armor import PruneOptions, WandaConfig, prune_model
from torch_armor.calibration.validate import check_token_ids, vocab_size_of


@pytest.mark.parametrize("dtype", [torch.bool, torch.float16, torch.float32, torch.bfloat16, torch.complex64])
def test_non_integer_ids_are_refused(dtype):
    with pytest.raises(ValueError, match=str(dtype)):
        check_token_ids([torch.zeros(2, 4, dtype=dtype)], 10)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_integer_ids_in_range_pass(dtype):
    check_token_ids([torch.arange(8, dtype=dtype).reshape(2, 4)], 8)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-5, 20), min_size=1, max_size=24), st.integers(1, 16))
def test_the_first_out_of_range_id_is_named(values, vocab):
    ids = torch.tensor(values).reshape(1, -1)
    bad = [(j, v) for j, v in enumerate(values) if not 0 <= v < vocab]  # brute force, row-major order
    if not bad:
        check_token_ids([ids], vocab)
        return
    with pytest.raises(ValueError) as info:
        check_token_ids([ids], vocab)
    j, v = bad[0]
    assert f"token id {v} (batch 0, row 0, position {j})" in str(info.value)
    assert f"[0, {vocab})" in str(info.value)


def test_prune_model_checks_ids_against_the_embedding_before_pruning():
    model = make_tiny_llama(vocab=50)
    assert vocab_size_of(model) == 50
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    for calib in (torch.full((2, 8), 50), torch.full((2, 8), -1), torch.ones(2, 8, dtype=torch.bool),
                  [torch.zeros(1, 8, dtype=torch.long), torch.full((1, 8), 77)],
                  {"input_ids": torch.full((2, 8), 99), "attention_mask": torch.ones(2, 8)}):
        with pytest.raises(ValueError, match="calibration"):
            prune_model(model, calib, WandaConfig(), options=PruneOptions(progress=False))
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())
