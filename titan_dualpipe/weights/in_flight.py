"""Work a full backward sets aside for the time its exchanges are in flight.

A full backward of a stage whose weight GEMMs defer queues them and names the work that computes
them here (:meth:`~.plan.BackwardPlan.collected`). Every exchange the backward posts calls
:func:`run_work_in_flight` between posting and waiting (:func:`~titan_dualpipe.overlap.relay.hand_over`
does, and so does :func:`~titan_dualpipe.overlap.segments.interleave` for a segment-wise
backward), so the GEMMs queued so far run while it travels. Only a backward's own exchanges run it (grad mode off
inside an autograd node): a forward's, or a recomputation's, leave it for the next.

The slot is process-wide, set only for the length of one backward: autograd may run a backward's
nodes on a device thread, and a relayed pair runs its backward half on a helper thread, neither
of which would see a thread-local or a context variable. docs/weight_gradients.md has more.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

_work: Callable[[], object] | None = None


@contextlib.contextmanager
def work_while_exchanges_fly(work: Callable[[], object]) -> Iterator[None]:
    """Run ``work`` at every exchange posted inside the block (and nothing after it)."""
    global _work
    previous, _work = _work, work
    try:
        yield
    finally:
        _work = previous


def run_work_in_flight(*, segment_backward: bool = False) -> None:
    """Run the work set aside for an exchange in flight, if any (call right after a backward's
    exchange is posted). The work posts no exchange of its own; a nested call finds the slot empty.
    ``segment_backward``: the caller is a backward run segment by segment from Python, between
    autograd calls (grad mode on), not an autograd node."""
    global _work
    work = _work
    if work is None or (torch.is_grad_enabled() and not segment_backward):  # not inside a backward's node
        return
    _work = None
    try:
        with torch.no_grad():  # a segment-wise backward's caller has grad mode on; the GEMMs build no graph
            work()
    finally:
        _work = work
