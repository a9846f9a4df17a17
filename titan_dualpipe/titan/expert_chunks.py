"""torchtitan's expert-parallel dispatch and combine cut into ``k`` exchanges (both releases).

``TITAN_DUALPIPE_EXCHANGE_CHUNKS=k`` cuts each MoE layer's token exchange by groups of local
experts, as our MoE module's ``exchange_chunks`` does: chunk ``c`` carries the tokens of every
rank's ``c``-th group. All dispatch chunks are posted at once; each chunk's experts run (through
torchtitan's own permutation and ``GroupedExperts``, the other experts given no tokens) as soon as
it arrived, while the next flies, and post its combine. Every expert's GEMMs see all its tokens in
the same order as one exchange gives them, so the result is bitwise that of ``k = 1``. In the
backward the reverse chunks fly while the chunks' other backward work runs (:class:`PostedExchange
<titan_dualpipe.overlap.comm.PostedExchange>`). Taken over:
0.3.0 ``RoutedExperts.forward`` (the ``AllToAllTokenDispatcher``); 0.2.2 ``ExpertParallel``'s
dispatch, ``GroupedExperts.forward`` and its combine. docs/overlap.md#chunked-exchanges.
"""

from __future__ import annotations

import functools
import importlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..overlap.moe import expert_groups
from ..switches import EXCHANGE_CHUNKS_ENV
from .active import ACTIVE
from .generation import GEN


def exchange_chunks_option() -> int:
    """``TITAN_DUALPIPE_EXCHANGE_CHUNKS`` (unset: 1, one exchange each)."""
    value = os.environ.get(EXCHANGE_CHUNKS_ENV, "") or "1"
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{EXCHANGE_CHUNKS_ENV}={value!r}: use an int from 1 (one dispatch and one combine per "
                         "MoE layer, the default) to the number of local experts")
    return int(value)


@dataclass(frozen=True)
class ChunkPlan:
    """How one MoE layer's routed tokens (sorted by global expert) travel in chunks."""

    group: Any  # the expert-parallel process group
    experts: list[range]  # per chunk: its local experts
    order: torch.Tensor  # the routed rows, chunk after chunk (peer-major within a chunk)
    restore: torch.Tensor  # inverse of ``order``
    send_splits: list[list[int]]  # per chunk: rows to each peer
    receive_splits: list[list[int]]  # per chunk: rows from each peer
    received_counts: list[list[int]]  # per chunk: rows from each peer for each of its experts, peer-major


def plan_chunks(local_counts: list[int], received_counts: list[int], ep_size: int, chunks: int, group: Any,
                device: torch.device) -> ChunkPlan:
    """The plan for routed rows sorted by global expert (``local_counts[e]`` rows for expert ``e``,
    peer ``p`` holding experts ``p * local`` to ``(p + 1) * local - 1``), receiving
    ``received_counts[p * local + j]`` rows from peer ``p`` for local expert ``j``."""
    local = len(local_counts) // ep_size
    if not 1 <= chunks <= local:
        raise ValueError(f"{EXCHANGE_CHUNKS_ENV}={chunks}: use an int from 1 to {local}, the local experts of each "
                         f"of the {ep_size} expert-parallel ranks (a chunk holds whole experts)")
    starts = [0]
    for count in local_counts:
        starts.append(starts[-1] + count)
    groups = expert_groups(local, chunks)
    rows: list[torch.Tensor] = []
    send, receive, counts = [], [], []
    for g in groups:
        first = [peer * local + g.start for peer in range(ep_size)]
        last = [peer * local + g.stop for peer in range(ep_size)]
        rows += [torch.arange(starts[a], starts[b]) for a, b in zip(first, last)]
        send.append([starts[b] - starts[a] for a, b in zip(first, last)])
        receive.append([sum(received_counts[a:b]) for a, b in zip(first, last)])
        counts.append([received_counts[peer * local + j] for peer in range(ep_size) for j in g])
    order = torch.cat(rows)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel())
    return ChunkPlan(group, groups, order.to(device), restore.to(device), send, receive, counts)


def run_chunked(routed: torch.Tensor, plan: ChunkPlan, experts: Callable[[int, torch.Tensor], torch.Tensor]
                ) -> torch.Tensor:
    """Dispatch ``routed`` in the plan's chunks, ``experts(c, received)`` on each as it arrives
    (rows peer-major, its experts only; returns rows in the same order), combine each chunk back:
    the expert outputs in ``routed``'s row order."""
    from ..overlap.comm import Link, post_relayed_all_to_all_single

    link = Link()  # one link: each chunk flies once the one posted before it arrived
    sends = routed[plan.order].split([sum(s) for s in plan.send_splits])
    dispatches = [post_relayed_all_to_all_single(send, out, inp, plan.group, link)
                  for send, out, inp in zip(sends, plan.receive_splits, plan.send_splits, strict=True)]
    combines = [post_relayed_all_to_all_single(experts(c, dispatch.wait()), plan.send_splits[c],
                                               plan.receive_splits[c], plan.group, link)
                for c, dispatch in enumerate(dispatches)]
    return torch.cat([combine.wait() for combine in combines])[plan.restore]


def _all_experts(counts: torch.Tensor, group: range, local_experts: int) -> torch.Tensor:
    """Per-expert token counts for all local experts: ``counts`` for the chunk's, none elsewhere."""
    full = counts.new_zeros(local_experts)
    full[group.start:group.stop] = counts
    return full


def _chunking(ep_mesh: Any) -> int:
    """The chunks for a layer exchanging over ``ep_mesh`` now (1: torchtitan's own path)."""
    if ACTIVE.exchange_chunks == 1 or ep_mesh is None or torch.compiler.is_compiling():
        return 1
    return ACTIVE.exchange_chunks


# ---- torchtitan 0.3.0: RoutedExperts.forward with the AllToAllTokenDispatcher


def _routed_experts_030(original: Callable[..., Any], read_counts: Callable[..., Any]) -> Callable[..., Any]:
    """``read_counts(dispatcher, local, group, ep_size)``: the token-count exchange, read
    (:func:`~titan_dualpipe.titan.expert_overlap.read_counts_030`)."""
    if getattr(original, "_titan_dualpipe", False):
        return original
    from torchtitan.distributed.spmd_types import current_spmd_mesh, maybe_set_sparse_mesh
    from torchtitan.distributed.utils import get_spmd_backend
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, LocalDispatchMetadata
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    def forward(self: Any, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        dispatcher = self.token_dispatcher
        chunks = _chunking(getattr(dispatcher, "ep_mesh", None))
        if chunks == 1 or type(dispatcher) is not AllToAllTokenDispatcher:
            return original(self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
        B, L, D = x_BLD.shape
        x_TD = x_BLD.view(B * L, D)
        K = topk_scores_BLK.size(-1)
        routed, token_indices, scores = dispatcher._local_reorder(
            x_TD, topk_scores_BLK.view(-1, K), topk_expert_ids_BLK.view(-1, K))
        ep_size = dispatcher.ep_mesh.size()
        with maybe_set_sparse_mesh():  # as torchtitan's dispatch, combine and experts run
            group = current_spmd_mesh().get_group("ep") if get_spmd_backend() == "spmd_types" \
                else dispatcher.ep_mesh.get_group()
            with torch.no_grad():
                read = read_counts(dispatcher, num_local_tokens_per_expert_E, group, ep_size)
            plan = plan_chunks(read.local_counts, read.received_counts, ep_size, chunks, group, routed.device)
            local_experts = len(read.received_counts) // ep_size

            def experts(c: int, received: torch.Tensor) -> torch.Tensor:
                counts = torch.tensor(plan.received_counts[c], dtype=read.received.dtype, device=received.device)
                shape, permuted, indices, per_expert = dispatcher._permute(received, counts)
                out = self.inner_experts(permuted, _all_experts(per_expert, plan.experts[c], local_experts))
                return dispatcher._unpermute(out, shape, indices)

            routed_out = run_chunked(routed, plan, experts)
        metadata = LocalDispatchMetadata(token_indices_experts_sorted_N=token_indices,
                                         topk_scores_experts_sorted_N=scores)
        return LocalTokenDispatcher.combine(dispatcher, routed_out, metadata, x_TD).view(B, -1, D)

    forward._titan_dualpipe = True  # type: ignore[attr-defined]
    return functools.wraps(original)(forward)


# ---- torchtitan 0.2.2: ExpertParallel's hooks around GroupedExperts


class _Pending(threading.local):
    """0.2.2: per experts module and thread (two sub-batches run one layer on two threads), the plan
    its dispatch hook made for its forward, and whether that forward combined already."""

    def __init__(self) -> None:
        self.plans: dict[int, ChunkPlan] = {}
        self.combined: set[int] = set()


_PENDING = _Pending()


def dispatch_in_chunks_022(mod: torch.nn.Module, routed: torch.Tensor, read: Any, device_mesh: Any) -> bool:
    """0.2.2, from ``ExpertParallel``'s dispatch hook: plan ``mod``'s forward in chunks (its
    dispatch then exchanges nothing itself). False: one exchange, torchtitan's path."""
    chunks = _chunking(device_mesh)
    if chunks == 1:
        return False
    ep_size = device_mesh.shape[0]
    _PENDING.plans[id(mod)] = plan_chunks(read.local_counts, read.received_counts, ep_size, chunks,
                                          device_mesh.get_group(), routed.device)
    return True


def combined_in_chunks_022(mod: torch.nn.Module) -> bool:
    """0.2.2, from ``ExpertParallel``'s combine hook: whether ``mod``'s forward combined already."""
    if id(mod) in _PENDING.combined:
        _PENDING.combined.discard(id(mod))
        return True
    return False


def _grouped_experts_022(original: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(original, "_titan_dualpipe", False):
        return original
    from torchtitan.models.moe.utils import _permute, _unpermute

    def forward(self: Any, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        plan = None if torch.compiler.is_compiling() else _PENDING.plans.pop(id(self), None)
        if plan is None:
            return original(self, x, num_tokens_per_expert)
        ep_size = len(plan.send_splits[0])
        local_experts = num_tokens_per_expert.numel() // ep_size

        def experts(c: int, received: torch.Tensor) -> torch.Tensor:
            counts = torch.tensor(plan.received_counts[c], dtype=num_tokens_per_expert.dtype, device=received.device)
            shape, permuted, indices, per_expert = _permute(received, counts, ep_size, len(plan.experts[c]))
            out = original(self, permuted, _all_experts(per_expert, plan.experts[c], local_experts))
            return _unpermute(out, shape, indices)

        out = run_chunked(x, plan, experts)
        _PENDING.combined.add(id(self))
        return out

    forward._titan_dualpipe = True  # type: ignore[attr-defined]
    return functools.wraps(original)(forward)


def install(read_counts_030: Callable[..., Any]) -> None:
    """Let torchtitan's MoE layers exchange in chunks where ``ACTIVE.exchange_chunks`` asks
    (idempotent). ``read_counts_030``: see :func:`_routed_experts_030`."""
    if GEN.registry:
        from torchtitan.models.common.moe import RoutedExperts

        RoutedExperts.forward = _routed_experts_030(RoutedExperts.forward, read_counts_030)
        return
    experts = importlib.import_module(GEN.experts_module).GroupedExperts
    experts.forward = _grouped_experts_022(experts.forward)


def check_exchange_chunks(modules: Iterable[torch.nn.Module], chunks: int, ep_degree: int) -> None:
    """Before the first step: ``chunks`` fits every MoE layer of ``modules`` (at most the experts
    each of the ``ep_degree`` expert-parallel ranks holds) and each exchanges through torchtitan's
    all-to-all dispatch; ValueError otherwise. (0.3.0's SPMD type checking, which the chunked path
    does not repeat, is refused by torchtitan itself under pipeline parallelism.)"""
    if chunks == 1:
        return
    for module in modules:
        for name, m in module.named_modules():
            dispatcher = getattr(m, "token_dispatcher", None)
            if GEN.registry and dispatcher is not None and type(dispatcher).__name__ != "AllToAllTokenDispatcher":
                raise ValueError(f"{EXCHANGE_CHUNKS_ENV}={chunks}: {name} dispatches with {type(dispatcher).__name__}; "
                                 "chunked exchanges need torchtitan's AllToAllTokenDispatcher (unset the variable)")
            weight = getattr(m, "w1_EFD" if GEN.registry else "w1", None)
            # by name along the MRO: FSDP2 and deferred weight GEMMs put classes of their own on top
            if weight is None or all(c.__name__ != "GroupedExperts" for c in type(m).__mro__):
                continue
            if "etp" in (getattr(getattr(weight, "device_mesh", None), "mesh_dim_names", None) or ()):
                raise ValueError(f"{EXCHANGE_CHUNKS_ENV}={chunks}: {name} is split by expert tensor parallelism, "
                                 "whose dispatch is not cut; unset the variable or set expert_tensor_parallel_degree 1")
            local = weight.shape[0] // ep_degree  # a DTensor's shape is the whole one: every expert
            if chunks > local:
                raise ValueError(f"{EXCHANGE_CHUNKS_ENV}={chunks}: {name} holds {local} experts on each of the "
                                 f"{ep_degree} expert-parallel ranks; use an int from 1 to {local} (a chunk holds "
                                 "whole experts)")
