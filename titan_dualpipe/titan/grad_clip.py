"""Gradient-norm clipping that counts each DualPipe twin once.

With DualPipe every model part is held twice (direction 0 on rank ``j``, direction 1 on rank
``pp-1-j``), both copies holding the same full-batch gradient after ``step()``, so torchtitan's
``clip_grad_norm_`` (summed over all local parameters, reduced over the PP group) would count every
gradient twice. Here the norm is taken over the direction-0 copies only, with torchtitan's own
function, which clips them; the direction-1 copies are scaled by the same ``total_norm``, so the
twins stay identical. Twins folded into FSDP (:mod:`.fold`) are shards of one parameter, which
torchtitan's norm counts once per twin rank: the double count is taken out of its norm, and every
shard is clipped by that. Any other schedule goes straight to torchtitan's function.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch

from .active import ACTIVE


def direction1_parameters() -> set[int]:
    """ids of this rank's direction-1 (second copy) parameters; empty unless DualPipe."""
    plan = ACTIVE.plan
    if plan is None or plan.schedule != "DualPipe":
        return set()
    return {id(p) for stage in ACTIVE.stages if stage.stage_index >= plan.pp for p in stage.submod.parameters()}


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group DTensor parameters by mesh: one foreach clip per group (as torchtitan does for EP)."""
    groups: dict[Any, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        groups[getattr(p, "device_mesh", None)].append(p)
    return list(groups.values())


def make_clip_grad_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def clip_grad_norm_(
        parameters: torch.Tensor | Iterable[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        pp_mesh: Any = None,
        ep_enabled: bool = False,
    ) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if ACTIVE.folded:  # every shard counted once per twin rank: take the double count out
            doubled = original(params, math.inf, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled)
            total_norm = doubled if math.isinf(norm_type) else doubled / 2 ** (1.0 / norm_type)
            to_clip = [p for p in params if p.grad is not None]
        else:  # the direction-0 copies' norm (torchtitan clips them), then the copies clipped by it
            twins = direction1_parameters()
            if not twins:
                return original(params, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled)
            once = [p for p in params if id(p) not in twins]
            total_norm = original(once, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled)
            to_clip = [p for p in params if id(p) in twins and p.grad is not None]
        for group in _by_mesh(to_clip):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm, foreach)
        return total_norm

    return clip_grad_norm_


def install() -> None:
    """train.py calls ``dist_utils.clip_grad_norm_`` through the module: replace it there."""
    from torchtitan.distributed import utils as dist_utils

    if not getattr(dist_utils, "_titan_dualpipe_installed", False):
        dist_utils.clip_grad_norm_ = make_clip_grad_norm(dist_utils.clip_grad_norm_)
        dist_utils._titan_dualpipe_installed = True
