"""FSDP2's internals the runtime reads and steers: each module's parameter groups (their divide
factors, data-parallel sizes, shard groups, post-forward resharding) and which modules composable
DDP ``replicate`` holds. FSDP2 keeps one parameter group per module before 2.13, a list from 2.13
on (:func:`_fsdp_param_groups`). Read against torch 2.11.0, 2.13.0, 2.14.1.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist


def _fsdp_param_groups(module: Any) -> list[Any]:
    """FSDP2's parameter groups of ``module``: one per module before torch 2.13
    (``_fsdp_param_group``), a list from 2.13 on (``_fsdp_param_groups``)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return list(groups)


def fsdp_gradient_divide_factors(module: Any) -> list[float | None]:
    """The gradient divide factor of each FSDP2 parameter group of ``module`` (None: FSDP's
    default, the mean over its mesh)."""
    return [group.gradient_divide_factor for group in _fsdp_param_groups(module)]


def fsdp_data_parallel_sizes(module: Any) -> list[int]:
    """Ranks each FSDP2 parameter group of ``module`` averages over by default (its data-parallel
    mesh: shard x replicate; an expert group's mesh excludes the expert-parallel dimension)."""
    return [group.mesh_info.mesh.size() for group in _fsdp_param_groups(module)]


def fsdp_shard_group_ranks(module: Any) -> list[list[int]]:
    """Global ranks of the process group each FSDP2 parameter group of ``module`` shards over
    (HSDP: the shard dimension's group); none for a group that only replicates (composable
    ``replicate_with_fsdp``, whose mesh info has no shard group)."""
    return [dist.get_process_group_ranks(group.mesh_info.shard_process_group) for group in _fsdp_param_groups(module)
            if getattr(group.mesh_info, "shard_process_group", None) is not None]


def replicated_by_ddp(module: torch.nn.Module) -> list[str]:
    """Names of ``module``'s modules (``""``: itself) under composable ``replicate`` of
    ``torch.distributed._composable.replicate`` (DDP's reducer, in autograd's accumulation hooks),
    not the FSDP-based ``replicate_with_fsdp`` (an ``FSDPModule``)."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in module.named_modules()
            if "replicate" in (_get_registry(m) or {}) and not isinstance(m, FSDPModule)]


@contextlib.contextmanager
def fsdp_post_forward_decided(modules: list[Any], reshard: Callable[[Any], bool]) -> Iterator[list[Any]]:
    """Within the block, each post-forward of an FSDP2 parameter group of ``modules`` asks
    ``reshard(group)``: False keeps the group's parameters gathered; True reshards them as a lone
    forward's post-forward does (by the group's ``reshard_after_forward``). FSDP2 itself applies that
    setting only to a group still in its forward: a group that another forward's post-forward left
    idle is resharded whatever the setting. Yields the groups (for :func:`fsdp_reshard_after_forward`)."""
    groups = [group for module in modules for group in _fsdp_param_groups(module)]
    for group in groups:
        group.post_forward = _decided_post_forward(group, type(group).post_forward.__get__(group), reshard)
    try:
        yield groups
    finally:
        for group in groups:
            group.__dict__.pop("post_forward", None)


def _decided_post_forward(group: Any, post_forward: Callable[..., Any],
                          reshard: Callable[[Any], bool]) -> Callable[..., Any]:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    def decided(module: Any, args: Any, output: Any) -> Any:
        if reshard(group):
            if group._training_state == TrainingState.IDLE:
                group._training_state = TrainingState.FORWARD
            return post_forward(module, args, output)
        group.reshard = _keep_gathered  # for this call: the method's lookup finds the instance's first
        try:
            return post_forward(module, args, output)
        finally:
            del group.reshard

    return decided


def _keep_gathered() -> None:
    pass


def fsdp_reshard_after_forward(group: Any) -> None:
    """Reshard an idle FSDP2 parameter group (one of :func:`fsdp_post_forward_decided`'s) as a
    post-forward does: only when its ``reshard_after_forward`` says so."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    if group._training_state != TrainingState.IDLE:
        return
    group._training_state = TrainingState.FORWARD
    try:
        group.reshard()
    finally:
        group._training_state = TrainingState.IDLE


__all__ = [
    "fsdp_data_parallel_sizes",
    "fsdp_gradient_divide_factors",
    "fsdp_post_forward_decided",
    "fsdp_reshard_after_forward",
    "fsdp_shard_group_ranks",
    "replicated_by_ddp",
]
