"""Which half of a relayed pair runs first: the schedule option ``pair_first``.

A relay switches halves at every hand-over, so the half that runs first decides which of the
partner's segments covers each exchange. Which covers more depends on the pair's stages: the
forward of a stage that starts with a long segment (attention, the router) is best started second,
its first segment covering the backward's first exchange. ``"forward"`` (the default) runs the
forward first, ``"backward"`` the backward; ``"measured"`` decides per kind of pair (its
forward's stage and its backward's) from the run itself:

- the second step (the first pays stage initialisation and first-call costs) records each relayed
  pair's segments and exchanges (:mod:`titan_dualpipe.exposure.record`, a benchmark's recorder
  where one runs), and sums per kind what starting with the backward saves in the floor's model
  (:func:`~titan_dualpipe.exposure.floor.run_in_order` of both alternations);
- one all-reduce over the default process group sums the savings over ranks, so every rank that
  runs pairs of a kind chooses the same first half. It must: the first half decides the order in
  which both halves post their collectives on a shared communicator (the expert-parallel group),
  which must be the same on every rank;
- from the third step on, a kind whose summed saving is positive runs backward first.

Only exchanges whose time is known (the CPU's emulated exchanges) give a saving, and only a CPU
run's segments are timed (on a GPU the host's clock would time kernel launches); elsewhere every
kind keeps the forward first. docs/overlap.md#which-half-first.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from .._compat.pipelining import _Action
from ..exposure.floor import relay_order, run_in_order
from ..exposure.record import PairTrace, recorder, start_recording, stop_recording
from .relay import BACKWARD, FORWARD

MEASURED_STEP = 1  # which step "measured" records (counting from 0)


class PairFirst:
    """The ``pair_first`` option of one schedule (module docstring): ``first(forward, backward)``
    for each relayed pair, and :meth:`step` around each step's actions."""

    def __init__(self, mode: str, num_stages: int, device: torch.device) -> None:
        self.mode = mode
        self._num_stages = num_stages
        self._device = device
        self._steps = 0
        self._backward_first: set[tuple[int, int]] = set()
        self.savings: dict[tuple[int, int], float] | None = None  # "measured", once decided: seconds, all ranks

    def first(self, forward: _Action, backward: _Action) -> int:
        """:data:`~.relay.FORWARD` or :data:`~.relay.BACKWARD`: the half of this pair that runs first."""
        if self.mode == "backward" or (forward.stage_index, backward.stage_index) in self._backward_first:
            return BACKWARD
        return FORWARD

    @staticmethod
    def kind(forward: _Action, backward: _Action) -> tuple[int, int]:
        """What a recorder files the pair under."""
        return forward.stage_index, backward.stage_index

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one step's actions: on the measured step, record its pairs and decide after them."""
        measuring = self.mode == "measured" and self._steps == MEASURED_STEP
        self._steps += 1
        if not measuring:
            yield
            return
        # a CPU run's segments only: on a GPU the host's clock would time kernel launches (no saving there)
        timed = self._device.type == "cpu"
        own = timed and recorder() is None  # a benchmark's recorder keeps recording; else one for this step
        record = start_recording() if own else recorder() if timed else None
        mark = record.closed_pairs() if record is not None else 0
        try:
            yield
            pairs = record.pairs_since(mark) if record is not None else []
        except BaseException:
            self._steps -= 1  # a failed step decides nothing: the next one is measured
            raise
        finally:
            if own:
                stop_recording()
        self._decide(pairs)

    def _decide(self, pairs: list[PairTrace]) -> None:
        n = self._num_stages
        saved = savings_by_kind(pairs, n).to(self._device)
        dist.all_reduce(saved)  # every rank steps: the default group reaches every communicator's ranks
        totals = saved.cpu().tolist()
        self.savings = {(k // n, k % n): s for k, s in enumerate(totals) if s != 0.0}
        self._backward_first = {kind for kind, s in self.savings.items() if s > 0.0}

    @property
    def backward_first(self) -> frozenset[tuple[int, int]]:
        """The kinds of pair (forward stage, backward stage) that run backward first under "measured"."""
        return frozenset(self._backward_first)


def savings_by_kind(pairs: list[PairTrace], num_stages: int) -> torch.Tensor:
    """Seconds that starting with the backward saves, summed per kind of pair: entry
    ``forward_stage * num_stages + backward_stage`` (pairs filed under no kind, or with a half that
    never ran, count nowhere)."""
    saved = torch.zeros(num_stages * num_stages, dtype=torch.float64)
    for pair in pairs:
        if pair.kind is not None and all(pair.halves):
            forward_stage, backward_stage = pair.kind
            saved[forward_stage * num_stages + backward_stage] += backward_first_saves(pair)
    return saved


def backward_first_saves(pair: PairTrace, queue: str = "fifo") -> float:
    """Seconds of exposure that starting ``pair`` with its backward saves over starting with its
    forward, each half switching at every hand-over, in the floor's model of its measured segments."""
    halves = pair.halves
    return (run_in_order(halves, relay_order(halves, FORWARD), queue).exposure
            - run_in_order(halves, relay_order(halves, BACKWARD), queue).exposure)
