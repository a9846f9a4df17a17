"""Communication order under NCCL's semantics: no buffering, one FIFO per communicator,
communicators created lazily at their first use (a rendezvous of their ranks), or eagerly
(a bound device: one communicator per group, lone p2p ops included).

gloo buffers sends, so an order can pass every CPU test and hang on GPUs. The planned
orders (every schedule, pp up to 8, receives deferred or not, both ways torch posts lone
ops) and the communication the runtime really posts (recorded during real CPU steps: early
sends, overlapped pairs, twins, losses, FSDP, expert-parallel MoE exchanges from both threads
of a relay included) must complete under :mod:`titan_dualpipe.orders.nccl_model`; an order
that gloo runs but NCCL would not fails. The pipeline's pair communicators are created before
the first action of the first step, not mid-schedule.
"""

from __future__ import annotations

import pytest
import torch
from torch.torch_version import TorchVersion

from cases import check_cases, moe_trace_cases
from cases import pipeline_cases as cases
from cases.dist_pool import WorkerPool
from titan_dualpipe import compute_order, placement
from titan_dualpipe._compat import pipelining
from titan_dualpipe.orders.lone_pairs import pair_lone_actions
from titan_dualpipe.orders.lowering import lower
from titan_dualpipe.orders.nccl_model import (
    RECV, SEND, Collective, Deadlock, P2P, Post, Trace, Wait, check_completes, check_completes_eager, communicators,
    describe, eager_init, first_uses, group_comm, pair_comm, planned_trace,
)

WORLD = 4  # the module's pool (tests/conftest.py); 8 ranks in pool8 below


def _configs(max_pp: int = 8):
    for schedule in ("DualPipeV", "DualPipe"):
        for pp in range(1 if schedule == "DualPipeV" else 2, max_pp + 1, 1 if schedule == "DualPipeV" else 2):
            for n in range(2 * pp, 2 * pp + 6, 1 if schedule == "DualPipeV" else 2):
                yield schedule, pp, n


@pytest.mark.parametrize("lone_pairs", [False, True], ids=["", "lone pairs"])
@pytest.mark.parametrize("lone_ops_on_pairs", [True, False], ids=["torch>=2.13 lone ops", "torch<2.13 batches"])
@pytest.mark.parametrize("defer", [False, True], ids=["asap", "deferred"])
def test_planned_orders_complete_without_buffering(defer, lone_ops_on_pairs, lone_pairs):
    checked = 0
    for schedule, pp, n in _configs():
        place = placement(schedule, pp, n)
        order = compute_order(schedule, pp, n)
        lowered = lower(pair_lone_actions(order, place) if lone_pairs else order, place, defer_recv=defer)
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
    with pytest.raises(Deadlock, match="waits for its own earlier kernels"):  # communicators made beforehand
        check_completes(waits_for_own_recv, created=communicators(waits_for_own_recv))
    with pytest.raises(Deadlock, match="host blocked creating"):  # each rank's first pair is another's second
        check_completes(waits_for_own_recv)


def test_lazy_communicator_creation_is_a_rendezvous():
    """Three ranks, each pair talks once: with the communicators created beforehand it
    completes; created at first use, each rank's host waits in its first creation for a peer
    that waits in another: a cycle, as NCCL's lazy init would hang."""
    def post(work: int, kind: str, me: int, peer: int, message: str) -> Post:
        return Post(work, pair_comm("pp", me, peer), (P2P(kind, peer, message),))

    trace: Trace = {
        0: [post(0, SEND, 0, 1, "a"), post(1, RECV, 0, 2, "c")],
        1: [post(0, SEND, 1, 2, "b"), post(1, RECV, 1, 0, "a")],
        2: [post(0, SEND, 2, 0, "c"), post(1, RECV, 2, 1, "b")],
    }
    assert check_completes(trace, created=communicators(trace)) >= 1
    blocked = r"rank 0: host blocked creating \('pair', 'pp', 0, 1\).*rank\(s\) \[1\] not there"
    with pytest.raises(Deadlock, match=blocked):
        check_completes(trace)
    # the same pairs taken in one global order (lower rank, higher rank) on every rank: it completes
    ordered = {r: sorted(events, key=lambda e: e.comm[2:]) for r, events in trace.items()}
    ordered = {r: [Post(i, e.comm, e.ops) for i, e in enumerate(events)] for r, events in ordered.items()}
    assert check_completes(ordered) >= 1
    assert first_uses(ordered)[2] == {pair_comm("pp", 0, 2): 0, pair_comm("pp", 1, 2): 1}


def test_a_group_communicator_is_created_by_all_its_members():
    """A batch on a group's communicator that is its first use there needs every member of the
    group (NCCL's lazy init of the group's communicator is a collective): members that never
    come make it hang, members that post a collective on it complete it."""
    comm = group_comm("pp")

    def swap(peer: int) -> Post:  # one batch_isend_irecv on the group's communicator of ranks 0, 1, 2
        return Post(0, comm, (P2P(SEND, peer, "x"), P2P(RECV, peer, "x")), "", (0, 1, 2))

    trace: Trace = {0: [swap(1)], 1: [swap(0)], 2: []}
    with pytest.raises(Deadlock, match=r"ranks \[0, 1, 2\]\): rank\(s\) \[2\] not there"):
        check_completes(trace)
    assert check_completes(trace, created=[comm]) == 1
    everyone = Post(0, comm, (Collective("all_reduce", (0, 1, 2)),))
    joined = {r: [everyone, *[Post(1, e.comm, e.ops, e.label, e.members) for e in events]]
              for r, events in trace.items()}
    assert check_completes(joined) >= 1


def _completes_lazy_and_eager(trace: Trace) -> tuple[int, int]:
    """Rounds to complete ``trace`` with lazy init (pair communicators made at first use) and with
    eager init (every group's communicator made beforehand, lone p2p ops on it)."""
    rounds = []
    for name, check in (("lazy init", check_completes), ("eager init", check_completes_eager)):
        try:
            rounds.append(check(trace))
        except Deadlock as err:
            raise AssertionError(f"under NCCL {name}: {err}\n{describe(trace)}") from None
    return rounds[0], rounds[1]


def test_eager_init_runs_a_groups_p2p_in_issue_order_on_one_communicator():
    """With a bound device NCCL runs a group's lone p2p ops on the group's communicator, in issue
    order with its other ops: a ring that completes on pair communicators hangs there."""
    trace = check_cases.ring_after_warm_up()
    assert check_completes(trace) == 4
    eager = eager_init(trace)
    assert communicators(eager) == {group_comm("pp")} and len(communicators(trace)) == 3
    with pytest.raises(Deadlock, match=r"rank 0: kernel 2 \(recv ring20\) on \('group', 'pp'\): recv from 2"):
        check_completes_eager(trace)
    assert check_completes_eager(trace, groups=["tp"]) == 4  # another group's eager init leaves "pp" as it was
    assert eager_init(trace, groups=["tp"]) == trace


def test_torch_deferral_would_hang_on_nccl():
    """torch's ``_defer_recv_ops`` moves receives past sends (gloo buffers them); on a V order
    the planned posting deadlocks under NCCL's semantics. Ours keeps every rank's sequence."""
    if pipelining.TORCH_DEFER_RECV_OPS is None:
        pytest.skip("this torch has no receive deferral of its own")
    place = placement("DualPipeV", 2, 4)
    lowered = lower(compute_order("DualPipeV", 2, 4), place)
    theirs = pipelining.TORCH_DEFER_RECV_OPS(lowered, place.rank_of)
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
    ("DualPipeV", 4, 8, {"lone_pairs": True}), ("DualPipe", 4, 8, {"lone_pairs": True}),
]


@pytest.mark.parametrize("schedule,pp,n,kwargs", RECORDED, ids=lambda v: str(v) if not isinstance(v, dict) else
                         ",".join(f"{k}={w}" for k, w in v.items()) or "default")
def test_recorded_posting_completes_without_buffering(pool, schedule, pp, n, kwargs):
    results = [r for r in pool.run(cases.recorded_step_trace, schedule=schedule, pp=pp, n=n, **kwargs) if r]
    trace = {r["rank"]: r["events"] for r in results}
    posted = sum(isinstance(e, Post) for events in trace.values() for e in events)
    assert posted > 0
    _completes_lazy_and_eager(trace)


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 4, 8), ("DualPipe", 4, 8)])
def test_recorded_step_completes_under_eager_init(pool, schedule, pp, n):
    """A recorded step moved onto eager init's communicators (``check --backend nccl`` binds each
    rank's GPU): every lone p2p op on its group's one communicator, in issue order with the rest.
    It still completes; serialised, it takes more rounds than on the pair communicators."""
    results = [r for r in pool.run(cases.recorded_step_trace, schedule=schedule, pp=pp, n=n) if r]
    trace = {r["rank"]: r["events"] for r in results}
    eager = eager_init(trace)
    assert not any(c[0] == "pair" for c in communicators(eager)), communicators(eager)
    assert sum(isinstance(e, Post) for events in eager.values() for e in events) == sum(
        isinstance(e, Post) for events in trace.values() for e in events)
    lazy_rounds, eager_rounds = _completes_lazy_and_eager(trace)
    if any(c[0] == "pair" for c in communicators(trace)):  # torch 2.13+: lone ops, now serialised
        assert eager_rounds > lazy_rounds, (lazy_rounds, eager_rounds)


@pytest.fixture(scope="module")
def pool8(pool):
    pool.close()  # one pool at a time: 8 processes share the machine's cores
    with WorkerPool(8) as p:
        yield p


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
@pytest.mark.parametrize("kwargs", [{}, {"defer_pp_recv": True, "overlap": False}], ids=["asap,overlap", "deferred,sequential"])
def test_recorded_posting_at_pp8_completes_without_buffering(pool8, schedule, kwargs):
    results = [r for r in pool8.run(cases.recorded_step_trace, schedule=schedule, pp=8, n=16, **kwargs) if r]
    assert len(results) == 8
    _completes_lazy_and_eager({r["rank"]: r["events"] for r in results})


@pytest.mark.parametrize("schedule,pp,n,kwargs", [
    ("DualPipeV", 2, 4, {}), ("DualPipe", 2, 4, {}), ("DualPipe", 4, 8, {"defer_pp_recv": True}),
    ("DualPipeV", 4, 8, {"fsdp": True}), ("DualPipe", 4, 8, {"fsdp": True, "overlap": False}),
], ids=["V", "DualPipe", "DualPipe-deferred", "V-fsdp", "DualPipe-fsdp"])
def test_every_collective_gets_tensors_on_the_stage_device(pool, schedule, pp, n, kwargs):
    """NCCL-only groups reject CPU tensors: inside step()/eval(), tensors made without device=
    land on meta here, and any collective or p2p op given one fails the case."""
    ran = [r for r in pool.run(cases.steps_with_collectives_on_stage_device, schedule=schedule, pp=pp, n=n, **kwargs) if r]
    assert ran and all(r["collectives"] > 0 for r in ran)


def test_functional_collectives_are_recorded_from_every_thread(pool):
    """torch.ops._c10d_functional collectives (torchtitan's expert parallelism, DTensor, our relayed
    exchange) are recorded on their group's communicator with their waits: from the recording
    thread, from another thread, and when torch calls them from C++ (the autograd all-to-all)."""
    ran = [r for r in pool.run(moe_trace_cases.functional_collectives_recorded) if r]
    assert len(ran) == WORLD
    for r in ran:
        posts = [e for e in r["events"] if isinstance(e, Post)]
        waited = {e.work for e in r["events"] if isinstance(e, Wait)}
        # funcol on this thread, the relayed exchange on another, autograd forward and its backward
        assert [(p.comm, p.ops[0].name, p.members) for p in posts] == [
            (r["ep_comm"], "all_to_all_single", r["ep_members"])] * 4, describe({r["rank"]: r["events"]})
        assert waited == {p.work for p in posts}
    check_completes({r["rank"]: r["events"] for r in ran})


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * x


def test_code_compiled_under_the_recorder_runs_compiled():
    """torch.compile builds graphs inside a CommRecorder (a dispatch mode that did not ignore
    compile internals would make dynamo skip every frame, the block running eagerly), and the
    compiled block's gradients equal the eager block's."""
    from titan_dualpipe.check.numerics import GraphCounter
    from titan_dualpipe.runtime.comm_record import CommRecorder

    torch.manual_seed(0)
    eager, x = _Block(), torch.randn(4, 8)
    compiled, counter = _Block(), GraphCounter("aot_eager")
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(backend=counter)
    with CommRecorder() as recorder:
        compiled(x).sum().backward()
    eager(x).sum().backward()
    assert counter.graphs >= 1 and recorder.events == []
    for got, want in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=4e-5)


def _pair_communicators_created_late(trace: Trace) -> dict[int, list]:
    """Per rank, the pair communicators whose first use (their lazy creation) comes at or after
    the rank's first post made by a schedule action (posts outside actions have no label)."""
    late = {}
    for rank, firsts in first_uses(trace).items():
        events = trace[rank]
        first_action = next((i for i, e in enumerate(events) if isinstance(e, Post) and e.label), len(events))
        late[rank] = [(c, events[i].label) for c, i in firsts.items() if c[0] == "pair" and i >= first_action]
    return {r: v for r, v in late.items() if v}


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 4, 8), ("DualPipe", 4, 8), ("DualPipeV", 2, 4)])
def test_pair_communicators_are_created_before_the_first_action(pool, schedule, pp, n):
    """torch 2.13+ posts one-direction batches as lone ops on two-rank communicators, which NCCL
    creates at first use (blocking both ranks). A recorded first step creates every one of them
    before the first action posts, and the steps complete with every communicator created lazily."""
    ran = [r for r in pool.run(cases.recorded_step_trace, schedule=schedule, pp=pp, n=n) if r]
    trace = {r["rank"]: r["events"] for r in ran}
    lone_ops = TorchVersion(torch.__version__) >= "2.13"  # before 2.13 every p2p batch shares the group's communicator
    assert any(c[0] == "pair" for c in communicators(trace)) == lone_ops, communicators(trace)
    assert not _pair_communicators_created_late(trace), _pair_communicators_created_late(trace)
    _completes_lazy_and_eager(trace)


@pytest.mark.parametrize("module,pair_first", [("ours", "forward"), ("relay", "forward"), ("titan", "forward"),
                                               ("relay", "backward"), ("titan", "backward")],
                         ids=["ours", "relay", "titan", "relay-backward_first", "titan-backward_first"])
@pytest.mark.parametrize("schedule,n", [("DualPipeV", 4), ("DualPipe", 4)])
def test_recorded_moe_step_completes_without_buffering(pool, schedule, n, module, pair_first):
    """Expert parallel x pipeline (pp=2 x ep=2), overlap on: our MoE module (its protocol, and as
    a relay) and torchtitan's MoE layer through the relay, the relay's pairs started with either
    half (``pair_first``). The first step's traffic, expert-parallel exchanges from both threads of
    a relay included, completes under NCCL's semantics with every communicator created at its first
    use, the pair communicators before the first action. torchtitan's token counts go on their own
    communicator, and some are read while the partner half's token exchange is in flight (2 MoE
    blocks per part: the second block's count exchange)."""
    if module == "titan" and moe_trace_cases.titan_moe_available():
        pytest.skip(moe_trace_cases.titan_moe_available())
    ran = pool.run(moe_trace_cases.recorded_moe_step, schedule=schedule, n=n, module=module, pair_first=pair_first)
    trace = {r["rank"]: r["events"] for r in ran}
    for r in ran:
        assert r["losses_finite"]
        # forward: (count,) dispatch, combine; backward: their reverses, each microbatch of each layer
        per_layer_mb = 5 if module == "titan" else 4
        assert r["all_to_alls"] >= per_layer_mb * r["moe_layer_microbatches"], r
        assert (r["hand_overs"] > 0) == (module != "ours"), r
        assert r["ep_comm"] in first_uses(trace)[r["rank"]]
        if module == "titan":  # the count exchange on its own communicator, read beside token exchanges in flight
            assert r["count_comm"] != r["ep_comm"], r
            counts, beside = _count_reads(trace[r["rank"]], r["count_comm"], r["ep_comm"])
            assert counts >= r["moe_layer_microbatches"] and beside > 0, (counts, beside, describe(trace, [r["rank"]]))
    assert not _pair_communicators_created_late(trace), _pair_communicators_created_late(trace)
    _completes_lazy_and_eager(trace)


def _count_reads(events: list, count_comm: tuple, ep_comm: tuple) -> tuple[int, int]:
    """Count exchanges on ``count_comm`` posted and waited for on this rank, and how many of them
    were waited for while a token exchange on ``ep_comm`` was posted and not yet waited for (on
    one communicator the count exchange would have run after it)."""
    in_flight: set[int] = set()
    beside_tokens: dict[int, bool] = {}
    counts = beside = 0
    for event in events:
        if isinstance(event, Post) and event.comm == ep_comm:
            in_flight.add(event.work)
        elif isinstance(event, Post) and event.comm == count_comm:
            beside_tokens[event.work] = bool(in_flight)
        elif isinstance(event, Wait) and event.work in beside_tokens:
            counts += 1
            beside += beside_tokens.pop(event.work) and bool(in_flight)
        elif isinstance(event, Wait):
            in_flight.discard(event.work)
    return counts, beside
