"""What the floor is computed from: each half's segments and exchanges as a run times them.

While a benchmark records (:func:`start_recording`), the overlap layer reports to the
:class:`ExposureRecorder` each pair opening and closing, which of its halves runs, stops or ends,
each exchange posted (its emulated seconds and communicator), each hand-over and each wait. From
these each half's chain of :class:`~titan_dualpipe.exposure.floor.Segment` is cut, and
:meth:`ExposureRecorder.take` hands over one step's :class:`StepTrace`. Nothing is recorded when
no benchmark asked (:func:`recorder` is None). What a segment is: docs/overlap.md#the-floor.

On the CPU the host's clock times the work. On a GPU the host runs ahead of the kernels it
launches, so a :class:`DeferredRecorder` marks each event with a CUDA event on the current stream
(:class:`DeviceClock`) and replays the events, their marks read as seconds, when a trace is asked
for (one synchronization).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch

from .floor import Exchange, Half, Segment, floor, lone_exposure, run_in_order, serial_exposure


class HalfTrace:
    """One half's segments, cut as its events arrive."""

    def __init__(self, counter: Iterator[int] | None = None) -> None:
        self.segments: list[Segment] = []
        self.begun: list[int] = []  # when each segment began computing, as a count shared by the pair's halves
        self._counter = counter if counter is not None else itertools.count()
        self.waits: list[tuple[float, float]] = []  # measured: blocked waiting for exchanges
        self.late = 0.0  # of those waits, past the exchanges' own (emulated) arrival
        self.overslept = 0.0  # of that, in a sleep that began in time (the emulator woken late)
        self.count_late = 0.0  # of that, in token-count reads' collectives (a peer posting its counts late)
        self._compute = 0.0  # of the open segment, up to _since
        self._since: float | None = None  # computing since (None: stopped or blocked)
        self._begun: int | None = None  # when the open segment began
        self._pending: list | None = None  # [seconds, channel, compute at the post, switch]
        self.offers = 0  # hand-overs offered (switching or not): a relay's plan counts them

    def _compute_at(self, t: float) -> float:
        return self._compute + (t - self._since if self._since is not None else 0.0)

    def run(self, t: float) -> None:
        if self._since is None:
            self._since = t
        if self._begun is None:
            self._begun = next(self._counter)

    def stop(self, t: float) -> None:
        self._compute = self._compute_at(t)
        self._since = None

    def posted(self, t: float, seconds: float, channel: Hashable | None) -> None:
        if self._pending is not None:  # an exchange never waited for: its segment ends here
            self._close(t)
            self.run(t)
        self._pending = [seconds, channel, self._compute_at(t), False]

    def switch(self) -> None:
        self.offers += 1
        if self._pending is not None:
            self._pending[3] = True

    def waited(self, start: float, end: float, late: float = 0.0, overslept: float = 0.0,
               count_late: float = 0.0) -> None:
        self.waits.append((start, end))
        self.late += late
        self.overslept += overslept
        self.count_late += count_late
        if self._pending is None:  # a wait for nothing posted here: off the compute, no segment cut
            self.stop(start)
            self._since = end
            return
        self._close(start)
        self._since, self._begun = end, next(self._counter)

    def end(self, t: float) -> None:
        self.stop(t)
        self._close(t)

    def _close(self, t: float) -> None:
        compute = self._compute_at(t)
        exchange = None
        if self._pending is not None:
            seconds, channel, at_post, switch = self._pending
            exchange = Exchange(seconds, max(0.0, compute - at_post), channel, switch)
        self.segments.append(Segment(compute, exchange))
        self.begun.append(next(self._counter) if self._begun is None else self._begun)
        self._compute, self._since, self._begun, self._pending = 0.0, None, None, None

    @property
    def waited_s(self) -> float:
        return sum(end - start for start, end in self.waits)


@dataclass
class PairTrace:
    """One pair (or two-batch halves) as it ran: each half's segments, the order they ran in
    (the half of each segment), the measured waits of each half, and when the pair ran;
    ``late``: seconds of the waits past the exchanges' own arrival (a peer posting late, a sleep
    woken late), which the floor's model does not see, ``overslept`` the part of it in sleeps woken
    late, ``count_late`` the part in token-count reads' collectives; ``kind``: what the runtime
    filed it under (a relayed pair's stages), None where it filed it under nothing; ``offers``:
    each half's hand-overs (whether or not the partner ran), which a relay's plan counts (None:
    not recorded)."""

    halves: tuple[tuple[Segment, ...], ...]
    order: tuple[int, ...]
    waits: tuple[tuple[tuple[float, float], ...], ...]
    start: float
    end: float
    late: float = 0.0
    kind: tuple[int, ...] | None = None
    offers: tuple[int, ...] | None = None
    overslept: float = 0.0
    count_late: float = 0.0

    @property
    def waited_s(self) -> float:
        return sum(end - start for half in self.waits for start, end in half)

    def to_json(self) -> dict[str, Any]:
        return {"halves": [[_segment_json(s) for s in half] for half in self.halves], "order": list(self.order),
                "waits": [[list(w) for w in half] for half in self.waits], "start": self.start, "end": self.end,
                "late": self.late, "kind": None if self.kind is None else list(self.kind),
                "offers": None if self.offers is None else list(self.offers), "overslept": self.overslept,
                "count_late": self.count_late}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PairTrace:
        return cls(tuple(tuple(_segment_from(s) for s in half) for half in data["halves"]), tuple(data["order"]),
                   tuple(tuple((a, b) for a, b in half) for half in data["waits"]), data["start"], data["end"],
                   data["late"], None if data.get("kind") is None else tuple(data["kind"]),
                   None if data.get("offers") is None else tuple(data["offers"]), data.get("overslept", 0.0),
                   data.get("count_late", 0.0))


@dataclass
class StepTrace:
    """One step: its pairs, and the exchanges outside pairs (lone halves) with their waits."""

    pairs: list[PairTrace] = field(default_factory=list)
    lone: tuple[Segment, ...] = ()
    lone_waits: tuple[tuple[float, float], ...] = ()
    lone_late: float = 0.0
    lone_overslept: float = 0.0
    lone_count_late: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"pairs": [p.to_json() for p in self.pairs], "lone": [_segment_json(s) for s in self.lone],
                "lone_waits": [list(w) for w in self.lone_waits], "lone_late": self.lone_late,
                "lone_overslept": self.lone_overslept, "lone_count_late": self.lone_count_late}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepTrace:
        return cls([PairTrace.from_json(p) for p in data["pairs"]], tuple(_segment_from(s) for s in data["lone"]),
                   tuple((a, b) for a, b in data["lone_waits"]), data["lone_late"], data.get("lone_overslept", 0.0),
                   data.get("lone_count_late", 0.0))


def _segment_json(segment: Segment) -> list:
    e = segment.exchange
    return [segment.compute] if e is None else [segment.compute, e.seconds, e.lead,
                                                None if e.channel is None else str(e.channel), e.switch]


def _segment_from(data: Sequence[Any]) -> Segment:
    if len(data) == 1:
        return Segment(data[0])
    compute, seconds, lead, channel, switch = data
    return Segment(compute, Exchange(seconds, lead, channel, switch))


class ExposureRecorder:
    """Collects one step's :class:`StepTrace` from the overlap layer's events (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.now = clock  # a mark for :meth:`waited`: on this recorder, the time itself
        self.host_clock = clock is time.perf_counter  # host times (time.perf_counter) are its marks
        self._pairs: list[PairTrace] = []
        self._pair: list[HalfTrace] | None = None
        self._pair_start = 0.0
        self._kind: tuple[int, ...] | None = None
        self._lone = HalfTrace()
        self._lone.run(clock())
        self._current = self._lone

    # -- a pair
    def open_pair(self, kind: tuple[int, ...] | None = None) -> bool:
        """Start recording a pair (filed under ``kind``); False (and nothing recorded for it) when
        one is open already."""
        if self._pair is not None:
            return False
        self._kind = kind
        now = self.clock()
        self._lone.stop(now)
        counter = itertools.count()
        self._pair, self._pair_start = [HalfTrace(counter), HalfTrace(counter)], now
        return True

    def run(self, half: int) -> None:
        if self._pair is not None:
            self._current = self._pair[half]
            self._current.run(self.clock())

    def stop(self, half: int) -> None:
        if self._pair is not None:
            self._pair[half].stop(self.clock())

    def end(self, half: int) -> None:
        if self._pair is not None:
            self._pair[half].end(self.clock())

    def close_pair(self) -> None:
        if self._pair is None:
            return
        now = self.clock()
        halves = self._pair
        for half in halves:
            if half._since is not None or half._pending is not None or half._compute:  # a half that never ended
                half.end(now)
        ran = sorted((begun, h) for h, half in enumerate(halves) for begun in half.begun)
        self._pairs.append(PairTrace(tuple(tuple(h.segments) for h in halves), tuple(h for _, h in ran),
                                     tuple(tuple(h.waits) for h in halves), self._pair_start, now,
                                     sum(h.late for h in halves), self._kind, tuple(h.offers for h in halves),
                                     sum(h.overslept for h in halves), sum(h.count_late for h in halves)))
        self._pair, self._current = None, self._lone
        self._lone.run(now)

    # -- exchanges, in whichever half runs (outside pairs: the lone half)
    def posted(self, seconds: float, channel: Hashable | None = None) -> None:
        self._current.posted(self.clock(), seconds, channel)

    def switch(self) -> None:
        self._current.switch()

    def waited(self, start: float, end: float, late: float = 0.0, overslept: float = 0.0,
               count_late: float = 0.0) -> None:
        """A wait for an exchange from ``start`` to ``end`` (marks of :attr:`now`); ``late``: seconds
        of it past the exchange's own arrival (the emulated time), which the floor does not model;
        of those, ``overslept``: a sleep that began in time ran past the arrival, ``count_late``: a
        token-count read's collective returned after it."""
        self._current.waited(start, end, late, overslept, count_late)

    def closed_pairs(self) -> int:
        """How many pairs closed since the last :meth:`take`: a mark for :meth:`pairs_since`."""
        return len(self._pairs)

    def pairs_since(self, mark: int) -> list[PairTrace]:
        """The pairs closed since ``mark`` (:meth:`closed_pairs`), leaving them to :meth:`take`."""
        return self._pairs[mark:]

    def take(self) -> StepTrace:
        """The step recorded since the last call (its pairs closed by now); the next starts."""
        lone = self._lone
        exchanges = tuple(s for s in lone.segments if s.exchange is not None)
        step = StepTrace(self._pairs, exchanges, tuple(lone.waits), lone.late, lone.overslept, lone.count_late)
        self._pairs = []
        fresh = HalfTrace()
        if self._pair is None:
            fresh.run(self.clock())
            self._current = fresh
        self._lone = fresh
        return step


class DeviceClock:
    """A CUDA device's clock: :meth:`mark` records an event on the calling thread's current stream
    (the stream the work runs on, the relay's helper thread included); :meth:`read` gives the
    seconds from the first of the marks it is given to each (it synchronizes the device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def read(self, marks: Sequence[torch.cuda.Event]) -> list[float]:
        torch.cuda.synchronize(self.device)
        return [marks[0].elapsed_time(m) / 1e3 for m in marks]


class DeferredRecorder:
    """:class:`ExposureRecorder`'s calls for a clock that is read later (:class:`DeviceClock`):
    each call is logged with a mark (:meth:`waited` with the marks it is given) and replayed into an
    :class:`ExposureRecorder` running on the marks' seconds when a trace is asked for
    (:meth:`take`, :meth:`closed_pairs`, :meth:`pairs_since`)."""

    def __init__(self, clock: DeviceClock) -> None:
        self.clock = clock
        self.now = clock.mark
        self.host_clock = False
        self._origin = clock.mark()
        self._log: list[tuple[str, tuple, tuple]] = []  # (method, arguments, marks)
        self._open = False
        self._at = 0.0  # the replay's clock: the seconds of the call being replayed
        self._live = ExposureRecorder(clock=lambda: self._at)

    def _logged(self, method: str, *args: Any) -> None:
        self._log.append((method, args, (self.clock.mark(),)))

    def open_pair(self, kind: tuple[int, ...] | None = None) -> bool:
        if self._open:  # as the live recorder answers
            return False
        self._open = True
        self._logged("open_pair", kind)
        return True

    def run(self, half: int) -> None:
        self._logged("run", half)

    def stop(self, half: int) -> None:
        self._logged("stop", half)

    def end(self, half: int) -> None:
        self._logged("end", half)

    def close_pair(self) -> None:
        if self._open:
            self._open = False
            self._logged("close_pair")

    def posted(self, seconds: float, channel: Hashable | None = None) -> None:
        self._logged("posted", seconds, channel)

    def switch(self) -> None:
        self._log.append(("switch", (), ()))

    def waited(self, start: Any, end: Any, late: float = 0.0, overslept: float = 0.0,
               count_late: float = 0.0) -> None:
        self._log.append(("waited", (late, overslept, count_late), (start, end)))

    def closed_pairs(self) -> int:
        self._replay()
        return self._live.closed_pairs()

    def pairs_since(self, mark: int) -> list[PairTrace]:
        self._replay()
        return self._live.pairs_since(mark)

    def take(self) -> StepTrace:
        self._logged("take")
        return self._replay()

    def _replay(self) -> Any:
        """Every logged call, in order, on the live recorder; returns the last one's answer."""
        marks = [m for _, _, entry_marks in self._log for m in entry_marks]
        seconds = iter(self.clock.read([self._origin, *marks])[1:]) if marks else iter(())
        answer = None
        for method, args, entry_marks in self._log:
            times = [next(seconds) for _ in entry_marks]
            if method == "waited":
                answer = self._live.waited(times[0], times[1], *args)
                continue
            if times:
                self._at = times[0]
            answer = getattr(self._live, method)(*args)
        self._log.clear()
        return answer


_RECORDER: ExposureRecorder | DeferredRecorder | None = None


def recorder() -> ExposureRecorder | DeferredRecorder | None:
    """The recorder a benchmark started in this process, or None (nothing to record)."""
    return _RECORDER


def start_recording(clock: Callable[[], float] = time.perf_counter,
                    device: torch.device | None = None) -> ExposureRecorder | DeferredRecorder:
    """Record this process's pairs and exchanges from now on (benchmarks); returns the recorder:
    on a CUDA ``device`` a :class:`DeferredRecorder` on its :class:`DeviceClock`, else one on ``clock``."""
    global _RECORDER
    cuda = device is not None and torch.device(device).type == "cuda"
    _RECORDER = DeferredRecorder(DeviceClock(torch.device(device))) if cuda else ExposureRecorder(clock)
    return _RECORDER


def stop_recording() -> None:
    global _RECORDER
    _RECORDER = None


# -- what a step's trace says ----------------------------------------------------------------
@dataclass(frozen=True)
class PairExposure:
    """One pair's exposed exchange time, seconds: ``measured`` (blocked in waits), ``late`` (of
    it, past the exchanges' own arrival), ``in_order`` (its measured segments and exchanges in the
    order they ran, each as early as it could: what the runtime's order costs in this model),
    ``floor`` (the best order) and ``serial`` (every exchange exposed, as nothing overlaps them in
    1F1B)."""

    measured: float
    late: float
    in_order: float
    floor: float
    serial: float


def pair_exposure(pair: PairTrace, queue: str = "fifo") -> PairExposure:
    halves: Sequence[Half] = [h for h in pair.halves if h]
    order = [h for h in pair.order if pair.halves[h]]
    if len(halves) == 1:  # a half that never ran: the other one is alone
        order = [0] * len(order)
    return PairExposure(pair.waited_s, pair.late, run_in_order(halves, order, queue).exposure if halves else 0.0,
                        floor(halves, queue).exposure if halves else 0.0, serial_exposure(halves))


STEP_KEYS = ("measured", "late", "overslept", "count_late", "floor", "serial", "pairs_measured", "pairs_late",
             "pairs_overslept", "pairs_count_late", "pairs_in_order", "pairs_floor", "pairs_serial", "lone_measured",
             "lone_late", "lone_overslept", "lone_count_late", "lone_floor", "lone_serial")


def step_exposure(step: StepTrace, queue: str = "fifo") -> dict[str, float]:
    """One step's exposure, seconds (:data:`STEP_KEYS`): in pairs (:class:`PairExposure` summed),
    in lone halves (measured, late, overslept, count_late; floor: every exchange but its lead;
    serial) and in all."""
    pairs = [pair_exposure(p, queue) for p in step.pairs]
    out = {"pairs_measured": sum(p.measured for p in pairs), "pairs_late": sum(p.late for p in pairs),
           "pairs_overslept": sum(p.overslept for p in step.pairs),
           "pairs_count_late": sum(p.count_late for p in step.pairs),
           "pairs_in_order": sum(p.in_order for p in pairs), "pairs_floor": sum(p.floor for p in pairs),
           "pairs_serial": sum(p.serial for p in pairs),
           "lone_measured": sum(end - start for start, end in step.lone_waits), "lone_late": step.lone_late,
           "lone_overslept": step.lone_overslept, "lone_count_late": step.lone_count_late,
           "lone_floor": lone_exposure(step.lone), "lone_serial": serial_exposure([step.lone])}
    for key in ("measured", "late", "overslept", "count_late", "floor", "serial"):
        out[key] = out[f"pairs_{key}"] + out[f"lone_{key}"]
    return {key: out[key] for key in STEP_KEYS}
