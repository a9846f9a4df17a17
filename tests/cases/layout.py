"""The layout most cases use: world ranks ``0 .. pp-1`` build one pipeline (pipeline rank = world
rank) and the pool's other ranks sit the case out.

Creating a process group is collective, so every rank calls :func:`pipeline_ranks`; the ranks
it gives None return None from the case, which is what the pool reports for a rank that did not
take part (``cases.dist_pool.ran`` keeps the others)::

    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
"""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class PipelineLayout(NamedTuple):
    group: dist.ProcessGroup  # the pipeline's ranks
    rank: int  # this rank's pipeline rank
    dp_mesh: "DeviceMesh | None"  # FSDP2's mesh (the data-parallel dimension), None without FSDP
    dp_index: int  # this rank's data-parallel index (0 without FSDP)


class PipelineRanks(NamedTuple):
    group: dist.ProcessGroup  # world ranks 0 .. pp-1
    rank: int  # this rank, in the group and in the world


@lru_cache(maxsize=None)
def first_ranks_group(size: int) -> dist.ProcessGroup:
    """Group of world ranks 0..size-1 (created on every rank, in the same order), once per process."""
    return dist.new_group(list(range(size)))


def pipeline_ranks(pp: int, timeout_s: float | None = None) -> PipelineRanks | None:
    """The first ``pp`` ranks' group and this rank, or None on the ranks beyond ``pp``.

    ``timeout_s``: a new group that gives up on a silent peer after that many seconds (cases that
    kill or fail a rank); otherwise the one group of the first ``pp`` ranks this process keeps."""
    if timeout_s is None:
        group = first_ranks_group(pp)
    else:
        group = dist.new_group(list(range(pp)), timeout=timedelta(seconds=timeout_s))
    rank = dist.get_rank()
    return PipelineRanks(group, rank) if rank < pp else None


def pipeline_layout(pp: int, fsdp: bool) -> PipelineLayout | None:
    """With ``fsdp``: a ``pp x (world / pp)`` mesh, FSDP2 over its second dimension, every rank
    taking part; otherwise :func:`pipeline_ranks` (None on the ranks beyond ``pp``)."""
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (pp, dist.get_world_size() // pp), mesh_dim_names=("pp", "dp"))
        return PipelineLayout(mesh["pp"].get_group(), mesh["pp"].get_local_rank(), mesh["dp"], mesh["dp"].get_local_rank())
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    return PipelineLayout(ranks.group, ranks.rank, None, 0)
