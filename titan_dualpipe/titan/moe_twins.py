"""DualPipe + MoE: keep the twins' load-balancing state identical.

torchtitan's MoE counts routed tokens per expert in a buffer (``tokens_per_expert``; 0.3.0:
``tokens_per_expert_E``) during the forward, and an optimizer step pre-hook (registered by the
train spec's ``build_optimizers_fn``; 0.3.0: the model spec's ``post_optimizer_build_fn``)
turns the counts into an ``expert_bias`` update.
Under DualPipe each copy of a model part sees only its direction's half of the microbatches,
so the two copies would count different tokens and their biases (hence routing) would drift
apart. A pre-hook placed before torchtitan's adds the twin's counts to each copy: both then
hold the full-batch counts a single copy sees under 1F1B and make the same update.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.p2p import swap
from .generation import GEN
from .active import ACTIVE


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def expert_counts(parts: dict[int, nn.Module]) -> list[torch.Tensor]:
    """Count buffers in model-part order, the same layout on both twin ranks."""
    return [
        _local(buf)
        for part in sorted(parts)
        for name, buf in parts[part].named_buffers()
        if name.rsplit(".", 1)[-1] == GEN.expert_count_buffer
    ]


@torch.no_grad()
def sum_twin_counts(parts: dict[int, nn.Module], peer: int, group: dist.ProcessGroup | None) -> None:
    """Add the twin rank's expert counts to ours (the peer does the same, mirrored)."""
    counts = expert_counts(parts)
    if not counts:
        return
    mine = torch.cat([c.reshape(-1) for c in counts])
    (theirs,) = swap([mine], [mine], peer, group)
    total = mine + theirs
    for count, chunk in zip(counts, total.split([c.numel() for c in counts])):
        count.copy_(chunk.view_as(count))


def _active_parts_and_peer() -> tuple[dict[int, nn.Module], int, dist.ProcessGroup | None]:
    plan = ACTIVE.plan
    assert plan is not None and ACTIVE.stages, "DualPipe stages are built before the optimizer"
    group = ACTIVE.stages[0].group
    rank = ACTIVE.stages[0].group_rank
    parts = {stage.stage_index % plan.pp: stage.submod for stage in ACTIVE.stages}
    return parts, dist.get_global_rank(group, plan.pp - 1 - rank), group


def add_twin_count_hook(optimizers: Any, model_parts: list[nn.Module]) -> None:
    """Register the twin-count sum as the first optimizer step pre-hook (before the bias update)."""
    if expert_counts(dict(enumerate(model_parts))):
        handle = optimizers.register_step_pre_hook(lambda *_a, **_k: sum_twin_counts(*_active_parts_and_peer()))
        optimizers._optimizer_step_pre_hooks.move_to_end(handle.id, last=False)


def with_twin_expert_counts(build_optimizers: Callable[..., Any]) -> Callable[..., Any]:
    """0.2.2: wrap a train spec's ``build_optimizers_fn``."""

    def build_optimizers_fn(model_parts: list[nn.Module], *args: Any, **kwargs: Any) -> Any:
        optimizers = build_optimizers(model_parts, *args, **kwargs)
        add_twin_count_hook(optimizers, model_parts)
        return optimizers

    return build_optimizers_fn


def with_twin_expert_counts_030(post_build: Callable[..., None]) -> Callable[..., None]:
    """0.3.0: wrap a model spec's ``post_optimizer_build_fn(optimizers, model_parts, parallel_dims)``."""

    def post_optimizer_build_fn(optimizers: Any, model_parts: list[nn.Module], *args: Any, **kwargs: Any) -> None:
        post_build(optimizers, model_parts, *args, **kwargs)
        add_twin_count_hook(optimizers, model_parts)

    post_optimizer_build_fn._titan_dualpipe = True  # type: ignore[attr-defined]
    return post_optimizer_build_fn
