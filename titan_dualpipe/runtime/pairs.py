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

from typing import TYPE_CHECKING, Any, ContextManager, Protocol

from .._compat.pipelining import F, _Action

if TYPE_CHECKING:
    from .executor import StepExecutor


class PairRunner(Protocol):
    def __call__(self, executor: "StepExecutor", forward: _Action, backward: _Action) -> None:
        """Run both halves; results must equal the forward, then the backward, bit for bit."""


PAIR_FIRST = ("forward", "backward", "measured", "measured_first")


class PairOrder(Protocol):
    """What the overlapped runner reads of the ``pair_first`` option (the schedules the package
    exports build one: :class:`titan_dualpipe.overlap.pair_first.PairFirst`)."""

    def first(self, first: _Action, second: _Action) -> Any:
        """The half of this pair (a forward with a backward, or a lone pair's two actions) that runs first."""

    def plan(self, first: _Action, second: _Action) -> Any:
        """Per half, whether it switches at each of its hand-overs in turn (None: at every one)."""

    def step(self) -> ContextManager[None]:
        """Entered around each step's actions (where a measuring order records and decides)."""


def pair_first_problem(value: Any, overlap: bool) -> str:
    """Why ``pair_first`` cannot be used with this ``overlap`` setting ("" when it can)."""
    if not isinstance(value, str) or value not in PAIR_FIRST:
        return (f"pair_first must be one of {', '.join(map(repr, PAIR_FIRST))} (which half of a relayed pair runs "
                f"first), got {value!r}")
    if value != "forward" and not overlap:
        return (f"pair_first={value!r} needs overlap=True: without it a pair's halves run one after the other, "
                "the forward first; pass overlap=True, or pair_first='forward'")
    return ""


def run_pair_sequentially(executor: "StepExecutor", forward: _Action, backward: _Action) -> None:
    """The pair without overlap: the forward, then the backward (a lone pair: its first action,
    then its second)."""
    for action in (forward, backward):
        run_action(executor, action)


def run_action(executor: "StepExecutor", action: _Action) -> None:
    """One sub-action of a pair: a forward, or a backward (``B`` or ``I``)."""
    if action.computation_type == F:
        executor.run_forward(action)
    else:
        executor.run_backward(action)


def lone_pairs_problem(value: Any, two_batch_overlap: Any) -> str:
    """Why ``lone_pairs`` cannot be used with this ``two_batch_overlap`` ("" when it can)."""
    if not isinstance(value, bool):
        return f"lone_pairs must be True or False, got {value!r}"
    if value and two_batch_overlap is not False:
        return (f"lone_pairs=True and two_batch_overlap={two_batch_overlap!r} both take the lone actions "
                "(paired with each other, or split into sub-batches): pass one of them")
    return ""


def pair_runner(overlap: bool, overlapped: PairRunner | None) -> PairRunner:
    """The runner for a schedule's ``overlap`` setting (``overlapped``: the schedule's overlapped runner)."""
    if not overlap:
        return run_pair_sequentially
    if overlapped is None:
        raise RuntimeError("this schedule class has no overlapped pair runner: use titan_dualpipe.ScheduleDualPipeV "
                           "or titan_dualpipe.ScheduleDualPipe (titan_dualpipe.overlap.schedules), or overlap=False")
    return overlapped
