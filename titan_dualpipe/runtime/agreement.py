"""Every rank raises the same :class:`~.errors.PipelineConfigError` (a ``ValueError``) when any
rank's input is wrong, before any traffic.

A check that raises on one rank only leaves the others blocked in their next collective. So
each rank first states its problem (or none) in one small fixed-size collective that every
rank reaches whatever its inputs (:func:`agree`); only when some rank has a problem do all
of them gather the messages (a second collective they all know they must run) and raise the
joined text.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import PipelineConfigError


def agree(problem: str, group: dist.ProcessGroup | None, device: torch.device,
          facts: list[int] | None = None) -> torch.Tensor:
    """Raise PipelineConfigError on every rank if any rank's ``problem`` is non-empty.

    ``facts``: small integers every rank should see from every other (e.g. batch sizes); the
    result is a ``[group size, 1 + len(facts)]`` tensor (column 0: whether that rank has a
    problem), gathered in the same collective.
    """
    mine = torch.tensor([int(bool(problem)), *(facts or [])], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).cpu()
    if table[:, 0].any():
        raise_all(problem, group)
    return table


def raise_all(problem: str, group: dist.ProcessGroup | None) -> None:
    """Every rank of ``group`` calls this when some rank has a problem: all raise the same text."""
    problems: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    raise PipelineConfigError("; ".join(dict.fromkeys(p for p in problems if p)))
