"""Factorize the layers of a model on several processes (``torch.distributed``).

Once the calibration statistics exist, the per-layer problems are independent. Each rank
takes a share of the layers (balanced by cost ``d_out·d_in·d_b`` with the greedy
longest-processing-time rule, :func:`shard_layers`), factorizes it and writes every finished
layer into one shared :class:`~torch_armor.engine.runstore.RunStore` directory; rank 0 then merges
the rank manifests and loads all factors. Results are bit-identical to a single-process run
with the same number of threads per process (each layer is seeded by ``config.seed`` alone,
so the order and the rank do not matter), and an interrupted run resumes like a
single-process one, with any number of ranks.

Launch (CPU: gloo; CUDA: NCCL, one GPU per rank with ``ArmorConfig(device="cuda")``)::

    torchrun --nproc-per-node 2 -m torch_armor prune ...        # the command line
    torchrun --nproc-per-node 2 my_script.py                    # or your own script calling
                                                                # distributed_factorize(...)

Without ``torchrun`` (no ``WORLD_SIZE``) everything runs in one process, so the same script
works both ways. On CPU, ``torchrun`` gives each worker one thread (``OMP_NUM_THREADS=1``)
unless you set it; keep ``ranks × threads`` at most the number of cores.

Example (one process; the same call runs sharded under ``torchrun``)::

    >>> import tempfile
    >>> from torch_armor.config.armor import ArmorConfig, BcdConfig
    >>> from torch_armor.engine.runstore import RunStore
    >>> from torch_armor.engine.identity import hash_statistics
    >>> g = torch.Generator().manual_seed(0)
    >>> layers = {f"fc{i}": (torch.randn(32, 64, generator=g), torch.rand(64, generator=g) + 0.1)
    ...           for i in range(4)}
    >>> cfg = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     store = RunStore(d, cfg, "toy", hash_statistics({k: h for k, (_, h) in layers.items()}))
    ...     factors = distributed_factorize(layers, cfg, store, progress=False)
    ...     sorted(factors) == sorted(layers)
    True
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist

from torch_armor.config.armor import ArmorConfig
from torch_armor.core.factors import ArmorFactors
from torch_armor.armor.layers import (LayerInput, check_layer_inputs, compute_layers, eager_shapes, factorize_layers,
                                       layer_configs, pending_layers)
from torch_armor.engine.runstore import RunStore
from torch_armor.engine.topology import init_distributed
from torch_armor.errors import ArmorInputError, ArmorRankError

__all__ = ["layer_cost", "shard_layers", "distributed_factorize"]

def layer_cost(shape: Union[torch.Tensor, Sequence[int]], block_size: int) -> float:
    """Relative cost of factorizing one layer: ``d_out · d_in · d_b``.

    Both optimizers do block-diagonal products (``d_b`` flops per weight entry) and
    ``O(d_b)``-per-entry group updates, so time per iteration scales with this product.

    Example::

        >>> layer_cost((4096, 11008), 128) / layer_cost((4096, 4096), 128)
        2.6875
    """
    dims = tuple(shape.shape) if isinstance(shape, torch.Tensor) else tuple(shape)
    if len(dims) != 2 or not all(isinstance(d, int) and d > 0 for d in dims):
        raise ArmorInputError(f"layer_cost needs a (d_out, d_in) shape of positive integers, got {dims}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ArmorInputError(f"block_size must be a positive integer, got {block_size!r}")
    return float(dims[0] * dims[1] * block_size)


def shard_layers(costs: Mapping[str, float], world_size: int) -> List[List[str]]:
    """Split layers across ``world_size`` ranks, balancing total cost (greedy LPT).

    Layers are taken by decreasing cost (ties: by name) and each goes to the rank with the
    least total so far (ties: the lowest rank). Deterministic; every layer lands on exactly
    one rank; the busiest rank's total is at most the idlest one's plus the largest single
    cost (and within 4/3 of the best possible split). Each shard keeps the order of ``costs``.

    Example::

        >>> shard_layers({"q": 4.0, "k": 1.0, "v": 1.0, "up": 11.0, "down": 11.0}, 2)
        [['q', 'down'], ['k', 'v', 'up']]
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ArmorInputError(f"world_size must be a positive integer, got {world_size!r}")
    for name, cost in costs.items():
        if not isinstance(cost, (int, float)) or isinstance(cost, bool) or not math.isfinite(cost) or cost < 0:
            raise ArmorInputError(f"layer {name!r}: cost must be a finite number >= 0, got {cost!r}")
    heap = [(0.0, rank) for rank in range(world_size)]
    owner: Dict[str, int] = {}
    for name in sorted(costs, key=lambda n: (-float(costs[n]), n)):
        load, rank = heapq.heappop(heap)
        owner[name] = rank
        heapq.heappush(heap, (load + float(costs[name]), rank))
    shards: List[List[str]] = [[] for _ in range(world_size)]
    for name in costs:
        shards[owner[name]].append(name)
    return shards


def _costs_for(
    names: Sequence[str],
    layers: Mapping[str, LayerInput],
    configs: Mapping[str, ArmorConfig],
    costs: Optional[Mapping[str, float]],
) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for fqn in names:
        if costs is not None and fqn in costs:
            out[fqn] = float(costs[fqn])
            continue
        value = layers[fqn]
        if callable(value) or not isinstance(value, (tuple, list)) or not isinstance(value[0], torch.Tensor):
            raise ArmorInputError(
                f"layer {fqn!r} is given lazily, so its cost is unknown: pass "
                "costs={name: layer_cost((d_out, d_in), block_size), ...} for every such layer"
            )
        out[fqn] = layer_cost(value[0], configs[fqn].block_size)
    return out


def _agree(status: Optional[str], world: int) -> List[Optional[str]]:
    """All-gather one status string per rank (``None``: fine)."""
    statuses: List[Optional[str]] = [None] * world
    dist.all_gather_object(statuses, status)
    return statuses


def distributed_factorize(
    layers: Mapping[str, LayerInput],
    config: ArmorConfig,
    store: Optional[RunStore],
    *,
    costs: Optional[Mapping[str, float]] = None,
    per_layer_overrides: Optional[Mapping[str, Any]] = None,
    progress: bool = True,
    on_layer_done: Optional[Callable[[str, ArmorFactors], None]] = None,
    return_factors: bool = True,
    backend: Optional[str] = None,
) -> Dict[str, ArmorFactors]:
    """Factorize ``layers`` sharded over the ranks of a ``torchrun`` job (or in one process).

    Call it on every rank with the same arguments. Rank 0 finds the layers ``store`` does not
    hold yet and broadcasts them; they are split by :func:`shard_layers`; each rank factorizes
    its share, writing every finished layer to ``store``'s directory (its own files, its own
    manifest); after all ranks finish, rank 0 merges the manifests and returns every layer's
    factors. With one process this is :func:`~torch_armor.armor.layers.factorize_layers`.

    Args:
        layers: ``{name: (weight, act_sq_norm)}`` or ``{name: callable returning it}`` (lazy:
            a rank loads only its own layers; then pass ``costs``). Same on every rank.
        config: :class:`ArmorConfig` of every layer (``device="cuda"``: one GPU per rank).
        store: the shared run directory (a path all ranks see, e.g. on one machine or a shared
            file system); required with more than one rank, optional with one.
        costs: ``{name: cost}`` (default :func:`layer_cost` of each weight's shape).
        per_layer_overrides: as in :func:`~torch_armor.armor.layers.factorize_layers`.
        progress: progress bar (rank 0 only, showing its own share).
        on_layer_done: called on the computing rank after each layer is saved.
        return_factors: rank 0 returns all factors (loading the other ranks' from the store);
            ``False``: every rank returns only what it computed.
        backend: process-group backend if this call creates the group (default gloo on CPU,
            NCCL for CUDA configs).

    Returns:
        Rank 0: ``{name: ArmorFactors}`` for every layer, in the order of ``layers``. Other
        ranks: the layers they computed.

    Raises:
        RunMismatchError: ``store`` belongs to another run (on every rank).
        ArmorRankError: another rank failed (a ``RuntimeError``); its message is included. Finished layers stay
            saved: rerun the same command to resume.
    """
    layers = check_layer_inputs(layers)
    configs = layer_configs(layers, config, per_layer_overrides, eager_shapes(layers))
    topo = init_distributed(backend, device=config.device)
    try:
        if topo.world_size == 1:
            return factorize_layers(layers, config, store, progress=progress, per_layer_overrides=per_layer_overrides,
                                    on_layer_done=on_layer_done, return_factors=return_factors)
        if store is None:
            raise ArmorInputError(
                f"distributed_factorize on {topo.world_size} ranks needs a store: the ranks exchange finished "
                "layers through its directory; pass RunStore(run_dir, config, model_id, stats_hash)"
            )
        rank, world = topo.rank, topo.world_size
        local_error: Optional[BaseException] = None
        decision: List[Any] = [None]
        try:
            store = store.with_rank(rank)
            if rank == 0:
                pending = pending_layers(layers, configs, store)
                store.plan(pending)
                decision = [{"pending": pending}]
        except Exception as err:  # every rank must reach the collective, even after an error
            local_error, decision = err, [{"error": f"{type(err).__name__}: {err}"}]
        dist.broadcast_object_list(decision, src=0)
        if local_error is not None:
            raise local_error
        if "error" in decision[0]:
            raise ArmorRankError(f"rank 0 failed before factorizing: {decision[0]['error']}")
        pending = decision[0]["pending"]

        own: Dict[str, ArmorFactors] = {}
        try:
            shards = shard_layers(_costs_for(pending, layers, configs, costs), world)
            own = compute_layers(layers, shards[rank], configs, store, progress=progress and rank == 0,
                                  on_layer_done=on_layer_done, keep=return_factors,
                                  desc=f"factorize (rank 0 of {world})")
        except Exception as err:
            local_error = err
        statuses = _agree(None if local_error is None else f"{type(local_error).__name__}: {local_error}", world)
        failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
        if rank == 0:  # every rank has stopped writing: merge their manifests, failures included
            store.finalize()
        if local_error is not None:
            raise local_error
        if failed:
            r, message = failed[0]
            raise ArmorRankError(
                f"rank {r} failed: {message}. The layers finished so far are saved in {store.directory}; "
                "fix the cause and rerun the same command to resume"
            )
        if rank != 0:
            return own
        if not return_factors:
            return own
        return {fqn: own[fqn] if fqn in own else store.load(fqn) for fqn in layers}
    finally:
        if topo.initialized_here:
            dist.destroy_process_group()

