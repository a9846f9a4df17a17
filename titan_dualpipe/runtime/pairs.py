"""How the runtime runs an overlapped pair ``(F; B)``: one small interface, two runners.

A :class:`PairRunner` runs the forward action ``F`` of one microbatch and the full backward
action ``B`` of another on this rank, through the executor's ``run_forward`` / ``run_backward``
(torch's stage bookkeeping, the receives they wait for). The runtime has
:func:`run_pair_sequentially` (``overlap=False``); the overlapped runner is
:func:`titan_dualpipe.overlap.pair.run_pair_overlapped`, which registers itself here when
``titan_dualpipe.overlap`` is imported (``titan_dualpipe``'s ``__init__`` does), so the
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


_overlapped: PairRunner | None = None


def register_overlapped(runner: PairRunner) -> None:
    """Set the runner ``overlap=True`` schedules use (called by :mod:`titan_dualpipe.overlap.pair`)."""
    global _overlapped
    _overlapped = runner


def pair_runner(overlap: bool) -> PairRunner:
    """The runner for a schedule's ``overlap`` setting."""
    if not overlap:
        return run_pair_sequentially
    if _overlapped is None:
        raise RuntimeError("no overlapped pair runner registered: import titan_dualpipe (it imports titan_dualpipe.overlap)")
    return _overlapped
