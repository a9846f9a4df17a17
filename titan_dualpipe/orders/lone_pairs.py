"""Lone actions paired with each other: the warm-up's and cool-down's actions without a partner.

DualPipe pairs the forward of one microbatch with the backward of another; what runs before the
first pair and after the last runs alone, every exchange of it exposed. Where two such actions of
one direction stand next to each other on a rank (two forwards, or two backwards: ``B`` or ``I``)
and neither feeds the other, :func:`pair_lone_actions` puts them into one ``OVERLAP_F_B`` entry
(torch's container of overlapped sub-actions, which torch's own runtime runs one after the other),
so a relay can hide each one's exchanges behind the other's compute.

A pair waits for both inputs before it starts, and its first action's output leaves later than
alone: a pair is kept only where the order still runs (:func:`~.lowering.insert_send_recv`'s
global dry run finds every input produced). Pure: a function of the order and its placement.
"""

from __future__ import annotations

from .._compat.pipelining import B, F, I, OVERLAP_F_B, _Action
from .lowering import insert_send_recv
from .placement import Placement

_BACKWARDS = (B, I)


def lone_pair(first: _Action, second: _Action) -> _Action:
    """The overlapped entry of two lone actions, ``first`` starting."""
    return _Action(-1, OVERLAP_F_B, None, (first, second))


def is_lone_pair(action: _Action | None) -> bool:
    """Whether ``action`` is a pair of two actions of one direction (not a forward with a backward)."""
    if action is None or action.computation_type != OVERLAP_F_B or action.sub_actions is None:
        return False
    kinds = [a.computation_type for a in action.sub_actions]
    return kinds[0] == F and kinds[1] == F or kinds[0] in _BACKWARDS and kinds[1] in _BACKWARDS


def pairable(first: _Action | None, second: _Action | None, place: Placement) -> bool:
    """Whether two adjacent actions of a rank can run as a lone pair: both forwards or both
    backwards (``B`` or ``I``), neither a pair already, and the first not feeding the second."""
    if first is None or second is None or first.sub_actions is not None or second.sub_actions is not None:
        return False
    a, b = first.computation_type, second.computation_type
    if a == F and b == F:
        feeds = place.next_stage(first.stage_index) == second.stage_index
    elif a in _BACKWARDS and b in _BACKWARDS:
        feeds = place.prev_stage(first.stage_index) == second.stage_index
    else:
        return False
    return not (feeds and first.microbatch_index == second.microbatch_index)


def pair_lone_actions(order: dict[int, list[_Action]], place: Placement) -> dict[int, list[_Action]]:
    """``order`` with adjacent lone actions of one direction paired (module docstring): each
    rank from its start, greedily, every pair kept only where the whole order still runs."""
    out = {rank: list(actions) for rank, actions in order.items()}
    for rank in sorted(out):
        i = 0
        while i + 1 < len(out[rank]):
            actions = out[rank]
            if pairable(actions[i], actions[i + 1], place):
                trial = {**out, rank: actions[:i] + [lone_pair(actions[i], actions[i + 1])] + actions[i + 2:]}
                if _runs(trial, place):
                    out = trial
            i += 1
    return out


def _runs(order: dict[int, list[_Action]], place: Placement) -> bool:
    try:
        insert_send_recv(order, place)
    except ValueError:
        return False
    return True
