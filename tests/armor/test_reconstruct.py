"""Block reconstruction: the kept factors' error recomputed independently, masks fixed, resume exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import make_tiny_llama
from torch_armor import ArmorConfig, prune_model, PruneOptions
from torch_armor.config.armor import BcdConfig, ReconstructConfig, RefineConfig
from torch_armor.calibration.blocks import BlockInput, block_statistics, capture_block_inputs, run_block
from torch_armor.armor.reconstruct import reconstruct_block
from torch_armor.core.factorize import factorize
from torch_armor.armor.reconstruct_weights import (FactoredLinears, FactorLeaves, build_weights, kept_index,
                                                   scatter_core, weight_names)
from torch_armor.engine.runner import solve_layer
from torch_armor.errors import ArmorInputError

pytestmark = pytest.mark.usefixtures("one_thread")
CALIB = torch.randint(0, 128, (16, 64), generator=torch.Generator().manual_seed(3))
CFG = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=RefineConfig(rounds=1))


def _block_problem():
    model = make_tiny_llama()
    block = model.model.layers[0]
    inputs = capture_block_inputs(model, block, list(CALIB.split(4)))
    layers = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    stats = block_statistics(block, layers, inputs, device=torch.device("cpu"), track_xtx=True)
    factors = {n: solve_layer(m.weight, stats[n], CFG, n).payload for n, m in layers.items()}
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
    assert sorted(report.stages["reconstruction"]["errors"]) == [0, 1]
    assert all(after <= before for before, after in report.stages["reconstruction"]["errors"].values())
    # the hidden states are gone: every block is recomputed from the store, none reconstructed twice
    (tmp_path / "run" / "hidden.safetensors").unlink()
    again = make_tiny_llama()
    report2 = prune_model(again, CALIB[:8], cfg, options=PruneOptions(run_dir=tmp_path / "run", progress=False, batch_size=2))
    assert report2.stages["reconstruction"]["errors"] == report.stages["reconstruction"]["errors"]
    for (n, p), (_, q) in zip(full.named_parameters(), again.named_parameters()):
        a = p.dense_weight() if hasattr(p, "dense_weight") else p
        b = q.dense_weight() if hasattr(q, "dense_weight") else q
        assert torch.equal(a.detach(), b.detach()), n


def test_xtx_leaves_memory_for_reconstruction_and_comes_back_bit_identical(tmp_path, monkeypatch):
    """With a run directory, each block's ``XᵀX`` waits on disk while the block is reconstructed
    and the file is gone afterwards; the report's output losses (which read it back) equal those
    of a run without a run directory, where nothing moves."""
    import torch_armor.armor.method as engine_blocks

    cfg = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=RefineConfig(rounds=1),
                      reconstruct=ReconstructConfig(steps=4), distill=None)
    seen = []
    real = engine_blocks.reconstruct_block

    def spy(*args, **kwargs):  # the real reconstruction, after looking at the file and the statistics
        seen.append(sorted(p.name for p in (tmp_path / "run").iterdir()))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_blocks, "reconstruct_block", spy)
    on_disk = prune_model(make_tiny_llama(), CALIB[:8], cfg,
                          options=PruneOptions(run_dir=tmp_path / "run", progress=False, batch_size=2))
    assert len(seen) == 2 and all(engine_blocks.XTX_OFFLOAD_NAME in names for names in seen)
    assert not (tmp_path / "run" / engine_blocks.XTX_OFFLOAD_NAME).exists()
    in_memory = prune_model(make_tiny_llama(), CALIB[:8], cfg, options=PruneOptions(progress=False, batch_size=2))
    losses = [(r.name, r.relative_output_loss) for r in on_disk.layers]
    assert losses == [(r.name, r.relative_output_loss) for r in in_memory.layers]
    assert all(loss is not None and loss > 0 for _, loss in losses)


def test_the_kept_iterate_is_the_best_checked_one_and_never_worse():
    block, _, inputs, targets, factors = _block_problem()
    r = reconstruct_block(block, factors, inputs, targets, ReconstructConfig(steps=12, lr=2e-2, checks=6))
    assert r.curve[0] == (0, r.before) and len(r.curve) == 7 and r.steps == 12
    assert r.after == min(e for _, e in r.curve) <= r.before
    assert [s for s, _ in r.curve] == [0, 2, 4, 6, 8, 10, 12]


def test_same_seed_same_bits_and_views_do_not_change_them():
    block, _, inputs, targets, factors = _block_problem()
    cfg = ReconstructConfig(steps=6, micro_batch=1, held_out=3)
    first = reconstruct_block(block, factors, inputs, targets, cfg, seed=5)
    views = {n: dataclasses.replace(f, core=f.core.t().contiguous().t()) for n, f in factors.items()}
    again = reconstruct_block(block, views, inputs, targets, cfg, seed=5)
    assert first.curve == again.curve
    for n in factors:
        for key in ("a_blocks", "core", "b_blocks"):
            assert torch.equal(getattr(first.factors[n], key), getattr(again.factors[n], key)), (n, key)


def test_split_stages_and_early_stop():
    block, _, inputs, targets, factors = _block_problem()
    r = reconstruct_block(block, factors, inputs, targets, ReconstructConfig(steps=8, split_stages=True, checks=2))
    assert r.steps == 8 and r.after <= r.before and len(r.curve) == 5
    for n, f in r.factors.items():
        assert torch.equal(f.mask, factors[n].mask) and not f.core[~f.mask].any()
    # a step size that only hurts: every check is worse, patience 1 stops after the first check
    bad = reconstruct_block(block, factors, inputs, targets, ReconstructConfig(steps=12, lr=50.0, checks=6, patience=1))
    assert bad.steps == 2 and bad.after == bad.before
    assert all(torch.equal(bad.factors[n].core, factors[n].core) for n in factors)


def test_building_w_hat_keeps_no_weight_sized_tensor_in_the_graph():
    """Ŵ is checkpointed: the masked core and ``A·core`` that build it are recomputed in the
    backward pass, not kept — a step's memory holds Ŵ (what ``F.linear`` saves) and the leaves."""
    _, layers, _, _, factors = _block_problem()
    for name, f in factors.items():
        leaves = FactorLeaves(f, torch.device("cpu"))
        saved = []

        def pack(t, size=f.core.numel(), saved=saved):  # noqa: B008  (this layer's size and list, bound now)
            # weight-sized float tensors of any shape
            if t.numel() == size and t.is_floating_point():
                saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            w = leaves.weight(grad=True)
        assert saved == [], name
        w.square().sum().backward()  # the recomputation gives the gradient autograd would
        plain = [t.detach().clone().requires_grad_(True) for t in leaves.tensors]
        core = torch.zeros(f.core.shape).masked_scatter(leaves.mask, plain[1])
        ref = torch.block_diag(*plain[0]) @ core @ torch.block_diag(*plain[2])
        ref.square().sum().backward()
        for t, p in zip(leaves.tensors, plain):
            assert torch.allclose(t.grad, p.grad, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("train", [True, False])
def test_a_factored_linear_keeps_no_weight_sized_tensor_and_gets_autograds_gradients(train):
    """Inside :class:`FactoredLinears` a linear's ``Ŵ`` and matmul are one checkpointed function:
    the graph keeps the input and the leaves, never a ``d_out × d_in`` tensor; the gradients of
    the input and (when trained) of the leaves are those of autograd through the explicit product
    in float64; a frozen linear passes the input's gradient and gives its leaves none."""
    block, layers, _, _, factors = _block_problem()
    groups = weight_names(block, factors)
    leaves = {n: FactorLeaves(f, torch.device("cpu")) for n, f in factors.items()}
    gen = torch.Generator().manual_seed(5)
    xs = {n: torch.randn(2, 5, m.in_features, generator=gen) for n, m in layers.items()}
    with FactoredLinears(block, groups, leaves) as linears:
        assert linears.params == {f"{n}.weight" for n in layers}
        linears.trainable = set(layers) if train else set()
        for name, module in layers.items():
            saved = []

            def pack(t, size=factors[name].core.numel(), saved=saved):  # noqa: B008  (bound now, as above)
                # weight-sized float tensors of any shape
                if t.numel() == size and t.is_floating_point():
                    saved.append(tuple(t.shape))
                return t

            x = xs[name].clone().requires_grad_(True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = module(x)
            assert saved == [], name
            y.square().sum().backward()
            plain = [t.detach().double().requires_grad_(True) for t in leaves[name].tensors]
            x64 = xs[name].double().requires_grad_(True)
            core = torch.zeros(factors[name].core.shape, dtype=torch.float64).masked_scatter(leaves[name].mask,
                                                                                              plain[1])
            w = torch.block_diag(*plain[0]) @ core @ torch.block_diag(*plain[2])
            (x64 @ w.T).square().sum().backward()
            assert torch.allclose(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-4), name
            for t, p in zip(leaves[name].tensors, plain):
                if train:
                    assert torch.allclose(t.grad.double(), p.grad, rtol=1e-3, atol=1e-4), name
                else:
                    assert t.grad is None, name
    for name, module in layers.items():  # restored: the plain forward on the dense weight again
        assert "forward" not in module.__dict__
        assert torch.equal(module(xs[name]), torch.nn.functional.linear(xs[name], module.weight, module.bias))


def test_a_factored_linears_backward_does_not_rerun_its_matmul():
    """The backward pass rebuilds ``Ŵ`` but not the matmul: one token-by-feature product (the
    input's gradient), no rerun of ``F.linear`` (a second one, as a reentrant checkpoint would do)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    tokens = 21  # 3 × 7, no size of the toy block

    class TokenProducts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm) \
                    and out.shape[-2] == tokens:
                self.count += 1
            return out

    block, layers, _, _, factors = _block_problem()
    leaves = {n: FactorLeaves(f, torch.device("cpu")) for n, f in factors.items()}
    with FactoredLinears(block, weight_names(block, factors), leaves) as linears:
        linears.trainable = set(layers)
        for name, module in layers.items():
            assert torch.equal(leaves[name].mask, factors[name].mask.bool()), name
            x = torch.randn(3, 7, module.in_features, requires_grad=True)
            y = module(x)
            with TokenProducts() as seen:
                y.backward(torch.randn_like(y))
            assert seen.count == 1, name
            assert x.grad is not None and all(t.grad is not None for t in leaves[name].tensors)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), groups=st.integers(1, 5), m=st.sampled_from([2, 4, 8]), exact=st.booleans(),
       seed=st.integers(0, 2**16))
def test_scatter_core_is_masked_scatter_and_its_gradient_masked_select(rows, groups, m, exact, seed):
    """The core built from :func:`kept_index` has the bits of ``masked_scatter`` and the values'
    gradient those of ``masked_select``, for ``n:m`` masks (a byte per kept entry) and any other."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, groups, m, generator=gen)
    if exact:
        n = int(torch.randint(1, m + 1, (1,), generator=gen))
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter(2, scores.topk(n, dim=2).indices, True)
    else:
        mask = scores < 0.5
    mask = mask.reshape(rows, groups * m)
    index = kept_index(mask)
    if exact:
        assert index.dtype == torch.uint8
    values = torch.randn(int(mask.sum()), generator=gen, requires_grad=True)
    core = scatter_core(values, index, mask.shape)
    assert torch.equal(core, torch.zeros(mask.shape).masked_scatter(mask, values.detach()))
    grad = torch.randn(mask.shape, generator=gen)
    core.backward(grad)
    assert torch.equal(values.grad, grad.masked_select(mask))


class _Experts(nn.Module):
    """A toy fused-experts block: ``weight`` is ``(E, out, in)``, expert ``e`` reads slice ``e`` of the input."""

    def __init__(self, experts=3, d=16):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)
        self.experts = nn.Module()
        self.experts.weight = nn.Parameter(torch.randn(experts, d, d, generator=torch.Generator().manual_seed(1)) / 4)

    def forward(self, hidden):
        x = self.proj(hidden)
        parts = x.chunk(self.experts.weight.shape[0], dim=1)
        return torch.cat([p @ w.T for p, w in zip(parts, self.experts.weight)], dim=1)


def test_fused_expert_factors_build_the_stacked_parameter():
    block = _Experts()
    cfg = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=1), refine=None)
    weights = {"proj": block.proj.weight, **{f"experts.weight.{e}": block.experts.weight[e] for e in range(3)}}
    factors = {n: factorize(w.detach(), torch.ones(16), cfg) for n, w in weights.items()}
    groups = weight_names(block, factors)
    assert groups == {"proj.weight": ["proj"], "experts.weight": [f"experts.weight.{e}" for e in range(3)]}
    built = build_weights(groups, {n: FactorLeaves(f, torch.device("cpu")) for n, f in factors.items()})
    hand = torch.stack([factors[f"experts.weight.{e}"].dense() for e in range(3)])
    assert built["experts.weight"].shape == (3, 16, 16)
    assert torch.allclose(built["experts.weight"], hand, atol=1e-6)
    assert torch.allclose(built["proj.weight"], factors["proj"].dense(), atol=1e-6)
    inputs = [BlockInput(torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(j))) for j in range(3)]
    targets = [block(inp.hidden).detach() for inp in inputs]
    r = reconstruct_block(block, factors, inputs, targets, ReconstructConfig(steps=10, lr=1e-2, held_out=2))
    assert r.after < r.before
    missing = {n: f for n, f in factors.items() if n != "experts.weight.1"}
    with pytest.raises(ArmorInputError, match=r"experts \[1\]"):
        weight_names(block, missing)


@pytest.mark.parametrize("target", ["block", "model"])
def test_each_block_is_fitted_on_the_pruned_stream_to_the_chosen_target(monkeypatch, target):
    """Block 1 is reconstructed on what the pruned block 0 hands it. ``target="block"`` fits it to
    the dense block 1 run on those inputs; ``"model"`` to the dense model's own hidden states after
    block 1 — both recomputed here from an untouched copy of the model with forward hooks."""
    import torch_armor.armor.method as engine_blocks

    seen = []
    real = engine_blocks.reconstruct_block

    def spy(block, factors, inputs, targets, *args, **kwargs):
        seen.append(([inp.hidden.clone() for inp in inputs], [t.clone() for t in targets]))
        return real(block, factors, inputs, targets, *args, **kwargs)

    monkeypatch.setattr(engine_blocks, "reconstruct_block", spy)
    cfg = dataclasses.replace(CFG, reconstruct=ReconstructConfig(steps=2, target=target), distill=None)
    pruned = make_tiny_llama()
    prune_model(pruned, CALIB[:8], cfg, options=PruneOptions(progress=False, batch_size=4))
    assert len(seen) == 2

    def block_io(model, index):
        """Each calibration batch's (input, output) of decoder block ``index``, by forward hooks."""
        io = []
        hook = model.model.layers[index].register_forward_hook(
            lambda _m, args, out: io.append((args[0].detach(), (out[0] if isinstance(out, tuple) else out).detach())))
        with torch.no_grad():
            for batch in CALIB[:8].split(4):
                model(batch)
        hook.remove()
        return io

    inputs, targets = seen[1]
    pruned_io = block_io(pruned, 0)
    dense = make_tiny_llama()
    dense_io = block_io(dense, 1)
    fed = iter(inputs)  # the dense model again, its block 1 fed the pruned stream instead
    swap = dense.model.layers[1].register_forward_pre_hook(lambda _m, args: (next(fed), *args[1:]))
    dense_on_pruned = block_io(dense, 1)
    swap.remove()
    for j, (pruned_in, dense_out) in enumerate(zip(inputs, dense_io)):
        assert torch.allclose(pruned_in, pruned_io[j][1], atol=1e-5)  # the pruned block 0's output
        assert not torch.allclose(pruned_in, dense_out[0], atol=1e-3)  # the two streams differ
        want = dense_out[1] if target == "model" else dense_on_pruned[j][1]
        assert torch.allclose(targets[j], want, atol=1e-5)
        assert not torch.allclose(dense_out[1], dense_on_pruned[j][1], atol=1e-3)  # the two targets differ


@pytest.mark.parametrize("bad", ["dense", "", None])
def test_reconstruct_target_must_be_named(bad):
    with pytest.raises(ArmorInputError, match=r"ReconstructConfig.target must be one of \('block', 'model'\)"):
        ReconstructConfig(target=bad)


def test_the_dense_stream_on_disk_gives_the_same_bits(tmp_path):
    """``hidden_dir``: the dense stream of ``target="model"`` waits on disk beside the pruned one."""
    cfg = dataclasses.replace(CFG, reconstruct=ReconstructConfig(steps=2, target="model"), distill=None)
    in_memory, on_disk = make_tiny_llama(), make_tiny_llama()
    prune_model(in_memory, CALIB[:8], cfg, options=PruneOptions(progress=False, batch_size=4))
    prune_model(on_disk, CALIB[:8], cfg, options=PruneOptions(progress=False, batch_size=4, hidden_dir=tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{kind}-{j:06d}.safetensors" for kind in ("batch", "dense")
                                                          for j in range(2)]
    for (n, p), (_, q) in zip(in_memory.named_parameters(), on_disk.named_parameters()):
        a = p.dense_weight() if hasattr(p, "dense_weight") else p
        b = q.dense_weight() if hasattr(q, "dense_weight") else q
        assert torch.equal(a.detach(), b.detach()), n
