"""Which microbatches two-batch overlap splits: those whose forward runs alone.

An overlapped pair ``(F; B)`` hides each half's exchanges behind the other half's compute. A
forward with no partner (warm-up, and nearly every forward when microbatches are few) has
nothing to hide behind, so two-batch overlap runs it as two sub-batches of its microbatch (split
along the batch), relayed like a pair. The backward of such a microbatch then runs on the two
sub-batches too when it is alone (``B``, ``I``, or a first stage's deferred ``W``), and through both
at once, like an unsplit microbatch, when it is the backward of a pair.

This is a pure function of the compute order, shared by the runtime (which microbatches to
split) and the simulator (which actions to cost as sub-batches).
"""

from __future__ import annotations

from .._compat.pipelining import F, OVERLAP_F_B, _Action


def lone_forwards(actions: list[_Action | None]) -> set[tuple[int, int]]:
    """``(stage, microbatch)`` of every forward in one rank's order that is not half of a pair."""
    return {(a.stage_index, a.microbatch_index) for a in actions
            if a is not None and a.computation_type == F}


def paired_backwards(actions: list[_Action | None]) -> set[tuple[int, int]]:
    """``(stage, microbatch)`` of every backward in one rank's order that runs in a pair."""
    return {(b.stage_index, b.microbatch_index) for a in actions
            if a is not None and a.computation_type == OVERLAP_F_B for b in a.sub_actions if b.computation_type != F}
