"""torch_armor: ARMOR 2:4 semi-structured pruning for PyTorch models.

One entry point prunes a whole model, one decoder block at a time (each block calibrated on the
outputs of the already-pruned blocks before it)::

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from torch_armor import ArmorConfig, PruneOptions, prune_model
    >>> from torch_armor.config.armor import BcdConfig
    >>> llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=50))
    >>> report = prune_model(llama, torch.randint(0, 50, (4, 16)), ArmorConfig(optimizer=BcdConfig(iters=2)),
    ...                      options=PruneOptions(progress=False))
    >>> len(report.layers), round(report.overhead, 3)
    (14, 0.889)

The config's type is the method: ``SparseGPTConfig()``, ``WandaConfig()``, ``NoWagConfig()`` and
``MagnitudeConfig()`` run the baselines through the same call.

The ``torch.ao.pruning`` protocol works on any model, with your own forward passes, one sparsifier
whatever the config::

    >>> import torch
    >>> from torch import nn
    >>> from torch_armor import ArmorSparsifier
    >>> model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    >>> sparsifier = ArmorSparsifier(ArmorConfig(block_size=16, optimizer=BcdConfig(iters=5)), progress=False)
    >>> sparsifier.prepare(model, [{"tensor_fqn": "0.weight"}])
    >>> _ = model(torch.randn(256, 64))      # calibrate
    >>> model = sparsifier.convert(model)     # factorize and swap in ArmorTensor weights
    >>> type(model[0].weight).__name__
    'CompactArmorTensor'

``save_pretrained(model, directory)`` writes the Hugging Face format (``AutoModelForCausalLM.from_pretrained``
reads it after ``import torch_armor``) and ``load_pretrained(directory)`` reads it back, checked.
"""

import importlib as _importlib

from torch_armor import _quiet


# The front doors, by the module that defines each (15 at most): one call prunes a model, the
# config's type is the method, one sparsifier serves the torch.ao protocol whatever the config, one
# function saves (the Hugging Face format) and one loads. Everything else is imported from the module
# where it lives: nested configs (BcdConfig, RefineConfig, …) from torch_armor.config.armor, the
# per-layer math from torch_armor.core, the tensor plumbing from torch_armor.tensor.
_EXPORTS = {
    "prune_model": "torch_armor.engine.prune",
    "PruneOptions": "torch_armor.engine.options",
    "PruneReport": "torch_armor.engine.report",
    "ArmorConfig": "torch_armor.config.armor",
    "SparseGPTConfig": "torch_armor.config.methods",
    "WandaConfig": "torch_armor.config.methods",
    "NoWagConfig": "torch_armor.config.methods",
    "MagnitudeConfig": "torch_armor.config.methods",
    "ArmorSparsifier": "torch_armor.sparsifier",
    "save_pretrained": "torch_armor.format.serialization",
    "load_pretrained": "torch_armor.format.serialization",
    "ArmorTensor": "torch_armor.tensor.armor_tensor",
    "ArmorCoreConfig": "torch_armor.tensor.quant",  # (registers the torchao handler)
    "enable_finetuning": "torch_armor.tensor.finetune",
    "evaluate": "torch_armor.recipes.harness",  # lm-evaluation-harness: the eval extra
}
# imported for what importing them registers: quant_method "armor" with transformers
_REGISTERS = ("torch_armor.baselines", "torch_armor.armor", "torch_armor.format.hf")  # the methods register with the engine; the format with transformers
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def _load() -> None:
    """Import everything ``import torch_armor`` promises, registrations with torchao and
    transformers included. It runs at every import of torch_armor or of any of its modules (the
    package is imported first), whatever ``sys.argv`` says, so the registrations never depend on
    how the process was started or what it imported first."""
    _quiet.import_torchao_quietly()
    for module in _REGISTERS:
        _importlib.import_module(module)
    for name, module in _EXPORTS.items():
        globals()[name] = getattr(_importlib.import_module(module), name)


_load()
