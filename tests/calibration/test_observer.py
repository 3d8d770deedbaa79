"""Tests for torch_armor.calibration.observer: streaming Σx² / XᵀX statistics and layer selection."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_armor.calibration.observer import (
    ActSqNormObserver,
    LayerStatistics,
    attach_observers,
    collect_statistics,
    decoder_linear_names,
    remove_observers,
)

PROJ = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]


def reference_sums(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Σ x² and Σ xᵀx in float64 by an explicit loop over every token row."""
    d = inputs[0].shape[-1]
    sq = torch.zeros(d, dtype=torch.float64)
    xtx = torch.zeros(d, d, dtype=torch.float64)
    n = 0
    for x in inputs:
        for row in x.reshape(-1, d).double():
            sq += row * row
            xtx += torch.outer(row, row)
            n += 1
    return sq, xtx, n


def test_observer_matches_reference_over_several_calls():
    torch.manual_seed(0)
    lin = nn.Linear(6, 3)
    obs = ActSqNormObserver(track_xtx=True).attach(lin, "lin")
    inputs = [torch.randn(2, 5, 6), torch.randn(7, 6), torch.randn(1, 2, 3, 6)]
    for x in inputs:
        lin(x)
    sq, xtx, n = reference_sums(inputs)
    assert obs.num_tokens == n == 10 + 7 + 6
    assert obs.act_sq_norm.dtype == torch.float32 and obs.act_sq_norm.shape == (6,)
    torch.testing.assert_close(obs.act_sq_norm.double(), sq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(obs.xtx.double(), xtx, rtol=1e-5, atol=1e-5)
    stats = obs.statistics()
    assert isinstance(stats, LayerStatistics) and stats.num_tokens == n
    torch.testing.assert_close(stats.mean_sq.double(), sq / n, rtol=1e-5, atol=1e-6)
    obs.remove()


def test_observer_accumulates_fp32_for_low_precision_inputs():
    torch.manual_seed(1)
    lin = nn.Linear(8, 4).to(torch.bfloat16)
    obs = ActSqNormObserver(track_xtx=True).attach(lin, "bf16")
    x = (torch.randn(64, 8) * 3).to(torch.bfloat16)
    lin(x)
    sq, xtx, _ = reference_sums([x])  # exact values of the bf16 inputs, summed in fp64
    assert obs.act_sq_norm.dtype == torch.float32 and obs.xtx.dtype == torch.float32
    torch.testing.assert_close(obs.act_sq_norm.double(), sq, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(obs.xtx.double(), xtx, rtol=1e-5, atol=1e-4)
    # a bf16 accumulation would be far off: make sure the test could tell
    assert (x.float().square().sum(0).bfloat16().double() - sq).abs().max() > 1e-3


def test_observer_without_xtx_remove_and_reset():
    lin = nn.Linear(3, 2)
    obs = ActSqNormObserver().attach(lin, "l")
    assert obs.xtx is None
    assert torch.equal(obs.act_sq_norm, torch.zeros(3))  # nothing seen yet
    lin(torch.tensor([[1.0, -2.0, 3.0]]))
    assert obs.act_sq_norm.tolist() == [1.0, 4.0, 9.0]
    obs.remove()
    assert not obs.attached and len(lin._forward_pre_hooks) == 0
    lin(torch.ones(4, 3))  # not observed any more
    assert obs.num_tokens == 1 and obs.act_sq_norm.tolist() == [1.0, 4.0, 9.0]
    obs.remove()  # idempotent
    obs.attach(lin, "l")
    obs.reset()
    assert obs.num_tokens == 0 and obs.act_sq_norm.tolist() == [0.0, 0.0, 0.0]
    lin(input=torch.full((2, 3), 2.0))  # keyword call is observed too
    assert obs.num_tokens == 2 and obs.act_sq_norm.tolist() == [8.0, 8.0, 8.0]
    obs.remove()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_observer_rejects_non_finite_inputs(bad):
    lin = nn.Linear(4, 2)
    obs = ActSqNormObserver().attach(lin, "model.layers.3.mlp.up_proj")
    x = torch.randn(5, 4)
    x[2, 1] = bad
    with pytest.raises(ValueError, match=r"NaN or Inf.*model\.layers\.3\.mlp\.up_proj"):
        lin(x)
    obs.remove()


def test_observer_rejects_overflow_and_bad_modules():
    lin = nn.Linear(2, 1)
    obs = ActSqNormObserver().attach(lin, "big")
    with pytest.raises(ValueError, match="'big' overflow float32"):
        lin(torch.tensor([[1e30, 0.0]]))
    with pytest.raises(ValueError, match="already attached"):
        obs.attach(lin, "big")
    obs.remove()
    with pytest.raises(ValueError, match="observes nn.Linear.*Conv1d"):
        ActSqNormObserver().attach(nn.Conv1d(2, 2, 1), "conv")


def test_attach_observers_by_name_and_module():
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    by_name = attach_observers(model, ["0", "2"])
    by_module = attach_observers(model, [model[2]], track_xtx=True)
    assert list(by_name) == ["0", "2"] and list(by_module) == ["2"]
    x = torch.randn(3, 4)
    model(x)
    remove_observers(by_name)
    remove_observers(by_module.values())
    hidden = torch.relu(model[0](x))
    assert all(len(m._forward_pre_hooks) == 0 for m in model)
    torch.testing.assert_close(by_name["0"].act_sq_norm, x.square().sum(0))
    torch.testing.assert_close(by_name["2"].act_sq_norm, hidden.square().sum(0))
    torch.testing.assert_close(by_module["2"].xtx, hidden.T @ hidden)
    with pytest.raises(ValueError, match="no submodule named 'nope'"):
        attach_observers(model, ["0", "nope"])
    assert len(model[0]._forward_pre_hooks) == 0  # partial attach undone
    with pytest.raises(ValueError, match="not part of the model"):
        attach_observers(model, [nn.Linear(1, 1)])
    with pytest.raises(ValueError, match="observes nn.Linear"):
        attach_observers(model, ["1"])


class _Lin(nn.Linear):
    """A Linear subclass: must still be found."""


class _TiedToy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = _Lin(4, 4)
        self.tied_view = nn.Linear(4, 10, bias=False)
        # same storage as the embedding, but a different Parameter object
        self.tied_view.weight = nn.Parameter(self.embed.weight.data.view(10, 4))
        self.head = nn.Linear(4, 10)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def test_decoder_linear_names_tiny_llama(tiny_llama_factory):
    expected = [f"model.layers.{i}.{p}" for i in range(2) for p in PROJ]
    for tie in (False, True):
        model = tiny_llama_factory(tie=tie)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
        assert decoder_linear_names(model) == expected


def test_decoder_linear_names_excludes_head_and_shared_storage():
    toy = _TiedToy()
    assert toy.tied_view.weight is not toy.embed.weight
    assert decoder_linear_names(toy) == ["proj"]
    plain = nn.Sequential(nn.Linear(2, 2), _Lin(2, 2))  # no head, no embeddings
    assert decoder_linear_names(plain) == ["0", "1"]


def test_collect_statistics_matches_manual_hooks(tiny_llama):
    model = tiny_llama
    names = decoder_linear_names(model)
    windows = torch.randint(0, 128, (5, 12), generator=torch.Generator().manual_seed(0))

    # independent reference: store every input with plain hooks, one window at a time
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    modules = dict(model.named_modules())
    handles = [
        modules[n].register_forward_hook(lambda m, a, o, n=n: seen[n].append(a[0].detach().clone()))
        for n in names
    ]
    with torch.no_grad():
        for w in windows:
            model(w[None])
    for h in handles:
        h.remove()

    model.train()
    stats = collect_statistics(model, names, windows, batch_size=2, track_xtx=True, progress=False)
    assert model.training  # mode restored
    assert list(stats) == names
    for n in names:
        sq, xtx, count = reference_sums(seen[n])
        assert stats[n].num_tokens == count == 60
        torch.testing.assert_close(stats[n].act_sq_norm.double(), sq, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(stats[n].xtx.double(), xtx, rtol=1e-4, atol=1e-3)
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())

    # different layers really see different inputs (the statistics are not all the same)
    assert not torch.allclose(
        stats["model.layers.0.self_attn.q_proj"].act_sq_norm,
        stats["model.layers.1.self_attn.q_proj"].act_sq_norm,
    )


def _offload(model: nn.Module, how: str, folder) -> None:
    accelerate = pytest.importorskip("accelerate")
    if how == "cpu_offload":
        accelerate.cpu_offload(model, execution_device="cpu")
    elif how == "disk_offload":
        accelerate.disk_offload(model, offload_dir=str(folder), execution_device="cpu")
    else:  # a device_map with one decoder layer on disk, as from_pretrained(device_map=...) builds it
        device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                      "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
        accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(folder))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload", "device_map"])
def test_collect_statistics_on_offloaded_models_in_low_precision(tmp_path, tiny_llama_factory, how, dtype):
    windows = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(1))
    plain = tiny_llama_factory().to(dtype)
    names = decoder_linear_names(plain)
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    modules = dict(plain.named_modules())
    handles = [modules[n].register_forward_hook(lambda m, a, o, n=n: seen[n].append(a[0].detach().clone()))
               for n in names]
    with torch.no_grad():
        plain(windows)
    for h in handles:
        h.remove()
    expected = collect_statistics(plain, names, windows, batch_size=2, track_xtx=True, progress=False)

    model = tiny_llama_factory().to(dtype)
    _offload(model, how, tmp_path)
    assert any(p.device.type == "meta" for p in model.parameters())  # really offloaded
    stats = collect_statistics(model, names, windows, batch_size=2, track_xtx=True, progress=False)
    for n in names:
        got = stats[n]
        assert got.act_sq_norm.dtype == got.xtx.dtype == torch.float32 and got.num_tokens == 48
        assert got.act_sq_norm.shape == (modules[n].in_features,)  # O(d_in), whatever the token count
        torch.testing.assert_close(got.act_sq_norm, expected[n].act_sq_norm, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.xtx, expected[n].xtx, rtol=1e-6, atol=1e-5)
        # accumulated in fp32 from the (possibly bf16) inputs: as exact as a float64 sum allows
        sq, _, _ = reference_sums(seen[n])
        torch.testing.assert_close(got.act_sq_norm.double(), sq, rtol=1e-5, atol=1e-5)


def test_collect_statistics_removes_hooks_on_error(tiny_llama):
    model = tiny_llama
    names = decoder_linear_names(model)
    bad = torch.full((2, 4), 500)  # token ids beyond the vocabulary (128)
    with pytest.raises(IndexError):
        collect_statistics(model, names, bad, progress=False)
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())

    # a NaN weight in up_proj: the error names the first layer that sees non-finite input
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or Inf.*'model\.layers\.0\.mlp\.down_proj'"):
        collect_statistics(model, names, torch.zeros(1, 4, dtype=torch.long), progress=False)
    assert all(len(m._forward_pre_hooks) == 0 for m in model.modules())


def test_collect_statistics_argument_errors(tiny_llama):
    names = decoder_linear_names(tiny_llama)
    with pytest.raises(ValueError, match="2-D tensor of token ids"):
        collect_statistics(tiny_llama, names, torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        collect_statistics(tiny_llama, names, torch.zeros(2, 8))
    with pytest.raises(ValueError, match="batch_size"):
        collect_statistics(tiny_llama, names, torch.zeros(2, 8, dtype=torch.long), batch_size=0)


@pytest.mark.slow
def test_collect_statistics_real_smollm2_first_layer(smollm2, sotu_available):
    """Real model: the q/k/v projections of a layer share one input, so equal statistics;
    and the input of layer 0's q_proj is the RMS-normed embedding, checkable by hand."""
    model, tok = smollm2
    from torch_armor.recipes.data import calibration_windows

    windows = calibration_windows("sotu", tok, n_windows=2, seq_len=64, seed=0)
    names = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    stats = collect_statistics(model, names, windows, progress=False)
    q, k, v = (stats[n] for n in names)
    assert q.num_tokens == 128
    assert torch.equal(q.act_sq_norm, k.act_sq_norm) and torch.equal(q.act_sq_norm, v.act_sq_norm)
    with torch.no_grad():
        emb = model.model.embed_tokens(windows)
        normed = model.model.layers[0].input_layernorm(emb)
    torch.testing.assert_close(q.act_sq_norm, normed.square().sum((0, 1)), rtol=1e-4, atol=1e-4)
