"""The MoE stage module and its overlapped pairs.

Single-process tests check the segment-wise path against plain autograd bit for bit and
the scheduling pieces; the pool tests (4 gloo ranks: pp=2 x ep=2) train DualPipeV and
DualPipe against a single-process reference with overlap on and off, with FSDP2 and
with torch's own V schedules. The failure test breaks the process groups, so it runs
last.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
import types

import pytest
import torch

from cases import overlap_cases as cases
from cases.dist_pool import WorkerPool
from titan_dualpipe._compat import pipelining
from titan_dualpipe.orders import compute_order, placement
from titan_dualpipe.orders.lone_actions import lone_forwards, paired_backwards
from titan_dualpipe.overlap.comm import CommStats, EmulatedNetwork, PendingAllToAll
from titan_dualpipe.cut import cut_layers
from titan_dualpipe.overlap.moe import _RECORD_KEY, MoEArgs, MoETransformer
from titan_dualpipe.overlap.segments import SegmentLeaves, interleave, run_to_completion
from titan_dualpipe.testing.model import lm_loss

WORLD = 4  # the module's pool (tests/conftest.py): pp=2 x ep=2
POOL_TIMEOUT_S = cases.GROUP_TIMEOUT_S
ARGS = MoEArgs(vocab_size=64, dim=32, n_layers=4, n_heads=2, num_experts=4, top_k=2, capacity_factor=1.0)


# -- single process -----------------------------------------------------------------------------
def _microbatches(last: bool):
    g = torch.Generator().manual_seed(3)
    if last:
        xs = [torch.randn(2, 8, ARGS.dim, generator=g).requires_grad_() for _ in range(2)]
    else:
        xs = [torch.randint(0, ARGS.vocab_size, (2, 8), generator=g) for _ in range(2)]
    return xs, torch.randint(0, ARGS.vocab_size, (2, 8), generator=g)


def _backward_args(out: torch.Tensor, target: torch.Tensor, last: bool):
    if last:
        return [lm_loss(out, target)], None
    return [out], [torch.linspace(-1, 1, out.numel()).view_as(out)]


@pytest.mark.parametrize("checkpoint", [False, True], ids=["no_ac", "ac"])
@pytest.mark.parametrize("last", [False, True], ids=["first_part", "last_part"])
def test_pair_is_bitwise_equal_to_plain_autograd(checkpoint, last):
    """F(mb1) overlapped with B(mb0) vs plain forward then plain backward: same output,
    same parameter and input gradients, bit for bit; then a segment-wise backward of mb1."""
    torch.manual_seed(0)
    part = cut_layers(MoETransformer(ARGS, activation_checkpoint=checkpoint), 2)[int(last)]
    plain, fused = part, copy.deepcopy(part)
    (x0, x1), target = _microbatches(last)
    fx0, fx1 = (x.detach().requires_grad_() if last else x for x in (x0, x1))

    out0 = plain(x0)
    out1 = plain(x1)
    torch.autograd.backward(*_backward_args(out0, target, last))
    fused_out0 = fused(fx0)
    fused_out1 = MoETransformer.overlapped_forward_backward(
        fused, (fx1,), {}, fused, [fx0], *_backward_args(fused_out0, target, last))

    assert torch.equal(out1, fused_out1)
    if last:
        assert torch.equal(x0.grad, fx0.grad)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    torch.autograd.backward(*_backward_args(out1, target, last))
    run_to_completion(fused.backward_steps(*_backward_args(fused_out1, target, last)))
    for (name, p), q in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), f"second microbatch: {name}"


@pytest.mark.parametrize("checkpoint", [False, True], ids=["no_ac", "ac"])
def test_chunked_exchanges_are_bitwise_equal_to_whole_ones(checkpoint):
    """``exchange_chunks`` 2 and 3 (uneven: 2 + 1 + 1 experts) against 1 on one rank: a pair's
    output and every gradient (the pair's backward, then a plain one) bit for bit."""
    torch.manual_seed(0)
    part = cut_layers(MoETransformer(ARGS, activation_checkpoint=checkpoint), 2)[1]
    (x0, x1), target = _microbatches(last=True)
    runs = {}
    for chunks in (1, 2, 3):
        model = copy.deepcopy(part)
        for block in model.layers.values():
            block.moe.set_exchange_chunks(chunks)
        a, b = x0.detach().requires_grad_(), x1.detach().requires_grad_()
        out0 = model(a)
        out1 = MoETransformer.overlapped_forward_backward(model, (b,), {}, model, [a], [lm_loss(out0, target)], None)
        lm_loss(out1, target).backward()
        runs[chunks] = [out0, out1, a.grad, b.grad, *(p.grad for p in model.parameters())]
    for chunks in (2, 3):
        for i, (want, got) in enumerate(zip(runs[1], runs[chunks], strict=True)):
            assert torch.equal(want, got), (chunks, i)


def test_a_chunked_pair_hands_over_at_every_chunk_exchange(monkeypatch):
    """``exchange_chunks=2``: each half of a pair yields at each chunk's exchange (4 per block), and
    the other half runs next every time; in the forward half, chunk 0's experts run while chunk 1's
    dispatch flies (posted before, waited after), and chunk 1's experts while chunk 0's combine flies."""
    from titan_dualpipe.overlap import moe as moe_module
    from titan_dualpipe.overlap.comm import ExpertParallelComm

    torch.manual_seed(0)
    part = cut_layers(MoETransformer(dataclasses.replace(ARGS, exchange_chunks=2)), 2)[1]
    (x0, x1), target = _microbatches(last=True)
    out0 = part(x0)
    log: list[tuple[str, str]] = []
    half = {"now": ""}
    labels: dict[int, tuple[str, str]] = {}  # a posted exchange's half and name
    real_post, real_wait = ExpertParallelComm.post, PendingAllToAll.wait

    def post(self, *args, **kwargs):
        pending = real_post(self, *args, **kwargs)
        labels[id(pending)] = half["now"], f"x{sum(h == half['now'] and e.startswith('post') for h, e in log)}"
        log.append((half["now"], f"post {labels[id(pending)][1]}"))
        return pending

    def wait(self):  # the pair waits a half's exchange just before resuming it
        if id(self) in labels:
            owner, name = labels.pop(id(self))
            log.append((owner, f"wait {name}"))
        return real_wait(self)

    def tagged(name, step):
        while True:
            half["now"] = name
            try:
                pending = step.send(None)
            except StopIteration as done:
                return done.value
            log.append((name, "yield"))
            yield pending

    def logged_experts(block, args, kwargs):
        if kwargs.get("segment") == "experts":
            log.append((half["now"], f"experts {args[1]}"))

    real_interleave = moe_module.interleave
    monkeypatch.setattr(ExpertParallelComm, "post", post)
    monkeypatch.setattr(PendingAllToAll, "wait", wait)
    monkeypatch.setattr(moe_module, "interleave", lambda b, f, **kw: real_interleave(tagged("B", b), tagged("F", f), **kw))
    for block in part.layers.values():
        block.register_forward_pre_hook(logged_experts, with_kwargs=True)
    for block in part.layers.values():
        block.moe.comm.network = EmulatedNetwork()  # autograd-aware exchanges, at no cost
    MoETransformer.overlapped_forward_backward(part, (x1,), {}, part, [x0], [lm_loss(out0, target)], None)

    blocks = len(part.layers)
    yields = [i for i, (_, event) in enumerate(log) if event == "yield"]
    assert [log[i][0] for i in yields].count("F") == 4 * blocks == [log[i][0] for i in yields].count("B")
    assert all(log[i + 1][0] != log[i][0] for i in yields[:-1]), log  # the partner runs at every yield
    forward = [event for h, event in log if h == "F"][:14]  # the first block's forward half
    assert forward == ["post x0", "post x1", "yield", "wait x0", "experts 0", "post x2", "yield", "wait x1",
                       "experts 1", "post x3", "yield", "wait x2", "yield", "wait x3"], forward


def test_boundaries_are_released_by_a_plain_backward():
    torch.manual_seed(0)
    model = MoETransformer(ARGS)
    out = model(torch.randint(0, ARGS.vocab_size, (2, 8)))
    record = out.grad_fn.metadata[_RECORD_KEY]
    assert len(record.layers) == ARGS.n_layers
    lm_loss(out, torch.zeros(2, 8, dtype=torch.long)).backward()
    assert record.entry is None and record.layers == []


class _Sleep:
    """A communication handle that is ready ``seconds`` after it was created."""

    def __init__(self, seconds: float, log: list, label: str) -> None:
        self.ready, self.log, self.label = time.perf_counter() + seconds, log, label

    def wait(self) -> None:
        time.sleep(max(0.0, self.ready - time.perf_counter()))
        self.log.append(f"waited {self.label}")


def _step(name: str, exchanges: int, log: list, seconds: float):
    for i in range(exchanges):
        log.append(f"{name}{i}")
        yield _Sleep(seconds, log, f"{name}{i}")
    return name


def test_interleave_alternates_and_overlaps_waits():
    """Each half's compute up to its next exchange (``F1``, ``B0``...) runs while the other
    half's exchange is in flight: between its post and its wait. Alone, a step waits each
    exchange before computing on."""
    log: list = []
    assert interleave(_step("F", 3, log, 0), _step("B", 2, log, 0)) == ("F", "B")
    assert log == ["F0", "B0", "waited F0", "F1", "waited B0", "B1", "waited F1", "F2", "waited B1", "waited F2"]
    alone: list = []
    run_to_completion(_step("F", 3, alone, 0))
    assert alone == ["F0", "waited F0", "F1", "waited F1", "F2", "waited F2"]


def test_interleave_closes_the_other_half_when_one_raises():
    closed = []

    def healthy():
        try:
            yield _Sleep(0, [], "h")
            yield _Sleep(0, [], "h")
        finally:
            closed.append(True)

    def broken():
        yield _Sleep(0, [], "b")
        raise KeyError("boom in one half")

    with pytest.raises(KeyError, match="boom in one half"):
        interleave(healthy(), broken())
    assert closed == [True]


class _StubClock:
    """``time`` for :mod:`titan_dualpipe.overlap.comm`: ``perf_counter`` moves only when the test
    advances it or the code sleeps, so no descheduling of a loaded machine shows as waiting."""

    def __init__(self) -> None:
        self.now, self.slept = 100.0, []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_emulated_network_waits_without_cpu_and_counts_only_blocked_time(monkeypatch):
    net = EmulatedNetwork(latency_s=0.05, bandwidth_bytes_per_s=1e6)
    assert net.seconds(50_000) == pytest.approx(0.1)
    ready_at = time.perf_counter() + net.seconds(50_000)
    cpu = time.process_time()
    PendingAllToAll(torch.zeros(1), None, ready_at, CommStats()).wait()
    assert time.perf_counter() >= ready_at and time.process_time() - cpu < 0.05  # slept, did not spin
    # on a stub clock (a loaded machine may deschedule this thread between any two lines): the
    # time blocked counts as waited; an exchange that ended while the other half computed costs
    # nothing; one still in flight costs what is left of it, slept
    from titan_dualpipe.overlap import comm

    clock, stats = _StubClock(), CommStats()
    monkeypatch.setattr(comm, "time", clock)
    PendingAllToAll(torch.zeros(1), None, clock.now + net.seconds(50_000), stats).wait()
    assert clock.slept == [pytest.approx(0.1)] and stats.waited_s == pytest.approx(0.1)
    clock.slept.clear()
    before = stats.waited_s
    hidden = PendingAllToAll(torch.zeros(1), None, clock.now + 0.05, stats)
    clock.now += 0.06  # the other half computing
    hidden.wait()
    assert stats.waited_s == before and clock.slept == []
    late = PendingAllToAll(torch.zeros(1), None, clock.now + 0.05, stats)
    clock.now += 0.02
    late.wait()
    assert clock.slept == [pytest.approx(0.03)] and stats.waited_s - before == pytest.approx(0.03)


def test_emulated_network_runs_a_groups_exchanges_in_order():
    """bench titan's network: an exchange is never ready before one posted earlier on its group
    (one communicator, one stream); other groups are independent."""
    from types import SimpleNamespace

    from titan_dualpipe.overlap.comm import RelayedExchangeCost

    cost = RelayedExchangeCost(seconds=1.0)
    ep, other = SimpleNamespace(group_name="ep"), SimpleNamespace(group_name="other")
    assert cost.ready_at(ep, 10.0) == 10.0  # a token exchange posted at 9.0
    assert cost.ready_at(ep, 9.5) == 10.0  # a count exchange posted after it: ready with it, not before
    assert cost.ready_at(other, 9.5) == 9.5
    assert cost.ready_at(ep, 12.0) == 12.0


@pytest.mark.parametrize("make,message", [
    (lambda: MoEArgs(dim=30, n_heads=4), "divisible by n_heads"),
    (lambda: MoEArgs(num_experts=2, top_k=3), "top_k=3 must be <= num_experts=2"),
    (lambda: MoEArgs(capacity_factor=0), "capacity_factor must be > 0"),
    (lambda: MoEArgs(exchange_chunks=0), "exchange_chunks=0: use an int from 1 (one exchange each) to 4"),
    (lambda: MoETransformer(dataclasses.replace(ARGS, exchange_chunks=4)).layers["0"].moe.use_expert_parallel(
        types.SimpleNamespace(size=2, rank=0)), "exchange_chunks=4: use an int from 1 (one exchange each) to 2"),
    (lambda: MoETransformer(ARGS).layers["0"].moe.set_exchange_chunks(5), "exchange_chunks=5: use an int from 1"),
    (lambda: EmulatedNetwork(latency_s=-1), "latency_s must be a finite number >= 0"),
    (lambda: EmulatedNetwork(bandwidth_bytes_per_s=0), "bandwidth_bytes_per_s must be > 0"),
    (lambda: cut_layers(MoETransformer(ARGS), 5), "cannot cut 4 layers into 5 parts"),
    (lambda: MoETransformer(ARGS).layers["0"].moe.use_expert_parallel(types.SimpleNamespace(size=3, rank=0)),
     "num_experts=4 is not divisible by the expert-parallel size 3"),
    (lambda: MoETransformer(ARGS).layers["0"](torch.zeros(1, 2, ARGS.dim), segment="router"),
     "unknown segment 'router'"),
    (lambda: run_to_completion(MoETransformer(ARGS).backward_steps([torch.ones(2, requires_grad=True) * 2], None)),
     "do not come from a MoETransformer forward"),
])
def test_bad_input_raises_value_error(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


@pytest.mark.parametrize("change,message", [
    ({"microbatches": 3}, "--microbatches must be >= 4"),
    ({"dualpipe": True, "microbatches": 5}, "and even with --dualpipe"),
    ({"layers": 3}, "--layers must be >= 4"),
    ({"experts": 5}, "--experts must be divisible by the expert-parallel size 2"),
    ({"bandwidth_gbps": 0.0}, "--bandwidth-gbps must be > 0"),
    ({"exchange_chunks": 3}, "--exchange-chunks must be from 1 to 2"),
    ({"pp": 3, "dualpipe": True, "microbatches": 6}, "--dualpipe needs an even --pp, got 3"),
    ({"pp": 0}, "--pp must be >= 1"),
    ({"device": "cuda", "pp": 64}, "--device cuda needs one GPU per process"),
])
def test_bench_rejects_bad_settings_before_spawning(change, message):
    from titan_dualpipe.bench.overlap import measure

    cfg = dict(pp=2, ep=2, device="cpu", rounds=1, steps=1, microbatches=8, layers=4, dim=16, seq=8, experts=4,
               comm_ratio=1.0, latency_ms=None, bandwidth_gbps=None, dualpipe=False, relay=True, compile=None)
    with pytest.raises(ValueError, match=re.escape(message)):
        measure({**cfg, **change})


def test_a_leaf_shared_by_two_segments_is_refused():
    leaves, shared = SegmentLeaves(), torch.zeros(3, requires_grad=True)
    leaves.claim([shared])
    with pytest.raises(ValueError, match="gradients from two segments"):
        leaves.claim([shared])


# -- 4 ranks: pp=2 x ep=2 -------------------------------------------------------------------------
def _check_numerics(results: list[dict], schedule: str, n: int, relay: bool = False, compiled: bool = False) -> None:
    assert all(r["grad_err"] <= cases.ATOL for r in results)
    twin_factor = 2 if schedule == "DualPipe" else 1  # both pipeline ends compute every loss
    # per pipeline: 2 steps x 2 runs (overlap on, off) x n losses on each rank holding a loss
    assert sum(r["losses_checked"] for r in results) == cases.EP * twin_factor * 2 * 2 * n
    assert all(r["bitwise_tensors"] > 0 for r in results)
    assert all(r["fused_pairs_without_overlap"] == 0 and r["hand_overs_without_overlap"] == 0 for r in results)
    # weight GEMMs waited for W (DualPipe at pp 2 runs I only on its chains' first stages; compiled
    # stages keep their backward whole)
    for kind in ("deferred_expert_gemms", "deferred_linear_gemms"):
        assert (sum(r[kind] for r in results) > 0) == (schedule == "DualPipeV" and not compiled), (kind, results)
    if relay:  # every rank has pairs, and every pair's halves switch at the MoE exchanges
        assert all(r["fused_pairs"] == 0 and r["hand_overs"] > 0 for r in results), results
    else:
        assert all(r["fused_pairs"] > 0 and r["hand_overs"] == 0 for r in results), results


@pytest.mark.parametrize("schedule,n,checkpoint", [
    ("DualPipeV", 4, False), ("DualPipeV", 5, True), ("DualPipe", 4, False), ("DualPipe", 6, True),
])
def test_moe_pipeline_matches_reference_and_overlap_is_bitwise(pool, schedule, n, checkpoint):
    results = pool.run(cases.moe_numerics, schedule=schedule, n=n, checkpoint=checkpoint)
    _check_numerics(results, schedule, n)


@pytest.mark.parametrize("schedule,n,checkpoint", [("DualPipeV", 4, False), ("DualPipe", 4, True)])
def test_moe_pipeline_with_fsdp2(pool, schedule, n, checkpoint):
    """fully_shard per block and per stage over the expert-parallel ranks (experts kept local)."""
    results = pool.run(cases.moe_numerics, schedule=schedule, n=n, checkpoint=checkpoint, fsdp=True)
    _check_numerics(results, schedule, n)


@pytest.mark.parametrize("schedule,n,checkpoint,fsdp", [
    ("DualPipeV", 4, False, False), ("DualPipe", 4, True, False), ("DualPipeV", 5, True, True),
])
def test_relayed_moe_pipeline_matches_reference_and_overlap_is_bitwise(pool, schedule, n, checkpoint, fsdp):
    """The MoE module without its protocol: pairs run as a relay switching at its exchanges. Full
    backwards run their weight GEMMs while their exchanges fly, with the same gradients bit for bit
    (``overlap=False`` runs them there too)."""
    results = pool.run(cases.moe_numerics, schedule=schedule, n=n, checkpoint=checkpoint, fsdp=fsdp, relay=True)
    _check_numerics(results, schedule, n, relay=True)
    assert all(r["weight_gemms_in_flight"] > 0 for r in results), results


@pytest.mark.parametrize("schedule,mode", [("DualPipeV", "backward"), ("DualPipe", "backward"),
                                           ("DualPipeV", "measured"), ("DualPipe", "measured")])
def test_which_half_runs_first_changes_no_bit(pool, schedule, mode):
    """``pair_first``: the relayed MoE pipeline (EP 2, exchanges of 2 ms emulated) with the backward
    first, or as measured in the second step, matches the reference and the forward-first run bit for
    bit over three steps. "backward" starts every relay with its backward; "measured" decides after
    the second step, the same on every rank, and from the third runs every relay of a kind with the
    first half and plan it chose for the kind."""
    results = pool.run(cases.pair_first_numerics, schedule=schedule, n=4, mode=mode, latency_s=2e-3)
    assert all(r["bitwise_tensors"] > 0 for r in results), results
    assert sum(r["losses_checked"] for r in results) > 0, results
    assert all(r["mismatched_relays"] == 0 for r in results), results
    if mode == "backward":
        assert all(min(r["first"]) > 0 for r in results), results
        return
    assert all(r["first"][:2] == [0, 0] for r in results), results  # measuring runs the forward first
    chosen = [r["chosen"] for r in results]
    assert chosen[0] is not None and all(c == chosen[0] for c in chosen), results  # decided, and agreed
    assert all(r["savings"] for r in results), results  # the emulated exchanges gave every kind a figure


@pytest.mark.parametrize("schedule,checkpoint", [("DualPipeV", False), ("DualPipe", True)])
def test_lone_pairs_run_in_their_measured_order_and_change_no_bit(pool, schedule, checkpoint):
    """``lone_pairs=True`` with "measured": a lone pair (two forwards, or two backwards) is a kind of
    its own, decided like any other, the same on every rank; its relays follow their kind's first half
    and plan, with the reference's losses and gradients and the same bits as the forward first (also
    with every block checkpointed)."""
    from titan_dualpipe.overlap.pair_first import FORWARD_BACKWARD

    results = pool.run(cases.pair_first_numerics, schedule=schedule, n=4, mode="measured", latency_s=2e-3,
                       checkpoint=checkpoint, lone_pairs=True)
    assert all(r["bitwise_tensors"] > 0 and r["mismatched_relays"] == 0 for r in results), results
    assert sum(r["losses_checked"] for r in results) > 0, results
    assert all(r["lone_relays"] > 0 for r in results), results
    chosen = [r["chosen"] for r in results]
    assert chosen[0] is not None and all(c == chosen[0] for c in chosen), results
    assert {kind[2] for kind, _, _ in chosen[0]} > {FORWARD_BACKWARD}, chosen[0]  # lone kinds decided too


@pytest.mark.parametrize("schedule,checkpoint", [("DualPipeV", False), ("DualPipe", False), ("DualPipeV", True)])
def test_a_plan_that_keeps_turns_changes_no_bit(pool, schedule, checkpoint):
    """"measured" with every kind's plan then made to keep each half's first turn (a half waits for
    its own exchange, as where the floor's order is no alternation): the reference's losses and
    gradients and the same bits as the forward first, every rank's relays following the plan, and
    no hang from the changed order of posts; also with every block checkpointed (a kept turn inside
    a recomputation)."""
    results = pool.run(cases.pair_first_numerics, schedule=schedule, n=4, mode="measured", latency_s=2e-3,
                       keep_first_turns=True, checkpoint=checkpoint)
    assert all(r["bitwise_tensors"] > 0 and r["mismatched_relays"] == 0 for r in results), results
    assert all(r["kept_turns"][:2] == [0, 0] and r["kept_turns"][2] > 0 for r in results), results


@pytest.mark.parametrize("schedule,n,relay,checkpoint,fsdp,two_batch", [
    ("DualPipeV", 4, False, False, False, False), ("DualPipe", 4, False, True, False, False),
    ("DualPipeV", 5, True, True, False, False), ("DualPipe", 4, True, False, False, False),
    ("DualPipeV", 4, False, False, True, False), ("DualPipeV", 4, False, False, False, True),
    ("DualPipeV", 4, True, False, False, True),
], ids=["DualPipeV-protocol", "DualPipe-protocol-ac", "DualPipeV-relay-ac", "DualPipe-relay", "DualPipeV-protocol-fsdp2",
        "DualPipeV-protocol-two_batch", "DualPipeV-relay-two_batch"])
def test_chunked_exchanges_are_bitwise_equal_in_the_pipeline(pool, schedule, n, relay, checkpoint, fsdp, two_batch):
    """``exchange_chunks=2`` (a chunk per local expert) against 1, both overlapped (and with two-batch overlap):
    each matches the reference, and they agree bit for bit; every exchange went as two, and relayed pairs switched
    halves at each of them."""
    results = pool.run(cases.chunked_exchanges_numerics, schedule=schedule, n=n, relay=relay, checkpoint=checkpoint,
                       fsdp=fsdp, two_batch=two_batch)
    assert all(r["grad_err"] <= cases.ATOL and r["bitwise_tensors"] > 0 for r in results), results
    twin_factor = 2 if schedule == "DualPipe" else 1
    assert sum(r["losses_checked"] for r in results) == cases.EP * twin_factor * 2 * 2 * n
    assert all(r["posted"][2] == 2 * r["posted"][1] > 0 for r in results), results
    if relay:
        assert all(r["hand_overs"][2] > r["hand_overs"][1] > 0 and r["fused_pairs"][2] == 0 for r in results), results
    else:
        assert all(r["fused_pairs"][2] == r["fused_pairs"][1] > 0 for r in results), results


@pytest.mark.parametrize("schedule,checkpoint", [("DualPipeV", True), ("DualPipe", "selective")],
                         ids=["DualPipeV-full_ac", "DualPipe-selective_ac"])
def test_weight_gemms_in_flight_change_no_bit(pool, schedule, checkpoint):
    """The relayed MoE pipeline (EP 2) under full and selective AC: full backwards compute their weight
    GEMMs while their exchanges fly, or inline (``weight_gemms_in_flight=False``); both match the
    reference, and each other bit for bit."""
    results = pool.run(cases.weight_gemms_in_flight_on_and_off, schedule=schedule, n=4, checkpoint=checkpoint)
    assert all(r["bitwise_tensors"] > 0 for r in results), results
    assert all(r["in_flight"] > 0 for r in results), results
    assert sum(r["losses_checked"] for r in results) > 0, results


def test_weight_gemm_fillers_change_no_bit(pool):
    """``weight_gemms_in_flight="fill"`` on an emulated network (arrival times known): a full
    backward computes only the weight GEMMs that fit before the exchange awaited next arrives, the rest
    at its end; the gradients match the reference, and computing them inline, bit for bit."""
    results = pool.run(cases.weight_gemms_in_flight_on_and_off, schedule="DualPipeV", n=4, checkpoint=False,
                       mode="fill", latency_s=2e-3)
    assert all(r["bitwise_tensors"] > 0 for r in results), results
    assert sum(r["in_flight"] for r in results) > 0, results
    assert sum(r["losses_checked"] for r in results) > 0, results


@pytest.mark.parametrize("schedule,relay", [("DualPipeV", True), ("DualPipe", True), ("DualPipeV", False)])
def test_compiled_moe_blocks_overlap_at_every_exchange(pool, schedule, relay):
    """Blocks compiled in place (aot_eager): the exchanges stay outside the compiled graphs, so a
    relayed pair switches halves at every exchange as it does uncompiled (the same count of
    hand-overs) and the protocol still fuses its pairs; gradients match the reference compiled
    the same way and are bitwise equal with and without overlap."""
    n = 4
    compiled = pool.run(cases.moe_numerics, schedule=schedule, n=n, relay=relay, compile_backend="aot_eager")
    _check_numerics(compiled, schedule, n, relay=relay, compiled=True)
    assert all(r["compiled_frames"] > 0 for r in compiled)
    if relay:
        eager = pool.run(cases.moe_numerics, schedule=schedule, n=n, relay=True)
        assert [r["hand_overs"] for r in compiled] == [r["hand_overs"] for r in eager]


def test_relayed_all_to_all_equals_torchs_autograd_all_to_all(pool):
    results = pool.run(cases.relayed_all_to_all_matches_torch)
    assert all(r["forward_equal"] and r["backward_equal"] for r in results), results
    assert [r["rows"] for r in results] == [3, 5, 3, 5]
    # said once, after the first exchange traced into a graph (the third call)
    assert all(r["told"] == [False, False, False, True, False] and len(r["warnings"]) == 1 for r in results), results


@pytest.mark.parametrize("name", ["torch DualPipeV", "ZBVZeroBubble"])
def test_moe_module_under_torch_v_schedules(pool, name):
    results = pool.run(cases.torch_schedule_numerics, name=name, n=4)
    assert all(r["grad_err"] <= cases.ATOL for r in results)
    assert sum(r["losses"] for r in results) == cases.EP * 4


def test_emulated_cost_of_relayed_exchanges_hides_behind_the_partner_half(pool):
    """bench titan's network: alone an exchange pays its whole cost, exposed; in a relayed
    pair the partner half's compute covers most of it; the bits do not change."""
    seconds = 0.2
    results = pool.run(cases.relayed_exchange_emulated_cost, seconds=seconds)
    for r in results:
        assert r["same_bits"] and r["posted"] == 2, r
        assert r["alone_s"] >= seconds and r["alone_exposed"] >= 0.9 * seconds, r
        assert r["paired_exposed"] <= 0.5 * seconds, r  # the partner computed 0.75 of it


def test_failure_in_a_relayed_pair_surfaces_on_every_rank():
    """Rank 0 raises in the backward half of a relayed pair (its own pool: the failure
    breaks the process groups): the forward half stops at its next hand-over, rank 0 raises
    at once, every other rank within the process-group timeout."""
    with WorkerPool(WORLD, pg_timeout_s=cases.GROUP_TIMEOUT_S) as own:
        results = own.run(cases.failure_in_pair, relay=True, timeout_s=cases.GROUP_TIMEOUT_S + 60)
    assert all(r["raised"] for r in results), results
    assert any(line.startswith("InjectedFailure: injected failure in the backward half of a pair on rank 0")
               for line in results[0]["chain"]), results[0]
    _others_stop_and_rank_2_names_rank_0(results)


def _others_stop_and_rank_2_names_rank_0(results: list[dict]) -> None:
    """Every other rank stops within the group timeout with an error of its own; rank 0's
    pipeline peer (rank 2; pp groups {0, 2} and {1, 3}) names rank 0 and what it raised."""
    assert results[0]["elapsed_s"] < cases.GROUP_TIMEOUT_S / 2
    for r in results[1:]:
        assert r["elapsed_s"] < cases.GROUP_TIMEOUT_S + 15, r
        assert not r["chain"][0].startswith("InjectedFailure"), r
    assert results[2]["chain"][0].startswith("PeerFailed: pipeline rank 1 (global rank 2) lost pipeline rank 0 "
                                             "(global rank 0)"), results[2]
    assert "First failure in the pipeline: pipeline rank 0 (global rank 0) raised InjectedFailure" \
        in results[2]["chain"][0], results[2]


def test_failure_in_a_pair_surfaces_on_every_rank():
    """Rank 0 raises inside its first overlapped pair (its own pool: the failure leaves
    unmatched messages in the process groups): it raises that error at once, and every other
    rank stops with an error within the process-group timeout."""
    with WorkerPool(WORLD, pg_timeout_s=cases.GROUP_TIMEOUT_S) as own:
        results = own.run(cases.failure_in_pair, timeout_s=cases.GROUP_TIMEOUT_S + 60)
    assert all(r["raised"] for r in results), results
    assert results[0]["chain"][0] == "InjectedFailure: injected failure in the forward half of a pair on rank 0"
    _others_stop_and_rank_2_names_rank_0(results)



@pytest.mark.parametrize("schedule,n,relay,checkpoint,fsdp", [
    ("DualPipeV", 4, False, False, False), ("DualPipe", 4, False, True, False),
    ("DualPipeV", 4, True, False, False), ("DualPipe", 6, True, True, False),
    ("DualPipeV", 5, False, False, True), ("DualPipeV", 4, True, False, True),
])
def test_two_batch_overlap_matches_reference(pool, schedule, n, relay, checkpoint, fsdp):
    """``two_batch_overlap=True``: lone forwards run their microbatch (2 rows) as two halves on
    every stage of this MoE (each posts expert-parallel exchanges): losses and gradients match the reference and the unsplit run
    at RTOL/ATOL (a weight gradient sums two half-batch gradients: a reordered sum)."""
    results = pool.run(cases.two_batch_numerics, schedule=schedule, n=n, relay=relay, checkpoint=checkpoint,
                       fsdp=fsdp)
    assert all(r["grad_err"] <= cases.ATOL and r["split_vs_whole"] <= cases.ATOL for r in results), results
    twin_factor = 2 if schedule == "DualPipe" else 1
    assert sum(r["losses_checked"] for r in results) == cases.EP * twin_factor * 2 * 2 * n
    order = compute_order(schedule, cases.PP, n)
    halves_with_input_action = False
    for rank, r in enumerate(results):  # 2 steps; a lone backward runs apart too, under FSDP2 as well
        split = lone_forwards(order[rank // cases.EP])
        halved = 2 * (len(split) + len(split - paired_backwards(order[rank // cases.EP])))
        assert r["split"] == 2 * len(split), results
        inputs = {(a.stage_index, a.microbatch_index) for a in order[rank // cases.EP]
                  if a is not None and a.computation_type == pipelining.I and not placement(schedule, cases.PP, n).is_first(a.stage_index)}
        assert set(r["deferred"]) == inputs, results  # every I's GEMMs waited for its W, split microbatches' too
        halves_with_input_action |= bool(split & inputs)
        if relay:  # the halves switch at the MoE exchanges
            assert r["fused_halves"] == 0 and r["relayed_halves"] == halved and r["halves_hand_overs"] > 0, results
        else:  # the module interleaves them itself
            assert r["relayed_halves"] == 0 and r["fused_halves"] == halved, results
    assert halves_with_input_action == (schedule == "DualPipeV")  # DualPipe at pp 2: I on first stages only


@pytest.mark.parametrize("schedule,n,relay,bias", [
    ("DualPipeV", 4, False, {0: -1e3, 1: -1e3, 2: 1e3, 3: 1e3}),
    ("DualPipeV", 4, True, None),
    ("DualPipe", 4, True, {0: 1e3, 1: -1e3, 2: -1e3, 3: 1e3}),
], ids=["protocol-biased", "relay-measured", "dualpipe-relay-biased"])
def test_measured_two_batch_overlap_splits_where_the_run_says_it_pays(pool, schedule, n, relay, bias):
    """``two_batch_overlap="measured"``: steps 0, 1 and 3 run whole, steps 2 and 4 split every stage
    with exchanges (here all), and from step 5 on the stages where splitting saved enough (summed
    over ranks) split, the same stages on every rank that holds them; losses and gradients match
    the reference at every step. ``bias`` makes splitting win (negative) or lose (positive) per
    stage whatever it measured."""
    results = pool.run(cases.two_batch_measured, schedule=schedule, n=n, relay=relay, bias=bias)
    assert all(r["grad_err"] <= cases.ATOL for r in results), results
    assert sum(r["losses_checked"] for r in results) == cases.EP * (2 if schedule == "DualPipe" else 1) * 7 * n
    place = placement(schedule, cases.PP, n)
    savings = results[0]["savings"]
    assert sorted(savings) == list(range(place.num_stages)), savings  # every stage split at steps 2 and 4
    chosen_everywhere = set(results[0]["chosen_everywhere"])
    assert chosen_everywhere <= {s for s, saved in savings.items() if saved > 0}, results[0]
    if bias is not None:
        assert chosen_everywhere == {s for s, b in bias.items() if b < 0}, savings
    order = compute_order(schedule, cases.PP, n)
    for rank, r in enumerate(results):
        mine = set(place.stages_of(rank // cases.EP))
        assert r["savings"] == savings and set(r["candidates"]) == mine, results  # one sum on every rank
        assert set(r["chosen_everywhere"]) == chosen_everywhere, results
        assert set(r["chosen"]) == chosen_everywhere & mine == set(r["two_batch_stages"]), results
        assert r["split_stages"] == [[], [], sorted(mine), [], sorted(mine)] + [sorted(r["chosen"])] * 2, results
        lone = lone_forwards(order[rank // cases.EP])
        assert r["joins"] == [sum(key[0] in set(stages) for key in lone) for stages in r["split_stages"]], results


@pytest.mark.parametrize("relay,checkpoint,whole_blocks,reshard_after_forward", [
    (False, False, False, None), (True, True, False, None), (True, False, True, False),
], ids=["protocol", "relay-ac", "relay-whole-blocks-kept-gathered"])
def test_two_batch_overlap_gathers_fsdp2_parameters_as_the_whole_microbatch(
        pool, relay, checkpoint, whole_blocks, reshard_after_forward):
    """FSDP2: the halves of a split microbatch share each module call's all-gather, so a step posts
    as many all-gathers with two-batch overlap as without; gradients agree. Our blocks are called per
    segment and reshard after each call; torchtitan-like blocks are called whole, a relayed half
    handing over inside the call; kept gathered (``reshard_after_forward=False``), they must not be
    resharded by the second half's post-forward."""
    results = pool.run(cases.two_batch_all_gathers, schedule="DualPipeV", n=4, relay=relay, checkpoint=checkpoint,
                       whole_blocks=whole_blocks, reshard_after_forward=reshard_after_forward)
    for r in results:
        assert r["split"] == r["whole"] and r["split_vs_whole"] <= cases.ATOL, results
    assert all(min(r["whole"]) > 0 for r in results), results
