"""torch_armor: ARMOR 2:4 semi-structured pruning for PyTorch models.

One entry point prunes a whole model, one decoder block at a time (each block calibrated on the
outputs of the already-pruned blocks before it)::

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from torch_armor import ArmorConfig, prune_model
    >>> llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=50))
    >>> report = prune_model(llama, torch.randint(0, 50, (4, 16)), "armor", ArmorConfig(num_iters=2),
    ...                      progress=False)
    >>> len(report.layers), round(report.overhead, 3)
    (14, 0.889)

The ``torch.ao.pruning`` protocol works on any model, with your own forward passes::

    >>> import torch
    >>> from torch import nn
    >>> from torch_armor import ArmorSparsifier
    >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    >>> sparsifier = ArmorSparsifier(block_size=16, num_iters=5, progress=False)
    >>> sparsifier.prepare(model, [{"tensor_fqn": "0.weight"}])
    >>> _ = model(torch.randn(256, 64))      # calibrate
    >>> model = sparsifier.convert(model)     # factorize and swap in ArmorTensor weights
    >>> type(model[0].weight).__name__
    'CompactArmorTensor'
"""

import logging as _logging


def _import_torchao_quietly() -> None:
    # torchao logs a warning per CUDA/MX extension it cannot load on a CPU-only build, and
    # torch warns about an Enum registration inside torchao: noise for our users. The
    # transformers quantizer machinery (torch_armor.hf) imports more of torchao: same treatment.
    noisy = [_logging.getLogger("torchao"), _logging.getLogger("torch.utils._pytree")]
    levels = [lg.level for lg in noisy]
    for lg in noisy:
        lg.setLevel(_logging.ERROR)
    try:
        import torchao  # noqa: F401
        import torchao.quantization  # noqa: F401
        import importlib

        import transformers.quantizers.auto  # noqa: F401

        # transformers imports these from its torchao integration; their Enum registrations
        # warn once per process, so take that once here, quietly
        for extra in ("torchao.prototype.mx_formats", "torchao.quantization.quantize_.common"):
            try:
                importlib.import_module(extra)
            except Exception:  # noqa: BLE001 - optional parts of torchao
                pass
    finally:
        for lg, level in zip(noisy, levels):
            lg.setLevel(level)


_import_torchao_quietly()

from torch_armor.config import ArmorConfig  # noqa: E402
from torch_armor.core.factorize import factorize  # noqa: E402
from torch_armor.core.factors import ArmorFactors  # noqa: E402
from torch_armor.engine.report import PruneReport  # noqa: E402
from torch_armor.engine.runner import BaselineConfig  # noqa: E402
from torch_armor.engine.runstore import RunMismatchError  # noqa: E402
from torch_armor.recipes.prune import prune_model  # noqa: E402
from torch_armor.sparsifier import ArmorSparsifier, PruningSparsifier  # noqa: E402
from torch_armor.tensor.armor_tensor import ArmorTensor  # noqa: E402
from torch_armor.tensor.quant import ArmorCoreConfig  # noqa: E402  (registers the torchao handler)
from torch_armor.tensor.serialization import load_pretrained, save_pretrained  # noqa: E402
from torch_armor.hf import attach_quantizer  # noqa: E402  (registers quant_method "armor" with transformers)
from torch_armor.tensor.finetune import enable_finetuning, model_size  # noqa: E402

# What a user needs; the math and the plumbing stay importable from their subpackages
# (torch_armor.core, .calibration, .tensor, .engine, .recipes).
__all__ = [
    "ArmorConfig",
    "ArmorCoreConfig",
    "ArmorFactors",
    "ArmorSparsifier",
    "ArmorTensor",
    "attach_quantizer",
    "enable_finetuning",
    "BaselineConfig",
    "PruneReport",
    "PruningSparsifier",
    "RunMismatchError",
    "factorize",
    "load_pretrained",
    "model_size",
    "prune_model",
    "save_pretrained",
]
__version__ = "0.1.0"
