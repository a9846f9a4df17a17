"""Compute orders the simulator can run, with the data flow between their stages.

A :class:`Pipeline` is a per-rank compute order plus its chains of stages (data flows
along a chain: forwards from a stage to the next, gradients back). Sources:

- ours: ``DualPipe`` (two chains) and ``DualPipeV`` (one), from :func:`compute_order`;
- torch's built-in schedules (``1F1B``, ``GPipe``, ``Interleaved1F1B``, ``LoopedBFS``,
  ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``torch:DualPipeV``), one chain
  ``0..num_stages-1``; ``torch:`` may prefix any of them;
- a torch-format CSV (:func:`pipeline_from_csv`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from .._compat.pipelining import F, _Action
from ..orders import SCHEDULES as OUR_SCHEDULES
from ..orders import compute_order, placement
from ..orders.csv_io import load_csv
from ..orders.dataflow import Chains
from ..orders.lowering import leaf_actions

Order = dict[int, list[_Action]]

# name -> (torch class, stages per rank)
TORCH_SCHEDULES: dict[str, tuple[type, int]] = {
    "GPipe": (ScheduleGPipe, 1),
    "1F1B": (Schedule1F1B, 1),
    "LoopedBFS": (ScheduleLoopedBFS, 2),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, 2),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, 2),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, 2),
    "torch:DualPipeV": (ScheduleDualPipeV, 2),
}
TORCH_PREFIX = "torch:"
SCHEDULE_NAMES = tuple(TORCH_SCHEDULES) + tuple(OUR_SCHEDULES)


@dataclass(frozen=True)
class Pipeline(Chains):
    """A compute order (``{rank: [action]}``, compute actions only) and its stage chains."""

    name: str
    order: Order
    chains: tuple[tuple[int, ...], ...]
    n_microbatches: int

    @property
    def pp_size(self) -> int:
        return len(self.order)

    @property
    def num_stages(self) -> int:
        return sum(len(chain) for chain in self.chains)

    @cached_property
    def stage_rank(self) -> dict[int, int]:
        return _stage_ranks(self.order, self.name)

    @property
    def model_share(self) -> float:
        """Fraction of ``1/pp`` of the model one stage holds (0.5 when a chain has ``2 * pp`` stages)."""
        return self.pp_size / max(len(chain) for chain in self.chains)


def _stage_ranks(order: Order, name: str) -> dict[int, int]:
    ranks: dict[int, int] = {}
    for rank, actions in order.items():
        for action in actions:
            for leaf in leaf_actions(action):
                if ranks.setdefault(leaf.stage_index, rank) != rank:
                    raise ValueError(
                        f"{name}: stage {leaf.stage_index} runs on ranks {ranks[leaf.stage_index]} "
                        f"and {rank}; a stage must live on one rank."
                    )
    return ranks


def compute_only(order: dict[int, list[_Action | None]]) -> Order:
    """Drop idle slots and communication/FSDP actions: the simulator times compute only."""
    return {rank: [a for a in actions if a is not None and a.is_compute_op] for rank, actions in order.items()}


def canonical_schedule(name: str) -> str:
    """Case-insensitive lookup; a ``torch:`` prefix selects torch's class of that name."""
    wanted = str(name).lower()
    for candidate in SCHEDULE_NAMES:
        if candidate.lower() == wanted:
            return candidate
    if wanted.startswith(TORCH_PREFIX):
        bare = wanted[len(TORCH_PREFIX):]
        for candidate in TORCH_SCHEDULES:
            if candidate.lower() in (bare, TORCH_PREFIX + bare):
                return candidate
    raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULE_NAMES)}.")


@dataclass
class _OrderOnlyStage:
    """What torch's schedule constructors read from a stage to build their order; nothing runs."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int = 0
    submod: Any = None
    stage_index_to_group_rank: Any = None


def _no_loss(output: Any, target: Any) -> Any:
    return output


def torch_order(name: str, pp_size: int, n_microbatches: int) -> dict[int, list[_Action | None]]:
    """Order of one of torch's built-in schedules, built without a process group.

    The schedule classes compute every rank's order in their constructor from a few stage
    attributes (``num_stages``, ``group_size``, ``group_rank``); stand-in stages carrying
    just those let the constructor run unchanged, validation and lowering included.
    """
    cls, stages_per_rank = TORCH_SCHEDULES[name]
    num_stages = pp_size * stages_per_rank
    stages = [_OrderOnlyStage(i * pp_size, num_stages, pp_size) for i in range(stages_per_rank)]
    try:
        if stages_per_rank == 1:
            schedule = cls(stages[0], n_microbatches, loss_fn=_no_loss)
        else:
            schedule = cls(stages, n_microbatches, loss_fn=_no_loss)
    except (ValueError, RuntimeError, AssertionError) as err:
        raise ValueError(
            f"torch's {name} cannot build an order for pp={pp_size}, microbatches={n_microbatches}: {err}"
        ) from None
    if cls is Schedule1F1B:
        # torch 2.13's Schedule1F1B order (a description only: its runtime keeps its own
        # counters) numbers the last rank's forwards 1..n; the runtime runs 0..n-1.
        return _number_forwards_in_run_order(schedule.pipeline_order)
    return schedule.pipeline_order


def _number_forwards_in_run_order(order: dict[int, list[_Action | None]]) -> dict[int, list[_Action | None]]:
    """Give the k-th forward of each stage microbatch k."""
    count: dict[int, int] = {}
    renumbered: dict[int, list[_Action | None]] = {}
    for rank, actions in order.items():
        renumbered[rank] = []
        for action in actions:
            if action is not None and action.computation_type == F:
                k = count.get(action.stage_index, 0)
                count[action.stage_index] = k + 1
                action = _Action(action.stage_index, F, k)
            renumbered[rank].append(action)
    return renumbered


def pipeline_for(name: str, pp_size: int, n_microbatches: int) -> Pipeline:
    """The :class:`Pipeline` of a named schedule (ours or torch's)."""
    name = canonical_schedule(name)
    if pp_size < 1 or n_microbatches < 1:
        raise ValueError(f"{name} needs pp >= 1 and microbatches >= 1, got pp={pp_size}, microbatches={n_microbatches}.")
    if name in OUR_SCHEDULES:
        place = placement(name, pp_size, n_microbatches)
        return Pipeline(name, compute_order(name, pp_size, n_microbatches), place.chains, n_microbatches)
    order = compute_only(torch_order(name, pp_size, n_microbatches))
    num_stages = pp_size * TORCH_SCHEDULES[name][1]
    return Pipeline(name, order, (tuple(range(num_stages)),), n_microbatches)


def pipeline_from_csv(path: str) -> Pipeline:
    """A torch-format CSV (one row per rank, compute_only or compute_comms) as a :class:`Pipeline`.

    The chains are read off the order: if every stage runs the same microbatches there is
    one chain ``0..S-1`` (torch's assumption); if the first and second half of the stages
    run two disjoint halves of the microbatches it is DualPipe's pair of chains.
    """
    try:
        order = compute_only(load_csv(path))
    except RuntimeError as err:  # torch's parser reports bad cells as RuntimeError
        raise ValueError(f"{path}: {err}") from None
    if not any(order.values()):
        raise ValueError(f"{path} holds no compute actions (F, B, I, W or OVERLAP_F_B).")
    microbatches = _microbatches_per_stage(order)
    return Pipeline(f"csv:{path}", order, _chains_from(microbatches, path), _count(microbatches))


def _microbatches_per_stage(order: Order) -> dict[int, frozenset[int]]:
    seen: dict[int, set[int]] = {}
    for actions in order.values():
        for action in actions:
            for leaf in leaf_actions(action):
                seen.setdefault(leaf.stage_index, set()).add(leaf.microbatch_index)
    return {stage: frozenset(mbs) for stage, mbs in seen.items()}


def _count(microbatches: dict[int, frozenset[int]]) -> int:
    return len(frozenset().union(*microbatches.values()))


def _chains_from(microbatches: dict[int, frozenset[int]], source: str) -> tuple[tuple[int, ...], ...]:
    num_stages = max(microbatches) + 1
    missing = sorted(set(range(num_stages)) - set(microbatches))
    if missing:
        raise ValueError(f"{source}: stages {missing} never run, but stage {num_stages - 1} does; stages must be 0..S-1.")
    if len(set(microbatches.values())) == 1:
        return (tuple(range(num_stages)),)
    half = num_stages // 2
    first = {microbatches[s] for s in range(half)}
    second = {microbatches[s] for s in range(half, num_stages)}
    if num_stages % 2 == 0 and len(first) == len(second) == 1:
        (first_mbs,), (second_mbs,) = first, second
        if not first_mbs & second_mbs:
            return (tuple(range(half)), tuple(range(half, num_stages)))
    raise ValueError(
        f"{source}: stages run different sets of microbatches, so the data flow is unclear; "
        "expected every stage to run the same microbatches (one chain) or DualPipe's two "
        "halves (stages 0..S/2-1 and S/2..S-1 on disjoint microbatches)."
    )
