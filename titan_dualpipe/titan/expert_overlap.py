"""torchtitan's expert-parallel all-to-all as hand-over points of our overlapped pairs.

Under our schedules, torchtitan's token dispatch and combine become
:func:`~titan_dualpipe.overlap.comm.relayed_all_to_all_single`: the same exchange with the
same functional collective op (so activation-checkpointing policies treat it alike) and the
same bits, which hands over to the partner half of a relayed pair between posting and
waiting, forward and backward. torchtitan's MoE blocks then overlap their dispatch and
combine with the other half's compute in every DualPipe / DualPipeV pair, the model
unchanged (:mod:`titan_dualpipe.overlap.relay`).

- 0.2.2: ``ExpertParallel`` (:mod:`torchtitan.distributed.expert_parallel`) calls
  ``all_to_all_single_autograd``, a name that module looks up at call time.
- 0.3.0: ``AllToAllTokenDispatcher`` (:mod:`torchtitan.models.common.token_dispatcher`) posts
  both exchanges from two methods, ``_dispatch_token_exchange`` and
  ``_combine_token_exchange``, given the expert-parallel process group. It finds that group
  through torchtitan's per-thread SPMD mesh state, which the relay's backward-half thread
  lacks (activation checkpointing re-runs the dispatch there): :class:`TrainerMeshes` gives a
  thread without that state the trainer's meshes.

Before the token exchange, each rank's per-expert token counts go to its peers in an
all-to-all that the dispatch then reads on the host. Read right after posting, that read
blocks the running half until the exchange is done, and on one communicator that means until
the partner half's token exchange, posted earlier, is done too (on GPUs, a host sync with the
partner's exchange in flight). So the count exchange is a hand-over point as well
(:func:`~titan_dualpipe.overlap.comm.relayed_count_exchange`): posted, then the partner
computes, then it is read.

- 0.2.2: ``ExpertParallel._token_dispatch`` posts it with ``all_to_all_single`` (looked up
  in that module at call time) and waits on it at once.
- 0.3.0: ``AllToAllTokenDispatcher._token_count_exchange`` posts it;
  ``_sync_token_count_exchange`` waits and reads.

DeepEP / HybridEP dispatch has its own communication and is left as it is.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from .generation import GEN


def _dispatch_token_exchange(self: Any, routed: torch.Tensor, pg: Any, output_splits: list[int],
                             input_splits: list[int]) -> torch.Tensor:
    from ..overlap.comm import relayed_all_to_all_single

    return relayed_all_to_all_single(routed, output_splits, input_splits, pg)


def _combine_token_exchange(self: Any, routed: torch.Tensor, pg: Any, input_splits: list[int],
                            output_splits: list[int]) -> torch.Tensor:
    from ..overlap.comm import relayed_all_to_all_single

    return relayed_all_to_all_single(routed, input_splits, output_splits, pg)


def _count_exchange_hands_over(post: Callable[..., Any], group_of: Callable[..., Any]) -> Callable[..., Any]:
    """``post`` (a count exchange poster) followed by a hand-over; ``group_of(*args)`` names its group."""
    if getattr(post, "_titan_dualpipe", False):
        return post

    def posted_then_handed_over(*args: Any, **kwargs: Any) -> Any:
        from ..overlap.comm import relayed_count_exchange

        return relayed_count_exchange(lambda: post(*args, **kwargs), group_of(*args, **kwargs))

    posted_then_handed_over._titan_dualpipe = True  # type: ignore[attr-defined]
    return posted_then_handed_over


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


def install() -> None:
    """Route torchtitan's expert-parallel all-to-all through the relay (idempotent)."""
    if GEN.registry:
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

        AllToAllTokenDispatcher._dispatch_token_exchange = _dispatch_token_exchange
        AllToAllTokenDispatcher._combine_token_exchange = _combine_token_exchange
        AllToAllTokenDispatcher._token_count_exchange = _count_exchange_hands_over(
            AllToAllTokenDispatcher._token_count_exchange, lambda self, counts, pg, ep_size: pg)
        _share_meshes_with_the_relay()
        return
    from torchtitan.distributed import expert_parallel

    from ..overlap.comm import relayed_all_to_all_single

    expert_parallel.all_to_all_single_autograd = relayed_all_to_all_single
    expert_parallel.all_to_all_single = _count_exchange_hands_over(
        expert_parallel.all_to_all_single, lambda x, output_splits, input_splits, group, *_: group)
