"""Issue #14: calibration honours attention masks — pad positions are left out of every statistic
(observer, collect_statistics, the block engine, prune_model, the sparsifiers)."""

from __future__ import annotations

import pytest
import torch

from torch_armor.calibration.blocks import block_statistics, capture_block_inputs, decoder_blocks
from torch_armor.calibration.observer import (ActSqNormObserver, collect_statistics, decoder_linear_names,
                                              set_token_mask, token_mask)
from torch_armor import MagnitudeConfig, PruneOptions, SparseGPTConfig, WandaConfig


def _padded(model, lengths, width, seed=0):
    """Right-padded windows: real tokens then junk ids (never to be counted) with mask 0."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return ids, mask


def _reference(model, ids, mask, names):
    """Independent reference: each window run alone, cut to its real tokens, no mask at all."""
    total = {}
    for row, m in zip(ids, mask):
        n = int(m.sum())
        stats = collect_statistics(model, names, row[:n][None], track_xtx=True, progress=False)
        for k, s in stats.items():
            acc = total.setdefault(k, [torch.zeros_like(s.act_sq_norm), 0, torch.zeros_like(s.xtx)])
            acc[0] += s.act_sq_norm
            acc[1] += s.num_tokens
            acc[2] += s.xtx
    return total


def test_observer_drops_masked_rows():
    lin = torch.nn.Linear(3, 2)
    obs = ActSqNormObserver(track_xtx=True).attach(lin, "lin")
    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]])
    with token_mask(mask):
        lin(x)
    kept = x[mask.bool()]
    assert obs.num_tokens == 4
    torch.testing.assert_close(obs.act_sq_norm, kept.square().sum(0))
    torch.testing.assert_close(obs.xtx, kept.T @ kept)
    lin(x)  # outside the context: every position counts again
    assert obs.num_tokens == 12
    with pytest.raises(ValueError, match="layer 'lin' saw 8 input rows but the attention mask has 6"):
        with token_mask(torch.ones(2, 3)):
            lin(x)
    obs.remove()


def test_collect_statistics_ignores_padding(tiny_llama):
    names = decoder_linear_names(tiny_llama)
    ids, mask = _padded(tiny_llama, [5, 9, 12], 12)
    got = collect_statistics(tiny_llama, names, ids, attention_mask=mask, track_xtx=True, progress=False)
    ref = _reference(tiny_llama, ids, mask, names)
    for name in names:
        assert got[name].num_tokens == ref[name][1] == 26
        torch.testing.assert_close(got[name].act_sq_norm, ref[name][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[name].xtx, ref[name][2], rtol=1e-4, atol=1e-3)
    unmasked = collect_statistics(tiny_llama, names, ids, progress=False)
    assert unmasked[names[0]].num_tokens == 36  # without the mask the pads would count


def test_block_engine_ignores_padding(tiny_llama):
    names = decoder_linear_names(tiny_llama)
    ids, mask = _padded(tiny_llama, [4, 10], 10, seed=1)
    _, blocks = decoder_blocks(tiny_llama)
    inputs = capture_block_inputs(tiny_llama, blocks[0], [(ids, mask)])
    layers = {n: tiny_llama.get_submodule(n) for n in names if n.startswith("model.layers.0.")}
    got = block_statistics(blocks[0], layers, inputs, device=torch.device("cpu"), track_xtx=True)
    ref = _reference(tiny_llama, ids, mask, list(layers))
    for name in layers:
        assert got[name].num_tokens == 14
        torch.testing.assert_close(got[name].act_sq_norm, ref[name][0], rtol=1e-4, atol=1e-4)


def test_prune_model_padding_changes_nothing(tiny_llama_factory):
    """The same real tokens with or without junk padding (masked) give the same pruned model:
    Wanda (a function of the statistics alone) bit for bit in its masks, ARMOR to 0.5% in every
    layer's loss (summation order differs; counting the pads instead moves them by up to ~10%)."""
    from torch_armor import ArmorConfig, prune_model
    from torch_armor.config.armor import BcdConfig

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    junk = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    padded = {"input_ids": torch.cat([ids, junk], 1),
              "attention_mask": torch.cat([torch.ones(2, 12), torch.zeros(2, 6)], 1).long()}
    plain_model, padded_model = tiny_llama_factory(), tiny_llama_factory()
    prune_model(plain_model, ids, WandaConfig(), options=PruneOptions(progress=False, batch_size=2))
    prune_model(padded_model, padded, WandaConfig(), options=PruneOptions(progress=False, batch_size=2))
    for name in decoder_linear_names(plain_model):
        wa, wb = (m.get_submodule(name).weight for m in (plain_model, padded_model))
        assert torch.equal(wa != 0, wb != 0), name
    cfg = ArmorConfig(block_size=16, refine=None, optimizer=BcdConfig(iters=2), reconstruct=None)  # the proxy loss alone
    a = prune_model(tiny_llama_factory(), ids, cfg, options=PruneOptions(progress=False, batch_size=2))
    b = prune_model(tiny_llama_factory(), padded, cfg, options=PruneOptions(progress=False, batch_size=2))
    for la, lb in zip(a.layers, b.layers):
        assert la.name == lb.name
        assert la.relative_proxy_loss == pytest.approx(lb.relative_proxy_loss, rel=5e-3)


def test_prune_model_rejects_bad_masks(tiny_llama):
    from torch_armor import prune_model

    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask must have the token ids' shape"):
        prune_model(tiny_llama, {"input_ids": ids, "attention_mask": torch.ones(2, 7)}, MagnitudeConfig(), options=PruneOptions(progress=False))
    with pytest.raises(ValueError, match="no token"):
        prune_model(tiny_llama, (ids, torch.tensor([[1] * 8, [0] * 8])), WandaConfig(), options=PruneOptions(progress=False))


def test_sparsifier_set_attention_mask(tiny_llama, tiny_llama_factory):
    from torch_armor.sparsifier import ArmorSparsifier

    names = [n for n in decoder_linear_names(tiny_llama) if ".0." in n]
    sp = ArmorSparsifier(SparseGPTConfig(), progress=False)
    sp.prepare(tiny_llama, [{"tensor_fqn": f"{n}.weight"} for n in names])
    ids, mask = _padded(tiny_llama, [3, 7], 7, seed=4)
    sp.set_attention_mask(mask)
    try:
        with torch.no_grad():
            tiny_llama(ids, attention_mask=mask)
    finally:
        sp.set_attention_mask(None)
    ref = _reference(tiny_llama_factory(), ids, mask, names)  # a fresh copy: no sparsifier hooks
    for name in names:
        stats = sp.statistics(f"{name}.weight")
        assert stats.num_tokens == 10
        torch.testing.assert_close(stats.act_sq_norm, ref[name][0], rtol=1e-4, atol=1e-4)
    set_token_mask(None)
