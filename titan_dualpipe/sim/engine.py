"""Event-driven simulation of a :class:`~titan_dualpipe.sim.schedules.Pipeline`.

Each rank runs its actions one at a time, in list order, from time 0. An action starts when its
rank is free and its inputs are there: ``F`` after the previous stage's ``F``; ``B`` / ``I`` after
its ``F`` and the next stage's ``B`` / ``I`` (a chain's last stage computes the loss); ``W`` after
its ``I``; an ``OVERLAP_F_B`` pair after both halves' inputs, handing both outputs over when it
ends. An input made on another rank arrives ``p2p`` later; an order in which some rank waits for
an input that never comes raises ValueError naming the stuck actions. Peak activations count live
stage-microbatch activations per rank (+1 at ``F``; -1 at ``B``, or at ``W`` after an ``I``; a pair
adds its forward before its backward releases). With ``two_batch=True`` (our schedules only) lone
forwards and their lone backwards cost ``F2`` and ``B2`` (:mod:`.two_batch` says which). Costs and
output: docs/simulate.md#simulate.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Collection
from dataclasses import dataclass

from .._compat.pipelining import B, F, I, OVERLAP_F_B, W, _Action
from ..orders.dataflow import input_source
from ..orders.lowering import leaf_actions
from ..orders.lone_pairs import is_lone_pair
from .costs import Costs
from .memory import peak_activation_bytes
from .schedules import TORCH_SCHEDULES, Pipeline
from .timeline import TimedAction
from .sub_batch_costs import freed_at_input, sub_batch_cost, sub_batch_actions


@dataclass(frozen=True)
class RankStats:
    """One rank's figures; ``bubble = makespan - busy``."""

    rank: int
    busy: float
    bubble: float
    bubble_ratio: float
    peak_activations: int
    actions: int


@dataclass(frozen=True)
class SimResult:
    pipeline: Pipeline
    costs: Costs
    p2p: float
    makespan: float
    ranks: list[RankStats]
    timeline: list[TimedAction]
    two_batch: bool = False

    @property
    def bubble_ratio(self) -> float:
        """Idle share of all ranks' time together."""
        total = self.makespan * len(self.ranks)
        return sum(r.bubble for r in self.ranks) / total if total else 0.0

    @property
    def max_bubble(self) -> float:
        """Largest per-rank bubble: the figure DeepSeek's bubble table gives."""
        return max(r.bubble for r in self.ranks)

    @property
    def peak_activations(self) -> int:
        return max(r.peak_activations for r in self.ranks)

    def to_json(self) -> dict:
        """The keys documented in :mod:`titan_dualpipe.sim`."""
        return {
            "schedule": self.pipeline.name,
            "pp": self.pipeline.pp_size,
            "microbatches": self.pipeline.n_microbatches,
            "num_stages": self.pipeline.num_stages,
            "costs": self.costs.as_dict(),
            "p2p": self.p2p,
            "two_batch": self.two_batch,
            "makespan": self.makespan,
            "busy_per_rank": [r.busy for r in self.ranks],
            "bubble_per_rank": [r.bubble for r in self.ranks],
            "bubble_ratio_per_rank": [r.bubble_ratio for r in self.ranks],
            "bubble_ratio": self.bubble_ratio,
            "max_bubble": self.max_bubble,
            "peak_activations_per_rank": [r.peak_activations for r in self.ranks],
            "peak_activations": self.peak_activations,
            "actions_per_rank": [r.actions for r in self.ranks],
        }


def action_cost(action: _Action, costs: Costs) -> float:
    """Time of ``action`` run whole (not as two sub-batches)."""
    kind = action.computation_type
    if kind == OVERLAP_F_B:  # a lone pair costs its two actions: no exchanges are timed for it to hide
        return sum(action_cost(sub, costs) for sub in action.sub_actions) if is_lone_pair(action) else costs.overlapped
    return {F: costs.F, B: costs.B, I: costs.I, W: costs.W}[kind]


def _inputs(leaf: _Action, pipe: Pipeline) -> list[tuple[_Action, ...]]:
    """What ``leaf`` waits for: a list of groups, each satisfied by any one of its actions
    (its stage's own earlier work, and the source of its input)."""
    stage, mb, kind = leaf.stage_index, leaf.microbatch_index, leaf.computation_type
    if kind not in (F, B, I, W):
        raise ValueError(f"{pipe.name}: cannot simulate {leaf}: only F, B, I, W and OVERLAP_F_B are timed.")
    if kind == W:
        return [(_Action(stage, I, mb),)]
    needs = [(_Action(stage, F, mb),)] if kind in (B, I) else []
    source = input_source(leaf, pipe)
    if source is not None:
        needs.append(tuple(_Action(source.stage, k, mb) for k in source.kinds))
    return needs


class _Run:
    """State of one simulation: per-rank cursor and clock, finished leaves, who waits on what.

    Leaves are numbered once up front so the inner loop indexes lists instead of hashing
    ``_Action`` tuples (whose enum member hashes in Python).
    """

    def __init__(self, pipe: Pipeline, costs: Costs, p2p: float, split: frozenset[_Action]) -> None:
        self.pipe, self.p2p, self.split = pipe, p2p, split
        self._ids: dict[_Action, int] = {}
        self.names: list[_Action] = []
        self.leaves = {rank: [self._number(leaf_actions(a)) for a in acts] for rank, acts in pipe.order.items()}
        self.needs = {
            rank: [[self._number(group) for leaf in leaf_actions(a) for group in _inputs(leaf, pipe)] for a in acts]
            for rank, acts in pipe.order.items()
        }
        self.durations = {rank: [self._cost(a, costs) for a in acts] for rank, acts in pipe.order.items()}
        self.position = {rank: 0 for rank in pipe.order}
        self.clock = {rank: 0.0 for rank in pipe.order}
        self.finished: list[tuple[float, int] | None] = [None] * len(self.names)  # (end, rank)
        self.waiting: dict[int, list[int]] = {}
        self.blocked_on: dict[int, tuple[int, ...]] = {}
        self.timeline: list[TimedAction] = []

    def _cost(self, action: _Action, costs: Costs) -> float:
        if action in self.split:
            return sub_batch_cost(action, costs.forward_in_sub_batches, costs.backward_in_sub_batches, self.pipe)
        return action_cost(action, costs)

    def _number(self, actions: tuple[_Action, ...]) -> tuple[int, ...]:
        for action in actions:
            if action not in self._ids:
                self._ids[action] = len(self.names)
                self.names.append(action)
        return tuple(self._ids[a] for a in actions)

    def earliest_start(self, rank: int, pos: int) -> float | None:
        """When the ``pos``-th action of ``rank`` can start, or None (recording what it waits for)."""
        start = self.clock[rank]
        for group in self.needs[rank][pos]:
            arrivals = [self._arrival(self.finished[i], rank) for i in group if self.finished[i] is not None]
            if not arrivals:
                self.blocked_on[rank] = group
                for needed in group:
                    self.waiting.setdefault(needed, []).append(rank)
                return None
            start = max(start, min(arrivals))
        return start

    def _arrival(self, finished: tuple[float, int], rank: int) -> float:
        end, producer_rank = finished
        return end + (self.p2p if producer_rank != rank else 0.0)

    def advance(self, rank: int) -> list[int]:
        """Run ``rank`` as far as its inputs allow; return the ranks its outputs may unblock."""
        actions, woken = self.pipe.order[rank], []
        while (pos := self.position[rank]) < len(actions):
            start = self.earliest_start(rank, pos)
            if start is None:
                break
            end = start + self.durations[rank][pos]
            self.timeline.append(TimedAction(rank, actions[pos], start, end, actions[pos] in self.split))
            self.clock[rank] = end
            self.position[rank] = pos + 1
            self.blocked_on.pop(rank, None)
            for leaf in self.leaves[rank][pos]:
                self.finished[leaf] = (end, rank)
                woken += self.waiting.pop(leaf, [])
        return woken

    def unfinished(self) -> bool:
        return any(self.position[r] < len(a) for r, a in self.pipe.order.items())

    def stuck_report(self) -> str:
        lines = []
        for rank, actions in sorted(self.pipe.order.items()):
            pos = self.position[rank]
            if pos < len(actions):
                needs = " or ".join(str(self.names[i]) for i in self.blocked_on.get(rank, ()))
                lines.append(f"rank {rank}: {actions[pos]} (action {pos + 1} of {len(actions)}) waits for {needs}")
        return "; ".join(lines)


def simulate(pipe: Pipeline, costs: Costs | None = None, p2p: float = 0.0, two_batch: bool = False) -> SimResult:
    """Time ``pipe``'s order with ``costs`` per action and ``p2p`` per cross-rank hand-off;
    ``two_batch``: lone forwards and their lone backwards as two sub-batches (``F2``, ``B2``)."""
    costs = costs or Costs()
    if p2p < 0:
        raise ValueError(f"p2p latency must be >= 0, got {p2p}.")
    _check_stages(pipe)
    run = _Run(pipe, costs, p2p, two_batch_actions(pipe) if two_batch else frozenset())
    ready = deque(sorted(pipe.order))
    while ready:
        ready.extend(run.advance(ready.popleft()))
    if run.unfinished():
        raise ValueError(
            f"{pipe.name} order cannot finish: these actions wait for inputs that are never "
            f"produced: {run.stuck_report()}"
        )
    return _result(run, costs, two_batch)


def two_batch_actions(pipe: Pipeline) -> frozenset[_Action]:
    """The actions of ``pipe`` that two-batch overlap runs as two sub-batches; ValueError for torch's
    schedules, whose runtime has no two-batch overlap."""
    if pipe.name in TORCH_SCHEDULES:
        raise ValueError(f"two-batch overlap is a feature of our schedules (DualPipe, DualPipeV), not of torch's "
                         f"{pipe.name}: simulate DualPipe or DualPipeV, or drop two_batch (--two-batch).")
    return sub_batch_actions(pipe.order)


def _check_stages(pipe: Pipeline) -> None:
    """Each stage on one rank and in one chain, so data flow and hand-off costs are defined."""
    unknown = sorted(set(pipe.stage_rank) - {s for chain in pipe.chains for s in chain})
    if unknown:
        raise ValueError(f"{pipe.name}: stages {unknown} run but belong to no chain of {pipe.chains}.")


def peak_activations(actions: list[_Action], freed_at_input: Collection[tuple[int, int]] = ()) -> int:
    """Most stage-microbatch activations alive at once on a rank running ``actions`` in order
    (``freed_at_input``: see :func:`~.memory.peak_activation_bytes`)."""
    return int(peak_activation_bytes(actions, defaultdict(lambda: 1), freed_at_input))


def _result(run: _Run, costs: Costs, two_batch: bool) -> SimResult:
    makespan = max((e.end for e in run.timeline), default=0.0)
    busy = {rank: 0.0 for rank in run.pipe.order}
    for e in run.timeline:
        busy[e.rank] += e.end - e.start
    freed = freed_at_input(run.split, run.pipe)
    stats = [
        RankStats(rank, busy[rank], makespan - busy[rank], (makespan - busy[rank]) / makespan if makespan else 0.0,
                  peak_activations(actions, freed), len(actions))
        for rank, actions in sorted(run.pipe.order.items())
    ]
    timeline = sorted(run.timeline, key=lambda e: (e.rank, e.start))
    return SimResult(run.pipe, costs, run.p2p, makespan, stats, timeline, two_batch)
