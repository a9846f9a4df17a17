"""Which half of a relayed pair runs first (``pair_first``): the choice from recorded segments, and
the option's checks. The pipeline runs: tests/test_overlap.py::test_which_half_runs_first_changes_no_bit."""

from __future__ import annotations

import random

import pytest
import torch

from titan_dualpipe import ScheduleDualPipeV
from titan_dualpipe.exposure.floor import Exchange, Segment, floor, hand_over_plan, relay_order
from titan_dualpipe.exposure.record import PairTrace
from titan_dualpipe.overlap.pair_first import (
    FORWARD_BACKWARD, TWO_BACKWARDS, TWO_FORWARDS, PairFirst, _segment_sums, _shape_sums, agreed_lengths,
    kind_of_slot, kind_order, mean_halves, shapes_by_kind, slot_of_kind,
)
from titan_dualpipe.overlap.relay import BACKWARD, FORWARD
from titan_dualpipe.runtime.errors import PipelineConfigError
from titan_dualpipe.runtime.pairs import pair_first_problem


def _pair(forward: list[Segment], backward: list[Segment], kind: tuple[int, int, int] | None,
          offers: tuple[int, int] | None = None) -> PairTrace:
    if offers is None:  # a hand-over at every exchange of its half
        offers = tuple(sum(s.exchange is not None for s in half) for half in (forward, backward))
    return PairTrace((tuple(forward), tuple(backward)), (), ((), ()), 0.0, 1.0, kind=kind, offers=offers)


# The forward computes 1 s before its exchange (1 s), the backward 0.2 s before its own (1 s).
# Forward first: F 0-1 (its exchange arrives at 2), B 1-1.2 (arrives at 2.2), F idles 0.8 s then
# computes 2-2.1, B idles 0.1 s then computes 2.2-3.2: 0.9 s exposed. Backward first: B 0-0.2
# (arrives at 1.2), F 0.2-1.2 (arrives at 2.2), B 1.2-2.2, F 2.2-2.3: nothing exposed.
LONG_FORWARD = [Segment(1.0, Exchange(1.0)), Segment(0.1)]
SHORT_BACKWARD = [Segment(0.2, Exchange(1.0)), Segment(1.0)]
# No alternation reaches this pair's floor: the backward posts its long exchange first, then the
# forward runs all three segments, waiting for its own short exchanges. Best: B 0-1 (arrives at 4),
# F 1-1.1 (arrives 1.6), idle 0.5, F 1.6-1.7 (arrives 2.2), idle 0.5, F 2.2-2.3, idle 1.7, B 4-4.1:
# 2.7 s exposed. Alternating from the forward exposes 2.9 (B's exchange is posted 0.1 s later and
# then waited in full), from the backward 3.4.
TWO_SHORT = [Segment(0.1, Exchange(0.5)), Segment(0.1, Exchange(0.5)), Segment(0.1)]
ONE_LONG = [Segment(1.0, Exchange(3.0)), Segment(0.1)]


def test_a_kind_starts_with_the_backward_where_it_saves():
    order = kind_order([LONG_FORWARD, SHORT_BACKWARD], offers=(1, 1))
    assert order.first == BACKWARD and order.saved == pytest.approx(0.9)
    assert order.plan == ((True,), (True,))  # an alternation: every hand-over switches
    mirrored = kind_order([SHORT_BACKWARD, LONG_FORWARD], offers=(1, 1))
    assert mirrored.first == FORWARD and mirrored.saved == pytest.approx(0.0)


def test_a_kind_keeps_a_half_running_where_the_floor_does():
    order = kind_order([TWO_SHORT, ONE_LONG], offers=(2, 1))
    assert order.first == BACKWARD and order.plan == ((False, False), (True,))
    assert order.saved == pytest.approx(0.2)
    assert relay_order([TWO_SHORT, ONE_LONG], order.first, order.plan) == (1, 0, 0, 0, 1)


def test_a_half_that_offers_more_hand_overs_than_it_posts_exchanges_alternates():
    """Chunked exchanges hand over at waits the record has no exchange for: the plan would count
    the wrong hand-overs, so the kind alternates, from the half that exposes less."""
    order = kind_order([LONG_FORWARD, SHORT_BACKWARD], offers=(2, 1))
    assert order.plan is None and order.first == BACKWARD and order.saved == pytest.approx(0.9)


def test_a_relay_following_the_plan_runs_the_floors_order():
    random.seed(0)

    def half(exchanges: int) -> list[Segment]:
        return ([Segment(random.uniform(0.1, 2), Exchange(random.uniform(0.1, 2), 0.0, "ep"))
                 for _ in range(exchanges)] + [Segment(random.uniform(0, 1))])

    alternations = 0
    for _ in range(200):
        halves = [half(random.randint(1, 4)), half(random.randint(1, 4))]
        best = floor(halves)
        first, plan = hand_over_plan(halves, best.order)
        assert relay_order(halves, first, plan) == best.order
        alternations += best.order in (relay_order(halves, FORWARD), relay_order(halves, BACKWARD))
    assert 0 < alternations < 200  # both kinds of floor were met


def _agreed(ranks: list[list[PairTrace]], num_stages: int = 4) -> dict:
    """What "measured" decides from each rank's pairs, the all-reduces summed by hand."""
    local = [shapes_by_kind(pairs) for pairs in ranks]
    lengths = agreed_lengths(sum(_shape_sums(lo, num_stages) for lo in local))
    sums = sum(_segment_sums(lo, lengths, num_stages) for lo in local)
    out = {}
    for k, n in enumerate(lengths):
        halves = None if n is None else mean_halves(sums[k], n)
        if halves is not None:
            out[kind_of_slot(k, num_stages)] = (halves, kind_order(halves, offers=n[3:]))
    return out


def test_ranks_agree_on_each_kinds_mean_segments():
    fb, lone = (0, 3, FORWARD_BACKWARD), (0, 3, TWO_BACKWARDS)  # the same stages, but one holds two backwards
    slow = [Segment(1.2, Exchange(1.0)), Segment(0.1)]
    ranks = [[_pair(LONG_FORWARD, SHORT_BACKWARD, fb), _pair(LONG_FORWARD, SHORT_BACKWARD, fb),
              _pair(LONG_FORWARD, SHORT_BACKWARD, None), _pair(LONG_FORWARD, [], (1, 2, FORWARD_BACKWARD))],
             [_pair(slow, SHORT_BACKWARD, fb), _pair(SHORT_BACKWARD, LONG_FORWARD, lone)],
             [_pair(TWO_SHORT, ONE_LONG, (1, 2, FORWARD_BACKWARD))]]
    agreed = _agreed(ranks)
    # no kind from a pair without one, or with a half that never ran
    assert set(agreed) == {fb, lone, (1, 2, FORWARD_BACKWARD)}
    halves, order = agreed[fb]
    # rank 0's pairs average to LONG_FORWARD, rank 1's is slower: the mean of the two ranks
    assert halves[0][0].compute == pytest.approx(1.1) and halves[0][0].exchange.seconds == pytest.approx(1.0)
    assert halves[1] == tuple(SHORT_BACKWARD) and order.first == BACKWARD
    assert tuple(agreed[lone][0]) == (tuple(SHORT_BACKWARD), tuple(LONG_FORWARD)) and agreed[lone][1].first == FORWARD
    assert agreed[(1, 2, FORWARD_BACKWARD)][1].plan == ((False, False), (True,))


def test_every_kind_has_its_own_row():
    kinds = [(f, s, holds) for holds in (FORWARD_BACKWARD, TWO_FORWARDS, TWO_BACKWARDS)
             for f in range(4) for s in range(4)]
    assert sorted(slot_of_kind(k, 4) for k in kinds) == list(range(len(kinds)))
    assert all(kind_of_slot(slot_of_kind(k, 4), 4) == k for k in kinds)


FB = (0, 3, FORWARD_BACKWARD)


def test_a_kind_whose_ranks_differ_in_shape_keeps_the_forward_first():
    longer = [Segment(0.5, Exchange(1.0)), *LONG_FORWARD]
    other_channel = [Segment(1.0, Exchange(1.0, channel="counts")), Segment(0.1)]
    assert _agreed([[_pair(LONG_FORWARD, SHORT_BACKWARD, FB)], [_pair(longer, SHORT_BACKWARD, FB)]]) == {}
    assert _agreed([[_pair(LONG_FORWARD, SHORT_BACKWARD, FB)],
                    [_pair(other_channel, SHORT_BACKWARD, FB)]]) == {}
    assert _agreed([[_pair(LONG_FORWARD, SHORT_BACKWARD, FB)],
                    [_pair(LONG_FORWARD, SHORT_BACKWARD, FB, offers=(2, 1))]]) == {}


def test_a_pair_without_exchanges_runs_as_it_would():
    order = kind_order([[Segment(1.0)], [Segment(2.0)]], offers=(0, 0))
    assert order.first == FORWARD and order.saved == 0.0


@pytest.mark.parametrize("value,overlap,message", [
    ("sideways", True, "pair_first must be one of 'forward', 'backward', 'measured'"),
    (True, True, "got True"),
    ("measured", False, "pair_first='measured' needs overlap=True"),
    ("backward", False, "pass overlap=True, or pair_first='forward'"),
])
def test_a_bad_pair_first_is_named(value, overlap, message):
    assert message in pair_first_problem(value, overlap)


def test_forward_first_needs_nothing():
    assert pair_first_problem("forward", False) == "" and pair_first_problem("measured", True) == ""


def test_the_schedule_refuses_a_bad_pair_first_before_any_collective():
    with pytest.raises(PipelineConfigError, match="pair_first must be one of"):
        ScheduleDualPipeV([], 4, pair_first="sideways")  # no stages, no process group: checked first


def test_fixed_modes_and_measured_before_it_decides():
    from titan_dualpipe._compat.pipelining import _Action, _ComputationType

    forward = _Action(0, _ComputationType.FORWARD, 2)
    backward = _Action(3, _ComputationType.FULL_BACKWARD, 0)
    cpu = torch.device("cpu")
    assert PairFirst("forward", 4, cpu).first(forward, backward) == FORWARD
    assert PairFirst("backward", 4, cpu).first(forward, backward) == BACKWARD
    measured = PairFirst("measured", 4, cpu)
    with measured.step():  # the first step measures nothing: no recorder, no collective
        pass
    assert measured.first(forward, backward) == FORWARD and measured.savings is None
    assert PairFirst.kind(forward, backward) == (0, 3, FORWARD_BACKWARD)


def test_a_lone_pair_is_its_own_kind_and_starts_with_its_first_action_unless_measured():
    from titan_dualpipe._compat.pipelining import _Action, _ComputationType as C

    forwards = (_Action(0, C.FORWARD, 3), _Action(3, C.FORWARD, 0))
    backwards = (_Action(2, C.BACKWARD_INPUT, 1), _Action(1, C.FULL_BACKWARD, 0))
    assert PairFirst.kind(*forwards) == (0, 3, TWO_FORWARDS)
    assert PairFirst.kind(*backwards) == (2, 1, TWO_BACKWARDS)
    cpu = torch.device("cpu")
    assert PairFirst("backward", 4, cpu).first(*forwards) == FORWARD  # "backward" names a forward-backward pair's half
    measured = PairFirst("measured", 4, cpu)
    measured.orders = {(0, 3, TWO_FORWARDS): kind_order([SHORT_BACKWARD, LONG_FORWARD], offers=(1, 1)),
                       (2, 1, TWO_BACKWARDS): kind_order([LONG_FORWARD, SHORT_BACKWARD], offers=(1, 1))}
    assert measured.first(*forwards) == FORWARD and measured.first(*backwards) == BACKWARD
    assert measured.plan(*backwards) == ((True,), (True,))


def test_measured_records_its_second_step_once_and_a_failed_one_again(monkeypatch):
    """The measured step records with a recorder of its own (none is left behind) and decides after
    it, through the all-reduces (here a stand-in); a step that raised decides nothing, and the next
    one is measured instead."""
    from titan_dualpipe.exposure import record as record_module
    from titan_dualpipe.overlap import pair_first

    reduced: list = []
    monkeypatch.setattr(pair_first.dist, "all_reduce", lambda tensor: reduced.append(tensor.clone()))
    order = pair_first.PairFirst("measured", 2, torch.device("cpu"))
    seen: list = []
    with order.step():  # the first step: not measured
        seen.append(record_module.recorder())
    with pytest.raises(KeyError):
        with order.step():
            seen.append(record_module.recorder())
            raise KeyError("this step failed")
    assert record_module.recorder() is None and order.savings is None and not reduced
    with order.step():
        seen.append(record_module.recorder())
    assert seen[0] is None and seen[1] is not None and seen[2] is not None
    # nothing recorded: the counts' all-reduce says so to every rank, and the segments' is skipped
    assert record_module.recorder() is None and order.savings == {} and len(reduced) == 1
    with order.step():  # decided: nothing more is recorded or reduced
        seen.append(record_module.recorder())
    assert seen[3] is None and len(reduced) == 1
