"""``torch.ao.pruning``-style sparsifiers: statistics hooks → per-layer solve → weight swap.

:class:`ArmorSparsifier` factorizes every prepared linear with ARMOR;
:class:`PruningSparsifier` runs a baseline (magnitude, Wanda, NoWag-P, SparseGPT) through the
same ``prepare → calibrate → step → convert`` shell, so every method sees the same data.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torch.ao.pruning import BaseSparsifier
from tqdm.auto import tqdm

from .config import ArmorConfig, parse_pattern
from .factorize import factorize
from .factors import ArmorFactors
from .observer import ActSqNormObserver, decoder_linear_names
from .proxy import check_layer_shape

__all__ = ["ArmorSparsifier", "PruningSparsifier"]

logger = logging.getLogger("torch_armor")
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(ArmorConfig)}
_FACTOR_TENSORS = ("a_blocks", "core", "b_blocks", "mask", "history", "history_iters", "history_time_s")


class _CalibratedSparsifier(BaseSparsifier):
    """Shared shell: forward pre-hooks accumulate ``Σx²`` (and ``XᵀX`` if needed) per layer."""

    track_xtx = False

    def __init__(self, defaults: Dict[str, Any], progress: bool = True) -> None:
        super().__init__(defaults=defaults)
        self.progress = progress
        self._observers: Dict[str, ActSqNormObserver] = {}
        self._converted = False

    # -- prepare -----------------------------------------------------------------------------
    def prepare(self, model: nn.Module, config: Optional[List[Dict[str, Any]]] = None) -> None:
        """Attach statistics hooks to the layers to prune.

        Args:
            model: the model; modified in place (hooks only, weights untouched).
            config: ``None`` — every ``nn.Linear`` except the output head and weights tied to
                an embedding; or a list of ``{"tensor_fqn": "model.layers.0.mlp.up_proj.weight",
                <per-layer overrides>}``.
        """
        from .tensor import ArmorTensor

        if any(isinstance(m.weight, ArmorTensor) for m in model.modules() if isinstance(m, nn.Linear)):
            raise ValueError("this model already holds ARMOR weights (it was converted); prepare the dense model")
        if config is None:
            config = [{"tensor_fqn": f"{name}.weight"} for name in decoder_linear_names(model)]
        if not config:
            raise ValueError("no layers to prune: the model has no nn.Linear besides the output head")
        for entry in config:
            unknown = set(entry) - {"tensor_fqn", "module", "tensor_name", "module_fqn"} - self._allowed_overrides()
            if unknown:
                raise ValueError(f"{entry.get('tensor_fqn')}: unknown per-layer options {sorted(unknown)}")
        self.groups, self.state = [], type(self.state)(dict)
        super().prepare(model, config)

    def _allowed_overrides(self) -> set:
        return set(self.defaults)

    def _prepare(self, *args: Any, **kwargs: Any) -> None:
        for group in self.groups:
            module, fqn = group["module"], group["tensor_fqn"]
            if not isinstance(module, nn.Linear) or group["tensor_name"] != "weight":
                raise ValueError(f"{fqn}: only nn.Linear weights can be pruned, got {type(module).__name__}")
            self._check_layer(group)
            self._observers[fqn] = ActSqNormObserver(track_xtx=self.track_xtx).attach(module, group["module_fqn"])

    def _check_layer(self, group: Dict[str, Any]) -> None:
        pass

    def _remove_hooks(self) -> None:
        for obs in self._observers.values():
            obs.remove()

    def statistics(self, fqn: str):
        """Accumulated statistics of one prepared layer (``act_sq_norm``, ``num_tokens``, ``xtx``)."""
        if fqn in self._observers:
            return self._observers[fqn].statistics()
        saved = self.state[fqn].get("act_sq_norm")
        if saved is None:
            raise KeyError(f"{fqn} was not prepared")
        return saved

    def _act_sq_norm(self, fqn: str) -> torch.Tensor:
        if fqn in self._observers:
            obs = self._observers[fqn]
            if obs.statistics().num_tokens == 0:
                raise ValueError(
                    f"layer {fqn!r} saw no calibration data: run forward passes on calibration "
                    "inputs between prepare() and step()"
                )
            return obs.act_sq_norm
        if "act_sq_norm" in self.state[fqn]:
            return self.state[fqn]["act_sq_norm"]
        raise ValueError(f"layer {fqn!r} has no statistics: call prepare() and calibrate first")

    # -- step --------------------------------------------------------------------------------
    def step(self, use_path: bool = True) -> None:
        """Solve every prepared layer not solved yet (progress bar; resumes after a load)."""
        if not self.groups:
            raise ValueError("nothing prepared: call prepare(model) and calibrate before step()")
        pending = [g for g in self.groups if not self._done(g["tensor_fqn"])]
        for group in pending:  # fail fast, before hours of work, if any layer has no data
            self._act_sq_norm(group["tensor_fqn"])
        bar = tqdm(pending, desc=type(self).__name__, unit="layer", disable=not self.progress)
        with torch.no_grad():
            for group in bar:
                bar.set_postfix_str(group["tensor_fqn"].rsplit(".", 1)[0][-40:])
                self.update_mask(**group)

    def _done(self, fqn: str) -> bool:
        raise NotImplementedError

    def _layer_config(self, group: Dict[str, Any]) -> Dict[str, Any]:
        return {k: group[k] for k in self.defaults if k in group}

    def squash_mask(self, *args: Any, **kwargs: Any) -> None:
        """Write each solved layer's approximation into its plain dense weight; remove hooks."""
        if any(not self._done(g["tensor_fqn"]) for g in self.groups):
            self.step()
        for group in self.groups:
            module = group["module"]
            approx = self.approximation(group["tensor_fqn"]).to(module.weight.dtype)
            module.weight = nn.Parameter(approx.to(module.weight.device), requires_grad=module.weight.requires_grad)
        self._remove_hooks()


class ArmorSparsifier(_CalibratedSparsifier):
    """ARMOR sparsifier following the ``torch.ao.pruning`` protocol.

    Args:
        config: an :class:`ArmorConfig` (fields can also be given as keyword arguments,
            which override it).
        storage: how converted weights store the core (see :class:`~torch_armor.tensor.ArmorTensor`).
        progress: show a progress bar in :meth:`step`.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 10))
        >>> sparsifier = ArmorSparsifier(block_size=16, optimizer="bcd", num_iters=5, progress=False)
        >>> sparsifier.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
        >>> _ = model(torch.randn(128, 32))          # calibrate
        >>> model = sparsifier.convert(model)         # step() + swap the weights
        >>> type(model[0].weight).__name__, sparsifier.factors["0.weight"].relative_loss < 1
        ('ArmorTensor', True)
    """

    def __init__(self, config: Optional[ArmorConfig] = None, *, storage: str = "auto", progress: bool = True,
                 **overrides: Any) -> None:
        unknown = set(overrides) - _CONFIG_FIELDS
        if unknown:
            raise ValueError(f"unknown ArmorConfig fields {sorted(unknown)}; valid: {sorted(_CONFIG_FIELDS)}")
        base = config or ArmorConfig()
        self.armor_config = dataclasses.replace(base, **overrides) if overrides else base
        defaults = {k: getattr(self.armor_config, k) for k in _CONFIG_FIELDS}
        super().__init__(defaults=defaults, progress=progress)
        self.storage = storage

    def _config_for(self, group: Dict[str, Any]) -> ArmorConfig:
        overrides = {k: group[k] for k in _CONFIG_FIELDS if k in group and group[k] != getattr(self.armor_config, k)}
        return dataclasses.replace(self.armor_config, **overrides) if overrides else self.armor_config

    def _check_layer(self, group: Dict[str, Any]) -> None:
        cfg = self._config_for(group)
        d_out, d_in = group["module"].weight.shape
        fqn = group["tensor_fqn"]
        try:
            check_layer_shape(d_out, d_in, cfg.pattern, cfg.block_size, name=fqn)
        except ValueError as err:
            raise ValueError(
                f"{err}. Override it for this layer: "
                f"prepare(model, [{{'tensor_fqn': '{fqn}', 'block_size': ...}}, ...])"
            ) from None

    def _done(self, fqn: str) -> bool:
        return "factors" in self.state[fqn]

    @property
    def factors(self) -> Dict[str, ArmorFactors]:
        """Finished factors by ``tensor_fqn``."""
        return {fqn: s["factors"] for fqn, s in self.state.items() if "factors" in s}

    def update_mask(self, module: nn.Module, tensor_name: str, **kwargs: Any) -> None:
        """Factorize one layer (called by :meth:`step`)."""
        fqn = kwargs["tensor_fqn"]
        h = self._act_sq_norm(fqn)
        cfg = self._config_for(kwargs)
        start = time.perf_counter()
        factors = factorize(getattr(module, tensor_name).detach(), h, cfg, name=fqn)
        self.state[fqn]["factors"] = factors
        self.state[fqn]["seconds"] = time.perf_counter() - start
        logger.info("%s: relative proxy loss %.4f (%.1fs)", fqn, factors.relative_loss, self.state[fqn]["seconds"])

    def approximation(self, fqn: str) -> torch.Tensor:
        return self.state[fqn]["factors"].dense()

    def convert(self, module: Optional[nn.Module] = None, *args: Any, storage: Optional[str] = None,
                **kwargs: Any) -> nn.Module:
        """Swap every prepared weight for an :class:`ArmorTensor`, in place; returns the model.

        Runs :meth:`step` first for layers not solved yet, and removes the hooks.
        """
        from .tensor import armor_linear_from_factors

        model = module if module is not None else getattr(self, "model", None)
        if model is None:
            raise ValueError("convert(model): no model given and none prepared")
        if self._converted:
            raise ValueError("this sparsifier already converted its model; prepare a dense model to convert again")
        if any(not self._done(g["tensor_fqn"]) for g in self.groups):
            self.step()
        for group in self.groups:
            armor_linear_from_factors(group["module"], self.state[group["tensor_fqn"]]["factors"],
                                      storage=storage or self.storage)
        self._remove_hooks()
        self._converted = True
        return model

    # -- save / resume -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Statistics and finished factors of every layer (tensors only, no modules)."""
        state: Dict[str, Any] = {}
        for group in self.groups:
            fqn = group["tensor_fqn"]
            entry: Dict[str, Any] = {}
            try:
                entry["act_sq_norm"] = self._act_sq_norm(fqn).detach().cpu()
            except ValueError:
                pass
            if "factors" in self.state[fqn]:
                f = self.state[fqn]["factors"]
                entry["factors"] = {k: getattr(f, k).detach().cpu() for k in _FACTOR_TENSORS}
                entry["factors"].update(pattern=f.pattern, nowag_loss=f.nowag_loss, best_iter=f.best_iter)
                entry["seconds"] = self.state[fqn].get("seconds")
            state[fqn] = entry
        groups = [{k: v for k, v in g.items() if k not in ("module", "tensor_name", "module_fqn")} for g in self.groups]
        return {"state": state, "groups": groups, "config": dataclasses.asdict(self.armor_config) | {"dtype": str(self.armor_config.dtype)}}

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> None:
        """Restore statistics and finished factors into a sparsifier prepared on the same model.

        Layers with factors are not recomputed by :meth:`step`; the others use the loaded
        statistics (no new calibration needed).
        """
        if not self.groups:
            raise ValueError("call prepare(model) before load_state_dict() so layers can be matched")
        mine = {g["tensor_fqn"] for g in self.groups}
        theirs = set(state_dict["state"])
        if strict and mine != theirs:
            raise ValueError(f"layers differ: missing {sorted(mine - theirs)[:5]}, unexpected {sorted(theirs - mine)[:5]}")
        for fqn, entry in state_dict["state"].items():
            if fqn not in mine:
                continue
            if "act_sq_norm" in entry:
                self.state[fqn]["act_sq_norm"] = entry["act_sq_norm"]
                self._observers.pop(fqn).remove() if fqn in self._observers else None
            if "factors" in entry:
                f = dict(entry["factors"])
                self.state[fqn]["factors"] = ArmorFactors(**f)
                self.state[fqn]["seconds"] = entry.get("seconds")


_METHODS = ("magnitude", "wanda", "nowag", "sparsegpt")


class PruningSparsifier(_CalibratedSparsifier):
    """Baseline pruning (``magnitude``, ``wanda``, ``nowag``, ``sparsegpt``) in the same shell.

    ``convert`` writes the pruned weight (dense with zeros) into each prepared layer.
    SparseGPT also accumulates ``XᵀX`` per layer (``d_in²`` floats each).

    Example::

        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
        >>> sparsifier = PruningSparsifier("wanda", pattern="2:4", progress=False)
        >>> sparsifier.prepare(model, [{"tensor_fqn": "0.weight"}])
        >>> _ = model(torch.randn(64, 16))
        >>> model = sparsifier.convert(model)
        >>> float((model[0].weight == 0).float().mean())
        0.5
    """

    def __init__(self, method: str, pattern: str = "2:4", *, progress: bool = True, **method_kwargs: Any) -> None:
        if method not in _METHODS:
            raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
        parse_pattern(pattern)
        self.method = method
        self.track_xtx = method == "sparsegpt"
        super().__init__(defaults={"pattern": pattern, **method_kwargs}, progress=progress)

    def _check_layer(self, group: Dict[str, Any]) -> None:
        d_out, d_in = group["module"].weight.shape
        check_layer_shape(d_out, d_in, group.get("pattern", self.defaults["pattern"]), None, name=group["tensor_fqn"])

    def _done(self, fqn: str) -> bool:
        return "pruned" in self.state[fqn]

    def update_mask(self, module: nn.Module, tensor_name: str, **kwargs: Any) -> None:
        from . import baselines
        from .proxy import nowag_prune

        fqn = kwargs["tensor_fqn"]
        weight = getattr(module, tensor_name).detach()
        pattern = kwargs.get("pattern", self.defaults["pattern"])
        extra = {k: v for k, v in kwargs.items() if k in self.defaults and k != "pattern"}
        start = time.perf_counter()
        if self.method == "magnitude":
            mask, pruned = baselines.magnitude_prune(weight, pattern)
        elif self.method == "wanda":
            mask, pruned = baselines.wanda_prune(weight, self._act_sq_norm(fqn), pattern)
        elif self.method == "nowag":
            mask, pruned = nowag_prune(weight, self._act_sq_norm(fqn).to(weight.device), pattern)
        else:
            self._act_sq_norm(fqn)
            xtx = self._observers[fqn].xtx
            mask, pruned = baselines.sparsegpt_prune(weight, xtx, pattern, **extra)
        self.state[fqn]["mask"] = mask
        self.state[fqn]["pruned"] = pruned
        self.state[fqn]["seconds"] = time.perf_counter() - start

    def approximation(self, fqn: str) -> torch.Tensor:
        return self.state[fqn]["pruned"]

    def convert(self, module: Optional[nn.Module] = None, *args: Any, **kwargs: Any) -> nn.Module:
        """Write every pruned weight into its layer, in place; returns the model."""
        model = module if module is not None else getattr(self, "model", None)
        if model is None:
            raise ValueError("convert(model): no model given and none prepared")
        self.squash_mask()
        for group in self.groups:  # free XᵀX etc.
            self._observers.pop(group["tensor_fqn"], None)
        return model
