"""Block reconstruction: the kept factors' error recomputed independently, masks fixed, resume exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import make_tiny_llama
from torch_armor import ArmorConfig, BcdConfig, prune_model, PruneOptions, ReconstructConfig, RefineConfig
from torch_armor.calibration.blocks import block_statistics, capture_block_inputs, run_block
from torch_armor.engine.reconstruct import reconstruct_block
from torch_armor.engine.runner import solve_layer

pytestmark = pytest.mark.usefixtures("one_thread")
CALIB = torch.randint(0, 128, (16, 64), generator=torch.Generator().manual_seed(3))
CFG = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=RefineConfig(rounds=1))


def _block_problem():
    model = make_tiny_llama()
    block = model.model.layers[0]
    inputs = capture_block_inputs(model, block, list(CALIB.split(4)))
    layers = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    stats = block_statistics(block, layers, inputs, device=torch.device("cpu"), track_xtx=True)
    factors = {n: solve_layer(m.weight, stats[n], CFG, n).factors for n, m in layers.items()}
    targets = [run_block(block, inp, torch.device("cpu")) for inp in inputs]
    return block, layers, inputs, targets, factors


def _held_rows(inputs, count=4, seed=0):
    """The held-out windows, drawn as documented: the first ``count`` of a seeded permutation."""
    windows = [(j, r) for j, inp in enumerate(inputs) for r in range(inp.hidden.shape[0])]
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [windows[i] for i in order[:count]]


def _held_out_error(block, layers, factors, inputs, targets, held) -> float:
    """The block run the plain way on whole batches, each weight replaced by the factors' dense
    product; the error summed over the held-out rows."""
    saved = {n: m.weight for n, m in layers.items()}
    err = den = 0.0
    try:
        for n, m in layers.items():
            m.weight = nn.Parameter(factors[n].dense().clone())
        for j, r in held:
            out = run_block(block, inputs[j], torch.device("cpu"))[r]
            err += float((out - targets[j][r]).square().sum())
            den += float(targets[j][r].square().sum())
    finally:
        for n, m in layers.items():
            m.weight = saved[n]
    return err / den


def test_reconstruction_lowers_the_block_error_with_masks_fixed():
    block, layers, inputs, targets, factors = _block_problem()
    r = reconstruct_block(block, factors, inputs, targets, ReconstructConfig(steps=30, lr=1e-3, held_out=4))
    new, before, after = r.factors, r.before, r.after
    # the 4 held-out windows of 16 (seed 0) are whole rows of some batches: recompute their error
    held = _held_rows(inputs)
    assert before == pytest.approx(_held_out_error(block, layers, factors, inputs, targets, held), rel=1e-4)
    assert after == pytest.approx(_held_out_error(block, layers, new, inputs, targets, held), rel=1e-4)
    assert after < 0.99 * before
    for n, f in new.items():
        assert torch.equal(f.mask, factors[n].mask)
        assert not f.core[~f.mask].any()
    # the block itself still holds its dense weights
    assert all(type(m.weight) is nn.Parameter for m in layers.values())


def test_no_step_that_helps_returns_the_input_factors():
    block, _, inputs, targets, factors = _block_problem()
    r = reconstruct_block(block, factors, inputs, targets, ReconstructConfig(steps=3, lr=50.0))
    new, before, after = r.factors, r.before, r.after
    if after == before:
        for n in factors:
            assert torch.equal(new[n].core, factors[n].core) and torch.equal(new[n].a_blocks, factors[n].a_blocks)
    assert after <= before


def test_prune_model_reconstructs_each_block_and_resumes_exactly(tmp_path):
    cfg = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=RefineConfig(rounds=1), reconstruct=ReconstructConfig(steps=6))
    full = make_tiny_llama()
    report = prune_model(full, CALIB[:8], cfg, options=PruneOptions(run_dir=tmp_path / "run", progress=False, batch_size=2))
    assert sorted(report.block_errors) == [0, 1]
    assert all(after <= before for before, after in report.block_errors.values())
    # the hidden states are gone: every block is recomputed from the store, none reconstructed twice
    (tmp_path / "run" / "hidden.safetensors").unlink()
    again = make_tiny_llama()
    report2 = prune_model(again, CALIB[:8], cfg, options=PruneOptions(run_dir=tmp_path / "run", progress=False, batch_size=2))
    assert report2.block_errors == report.block_errors
    for (n, p), (_, q) in zip(full.named_parameters(), again.named_parameters()):
        a = p.dense_weight() if hasattr(p, "dense_weight") else p
        b = q.dense_weight() if hasattr(q, "dense_weight") else q
        assert torch.equal(a.detach(), b.detach()), n
