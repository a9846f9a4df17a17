"""Work a full backward sets aside for the time its exchanges are in flight.

A full backward (``B``) of a stage whose weight GEMMs defer queues them as an ``I`` does and
names the work that computes them here. Every exchange posted while that backward runs
(torchtitan's expert all-to-all, our MoE module's, in a pair or lone) calls
:func:`run_work_in_flight` between posting and waiting
(:func:`~titan_dualpipe.overlap.relay.hand_over` does), so the weight GEMMs queued so far run
while the exchange travels instead of before it was posted. In a relayed pair the backward
half's exchange is then hidden by its own weight GEMMs and the forward half's segment, where the
forward's segment alone (half the compute of a backward's) falls short.

The work runs only at a backward's own exchanges (``hand_over(backward=True)``, from an autograd
node's backward, where grad mode is off): an exchange posted by a forward, or by a checkpointed
region's recomputation inside the backward (the checkpoint's hooks and modes active), leaves it
for the next exchange or the backward's end. It computes GEMMs only; the backward's end gives
every result to autograd at once, in the order queued.

The runtime sets the work (:meth:`~titan_dualpipe.runtime.executor.StepExecutor.run_backward`,
for the stages that post exchanges); the overlap layer runs it. The work is one module-level
slot, not thread-local: autograd may run a backward's nodes on a device thread of its own, and
a relayed pair runs its backward half on a helper thread. A pair's forward half leaves it alone.
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


def run_work_in_flight() -> None:
    """Run the work set aside for an exchange in flight, if any (call right after a backward's
    exchange is posted). The work posts no exchange of its own; a nested call finds the slot empty."""
    global _work
    work = _work
    if work is None or torch.is_grad_enabled():  # grad mode on: not inside a backward's node
        return
    _work = None
    try:
        work()
    finally:
        _work = work
