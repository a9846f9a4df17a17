"""Which half of a relayed pair runs first, and where it hands over: the option ``pair_first``.

A relay switches halves at every hand-over, so the half that runs first decides which of the
partner's segments covers each exchange. Which covers more depends on the pair's stages: the
forward of a stage that starts with a long segment (attention, the router) is best started second,
its first segment covering the backward's first exchange. ``"forward"`` (the default) runs the
forward first, ``"backward"`` the backward; ``"measured"`` decides per kind of pair (what it holds,
a forward with a backward or two lone actions of one direction, and their stages) from the run
itself:

- the second step (the first pays stage initialisation and first-call costs) records each relayed
  pair's segments, exchanges and hand-overs (:mod:`titan_dualpipe.exposure.record`, a benchmark's
  recorder where one runs);
- two all-reduces over the default process group give every rank each kind's mean segments, so
  every rank that runs pairs of a kind runs them in one order. It must: the order decides the order
  in which both halves post their collectives on a shared communicator (the expert-parallel group),
  which must be the same on every rank;
- from the third step on, each kind runs in the order the floor finds for its mean segments
  (:func:`~titan_dualpipe.exposure.floor.floor`): the half that runs first, and at each hand-over
  whether the partner runs next (:func:`~titan_dualpipe.exposure.floor.hand_over_plan`); a half
  that keeps the turn waits for its own exchange. A kind whose pairs differ in shape (between ranks,
  or a half offering hand-overs its record has no exchange for, as chunked exchanges do) alternates,
  from the half whose start the model says exposes less.

``"measured_first"`` decides the same way but keeps every kind alternating, from the half whose
start exposes less in the model: what ``"measured"`` chose before it planned hand-overs.

A lone pair (:mod:`titan_dualpipe.orders.lone_pairs`: two forwards, or two backwards) runs its first
action first under ``"forward"`` and ``"backward"``, which name the halves of a forward with a
backward; the measured modes order its halves as they do any kind.

Only exchanges whose time is known (an emulated network's) give an order; elsewhere every kind
keeps the forward first. The segments are timed by the host's clock on the CPU and by CUDA events
on the compute stream on a GPU (:class:`~titan_dualpipe.exposure.record.DeferredRecorder`, read
once after the step). docs/overlap.md#which-half-first.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from .._compat.pipelining import F, _Action
from ..exposure.floor import (
    Exchange, Half, HandOverPlan, Segment, floor, hand_over_plan, normalized, relay_order, run_in_order,
)
from ..exposure.record import PairTrace, recorder, start_recording, stop_recording
from .relay import BACKWARD, FORWARD

MEASURED_STEP = 1  # which step "measured" records (counting from 0)
_SEGMENT_FIELDS = 9  # per segment slot: has an exchange, switch, channel, their squares; compute, seconds, lead
# what a relayed pair holds: a forward with a backward, two lone forwards, two lone backwards (B or I)
FORWARD_BACKWARD, TWO_FORWARDS, TWO_BACKWARDS = 0, 1, 2
_HOLDS = 3
Kind = tuple[int, int, int]  # a relayed pair's first action's stage, its second's, and what it holds


@dataclass(frozen=True)
class KindOrder:
    """How "measured" runs one kind of pair: ``first``, and the relay's ``plan`` (None: alternate);
    ``saved``: seconds a pair of the kind's mean segments exposes less than forward first, alternating."""

    first: int
    plan: HandOverPlan | None
    saved: float


class PairFirst:
    """The ``pair_first`` option of one schedule (module docstring): ``first(forward, backward)``
    and ``plan(forward, backward)`` for each relayed pair, and :meth:`step` around each step's actions."""

    def __init__(self, mode: str, num_stages: int, device: torch.device) -> None:
        self.mode = mode
        self._num_stages = num_stages
        self._device = device
        self._steps = 0
        self.orders: dict[Kind, KindOrder] | None = None  # "measured", once decided: the same on all ranks

    def first(self, first: _Action, second: _Action) -> int:
        """:data:`~.relay.FORWARD` or :data:`~.relay.BACKWARD`: the half of this pair that runs first
        (of a lone pair: its ``first`` action's half or its ``second``'s)."""
        kind = self.kind(first, second)
        if self.mode == "backward" and kind[2] == FORWARD_BACKWARD:
            return BACKWARD
        chosen = (self.orders or {}).get(kind)
        return FORWARD if chosen is None else chosen.first

    def plan(self, first: _Action, second: _Action) -> HandOverPlan | None:
        """Where this pair's halves switch (:func:`~titan_dualpipe.exposure.floor.hand_over_plan`); None: at every hand-over."""
        chosen = (self.orders or {}).get(self.kind(first, second))
        return None if chosen is None else chosen.plan

    @property
    def queue(self) -> str:
        """How a communicator's exchanges queue in the floor's model: "fifo" (NCCL's ready order,
        the CPU's emulation) or, on a GPU, "serial": the emulated network's delays run one after
        another on one side stream."""
        return "serial" if self._device.type == "cuda" else "fifo"

    @staticmethod
    def kind(first: _Action, second: _Action) -> Kind:
        """What a recorder files the pair of ``first`` and ``second`` under (a forward with a
        backward, or a lone pair's two actions in their order)."""
        forwards = (first.computation_type == F) + (second.computation_type == F)
        holds = FORWARD_BACKWARD if forwards == 1 else TWO_FORWARDS if forwards == 2 else TWO_BACKWARDS
        return first.stage_index, second.stage_index, holds

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one step's actions: on the measured step, record its pairs and decide after them."""
        measuring = self.mode in ("measured", "measured_first") and self._steps == MEASURED_STEP
        self._steps += 1
        if not measuring:
            yield
            return
        # the host's clock on the CPU, CUDA events on a GPU (whose host runs ahead of its kernels)
        timed = self._device.type in ("cpu", "cuda")
        own = timed and recorder() is None  # a benchmark's recorder keeps recording; else one for this step
        record = start_recording(device=self._device) if own else recorder() if timed else None
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
        local = shapes_by_kind(pairs)
        counts = _shape_sums(local, self._num_stages).to(self._device)
        dist.all_reduce(counts)  # every rank steps: the default group reaches every communicator's ranks
        lengths = agreed_lengths(counts.cpu())
        if not any(lengths):  # the same on every rank: nothing recorded anywhere (a GPU), or no kind agreed
            self.orders = {}
            return
        sums = _segment_sums(local, lengths, self._num_stages).to(self._device)
        dist.all_reduce(sums)
        sums = sums.cpu()
        orders = {}
        for k, agreed in enumerate(lengths):
            if agreed is not None:
                halves = mean_halves(sums[k], agreed)
                if halves is not None:
                    orders[kind_of_slot(k, self._num_stages)] = kind_order(
                        halves, agreed[3:], planned=self.mode == "measured", queue=self.queue)
        self.orders = orders

    @property
    def savings(self) -> dict[Kind, float] | None:
        """"measured", once decided: per kind, the seconds its order saves a mean pair (the floor's model)."""
        return None if self.orders is None else {kind: o.saved for kind, o in self.orders.items()}


# -- a kind's shape, agreed across ranks ------------------------------------------------------
# A pair's shape: each half's segments (normalized as the floor takes them) with, per segment,
# whether it posts an exchange, whether the exchange is a hand-over, and its channel (numbered in
# the order the pair first meets it, so that ranks naming communicators differently agree); and
# each half's hand-over offers.
Shape = tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int, int], ...], tuple[int, int]]


def shape_of(halves: Sequence[Half], offers: tuple[int, int]) -> Shape:
    """The shape of a pair's normalized ``halves`` that offered ``offers`` hand-overs."""
    channels: dict = {}
    marks = []
    for half in halves:
        row = []
        for segment in half:
            e = segment.exchange
            channel = -1 if e is None or e.channel is None else channels.setdefault(e.channel, len(channels))
            row.append((int(e is not None), int(e is not None and e.switch), channel))
        marks.append(tuple(row))
    return marks[0], marks[1], offers


Halves = tuple[tuple[Segment, ...], ...]  # a pair's halves, normalized


def slot_of_kind(kind: Kind, num_stages: int) -> int:
    """A kind's row in the tables the ranks all-reduce."""
    first, second, holds = kind
    return (holds * num_stages + first) * num_stages + second


def kind_of_slot(slot: int, num_stages: int) -> Kind:
    rest, second = divmod(slot, num_stages)
    holds, first = divmod(rest, num_stages)
    return first, second, holds


def shapes_by_kind(pairs: list[PairTrace]) -> dict[Kind, tuple[Shape, list[Halves]]]:
    """Per kind, its most common shape among ``pairs`` (ties: the least shape) and the pairs of it,
    normalized; pairs filed under no kind, with a half that never ran, or without offers count nowhere."""
    grouped: dict[Kind, dict[Shape, list]] = {}
    for pair in pairs:
        if pair.kind is None or pair.offers is None or not all(pair.halves):
            continue
        halves = tuple(normalized(h) for h in pair.halves)
        shape = shape_of(halves, (pair.offers[0], pair.offers[1]))
        first, second, holds = pair.kind
        grouped.setdefault((first, second, holds), {}).setdefault(shape, []).append(halves)
    return {kind: min(by_shape.items(), key=lambda item: (-len(item[1]), item[0]))
            for kind, by_shape in grouped.items()}


def _shape_sums(local: dict, num_stages: int) -> torch.Tensor:
    """Per kind: ranks holding it, and each of its four sizes (segments and offers per half) with its square."""
    out = torch.zeros(_HOLDS * num_stages * num_stages, 9, dtype=torch.float64)
    for kind, (shape, _) in local.items():
        sizes = torch.tensor([len(shape[0]), len(shape[1]), *shape[2]], dtype=torch.float64)
        out[slot_of_kind(kind, num_stages)] = torch.cat([torch.ones(1, dtype=torch.float64), sizes, sizes * sizes])
    return out


# per kind whose holders agree: (ranks holding it, segments of each half, offers of each half)
Lengths = tuple[int, int, int, int, int]


def agreed_lengths(counts: torch.Tensor) -> list[Lengths | None]:
    """Per kind, its holders and the segments and offers of each half, where every rank holding it
    has the same (else None)."""
    out: list[Lengths | None] = []
    for row in counts.tolist():
        holders, sums, squares = row[0], row[1:5], row[5:9]
        same = holders > 0 and _all_equal(holders, sums, squares)
        out.append((int(holders), *(int(s / holders) for s in sums)) if same else None)  # type: ignore[arg-type]
    return out


def _all_equal(holders: float, sums: Sequence[float], squares: Sequence[float]) -> bool:
    """Whether each value, summed over ``holders`` ranks with its square, was the same on all of them
    (n * sum(v^2) == sum(v)^2 only where every v is equal; exact for these small integers)."""
    return all(holders * q == s * s for s, q in zip(sums, squares))


def _slots(lengths: list[Lengths | None]) -> int:
    return max((max(n[1], n[2]) for n in lengths if n is not None), default=0)


def _segment_sums(local: dict, lengths: list, num_stages: int) -> torch.Tensor:
    """Per kind whose lengths agree: per segment slot, this rank's shape marks with their squares,
    and its pairs' mean compute, exchange seconds and lead."""
    out = torch.zeros(_HOLDS * num_stages * num_stages, 2, _slots(lengths), _SEGMENT_FIELDS, dtype=torch.float64)
    for kind, (shape, pairs) in local.items():
        k = slot_of_kind(kind, num_stages)
        if lengths[k] is None:
            continue
        for h in range(2):
            for i, marks in enumerate(shape[h]):
                segments = [pair[h][i] for pair in pairs]
                timing = [statistics.fmean(s.compute for s in segments),
                          statistics.fmean(s.exchange.seconds if s.exchange else 0.0 for s in segments),
                          statistics.fmean(s.exchange.lead if s.exchange else 0.0 for s in segments)]
                out[k, h, i] = torch.tensor([*marks, *(m * m for m in marks), *timing], dtype=torch.float64)
    return out.flatten(1)


def mean_halves(row: torch.Tensor, lengths: Lengths) -> list[tuple[Segment, ...]] | None:
    """One kind's halves from its summed slots: each segment the mean over the ranks holding it;
    None where those ranks' shapes differ."""
    slots = row.view(2, -1, _SEGMENT_FIELDS).tolist()
    holders = lengths[0]
    halves = []
    for h in range(2):
        half = []
        for values in slots[h][:lengths[1 + h]]:
            marks, squares, timing = values[0:3], values[3:6], values[6:9]
            if not _all_equal(holders, marks, squares):
                return None
            has, switch, channel = (m / holders for m in marks)
            compute, seconds, lead = (t / holders for t in timing)
            exchange = Exchange(seconds, lead, None if channel < 0 else int(channel), bool(switch)) if has else None
            half.append(Segment(compute, exchange))
        halves.append(tuple(half))
    return halves


def kind_order(halves: Sequence[Half], offers: tuple[int, int], planned: bool = True, queue: str = "fifo") -> KindOrder:
    """The order "measured" runs a kind of pair in, from its mean halves (module docstring);
    ``planned=False`` ("measured_first"): an alternation, from the half that exposes less."""
    alternating = run_in_order(halves, relay_order(halves, FORWARD), queue).exposure
    if planned:
        best = floor(halves, queue)
        first, plan = hand_over_plan(halves, best.order)
        if tuple(len(p) for p in plan) == tuple(offers):
            return KindOrder(first, plan, alternating - best.exposure)
    backward = run_in_order(halves, relay_order(halves, BACKWARD), queue).exposure
    return KindOrder(BACKWARD if backward < alternating else FORWARD, None, max(0.0, alternating - backward))
