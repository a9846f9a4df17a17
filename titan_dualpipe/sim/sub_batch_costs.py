"""Two-batch overlap in the simulator: which actions run on two sub-batches, and what they cost.

Which microbatches split comes from :mod:`titan_dualpipe.orders.lone_actions`, the runtime's rule;
the simulator models ``two_batch_overlap="all"``. A lone forward of a split microbatch costs
``F2``; its backward, when lone too, runs whole on the two sub-batches and costs ``B2`` (at its
``B`` or ``I``, the ``W`` then 0; on a chain's first stage at its ``W``); a pair's backward costs
``FB`` as for an unsplit microbatch. A split microbatch's activation is freed by the action that
runs its backward (docs/simulate.md).
"""

from __future__ import annotations

from collections.abc import Collection

from .._compat.pipelining import B, F, I, W, _Action
from ..orders.dataflow import Chains
from ..orders.lone_actions import lone_forwards, paired_backwards

Order = dict[int, list[_Action | None]]


def sub_batch_actions(order: Order) -> frozenset[_Action]:
    """The compute actions (never pairs) of ``order`` that belong to a microbatch run on two
    sub_batches: each lone forward, and the ``B``, ``I`` and ``W`` of its backward when that is lone."""
    split: set[_Action] = set()
    for actions in order.values():
        lone, paired = lone_forwards(actions), paired_backwards(actions)
        for action in filter(None, actions):
            key = (action.stage_index, action.microbatch_index)
            kind = action.computation_type
            if key in lone and (kind == F or (kind in (B, I, W) and key not in paired)):
                split.add(action)
    return frozenset(split)


def runs_backward(action: _Action, chains: Chains) -> bool:
    """Whether ``action`` (``B``, ``I`` or ``W`` of a split microbatch) is the one that runs its
    whole backward: a ``B``; an ``I``, or on a chain's first stage the ``W``."""
    kind = action.computation_type
    if kind == B:
        return True
    return (kind == W) == chains.is_first(action.stage_index)


def sub_batch_cost(action: _Action, forward: float, backward: float, chains: Chains) -> float:
    """Time of a split action, given the times of a forward and a backward on two sub-batches."""
    if action.computation_type == F:
        return forward
    return backward if runs_backward(action, chains) else 0.0


def freed_at_input(split: Collection[_Action], chains: Chains) -> set[tuple[int, int]]:
    """``(stage, microbatch)`` whose activation its ``I`` frees (the backward runs whole there)."""
    return {(a.stage_index, a.microbatch_index) for a in split
            if a.computation_type == I and runs_backward(a, chains)}
