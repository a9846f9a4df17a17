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
all-to-all that the dispatch reads on the host at once (0.2.2: ``ExpertParallel``'s
``all_to_all_single`` then ``wait_tensor``; 0.3.0: ``_token_count_exchange`` then
``_sync_token_count_exchange``). On one communicator that read waits for the partner half's
token exchange posted before it. It stays torchtitan's: a hand-over between posting and
reading was built and measured (``bench titan``'s ``... counts handed over``) and leaves more
exposed, not less. The partner half's next step is to wait for that same exchange, so the
hand-over only moves the wait to the partner, and the partner then hands back after posting its
next exchange with almost no compute of this half left to cover it (this half's token exchange
follows its count read at once). ``install(count_exchange=True)`` (bench runs) routes the count
exchange through :func:`~titan_dualpipe.overlap.comm.count_exchange`, where the emulated network
charges it and the comparison runs hand over.

0.2.2's ``ExpertParallel`` keeps a dispatch's splits on the module until the combine; they are
kept per thread (:class:`PerThread`), so the two halves of a two-batch split, which run one layer
on two threads of a relay, each combine with their own. 0.3.0 passes them along explicitly.

DeepEP / HybridEP dispatch has its own communication and is left as it is.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Callable

import torch

from .generation import GEN
from .pipeline import ACTIVE


def _dispatch_token_exchange(self: Any, routed: torch.Tensor, pg: Any, output_splits: list[int],
                             input_splits: list[int]) -> torch.Tensor:
    from ..overlap.comm import relayed_all_to_all_single

    return relayed_all_to_all_single(routed, output_splits, input_splits, pg)


def _combine_token_exchange(self: Any, routed: torch.Tensor, pg: Any, input_splits: list[int],
                            output_splits: list[int]) -> torch.Tensor:
    from ..overlap.comm import relayed_all_to_all_single

    return relayed_all_to_all_single(routed, input_splits, output_splits, pg)


def _through_count_exchange(post: Callable[..., Any], group_of: Callable[..., Any]) -> Callable[..., Any]:
    """``post`` (torchtitan's count-exchange poster) through :func:`..overlap.comm.count_exchange`;
    ``group_of(*args)`` names its group."""
    if getattr(post, "_titan_dualpipe", False):
        return post

    def posted(*args: Any, **kwargs: Any) -> Any:
        from ..overlap.comm import count_exchange

        return count_exchange(lambda: post(*args, **kwargs), group_of(*args, **kwargs))

    posted._titan_dualpipe = True  # type: ignore[attr-defined]
    return posted


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
    splits and permutation on the module for the combine; two halves of one microbatch run the
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


def install(*, count_exchange: bool = False) -> None:
    """Route torchtitan's expert-parallel all-to-all through the relay (idempotent); with
    ``count_exchange`` (bench runs) its token-count exchange through ``comm.count_exchange`` too.
    Our schedules' two-batch overlap then counts torchtitan's MoE stages as stages with exchanges."""
    from ..runtime.deferred_weights import register_expert_class
    from ..runtime.two_batch import register_exchange_rule

    register_exchange_rule(has_expert_parallel_moe)
    register_expert_class(importlib.import_module(GEN.experts_module).GroupedExperts)  # weight GEMMs wait for W
    if GEN.registry:
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

        AllToAllTokenDispatcher._dispatch_token_exchange = _dispatch_token_exchange
        AllToAllTokenDispatcher._combine_token_exchange = _combine_token_exchange
        if count_exchange:
            AllToAllTokenDispatcher._token_count_exchange = _through_count_exchange(
                AllToAllTokenDispatcher._token_count_exchange, lambda self, counts, pg, ep_size: pg)
        _share_meshes_with_the_relay()
        return
    from torchtitan.distributed import expert_parallel

    from ..overlap.comm import relayed_all_to_all_single

    expert_parallel.all_to_all_single_autograd = relayed_all_to_all_single
    for name in _DISPATCH_STATE:
        if not isinstance(expert_parallel.ExpertParallel.__dict__.get(name), PerThread):
            setattr(expert_parallel.ExpertParallel, name, PerThread(name))
    if count_exchange:
        expert_parallel.all_to_all_single = _through_count_exchange(
            expert_parallel.all_to_all_single, lambda x, output_splits, input_splits, group, *_: group)
