"""The floor of a pair's exposed exchange time (titan_dualpipe/exposure): hand-made segment lists
with known answers, the dynamic program against every order, and the record a run's pairs leave."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from titan_dualpipe.exposure.floor import (Exchange, Segment, floor, lone_exposure, normalized, relay_order,
                                           run_in_order, serial_exposure)
from titan_dualpipe.exposure.record import (ExposureRecorder, PairTrace, StepTrace, pair_exposure, start_recording,
                                            step_exposure, stop_recording)


def chain(*parts: float, channel: str | None = None) -> list[Segment]:
    """``chain(c0, e0, c1, e1, ..., ck)``: compute and exchange seconds, alternating."""
    computes, exchanges = parts[0::2], parts[1::2]
    return [Segment(c, Exchange(e, channel=channel) if i < len(exchanges) else None) for i, (c, e)
            in enumerate(itertools.zip_longest(computes, exchanges))]


# -- known answers ---------------------------------------------------------------------------------
def test_a_lone_half_leaves_every_exchange_exposed_but_its_lead():
    half = chain(1, 2, 1, 3, 1)
    assert floor([half]).exposure == lone_exposure(half) == serial_exposure([half]) == 5
    led = [Segment(1, Exchange(2, lead=0.5)), Segment(1, Exchange(3)), Segment(1)]  # 0.5 of weight GEMMs after posting
    assert floor([led]).exposure == lone_exposure(led) == 4.5


def test_zero_length_exchanges_leave_nothing_exposed_in_any_order():
    a, b = chain(1, 0, 2, 0, 1), chain(3, 0, 1)
    assert floor([a, b]).exposure == 0
    for order in ((0, 0, 0, 1, 1), (1, 1, 0, 0, 0), relay_order([a, b])):
        assert run_in_order([a, b], order).exposure == 0


def test_an_exchange_longer_than_all_the_partners_compute_is_exposed_by_the_difference():
    forward, backward = chain(1, 10, 1), chain(2)
    best = floor([forward, backward])
    assert best.exposure == 8 and best.order == (0, 1, 0)  # the partner's 2 s cover 2 of the 10
    assert run_in_order([forward, backward], (1, 0, 0)).exposure == 10


def test_the_greedy_order_is_not_the_floor():
    """Starting with the segment that can start first, the longer compute on ties (or the
    runtime's alternation from the first half), exposes 5; starting with the short one, 1."""
    a, b = chain(4, 5, 0), chain(1, 5, 4)
    assert run_in_order([a, b], relay_order([a, b], first=0)).exposure == 5
    best = floor([a, b])
    assert best.exposure == 1 and best.order == (1, 0, 1, 0)


def test_the_relays_alternation_is_not_the_floor():
    """A forward whose one exchange outlasts the backward's segment: alternating exposes 4; the
    backward's next segment before the forward's resumes, 1 (no order does better: the forward's
    chain takes 7 and the backward's exchanges gap its own segments)."""
    forward, backward = chain(1, 5, 1), chain(2, 1, 2, 1, 2)
    assert relay_order([forward, backward]) == (0, 1, 0, 1, 1)
    assert run_in_order([forward, backward], relay_order([forward, backward])).exposure == 4
    assert floor([forward, backward]).exposure == 1


def test_an_exchange_read_at_once_keeps_its_half_running():
    """A token-count read (no hand-over): the partner cannot compute behind it."""
    counts = [Segment(1, Exchange(3, switch=False)), Segment(1)]
    assert floor([counts, chain(3)]).exposure == 3
    assert floor([chain(1, 3, 1), chain(3)]).exposure == 0  # the same exchange handed over: hidden
    with pytest.raises(ValueError, match="switches halves after an exchange half 0 reads at once"):
        run_in_order([counts, chain(3)], (0, 1, 0))


@pytest.mark.parametrize("queue,expected", [(None, 1), ("fifo", 2), ("serial", 3)])
def test_exchanges_on_one_communicator_queue(queue, expected):
    """Alone each exchange flies as posted (1); on one FIFO the short one arrives no earlier than
    the long one posted before it (2); on one stream it waits for it to finish (3)."""
    a, b = chain(1, 1, 1, channel=queue and "ep"), chain(0, 3, 0, channel=queue and "ep")
    assert floor([a, b], queue or "fifo").exposure == expected


def test_schedule_places_each_segment_and_charges_the_half_that_waited():
    best = floor([chain(1, 10, 1), chain(2)])
    assert [(p.half, p.index, p.start, p.end, p.idle) for p in best.placed] == [
        (0, 0, 0, 1, 0), (1, 0, 1, 3, 0), (0, 1, 11, 12, 8)]
    assert best.makespan == 12 and best.idle_by_half() == (8, 0)


def test_normalized_merges_segments_without_exchanges_and_bounds_the_lead():
    half = [Segment(1), Segment(2, Exchange(1, lead=5)), Segment(1, Exchange(2))]
    assert normalized(half) == (Segment(3, Exchange(1, lead=3)), Segment(1, Exchange(2)), Segment(0))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="compute must be >= 0"):
        Segment(-1)
    with pytest.raises(ValueError, match="seconds and lead must be >= 0"):
        Exchange(-1)
    with pytest.raises(ValueError, match="does not run every segment"):
        run_in_order([chain(1, 1, 1), chain(1)], (0, 1))
    with pytest.raises(ValueError, match="queue must be one of"):
        floor([chain(1)], queue="lifo")
    with pytest.raises(ValueError, match="one or two halves"):
        floor([])


# -- exact: the dynamic program against every order ------------------------------------------------
def _orders(lengths: tuple[int, int]):
    n = sum(lengths)
    for firsts in itertools.combinations(range(n), lengths[0]):
        yield tuple(0 if k in firsts else 1 for k in range(n))


def _every_order_minimum(halves, queue: str) -> float:
    best = float("inf")
    lengths = tuple(len(normalized(h)) for h in halves)
    for order in _orders(lengths):
        try:
            best = min(best, run_in_order(halves, order, queue).exposure)
        except ValueError:  # a switch after an exchange read at once
            pass
    return best


def _random_half(rng: random.Random) -> list[Segment]:
    segments = []
    for _ in range(rng.randint(1, 5)):
        compute = rng.choice([0.0, rng.uniform(0, 3)])
        exchange = Exchange(rng.choice([0.0, rng.uniform(0, 6)]), lead=rng.choice([0.0, compute * rng.random()]),
                            channel=rng.choice([None, "ep", "counts"]), switch=rng.random() > 0.2)
        segments.append(Segment(compute, exchange))
    return segments + [Segment(rng.uniform(0, 3))]


@pytest.mark.parametrize("queue", ["fifo", "serial"])
def test_the_floor_is_the_least_exposure_over_every_order(queue):
    rng = random.Random(7)
    for _ in range(200):
        halves = [_random_half(rng), _random_half(rng)]
        best = floor(halves, queue)
        assert best.exposure == pytest.approx(_every_order_minimum(halves, queue), abs=1e-9), halves
        assert run_in_order(halves, best.order, queue).exposure == pytest.approx(best.exposure)
        assert best.exposure <= run_in_order(halves, relay_order(halves), queue).exposure + 1e-9


def test_the_floor_of_a_pair_of_a_dozen_segments_a_half_is_quick():
    rng = random.Random(1)
    halves = [chain(*[rng.uniform(0.5, 2) for _ in range(25)], channel="ep") for _ in range(2)]
    start = time.perf_counter()
    floor(halves)
    assert time.perf_counter() - start < 2.0


# -- the record a run leaves -----------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def at(self, t: float) -> _Clock:
        self.now = t
        return self


def test_the_recorder_cuts_each_half_at_its_exchange_waits():
    """A relayed pair as its events arrive: the forward posts at 1 and hands over; the backward
    posts at 3, runs 0.5 s of weight GEMMs (its lead), hands back; the forward waits 0.5 s, ends;
    the backward finds its exchange arrived, ends. Then a lone exchange, waited 2 s."""
    clock = _Clock()
    rec = ExposureRecorder(clock)
    assert rec.open_pair() and not rec.open_pair()  # pairs do not nest
    rec.run(0)
    clock.at(1); rec.posted(3.0); rec.switch(); rec.stop(0)
    rec.run(1)
    clock.at(3); rec.posted(1.0, channel="ep"); rec.switch()
    clock.at(3.5); rec.stop(1)
    rec.run(0); rec.waited(3.5, 4.0, late=0.125, overslept=0.125)  # its sleep woken 0.125 s late
    clock.at(5); rec.end(0)
    rec.run(1); rec.waited(5.0, 5.0)
    clock.at(7); rec.end(1)
    rec.close_pair()
    clock.at(8); rec.posted(2.0); rec.waited(8.0, 10.0, late=0.25, count_late=0.25)  # a peer's counts 0.25 s late
    step = rec.take()
    (pair,) = step.pairs
    assert pair.halves == ((Segment(1, Exchange(3.0)), Segment(1)),
                           (Segment(2.5, Exchange(1.0, lead=0.5, channel="ep")), Segment(2)))
    assert pair.order == (0, 1, 0, 1) and pair.waited_s == 0.5 and (pair.start, pair.end) == (0, 7)
    assert step.lone == (Segment(8 - 7, Exchange(2.0, switch=False)),) and step.lone_waits == ((8.0, 10.0),)
    exposure = pair_exposure(pair)
    assert (exposure.measured, exposure.late, exposure.in_order, exposure.floor, exposure.serial) == (
        0.5, 0.125, 0.5, 0.5, 4.0)
    assert step_exposure(step) == {"measured": 2.5, "late": 0.375, "overslept": 0.125, "count_late": 0.25,
                                   "floor": 2.5, "serial": 6.0, "pairs_measured": 0.5, "pairs_late": 0.125,
                                   "pairs_overslept": 0.125, "pairs_count_late": 0.0, "pairs_in_order": 0.5,
                                   "pairs_floor": 0.5, "pairs_serial": 4.0, "lone_measured": 2.0, "lone_late": 0.25,
                                   "lone_overslept": 0.0, "lone_count_late": 0.25, "lone_floor": 2.0,
                                   "lone_serial": 2.0}
    assert StepTrace.from_json(step.to_json()) == step
    assert rec.take() == StepTrace()  # the next step starts empty


class _DeviceClock:
    """A stand-in for :class:`DeviceClock`: a mark is the time it was made at, read later."""

    def __init__(self, clock: _Clock) -> None:
        self.clock, self.reads = clock, 0

    def mark(self) -> float:
        return self.clock()

    def read(self, marks: list[float]) -> list[float]:
        self.reads += 1
        return [m - marks[0] for m in marks]


def _relayed_pair_then_a_lone_exchange(rec, clock: _Clock) -> None:
    """The events of the test above, the waits timed by the recorder's own marks."""
    def waited_until(end: float, late: float = 0.0, overslept: float = 0.0, count_late: float = 0.0) -> None:
        start = rec.now()
        clock.at(end)
        rec.waited(start, rec.now(), late, overslept, count_late)

    assert rec.open_pair(kind=(0, 1)) and not rec.open_pair()
    rec.run(0)
    clock.at(1); rec.posted(3.0); rec.switch(); rec.stop(0)
    rec.run(1)
    clock.at(3); rec.posted(1.0, channel="ep"); rec.switch()
    clock.at(3.5); rec.stop(1)
    rec.run(0); waited_until(4.0, late=0.125, overslept=0.125)
    clock.at(5); rec.end(0)
    rec.run(1); waited_until(5.0)
    clock.at(7); rec.end(1)
    rec.close_pair()
    clock.at(8); rec.posted(2.0); waited_until(10.0, late=0.25, count_late=0.25)


def test_a_deferred_recorder_replays_its_marks_into_the_same_trace():
    """A GPU's recorder (its marks read once, after the step) cuts the same segments, waits and
    order as the host's recorder given the same events at the same times; its pairs are asked for
    mid-step as pair_first asks (one read each)."""
    from titan_dualpipe.exposure.record import DeferredRecorder

    clock = _Clock()
    live = ExposureRecorder(clock)
    _relayed_pair_then_a_lone_exchange(live, clock)
    expected = live.take()
    clock = _Clock()
    device_clock = _DeviceClock(clock)
    deferred = DeferredRecorder(device_clock)
    mark = deferred.closed_pairs()
    _relayed_pair_then_a_lone_exchange(deferred, clock)
    assert device_clock.reads == 0, "nothing is read while the step runs"
    (pair,) = deferred.pairs_since(mark)
    assert device_clock.reads == 1 and pair == expected.pairs[0] and pair.kind == (0, 1)
    step = deferred.take()
    assert step == expected and device_clock.reads == 2
    assert step_exposure(step)["measured"] == 2.5 and pair_exposure(pair).floor == 0.5
    clock.at(12)
    assert deferred.take() == StepTrace() == live.take()  # the next step starts empty


def test_start_recording_takes_a_gpus_clock_on_a_gpu_only():
    import torch

    from titan_dualpipe.exposure.record import DeferredRecorder

    try:
        assert type(start_recording(device=torch.device("cpu"))) is ExposureRecorder
        assert type(start_recording()) is ExposureRecorder
        if torch.cuda.is_available():
            assert type(start_recording(device=torch.device("cuda", 0))) is DeferredRecorder
    finally:
        stop_recording()


def test_a_waits_lateness_is_filed_under_the_collective_or_the_sleep():
    """The emulated network's wait: a collective that returns after the exchange's arrival is late
    by its own overrun (a peer posting late), none of it overslept, and filed apart for a count
    read; one that returns in time leaves the rest to a sleep, whose overrun is all of the
    lateness, a count read's too."""
    from titan_dualpipe.overlap.comm import CommStats

    stats = CommStats()
    steps = {}
    try:
        rec = start_recording()
        for name, count in (("peer", False), ("count", True)):
            stats.wait_until(time.perf_counter() + 0.005, lambda: time.sleep(0.03), count=count)  # 25 ms past
            steps[name] = rec.take()
        for name, count in (("slept", False), ("count slept", True)):
            arrival = time.perf_counter() + 0.02
            stats.wait_until(arrival, lambda: None, count=count)  # in time: sleeps 20 ms
            steps[name] = step = rec.take()
            (start, end), = step.lone_waits
            assert end - start >= 0.0199 and step.lone_late == pytest.approx(end - arrival, abs=1e-9), name
    finally:
        stop_recording()
    for name in ("peer", "count"):
        assert steps[name].lone_late >= 0.024 and steps[name].lone_overslept == 0.0, name
    assert steps["count"].lone_count_late == steps["count"].lone_late and steps["peer"].lone_count_late == 0.0
    for name in ("slept", "count slept"):
        step = steps[name]
        assert step.lone_late == step.lone_overslept < 0.02 and step.lone_count_late == 0.0, name


def test_the_recorder_reads_a_count_exchange_as_read_at_once():
    clock = _Clock()
    rec = ExposureRecorder(clock)
    rec.open_pair()
    rec.run(0)
    clock.at(1); rec.posted(0.5, channel="counts"); rec.waited(1.0, 1.5)  # no hand-over
    clock.at(2); rec.posted(2.0, channel="ep"); rec.switch(); rec.stop(0)
    rec.run(1); clock.at(4); rec.end(1)
    rec.run(0); rec.waited(4, 4); clock.at(5); rec.end(0)
    rec.close_pair()
    (pair,) = rec.take().pairs
    assert pair.halves[0] == (Segment(1, Exchange(0.5, channel="counts", switch=False)),
                              Segment(0.5, Exchange(2.0, channel="ep")), Segment(1))
    assert pair.order == (0, 0, 1, 0)
    assert pair_exposure(pair).floor == 0.5


def _sleeping_exchange_pair(relayed: bool) -> tuple[StepTrace, float]:
    """A pair of two halves that each post two emulated exchanges of 20 ms (ExpertParallelComm
    with no group) and compute 5 ms around them; as a relay or interleaved; its recorded step."""
    import torch

    from titan_dualpipe.overlap.comm import EmulatedNetwork, ExpertParallelComm
    from titan_dualpipe.overlap.relay import run_relayed
    from titan_dualpipe.overlap.segments import interleave, run_to_completion

    comm = ExpertParallelComm(None, EmulatedNetwork(latency_s=0.02))

    def half():
        for _ in range(2):
            time.sleep(0.005)
            yield comm.post(torch.zeros(1, 1))
        time.sleep(0.005)

    rec = start_recording()
    try:
        rec.take()
        if relayed:
            run_relayed(lambda: run_to_completion(half()), lambda: run_to_completion(half()))
        else:
            interleave(half(), half())
        return rec.take(), comm.stats.waited_s
    finally:
        stop_recording()


@pytest.mark.parametrize("relayed", [True, False], ids=["relay", "interleave"])
def test_a_run_pair_records_its_halves_segments_and_exchanges(relayed):
    step, waited = _sleeping_exchange_pair(relayed)
    (pair,) = step.pairs
    assert step.lone == ()
    for half in pair.halves:
        assert [s.exchange is not None for s in half] == [True, True, False]
        assert all(s.exchange.seconds == 0.02 and s.exchange.switch for s in half[:2])
        assert all(0.004 <= s.compute < 0.05 for s in half)
    assert pair.order == (0, 1, 0, 1, 0, 1)
    assert pair.waited_s == pytest.approx(waited)
    exposure = pair_exposure(pair)
    # each exchange flies 20 ms behind 5 ms of the partner: about 15 ms exposed each but the last
    assert exposure.floor <= exposure.in_order + 1e-9 and exposure.serial == pytest.approx(0.08)
    assert exposure.in_order == pytest.approx(exposure.measured, abs=0.02)


def test_a_forward_that_never_hands_over_records_its_backward_after_it():
    from titan_dualpipe.overlap.relay import run_relayed

    rec = start_recording()
    try:
        rec.take()
        run_relayed(lambda: time.sleep(0.002), lambda: time.sleep(0.002))
        (pair,) = rec.take().pairs
    finally:
        stop_recording()
    assert [len(h) for h in pair.halves] == [1, 1] and pair.order == (0, 1)
    assert pair_exposure(pair) == pair_exposure(PairTrace.from_json(pair.to_json()))


# -- where the floor is shown ----------------------------------------------------------------------
def test_bench_titan_sets_each_runs_exposure_next_to_its_floor_and_1f1bs():
    """The probe's per-step floors (from its step traces), the bench's median over steps of the
    mean over ranks, and the table: measured, floor and the 1F1B run's exposure side by side."""
    from titan_dualpipe.bench import titan as bench
    from titan_dualpipe.titan.bench_probe import _floors

    pair = PairTrace((tuple(chain(1, 10, 1)), tuple(chain(2))), (0, 1, 0), (((1.0, 11.0),), ()), 0.0, 12.0)
    step = StepTrace([pair], (Segment(0, Exchange(4.0)),), ((20.0, 24.0),))
    floors = _floors([StepTrace(), step])
    assert floors["pairs"] == [[], [{"measured": 10.0, "late": 0.0, "in_order": 8.0, "floor": 8.0, "serial": 10.0}]]
    assert floors["exposure"][1]["floor"] == 12.0 and floors["exposure"][1]["serial"] == 14.0
    ranks = [floors, {"exposure": [floors["exposure"][0], {**floors["exposure"][1], "measured": 16.0}]}]
    summary = bench.exposure_summary([ranks], warmup=1)
    assert summary["measured"] == 15.0 and summary["floor"] == 12.0 and summary["pairs_in_order"] == 8.0
    table = bench._floor_table({"1F1B": {"exposed_comm": 14.0, "exposure": {**summary, "measured": 14.0}},
                                "DualPipeV": {"exposed_comm": 15.0, "exposure": summary}}, 22)
    assert table[2].split()[:8] == ["schedule", "measured", "late", "slept", "counts", "floor", "1F1B", "all"]
    assert table[4].split()[:10] == ["DualPipeV", "15000", "0", "0", "0", "12000", "14000", "14000", "0.86", "1.07"]
    assert bench._floor_table({"1F1B": {"exposed_comm": 1.0}}, 22) == []  # no floor recorded (GPU runs)


def test_profile_places_the_floor_on_the_timelines_clock():
    """The recorder's clock is the timeline's plus the pairs' offset: each pair's measured waits
    and its floor's idle times land inside its F&B action; a lone exchange's floor starts with
    its wait."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    from titan_dualpipe.runtime.timeline import TimedAction
    from titan_dualpipe.sim.profile import _rank_exposure

    class _Comm:
        network = type("N", (), {"seconds": staticmethod(lambda remote_bytes: 10.0)})()

    pair = PairTrace((tuple(chain(1, 10, 1)), tuple(chain(2))), (0, 1, 0), (((103.0, 111.0),), ()), 100.0, 112.0)
    step = StepTrace([pair], (Segment(2, Exchange(4.0, lead=1.0)),), ((130.0, 134.0),))
    actions = [TimedAction(0, _Action(0, _ComputationType.OVERLAP_F_B, None), 5.0, 17.0)]
    out = _rank_exposure(step, actions, step_start=90.0, comm=_Comm())
    assert sorted(out["marks"]) == [(8.0, 16.0, "exposed"), (8.0, 16.0, "floor"), (35.0, 38.0, "floor"),
                                    (35.0, 39.0, "exposed")]
    assert out["exposure"]["floor"] == 8.0 + 3.0 and out["exchange_s"] == 10.0


def test_the_timeline_picture_draws_marks_under_each_rank(tmp_path):
    pytest.importorskip("matplotlib")
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    from titan_dualpipe.runtime.timeline import TimedAction
    from titan_dualpipe.sim.timeline import draw_timeline

    events = [TimedAction(r, _Action(r, _ComputationType.FORWARD, 0), 0.0, 1.0) for r in (0, 1)]
    path = tmp_path / "marks.png"
    draw_timeline(events, str(path), marks=[(0, 0.2, 0.4, "exposed"), (1, 0.2, 0.3, "floor")])
    assert path.stat().st_size > 0


@pytest.fixture(scope="module")
def world_of_one():
    from cases.dist_pool import one_rank_process_group

    yield from one_rank_process_group()


def test_bench_overlap_reports_each_runs_floor(world_of_one):
    """``bench overlap --pp 1 --ep 1``: every run's exposure per step next to its floor and 1F1B's
    (every exchange exposed); pairs only where pairs overlap; the floor never above the run's order."""
    from titan_dualpipe.bench import overlap as bench

    cfg = dict(pp=1, ep=1, device="cpu", rounds=1, steps=1, microbatches=4, layers=2, dim=16, seq=8, experts=4,
               comm_ratio=1.0, latency_ms=2.0, bandwidth_gbps=None, dualpipe=False, relay=True, compile=None)
    raw = bench._worker(cfg)
    exposure = raw["exposure"]
    assert set(exposure) == set(raw["step_time"])
    per_step = 2 * 2 * cfg["layers"] * cfg["microbatches"]  # exchanges, forward and backward
    for name, e in exposure.items():
        assert e["serial"] >= per_step * 0.002 - 1e-9, name  # two-batch runs may post more (one EP rank: none split)
        assert e["serial"] == pytest.approx(per_step * 0.002) or "two_batch" in name, name
        assert e["floor"] <= e["serial"] + 1e-9 and e["pairs_floor"] <= e["pairs_in_order"] + 1e-9
        assert e["measured"] == pytest.approx(raw["exposed_comm"][name], rel=1e-6, abs=1e-6)
    for name in ("sequential", "torch_dualpipev", "torch_zbv"):
        assert exposure[name]["pairs_measured"] == 0 and not raw["pairs"][name]
    assert raw["pairs"]["overlap"] and raw["pairs"]["overlap_relay"]
    # the measured two-batch runs decided in their warm-up; one EP rank has no exchanges: nothing to split
    assert raw["two_batch_savings"] == {name: {} for name in bench.TWO_BATCH_MEASURED}
    assert raw["two_batch_chosen"] == {name: [] for name in bench.TWO_BATCH_MEASURED}
    assert bench.exposure_table(exposure).splitlines()[1].split()[:7] == ["schedule", "measured", "late", "slept",
                                                                         "counts", "floor", "1F1B"]
