"""What the runtime records per action when ``record_timeline=True`` (drawn by :mod:`..sim.timeline`),
and the clocks that time it.

A step clock hands out marks while the step runs and turns them into seconds since the clock
was made once the step is over. On the CPU a mark is ``time.perf_counter()``. On a GPU the CPU
runs ahead of the kernels it queues, so its clock would time the launches: there a mark is a
CUDA event recorded on the current stream (it completes when the work queued before it has
run), and all marks are resolved after the step with one synchronize.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol, Sequence

import torch

from .._compat.pipelining import _Action


class TimedAction(NamedTuple):
    """One action (an ``OVERLAP_F_B`` pair counts as one) that ran on ``rank`` from ``start`` to ``end``;
    ``sub_batches``: its microbatch ran as two sub-batches (two-batch overlap; set by the simulator, and by
    ``titan-dualpipe profile`` from the order)."""

    rank: int
    action: _Action
    start: float
    end: float
    sub_batches: bool = False


class StepClock(Protocol):
    def mark(self) -> Any:
        """A point in time (cheap; no synchronization)."""

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        """Each mark in seconds since the clock was made (on a GPU: waits for the marks once)."""


class CpuClock:
    """Host seconds (``time.perf_counter``): CPU runs, where the work is done when the call returns."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def mark(self) -> float:
        return time.perf_counter() - self._t0

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        return [float(m) for m in marks]


class CudaClock:
    """GPU seconds: a mark is a timing event on ``device``'s current stream, relative to an event
    recorded when the clock was made (the step's start)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = self.mark()

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        torch.cuda.synchronize(self.device)  # once for all marks: none is read before it completed
        return [self._start.elapsed_time(m) / 1e3 for m in marks]


def clock_for(device: torch.device | str | None) -> StepClock:
    """The clock for work on ``device``: CUDA events on a CUDA device, else the host clock."""
    device = torch.device("cpu" if device is None else device)
    return CudaClock(device) if device.type == "cuda" else CpuClock()


def span_seconds(clock: StepClock, spans: Sequence[tuple[Any, Any]]) -> list[tuple[float, float]]:
    """``(start, end)`` mark pairs as seconds, all resolved at once (one synchronize on a GPU)."""
    flat = clock.seconds([m for span in spans for m in span])
    return list(zip(flat[0::2], flat[1::2]))
