"""``two_batch_overlap="measured"``: which stages split their lone microbatches, decided from the run.

Sub-batches hide a lone microbatch's exchanges behind the other sub-batch's compute, and pay
each op's fixed costs and each exchange's latency twice; which wins depends on the stage, the
microbatch's size and the device. "measured" times both on the candidate stages (those whose
module posts expert-parallel exchanges, as for ``True``):

- training step 1 (step 0 pays first calls and stage initialisation) runs every lone microbatch
  whole, step 2 splits those of the candidate stages. Both time, on the stages' device, each
  stage's lone actions: the forwards that have no pair partner and the backward actions of those
  microbatches that run outside pairs (:func:`lone_seconds`);
- one all-reduce over the default process group sums per stage what splitting saved and how many
  microbatches split, so every rank that holds a stage decides the same. It must: a split
  microbatch posts two exchanges where the whole posts one, on the expert-parallel communicator
  every holder of the stage shares;
- from step 3 on, a stage splits where some microbatch split (one of a single row runs whole
  either way: nothing to decide) and the summed saving is at least :data:`MIN_SAVING` of the
  summed whole time: a smaller one is a single step's noise on a CPU (two runs of the same
  configuration would choose differently), and whole microbatches are the simpler run.

Every rank must pass the same option (as every other option of the schedule).
docs/overlap.md#two-batch-overlap.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

from .._compat.pipelining import B, F, I, W, _Action
from .timeline import TimedAction

WHOLE_STEP, SPLIT_STEP = 1, 2  # the training steps "measured" times (counting from 0)
MIN_SAVING = 0.02  # of the lone actions' whole time: what splitting must save to be chosen
_LONE_KINDS = frozenset({F, B, I, W})

Key = tuple[int, int]  # (stage, microbatch)


class MeasuredTwoBatch:
    """The "measured" choice of one schedule on one rank (module docstring)."""

    def __init__(self, candidates: Iterable[int], num_stages: int, device: torch.device) -> None:
        self.candidates = frozenset(candidates)  # this rank's stages with expert-parallel exchanges
        self._num_stages = num_stages
        self._device = device
        self._steps = 0  # training steps that ended
        self._whole: dict[int, float] = {}  # seconds per stage on the whole step
        self.chosen: frozenset[int] | None = None  # this rank's stages that split, once decided
        # once decided, every stage where some microbatch split: seconds saved, summed over ranks;
        # and every stage that splits (this rank's or not)
        self.savings: dict[int, float] | None = None
        self.chosen_everywhere: frozenset[int] | None = None

    def stages(self, training: bool) -> set[int]:
        """The stages whose lone microbatches split in the coming step."""
        if self.chosen is not None:
            return set(self.chosen)
        return set(self.candidates) if training and self._steps == SPLIT_STEP else set()

    def times(self, training: bool) -> bool:
        """Whether the coming step's actions are timed for the choice."""
        return training and self.chosen is None and self._steps in (WHOLE_STEP, SPLIT_STEP)

    def step_ended(self, timeline: list[TimedAction], lone: set[Key], split: set[Key]) -> None:
        """After a training step that ran to its end: ``timeline``, its timed actions (where
        :meth:`times` said so); ``lone``, the (stage, microbatch) of its forwards without a pair;
        ``split``, those that ran as sub-batches."""
        if self.times(True):
            seconds = lone_seconds(timeline, {key for key in lone if key[0] in self.candidates})
            if self._steps == WHOLE_STEP:
                self._whole = seconds
            else:
                self._decide(seconds, split)
        self._steps += 1

    def _decide(self, split_seconds: dict[int, float], split: set[Key]) -> None:
        n = self._num_stages
        totals = torch.zeros(3, n, dtype=torch.float64)
        for stage in self.candidates:
            totals[0, stage] = self._whole.get(stage, 0.0)
            totals[1, stage] = self._whole.get(stage, 0.0) - split_seconds.get(stage, 0.0)
            totals[2, stage] = sum(1 for key in split if key[0] == stage)
        totals = totals.to(self._device)
        dist.all_reduce(totals)  # every rank steps: the default group reaches every holder of a stage
        whole, saved, splits = totals.cpu().tolist()
        self.savings = {s: saved[s] for s in range(n) if splits[s] > 0}
        self.chosen_everywhere = frozenset(s for s, seconds in self.savings.items() if seconds >= MIN_SAVING * whole[s])
        self.chosen = self.chosen_everywhere & self.candidates


def lone_seconds(timeline: list[TimedAction], lone: set[Key]) -> dict[int, float]:
    """Seconds per stage of the actions two-batch overlap changes: the forwards of ``lone`` and
    their backward actions (B, I, W) outside pairs."""
    seconds: dict[int, float] = {}
    for event in timeline:
        action: _Action = event.action
        key = (action.stage_index, action.microbatch_index)
        if action.computation_type in _LONE_KINDS and key in lone:
            seconds[key[0]] = seconds.get(key[0], 0.0) + (event.end - event.start)
    return seconds
