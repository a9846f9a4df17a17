"""Dry run of a lowered (compute + comms) order: catches deadlocks and mismatched messages.

Each rank executes its actions in order. SEND and RECV only post (they are async in the
runtime); a compute action waits until its input is there: a posted RECV whose message
has been sent, or the same-rank producer already done. Messages between two ranks match
in posting order, as torch's untagged p2p does, so each recv is checked against the
message it would really receive. Overlapped pairs wait for both halves' inputs.
"""

from __future__ import annotations

from collections import deque

from .._compat.pipelining import (
    B,
    F,
    I,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    W,
    _Action,
    _format_pipeline_order,
)
from .dataflow import input_source, peer_stage, receive_for
from .lowering import Order, leaf_actions
from .placement import Placement


class _Channel:
    """Messages from one rank to another, matched to recvs in posting order."""

    def __init__(self) -> None:
        self.sent: list[_Action] = []
        self.recvs: list[_Action] = []

    def matched(self, recv: _Action) -> bool:
        return self.recvs.index(recv) < len(self.sent)


def _expected_recv(send: _Action, place: Placement) -> _Action:
    kind = RECV_F if send.computation_type == SEND_F else RECV_B
    return _Action(peer_stage(send, place), kind, send.microbatch_index)


class _DryRun:
    def __init__(self, lowered: Order, place: Placement) -> None:
        self.lowered, self.place = lowered, place
        self.pending = {rank: deque(actions) for rank, actions in lowered.items()}
        self.done: dict[int, set[_Action]] = {rank: set() for rank in lowered}
        self.channels: dict[tuple[int, int], _Channel] = {}

    def channel(self, src: int, dst: int) -> _Channel:
        return self.channels.setdefault((src, dst), _Channel())

    def input_ready(self, rank: int, action: _Action) -> bool:
        stage, mb = action.stage_index, action.microbatch_index
        done = self.done[rank]
        if action.computation_type == W:
            return _Action(stage, I, mb) in done
        source = input_source(action, self.place)
        if source is None:
            return True
        if self.place.rank_of(source.stage) == rank:
            return any(_Action(source.stage, k, mb) in done for k in source.kinds)
        recv = receive_for(action)
        return recv in done and self.channel(self.place.rank_of(source.stage), rank).matched(recv)

    def post(self, rank: int, action: _Action) -> None:
        kind = action.computation_type
        if kind in (SEND_F, SEND_B):
            source = _Action(action.stage_index, F if kind == SEND_F else B, action.microbatch_index)
            if source not in self.done[rank] and source._replace(computation_type=I) not in self.done[rank]:
                raise ValueError(f"rank {rank}: {action} is posted before its data is computed")
            recv = _expected_recv(action, self.place)
            self.channel(rank, self.place.rank_of(recv.stage_index)).sent.append(recv)
        elif kind in (RECV_F, RECV_B):
            self.channel(self.place.rank_of(peer_stage(action, self.place)), rank).recvs.append(action)

    def step(self, rank: int) -> bool:
        queue = self.pending[rank]
        if not queue:
            return False
        action = queue[0]
        if not all(self.input_ready(rank, leaf) for leaf in leaf_actions(action)):
            return False
        queue.popleft()
        self.post(rank, action)
        self.done[rank].update(leaf_actions(action))
        self.done[rank].add(action)
        return True

    def check_matches(self) -> None:
        for (src, dst), channel in self.channels.items():
            if channel.sent != channel.recvs:
                pairs = [(s, r) for s, r in zip(channel.sent, channel.recvs) if s != r]
                raise ValueError(
                    f"messages from rank {src} to rank {dst} do not match their recvs in posting order; "
                    f"first mismatch: {pairs[0][1]} would receive the data meant for {pairs[0][0]}"
                    if pairs else
                    f"rank {src} sends {len(channel.sent)} messages to rank {dst}, which posts {len(channel.recvs)} recvs"
                )


def dry_run(lowered: Order, place: Placement) -> int:
    """Run ``lowered`` on paper; return the number of rounds, or raise ValueError naming
    the stuck actions (deadlock) or the first mismatched message."""
    run = _DryRun(lowered, place)
    rounds = 0
    while any(run.pending.values()):
        progress = False
        for rank in sorted(run.pending):
            while run.step(rank):
                progress = True
        rounds += 1
        if not progress:
            stuck = {rank: str(q[0]) for rank, q in run.pending.items() if q}
            raise ValueError(f"deadlock: every rank waits; next actions {stuck}\n{_format_pipeline_order(lowered)}")
    run.check_matches()
    return rounds
