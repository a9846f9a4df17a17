"""Device timing: on a GPU the executor timeline and ``bench titan``'s step, phases and exposed
exchange time come from CUDA events on the current stream, resolved after the step with one
synchronize; on the CPU from the host clock.

Without a GPU the CUDA path runs on fake events that carry their own time (a fixed step per
recorded event, far from any host clock reading), so a CUDA path that read the host clock, read
an event before the synchronize, or synchronized per event fails here.
"""

from __future__ import annotations

import time
import types
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cases.dist_pool import one_rank_process_group
from titan_dualpipe._compat.c10d import wait_collective
from titan_dualpipe.overlap import comm
from titan_dualpipe.runtime import executor as executor_module
from titan_dualpipe.runtime import timeline
from titan_dualpipe.runtime.timeline import CpuClock, CudaClock, clock_for, span_seconds
from titan_dualpipe.titan import bench_probe

TICK_MS = 250.0  # GPU time between two consecutive recorded fake events


class _Gpu:
    """A fake device: the events recorded so far, synchronizations, the current stream, and GPU
    time spent waiting besides the ticks (``stalled_ms``)."""

    def __init__(self) -> None:
        self.recorded = 0
        self.syncs = 0
        self.stream = object()
        self.stalled_ms = 0.0


class _FakeEvent:
    gpu: _Gpu

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "a timing event is needed to read elapsed time"
        self.at_ms: float | None = None
        self.synced_at: int | None = None

    def record(self, stream: object = None) -> None:
        assert stream is self.gpu.stream, "events go on the current stream"
        self.at_ms = self.gpu.recorded * TICK_MS + self.gpu.stalled_ms
        self.gpu.recorded += 1

    def elapsed_time(self, end: "_FakeEvent") -> float:
        assert self.gpu.syncs > 0, "an event was read before the device synchronized"
        assert self.at_ms is not None and end.at_ms is not None
        return end.at_ms - self.at_ms


@pytest.fixture
def fake_gpu(monkeypatch) -> _Gpu:
    gpu = _Gpu()
    _FakeEvent.gpu = gpu

    def synchronize(device: object = None) -> None:
        gpu.syncs += 1

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: gpu.stream)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return gpu


def _expected_spans(n: int) -> list[tuple[float, float]]:
    """n back-to-back spans after the clock's own start event, in seconds."""
    return [((2 * k + 1) * TICK_MS / 1e3, (2 * k + 2) * TICK_MS / 1e3) for k in range(n)]


# -- the clocks ---------------------------------------------------------------------------------
def test_the_clock_follows_the_device(fake_gpu):
    assert isinstance(clock_for(torch.device("cuda", 0)), CudaClock)
    assert isinstance(clock_for("cuda"), CudaClock)
    assert isinstance(clock_for(torch.device("cpu")), CpuClock)
    assert isinstance(clock_for(None), CpuClock)


def test_the_cuda_clock_reads_events_after_one_synchronize(fake_gpu, monkeypatch):
    monkeypatch.setattr(timeline, "time", types.SimpleNamespace(perf_counter=_no_host_clock))
    clock = clock_for("cuda")
    spans = [(clock.mark(), clock.mark()) for _ in range(3)]
    assert fake_gpu.syncs == 0  # nothing waits while the step runs
    assert span_seconds(clock, spans) == _expected_spans(3)
    assert fake_gpu.syncs == 1


def test_the_cpu_clock_is_the_host_clock():
    clock = clock_for("cpu")
    before = time.perf_counter()
    start = clock.mark()
    time.sleep(0.01)
    end = clock.mark()
    [(s, e)] = span_seconds(clock, [(start, end)])
    assert 0 <= s < e and 0.01 <= e - s <= time.perf_counter() - before


def _no_host_clock() -> float:
    raise AssertionError("the CUDA path read the host clock")


# -- the executor's timeline, one rank (DualPipeV's two stages), gloo on the CPU -----------------
@pytest.fixture(scope="module")
def world_of_one():
    yield from one_rank_process_group()


def _timed_step(group: dist.ProcessGroup, n: int = 4):
    from titan_dualpipe.check.numerics import batch, build_pipeline

    _, _, schedule = build_pipeline("DualPipeV", 1, n, group, 0, record_timeline=True)
    x, y = batch(0, n)
    schedule.step(x, target=y)  # the first step infers shapes
    return schedule, (x, y)


def test_executor_timeline_on_cuda_comes_from_events(world_of_one, fake_gpu, monkeypatch):
    schedule, (x, y) = _timed_step(world_of_one)
    devices = []

    def on_cuda(device: torch.device):
        devices.append(device)
        return clock_for(torch.device("cuda", 0))  # the stages' device, as a GPU would give it

    monkeypatch.setattr(executor_module, "clock_for", on_cuda)
    monkeypatch.setattr(timeline, "time", types.SimpleNamespace(perf_counter=_no_host_clock))
    recorded_before = fake_gpu.recorded
    schedule.step(x, target=y)
    assert devices == [schedule._stages[0].device]
    assert fake_gpu.syncs == 1  # once, after the step
    ran = schedule.timeline
    assert [t.action for t in ran] == list(schedule.pipeline_order[0])
    assert [(t.start, t.end) for t in ran] == _expected_spans(len(ran))
    assert fake_gpu.recorded - recorded_before == 1 + 2 * len(ran)


def test_executor_timeline_on_cpu_is_host_seconds(world_of_one, fake_gpu):
    schedule, (x, y) = _timed_step(world_of_one)
    recorded = fake_gpu.recorded
    start = time.perf_counter()
    schedule.step(x, target=y)
    wall = time.perf_counter() - start
    ran = schedule.timeline
    assert [t.action for t in ran] == list(schedule.pipeline_order[0])
    assert all(0 <= t.start <= t.end <= wall for t in ran)
    assert all(a.end <= b.start for a, b in zip(ran, ran[1:]))
    assert (fake_gpu.recorded, fake_gpu.syncs) == (recorded, 0)  # no event on the CPU


def test_no_timeline_no_clock(world_of_one, fake_gpu, monkeypatch):
    from titan_dualpipe.check.numerics import batch, build_pipeline

    monkeypatch.setattr(executor_module, "clock_for", lambda device: clock_for("cuda"))
    _, _, schedule = build_pipeline("DualPipeV", 1, 4, world_of_one, 0)
    x, y = batch(0, 4)
    for _ in range(2):
        schedule.step(x, target=y)
    assert (fake_gpu.recorded, fake_gpu.syncs) == (0, 0)


# -- bench titan's probe ------------------------------------------------------------------------
class _Stats:
    """The relayed exchanges' stats as the probe sees them."""

    def __init__(self) -> None:
        self.waited_s = 0.0

    def wait_until(self, ready_at: float, wait):
        return wait()


def _probe_step(clock: bench_probe._PhaseClock, stats: _Stats, device: str) -> bench_probe._Record:
    """One train step: a pipeline step with one exchange wait, clipping, the optimizer."""
    record = bench_probe._Record()
    schedule = clock.timed("schedule", lambda: stats.wait_until(0.0, lambda: None))
    clip, optimizer = clock.timed("clip", lambda: None), clock.timed("optimizer", lambda: None)
    clock.start_step(device)
    clock.timed(bench_probe.STEP, lambda: (schedule(), clip(), optimizer()))()
    bench_probe._record_step(record, clock.totals())
    return record


def test_bench_titan_times_a_gpu_step_with_events(fake_gpu, monkeypatch):
    clock, stats = bench_probe._PhaseClock(), _Stats()
    bench_probe._time_exposed(stats, clock)
    monkeypatch.setattr(timeline, "time", types.SimpleNamespace(perf_counter=_no_host_clock))
    record = _probe_step(clock, stats, "cuda:0")
    # events in order: clock start, step start, schedule start, exposed start and end, schedule
    # end, clip start and end, optimizer start and end, step end: ticks 0..10
    tick = TICK_MS / 1e3
    assert record.step_s == [pytest.approx(9 * tick)]
    assert record.exposed_s == [pytest.approx(tick)]
    assert record.exposed_by_action == [pytest.approx({bench_probe.OUTSIDE: tick})]  # no action of ours ran
    assert record.phases == [pytest.approx({"schedule": 3 * tick, "clip": tick, "optimizer": tick,
                                            "other": 4 * tick})]
    assert fake_gpu.syncs == 1


def test_bench_titan_times_a_cpu_step_with_the_host_clock(fake_gpu):
    clock, stats = bench_probe._PhaseClock(), _Stats()
    bench_probe._time_exposed(stats, clock)
    start = time.perf_counter()
    record = _probe_step(clock, stats, "cpu")
    wall = time.perf_counter() - start
    [step], [exposed], [phases] = record.step_s, record.exposed_s, record.phases
    assert 0 <= exposed <= phases["schedule"] <= step <= wall
    assert Counter(phases).keys() == {"schedule", "clip", "optimizer", "other"}
    assert (fake_gpu.recorded, fake_gpu.syncs) == (0, 0)


def test_bench_titan_charges_a_relayed_pairs_wait_to_the_half_that_waited():
    """Inside a relayed pair each exchange wait is charged to the half that blocked: ``pair F``
    for the forward half (the calling thread), ``pair B`` for the backward half (the helper
    thread); outside a relay a pair's wait stays ``pair``, a lone action's its own kind."""
    from titan_dualpipe.overlap.relay import hand_over, run_relayed

    clock, stats = bench_probe._PhaseClock(), _Stats()
    bench_probe._time_exposed(stats, clock)
    clock.start_step("cpu")

    def waits(times: int) -> None:
        for _ in range(times):
            hand_over()
            stats.wait_until(0.0, lambda: time.sleep(0.001))

    clock.action_kind = bench_probe.PAIR
    run_relayed(lambda: waits(1), lambda: waits(2))
    stats.wait_until(0.0, lambda: None)  # a pair whose module interleaves its halves itself
    clock.action_kind = "lone F"
    stats.wait_until(0.0, lambda: None)
    charged = Counter(phase for phase, _, _ in clock.spans)
    exposed = bench_probe.EXPOSED
    assert charged == {f"{exposed}:pair F": 1, f"{exposed}:pair B": 2, f"{exposed}:pair": 1, f"{exposed}:lone F": 1}
    assert clock.totals()[f"{exposed}:pair B"] >= 0.002


def test_bench_titan_takes_the_trainers_device():
    assert bench_probe._device(types.SimpleNamespace(device=torch.device("cuda", 3))) == torch.device("cuda", 3)
    part = torch.nn.Linear(2, 2)
    assert bench_probe._device(types.SimpleNamespace(model_parts=[part])) == torch.device("cpu")


# -- bench titan: the token-count exchange's stall ------------------------------------------------
STALL_MS = 1000.0  # device time the counts take to arrive once the compute stream reaches their read


class _Counts(torch.Tensor):
    """Token counts a count exchange fills. ``arrive`` runs once, at the first operation the
    caller must wait at for them (a GPU: the host's first read, which copies them to the host;
    the CPU: the collective's wait)."""

    arrive_on: tuple[str, ...] = ()
    arrive: Any = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in cls.arrive_on and cls.arrive is not None:
            arrive, cls.arrive = cls.arrive, None
            arrive()
        return super().__torch_function__(func, types, args, kwargs or {})


def _wait_and_copy_to_host(counts: torch.Tensor) -> torch.Tensor:
    """A read that blocks the host until the counts arrive: the collective's wait, then (where
    the counts would sit on a GPU) their copy to the host."""
    waited = wait_collective(counts)
    waited.to("cpu")
    return waited


def _dispatch_reads_counts(counts: torch.Tensor) -> list[int]:
    """A dispatch: post the count exchange, read it on the host at once, then take the splits."""
    received = comm.count_exchange(lambda: counts, group=None, read=_wait_and_copy_to_host)
    return received.view(2, -1).sum(dim=1).tolist()


def _probe_count_step(clock: bench_probe._PhaseClock, device: str) -> tuple[bench_probe._Record, list[int]]:
    """One train step whose pipeline step reads a token-count exchange, under bench titan's probe."""
    cost = comm.RelayedExchangeCost(0.0)  # what bench titan installs on a GPU (--comm-ratio 0)
    bench_probe._time_exposed(cost.stats, clock)
    counts = torch.tensor([[1, 2], [3, 4]]).as_subclass(_Counts)
    splits: list[int] = []
    record = bench_probe._Record()
    schedule = clock.timed("schedule", lambda: splits.extend(_dispatch_reads_counts(counts)))
    clock.start_step(device)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(comm, "_RELAYED_COST", cost)
        clock.timed(bench_probe.STEP, schedule)()
    bench_probe._record_step(record, clock.totals())
    return record, splits


def test_bench_titan_charges_the_count_exchange_stall_on_a_gpu(fake_gpu, monkeypatch):
    """On a GPU the counts arrive while the host blocks in their read (the stream's wait for the
    collective, then the device-to-host copy): that stall is exposed communication, inside the
    exposed span's events, not after them."""
    def arrive() -> None:
        fake_gpu.stalled_ms += STALL_MS

    clock = bench_probe._PhaseClock()
    monkeypatch.setattr(_Counts, "arrive_on", ("to", "cpu", "tolist", "item"))
    monkeypatch.setattr(_Counts, "arrive", arrive)
    monkeypatch.setattr(timeline, "time", types.SimpleNamespace(perf_counter=_no_host_clock))
    record, splits = _probe_count_step(clock, "cuda:0")
    assert splits == [3, 7] and _Counts.arrive is None
    # events: clock start, step start, schedule start, exposed start, (stall) exposed end,
    # schedule end, step end
    tick, stall = TICK_MS / 1e3, STALL_MS / 1e3
    assert record.exposed_s == [pytest.approx(tick + stall)]
    assert record.exposed_by_action == [pytest.approx({bench_probe.OUTSIDE: tick + stall})]
    assert record.step_s == [pytest.approx(5 * tick + stall)]  # the stall counted once
    assert fake_gpu.syncs == 1


def test_bench_titan_charges_the_count_exchange_wait_on_the_cpu(fake_gpu, monkeypatch):
    """On the CPU the same read waits in the collective's wait: on the host clock, inside the
    exposed span too."""
    wait_s = 0.05
    monkeypatch.setattr(_Counts, "arrive_on", ("wait_tensor",))
    monkeypatch.setattr(_Counts, "arrive", lambda: time.sleep(wait_s))
    record, splits = _probe_count_step(bench_probe._PhaseClock(), "cpu")
    assert splits == [3, 7] and _Counts.arrive is None
    [step], [exposed] = record.step_s, record.exposed_s
    assert wait_s <= exposed <= step < wait_s + 0.04
    assert (fake_gpu.recorded, fake_gpu.syncs) == (0, 0)


# -- the token-count read on CUDA -----------------------------------------------------------------
class _Streams:
    """Fake CUDA streams and events that log, in order, what a count read asks of them."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.current = "compute"

    def stream(self, name: str) -> Any:
        streams = self

        class _Stream:
            def __init__(self, device: object = None) -> None:
                self.name = name

            def wait_stream(self, other: Any) -> None:
                streams.log.append(f"{self.name} waits for {other.name}")

            def wait_event(self, event: Any) -> None:
                streams.log.append(f"{self.name} waits for {event.name}")

            def synchronize(self) -> None:
                streams.log.append(f"host waits for the {self.name} stream")

        return _Stream

    def on(self, stream: Any) -> Any:
        streams = self

        class _On:
            def __enter__(self) -> None:
                self.before, streams.current = streams.current, stream.name

            def __exit__(self, *exc: object) -> None:
                streams.current = self.before

        return _On()

    def event(self) -> Any:
        streams = self

        class _Event:
            def __init__(self) -> None:
                self.name = "its event"

            def record(self, stream: Any) -> None:
                streams.log.append(f"{self.name} recorded on {stream.name}")

            def synchronize(self) -> None:
                streams.log.append(f"host waits for {self.name}")

        return _Event


def test_cuda_count_read_waits_for_its_own_exchange_beside_the_compute_stream(monkeypatch):
    """On CUDA the count exchange is posted from a side stream once the local counts are computed,
    the partner half runs while the counts travel, and the host waits for the event of the counts'
    pinned, non-blocking copy only: never for the compute stream or the device. The compute stream
    waits for the same event before it uses the received counts."""
    from titan_dualpipe.overlap import count_read
    from titan_dualpipe.overlap.relay import hand_over, run_relayed

    fake = _Streams()
    compute, side = fake.stream("compute")(), fake.stream("side")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "Stream", side)
    monkeypatch.setattr(torch.cuda, "stream", fake.on)
    monkeypatch.setattr(torch.cuda, "Event", fake.event())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: fake.log.append("host waits for the device"))
    monkeypatch.setattr(count_read, "_SIDE_STREAMS", {})

    def pinned_like(t: torch.Tensor) -> torch.Tensor:
        host = torch.empty_like(t)
        copy_ = host.copy_
        host.copy_ = lambda src, non_blocking=False: (  # type: ignore[method-assign]
            fake.log.append(f"pinned copy on {fake.current}, non_blocking={non_blocking}"), copy_(src))[1]
        return host

    def waited(t: torch.Tensor) -> torch.Tensor:
        fake.log.append(f"exchange waited for on {fake.current}")
        return t

    monkeypatch.setattr(count_read, "_pinned_like", pinned_like)
    monkeypatch.setattr(count_read, "_used_on", lambda t, stream: None)
    monkeypatch.setattr(count_read, "wait_collective", waited)
    local, peers = torch.tensor([1, 2, 3, 4]), torch.tensor([5, 0, 2, 1])

    def post() -> torch.Tensor:
        fake.log.append(f"exchange posted on {fake.current}")
        return peers

    reads = []

    def partner() -> None:
        fake.log.append("partner half runs")
        hand_over()

    run_relayed(lambda: reads.append(count_read._read_beside_the_compute_stream(local, 2, post, None)), partner)
    [read] = reads
    assert (read.received is peers, read.input_splits, read.output_splits) == (True, [3, 7], [5, 3])
    assert fake.log[:8] == [
        "side waits for compute",
        "exchange posted on side",
        "partner half runs",
        "exchange waited for on side",
        "pinned copy on side, non_blocking=True",
        "its event recorded on side",
        "host waits for its event",
        "compute waits for its event",
    ], fake.log
    assert not [entry for entry in fake.log if "stream" in entry or "device" in entry], fake.log


# -- bench compile: full and split backwards on the device ---------------------------------------
def test_bench_compile_times_full_and_split_backwards_with_events(world_of_one, fake_gpu, monkeypatch):
    """``bench compile --device cuda``: the full backward and torch's I and W are spans of CUDA
    events on the stage's device (each variant's marks resolved with one synchronize), as its
    runtime variant's timeline is; the host clock would time the kernel launches."""
    from titan_dualpipe.bench import compile as bench_compile

    cfg = dict(model="mlp", blocks=1, dim=8, tokens=8, seq=4, microbatches=2, rounds=1, backend="aot_eager",
               threads=1, device="cpu")
    g = torch.Generator().manual_seed(0)
    batch, target = torch.randn(4, 4, 8, generator=g), torch.randn(4, 4, 8, generator=g)
    kind = bench_compile._Kind("eager", cfg, batch, target)
    devices = []

    def on_cuda(device: torch.device):
        devices.append(device)
        return clock_for(torch.device("cuda", 0))

    monkeypatch.setattr(bench_compile, "clock_for", on_cuda)
    monkeypatch.setattr(timeline, "time", types.SimpleNamespace(perf_counter=_no_host_clock))
    tick = TICK_MS / 1e3
    assert kind.full() == pytest.approx((tick, 0.0, 0.0))  # per microbatch: backward start, end
    assert kind.torch_split() == pytest.approx((2 * tick, tick, tick))  # start, between I and W, end
    assert devices == [kind.device, kind.device] and fake_gpu.syncs == 2
