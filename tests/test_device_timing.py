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

import pytest
import torch
import torch.distributed as dist

from dist_pool import one_rank_process_group
from titan_dualpipe.runtime import executor as executor_module
from titan_dualpipe.runtime import timeline
from titan_dualpipe.runtime.timeline import CpuClock, CudaClock, clock_for, span_seconds
from titan_dualpipe.titan import bench_probe

TICK_MS = 250.0  # GPU time between two consecutive recorded fake events


class _Gpu:
    """A fake device: the events recorded so far, synchronizations, the current stream."""

    def __init__(self) -> None:
        self.recorded = 0
        self.syncs = 0
        self.stream = object()


class _FakeEvent:
    gpu: _Gpu

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "a timing event is needed to read elapsed time"
        self.at_ms: float | None = None
        self.synced_at: int | None = None

    def record(self, stream: object = None) -> None:
        assert stream is self.gpu.stream, "events go on the current stream"
        self.at_ms = self.gpu.recorded * TICK_MS
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


def test_bench_titan_takes_the_trainers_device():
    assert bench_probe._device(types.SimpleNamespace(device=torch.device("cuda", 3))) == torch.device("cuda", 3)
    part = torch.nn.Linear(2, 2)
    assert bench_probe._device(types.SimpleNamespace(model_parts=[part])) == torch.device("cpu")
