"""torch_armor: ARMOR 2:4 semi-structured pruning for PyTorch models.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from torch_armor import ArmorSparsifier
    >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    >>> sparsifier = ArmorSparsifier(block_size=16, num_iters=5, progress=False)
    >>> sparsifier.prepare(model, [{"tensor_fqn": "0.weight"}])
    >>> _ = model(torch.randn(256, 64))      # calibrate
    >>> model = sparsifier.convert(model)     # factorize and swap in ArmorTensor weights
    >>> type(model[0].weight).__name__
    'ArmorTensor'
"""

import logging as _logging


def _import_torchao_quietly() -> None:
    # torchao logs a warning per CUDA/MX extension it cannot load on a CPU-only build, and
    # torch warns about an Enum registration inside torchao: noise for our users.
    noisy = [_logging.getLogger("torchao"), _logging.getLogger("torch.utils._pytree")]
    levels = [lg.level for lg in noisy]
    for lg in noisy:
        lg.setLevel(_logging.ERROR)
    try:
        import torchao  # noqa: F401
        import torchao.quantization  # noqa: F401
    finally:
        for lg, level in zip(noisy, levels):
            lg.setLevel(level)


_import_torchao_quietly()

from torch_armor.config import ArmorConfig, SparsityPattern, parse_pattern  # noqa: E402
from torch_armor.engine.distributed import distributed_factorize, shared_statistics  # noqa: E402
from torch_armor.core.factorize import factorize  # noqa: E402
from torch_armor.core.factors import ArmorFactors  # noqa: E402
from torch_armor.core.proxy import nowag_prune, proxy_loss, relative_proxy_loss  # noqa: E402
from torch_armor.engine.runstore import RunMismatchError, RunStore, factorize_layers, hash_statistics  # noqa: E402
from torch_armor.tensor.quant import ArmorCoreConfig, dequantize_armor_core, quantize_armor_core  # noqa: E402  (registers the handler)
from torch_armor.tensor.serialization import load_pretrained, save_pretrained  # noqa: E402
from torch_armor.sparsifier import ArmorSparsifier, PruningSparsifier  # noqa: E402
from torch_armor.tensor.armor_tensor import ArmorTensor, armor_linear_from_factors  # noqa: E402

__all__ = [
    "ArmorConfig",
    "ArmorCoreConfig",
    "ArmorFactors",
    "ArmorSparsifier",
    "ArmorTensor",
    "PruningSparsifier",
    "RunMismatchError",
    "RunStore",
    "SparsityPattern",
    "armor_linear_from_factors",
    "dequantize_armor_core",
    "distributed_factorize",
    "factorize",
    "factorize_layers",
    "hash_statistics",
    "load_pretrained",
    "nowag_prune",
    "parse_pattern",
    "proxy_loss",
    "quantize_armor_core",
    "relative_proxy_loss",
    "save_pretrained",
    "shared_statistics",
]
__version__ = "0.1.0"
