"""torchtitan's expert-parallel all-to-all as hand-over points of our overlapped pairs.

Under our schedules torchtitan's token dispatch and combine (0.2.2: ``ExpertParallel``'s
``all_to_all_single_autograd``; 0.3.0: ``AllToAllTokenDispatcher``'s ``_dispatch_token_exchange``
and ``_combine_token_exchange``) become
:func:`~titan_dualpipe.overlap.comm.relayed_all_to_all_single`: the same exchange, op and bits,
which hands over to the partner half of a relayed pair between posting and waiting, so
torchtitan's MoE blocks overlap with the other half's compute, the model unchanged. The
per-expert token counts go on a communicator of their own (:func:`count_communicators`) and are
read by :func:`~titan_dualpipe.overlap.count_read.read_token_counts`; what the relay's other
thread lacks is shared with it (:class:`TrainerMeshes`, :class:`PerThread`). Why, per release:
docs/overlap.md#in-torchtitan.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Callable, Iterable

import torch

from ..overlap.count_groups import count_group, make_count_groups
from ..overlap.count_read import TokenCounts, read_token_counts
from .active import ACTIVE
from .expert_chunks import combined_in_chunks_022, dispatch_in_chunks_022
from .expert_chunks import install as install_exchange_chunks
from .generation import GEN


def _dispatch_token_exchange(self: Any, routed: torch.Tensor, pg: Any, output_splits: list[int],
                             input_splits: list[int]) -> torch.Tensor:
    from ..overlap.comm import relayed_all_to_all_single

    return relayed_all_to_all_single(routed, output_splits, input_splits, pg)


def _combine_token_exchange(self: Any, routed: torch.Tensor, pg: Any, input_splits: list[int],
                            output_splits: list[int]) -> torch.Tensor:
    from ..overlap.comm import relayed_all_to_all_single

    return relayed_all_to_all_single(routed, input_splits, output_splits, pg)


class _LastRead(threading.local):
    """0.3.0: the count exchange this thread read last, for the dispatch's next step (its sync)."""

    read: TokenCounts | None = None

    def take(self, received: torch.Tensor) -> TokenCounts | None:
        read, self.read = self.read, None
        return read if read is not None and read.received is received else None


_LAST_READ = _LastRead()


def _read_on_count_communicator(local: torch.Tensor, ep_size: int, post_on: Callable[[Any], torch.Tensor],
                                group: Any) -> TokenCounts:
    """The token-count exchange ``post_on(g)`` of ``local`` on ``group``'s count communicator ``g``,
    read on the host (:func:`~titan_dualpipe.overlap.count_read.read_token_counts`)."""
    counts = count_group(group)
    return read_token_counts(local, ep_size, lambda: post_on(counts), counts)


def _token_dispatch_022(original: Callable[..., Any]) -> Callable[..., Any]:
    """0.2.2: ``ExpertParallel._token_dispatch``, its counts exchanged on their own communicator
    and read by :func:`read_token_counts`; then, as torchtitan's, the token exchange and the
    permutation to expert-major order. Inside a compiled graph: torchtitan's own."""
    if getattr(original, "_titan_dualpipe", False):
        return original
    from torch.distributed._functional_collectives import all_to_all_single
    from torchtitan.distributed import expert_parallel

    def _token_dispatch(self: Any, mod: torch.nn.Module, inputs: tuple, device_mesh: Any) -> tuple:
        if torch.compiler.is_compiling():
            return original(self, mod, inputs, device_mesh)
        routed_input, local = inputs
        ep_size, group = device_mesh.shape[0], device_mesh.get_group()
        with torch.no_grad():
            read = _read_on_count_communicator(
                local, ep_size, lambda g: all_to_all_single(local, None, None, group=g), group)
        if dispatch_in_chunks_022(mod, routed_input, read, device_mesh):
            return routed_input, read.received  # GroupedExperts' forward exchanges, in chunks
        self.input_splits, self.output_splits = read.input_splits, read.output_splits
        routed_input = expert_parallel.all_to_all_single_autograd(
            routed_input, self.output_splits, self.input_splits, group)
        self.input_shape, routed_input, self.permuted_indices, received = expert_parallel._permute(
            routed_input, read.received, ep_size, local.shape[0] // ep_size)
        return routed_input, received

    _token_dispatch._titan_dualpipe = True  # type: ignore[attr-defined]
    return _token_dispatch


def _token_combine_022(original: Callable[..., Any]) -> Callable[..., Any]:
    """0.2.2: ``ExpertParallel._token_combine``, a no-op after a forward that combined in chunks."""
    if getattr(original, "_titan_dualpipe", False):
        return original

    def _token_combine(self: Any, mod: torch.nn.Module, routed_output: torch.Tensor, device_mesh: Any) -> Any:
        if combined_in_chunks_022(mod):
            return routed_output
        return original(self, mod, routed_output, device_mesh)

    _token_combine._titan_dualpipe = True  # type: ignore[attr-defined]
    return _token_combine


def _count_exchange_030(original: Callable[..., Any]) -> Callable[..., Any]:
    """0.3.0: ``AllToAllTokenDispatcher._token_count_exchange``, on the count communicator and read
    at once (:func:`read_token_counts`); :func:`_sync_030` hands the read on. torchtitan's own
    exchanges on its expert-parallel mesh with a functional all-to-all, or, under its default
    ``spmd_types`` backend, with ``dist.all_to_all``, which on the CPU blocks until every peer has
    posted (in the post, where neither the relay nor a benchmark sees a wait). Ours is the
    functional all-to-all, the same rows in the same order, on the count communicator; torchtitan's
    own only while ``spmd_types`` checks types (which its result carries)."""
    if getattr(original, "_titan_dualpipe", False):
        return original
    import spmd_types
    from torch.distributed._functional_collectives import all_to_all_single
    from torchtitan.distributed.utils import get_spmd_backend

    def _token_count_exchange(self: Any, counts: torch.Tensor, pg: Any, ep_size: int) -> torch.Tensor:
        def post_on(group: Any) -> torch.Tensor:
            if get_spmd_backend() == "spmd_types" and spmd_types.is_type_checking():
                return original(self, counts, group, ep_size)
            return all_to_all_single(counts.view(ep_size, -1), None, None, group=group)

        if torch.compiler.is_compiling():
            return post_on(pg)
        _LAST_READ.read = _read_on_count_communicator(counts, ep_size, post_on, pg)
        return _LAST_READ.read.received

    _token_count_exchange._titan_dualpipe = True  # type: ignore[attr-defined]
    return _token_count_exchange


def _sync_030(original: Callable[..., Any]) -> Callable[..., Any]:
    """0.3.0: ``AllToAllTokenDispatcher._sync_token_count_exchange``: the splits that
    :func:`_count_exchange_030` read for these counts, else torchtitan's own read."""
    if getattr(original, "_titan_dualpipe", False):
        return original

    def _sync_token_count_exchange(self: Any, local: torch.Tensor, received: torch.Tensor,
                                   ep_size: int) -> tuple[torch.Tensor, list[int], list[int]]:
        read = None if torch.compiler.is_compiling() else _LAST_READ.take(received)
        if read is None:
            return original(self, local, received, ep_size)
        return read.received.reshape(-1), read.input_splits, read.output_splits

    _sync_token_count_exchange._titan_dualpipe = True  # type: ignore[attr-defined]
    return _sync_token_count_exchange


def read_counts_030(dispatcher: Any, local: torch.Tensor, pg: Any, ep_size: int) -> TokenCounts:
    """0.3.0: ``dispatcher``'s token-count exchange of ``local``, read (:func:`_count_exchange_030`)."""
    read = _LAST_READ.take(dispatcher._token_count_exchange(local, pg, ep_size))
    if read is None:  # traced: the chunked path never runs there
        raise RuntimeError("the token-count exchange was not read by titan_dualpipe")
    return read


# 0.2.2: the expert-parallel mesh an ExpertParallel style was applied with, kept on the module
_EP_MESH = "_titan_dualpipe_ep_mesh"


def _recording_ep_mesh(apply: Callable[..., Any]) -> Callable[..., Any]:
    """0.2.2: ``ExpertParallel._apply(module, device_mesh)`` that keeps the mesh its token dispatch
    uses on ``module`` (``device_mesh["ep"]`` for expert-tensor parallelism)."""
    if getattr(apply, "_titan_dualpipe", False):
        return apply

    def _apply(self: Any, module: torch.nn.Module, device_mesh: Any) -> Any:
        names = device_mesh.mesh_dim_names or ()
        setattr(module, _EP_MESH, device_mesh["ep"] if device_mesh.ndim > 1 and "ep" in names else device_mesh)
        return apply(self, module, device_mesh)

    _apply._titan_dualpipe = True  # type: ignore[attr-defined]
    return _apply


def expert_parallel_groups(modules: Iterable[torch.nn.Module]) -> list[Any]:
    """The expert-parallel meshes that torchtitan's token dispatch in ``modules`` exchanges over
    (0.3.0: the ``ep_mesh`` of each MoE layer's ``token_dispatcher``; 0.2.2: the mesh its
    ``ExpertParallel`` was applied with)."""
    meshes = []
    for module in modules:
        for m in module.modules():
            if GEN.registry:
                mesh = getattr(getattr(m, "token_dispatcher", None), "ep_mesh", None)
            else:
                mesh = getattr(m, _EP_MESH, None)
            if mesh is not None and mesh.ndim == 1:
                meshes.append(mesh)
    return meshes


def count_communicators(modules: Iterable[torch.nn.Module]) -> dict:
    """The count communicators of the expert-parallel groups of ``modules`` (see
    :func:`~titan_dualpipe.overlap.count_groups.make_count_groups`: every rank calls this,
    before the first step). Returns them by the groups' ranks."""
    return make_count_groups(expert_parallel_groups(modules))


class TrainerMeshes(threading.local):
    """torchtitan 0.3.0's per-thread SPMD meshes. A thread that never registered any (the
    relay's backward-half thread) starts with the meshes the trainer registered last and the
    dense mesh current, as the backward half has them when it runs on the trainer's thread."""

    registered: dict[str, Any] = {}  # process-wide copy of the last set_spmd_meshes

    def __init__(self) -> None:
        dense = self.registered.get("dense_mesh")
        if dense is not None:
            self.dense_mesh, self.sparse_mesh = dense, self.registered["sparse_mesh"]
            self.mesh_stack = [dense]


def _recording(set_spmd_meshes: Callable[..., None]) -> Callable[..., None]:
    def set_meshes(*, dense_mesh: Any, sparse_mesh: Any) -> None:
        set_spmd_meshes(dense_mesh=dense_mesh, sparse_mesh=sparse_mesh)
        TrainerMeshes.registered.update(dense_mesh=dense_mesh, sparse_mesh=sparse_mesh)

    return set_meshes


def _share_meshes_with_the_relay() -> None:
    from torchtitan.distributed import spmd_types

    if not isinstance(spmd_types._MESH_TLS, TrainerMeshes):
        spmd_types._MESH_TLS = TrainerMeshes()
        spmd_types.set_spmd_meshes = _recording(spmd_types.set_spmd_meshes)


# What 0.2.2's ExpertParallel keeps on itself from a dispatch for its combine.
_DISPATCH_STATE = ("input_splits", "output_splits", "input_shape", "permuted_indices")


class PerThread:
    """An instance attribute kept per thread. 0.2.2's ``ExpertParallel`` leaves its dispatch's
    splits and permutation on the module for the combine; two sub-batches of one microbatch run the
    same layer on two threads of a relay (two-batch overlap), the second half's dispatch in
    between the first half's dispatch and combine, so each thread keeps its own."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        return getattr(_thread_values(obj), self.name, None)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(_thread_values(obj), self.name, value)


def _thread_values(obj: Any) -> threading.local:
    values = obj.__dict__.get("_titan_dualpipe_per_thread")
    if values is None:
        values = obj.__dict__.setdefault("_titan_dualpipe_per_thread", threading.local())
    return values


def has_expert_parallel_moe(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds torchtitan MoE layers whose experts are split over an
    expert-parallel group (their dispatch and combine then exchange tokens)."""
    return ACTIVE.expert_parallel and any(type(m).__name__ == "MoE" and type(m).__module__.startswith("torchtitan")
                                          for m in module.modules())


def install() -> None:
    """Route torchtitan's expert-parallel all-to-all through the relay, and its token-count exchange
    to the count communicators (idempotent). Our schedules' two-batch overlap then counts
    torchtitan's MoE stages as stages with exchanges."""
    from ..weights.install import register_expert_class
    from ..runtime.sub_batch_runner import register_exchange_rule

    register_exchange_rule(has_expert_parallel_moe)
    register_expert_class(importlib.import_module(GEN.experts_module).GroupedExperts)  # weight GEMMs wait for W
    if GEN.registry:
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

        AllToAllTokenDispatcher._dispatch_token_exchange = _dispatch_token_exchange
        AllToAllTokenDispatcher._combine_token_exchange = _combine_token_exchange
        AllToAllTokenDispatcher._token_count_exchange = _count_exchange_030(AllToAllTokenDispatcher._token_count_exchange)
        AllToAllTokenDispatcher._sync_token_count_exchange = _sync_030(AllToAllTokenDispatcher._sync_token_count_exchange)
        _share_meshes_with_the_relay()
        install_exchange_chunks(read_counts_030)
        return
    from torchtitan.distributed import expert_parallel

    from ..overlap.comm import relayed_all_to_all_single

    expert_parallel.all_to_all_single_autograd = relayed_all_to_all_single
    for name in _DISPATCH_STATE:
        if not isinstance(expert_parallel.ExpertParallel.__dict__.get(name), PerThread):
            setattr(expert_parallel.ExpertParallel, name, PerThread(name))
    expert_parallel.ExpertParallel._token_dispatch = _token_dispatch_022(expert_parallel.ExpertParallel._token_dispatch)
    expert_parallel.ExpertParallel._token_combine = _token_combine_022(expert_parallel.ExpertParallel._token_combine)
    install_exchange_chunks(read_counts_030)
    for style in (expert_parallel.ExpertParallel, expert_parallel.ExpertTensorParallel):
        if "_apply" in style.__dict__:
            style._apply = _recording_ep_mesh(style.__dict__["_apply"])
