"""Zamba and Zamba2 through prune_model: hybrid layers that call one shared transformer block.

Their decoder layers are called as ``layer(hidden, original_hidden_states, layer_idx, mamba mask,
attention mask, cache=…, …)``; every hybrid layer holds the *same* attention and MLP weights (tied,
Zamba2's LoRA-like adapters on them too) and calls them on its own input. The rule: a linear whose
weight several decoder layers hold stays dense, listed in ``PruneReport.dense_weights`` as "shared by
decoder layers 1, 3", with one warning; the Mamba mixers' ``in_proj``/``out_proj`` and each hybrid
layer's own ``linear`` are pruned to 2:4. The mixers' raw weights (Zamba's per-head ``x_proj_weight``,
``dt_proj_weight``) are not a linear's and stay dense as such, not as "experts".
"""

import inspect
import warnings

import pytest
import torch
from torch import nn
from transformers import Zamba2Config, Zamba2ForCausalLM, ZambaConfig, ZambaForCausalLM

from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.engine.prune import PruneOptions, prune_model
from torch_armor.tensor.armor_tensor import ArmorTensor

from _helpers import check_mask
from _tiny_moe import armor_and_magnitude_errors, assert_saves_and_loads_bit_identically

pytestmark = pytest.mark.usefixtures("one_thread")
CALIB = torch.randint(0, 64, (6, 16), generator=torch.Generator().manual_seed(0))
IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))
HYBRID = (1, 3)  # layers 0 and 2 are Mamba layers, 1 and 3 hybrid: Mamba plus the one shared transformer block


def _widen(model):
    """Weights redrawn from N(0, 0.3²) (the default init predicts almost uniformly), ``A_log`` kept."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "A_log" not in name:
                p.normal_(0.0, 0.3)
    return model.eval()


def _zamba():
    torch.manual_seed(0)
    return _widen(ZambaForCausalLM(ZambaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, mamba_d_state=16, mamba_dt_rank=8, mamba_expand=2, n_mamba_heads=2,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"])))


def _zamba2():
    torch.manual_seed(0)
    return _widen(Zamba2ForCausalLM(Zamba2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, mamba_d_state=16, mamba_headdim=8, n_mamba_heads=8, mamba_expand=2, mamba_ngroups=1,
        num_mem_blocks=1, use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"])))


_ADAPTERS = [f"self_attn.linear_{p}_adapter_list.{i}.{j}" for p in "qkv" for i in range(2) for j in range(2)] + \
    [f"feed_forward.gate_up_proj_adapter_list.{i}.{j}" for i in range(2) for j in range(2)]
#: arch: (build, the shared block's attribute, its linears (every one tied across the hybrid layers),
#: where the Mamba mixer sits in a hybrid layer)
ARCHS = {
    "zamba": (_zamba, "shared_transf", [f"self_attn.{p}_proj" for p in "qkvo"]
              + [f"feed_forward.{p}_proj" for p in ("gate", "up", "down")], "mamba_decoder.mamba"),
    "zamba2": (_zamba2, "shared_transformer", [f"self_attn.{p}_proj" for p in "qkvo"]
               + ["feed_forward.gate_up_proj", "feed_forward.down_proj"] + _ADAPTERS, "mamba_decoder.mamba"),
}
SHARED_WHY = "shared by decoder layers 1, 3"


def _pruned_names(arch):
    """Every linear the rule prunes, written out: each layer's Mamba projections, each hybrid layer's own linear."""
    mixer = ARCHS[arch][3]
    names = []
    for i in range(4):
        where = mixer if i in HYBRID else "mamba"
        names += [f"model.layers.{i}.{where}.in_proj", f"model.layers.{i}.{where}.out_proj"]
        if i in HYBRID:
            names.append(f"model.layers.{i}.linear")
    return names


def _armor():
    return ArmorConfig(block_size=8, optimizer=BcdConfig(iters=1), refine=None, reconstruct=None, distill=None)


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_unshared_linears_are_2_4_the_shared_block_stays_dense_and_listed_and_it_round_trips(arch, tmp_path):
    build, attr, shared, _ = ARCHS[arch]
    model = build()
    dense = {f"model.layers.1.{attr}.{n}": model.get_submodule(f"model.layers.1.{attr}.{n}").weight.detach().clone()
             for n in shared}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False))

    assert sorted(r.name for r in report.layers) == sorted(_pruned_names(arch))
    for name in _pruned_names(arch):
        w = model.get_submodule(name).weight
        assert isinstance(w, ArmorTensor) and check_mask(w.core_dense() != 0, "2:4"), name
    for n in shared:  # one weight, untouched, still held by both hybrid layers
        weights = [model.get_submodule(f"model.layers.{i}.{attr}.{n}").weight for i in HYBRID]
        assert weights[0] is weights[1] and type(weights[0]) is nn.Parameter, n
        assert torch.equal(weights[0], dense[f"model.layers.1.{attr}.{n}"]), n
        count, why = report.dense_weights[f"model.layers.*.{attr}.{n}.weight"]
        assert (count, why) == (1, SHARED_WHY), n
    for name, m in model.named_modules(remove_duplicate=False):  # nothing else left dense
        if isinstance(m, nn.Linear) and name.startswith("model.layers.") and not isinstance(m.weight, ArmorTensor):
            rest = name.split(".", 3)[3]
            assert rest.startswith(attr + ".") and rest[len(attr) + 1:] in shared, name
    about = [str(w.message) for w in caught if "weight that several decoder layers share" in str(w.message)]
    assert len(about) == 1 and f"{2 * len(shared)} selected linear(s)" in about[0], [str(w.message) for w in caught]
    assert not report.uncalled_layers  # Zamba2's adapters the other layer calls are not "never called"
    assert not any("experts" in why for _, why in report.dense_weights.values()), report.dense_weights
    if arch == "zamba":  # the mixer's per-head weights, read directly by its forward
        for p in ("x_proj_weight", "dt_proj_weight"):
            assert report.dense_weights[f"model.layers.*.mamba.{p}"][1].startswith("not a linear's weight"), p

    assert_saves_and_loads_bit_identically(model, tmp_path / "saved", IDS)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_armor_is_closer_to_dense_than_magnitude_2_4_of_the_same_linears(arch):
    """Each method prunes what the rule selects by default (the same linears), ARMOR with smaller logit error."""
    errors = armor_and_magnitude_errors(ARCHS[arch][0], CALIB, IDS, _armor(), None, pruned=_pruned_names(arch))
    assert errors["armor"] < errors["magnitude"], errors


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_streamed_checkpoint_is_pruned_like_the_model_in_memory(arch, tmp_path):
    from torch_armor import load_pretrained

    build = ARCHS[arch][0]
    build().save_pretrained(tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        streamed = prune_model(tmp_path / "ckpt", CALIB, _armor(), options=PruneOptions(progress=False,
                                                                                        out=tmp_path / "out"))
        model = build()
        in_memory = prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False))
    assert sorted(r.name for r in streamed.layers) == sorted(_pruned_names(arch))
    assert [(r.name, r.relative_proxy_loss) for r in streamed.layers] == \
        [(r.name, r.relative_proxy_loss) for r in in_memory.layers]
    assert streamed.dense_weights == in_memory.dense_weights
    assert torch.equal(_logits(load_pretrained(tmp_path / "out").eval()), _logits(model))


def _calls(model, run):
    """Every decoder layer's calls while ``run()`` runs: ``[(arguments by name, output)]`` per layer, the
    arguments bound to the layer's own forward signature (``**kwargs`` spread out)."""
    calls = {i: [] for i in range(len(model.model.layers))}

    def hook(index):
        def record(module, args, kwargs, output):
            bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments
            named = {k: v for k, v in bound.items() if k not in ("self", "kwargs")}
            named.update(bound.get("kwargs", {}))
            calls[index].append((named, output))
        return record

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return calls


def _same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_each_block_is_called_with_what_the_models_own_forward_passes_it(arch):
    """A one-shot prune (the dense stream) calls each block last with the very arguments, positional
    and keyword, that the model's forward gives it, and gets the very same output."""
    model = ARCHS[arch][0]()
    batch = CALIB[:2]
    own = _calls(model, lambda: model(batch, use_cache=False))
    pipeline = _calls(model, lambda: prune_model(model, batch, _armor(), options=PruneOptions(progress=False,
                                                                                              sequential=False)))
    embeddings = model.model.embed_tokens(batch)
    for i, layer_calls in pipeline.items():
        (want, want_out), = own[i]
        got, got_out = layer_calls[-1]  # the block's calibration run (earlier ones: the capture's recorders)
        assert want["layer_idx"] == i and torch.equal(want["original_hidden_states"], embeddings)
        assert sorted(got) == sorted(want), (i, sorted(got), sorted(want))
        for name in want:
            assert _same(got[name], want[name]), (i, name)
        assert torch.equal(got_out, want_out), i


def test_a_module_reused_by_two_layers_stays_dense_and_the_rest_is_pruned():
    """The rule is about weights, not Zamba: a Llama whose layer 1 calls layer 0's very MLP module."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64)).eval()
    model.model.layers[1].mlp = model.model.layers[0].mlp
    down = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False))
    assert sorted(r.name for r in report.layers) == sorted(f"model.layers.{i}.self_attn.{p}_proj"
                                                           for i in range(2) for p in "qkvo")
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight, down)
    for p in ("gate", "up", "down"):
        assert report.dense_weights[f"model.layers.*.mlp.{p}_proj.weight"] == (1, "shared by decoder layers 0, 1")
    assert sum("weight that several decoder layers share" in str(w.message) for w in caught) == 1


def test_a_selection_of_shared_weights_only_is_refused_by_name():
    from torch_armor.errors import ArmorInputError

    model = _zamba()
    with pytest.raises(ArmorInputError, match=r"model\.layers\.1\.shared_transf\.self_attn\.q_proj.*shared by decoder "
                                              r"layers 1, 3.*select other layers"):
        prune_model(model, CALIB, _armor(), layers="shared_transf", options=PruneOptions(progress=False))
