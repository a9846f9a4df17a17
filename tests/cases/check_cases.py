"""What each rank of a ``WorkerPool`` runs for tests/test_check.py (importable by the workers)."""

from __future__ import annotations

from typing import Any

from titan_dualpipe.check import cli as check_cli


def cases_counting_groups(cases: list[check_cli.Case], fault: check_cli.Fault | None = None,
                          case_timeout_s: float = check_cli.CASE_TIMEOUT_S) -> dict[str, Any]:
    """``check``'s worker on this rank, with the process groups alive before and after it."""
    before = check_cli.live_groups()
    outcomes = check_cli._worker(cases, "gloo", fault, case_timeout_s)
    return {"groups_before": before, "groups_after": check_cli.live_groups(), "outcomes": outcomes}


def ring_after_warm_up() -> dict[int, list]:
    """A trace of three ranks in one group "pp" that NCCL completes with lazy init but not with
    eager init: each pair talks once in a warm-up (creating the pair communicators in one order
    on every rank), then each rank receives from the previous rank before it sends to the next.
    On pair communicators the sends run beside the receives; on the group's one communicator
    each rank's send waits behind its receive, whose send waits behind the next receive: a cycle."""
    from titan_dualpipe.orders.nccl_model import RECV, SEND, P2P, Post, pair_comm

    def post(work: int, kind: str, me: int, peer: int, message: str) -> Post:
        return Post(work, pair_comm("pp", me, peer), (P2P(kind, peer, message),), f"{kind} {message}")

    warm_up = {0: [(SEND, 1, "w01"), (SEND, 2, "w02")], 1: [(RECV, 0, "w01"), (SEND, 2, "w12")],
               2: [(RECV, 0, "w02"), (RECV, 1, "w12")]}
    ring = {r: [(RECV, (r - 1) % 3, f"ring{(r - 1) % 3}{r}"), (SEND, (r + 1) % 3, f"ring{r}{(r + 1) % 3}")]
            for r in range(3)}
    return {r: [post(i, kind, r, peer, msg) for i, (kind, peer, msg) in enumerate(warm_up[r] + ring[r])]
            for r in range(3)}
