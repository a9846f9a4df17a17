"""The token-count exchange on a communicator of its own.

An MoE dispatch reads its peers' per-expert token counts on the host right after posting them.
On the expert-parallel group's communicator, which runs its collectives in order, that read
would first wait out the partner half's token exchange posted before it. :func:`make_count_groups`
gives every expert-parallel group a twin with the same ranks, made once before the first step;
:func:`count_group` names the twin a group's count exchange uses (a group without one keeps its
own communicator). Why, and when a group has no twin: docs/overlap.md#in-torchtitan.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch.distributed as dist


class _Twins:
    """The twins made in one default process group."""

    def __init__(self) -> None:
        self.mine: dict[tuple[int, ...], dist.ProcessGroup] = {}  # this rank's groups' twins, by ranks
        self.made: set[tuple[int, ...]] = set()  # every twin made, this rank a member or not


# By default group, held weakly: once torch lets go of a group (destroy_process_group), its twins
# go with it. Held past that, they would be freed at interpreter exit, where gloo's worker
# threads, still releasing the last collective's tensors, cannot take the GIL and abort.
_TWINS: "weakref.WeakKeyDictionary[dist.ProcessGroup, _Twins]" = weakref.WeakKeyDictionary()


def _current_twins() -> _Twins:
    """The twins of the current default process group (a new one starts afresh)."""
    return _TWINS.setdefault(dist.group.WORLD, _Twins())


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of ``group`` (a process group, or a one-dimensional device mesh)."""
    if hasattr(group, "get_group"):  # DeviceMesh
        group = group.get_group()
    return tuple(dist.get_process_group_ranks(group))


def make_count_groups(groups: Iterable[Any]) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """A count communicator for each expert-parallel group in ``groups`` (this rank's) and in every
    other rank's: collective over the world, so every rank calls it, before the first step.

    Every rank makes every twin (``new_group`` asks that of all ranks), in one order (by ranks),
    each once: the least twin not yet made always has every rank at it, so the making cannot
    deadlock, with eager NCCL initialisation too. Returns this rank's twins by ranks."""
    mine = sorted({group_ranks(group) for group in groups})
    everyone: list[list[tuple[int, ...]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    twins = _current_twins()
    wanted = sorted({tuple(ranks) for theirs in everyone for ranks in theirs or []} - twins.made)
    me = dist.get_rank()
    for ranks in wanted:
        twin = dist.new_group(list(ranks))
        twins.made.add(ranks)
        if me in ranks:
            twins.mine[ranks] = twin
    return {ranks: twins.mine[ranks] for ranks in mine}


def count_group(group: Any) -> Any:
    """The communicator for ``group``'s token-count exchange: its twin, or ``group`` itself."""
    if group is None or not dist.is_initialized():
        return group
    twins = _TWINS.get(dist.group.WORLD)  # read on every dispatch: makes nothing
    return twins.mine.get(group_ranks(group), group) if twins is not None and twins.mine else group
