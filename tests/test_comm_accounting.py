"""What the expert-parallel exchanges charge and keep, in one process.

Every path through the MoE module (plain autograd, the segment-wise backward, overlapped
pairs) and every run of ``bench overlap`` charges the same exchanges forward and backward,
also with one expert-parallel rank (no group: the data stays, the emulated time passes).
``CommStats`` stays the same size over any number of steps; on a GPU the stalls are timed
only when a benchmark asks.
"""

from __future__ import annotations

import types
import weakref

import pytest
import torch
import torch.distributed as dist

from cases.dist_pool import one_rank_process_group
from titan_dualpipe.overlap.comm import (CommStats, EmulatedNetwork, ExpertParallelComm, PendingAllToAll,
                                         RelayedExchangeCost, all_to_all)
from titan_dualpipe.overlap.moe import MoEArgs, MoETransformer, expert_parallel, set_exchange_chunks
from titan_dualpipe.overlap.segments import run_to_completion
from titan_dualpipe.testing.model import lm_loss

ARGS = MoEArgs(vocab_size=64, dim=16, n_layers=2, n_heads=2, num_experts=4, top_k=2, moe_inter_dim=32)
BENCH_CFG = dict(pp=1, ep=1, device="cpu", rounds=1, steps=1, microbatches=4, layers=2, dim=16, seq=8, experts=4,
                 comm_ratio=1.0, latency_ms=0.0, bandwidth_gbps=None, dualpipe=False, relay=True,
                 compile="aot_eager")  # the compiled runs too


def _model(comm: ExpertParallelComm) -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer(ARGS)
    expert_parallel(model, comm)
    return model


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, ARGS.vocab_size, (2, 8), generator=g),
            torch.randint(0, ARGS.vocab_size, (2, 8), generator=g))


def _plain(model: MoETransformer) -> None:
    for seed in (0, 1):
        x, y = _batch(seed)
        lm_loss(model(x), y).backward()


def _segment_backward(model: MoETransformer) -> None:
    for seed in (0, 1):
        x, y = _batch(seed)
        run_to_completion(model.backward_steps([lm_loss(model(x), y)], None))


def _pair(model: MoETransformer) -> None:
    """F(mb1) overlapped with B(mb0), then B(mb1) segment-wise."""
    (x0, y0), (x1, y1) = _batch(0), _batch(1)
    out1 = MoETransformer.overlapped_forward_backward(model, (x1,), {}, model, [x0], [lm_loss(model(x0), y0)], None)
    run_to_completion(model.backward_steps([lm_loss(out1, y1)], None))


def _sizes(obj: object) -> dict[str, int]:
    """The length of every container attribute of ``obj``."""
    return {k: len(v) for k, v in vars(obj).items() if isinstance(v, (list, dict, set, tuple))}


@pytest.mark.parametrize("path", [_plain, _segment_backward, _pair], ids=["plain", "segment_backward", "pair"])
def test_one_rank_charges_every_exchange_forward_and_backward(path):
    """Two microbatches, two blocks, two exchanges per block each way: the emulated network
    charges 8 forward and 8 backward on every path (a plain backward charged none before)."""
    comm = ExpertParallelComm(None, EmulatedNetwork())
    path(_model(comm))
    assert comm.stats.posted == 16
    assert (comm.stats.charged_forward, comm.stats.charged_backward) == (8, 8)


def test_one_rank_without_a_network_is_a_free_identity():
    comm, x = ExpertParallelComm(), torch.ones(1, 3, requires_grad=True)
    pending = all_to_all(x, comm)
    assert pending.output is x and pending.wait() is x
    assert (comm.stats.charged_forward, comm.stats.charged_backward) == (0, 0)


def test_one_rank_with_a_network_is_an_exchange_with_a_backward():
    comm, x = ExpertParallelComm(None, EmulatedNetwork()), torch.arange(3.0).view(1, 3).requires_grad_()
    out = all_to_all(x, comm).wait()
    assert torch.equal(out, x) and out.grad_fn is not None
    (out * 2).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    assert (comm.stats.charged_forward, comm.stats.charged_backward) == (1, 1)


# -- bench overlap's runs, in a process group of one rank -------------------------------------------
@pytest.fixture(scope="module")
def world_of_one():
    yield from one_rank_process_group()


def test_bench_runs_charge_the_same_exchanges(world_of_one):
    """``bench overlap --pp 1 --ep 1``: every run posts and charges one step's exchanges, the
    same forward and backward (before, the protocol run charged twice what the others did)."""
    from titan_dualpipe.bench import overlap as bench

    comm = ExpertParallelComm(None, EmulatedNetwork())
    schedules = bench._schedules(BENCH_CFG, dist.distributed_c10d._get_default_group(), comm, 0)
    assert {name for name, _, _ in bench.COMPILED_CONFIGS} < set(schedules)
    n, per_step = BENCH_CFG["microbatches"], 2 * BENCH_CFG["layers"] * BENCH_CFG["microbatches"]
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 512, (2 * n, BENCH_CFG["seq"]), generator=g) for _ in range(2))
    counts = {}
    for name, (schedule, _) in schedules.items():
        schedule.step(x, target=y)  # the first step infers shapes
        comm.stats.reset()
        schedule.step(x, target=y)
        counts[name] = dict(vars(comm.stats))
    assert {name: c["posted"] for name, c in counts.items()} == {name: 2 * per_step for name in schedules}
    assert {name: (c["charged_forward"], c["charged_backward"]) for name, c in counts.items()} \
        == {name: (per_step, per_step) for name in schedules}


def test_bench_chunked_runs_charge_every_chunk(world_of_one):
    """``--exchange-chunks 2``: the chunked runs post and charge two exchanges for each of the whole runs' one."""
    from titan_dualpipe.bench import overlap as bench

    comm = ExpertParallelComm(None, EmulatedNetwork())
    cfg = {**BENCH_CFG, "compile": None, "exchange_chunks": 2}
    schedules = bench._schedules(cfg, dist.distributed_c10d._get_default_group(), comm, 0)
    names = ("overlap", "overlap_relay", *bench.chunked_names(2))
    n, per_step = cfg["microbatches"], 2 * cfg["layers"] * cfg["microbatches"]
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 512, (2 * n, cfg["seq"]), generator=g) for _ in range(2))
    counts = {}
    for name in names:
        schedules[name][0].step(x, target=y)
        comm.stats.reset()
        schedules[name][0].step(x, target=y)
        counts[name] = (comm.stats.posted, comm.stats.charged_forward, comm.stats.charged_backward)
    chunked = (4 * per_step, 2 * per_step, 2 * per_step)
    assert counts == dict(zip(names, [(2 * per_step, per_step, per_step)] * 2 + [chunked] * 2, strict=True))


def test_bench_reports_equal_charged_exchanges(world_of_one):
    from titan_dualpipe.bench import overlap as bench

    raw = bench._worker(BENCH_CFG)
    per_step = 2 * BENCH_CFG["layers"] * BENCH_CFG["microbatches"]
    assert raw["charged"] == {name: [per_step, per_step, 0] for name in raw["step_time"]}  # one rank: no remote bytes
    assert raw["gpu"] is None


# -- nothing grows in training ----------------------------------------------------------------------
def test_stats_stay_the_same_size_over_many_steps():
    comm = ExpertParallelComm(None, EmulatedNetwork())
    model = _model(comm)
    sizes = (_sizes(comm.stats), _sizes(comm))
    for _ in range(20):
        _pair(model)
        _plain(model)
    assert (_sizes(comm.stats), _sizes(comm)) == sizes
    assert comm.stats.charged_forward == comm.stats.charged_backward == 20 * 16


class _FakeEvent:
    made = 0

    def __init__(self, enable_timing: bool = False) -> None:
        _FakeEvent.made += 1

    def record(self, stream: object = None) -> None:
        pass

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return 2.0  # milliseconds


@pytest.fixture
def fake_gpu(monkeypatch):
    """The GPU wait path without a GPU: events and the compute stream are stand-ins."""
    _FakeEvent.made = 0
    stream = types.SimpleNamespace(wait_event=lambda event: None)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return types.SimpleNamespace(is_cuda=True)  # an exchange's output on the GPU


def test_gpu_waits_keep_nothing_in_training(fake_gpu):
    stats = CommStats()
    sizes = _sizes(stats)
    for _ in range(100):
        PendingAllToAll(fake_gpu, None, 0.0, stats, gpu_done=object()).wait()
    assert _sizes(stats) == sizes and _FakeEvent.made == 0


def test_gpu_waits_are_timed_when_a_benchmark_asks(fake_gpu):
    stats = CommStats(timing=True)
    for _ in range(10):
        PendingAllToAll(fake_gpu, None, 0.0, stats, gpu_done=object()).wait()
    assert len(stats.gpu_stalls) == 10 and _FakeEvent.made == 20
    assert stats.collect() == pytest.approx(10 * 2e-3)
    assert stats.gpu_stalls == []


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_forward_keeps_no_dispatch_buffer_or_expert_output_alive(world_of_one, chunks):
    """Between a microbatch's forward and its backward, only what autograd saves stays: the
    boundaries kept for a segment-wise backward hold the dispatch buffer and the experts' output
    as graph edges, whose memory nothing else needs (the exchanges read them and keep nothing);
    so do their chunks when the exchanges are cut."""
    model = _model(ExpertParallelComm(dist.group.WORLD))
    set_exchange_chunks(model, chunks)
    produced: dict[str, list] = {"attention": [], "experts": []}

    def keep_refs(module, args, kwargs, output):
        segment = kwargs.get("segment")
        if segment in produced:
            produced[segment].append(weakref.ref(output[1] if segment == "attention" else output))

    for block in model.layers.values():
        block.register_forward_hook(keep_refs, with_kwargs=True)
    for backward in (lambda loss: loss.backward(), lambda loss: run_to_completion(model.backward_steps([loss], None))):
        produced["attention"].clear(), produced["experts"].clear()
        x, y = _batch(0)
        loss = lm_loss(model(x), y)
        held = {name: sum(ref() is not None for ref in refs) for name, refs in produced.items()}
        assert held == {"attention": 0, "experts": 0}, f"alive before the backward: {held}"
        backward(loss)  # the segment-wise backward still finds its roots
        assert all(p.grad is not None for p in model.parameters())


def test_the_emulated_network_queues_each_communicator_apart():
    """One FIFO per communicator: a count exchange posted on its own communicator while a token
    exchange is in flight on the expert-parallel group is ready after its latency; posted on
    the expert-parallel group it would be ready only after that token exchange."""
    cost = RelayedExchangeCost(seconds=1.0, reference_rows=8)
    ep, counts = types.SimpleNamespace(group_name="ep"), types.SimpleNamespace(group_name="ep counts")
    assert cost.latency_s == 0.5 and RelayedExchangeCost(seconds=1.0).latency_s == 0.0
    tokens_ready = cost.ready_at(ep, 10.0 + cost.seconds_for(8))
    assert tokens_ready == 11.0
    assert cost.ready_at(counts, 10.2 + cost.latency_s) == pytest.approx(10.7)  # its own queue: the latency only
    assert cost.ready_at(ep, 10.2 + cost.latency_s) == 11.0  # the token exchange's queue: behind it
    assert cost.ready_at(counts, 10.3) == pytest.approx(10.7)  # in order behind the earlier count exchange
