"""Pair runners: how the runtime executes an overlapped ``(F; B)`` pair.

:func:`run_pair_overlapped`, the ``overlapped_pair_runner`` of the schedules the package exports
(:mod:`.schedules`), hands the pair to the stage modules' protocol
(:class:`~titan_dualpipe.overlap.protocol.OverlappedForwardBackward`) inside torch's own forward
and backward bookkeeping, or else runs its halves as a relay (:mod:`~titan_dualpipe.overlap.relay`),
the half the schedule's ``pair_first`` names first, switching where it says (:mod:`.pair_first`),
posting the forward's pipeline send as soon as the forward half ends. Its results are bitwise
equal to :func:`~titan_dualpipe.runtime.pairs.run_pair_sequentially` (``overlap=False``): the
forward, then the backward, sends after both. See docs/overlap.md.
"""

from __future__ import annotations

from typing import Any, Callable

from .._compat.autograd import module_forward_replaced
from .._compat.pipelining import SEND_F, B, F, I, _Action, input_grads, stage_backward_replaced
from ..runtime.executor import StepExecutor
from .comm import warn_once_if_exchange_traced
from .protocol import overlap_implementation
from .pair_first import PairFirst
from .relay import FORWARD, run_relayed


def run_pair_overlapped(executor: StepExecutor, forward: _Action, backward: _Action) -> None:
    if forward.computation_type != F or backward.computation_type not in (B, I):
        run_lone_pair(executor, forward, backward)
        return
    fwd_module = executor.stages[forward.stage_index].submod
    bwd_module = executor.stages[backward.stage_index].submod
    fused = overlap_implementation(fwd_module, bwd_module)
    # A backward microbatch that ran its forward as two sub-batches backpropagates through both at
    # once, from the joined output: the relay runs that as it is, the protocol's backward does not.
    if executor.sub_batches.pop((backward.stage_index, backward.microbatch_index), None) is not None:
        fused = None
    if fused is None:
        def forward_half() -> None:
            executor.run_forward(forward)
            executor.post_send_early(_Action(forward.stage_index, SEND_F, forward.microbatch_index))

        run_relayed(forward_half, lambda: executor.run_backward(backward), **_relay_options(executor, forward, backward))
        warn_once_if_exchange_traced()
        return

    failure: list[BaseException] = []

    def forward_running_both_halves(*args: Any, **kwargs: Any) -> Any:
        result: dict[str, Any] = {}

        def backward_half(stage_output: Any, output_grads: Any, input_values: list) -> tuple:
            outputs, grads = _differentiable(stage_output, output_grads)
            try:
                result["forward"] = fused(fwd_module, args, kwargs, bwd_module, input_values, outputs, grads)
            except BaseException as err:
                failure.append(err)
                raise
            return input_grads(input_values)

        with stage_backward_replaced(backward_half):
            executor.run_backward(backward)
        return result["forward"]

    try:
        with module_forward_replaced(fwd_module, forward_running_both_halves):
            executor.run_forward(forward)
        return
    except Exception:
        if not failure:
            raise
    # torch's forward_one_chunk wrapped the pair's own error (whose cause it is); raise that
    # one, outside the handler so its context does not point back at the wrapper
    error = failure[0]
    error.__context__ = None
    raise error


def run_lone_pair(executor: StepExecutor, first: _Action, second: _Action) -> None:
    """Two forwards, or two backwards, of a lone pair (:mod:`titan_dualpipe.orders.lone_pairs`) as
    a relay, ``first``'s half starting unless a measured ``pair_first`` says otherwise (its halves
    are those of ``first`` and ``second``); a forward posts its pipeline send as soon as it ends."""

    def half(action: _Action) -> Callable[[], None]:
        if action.computation_type != F:
            return lambda: executor.run_backward(action)

        def forward() -> None:
            executor.run_forward(action)
            executor.post_send_early(_Action(action.stage_index, SEND_F, action.microbatch_index))

        return forward

    run_relayed(half(first), half(second), **_relay_options(executor, first, second))
    warn_once_if_exchange_traced()


def _relay_options(executor: StepExecutor, first: _Action, second: _Action) -> dict[str, Any]:
    """How the relay of ``first``'s and ``second``'s halves runs: the half that starts and its plan
    (the schedule's ``pair_first``), its kind, and the state each half keeps."""
    order = executor.view.pair_order
    return {"first": FORWARD if order is None else order.first(first, second),
            "plan": None if order is None else order.plan(first, second),
            "kind": PairFirst.kind(first, second), "half_locals": _weight_marks(executor)}


def _weight_marks(executor: StepExecutor) -> tuple:
    """What each half of a relay keeps as its own of the weight queue: whether forwards defer, which
    backward collects (two forwards or two backwards each enter and leave theirs)."""
    return () if executor.plan is None else (executor.plan.queue,)


def _differentiable(stage_output: Any, output_grads: Any) -> tuple[list, list | None]:
    """The outputs torch's full backward would backpropagate from, with their grads."""
    if not isinstance(stage_output, (tuple, list)):
        return [stage_output], None  # a last stage's loss
    kept = [(o, g) for o, g in zip(stage_output, output_grads)
            if o.requires_grad or o.grad_fn is not None]
    return [o for o, _ in kept], [g for _, g in kept]
