"""How the runtime runs an overlapped pair ``(F; B)``: one small interface, two runners.

A :class:`PairRunner` runs the forward action ``F`` of one microbatch and the full backward
action ``B`` of another on this rank, through the executor's ``run_forward`` / ``run_backward``
(torch's stage bookkeeping, the receives they wait for). The runtime has
:func:`run_pair_sequentially` (``overlap=False``); the overlapped runner is
:func:`titan_dualpipe.overlap.pair.run_pair_overlapped`, which the schedules the package exports
(:mod:`titan_dualpipe.overlap.schedules`) hand to the runtime's as a class attribute, so the
dependencies run one way: orders -> runtime -> overlap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .._compat.pipelining import _Action

if TYPE_CHECKING:
    from .executor import StepExecutor


class PairRunner(Protocol):
    def __call__(self, executor: "StepExecutor", forward: _Action, backward: _Action) -> None:
        """Run both halves; results must equal the forward, then the backward, bit for bit."""


def run_pair_sequentially(executor: "StepExecutor", forward: _Action, backward: _Action) -> None:
    """The pair without overlap: the forward, then the backward."""
    executor.run_forward(forward)
    executor.run_backward(backward)


def pair_runner(overlap: bool, overlapped: PairRunner | None) -> PairRunner:
    """The runner for a schedule's ``overlap`` setting (``overlapped``: the schedule's overlapped runner)."""
    if not overlap:
        return run_pair_sequentially
    if overlapped is None:
        raise RuntimeError("this schedule class has no overlapped pair runner: use titan_dualpipe.ScheduleDualPipeV "
                           "or titan_dualpipe.ScheduleDualPipe (titan_dualpipe.overlap.schedules), or overlap=False")
    return overlapped
