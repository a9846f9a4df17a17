"""Where data flows: the one rule for what feeds an action and where its output goes.

Stages form chains (DualPipeV one, DualPipe two, torch's schedules one); along a chain a
forward's activation goes to the next stage and a backward's (I or B) input gradient to the
previous one. :class:`Chains` answers neighbour questions for anything with a ``chains``
attribute (the placement, the simulator's pipelines); :func:`input_source`,
:func:`output_destination`, :func:`receive_for` and :func:`peer_stage` are the rules that
lowering, the dry run, the NCCL model, the simulator and the executor share.
"""

from __future__ import annotations

from functools import cached_property
from typing import NamedTuple

from .._compat.pipelining import B, F, I, RECV_B, RECV_F, SEND_B, SEND_F, _Action, _ComputationType


class Chains:
    """Neighbour lookups for a class with ``chains: tuple[tuple[int, ...], ...]`` (data-flow order)."""

    chains: tuple[tuple[int, ...], ...]

    @cached_property
    def _chain_position(self) -> dict[int, tuple[int, int]]:
        return {stage: (c, i) for c, chain in enumerate(self.chains) for i, stage in enumerate(chain)}

    def _position(self, stage: int) -> tuple[int, int]:
        try:
            return self._chain_position[stage]
        except KeyError:
            raise ValueError(f"stage {stage} is in none of the chains {self.chains}") from None

    def chain_of(self, stage: int) -> int:
        return self._position(stage)[0]

    def prev_stage(self, stage: int) -> int | None:
        """The stage whose output feeds ``stage``, or None for a chain's first stage."""
        chain, i = self._position(stage)
        return self.chains[chain][i - 1] if i > 0 else None

    def next_stage(self, stage: int) -> int | None:
        """The stage fed by ``stage``, or None for a chain's last stage (it computes the loss)."""
        chain, i = self._position(stage)
        members = self.chains[chain]
        return members[i + 1] if i + 1 < len(members) else None

    def is_first(self, stage: int) -> bool:
        return self.prev_stage(stage) is None

    def is_last(self, stage: int) -> bool:
        return self.next_stage(stage) is None


class Source(NamedTuple):
    """The stage whose action (any of ``kinds``) on the same microbatch makes an action's input."""

    stage: int
    kinds: tuple[_ComputationType, ...]


def input_source(action: _Action, flow: Chains) -> Source | None:
    """What feeds ``action`` (F: the previous stage's F; I/B: the next stage's I or B), or None
    at a chain end and for W (it continues this stage's own I)."""
    kind, stage = action.computation_type, action.stage_index
    if kind == F:
        prev = flow.prev_stage(stage)
        return None if prev is None else Source(prev, (F,))
    if kind in (I, B):
        nxt = flow.next_stage(stage)
        return None if nxt is None else Source(nxt, (B, I))
    return None


class Destination(NamedTuple):
    """Where an action's output goes: the consuming stage, and the send / receive that carry it."""

    stage: int
    send: _Action
    recv: _Action


def output_destination(action: _Action, flow: Chains) -> Destination | None:
    """F's activation to the next stage, I/B's input gradient to the previous one; None at a chain end."""
    kind, stage, mb = action.computation_type, action.stage_index, action.microbatch_index
    if kind == F:
        to, send, recv = flow.next_stage(stage), SEND_F, RECV_F
    elif kind in (I, B):
        to, send, recv = flow.prev_stage(stage), SEND_B, RECV_B
    else:
        return None
    return None if to is None else Destination(to, _Action(stage, send, mb), _Action(to, recv, mb))


def receive_for(action: _Action) -> _Action | None:
    """The receive whose data ``action`` (F, I or B) consumes when its source is on another rank."""
    kind = {F: RECV_F, I: RECV_B, B: RECV_B}.get(action.computation_type)
    return None if kind is None else _Action(action.stage_index, kind, action.microbatch_index)


def peer_stage(comm: _Action, flow: Chains) -> int:
    """The stage at the other end of a SEND/RECV action (the receiver of a send, the sender of a recv)."""
    stage, kind = comm.stage_index, comm.computation_type
    other = flow.next_stage(stage) if kind in (SEND_F, RECV_B) else flow.prev_stage(stage)
    if other is None:
        raise ValueError(f"{comm} crosses a chain end: no stage at its other end")
    return other
