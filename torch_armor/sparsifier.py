"""The ``torch.ao.pruning``-style sparsifier of every method: statistics hooks → per-layer solve → weight swap.

:class:`ArmorSparsifier` takes any method config, like :func:`~torch_armor.prune_model`: the
config's type is the method. :class:`~torch_armor.config.armor.ArmorConfig` factorizes every prepared
linear into an :class:`~torch_armor.tensor.armor_tensor.ArmorTensor`; a baseline
(:class:`~torch_armor.config.methods.MagnitudeConfig`, ``WandaConfig``, ``NoWagConfig``,
``SparseGPTConfig``) writes the pruned dense weight. Every method sees the same data through the
same ``prepare → calibrate → step → convert`` shell, and each layer is solved by the one per-layer
runner, :func:`~torch_armor.engine.runner.solve_layer`, and written back with
:meth:`~torch_armor.engine.runner.LayerSolution.apply`.

The protocol:

1. ``prepare(model, config=None)`` attaches a forward pre-hook to every layer to prune
   (default: every ``nn.Linear`` except the output head and weights tied to an embedding) and
   records a sha256 of each prepared dense weight.
2. Calibrate: run forward passes yourself. Each hook adds ``Σ x_j²`` per input channel (and
   ``XᵀX`` where the method needs it: SparseGPT, ARMOR's refinement) in float32, whatever the input dtype or shape; activations are never
   stored. Padded batches: call ``sparsifier.set_attention_mask(mask)`` before each forward
   (``(batch, seq_len)``, 0 = pad; give the model the same mask) and pad positions are left out of
   every statistic; ``set_attention_mask(None)`` counts every position again.
3. ``step()`` solves every layer not solved yet (progress bar, one log line per layer).
4. ``convert(model)`` swaps the weights in place (ARMOR: an
   :class:`~torch_armor.tensor.armor_tensor.ArmorTensor`; baselines: the pruned dense weight) and removes
   the hooks; ``squash_mask()`` instead writes plain dense approximations.

``state_dict()`` holds only tensors, strings and numbers (``torch.load(weights_only=True)``
reads it): the statistics, every finished layer and the weight hashes, so a long run can be
checkpointed and resumed on a freshly prepared copy of the same dense model without
recalibrating or recomputing; a state from other weights, or of another method, is refused.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from torch import nn

from torch_armor.calibrated_sparsifier import CalibratedSparsifier
from torch_armor.config.armor import ArmorConfig
from torch_armor.core.factors import ArmorFactors
from torch_armor.engine.runner import LayerSolution
from torch_armor.errors import ArmorInputError
from torch_armor.sparsifier_state import STATE_DICT_VERSION
from torch_armor.tensor.armor_tensor import STORAGES
from torch_armor.format.hf import attach_quantizer

__all__ = ["ArmorSparsifier", "STATE_DICT_VERSION"]

class ArmorSparsifier(CalibratedSparsifier):
    """The sparsifier of every method, following the ``torch.ao.pruning`` protocol.

    Args:
        config: a method config, whose type is the method (default ``ArmorConfig()``):
            :class:`~torch_armor.config.armor.ArmorConfig` converts to ArmorTensor weights;
            ``SparseGPTConfig``, ``WandaConfig``, ``NoWagConfig`` and ``MagnitudeConfig`` write the
            pruned dense weights (with exact zeros). SparseGPT also accumulates ``XᵀX`` per layer
            (``d_in²`` floats each); magnitude needs no calibration.
        storage: how converted ArmorTensor weights store the core (``"auto"``, ``"compact"``,
            ``"dense"``, ``"semi_structured"``; see :class:`~torch_armor.tensor.armor_tensor.ArmorTensor`).
        progress: show a tqdm progress bar in :meth:`step`.
        strict: refuse, in ``prepare``, a layer the settings do not fit (the message names it and the
            block sizes that fit). By default such a layer is fitted as :func:`~torch_armor.prune_model`
            fits it: ARMOR with an integer block size gives it the largest block size that divides it
            within ``max_overhead``; a layer nothing fits (or a pattern whose ``M`` does not divide its
            input width) stays dense and is not prepared. Both are said in one warning and listed in
            :attr:`unfit_layers`.
        on_layer_done: called as ``on_layer_done(tensor_fqn, solution)`` after each layer is solved
            in :meth:`step` (the :class:`~torch_armor.engine.runner.LayerSolution` is already
            stored: ``solution.payload``: the ``ArmorFactors`` for ARMOR, the pruned weight for a baseline), e.g. to
            checkpoint ``sparsifier.state_dict()``.

    Per-layer overrides in ``prepare(model, [{"tensor_fqn": ..., "block_size": 16}, ...])`` may
    set any field of the config (e.g. a baseline's ``"pattern"``). For ARMOR, derived defaults
    follow: a layer overriding ``block_size`` gets that block size's default ``group_updates``
    unless that is set too. Each layer's config is fitted to its shape in ``prepare`` as
    :func:`~torch_armor.prune_model` fits it (see ``strict``) and resolved with the config's
    ``for_layer`` (``block_size="auto"`` picks a block size per layer). Block reconstruction needs decoder blocks and distillation the whole model: the
    sparsifier, which sees layers, skips both.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> from torch_armor.config.armor import BcdConfig
        >>> model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 10))
        >>> sparsifier = ArmorSparsifier(ArmorConfig(block_size=16, optimizer=BcdConfig(iters=5)), progress=False)
        >>> sparsifier.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
        >>> _ = model(torch.randn(128, 32))          # calibrate
        >>> model = sparsifier.convert(model)         # step() + swap the weights
        >>> type(model[0].weight).__name__, sparsifier.factors["0.weight"].relative_loss < 1
        ('CompactArmorTensor', True)

    The same class runs a baseline::

        >>> from torch_armor.config.methods import WandaConfig
        >>> model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
        >>> sparsifier = ArmorSparsifier(WandaConfig(pattern="2:4"), progress=False)
        >>> sparsifier.prepare(model, [{"tensor_fqn": "0.weight"}])
        >>> _ = model(torch.randn(64, 16))
        >>> model = sparsifier.convert(model)
        >>> type(model[0].weight).__name__, float((model[0].weight == 0).float().mean())
        ('Parameter', 0.5)
    """

    def __init__(
        self,
        config: Any = None,
        *,
        storage: str = "auto",
        progress: bool = True,
        strict: bool = False,
        on_layer_done: Optional[Callable[[str, LayerSolution], None]] = None,
    ) -> None:
        if storage not in STORAGES + ("auto",):
            raise ArmorInputError(f"storage must be one of {STORAGES + ('auto',)}, got {storage!r}")
        if on_layer_done is not None and not callable(on_layer_done):
            raise ArmorInputError("on_layer_done must be a callable (tensor_fqn, solution) -> None")
        super().__init__(ArmorConfig() if config is None else config, progress=progress, strict=strict)
        self.storage = storage
        self.on_layer_done = on_layer_done

    @property
    def method_config(self) -> Any:
        """The config every layer starts from (before its per-layer overrides)."""
        return self._base_config

    @property
    def factors(self) -> Dict[str, ArmorFactors]:
        """Finished ARMOR factors by ``tensor_fqn`` (empty for a baseline, which has none)."""
        return {fqn: sol.payload for fqn, sol in self.solutions.items() if isinstance(sol.payload, ArmorFactors)}

    def _after_layer(self, fqn: str) -> None:
        if self.on_layer_done is not None:
            self.on_layer_done(fqn, self.state[fqn]["solution"])

    def convert(self, module: Optional[nn.Module] = None, *, storage: Optional[str] = None,
                inplace: bool = True) -> nn.Module:
        """Write every solved layer into the model, in place: an
        :class:`~torch_armor.tensor.armor_tensor.ArmorTensor` weight for ARMOR (its core stored as
        ``storage``, default the sparsifier's), the pruned dense weight for a baseline.

        Runs :meth:`step` first for layers not solved yet, removes the hooks and returns the
        model. Unlike ``BaseSparsifier.convert`` no copy is made (``inplace=False`` raises).

        Raises:
            ArmorInputError: the model was already converted, or ``module`` was not prepared.
        """
        if storage is not None and storage not in STORAGES + ("auto",):
            raise ArmorInputError(f"storage must be one of {STORAGES + ('auto',)}, got {storage!r}")
        model = self._convert(module, inplace, storage or self.storage)
        return attach_quantizer(model)  # with ArmorTensor weights, model.save_pretrained writes the ARMOR format
