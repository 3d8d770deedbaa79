"""``torch.ao.pruning``-style sparsifiers: statistics hooks → per-layer solve → weight swap.

:class:`ArmorSparsifier` factorizes every prepared linear with ARMOR;
:class:`PruningSparsifier` runs a baseline (magnitude, Wanda, NoWag-P, SparseGPT) through the
same ``prepare → calibrate → step → convert`` shell, so every method sees the same data.

The protocol:

1. ``prepare(model, config=None)`` attaches a forward pre-hook to every layer to prune
   (default: every ``nn.Linear`` except the output head and weights tied to an embedding).
2. Calibrate: run forward passes yourself. Each hook adds ``Σ x_j²`` per input channel (and
   ``XᵀX`` for SparseGPT) in float32, whatever the input dtype or shape; activations are never
   stored.
3. ``step()`` solves every layer not solved yet (progress bar, one log line per layer).
4. ``convert(model)`` swaps the weights in place (ARMOR: an
   :class:`~torch_armor.tensor.armor_tensor.ArmorTensor`; baselines: the pruned dense weight) and removes
   the hooks; ``squash_mask()`` instead writes plain dense approximations.

``state_dict()`` holds only tensors, strings and numbers (``torch.load(weights_only=True)``
reads it): the statistics and every finished layer, so a long run can be checkpointed and
resumed on a freshly prepared dense model without recalibrating or recomputing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn
from torch.ao.pruning import BaseSparsifier
from tqdm.auto import tqdm

from torch_armor.config import ArmorConfig, parse_pattern
from torch_armor.core.factorize import factorize
from torch_armor.core.factors import SCALAR_NAMES, ArmorFactors
from torch_armor.calibration.observer import ActSqNormObserver, LayerStatistics, decoder_linear_names
from torch_armor.core.proxy import check_layer_shape

__all__ = ["ArmorSparsifier", "PruningSparsifier"]

logger = logging.getLogger("torch_armor")

STATE_DICT_VERSION = 1
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ArmorConfig))
_MODULE_KEYS = ("module", "module_fqn", "tensor_name")  # filled in by BaseSparsifier.prepare


def _plain(value: Any) -> Any:
    """``value`` with dtypes/devices as strings, tensors on CPU: safe for ``weights_only`` loads."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class _CalibratedSparsifier(BaseSparsifier):
    """Shared shell: forward pre-hooks accumulate ``Σx²`` (and ``XᵀX`` if needed) per layer.

    Subclasses implement ``_check_layer``, ``_done``, ``update_mask``, ``approximation``,
    ``_result_state`` / ``_load_result`` and ``convert``.
    """

    track_xtx = False
    needs_statistics = True

    def __init__(self, defaults: Dict[str, Any], progress: bool = True) -> None:
        super().__init__(defaults=defaults)
        self.progress = bool(progress)
        self._observers: Dict[str, ActSqNormObserver] = {}
        self._converted = False

    # -- prepare -----------------------------------------------------------------------------
    def prepare(self, model: nn.Module, config: Optional[List[Dict[str, Any]]] = None) -> None:
        """Attach statistics hooks to the layers to prune (weights are not touched).

        Args:
            model: the dense model; modified in place (hooks only).
            config: ``None`` — every ``nn.Linear`` (subclasses included) except the output head
                (``model.get_output_embeddings()``) and any linear whose weight is tied to an
                embedding; or a list of ``{"tensor_fqn": "model.layers.0.mlp.up_proj.weight",
                <per-layer overrides>}``.

        Raises:
            ValueError: the model was already converted; a ``tensor_fqn`` names no
                ``nn.Linear`` weight; an unknown per-layer option; a layer whose shape the
                pattern (or block size) cannot serve — the message names the layer and the fix.
        """
        from torch_armor.tensor.armor_tensor import ArmorTensor

        if not isinstance(model, nn.Module):
            raise ValueError(f"prepare(model, ...) expects an nn.Module, got {type(model).__name__}")
        converted = [n for n, m in model.named_modules()
                     if isinstance(m, nn.Linear) and isinstance(m.weight, ArmorTensor)]
        if converted:
            raise ValueError(
                f"this model was already converted (layer {converted[0]!r} holds an ArmorTensor "
                "weight); prepare() needs the dense model: reload it"
            )
        if config is None:
            config = [{"tensor_fqn": f"{name}.weight"} for name in decoder_linear_names(model)]
            if not config:
                raise ValueError("no layers to prune: the model has no nn.Linear besides the output head")
        config = self._validate_config(config)
        # a second prepare() starts over: drop the hooks and results of the first
        self._remove_hooks()
        self._observers = {}
        self._converted = False
        self.groups = []
        self.state = defaultdict(dict)
        super().prepare(model, config)

    def _validate_config(self, config: Any) -> List[Dict[str, Any]]:
        if not isinstance(config, (list, tuple)) or not config:
            raise ValueError(
                "config must be None or a non-empty list like [{'tensor_fqn': 'layers.0.fc.weight'}, ...]"
            )
        allowed = {"tensor_fqn", *_MODULE_KEYS} | self._allowed_overrides()
        seen = set()
        out = []
        for entry in config:
            if not isinstance(entry, dict) or not isinstance(entry.get("tensor_fqn"), str):
                raise ValueError(
                    f"every config entry must be a dict with a 'tensor_fqn' string such as "
                    f"{{'tensor_fqn': 'layers.0.fc.weight'}}, got {entry!r}"
                )
            fqn = entry["tensor_fqn"]
            unknown = set(entry) - allowed
            if unknown:
                raise ValueError(
                    f"layer {fqn!r}: unknown per-layer options {sorted(unknown)}; "
                    f"valid: {sorted(self._allowed_overrides())}"
                )
            if fqn in seen:
                raise ValueError(f"layer {fqn!r} appears twice in the config; list each layer once")
            seen.add(fqn)
            out.append(dict(entry))
        return out

    def _allowed_overrides(self) -> set:
        return set(self.defaults)

    def _prepare(self, *args: Any, **kwargs: Any) -> None:
        for group in self.groups:  # check everything before attaching anything
            module, fqn = group["module"], group["tensor_fqn"]
            if module is None:
                raise ValueError(
                    f"layer {fqn!r}: the model has no module {group['module_fqn']!r}; tensor_fqn is "
                    "'<module name>.weight' with the name from model.named_modules()"
                )
            if not isinstance(module, nn.Linear) or group["tensor_name"] != "weight":
                raise ValueError(
                    f"layer {fqn!r}: only the 'weight' of an nn.Linear can be pruned, got "
                    f"{group['tensor_name']!r} of a {type(module).__name__}"
                )
            self._check_layer(group)
        if not self.needs_statistics:
            return
        try:
            for group in self.groups:
                obs = ActSqNormObserver(track_xtx=self.track_xtx)
                self._observers[group["tensor_fqn"]] = obs.attach(group["module"], group["module_fqn"])
        except Exception:
            self._remove_hooks()
            raise

    def _check_layer(self, group: Dict[str, Any]) -> None:
        pass

    def _remove_hooks(self) -> None:
        for obs in self._observers.values():
            obs.remove()

    def _finish(self) -> None:
        """Remove the hooks; keep ``Σx²`` (drop ``XᵀX``, ``d_in²`` floats per layer)."""
        for fqn in list(self._observers):
            stats = self.statistics(fqn)
            self.state[fqn]["stats"] = LayerStatistics(stats.act_sq_norm, stats.num_tokens, None)
            self._observers.pop(fqn).remove()

    # -- statistics --------------------------------------------------------------------------
    def _fqns(self) -> List[str]:
        return [g["tensor_fqn"] for g in self.groups]

    def statistics(self, fqn: str) -> LayerStatistics:
        """Statistics of one prepared layer: loaded ones (:meth:`load_state_dict`) plus live ones.

        Example::

            >>> lin = nn.Sequential(nn.Linear(8, 4))
            >>> sp = PruningSparsifier("wanda", progress=False)
            >>> sp.prepare(lin, [{"tensor_fqn": "0.weight"}])
            >>> _ = lin(torch.ones(2, 3, 8))
            >>> sp.statistics("0.weight").num_tokens
            6
        """
        if fqn not in self._fqns():
            raise KeyError(f"layer {fqn!r} was not prepared; prepared layers: {self._fqns()[:5]}...")
        saved: Optional[LayerStatistics] = self.state[fqn].get("stats")
        obs = self._observers.get(fqn)
        live = obs.statistics() if obs is not None and obs.num_tokens > 0 else None
        if saved is None and live is None:
            d_in = self._module(fqn).in_features
            zeros = torch.zeros(d_in, dtype=torch.float32)
            return LayerStatistics(zeros, 0, torch.zeros(d_in, d_in) if self.track_xtx else None)
        if saved is None or live is None:
            return live if saved is None else saved
        device = live.act_sq_norm.device
        xtx = None
        if saved.xtx is not None and live.xtx is not None:
            xtx = saved.xtx.to(device) + live.xtx
        return LayerStatistics(saved.act_sq_norm.to(device) + live.act_sq_norm,
                               saved.num_tokens + live.num_tokens, xtx)

    def _module(self, fqn: str) -> nn.Linear:
        for group in self.groups:
            if group["tensor_fqn"] == fqn:
                return group["module"]
        raise KeyError(fqn)

    def _require_statistics(self, fqn: str) -> LayerStatistics:
        stats = self.statistics(fqn)
        if stats.num_tokens == 0:
            raise ValueError(
                f"layer {fqn!r} saw no calibration data: run forward passes on calibration inputs "
                "(model(batch)) between prepare() and step(), or load_state_dict() a saved state"
            )
        if self.track_xtx and stats.xtx is None:
            raise ValueError(f"layer {fqn!r} has no XᵀX statistics (needed by SparseGPT): calibrate again")
        return stats

    # -- step --------------------------------------------------------------------------------
    def step(self) -> None:
        """Solve every prepared layer not solved yet (progress bar; resumes after a load).

        Raises:
            ValueError: nothing prepared, or a layer saw no calibration forward pass (checked
                for every layer before any work starts).
        """
        if not self.enable_mask_update:
            return
        if not self.groups:
            raise ValueError("nothing prepared: call prepare(model), then calibrate, before step()")
        pending = [g for g in self.groups if not self._done(g["tensor_fqn"])]
        if self.needs_statistics:
            for group in pending:  # fail fast, before hours of work, if any layer has no data
                self._require_statistics(group["tensor_fqn"])
        bar = tqdm(pending, desc=type(self).__name__, unit="layer", disable=not self.progress)
        with torch.no_grad():
            for group in bar:
                fqn = group["tensor_fqn"]
                bar.set_postfix_str(fqn.rsplit(".", 1)[0][-40:])
                try:
                    self.update_mask(**group)
                except ValueError as err:
                    if fqn in str(err):
                        raise
                    raise ValueError(f"layer {fqn!r}: {err}") from err
                self._after_layer(fqn)

    def _after_layer(self, fqn: str) -> None:
        pass

    def _done(self, fqn: str) -> bool:
        raise NotImplementedError

    def approximation(self, fqn: str) -> torch.Tensor:
        """The dense approximation of one solved layer's weight."""
        raise NotImplementedError

    def _solve_pending(self) -> None:
        """Run :meth:`step` if some layer is not solved yet; raise if it still is not."""
        if any(not self._done(fqn) for fqn in self._fqns()):
            self.step()
        unsolved = [fqn for fqn in self._fqns() if not self._done(fqn)]
        if unsolved:
            raise ValueError(
                f"layer {unsolved[0]!r} is not solved and step() did nothing (enable_mask_update is False); "
                "set sparsifier.enable_mask_update = True"
            )

    def _model_for(self, module: Optional[nn.Module]) -> nn.Module:
        model = getattr(self, "model", None)
        if module is None:
            module = model
        if module is None or not self.groups:
            raise ValueError("nothing prepared: call prepare(model) and calibrate before convert()")
        if module is not model:
            ids = {id(m) for m in module.modules()}
            if any(id(g["module"]) not in ids for g in self.groups):
                raise ValueError("convert(model) got a model that this sparsifier did not prepare")
        return module

    def _check_not_converted(self) -> None:
        from torch_armor.tensor.armor_tensor import ArmorTensor

        if self._converted:
            raise ValueError(
                "this model was already converted by this sparsifier; to convert another model, "
                "prepare() its dense weights first"
            )
        for group in self.groups:
            if isinstance(group["module"].weight, ArmorTensor):
                raise ValueError(f"layer {group['tensor_fqn']!r} was already converted (it holds an ArmorTensor)")

    def squash_mask(self, *args: Any, **kwargs: Any) -> None:
        """Write each layer's dense approximation into a plain ``nn.Parameter``; remove hooks.

        Runs :meth:`step` first for layers not solved yet. The result is an ordinary dense
        model (for export or evaluation); the weights keep their dtype, device and
        ``requires_grad``.
        """
        if args or kwargs:
            raise ValueError("squash_mask() takes no arguments (sparse_params are not kept)")
        self._model_for(None)
        self._solve_pending()
        for group in self.groups:
            module = group["module"]
            old = module.weight
            approx = self.approximation(group["tensor_fqn"]).to(device=old.device, dtype=old.dtype)
            module.weight = nn.Parameter(approx, requires_grad=old.requires_grad)
        self._finish()

    # -- save / resume -----------------------------------------------------------------------
    def _result_state(self, fqn: str) -> Optional[Dict[str, Any]]:
        raise NotImplementedError

    def _load_result(self, fqn: str, entry: Dict[str, Any]) -> None:
        raise NotImplementedError

    def _identity(self) -> Dict[str, Any]:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """Statistics and finished layers, as tensors, strings and numbers only.

        ``torch.save`` it and read it back with ``torch.load(path, weights_only=True)``.
        Layout: ``{"version", "sparsifier", "method", "config", "groups",
        "state": {tensor_fqn: {"act_sq_norm", "num_tokens", ["xtx"], [result...]}}}``.
        """
        state: Dict[str, Any] = {}
        for fqn in self._fqns():
            stats = self.statistics(fqn)
            entry: Dict[str, Any] = {}
            if stats.num_tokens > 0:
                entry["act_sq_norm"] = stats.act_sq_norm.detach().cpu()
                entry["num_tokens"] = int(stats.num_tokens)
                if stats.xtx is not None:
                    entry["xtx"] = stats.xtx.detach().cpu()
            result = self._result_state(fqn)
            if result is not None:
                entry.update(result)
            state[fqn] = entry
        groups = [_plain({k: v for k, v in g.items() if k not in _MODULE_KEYS}) for g in self.groups]
        return {"version": STATE_DICT_VERSION, **self._identity(), "groups": groups, "state": state}

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> None:
        """Restore statistics and finished layers into a sparsifier prepared on the same model.

        Layers with results are not recomputed by :meth:`step`; the others are solved from the
        loaded statistics (no new calibration needed). Forward passes run after loading add to
        the loaded statistics.

        Args:
            state_dict: from :meth:`state_dict` (possibly via ``torch.save``/``torch.load``).
            strict: require exactly the same prepared layers.
        """
        if not self.groups:
            raise ValueError("call prepare(model) on the dense model before load_state_dict() so layers can be matched")
        if self._converted:
            raise ValueError("this sparsifier already converted its model; prepare() a dense model, then load")
        if not isinstance(state_dict, dict) or "state" not in state_dict:
            raise ValueError("not a sparsifier state: expected the dict returned by state_dict()")
        mine_id, theirs_id = self._identity(), {k: state_dict.get(k) for k in ("sparsifier", "method")}
        if {k: mine_id[k] for k in theirs_id} != theirs_id:
            raise ValueError(
                f"this state comes from {theirs_id['sparsifier']}(method={theirs_id['method']!r}); "
                f"load it into the same kind of sparsifier, not {mine_id['sparsifier']}(method={mine_id['method']!r})"
            )
        mine, theirs = set(self._fqns()), set(state_dict["state"])
        if strict and mine != theirs:
            raise ValueError(
                f"the saved layers differ from the prepared ones: missing {sorted(mine - theirs)[:5]}, "
                f"unexpected {sorted(theirs - mine)[:5]}; prepare with the same config or pass strict=False"
            )
        saved_groups = {g.get("tensor_fqn"): g for g in state_dict.get("groups", [])}
        for group in self.groups:
            fqn = group["tensor_fqn"]
            if fqn not in state_dict["state"]:
                continue
            entry = state_dict["state"][fqn]
            module = group["module"]
            if "act_sq_norm" in entry:
                h = entry["act_sq_norm"]
                if tuple(h.shape) != (module.in_features,):
                    raise ValueError(
                        f"layer {fqn!r}: saved statistics have shape {tuple(h.shape)} but the layer has "
                        f"d_in={module.in_features}; the state comes from a different model"
                    )
                xtx = entry.get("xtx")
                if self.track_xtx and xtx is None:
                    raise ValueError(f"layer {fqn!r}: the saved state has no XᵀX (needed by SparseGPT)")
                self.state[fqn]["stats"] = LayerStatistics(h.float(), int(entry["num_tokens"]),
                                                           xtx.float() if self.track_xtx else None)
                if fqn in self._observers:
                    self._observers[fqn].reset()  # the loaded statistics replace what was seen
            self._load_result(fqn, entry)
            if self._done(fqn) and fqn in saved_groups:
                now = _plain({k: v for k, v in group.items() if k not in _MODULE_KEYS})
                diff = sorted(k for k in now if k in saved_groups[fqn] and saved_groups[fqn][k] != now[k])
                if diff:
                    logger.warning("%s: loaded result was computed with different settings %s; kept as is",
                                   fqn, {k: saved_groups[fqn][k] for k in diff})


class ArmorSparsifier(_CalibratedSparsifier):
    """ARMOR sparsifier following the ``torch.ao.pruning`` protocol.

    Args:
        config: an :class:`ArmorConfig`; its fields can also be given as keyword arguments,
            which override it (``ArmorSparsifier(cfg, num_iters=3)``). Unknown keywords raise.
        storage: how converted weights store the core (``"auto"``, ``"compact"``,
            ``"dense"``, ``"semi_structured"``; see :class:`~torch_armor.tensor.armor_tensor.ArmorTensor`).
        progress: show a tqdm progress bar in :meth:`step`.
        on_layer_done: called as ``on_layer_done(tensor_fqn, factors)`` after each layer is
            factorized in :meth:`step` (the factors are already stored), e.g. to checkpoint
            ``sparsifier.state_dict()``.

    Per-layer overrides in ``prepare(model, [{"tensor_fqn": ..., "block_size": 16}, ...])`` may
    set any :class:`ArmorConfig` field. Derived defaults follow: a layer overriding
    ``block_size`` gets that block size's default ``group_updates`` unless that is set too.
    Each layer's config is resolved with :meth:`ArmorConfig.for_layer` (``block_size="auto"``
    picks a block size per layer) and checked against its shape in ``prepare``.

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

    def __init__(
        self,
        config: Optional[ArmorConfig] = None,
        *,
        storage: str = "auto",
        progress: bool = True,
        on_layer_done: Optional[Callable[[str, ArmorFactors], None]] = None,
        **overrides: Any,
    ) -> None:
        from torch_armor.tensor.armor_tensor import STORAGES

        unknown = set(overrides) - set(_CONFIG_FIELDS)
        if unknown:
            raise ValueError(
                f"ArmorSparsifier: unknown ArmorConfig fields {sorted(unknown)}; valid: {list(_CONFIG_FIELDS)}"
            )
        if config is not None and not isinstance(config, ArmorConfig):
            raise ValueError(f"config must be an ArmorConfig or None, got {type(config).__name__}")
        if storage not in STORAGES + ("auto",):
            raise ValueError(f"storage must be one of {STORAGES + ('auto',)}, got {storage!r}")
        if on_layer_done is not None and not callable(on_layer_done):
            raise ValueError("on_layer_done must be a callable (tensor_fqn, factors) -> None")
        self.armor_config = dataclasses.replace(config or ArmorConfig(), **overrides)
        defaults = {k: getattr(self.armor_config, k) for k in _CONFIG_FIELDS}
        super().__init__(defaults=defaults, progress=progress)
        self.storage = storage
        self.on_layer_done = on_layer_done
        self._layer_configs: Dict[str, ArmorConfig] = {}

    def prepare(self, model: nn.Module, config: Optional[List[Dict[str, Any]]] = None) -> None:
        self._layer_configs = {}
        super().prepare(model, config)

    prepare.__doc__ = _CalibratedSparsifier.prepare.__doc__

    def config_for(self, fqn: str) -> ArmorConfig:
        """The :class:`ArmorConfig` used for one prepared layer (per-layer overrides applied)."""
        if fqn not in self._layer_configs:
            raise KeyError(f"layer {fqn!r} was not prepared")
        return self._layer_configs[fqn]

    def _resolve_config(self, group: Dict[str, Any]) -> ArmorConfig:
        """The config of one prepared layer: per-layer overrides applied, resolved for its shape."""
        fqn = group["tensor_fqn"]
        overrides = {k: group[k] for k in _CONFIG_FIELDS
                     if k in group and group[k] != getattr(self.armor_config, k)}
        try:
            cfg = dataclasses.replace(self.armor_config, **overrides)
        except ValueError as err:
            raise ValueError(f"layer {fqn!r}: invalid per-layer setting: {err}") from None
        d_out, d_in = group["module"].weight.shape
        try:
            return cfg.for_layer(d_out, d_in, name=fqn)
        except ValueError as err:
            raise ValueError(
                f"{err}. Override it for this layer: "
                f"prepare(model, [{{'tensor_fqn': '{fqn}', 'block_size': <one of those>}}, ...])"
            ) from None

    def _check_layer(self, group: Dict[str, Any]) -> None:
        self._layer_configs[group["tensor_fqn"]] = self._resolve_config(group)

    def _done(self, fqn: str) -> bool:
        return "factors" in self.state[fqn]

    @property
    def factors(self) -> Dict[str, ArmorFactors]:
        """Finished factors by ``tensor_fqn``."""
        return {fqn: self.state[fqn]["factors"] for fqn in self._fqns() if "factors" in self.state[fqn]}

    def update_mask(self, module: nn.Module, tensor_name: str, **kwargs: Any) -> None:
        """Factorize one layer (called by :meth:`step`)."""
        fqn = kwargs["tensor_fqn"]
        h = self._require_statistics(fqn).act_sq_norm
        weight = getattr(module, tensor_name).detach()
        start = time.perf_counter()
        factors = factorize(weight, h, self.config_for(fqn), name=fqn)
        seconds = time.perf_counter() - start
        self.state[fqn]["factors"] = factors
        self.state[fqn]["seconds"] = seconds
        logger.info("%s: relative proxy loss %.4f (%.1fs)", fqn, factors.relative_loss, seconds)

    def _after_layer(self, fqn: str) -> None:
        if self.on_layer_done is not None:
            self.on_layer_done(fqn, self.state[fqn]["factors"])

    def approximation(self, fqn: str) -> torch.Tensor:
        """``W_hat = A · core · B`` of one factorized layer, dense."""
        return self.state[fqn]["factors"].dense()

    def convert(self, module: Optional[nn.Module] = None, *, storage: Optional[str] = None,
                inplace: bool = True) -> nn.Module:
        """Swap every prepared weight for an :class:`~torch_armor.tensor.armor_tensor.ArmorTensor`, in place.

        Runs :meth:`step` first for layers not solved yet, removes the hooks and returns the
        model. Unlike ``BaseSparsifier.convert`` no copy is made (``inplace=False`` raises).

        Raises:
            ValueError: the model was already converted, or ``module`` was not prepared.
        """
        from torch_armor.tensor.armor_tensor import armor_linear_from_factors

        if not inplace:
            raise ValueError(
                "ArmorSparsifier.convert works in place; copy.deepcopy the model before prepare() to keep it"
            )
        model = self._model_for(module)
        self._check_not_converted()
        self._solve_pending()
        for group in self.groups:
            armor_linear_from_factors(group["module"], self.state[group["tensor_fqn"]]["factors"],
                                      storage=storage or self.storage)
        self._finish()
        self._converted = True
        return model

    # -- save / resume -----------------------------------------------------------------------
    def _identity(self) -> Dict[str, Any]:
        from torch_armor.engine.runstore import config_to_dict

        return {"sparsifier": "ArmorSparsifier", "method": "armor", "config": config_to_dict(self.armor_config)}

    def _result_state(self, fqn: str) -> Optional[Dict[str, Any]]:
        if "factors" not in self.state[fqn]:
            return None
        f: ArmorFactors = self.state[fqn]["factors"]
        factors: Dict[str, Any] = {**f.to_tensors(), **f.metadata()}
        return {"factors": factors, "seconds": float(self.state[fqn].get("seconds") or 0.0)}

    def _load_result(self, fqn: str, entry: Dict[str, Any]) -> None:
        if "factors" not in entry:
            return
        saved = dict(entry["factors"])
        if "pattern" not in saved:
            raise ValueError(f"layer {fqn!r}: saved factors lack ['pattern']")
        scalars = {k: saved.pop(k) for k in SCALAR_NAMES if k in saved}
        try:
            factors = ArmorFactors.from_tensors(saved, **scalars)
        except ValueError as err:
            raise ValueError(f"layer {fqn!r}: saved factors: {err}") from None
        shape = tuple(self._module(fqn).weight.shape)
        if tuple(factors.core.shape) != shape:
            raise ValueError(
                f"layer {fqn!r}: saved factors are for a {tuple(factors.core.shape)} weight, the layer is "
                f"{shape}; the state comes from a different model"
            )
        self.state[fqn]["factors"] = factors
        self.state[fqn]["seconds"] = entry.get("seconds")


_METHOD_OPTIONS: Dict[str, tuple] = {
    "magnitude": (),
    "wanda": (),
    "nowag": (),
    "sparsegpt": ("block_size", "damp", "compute_dtype"),
}
_METHODS = tuple(_METHOD_OPTIONS)


class PruningSparsifier(_CalibratedSparsifier):
    """Baseline pruning (``magnitude``, ``wanda``, ``nowag``, ``sparsegpt``) in the same shell.

    ``convert`` (like ``squash_mask``) writes the pruned weight — dense, with exact zeros —
    into each prepared layer, in place. Wanda and NoWag-P use ``Σx²``; SparseGPT also
    accumulates ``XᵀX`` per layer (``d_in²`` floats each); magnitude needs no calibration.

    Args:
        method: ``"magnitude"``, ``"wanda"``, ``"nowag"`` or ``"sparsegpt"``.
        pattern: ``"N:M"`` or ``"unstructured:F"`` (per-layer override: ``"pattern"``).
        progress: show a progress bar in :meth:`step`.
        **method_kwargs: SparseGPT only: ``block_size``, ``damp``, ``compute_dtype``
            (see :func:`torch_armor.core.baselines.sparsegpt_prune`); also overridable per layer.

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
        unknown = set(method_kwargs) - set(_METHOD_OPTIONS[method])
        if unknown:
            raise ValueError(
                f"PruningSparsifier({method!r}): unknown options {sorted(unknown)}; "
                f"valid: {list(_METHOD_OPTIONS[method]) or 'none'}"
            )
        pattern = str(parse_pattern(pattern))
        self.method = method
        self.track_xtx = method == "sparsegpt"
        self.needs_statistics = method != "magnitude"
        super().__init__(defaults={"pattern": pattern, **method_kwargs}, progress=progress)

    def _allowed_overrides(self) -> set:
        return {"pattern", *_METHOD_OPTIONS[self.method]}

    def _check_layer(self, group: Dict[str, Any]) -> None:
        d_out, d_in = group["module"].weight.shape
        pattern = group.get("pattern", self.defaults["pattern"])
        try:
            parse_pattern(pattern)
        except ValueError as err:
            raise ValueError(f"layer {group['tensor_fqn']!r}: {err}") from None
        check_layer_shape(d_out, d_in, pattern, None, name=group["tensor_fqn"])

    def _done(self, fqn: str) -> bool:
        return "pruned" in self.state[fqn]

    def update_mask(self, module: nn.Module, tensor_name: str, **kwargs: Any) -> None:
        """Prune one layer (called by :meth:`step`)."""
        from torch_armor.core import baselines
        from torch_armor.core.proxy import nowag_prune

        fqn = kwargs["tensor_fqn"]
        weight = getattr(module, tensor_name).detach()
        pattern = kwargs.get("pattern", self.defaults["pattern"])
        extra = {k: kwargs[k] for k in _METHOD_OPTIONS[self.method] if k in kwargs}
        start = time.perf_counter()
        if self.method == "magnitude":
            mask, pruned = baselines.magnitude_prune(weight, pattern)
        else:
            stats = self._require_statistics(fqn)
            h = stats.act_sq_norm.to(weight.device)
            if self.method == "wanda":
                mask, pruned = baselines.wanda_prune(weight, h, pattern)
            elif self.method == "nowag":
                mask, pruned = nowag_prune(weight, h, pattern)
            else:
                mask, pruned = baselines.sparsegpt_prune(weight, stats.xtx.to(weight.device), pattern, **extra)
        self.state[fqn]["mask"] = mask
        self.state[fqn]["pruned"] = pruned
        self.state[fqn]["seconds"] = time.perf_counter() - start
        logger.info("%s: %s pruned (%.1fs)", fqn, self.method, self.state[fqn]["seconds"])

    def approximation(self, fqn: str) -> torch.Tensor:
        """The pruned weight of one layer (dense, exact zeros off the mask)."""
        return self.state[fqn]["pruned"]

    def convert(self, module: Optional[nn.Module] = None, *, inplace: bool = True) -> nn.Module:
        """Write every pruned weight into its layer, in place (runs :meth:`step` if needed); returns the model."""
        if not inplace:
            raise ValueError(
                "PruningSparsifier.convert works in place; copy.deepcopy the model before prepare() to keep it"
            )
        model = self._model_for(module)
        self._check_not_converted()
        self.squash_mask()
        self._converted = True
        return model

    # -- save / resume -----------------------------------------------------------------------
    def _identity(self) -> Dict[str, Any]:
        return {"sparsifier": "PruningSparsifier", "method": self.method, "config": _plain(self.defaults)}

    def _result_state(self, fqn: str) -> Optional[Dict[str, Any]]:
        if "pruned" not in self.state[fqn]:
            return None
        s = self.state[fqn]
        return {"mask": s["mask"].detach().cpu(), "pruned": s["pruned"].detach().cpu(),
                "seconds": float(s.get("seconds") or 0.0)}

    def _load_result(self, fqn: str, entry: Dict[str, Any]) -> None:
        if "pruned" not in entry:
            return
        shape = tuple(self._module(fqn).weight.shape)
        if tuple(entry["pruned"].shape) != shape:
            raise ValueError(
                f"layer {fqn!r}: the saved pruned weight is {tuple(entry['pruned'].shape)}, the layer is {shape}"
            )
        self.state[fqn]["mask"] = entry["mask"]
        self.state[fqn]["pruned"] = entry["pruned"]
        self.state[fqn]["seconds"] = entry.get("seconds")
