"""Small problem generators shared by the math tests."""

from __future__ import annotations

from pathlib import Path

import torch

from torch_armor.core.pattern import parse_pattern
from torch_armor.core.factors import ArmorFactors
from torch_armor.core.proxy import mask_from_scores
from torch_armor.core.sparse_core import psd_pinv


def random_layer(d_out: int, d_in: int, seed: int = 0, dtype=torch.float64):
    """A random weight and positive activation statistics with a realistic spread."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_out, d_in, generator=g, dtype=dtype)
    h = torch.rand(d_in, generator=g, dtype=dtype).pow(3) * 10 + 1e-2
    return w, h


def random_factors(d_out: int, d_in: int, d_b: int, n: int, m: int, seed: int = 0, dtype=torch.float64):
    """Random blocks and a random valid N:M core, in normalized space."""
    g = torch.Generator().manual_seed(seed)
    eye = torch.eye(d_b, dtype=dtype)
    a = eye + 0.3 * torch.randn(d_out // d_b, d_b, d_b, generator=g, dtype=dtype)
    b = eye + 0.3 * torch.randn(d_in // d_b, d_b, d_b, generator=g, dtype=dtype)
    core = torch.randn(d_out, d_in, generator=g, dtype=dtype)
    mask = mask_from_scores(torch.rand(d_out, d_in, generator=g, dtype=dtype), f"{n}:{m}")
    return a, b, core * mask, mask


def block_diag_dense(blocks: torch.Tensor) -> torch.Tensor:
    """The full block-diagonal matrix of a ``(k, d_b, d_b)`` block stack."""
    return torch.block_diag(*blocks.unbind(0))


def check_mask(mask: torch.Tensor, pattern) -> bool:
    """Whether ``mask`` satisfies ``pattern`` exactly (N kept per group; row fraction if unstructured)."""
    pat = parse_pattern(pattern)
    d_out, d_in = mask.shape
    if pat.structured:
        return bool((mask.reshape(d_out, d_in // pat.m, pat.m).sum(-1) == pat.n).all())
    return bool((mask.sum(1) == int(round((1.0 - pat.sparsity) * d_in))).all())


def solve_psd_2x2(k: torch.Tensor, u: torch.Tensor, rel_tol: float = 1e-6) -> torch.Tensor:
    """``K⁺ u`` of batched symmetric PSD 2×2 systems through :func:`psd_pinv`."""
    return (psd_pinv(k, rel_tol) @ u[..., None])[..., 0]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a torchrun rendezvous."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_pattern_factors(
    d_out: int, d_in: int, d_b: int, pattern: str = "2:4", seed: int = 0, dtype: torch.dtype = torch.float32
) -> ArmorFactors:
    """Random block-diagonal wrappers and a random core with a valid N:M (or random unstructured) mask."""
    gen = torch.Generator().manual_seed(seed)
    if pattern.startswith("unstructured"):
        mask = torch.rand(d_out, d_in, generator=gen) < 0.5
    else:
        n, m = (int(v) for v in pattern.split(":"))
        ranks = torch.rand(d_out, d_in // m, m, generator=gen).argsort(-1).argsort(-1)
        mask = (ranks < n).reshape(d_out, d_in)
    core = torch.randn(d_out, d_in, generator=gen) * mask
    a = torch.randn(d_out // d_b, d_b, d_b, generator=gen) / d_b**0.5
    b = torch.randn(d_in // d_b, d_b, d_b, generator=gen) / d_b**0.5
    return ArmorFactors(a.to(dtype), core.to(dtype), b.to(dtype), mask, pattern)


def edit_checkpoint(directory, tensors=None, quantization_config=None):
    """Edit a saved Hugging Face-format directory in place: ``tensors(dict)`` changes the tensors of
    ``model.safetensors`` (header metadata kept), ``quantization_config(dict)`` the ARMOR entry of
    ``config.json``. Returns the directory (crafted checkpoints for the robustness checks)."""
    import json
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import save_file

    d = Path(directory)
    if tensors is not None:
        path = d / "model.safetensors"
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata()
            parts = {k: fh.get_tensor(k) for k in fh.keys()}
        tensors(parts)
        save_file(parts, path, metadata=meta)
    if quantization_config is not None:
        cfg = json.loads((d / "config.json").read_text())
        quantization_config(cfg["quantization_config"])
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def saved_tensors(path) -> dict:
    """Every tensor of a saved model, whatever its shards."""
    from safetensors.torch import load_file

    out: dict = {}
    for shard in sorted(Path(path).glob("model*.safetensors")):
        out.update(load_file(str(shard)))
    assert out, f"no weights in {path}"
    return out


def assert_same_saved_model(a, b) -> None:
    """Two saved models hold the same tensors under the same keys, bit for bit."""
    ta, tb = saved_tensors(a), saved_tensors(b)
    assert sorted(ta) == sorted(tb)
    different = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not different, different[:5]


#: calibration ids and a config for :func:`fit_llama`, whose layers the config's block size does not all fit:
#: q/o (32, 32): 16 fits; k/v (4, 32): only 4 divides, at 112% overhead; gate/up (40, 32), down (32, 40): 8, at 45%
FIT_CALIB = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))


def fit_config():
    from torch_armor.config.armor import ArmorConfig, BcdConfig

    return ArmorConfig(block_size=16, max_overhead=0.5, optimizer=BcdConfig(iters=2), refine=None, reconstruct=None,
                       distill=None)


def fit_llama():
    """A 2-layer random Llama whose linears :func:`fit_config`'s block size 16 does not all fit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=1, head_dim=4,
                                        max_position_embeddings=32)).eval()
