"""Work a full backward sets aside for the time its exchanges are in flight.

A full backward of a stage whose weight GEMMs defer queues them and names the work that computes
them here (:meth:`~.plan.BackwardPlan.collected`). Every exchange the backward posts calls
:func:`run_work_in_flight` between posting and waiting (:func:`~titan_dualpipe.overlap.relay.hand_over`
does, and so does :func:`~titan_dualpipe.overlap.segments.interleave` for a segment-wise
backward), so the GEMMs queued so far run while it travels. Only a backward's own exchanges run it (grad mode off
inside an autograd node): a forward's, or a recomputation's, leave it for the next.

The slot is process-wide, set only for the length of one backward: autograd may run a backward's
nodes on a device thread, and a relayed pair runs its backward half on a helper thread, neither
of which would see a thread-local or a context variable. A relay parks it with each half
(:func:`parked`, :func:`resume`), as it does the random-number generators.

As fillers (``weight_gemms_in_flight="fill"``), a backward computes only what fits before the
exchange its partner half waits on arrives, and more before its own wait, so that the GEMMs cover
compute that would otherwise idle and never hold the partner back; what does not fit runs at the
backward's end. Where arrival times are unknown (a GPU's exchanges) it computes all. Why and how
much: docs/weight_gradients.md#fillers.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

IN_FLIGHT_MODES = (False, True, "fill")  # weight_gemms_in_flight: inline, all at each exchange, as fillers

# The work; as fillers called with ``until``, a time.perf_counter() time not to run past (None: unknown).
Work = Callable[..., object]
_work: Work | None = None
_fills = False  # the work runs as fillers: the callers' ``until`` applies


def in_flight_mode_problem(mode: object) -> str:
    """What is wrong with a ``weight_gemms_in_flight`` value, or ``''``."""
    if any(mode is m or (isinstance(m, str) and mode == m) for m in IN_FLIGHT_MODES):
        return ""
    return f"weight_gemms_in_flight={mode!r}: use True (the default), False (inline) or 'fill' (as fillers)"


@contextlib.contextmanager
def work_while_exchanges_fly(work: Work, fill: bool = False) -> Iterator[None]:
    """Run ``work`` at every exchange posted inside the block (and nothing after it); ``fill``: as
    fillers (see the module docstring)."""
    global _work, _fills
    previous, _work, _fills = (_work, _fills), work, fill
    try:
        yield
    finally:
        _work, _fills = previous


def parked() -> tuple[Work | None, bool]:
    """The slot as the running half of a relayed pair sees it, to park while its partner runs (two
    backwards of one relay each set their own)."""
    return _work, _fills


def resume(state: tuple[Work | None, bool]) -> None:
    """Set the slot to a half's :func:`parked` state."""
    global _work, _fills
    _work, _fills = state


def run_work_in_flight(*, until: float | None = None, segment_backward: bool = False) -> None:
    """Run the work set aside for an exchange in flight, if any (call right after a backward's
    exchange is posted). The work posts no exchange of its own; a nested call finds the slot empty.
    ``until``: when the exchange the partner half waits on arrives (a filler stops before it);
    ``segment_backward``: the caller is a backward run segment by segment from Python, between
    autograd calls (grad mode on), not an autograd node."""
    global _work
    work = _work
    if work is None or (torch.is_grad_enabled() and not segment_backward):  # not inside a backward's node
        return
    _work = None
    try:
        with torch.no_grad():  # a segment-wise backward's caller has grad mode on; the GEMMs build no graph
            work(until) if _fills else work()
    finally:
        _work = work


def fill_before_wait(ready_at: float | None, *, segment_backward: bool = False) -> None:
    """As fillers only: a backward about to wait for its own exchange, arriving at ``ready_at``
    (``time.perf_counter()``; None: unknown), computes what fits before it."""
    if _fills and ready_at is not None:
        run_work_in_flight(until=ready_at, segment_backward=segment_backward)
