"""DualPipe twins folded into torchtitan's FSDP.

Under DualPipe pipeline ranks ``r`` and ``pp-1-r`` hold the same two model parts. When torchtitan
shards the parts with FSDP, each part is sharded over twins x replicas instead of replicas alone,
as DeepSeek and Megatron fold twins into data parallelism: FSDP's reduce-scatter sums the twins'
gradients with the replicas' (no twin exchange after the step), and weights, gradients and
optimizer state take half the memory. torchtitan's world mesh is pipeline-rank-major, where twins
are not neighbours, so a second root mesh lists each twin pair's ranks side by side
(:func:`folded_rank_map`); while torchtitan parallelizes the parts (:class:`FoldWindow`), its lookups of
the dimensions FSDP combines (:data:`FOLDED_DIMS`) answer from that root. The schedule then moves
FSDP's collectives to the step's edges (``ScheduleDualPipe.fsdp_at_step_edges``). When folding
applies: docs/torchtitan.md#dualpipe-twins-folded-into-fsdp.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from ..switches import FOLD_ENV  # "0": sum DualPipe's twins by an exchange even under FSDP

# Answered from the folded root inside the window: the same groups as torchtitan's except fsdp and
# efsdp (twice as large, spanning both twins), and one root, which FSDP needs to combine them.
FOLDED_DIMS = frozenset({"fsdp", "efsdp", "dp_replicate", "ep", "etp", "tp"})
# torchtitan 0.3.0's spmd_backend that looks its FSDP meshes up by name (its default, spmd_types,
# needs each parameter's type-checking mesh to span its FSDP mesh's ranks: there twins exchange)
FOLDING_BACKEND = "partial_dtensor"


def fold_enabled() -> bool:
    return os.environ.get(FOLD_ENV, "1") != "0"


def folded_rank_map(pp: int, dp_replicate: int, world_size: int) -> list[int]:
    """The world's ranks in the folded root mesh's order, ``(pair, dp_replicate, twin, rest)``
    row-major: torchtitan numbers rank ``(p, d, x)`` (pipeline rank, replica, the rest) as
    ``(p * dp_replicate + d) * rest + x``; here pipeline ranks ``r`` and ``pp-1-r`` (pair
    ``r``) follow each other inside each replica slice."""
    if pp < 2 or pp % 2 or world_size % (pp * dp_replicate):
        raise ValueError(f"twin folding needs an even pp >= 2 with pp x dp_replicate dividing the world; got "
                         f"pp={pp}, dp_replicate={dp_replicate}, world size {world_size}")
    rest = world_size // (pp * dp_replicate)
    return [(p * dp_replicate + d) * rest + x
            for r in range(pp // 2) for d in range(dp_replicate) for p in (r, pp - 1 - r) for x in range(rest)]


@dataclass
class FoldedMeshes:
    """Meshes over one root where ``fsdp`` and ``efsdp`` span twin pipeline ranks."""

    dense: Any  # ("pair", "dp_replicate", "fsdp", "tp")
    sparse: Any  # ("pair", "dp_replicate", "efsdp", "ep"[, "etp" on 0.2.2]); None without expert parallelism

    def lookup(self, dims: list[str]) -> Any:
        for mesh in (self.dense, self.sparse):
            if mesh is not None and set(dims) <= set(mesh.mesh_dim_names):
                return mesh[dims[0]] if len(dims) == 1 else mesh[tuple(dims)]
        return None


def build_folded_meshes(dims: Any, device_type: str) -> FoldedMeshes:
    """Collective over the world (every rank builds the same groups in the same order)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    fsdp = dims.dp_shard * dims.cp
    ranks = folded_rank_map(dims.pp, dims.dp_replicate, dims.world_size)
    root = DeviceMesh(device_type, torch.tensor(ranks), mesh_dim_names=("twin_folded_world",))

    def unflatten(names: tuple[str, ...], sizes: tuple[int, ...], real: set[str]) -> Any:
        fake = {name: "fake" for name, size in zip(names, sizes) if size == 1 and name not in real}
        return root._unflatten(0, sizes, names, backend_override=fake)

    dense = unflatten(("pair", "dp_replicate", "fsdp", "tp"), (dims.pp // 2, dims.dp_replicate, 2 * fsdp, dims.tp),
                      set())
    sparse = None
    if dims.ep > 1:
        etp = getattr(dims, "etp", None)  # 0.3.0 has no expert tensor parallelism
        efsdp = fsdp * dims.tp // ((etp or 1) * dims.ep)
        names, sizes = ("pair", "dp_replicate", "efsdp", "ep"), (dims.pp // 2, dims.dp_replicate, 2 * efsdp, dims.ep)
        if etp is not None:
            names, sizes = (*names, "etp"), (*sizes, etp)
        sparse = unflatten(names, sizes, {"efsdp"})
    return FoldedMeshes(dense, sparse)


class FoldWindow:
    """Whether torchtitan's mesh lookups answer with folded meshes right now (set while
    DualPipe's model parts are parallelized), and the meshes once built."""

    def __init__(self) -> None:
        self.open = False
        self.meshes: FoldedMeshes | None = None
        self.used = False  # an FSDP mesh lookup was answered from the folded root: parts sharded over twins


def exchange_backend(config: Any) -> str | None:
    """torchtitan 0.3.0's ``spmd_backend`` of ``config`` (its parallelism config or ParallelDims)
    when that backend builds FSDP meshes folding cannot reach, so twins are summed by the
    exchange; None when FSDP meshes are looked up by name (always on 0.2.2)."""
    backend = getattr(config, "spmd_backend", FOLDING_BACKEND)
    return None if backend == FOLDING_BACKEND else backend


def context_parallel(dims: Any) -> int:
    """The context-parallel degree of a ParallelDims (``cp``) or a parallelism config."""
    return int(getattr(dims, "cp", None) or getattr(dims, "context_parallel_degree", 1) or 1)


def applies(dims: Any) -> bool:
    """Folding can apply: torchtitan will apply FSDP, looking its meshes up by name, and the
    layout has twins. Not with context parallelism: FSDP then shards over dp_shard x cp, a
    layout no CPU run can check (no CPU attention sharding rule), so its twins are exchanged."""
    return (fold_enabled() and exchange_backend(dims) is None and context_parallel(dims) == 1
            and dims.pp >= 2 and dims.pp % 2 == 0 and (dims.fsdp_enabled or dims.ep_enabled))


def make_get_optional_mesh(original: Callable[..., Any], window: FoldWindow) -> Callable[..., Any]:
    def get_optional_mesh(self: Any, dims: str | list[str], *args: Any, **kwargs: Any) -> Any:
        mesh = original(self, dims, *args, **kwargs)
        names = [dims] if isinstance(dims, str) else list(dims)
        if mesh is None or not window.open or not set(names) <= FOLDED_DIMS or not applies(self):
            return mesh
        if window.meshes is None:
            window.meshes = build_folded_meshes(self, mesh.device_type)
        folded = window.meshes.lookup(names)
        if folded is None:
            return mesh
        window.used = window.used or bool({"fsdp", "efsdp"} & set(names))
        return folded

    get_optional_mesh._titan_dualpipe = True  # type: ignore[attr-defined]
    return get_optional_mesh


class _InitInPartOrder:
    """Holds each model part's ``init_weights`` until the rank's last part has been called,
    then runs them all in part order; later calls run at once."""

    def __init__(self, parts: dict[int, Any]) -> None:
        self.originals = {part: module.init_weights for part, module in parts.items()}
        self.held: dict[int, tuple[tuple, dict]] | None = {}
        for part, module in parts.items():
            module.init_weights = self._hold(part)

    def _hold(self, part: int) -> Callable[..., None]:
        def init_weights(*args: Any, **kwargs: Any) -> None:
            if self.held is None:
                self.originals[part](*args, **kwargs)
                return
            self.held[part] = (args, kwargs)
            if len(self.held) == len(self.originals):
                held, self.held = self.held, None
                for p in sorted(held):
                    self.originals[p](*held[p][0], **held[p][1])

        return init_weights


def init_parts_in_order(parts: dict[int, Any]) -> None:
    """Make every rank initialize its model parts (``{part index: module}``) in part order.

    Twin ranks hold the same two parts in opposite order, and folded, each part's parameters are
    sharded over both twins, so initializing them is collective (``trunc_normal_`` asks whether
    any sample fell outside its bounds; from torch 2.14 that all-gathers the sharded mask) and
    both twins must reach the parts in one order. torchtitan initializes each local part right
    after moving it off the meta device, in the rank's own order; here those calls are held
    until the last one and then run in part order, every part already materialized."""
    _InitInPartOrder(parts)


def install(window: FoldWindow) -> None:
    """Route ``ParallelDims.get_optional_mesh`` (``get_mesh`` calls it) through ``window``, the
    process's pipeline run's (idempotent)."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    if not getattr(ParallelDims.get_optional_mesh, "_titan_dualpipe", False):
        ParallelDims.get_optional_mesh = make_get_optional_mesh(ParallelDims.get_optional_mesh, window)
