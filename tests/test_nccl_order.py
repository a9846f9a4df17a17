"""Communication order under NCCL's semantics: no buffering, one FIFO per communicator.

gloo buffers sends, so an order can pass every CPU test and hang on GPUs. The planned
orders (every schedule, pp up to 8, receives deferred or not, both ways torch posts lone
ops) and the communication the runtime really posts (recorded during real CPU steps: early
sends, overlapped pairs, twins, losses, FSDP included) must complete under
:mod:`titan_dualpipe.orders.nccl_model`; an order that gloo runs but NCCL would not fails.
"""

from __future__ import annotations

import pytest

import pipeline_cases as cases
from dist_pool import WorkerPool
from titan_dualpipe import _compat, compute_order, placement
from titan_dualpipe.orders.lowering import lower
from titan_dualpipe.orders.nccl_model import (
    RECV, SEND, Deadlock, P2P, Post, Wait, check_completes, describe, group_comm, pair_comm, planned_trace,
)

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(WORLD)
    yield p
    p.close()


def _configs(max_pp: int = 8):
    for schedule in ("DualPipeV", "DualPipe"):
        for pp in range(1 if schedule == "DualPipeV" else 2, max_pp + 1, 1 if schedule == "DualPipeV" else 2):
            for n in range(2 * pp, 2 * pp + 6, 1 if schedule == "DualPipeV" else 2):
                yield schedule, pp, n


@pytest.mark.parametrize("lone_ops_on_pairs", [True, False], ids=["torch>=2.13 lone ops", "torch<2.13 batches"])
@pytest.mark.parametrize("defer", [False, True], ids=["asap", "deferred"])
def test_planned_orders_complete_without_buffering(defer, lone_ops_on_pairs):
    checked = 0
    for schedule, pp, n in _configs():
        place = placement(schedule, pp, n)
        lowered = lower(compute_order(schedule, pp, n), place, defer_recv=defer)
        trace = planned_trace(lowered, place, lone_ops_on_pairs=lone_ops_on_pairs)
        try:
            check_completes(trace)
        except Deadlock as err:
            raise AssertionError(f"{schedule} pp={pp} n={n}: {err}\n{describe(trace)}") from None
        checked += 1
    assert checked == 60  # DualPipeV pp 1-8 x 6 microbatch counts, DualPipe pp 2-8 (even) x 3


def test_the_model_has_no_buffer():
    """Two ranks that both send first: gloo completes it, NCCL does not."""
    comm = pair_comm("pp", 0, 1)
    both_send_first = {
        0: [Post(0, comm, (P2P(SEND, 1, "a"),)), Post(1, comm, (P2P(RECV, 1, "b"),))],
        1: [Post(0, comm, (P2P(SEND, 0, "b"),)), Post(1, comm, (P2P(RECV, 0, "a"),))],
    }
    with pytest.raises(Deadlock, match=r"rank 0: kernel 0 on .*send to 1"):
        check_completes(both_send_first)
    one_batch_each = {r: [Post(0, group_comm("pp"), (e[0].ops[0], e[1].ops[0]))] for r, e in both_send_first.items()}
    assert check_completes(one_batch_each) == 1  # ops of one batch progress together
    waits_for_own_recv = {
        0: [Post(0, comm, (P2P(RECV, 1, "b"),)), Wait(0), Post(1, pair_comm("pp", 0, 2), (P2P(SEND, 2, "c"),))],
        1: [Post(0, comm, (P2P(SEND, 0, "b"),))],
        2: [Post(0, pair_comm("pp", 0, 2), (P2P(RECV, 0, "c"),))],
    }
    assert check_completes(waits_for_own_recv) == 2
    # a cycle through the compute streams: each rank sends only after its own receive arrived
    waits_for_own_recv[1] = [Post(0, pair_comm("pp", 1, 2), (P2P(RECV, 2, "d"),)), Wait(0),
                             Post(1, comm, (P2P(SEND, 0, "b"),))]
    waits_for_own_recv[2] = [Post(0, pair_comm("pp", 0, 2), (P2P(RECV, 0, "c"),)), Wait(0),
                             Post(1, pair_comm("pp", 1, 2), (P2P(SEND, 1, "d"),))]
    with pytest.raises(Deadlock, match="waits for its own earlier kernels"):
        check_completes(waits_for_own_recv)


def test_torch_deferral_would_hang_on_nccl():
    """torch's ``_defer_recv_ops`` moves receives past sends (gloo buffers them); on a V order
    the planned posting deadlocks under NCCL's semantics. Ours keeps every rank's sequence."""
    if _compat.TORCH_DEFER_RECV_OPS is None:
        pytest.skip("this torch has no receive deferral of its own")
    place = placement("DualPipeV", 2, 4)
    lowered = lower(compute_order("DualPipeV", 2, 4), place)
    theirs = _compat.TORCH_DEFER_RECV_OPS(lowered, place.rank_of)
    with pytest.raises(Deadlock):
        check_completes(planned_trace(theirs, place))
    check_completes(planned_trace(lower(compute_order("DualPipeV", 2, 4), place, defer_recv=True), place))


def test_an_order_gloo_runs_but_nccl_would_not_fails_here(pool):
    """Rank 1 posts a receive after its send (both ranks send first): the step completes on
    gloo with the right gradients, and the recorded posting order is reported as a hang."""
    results = [r for r in pool.run(cases.recorded_trace_of_hand_made_order, pp=2, n=4, move="1RECV_F1",
                                   after="2SEND_F0") if r]
    trace = {r["rank"]: r["events"] for r in results}
    with pytest.raises(Deadlock, match="cannot complete without buffering"):
        check_completes(trace)


RECORDED = [
    ("DualPipeV", 2, 5, {}), ("DualPipeV", 4, 8, {}), ("DualPipeV", 4, 9, {"defer_pp_recv": True}),
    ("DualPipeV", 4, 8, {"overlap": False}), ("DualPipeV", 4, 8, {"defer_pp_recv": True, "overlap": False}),
    ("DualPipe", 2, 4, {}), ("DualPipe", 4, 8, {}), ("DualPipe", 4, 10, {"defer_pp_recv": True}),
    ("DualPipe", 4, 8, {"overlap": False}), ("DualPipeV", 2, 4, {"fsdp": True}), ("DualPipe", 2, 6, {"fsdp": True}),
]


@pytest.mark.parametrize("schedule,pp,n,kwargs", RECORDED, ids=lambda v: str(v) if not isinstance(v, dict) else
                         ",".join(f"{k}={w}" for k, w in v.items()) or "default")
def test_recorded_posting_completes_without_buffering(pool, schedule, pp, n, kwargs):
    results = [r for r in pool.run(cases.recorded_step_trace, schedule=schedule, pp=pp, n=n, **kwargs) if r]
    trace = {r["rank"]: r["events"] for r in results}
    posted = sum(isinstance(e, Post) for events in trace.values() for e in events)
    assert posted > 0
    try:
        check_completes(trace)
    except Deadlock as err:
        raise AssertionError(f"{err}\n{describe(trace)}") from None


@pytest.fixture(scope="module")
def pool8(pool):
    pool.close()  # one pool at a time: 8 processes share the machine's cores
    p = WorkerPool(8)
    yield p
    p.close()


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
@pytest.mark.parametrize("kwargs", [{}, {"defer_pp_recv": True, "overlap": False}], ids=["asap,overlap", "deferred,sequential"])
def test_recorded_posting_at_pp8_completes_without_buffering(pool8, schedule, kwargs):
    results = [r for r in pool8.run(cases.recorded_step_trace, schedule=schedule, pp=8, n=16, **kwargs) if r]
    assert len(results) == 8
    check_completes({r["rank"]: r["events"] for r in results})


@pytest.mark.parametrize("schedule,pp,n,kwargs", [
    ("DualPipeV", 2, 4, {}), ("DualPipe", 2, 4, {}), ("DualPipe", 4, 8, {"defer_pp_recv": True}),
    ("DualPipeV", 4, 8, {"fsdp": True}), ("DualPipe", 4, 8, {"fsdp": True, "overlap": False}),
], ids=["V", "DualPipe", "DualPipe-deferred", "V-fsdp", "DualPipe-fsdp"])
def test_every_collective_gets_tensors_on_the_stage_device(pool, schedule, pp, n, kwargs):
    """NCCL-only groups reject CPU tensors: inside step()/eval(), tensors made without device=
    land on meta here, and any collective or p2p op given one fails the case."""
    ran = [r for r in pool.run(cases.steps_with_collectives_on_stage_device, schedule=schedule, pp=pp, n=n, **kwargs) if r]
    assert ran and all(r["collectives"] > 0 for r in ran)
