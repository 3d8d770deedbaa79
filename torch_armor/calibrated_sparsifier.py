"""The method-blind shell of :class:`~torch_armor.sparsifier.ArmorSparsifier`, the ``torch.ao``-style sparsifier.

:class:`CalibratedSparsifier` attaches statistics hooks in ``prepare``, solves each layer with
the one per-layer runner (:func:`~torch_armor.engine.runner.solve_layer`: the base config's
method) in ``step``, writes results with :meth:`~torch_armor.engine.runner.LayerSolution.apply`
in ``convert``, and saves / restores statistics and finished layers. It takes any method config
(an :class:`~torch_armor.config.armor.ArmorConfig` or a baseline's); a layer may override the
config's fields in ``prepare``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.ao.pruning import BaseSparsifier

from torch_armor.calibration.observer import ActSqNormObserver, LayerStatistics, decoder_linear_names, set_token_mask
from torch_armor.config.serialized import config_changes, config_to_dict
from torch_armor.core.factors import ArmorFactors
from torch_armor.engine.fit import fit_layers, unfit_warning
from torch_armor.engine.identity import hash_tensors
from torch_armor.engine.methods import Method, method_for
from torch_armor.engine.runner import LayerSolution, solve_layer
from torch_armor.errors import ArmorInputError
from torch_armor.sparsifier_state import (MODULE_KEYS, STATE_DICT_VERSION, solution_from_state,
                                          solution_state)
from torch_armor.tensor.armor_tensor import ArmorTensor
from torch_armor.progress import tqdm

__all__ = ["CalibratedSparsifier", "STATE_DICT_VERSION"]

logger = logging.getLogger("torch_armor")

class CalibratedSparsifier(BaseSparsifier):
    """Shared shell: forward pre-hooks accumulate ``Σx²`` (and ``XᵀX`` if needed) per layer;
    every layer is solved by :func:`~torch_armor.engine.runner.solve_layer`.

    Args:
        base_config: the method config of every layer (its type is the method).
        progress: a progress bar in :meth:`step`.
        strict: refuse a layer the settings do not fit instead of fitting it as
            :func:`~torch_armor.prune_model` does (:func:`~torch_armor.engine.fit.fit_layers`).
    """

    def __init__(self, base_config: Any, progress: bool = True, strict: bool = False) -> None:
        self.method: Method = method_for(base_config)
        self._base_config = base_config
        fields = tuple(f.name for f in dataclasses.fields(base_config))
        self._options = fields
        super().__init__(defaults={k: getattr(base_config, k) for k in fields})
        self.progress = bool(progress)
        self.strict = bool(strict)
        #: ``{tensor_fqn: what was done instead and why}`` for every prepared layer the settings did not fit
        self.unfit_layers: Dict[str, str] = {}
        self._observers: Dict[str, ActSqNormObserver] = {}
        self._layer_configs: Dict[str, Any] = {}
        self._group_configs: Dict[str, Any] = {}  # per-layer overrides applied, not yet resolved for the shape
        self._weight_hashes: Dict[str, str] = {}
        self._converted = False

    @property
    def track_xtx(self) -> bool:
        return self.method.needs_xtx(self._base_config)

    @property
    def needs_statistics(self) -> bool:
        return self.method.needs_statistics

    @staticmethod
    def set_attention_mask(mask: Optional[torch.Tensor]) -> None:
        """Count only positions where ``mask`` (``(batch, seq_len)``) is 1 in the following forward
        passes (pads left out of every statistic); ``None``: every position."""
        set_token_mask(mask)

    # -- prepare -----------------------------------------------------------------------------
    def prepare(self, model: nn.Module, config: Optional[List[Dict[str, Any]]] = None) -> None:
        """Attach statistics hooks to the layers to prune and hash their weights (not touched).

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
        if not isinstance(model, nn.Module):
            raise ArmorInputError(f"prepare(model, ...) expects an nn.Module, got {type(model).__name__}")
        converted = [n for n, m in model.named_modules()
                     if isinstance(m, nn.Linear) and isinstance(m.weight, ArmorTensor)]
        if converted:
            raise ArmorInputError(
                f"this model was already converted (layer {converted[0]!r} holds an ArmorTensor "
                "weight); prepare() needs the dense model: reload it"
            )
        if config is None:
            config = [{"tensor_fqn": f"{name}.weight"} for name in decoder_linear_names(model)]
            if not config:
                raise ArmorInputError("no layers to prune: the model has no nn.Linear besides the output head")
        config = self._validate_config(config)
        # a second prepare() starts over: drop the hooks and results of the first
        self._remove_hooks()
        self._observers, self._layer_configs, self._group_configs, self._weight_hashes = {}, {}, {}, {}
        self.unfit_layers = {}
        self._converted = False
        self.groups = []
        self.state = defaultdict(dict)
        super().prepare(model, config)

    def _validate_config(self, config: Any) -> List[Dict[str, Any]]:
        if not isinstance(config, (list, tuple)) or not config:
            raise ArmorInputError(
                "config must be None or a non-empty list like [{'tensor_fqn': 'layers.0.fc.weight'}, ...]"
            )
        allowed = {"tensor_fqn", *MODULE_KEYS, *self._options}
        seen = set()
        out = []
        for entry in config:
            if not isinstance(entry, dict) or not isinstance(entry.get("tensor_fqn"), str):
                raise ArmorInputError(
                    f"every config entry must be a dict with a 'tensor_fqn' string such as "
                    f"{{'tensor_fqn': 'layers.0.fc.weight'}}, got {entry!r}"
                )
            fqn = entry["tensor_fqn"]
            unknown = set(entry) - allowed
            if unknown:
                raise ArmorInputError(
                    f"layer {fqn!r}: unknown per-layer options {sorted(unknown)}; valid: {sorted(self._options)}"
                )
            if fqn in seen:
                raise ArmorInputError(f"layer {fqn!r} appears twice in the config; list each layer once")
            seen.add(fqn)
            out.append(dict(entry))
        return out

    def _prepare(self, *args: Any, **kwargs: Any) -> None:
        for group in self.groups:  # check everything before attaching anything
            module, fqn = group["module"], group["tensor_fqn"]
            if module is None:
                raise ArmorInputError(
                    f"layer {fqn!r}: the model has no module {group['module_fqn']!r}; tensor_fqn is "
                    "'<module name>.weight' with the name from model.named_modules()"
                )
            if not isinstance(module, nn.Linear) or group["tensor_name"] != "weight":
                raise ArmorInputError(
                    f"layer {fqn!r}: only the 'weight' of an nn.Linear can be pruned, got "
                    f"{group['tensor_name']!r} of a {type(module).__name__}"
                )
        self._fit_layers()
        self._weight_hashes = {g["tensor_fqn"]: hash_tensors({g["tensor_fqn"]: g["module"].weight})
                               for g in self.groups}
        if not self.needs_statistics:
            return
        try:
            for group in self.groups:
                obs = ActSqNormObserver(track_xtx=self.track_xtx)
                self._observers[group["tensor_fqn"]] = obs.attach(group["module"], group["module_fqn"])
        except Exception:
            self._remove_hooks()
            raise

    def _fit_layers(self) -> None:
        """Every prepared layer's settings, decided as :func:`~torch_armor.prune_model` decides them: the
        per-layer overrides applied, then :func:`~torch_armor.engine.fit.fit_layers` (a layer the settings
        do not fit gets a smaller block size, or stays dense: its group is dropped, no hook, not converted;
        one warning; ``strict``: refused), then resolved for the layer's shape (``for_layer``)."""
        kept_groups = []
        for group in self.groups:
            fqn, module_fqn = group["tensor_fqn"], group["module_fqn"]
            overrides = {k: group[k] for k in self._options
                         if k in group and (k not in self.defaults or group[k] != self.defaults[k])}
            cfg = self._base_config.with_override(overrides, fqn)
            try:
                kept, cfg, unfit = fit_layers(self.model, [module_fqn], cfg, self.strict)
            except ArmorInputError as err:
                key = "block_size" if "block_size" in str(err) else "pattern"
                raise ArmorInputError(f"{err}. Override it for this layer: prepare(model, [{{'tensor_fqn': '{fqn}', "
                                      f"'{key}': <one that fits>}}, ...]), or pass strict=False") from None
            if module_fqn in unfit:
                self.unfit_layers[fqn] = unfit[module_fqn]
            if kept:
                self._group_configs[fqn] = cfg
                self._layer_configs[fqn] = cfg.for_layer(*group["module"].weight.shape, name=module_fqn)
                kept_groups.append(group)
        if not kept_groups:
            first = next(iter(self.unfit_layers))
            raise ArmorInputError(f"the settings fit none of the {len(self.groups)} prepared layers (layer {first!r}: "
                                  f"{self.unfit_layers[first]}); choose a block size or pattern that fits them")
        if self.unfit_layers:  # pointing at the caller of prepare()
            warnings.warn(unfit_warning(self.unfit_layers), UserWarning, stacklevel=5)
        self.groups = kept_groups

    def config_for(self, fqn: str) -> Any:
        """The settings used for one prepared layer (per-layer overrides applied, resolved for its shape)."""
        if fqn in self.unfit_layers and fqn not in self._layer_configs:
            raise KeyError(f"layer {fqn!r} is left dense: {self.unfit_layers[fqn]}")
        if fqn not in self._layer_configs:
            raise KeyError(f"layer {fqn!r} was not prepared")
        return self._layer_configs[fqn]

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

            >>> from torch_armor.config.methods import WandaConfig
            >>> from torch_armor.sparsifier import ArmorSparsifier
            >>> lin = nn.Sequential(nn.Linear(8, 4))
            >>> sp = ArmorSparsifier(WandaConfig(), progress=False)
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
        return next(g["module"] for g in self.groups if g["tensor_fqn"] == fqn)

    def _require_statistics(self, fqn: str) -> LayerStatistics:
        stats = self.statistics(fqn)
        if stats.num_tokens == 0:
            raise ArmorInputError(
                f"layer {fqn!r} saw no calibration data: run forward passes on calibration inputs "
                "(model(batch)) between prepare() and step(), or load_state_dict() a saved state"
            )
        if self.track_xtx and stats.xtx is None:
            raise ArmorInputError(f"layer {fqn!r} has no XᵀX statistics (needed by SparseGPT): calibrate again")
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
            raise ArmorInputError("nothing prepared: call prepare(model), then calibrate, before step()")
        pending = [g for g in self.groups if not self._done(g["tensor_fqn"])]
        if self.needs_statistics:
            for group in pending:  # fail fast, before hours of work, if any layer has no data
                self._require_statistics(group["tensor_fqn"])
        bar = tqdm(pending, desc=type(self).__name__, unit="layer", disable=not self.progress)
        for group in bar:
            bar.set_postfix_str(group["tensor_fqn"].rsplit(".", 1)[0][-40:])
            self.update_mask(**group)
            self._after_layer(group["tensor_fqn"])

    def update_mask(self, module: nn.Module, tensor_name: str, **kwargs: Any) -> None:
        """Solve one layer with :func:`~torch_armor.engine.runner.solve_layer` (called by :meth:`step`)."""
        fqn = kwargs["tensor_fqn"]
        stats = self._require_statistics(fqn) if self.needs_statistics else None
        sol = solve_layer(getattr(module, tensor_name), stats, self.config_for(fqn), fqn)
        self.state[fqn]["solution"] = sol
        label = self.method.label
        result = sol.payload.loss_text() if isinstance(sol.payload, ArmorFactors) else f"{label} pruned"
        logger.info("%s: %s (%.1fs)", fqn, result, sol.seconds)

    def _after_layer(self, fqn: str) -> None:
        pass

    def _done(self, fqn: str) -> bool:
        return "solution" in self.state[fqn]

    @property
    def solutions(self) -> Dict[str, LayerSolution]:
        """Finished layers by ``tensor_fqn`` (:class:`~torch_armor.engine.runner.LayerSolution`)."""
        return {fqn: self.state[fqn]["solution"] for fqn in self._fqns() if self._done(fqn)}

    def approximation(self, fqn: str) -> torch.Tensor:
        """The dense approximation of one solved layer's weight (ARMOR: ``A · core · B``)."""
        return self.state[fqn]["solution"].approximation()

    def _solve_pending(self) -> None:
        """Run :meth:`step` if some layer is not solved yet; raise if it still is not."""
        if any(not self._done(fqn) for fqn in self._fqns()):
            self.step()
        unsolved = [fqn for fqn in self._fqns() if not self._done(fqn)]
        if unsolved:
            raise ArmorInputError(
                f"layer {unsolved[0]!r} is not solved and step() did nothing (enable_mask_update is False); "
                "set sparsifier.enable_mask_update = True"
            )

    # -- convert / squash --------------------------------------------------------------------
    def _model_for(self, module: Optional[nn.Module]) -> nn.Module:
        model = getattr(self, "model", None)
        if module is None:
            module = model
        if module is None or not self.groups:
            raise ArmorInputError("nothing prepared: call prepare(model) and calibrate before convert()")
        if module is not model:
            ids = {id(m) for m in module.modules()}
            if any(id(g["module"]) not in ids for g in self.groups):
                raise ArmorInputError("convert(model) got a model that this sparsifier did not prepare")
        return module

    def _convert(self, module: Optional[nn.Module], inplace: bool, storage: str) -> nn.Module:
        """Write every solution into its layer with :meth:`LayerSolution.apply`, in place."""
        if not inplace:
            raise ArmorInputError(
                f"{type(self).__name__}.convert works in place; copy.deepcopy the model before prepare() to keep it"
            )
        model = self._model_for(module)
        if self._converted:
            raise ArmorInputError(
                "this model was already converted by this sparsifier; to convert another model, "
                "prepare() its dense weights first"
            )
        for group in self.groups:
            if isinstance(group["module"].weight, ArmorTensor):
                raise ArmorInputError(f"layer {group['tensor_fqn']!r} was already converted (it holds an ArmorTensor)")
        self._solve_pending()
        for group in self.groups:
            self.state[group["tensor_fqn"]]["solution"].apply(group["module"], storage)
        self._finish()
        self._converted = True
        return model

    def squash_mask(self, *args: Any, **kwargs: Any) -> None:
        """Write each layer's dense approximation into a plain ``nn.Parameter``; remove hooks.

        Runs :meth:`step` first for layers not solved yet. The result is an ordinary dense
        model (for export or evaluation); the weights keep their dtype, device and
        ``requires_grad``.
        """
        if args or kwargs:
            raise ArmorInputError("squash_mask() takes no arguments (sparse_params are not kept)")
        self._model_for(None)
        self._solve_pending()
        for group in self.groups:
            module = group["module"]
            old = module.weight
            approx = self.approximation(group["tensor_fqn"]).to(device=old.device, dtype=old.dtype)
            module.weight = nn.Parameter(approx, requires_grad=old.requires_grad)
        self._finish()

    # -- save / resume -----------------------------------------------------------------------
    def _group_state(self, fqn: str) -> Dict[str, Any]:
        """A layer's settings as saved: its config (per-layer overrides applied), serialized."""
        return {"tensor_fqn": fqn, "config": config_to_dict(self._group_configs[fqn])}

    def _identity(self) -> Dict[str, Any]:
        return {"sparsifier": type(self).__name__, "method": self.method.name,
                "config": config_to_dict(self._base_config)}

    def state_dict(self) -> Dict[str, Any]:
        """Statistics, finished layers and weight hashes, as tensors, strings and numbers only.

        ``torch.save`` it and read it back with ``torch.load(path, weights_only=True)``.
        Layout: ``{"version", "sparsifier", "method", "config", "groups" (each layer's
        ``{"tensor_fqn", "config"}``, the config as ``config_to_dict`` writes it), "weight_hashes":
        {tensor_fqn: sha256 of the dense weight at prepare()}, "state": {tensor_fqn:
        {"act_sq_norm", "num_tokens", ["xtx"], [result...]}}}``; an ARMOR result is
        ``"factors"`` (:meth:`ArmorFactors.to_tensors`) and ``"factor_metadata"``, a baseline's
        ``"pruned"`` and ``"mask"``.
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
            if self._done(fqn):
                entry.update(solution_state(self.state[fqn]["solution"]))
            state[fqn] = entry
        groups = [self._group_state(g["tensor_fqn"]) for g in self.groups]
        return {"version": STATE_DICT_VERSION, **self._identity(), "groups": groups,
                "weight_hashes": dict(self._weight_hashes), "state": state}

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> None:
        """Restore statistics and finished layers into a sparsifier prepared on the same model.

        Layers with results are not recomputed by :meth:`step`; the others are solved from the
        loaded statistics (no new calibration needed). Forward passes run after loading add to
        the loaded statistics. Nothing is loaded unless every check passes.

        Args:
            state_dict: from :meth:`state_dict` (possibly via ``torch.save``/``torch.load``).
            strict: require exactly the same prepared layers.

        Raises:
            ValueError: not prepared or already converted; a state of another sparsifier or
                method, of an older version, or from other weights (the first differing layer
                is named); shapes or layers that do not match.
        """
        if not self.groups:
            raise ArmorInputError("call prepare(model) on the dense model before load_state_dict() so layers can be matched")
        if self._converted:
            raise ArmorInputError("this sparsifier already converted its model; prepare() a dense model, then load")
        if not isinstance(state_dict, dict) or "state" not in state_dict:
            raise ArmorInputError("not a sparsifier state: expected the dict returned by state_dict()")
        mine_id, theirs_id = self._identity(), {k: state_dict.get(k) for k in ("sparsifier", "method")}
        if {k: mine_id[k] for k in theirs_id} != theirs_id:
            raise ArmorInputError(
                f"this state comes from {theirs_id['sparsifier']}(method={theirs_id['method']!r}); "
                f"load it into the same kind of sparsifier, not {mine_id['sparsifier']}(method={mine_id['method']!r})"
            )
        if state_dict.get("version") != STATE_DICT_VERSION or not isinstance(state_dict.get("weight_hashes"), dict):
            raise ArmorInputError(
                f"this sparsifier state is version {state_dict.get('version')!r} (without weight hashes); this "
                f"torch_armor reads version {STATE_DICT_VERSION}: recompute it (prepare, calibrate, step, state_dict())"
            )
        mine, theirs = set(self._fqns()), set(state_dict["state"])
        if strict and mine != theirs:
            raise ArmorInputError(
                f"the saved layers differ from the prepared ones: missing {sorted(mine - theirs)[:5]}, "
                f"unexpected {sorted(theirs - mine)[:5]}; prepare with the same config or pass strict=False"
            )
        loaded: Dict[str, tuple] = {}
        for group in self.groups:  # check everything before loading anything
            fqn, module = group["tensor_fqn"], group["module"]
            if fqn not in state_dict["state"]:
                continue
            entry, stats = state_dict["state"][fqn], None
            if "act_sq_norm" in entry:
                h = entry["act_sq_norm"]
                if tuple(h.shape) != (module.in_features,):
                    raise ArmorInputError(
                        f"layer {fqn!r}: saved statistics have shape {tuple(h.shape)} but the layer has "
                        f"d_in={module.in_features}; the state comes from a different model"
                    )
                xtx = entry.get("xtx")
                if self.track_xtx and xtx is None:
                    raise ArmorInputError(f"layer {fqn!r}: the saved state has no XᵀX (needed by {self.method.name!r} with these "
                                     "settings): recalibrate and save the state again")
                stats = LayerStatistics(h.float(), int(entry["num_tokens"]), xtx.float() if self.track_xtx else None)
            sol = solution_from_state(fqn, self.method, entry, tuple(module.weight.shape))
            loaded[fqn] = (stats, sol)
        for fqn in loaded:
            if state_dict["weight_hashes"].get(fqn) != self._weight_hashes[fqn]:
                raise ArmorInputError(
                    f"layer {fqn!r}: the state comes from other weights (its sha256 differs from the prepared "
                    "weight's); prepare() the model the state was saved from, then load it"
                )
        saved_groups = {g.get("tensor_fqn"): g for g in state_dict.get("groups", [])}
        for group in (g for g in self.groups if g["tensor_fqn"] in loaded):
            fqn = group["tensor_fqn"]
            stats, sol = loaded[fqn]
            if stats is not None:
                self.state[fqn]["stats"] = stats
                if fqn in self._observers:
                    self._observers[fqn].reset()  # the loaded statistics replace what was seen
            if sol is not None:
                self.state[fqn]["solution"] = sol
                saved = saved_groups.get(fqn, {}).get("config")
                diff = config_changes(saved, self._group_state(fqn)["config"]) if isinstance(saved, dict) else {}
                if diff:
                    logger.warning("%s: loaded result was computed with different settings %s; kept as is",
                                   fqn, {k: old for k, (old, _) in diff.items()})
