"""Validation and lowering of a compute order to the runtime's compute+comms order.

Lowering = torch's own per-rank passes (``_add_unshard_reshard``, ``_add_reduce_grad``),
then :func:`insert_send_recv`, a send/recv pass that follows the placement's chains
(torch's ``_add_send_recv`` assumes one chain ``0..N-1`` and rejects DualPipe), then
optionally :func:`defer_recvs`.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from .._compat.pipelining import (
    RESHARD,
    UNSHARD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    _Action,
    _format_pipeline_order,
    _validate_schedule,
    add_reduce_grad,
    add_unshard_reshard,
    reduce_grad_actions,
)
from . import identify_order
from .dataflow import input_source, output_destination, receive_for
from .placement import Placement

Order = dict[int, list[_Action]]


def leaf_actions(action: _Action) -> tuple[_Action, ...]:
    """The compute actions an entry stands for (both halves of an overlapped pair)."""
    return action.sub_actions if action.sub_actions is not None else (action,)


def validate_order(order: dict[int, list[_Action | None]], place: Placement) -> None:
    """Raise ValueError (with the formatted order) unless ``order`` is a complete, valid schedule.

    torch's validator checks per-stage counts and F-before-B/I-before-W; on top of that each
    stage must run exactly its own microbatches on its own rank.
    """
    try:
        stage_to_rank = _validate_schedule(
            order, place.pp_size, place.num_stages, place.microbatches_per_stage()
        )
        for stage, rank in stage_to_rank.items():
            if rank != place.rank_of(stage):
                raise AssertionError(f"stage {stage} runs on rank {rank}, expected {place.rank_of(stage)}")
        for rank, actions in order.items():
            for action in filter(None, actions):
                for leaf in leaf_actions(action):
                    if leaf.microbatch_index not in place.microbatches(leaf.stage_index):
                        raise AssertionError(
                            f"rank {rank}: {leaf} runs microbatch {leaf.microbatch_index}, outside "
                            f"stage {leaf.stage_index}'s {place.microbatches(leaf.stage_index)}"
                        )
    except AssertionError as err:
        raise ValueError(
            f"Invalid {place.schedule} order for pp={place.pp_size}, n_microbatches={place.n_microbatches}: "
            f"{err}.{_what_it_fits(order, place)}\n{_format_pipeline_order(order)}"
        ) from None


def _what_it_fits(order: dict[int, list[_Action | None]], place: Placement) -> str:
    """Which schedule and sizes the order was made for, when it is one of ours, and the fix."""
    fits = identify_order(order)
    if fits is None:
        return ""
    schedule, pp, n = fits
    return (f" This order is {schedule}'s for pp={pp} and {n} microbatches: run it as {schedule} with those, or "
            f"write one for this schedule with `titan-dualpipe csv --schedule {place.schedule} --pp {place.pp_size} "
            f"--microbatches {place.n_microbatches} -o FILE`.")


def _input_ready(action: _Action, done: set[_Action], place: Placement) -> bool:
    """Whether ``action``'s input (activation or output grad) is available on its rank: its
    receive was posted, or its same-rank source ran."""
    source = input_source(action, place)
    if source is None:
        return True
    mb = action.microbatch_index
    return receive_for(action) in done or any(_Action(source.stage, k, mb) in done for k in source.kinds)


def _comms_after(action: _Action, place: Placement) -> list[tuple[_Action, _Action, int]]:
    """(send on this rank, matching recv, receiving rank) for a cross-rank output."""
    dest = output_destination(action, place)
    if dest is None or place.rank_of(dest.stage) == place.rank_of(action.stage_index):
        return []  # chain end, or same-rank neighbour: handed over in memory
    return [(dest.send, dest.recv, place.rank_of(dest.stage))]


def insert_send_recv(order: dict[int, list[_Action]], place: Placement) -> Order:
    """Add SEND/RECV actions: each send right after its producer, each recv posted on the
    receiving rank at the same point of a global dry run (a rank only advances once its
    next action's inputs are there), which orders every pair of ranks consistently."""
    pending = {rank: deque(a for a in actions if a is not None) for rank, actions in order.items()}
    lowered: Order = {rank: [] for rank in order}
    done: dict[int, set[_Action]] = {rank: set() for rank in order}
    while any(pending.values()):
        progress = False
        for rank in sorted(pending):
            if not pending[rank]:
                continue
            action = pending[rank][0]
            if not all(_input_ready(a, done[rank], place) for a in leaf_actions(action)):
                continue
            pending[rank].popleft()
            lowered[rank].append(action)
            progress = True
            for leaf in leaf_actions(action):
                done[rank].add(leaf)
                for send, recv, peer_rank in _comms_after(leaf, place):
                    lowered[rank].append(send)
                    done[rank].add(send)
                    lowered[peer_rank].append(recv)
                    done[peer_rank].add(recv)
        if not progress:
            stuck = {rank: str(q[0]) for rank, q in pending.items() if q}
            raise ValueError(
                f"{place.schedule} order cannot run: every rank waits for an input that is never "
                f"produced; next actions {stuck}\n{_format_pipeline_order(order)}"
            )
    return lowered


def lower(
    order: dict[int, list[_Action]], place: Placement, *, defer_recv: bool = False,
    fsdp_at_step_edges: bool = False, defer_reduce_grad_wait: bool = False, max_active_stages: int = 3,
    unshard_lookahead: str | tuple[int, ...] = "full",
) -> Order:
    """Compute-only order -> the compute+comms order the runtime executes.

    FSDP actions go where torch puts them (UNSHARD before a stage's first action, RESHARD after
    its last, REDUCE_GRAD after its last backward, on torch 2.15+ with its WAIT_REDUCE_GRAD right
    after it or, ``defer_reduce_grad_wait``, before the next reduction or at the end), or, with
    ``fsdp_at_step_edges``, all at the step's edges in model-part order (:func:`_fsdp_at_step_edges`).
    ``max_active_stages`` and ``unshard_lookahead`` are torch's (:func:`unshard_lookaheads`).
    """
    validate_order(order, place)
    per_stage = place.microbatches_per_stage()
    if fsdp_at_step_edges:
        with_fsdp = {rank: _fsdp_at_step_edges(list(actions), place, rank) for rank, actions in order.items()}
    else:
        lookaheads = unshard_lookaheads(unshard_lookahead, len(order), max_active_stages)
        with_fsdp = {
            rank: add_reduce_grad(add_unshard_reshard(list(actions), max_active_stages, lookaheads[rank]), per_stage,
                                  defer_reduce_grad_wait)
            for rank, actions in order.items()
        }
    lowered = insert_send_recv(with_fsdp, place)
    return defer_recvs(lowered, place) if defer_recv else lowered


def unshard_lookaheads(lookahead: str | tuple[int, ...], pp: int, max_active_stages: int) -> tuple[int, ...]:
    """Per pipeline rank, how many distinct upcoming stages' unshards may be issued ahead (torch
    2.15's ``unshard_lookahead``): ``"full"`` ``max_active_stages``; ``"auto"`` ``min(rank + 2,
    max_active_stages)`` (later ranks start their first compute later); a tuple, one per rank.
    ValueError naming the value otherwise."""
    if isinstance(max_active_stages, bool) or not isinstance(max_active_stages, int) or max_active_stages < 1:
        raise ValueError(f"max_active_stages={max_active_stages!r}: pass a positive integer (default 3)")
    if lookahead == "full":
        return (max_active_stages,) * pp
    if lookahead == "auto":
        return tuple(min(rank + 2, max_active_stages) for rank in range(pp))
    if (not isinstance(lookahead, tuple) or len(lookahead) != pp
            or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= max_active_stages
                   for k in lookahead)):
        raise ValueError(f"unshard_lookahead={lookahead!r}: pass 'full', 'auto' or a tuple of {pp} integers "
                         f"(one per pipeline rank) in [1, max_active_stages={max_active_stages}]")
    return lookahead


def _fsdp_at_step_edges(actions: list[_Action], place: Placement, rank: int) -> list[_Action]:
    """UNSHARD every stage first and REDUCE_GRAD, then RESHARD, every stage last, in model-part
    order. Ranks that shard one model part together (DualPipe twins folded into FSDP: the two
    copies of a part live on ranks r and pp-1-r, which compute on it at different times) then
    issue their FSDP collectives in the same order, at the same points of their steps."""
    stages = sorted(place.stages_of(rank), key=place.model_part)
    return ([_Action(s, UNSHARD, None) for s in stages] + actions
            + [a for s in stages for a in reduce_grad_actions(s)] + [_Action(s, RESHARD, None) for s in stages])


def compute_actions(actions: Iterable[_Action | None]) -> list[_Action]:
    """The F/I/W/B leaves of a rank's order, pairs flattened, in execution order."""
    return [leaf for a in actions if a is not None for leaf in leaf_actions(a) if leaf.is_compute_op]


def defer_recvs(lowered: Order, place: Placement) -> Order:
    """Post each RECV as late as possible without reordering any rank's communication.

    A receive moves past compute actions only: it is posted just before the compute that
    consumes it, or just before the rank's next SEND or RECV, whichever comes first. Every
    rank therefore posts exactly the communication sequence of the undeferred order, which
    NCCL needs (no buffering: a send completes only against its posted receive, and a
    communicator runs its ops in posting order; see :mod:`.nccl_model`), and messages between
    two ranks keep their order (torch's sends carry no tag, and V neighbours exchange
    activations and gradients of one shape). torch's ``_defer_recv_ops`` also moves receives
    past sends, which gloo buffers and NCCL does not.
    """
    return {rank: _deferred(actions) for rank, actions in lowered.items()}


def _deferred(actions: list[_Action]) -> list[_Action]:
    out: list[_Action] = []
    pending: list[_Action] = []
    for action in actions:
        kind = action.computation_type
        if kind in (RECV_F, RECV_B):
            pending.append(action)
            continue
        if kind in (SEND_F, SEND_B):
            out.extend(pending)
            pending.clear()
        else:
            needed = {receive_for(leaf) for leaf in leaf_actions(action)}
            while needed & set(pending):  # up to the last receive this action consumes
                out.append(pending.pop(0))
        out.append(action)
    return out + pending
