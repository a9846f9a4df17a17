"""The floor: the least exchange time a pair's two halves could leave exposed, computed exactly.

A half is a chain of compute segments, each posting an exchange (:class:`Segment`,
:class:`Exchange`); one compute resource runs both halves' segments, one at a time, while
exchanges fly. Exchanges on one ``channel`` (a communicator) queue ``"fifo"`` (each ready no
earlier than the one posted before it, as NCCL) or ``"serial"`` (each starts once the one before
has arrived: one side stream); ``channel=None`` flies on its own. :func:`floor` finds the order
that leaves compute least idle, by a dynamic program over the segments done in each half;
:func:`lone_exposure` is a half without a partner; :func:`hand_over_plan` turns an order into
what a relay does at each hand-over. The floor tells how much of a run's exposure
is the runtime's order and how much the work's shape. The model, and why the program is exact:
docs/overlap.md#the-floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

QUEUES = ("fifo", "serial")


@dataclass(frozen=True)
class Exchange:
    """One exchange: ``seconds`` in flight from its post, posted ``lead`` seconds of its half's
    compute before the segment that posts it ends; ``channel``: the communicator it queues on
    (None: on its own); ``switch``: the partner half may compute while it flies (a hand-over)."""

    seconds: float
    lead: float = 0.0
    channel: Hashable | None = None
    switch: bool = True

    def __post_init__(self) -> None:
        if not (self.seconds >= 0 and self.lead >= 0):
            raise ValueError(f"an exchange's seconds and lead must be >= 0, got {self.seconds} and {self.lead}")


@dataclass(frozen=True)
class Segment:
    """``compute`` seconds of one half between two exchanges, and the exchange it posts (None: the
    half's last segment)."""

    compute: float
    exchange: Exchange | None = None

    def __post_init__(self) -> None:
        if not self.compute >= 0:
            raise ValueError(f"a segment's compute must be >= 0, got {self.compute}")


Half = Sequence[Segment]
# per half of a pair, at each of its hand-overs in turn: does the partner run next?
HandOverPlan = tuple[tuple[bool, ...], tuple[bool, ...]]


@dataclass(frozen=True)
class Placed:
    """A segment as an order places it: ``half``'s segment ``index`` computes from ``start`` to
    ``end``, after ``idle`` seconds of the compute resource waiting for it."""

    half: int
    index: int
    start: float
    end: float
    idle: float


@dataclass(frozen=True)
class Schedule:
    """An order of the segments, each started as early as it allows."""

    exposure: float  # compute idle, waiting for exchanges
    makespan: float
    placed: tuple[Placed, ...]

    @property
    def order(self) -> tuple[int, ...]:
        return tuple(p.half for p in self.placed)

    def idle_by_half(self) -> tuple[float, ...]:
        """Exposure charged to the half whose segment waited."""
        halves = max((p.half for p in self.placed), default=-1) + 1
        return tuple(sum(p.idle for p in self.placed if p.half == h) for h in range(halves))


def normalized(half: Half) -> tuple[Segment, ...]:
    """``half`` as the floor takes it: a segment that posts no exchange is merged into the next,
    a lead is at most its segment's compute, and a last exchange gets an empty segment after it
    (the half ends once it has arrived)."""
    out: list[Segment] = []
    carry = 0.0
    for segment in half:
        exchange = segment.exchange
        compute = segment.compute + carry
        if exchange is None:
            carry = compute
            continue
        if exchange.lead > compute:
            exchange = Exchange(exchange.seconds, compute, exchange.channel, exchange.switch)
        out.append(Segment(compute, exchange))
        carry = 0.0
    out.append(Segment(carry))
    return tuple(out)


class _Run:
    """Times of a partial order (docs/overlap.md#the-floor): compute free at ``t``, each half's
    next segment ready at ``ready[h]``, each channel's last arrival in ``channels``."""

    __slots__ = ("t", "ready", "channels")

    def __init__(self, t: float, ready: tuple[float, ...], channels: tuple[float, ...]) -> None:
        self.t, self.ready, self.channels = t, ready, channels

    def key(self) -> tuple[float, ...]:
        t = self.t
        return (t, *(max(r, t) for r in self.ready), *(max(c, t) for c in self.channels))


def _step(run: _Run, h: int, segment: Segment, channel_index: dict[Hashable, int], queue: str) -> tuple[_Run, float]:
    """``run`` after half ``h`` computes ``segment`` as early as it can; and the idle before it."""
    start = max(run.t, run.ready[h])
    end = start + segment.compute
    ready, channels = list(run.ready), run.channels
    exchange = segment.exchange
    if exchange is not None:
        posted = end - exchange.lead
        if exchange.channel is None:
            arrival = posted + exchange.seconds
        else:
            c = channel_index[exchange.channel]
            last = channels[c]
            arrival = max(posted + exchange.seconds, last) if queue == "fifo" else max(posted, last) + exchange.seconds
            channels = channels[:c] + (arrival,) + channels[c + 1:]
        ready[h] = arrival
    else:
        ready[h] = end
    return _Run(end, tuple(ready), channels), start - run.t


def _prepare(halves: Sequence[Half], queue: str) -> tuple[list[tuple[Segment, ...]], dict[Hashable, int]]:
    if queue not in QUEUES:
        raise ValueError(f"queue must be one of {QUEUES}, got {queue!r}")
    if not 1 <= len(halves) <= 2:
        raise ValueError(f"a pair has one or two halves, got {len(halves)}")
    prepared = [normalized(h) for h in halves]
    channels = sorted({s.exchange.channel for h in prepared for s in h
                       if s.exchange is not None and s.exchange.channel is not None}, key=repr)
    return prepared, {c: i for i, c in enumerate(channels)}


def _forced(segment: Segment, h: int, done: int, length: int) -> int | None:
    """The half that must run next after ``h`` ran ``segment`` (its ``done``-th of ``length``):
    ``h`` itself after an exchange it reads at once, else None."""
    exchange = segment.exchange
    return h if exchange is not None and not exchange.switch and done < length else None


def run_in_order(halves: Sequence[Half], order: Sequence[int], queue: str = "fifo") -> Schedule:
    """The schedule of ``order`` (the half of each segment, in turn), every segment as early as
    it allows. ValueError for an order that does not run every segment once, or that puts the
    partner's segment after an exchange its half reads at once."""
    prepared, channel_index = _prepare(halves, queue)
    lengths = [len(h) for h in prepared]
    if sorted(order) != sorted(h for h, n in enumerate(lengths) for _ in range(n)):
        raise ValueError(f"the order {list(order)} does not run every segment of halves of {lengths} segments once")
    run = _Run(0.0, (0.0,) * len(prepared), (0.0,) * len(channel_index))
    done = [0] * len(prepared)
    placed, forced = [], None
    for h in order:
        if forced is not None and h != forced:
            raise ValueError(f"the order {list(order)} switches halves after an exchange half {forced} reads at once")
        segment = prepared[h][done[h]]
        before = run.t
        run, idle = _step(run, h, segment, channel_index, queue)
        placed.append(Placed(h, done[h], before + idle, run.t, idle))
        done[h] += 1
        forced = _forced(segment, h, done[h], lengths[h])
    compute = sum(s.compute for half in prepared for s in half)
    return Schedule(run.t - compute, run.t, tuple(placed))


def floor(halves: Sequence[Half], queue: str = "fifo") -> Schedule:
    """The least-exposure order of one or two halves (see the module docstring) and its schedule."""
    prepared, channel_index = _prepare(halves, queue)
    if len(prepared) == 1:
        return run_in_order(prepared, [0] * len(prepared[0]), queue)
    n0, n1 = len(prepared[0]), len(prepared[1])
    start = _Run(0.0, (0.0, 0.0), (0.0,) * len(channel_index))
    # (i, j, forced half) -> non-dominated states, each with the order that reached it
    layer: dict[tuple[int, int, int | None], list[tuple[_Run, tuple[int, ...]]]] = {(0, 0, None): [(start, ())]}
    for _ in range(n0 + n1):
        following: dict[tuple[int, int, int | None], list[tuple[_Run, tuple[int, ...]]]] = {}
        for (i, j, forced), states in layer.items():
            for h in (0, 1) if forced is None else (forced,):
                done = (i, j)[h]
                if done == (n0, n1)[h]:
                    continue
                segment = prepared[h][done]
                node = (i + (h == 0), j + (h == 1), _forced(segment, h, done + 1, (n0, n1)[h]))
                bucket = following.setdefault(node, [])
                for run, order in states:
                    bucket.append((_step(run, h, segment, channel_index, queue)[0], order + (h,)))
        layer = {node: _non_dominated(states) for node, states in following.items()}
    (states,) = layer.values()
    _, best = min(states, key=lambda state: state[0].t)
    return run_in_order(prepared, best, queue)


def _non_dominated(states: list[tuple[_Run, tuple[int, ...]]]) -> list[tuple[_Run, tuple[int, ...]]]:
    """The states no other state dominates (one of equal ones), by their times."""
    keyed = sorted(((run.key(), run, order) for run, order in states), key=lambda s: s[0])
    kept: list[tuple[tuple[float, ...], _Run, tuple[int, ...]]] = []
    for key, run, order in keyed:  # sorted: a state can be dominated only by one before it
        if not any(all(a <= b for a, b in zip(other, key)) for other, _, _ in kept):
            kept.append((key, run, order))
    return [(run, order) for _, run, order in kept]


def relay_order(halves: Sequence[Half], first: int = 0, plan: HandOverPlan | None = None) -> tuple[int, ...]:
    """The order the runtime's policy gives: ``first`` runs until it posts an exchange it hands
    over at, then the other half, and so on; a half whose partner has ended runs on alone.
    ``plan``: per half, whether it switches at each of its hand-overs in turn (past its end: yes)."""
    prepared, _ = _prepare(halves, "fifo")
    lengths = [len(h) for h in prepared]
    done, offers, order, h = [0] * len(prepared), [0] * len(prepared), [], first
    while len(order) < sum(lengths):
        if done[h] == lengths[h]:
            h = 1 - h
        segment = prepared[h][done[h]]
        order.append(h)
        done[h] += 1
        if segment.exchange is not None and segment.exchange.switch and len(prepared) == 2:
            switches = plan is None or offers[h] >= len(plan[h]) or plan[h][offers[h]]
            offers[h] += 1
            h = 1 - h if switches else h
    return tuple(order)


def hand_over_plan(halves: Sequence[Half], order: Sequence[int]) -> tuple[int, HandOverPlan]:
    """How a relay runs ``order`` (two halves): the half that runs first, and for each half, at each
    of its hand-overs in turn (each exchange it may switch at), whether the partner runs next.
    ValueError for an order :func:`run_in_order` refuses."""
    prepared, _ = _prepare(halves, "fifo")
    if len(prepared) != 2:
        raise ValueError(f"a hand-over plan is for a pair of two halves, got {len(prepared)}")
    run_in_order(prepared, order)  # checks the order
    done, plan = [0, 0], ([], [])
    for position, h in enumerate(order):
        segment = prepared[h][done[h]]
        done[h] += 1
        if segment.exchange is not None and segment.exchange.switch:
            following = order[position + 1] if position + 1 < len(order) else h
            plan[h].append(following != h)
    return order[0], (tuple(plan[0]), tuple(plan[1]))


def lone_exposure(half: Half) -> float:
    """A half with no partner: every exchange exposed but for the compute its half runs after
    posting it (its ``lead``)."""
    return sum(max(0.0, s.exchange.seconds - s.exchange.lead) for s in normalized(half) if s.exchange is not None)


def serial_exposure(halves: Sequence[Half]) -> float:
    """Every exchange exposed in full, as where nothing overlaps them (1F1B)."""
    return sum(s.exchange.seconds for half in halves for s in half if s.exchange is not None)
