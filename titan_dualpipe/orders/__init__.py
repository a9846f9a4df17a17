"""Pure compute orders: functions of ``(schedule, pp_size, n_microbatches)``, no process group."""

from __future__ import annotations

from .._compat.pipelining import _Action
from .errors import PipelineConfigError
from .placement import SCHEDULES, Placement, canonical_name, check_requirements, placement
from .recipe import PhaseOp, recipe, to_actions


def _rank_order(place: Placement, rank: int) -> list[_Action]:
    pp, n = place.pp_size, place.n_microbatches
    near, far = place.stages_of(rank)  # direction-0 stage, direction-1 stage
    if place.bidirectional:
        half_rank = min(rank, pp - 1 - rank)
        in_second_half = rank >= pp // 2
        # Phase 0 is the direction whose first stage is nearer this rank.
        phase_stages = (far, near) if in_second_half else (near, far)
        ops = recipe(pp // 2, half_rank, n // 2)
    else:
        phase_stages = (near, far)
        ops = recipe(pp, rank, n)
    microbatches = {stage: place.microbatches(stage) for stage in (near, far)}
    return to_actions(ops, phase_stages, microbatches)


def compute_order(schedule: str, pp_size: int, n_microbatches: int) -> dict[int, list[_Action]]:
    """The per-rank compute order of ``schedule`` ("DualPipeV" or "DualPipe").

    Returns ``{rank: [action, ...]}`` in torch's ``_Action`` IR (F, I, W, B and
    ``OVERLAP_F_B`` pairs); stage ids follow :mod:`titan_dualpipe.orders.placement`.
    Raises :class:`PipelineConfigError` (a ``ValueError``) when the schedule cannot run with these values.
    """
    place = placement(schedule, pp_size, n_microbatches)
    return {rank: _rank_order(place, rank) for rank in range(pp_size)}


def identify_order(order: dict[int, list[_Action | None]]) -> tuple[str, int, int] | None:
    """``(schedule, pp, n_microbatches)`` whose compute order ``order`` is, or None.

    For messages about a CSV loaded under the wrong config: it names the config it fits.
    """
    compute = {r: [a for a in acts if a is not None and a.is_compute_op] for r, acts in order.items()}
    pp = len(compute)
    leaves = [leaf for acts in compute.values() for a in acts for leaf in (a.sub_actions or (a,))]
    forwards_of_stage_0 = sum(1 for a in leaves if a.stage_index == 0 and a.computation_type.name == "FORWARD")
    for schedule, n in (("DualPipeV", forwards_of_stage_0), ("DualPipe", 2 * forwards_of_stage_0)):
        try:
            if compute_order(schedule, pp, n) == compute:
                return schedule, pp, n
        except ValueError:
            continue
    return None


__all__ = [
    "PipelineConfigError",
    "SCHEDULES",
    "Placement",
    "PhaseOp",
    "canonical_name",
    "check_requirements",
    "compute_order",
    "identify_order",
    "placement",
    "recipe",
    "to_actions",
]
