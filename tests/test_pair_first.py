"""Which half of a relayed pair runs first (``pair_first``): the choice from recorded segments, and
the option's checks. The pipeline runs: tests/test_overlap.py::test_which_half_runs_first_changes_no_bit."""

from __future__ import annotations

import pytest
import torch

from titan_dualpipe import ScheduleDualPipeV
from titan_dualpipe.exposure.floor import Exchange, Segment
from titan_dualpipe.exposure.record import PairTrace
from titan_dualpipe.overlap.pair_first import backward_first_saves, savings_by_kind
from titan_dualpipe.runtime.errors import PipelineConfigError
from titan_dualpipe.runtime.pairs import pair_first_problem


def _pair(forward: list[Segment], backward: list[Segment], kind: tuple[int, int] | None) -> PairTrace:
    return PairTrace((tuple(forward), tuple(backward)), (), ((), ()), 0.0, 1.0, kind=kind)


# The forward computes 1 s before its exchange (1 s), the backward 0.2 s before its own (1 s).
# Forward first: F 0-1 (its exchange arrives at 2), B 1-1.2 (arrives at 2.2), F idles 0.8 s then
# computes 2-2.1, B idles 0.1 s then computes 2.2-3.2: 0.9 s exposed. Backward first: B 0-0.2
# (arrives at 1.2), F 0.2-1.2 (arrives at 2.2), B 1.2-2.2, F 2.2-2.3: nothing exposed.
LONG_FORWARD = [Segment(1.0, Exchange(1.0)), Segment(0.1)]
SHORT_BACKWARD = [Segment(0.2, Exchange(1.0)), Segment(1.0)]


def test_starting_with_the_backward_saves_what_the_floors_model_says():
    assert backward_first_saves(_pair(LONG_FORWARD, SHORT_BACKWARD, (0, 3))) == pytest.approx(0.9)
    # the mirror image: starting with the backward costs as much
    assert backward_first_saves(_pair(SHORT_BACKWARD, LONG_FORWARD, (0, 3))) == pytest.approx(-0.9)


def test_savings_are_summed_per_kind_and_skip_what_has_no_kind_or_a_lone_half():
    pairs = [_pair(LONG_FORWARD, SHORT_BACKWARD, (0, 3)), _pair(LONG_FORWARD, SHORT_BACKWARD, (0, 3)),
             _pair(SHORT_BACKWARD, LONG_FORWARD, (3, 0)), _pair(LONG_FORWARD, SHORT_BACKWARD, None),
             _pair(LONG_FORWARD, [], (1, 2))]
    saved = savings_by_kind(pairs, num_stages=4)
    want = torch.zeros(16, dtype=torch.float64)
    want[0 * 4 + 3], want[3 * 4 + 0] = 1.8, -0.9
    torch.testing.assert_close(saved, want)


def test_a_pair_without_exchanges_saves_nothing_either_way():
    assert backward_first_saves(_pair([Segment(1.0)], [Segment(2.0)], (0, 1))) == 0.0


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
    from titan_dualpipe.overlap.pair_first import PairFirst
    from titan_dualpipe.overlap.relay import BACKWARD, FORWARD

    forward = _Action(0, _ComputationType.FORWARD, 2)
    backward = _Action(3, _ComputationType.FULL_BACKWARD, 0)
    cpu = torch.device("cpu")
    assert PairFirst("forward", 4, cpu).first(forward, backward) == FORWARD
    assert PairFirst("backward", 4, cpu).first(forward, backward) == BACKWARD
    measured = PairFirst("measured", 4, cpu)
    with measured.step():  # the first step measures nothing: no recorder, no collective
        pass
    assert measured.first(forward, backward) == FORWARD and measured.savings is None
    assert PairFirst.kind(forward, backward) == (0, 3)


def test_measured_records_its_second_step_once_and_a_failed_one_again(monkeypatch):
    """The measured step records with a recorder of its own (none is left behind) and decides after
    it, through one all-reduce (here a stand-in); a step that raised decides nothing, and the next
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
    assert record_module.recorder() is None and order.savings == {} and len(reduced) == 1
    with order.step():  # decided: nothing more is recorded or reduced
        seen.append(record_module.recorder())
    assert seen[3] is None and len(reduced) == 1
