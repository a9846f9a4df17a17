"""``two_batch_overlap="measured"``: which stages split their lone microbatches, decided from the run.

Sub-batches hide a lone microbatch's exchanges behind the other sub-batch's compute, and pay
each op's fixed costs and each exchange's latency twice; which wins depends on the stage, the
microbatch's size and the device. "measured" times both on the candidate stages (those whose
module posts expert-parallel exchanges, as for ``True``):

- from training step 1 (step 0 pays first calls and stage initialisation), :data:`ROUNDS` paired
  rounds: a step with every lone microbatch whole, then one with those of the candidate stages
  split. Each times, on the stages' device, the actions splitting changes, by stage: the forwards
  that have no pair partner, and those microbatches' backward actions, alone or in a pair
  (:func:`lone_seconds`);
- one all-reduce over the default process group sums per stage and round what splitting saved,
  and how many microbatches split, so every rank that holds a stage decides the same. It must: a
  split microbatch posts two exchanges where the whole posts one, on the expert-parallel
  communicator every holder of the stage shares;
- from then on, a stage splits where some microbatch split (one of a single row runs whole either
  way: nothing to decide) and splitting saved at least :data:`MIN_SAVING` of the whole time in
  every round. A smaller saving, or one round's alone, is a step's noise on a CPU (two runs of
  one configuration would choose differently), and whole microbatches are the simpler run.

Every rank must pass the same option (as every other option of the schedule).
docs/overlap.md#two-batch-overlap.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from .._compat.pipelining import OVERLAP_F_B, B, F, I, W, _Action
from .timeline import TimedAction

FIRST_TIMED_STEP = 1  # the training step (counting from 0) the first round starts at
ROUNDS = 2  # paired rounds: a whole step, then a split step
MIN_SAVING = 0.02  # of the lone actions' whole time: what splitting must save in every round
_LONE_KINDS = frozenset({F, B, I, W})

Key = tuple[int, int]  # (stage, microbatch)


class MeasuredTwoBatch:
    """The "measured" choice of one schedule on one rank (module docstring)."""

    def __init__(self, candidates: Iterable[int], num_stages: int, device: torch.device) -> None:
        self.candidates = frozenset(candidates)  # this rank's stages with expert-parallel exchanges
        self._num_stages = num_stages
        self._device = device
        self._steps = 0  # training steps that ended
        self._seconds: list[dict[int, float]] = []  # per timed step, in order (whole, split, ...): by stage
        self._splits: dict[int, int] = {}  # microbatches that split, by stage, over the split steps
        self.chosen: frozenset[int] | None = None  # this rank's stages that split, once decided
        # once decided, every stage where some microbatch split: seconds saved, summed over rounds
        # and ranks; and every stage that splits (this rank's or not)
        self.savings: dict[int, float] | None = None
        self.chosen_everywhere: frozenset[int] | None = None

    def _timed_step(self) -> int | None:
        """The coming training step's place among the timed ones (odd: a split step), None if untimed."""
        index = self._steps - FIRST_TIMED_STEP
        return index if self.chosen is None and 0 <= index < 2 * ROUNDS else None

    def stages(self, training: bool) -> set[int]:
        """The stages whose lone microbatches split in the coming step."""
        if self.chosen is not None:
            return set(self.chosen)
        index = self._timed_step() if training else None
        return set(self.candidates) if index is not None and index % 2 == 1 else set()

    def times(self, training: bool) -> bool:
        """Whether the coming step's actions are timed for the choice."""
        return training and self._timed_step() is not None

    def step_ended(self, timeline: list[TimedAction], lone: set[Key], split: set[Key]) -> None:
        """After a training step that ran to its end: ``timeline``, its timed actions (where
        :meth:`times` said so); ``lone``, the (stage, microbatch) of its forwards without a pair;
        ``split``, those that ran as sub-batches."""
        index = self._timed_step()
        if index is not None:
            self._seconds.append(lone_seconds(timeline, {key for key in lone if key[0] in self.candidates}))
            for stage, _ in split:
                self._splits[stage] = self._splits.get(stage, 0) + 1
            if index == 2 * ROUNDS - 1:
                self._decide(self._seconds, self._splits)
        self._steps += 1

    def _decide(self, seconds: list[dict[int, float]], splits: dict[int, int]) -> None:
        """``seconds``: per timed step (whole, split, ...), this rank's by stage."""
        n = self._num_stages
        totals = torch.zeros(2 * ROUNDS + 1, n, dtype=torch.float64)  # per round: whole, saved; then splits
        for stage in self.candidates:
            for r in range(ROUNDS):
                whole, split = seconds[2 * r].get(stage, 0.0), seconds[2 * r + 1].get(stage, 0.0)
                totals[2 * r, stage], totals[2 * r + 1, stage] = whole, whole - split
            totals[-1, stage] = splits.get(stage, 0)
        totals = totals.to(self._device)
        dist.all_reduce(totals)  # every rank steps: the default group reaches every holder of a stage
        rows = totals.cpu().tolist()
        self.savings = {s: sum(rows[2 * r + 1][s] for r in range(ROUNDS)) for s in range(n) if rows[-1][s] > 0}
        self.chosen_everywhere = frozenset(
            s for s in self.savings if all(rows[2 * r + 1][s] >= MIN_SAVING * rows[2 * r][s] for r in range(ROUNDS)))
        self.chosen = self.chosen_everywhere & self.candidates


def lone_seconds(timeline: list[TimedAction], lone: set[Key]) -> dict[int, float]:
    """Seconds per stage of the actions two-batch overlap changes: the forwards of ``lone``, their
    backward actions (B, I, W), and the pairs whose backward half is one of those (a split
    microbatch backpropagates through both sub-batches' graphs there too), filed under the
    microbatch's stage."""
    seconds: dict[int, float] = {}
    for event in timeline:
        for stage in _changed_stages(event.action, lone):
            seconds[stage] = seconds.get(stage, 0.0) + (event.end - event.start)
    return seconds


def _changed_stages(action: _Action, lone: set[Key]) -> set[int]:
    if action.computation_type == OVERLAP_F_B:
        return {b.stage_index for b in action.sub_actions
                if b.computation_type != F and (b.stage_index, b.microbatch_index) in lone}
    key = (action.stage_index, action.microbatch_index)
    return {action.stage_index} if action.computation_type in _LONE_KINDS and key in lone else set()
