"""DeepSeek's eight-step DualPipe recipe, in phase terms, and its mapping to torch actions.

The recipe is written for one rank as a list of :class:`PhaseOp` (:func:`recipe` lists the
steps). "Phase 0" is the chunk whose pipeline direction starts nearer this rank, "phase 1" the
other one; :func:`to_actions` maps the phases to this rank's two stages and their microbatches.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple, Sequence

from .._compat.pipelining import B, F, I, OVERLAP_F_B, W, _Action


class PhaseOp(NamedTuple):
    """One recipe entry: ``kind`` is F, B, I, W or FB (pair: forward ``phase``, backward ``backward_phase``)."""

    kind: str
    phase: int | None = None
    backward_phase: int | None = None

    def __repr__(self) -> str:
        if self.kind == "W":
            return "W"
        if self.kind == "FB":
            return f"(F{self.phase}&B{self.backward_phase})"
        return f"{self.kind}{self.phase}"


def _f(phase: int) -> PhaseOp:
    return PhaseOp("F", phase)


def _b(phase: int, zero_bubble: bool = False) -> PhaseOp:
    return PhaseOp("I" if zero_bubble else "B", phase)


def _pair(forward_phase: int, backward_phase: int) -> PhaseOp:
    return PhaseOp("FB", forward_phase, backward_phase)


_W = PhaseOp("W")


def _step1_warmup(h: int, r: int) -> list[PhaseOp]:
    return [_f(0)] * (2 * (h - r - 1))


def _step2_start_far_chunk(h: int, r: int) -> list[PhaseOp]:
    return [_f(0), _f(1)] * (r + 1)


def _step3_zero_bubble_warmup(h: int, r: int) -> list[PhaseOp]:
    return [_b(1, zero_bubble=True), _W, _f(1)] * (h - r - 1)


def _step4_overlapped(h: int, r: int, c: int) -> list[PhaseOp]:
    ops: list[PhaseOp] = []
    for i in range(c - 2 * h + r + 1):
        middle_rank_first_pair = i == 0 and r == h - 1
        ops += [_f(0), _b(1)] if middle_rank_first_pair else [_pair(0, 1)]
        ops.append(_pair(1, 0))
    return ops


def _step5_drain_far_forwards(h: int, r: int) -> list[PhaseOp]:
    return [_b(1), _pair(1, 0)] * (h - r - 1)


def _step6_drain_backwards(h: int, r: int) -> list[PhaseOp]:
    # The second half of these backwards defer their weight gradient (zero bubble);
    # where the switch falls depends on the parity of r.
    ops: list[PhaseOp] = []
    steps = r + 1
    zero_bubble = False
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            zero_bubble = True
        ops.append(_b(1, zero_bubble))
        if i == steps // 2 and r % 2 == 0:
            zero_bubble = True
        ops.append(_b(0, zero_bubble))
    return ops


def _step7_zero_bubble_cooldown(h: int, r: int) -> list[PhaseOp]:
    return [_W, _b(0, zero_bubble=True)] * (h - r - 1)


def _step8_flush_weights(h: int, r: int) -> list[PhaseOp]:
    return [_W] * (r + 1)


def recipe(half_ranks: int, half_rank: int, chunks: int) -> list[PhaseOp]:
    """The per-rank recipe. ``h`` = half the number of ranks of the full DualPipe (the number of
    ranks of a DualPipeV), ``r`` = this rank's distance from its nearer pipeline end, ``c`` = the
    number of microbatches per direction::

        1  nF0        2(h-r-1) x  F0                      warm-up of the near chunk
        2  nF0F1      (r+1)    x  F0 F1                    start the far chunk
        3  nI1WF1     (h-r-1)  x  I1 W F1                 first backwards, weight grad deferred
        4  nF0B1F1B0  (c-2h+r+1) x (F0&B1) (F1&B0)        steady state: overlapped pairs
        5  nB1F1B0    (h-r-1)  x  B1 (F1&B0)
        6  nB1B0      (r+1)    x  B1 B0, split into I from the middle on (zero bubble)
        7  nWB0       (h-r-1)  x  W I0
        8  nW         (r+1)    x  W

    ``F&B`` is an overlapped pair; ``W`` runs the oldest deferred weight gradient (FIFO). On the
    middle ranks (``r == h-1``) the first pair of step 4 runs as ``F0`` then ``B1`` without
    overlap, which shortens the bubble."""
    h, r, c = half_ranks, half_rank, chunks
    return (
        _step1_warmup(h, r)
        + _step2_start_far_chunk(h, r)
        + _step3_zero_bubble_warmup(h, r)
        + _step4_overlapped(h, r, c)
        + _step5_drain_far_forwards(h, r)
        + _step6_drain_backwards(h, r)
        + _step7_zero_bubble_cooldown(h, r)
        + _step8_flush_weights(h, r)
    )


class _MicrobatchCursor:
    """Hands out each stage's microbatches in FIFO order and queues deferred weight grads."""

    def __init__(self, microbatches: dict[int, Sequence[int]]) -> None:
        self._microbatches = microbatches
        self._forwards = {stage: 0 for stage in microbatches}
        self._backwards = {stage: 0 for stage in microbatches}
        self._deferred_weights: deque[_Action] = deque()

    def forward(self, stage: int) -> _Action:
        mb = self._microbatches[stage][self._forwards[stage]]
        self._forwards[stage] += 1
        return _Action(stage, F, mb)

    def backward(self, stage: int, kind: str) -> _Action:
        mb = self._microbatches[stage][self._backwards[stage]]
        self._backwards[stage] += 1
        if kind == "I":
            self._deferred_weights.append(_Action(stage, W, mb))
            return _Action(stage, I, mb)
        return _Action(stage, B, mb)

    def weight(self) -> _Action:
        if not self._deferred_weights:
            raise RuntimeError("recipe asked for a weight gradient with none deferred")
        return self._deferred_weights.popleft()


def to_actions(
    ops: Sequence[PhaseOp], phase_stages: tuple[int, int], microbatches: dict[int, Sequence[int]]
) -> list[_Action]:
    """Turn recipe ops into torch actions: phase ``p`` runs on stage ``phase_stages[p]``."""
    cursor = _MicrobatchCursor(microbatches)
    actions: list[_Action] = []
    for op in ops:
        if op.kind == "F":
            actions.append(cursor.forward(phase_stages[op.phase]))
        elif op.kind in ("B", "I"):
            actions.append(cursor.backward(phase_stages[op.phase], op.kind))
        elif op.kind == "W":
            actions.append(cursor.weight())
        else:
            pair = (
                cursor.forward(phase_stages[op.phase]),
                cursor.backward(phase_stages[op.backward_phase], "B"),
            )
            actions.append(_Action(-1, OVERLAP_F_B, None, pair))
    return actions
