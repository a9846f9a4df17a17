"""torch's own schedule tests on our schedules.

torch's ``test/distributed/pipelining/test_schedule.py`` and ``test_schedule_multiproc.py``
(torch 2.15) test its schedules one scenario at a time; every test that runs
``ScheduleDualPipeV`` or is parametrized over schedule classes is re-expressed here for our
``ScheduleDualPipeV`` and, where the scenario fits it, ``ScheduleDualPipe`` (even ``pp``, an even
``n >= 2 * pp``, one stage per direction per rank). Each test carries the name of torch's, with
the same model shapes (512-wide MLP blocks, a batch of 64 or 256), the same checks (outputs,
losses, every gradient against the unpipelined model at rtol 1e-5 / atol 4e-5, eval's
gradients, CSV round trips, order validity, error cases) and our sizes where ours need others
(``n >= 2 * pp``: 8 microbatches at pp 4 where torch runs 4). What differs on purpose, and
why, is in docs/schedules.md#torchs-own-schedule-tests.

Orders, CSVs and construction checks run in this process (a gloo group of one rank for the
construction's agreement collective); training runs on the module's pool of 4 ranks
(tests/cases/torch_schedule_cases.py).
"""

from __future__ import annotations

import csv
import inspect
import os
import re
from collections import Counter

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import ScheduleDualPipeV as TorchDualPipeV
from torch.distributed.pipelining.schedules import (
    _Action,
    _add_send_recv,
    _ComputationType,
    _validate_schedule,
)

from cases import torch_schedule_cases as cases
from cases.dist_pool import one_rank_process_group, ran
from titan_dualpipe import PipelineConfigError, ScheduleDualPipe, ScheduleDualPipeV, compute_order, placement
from titan_dualpipe.orders.csv_io import load_csv
from titan_dualpipe.orders.dryrun import dry_run
from titan_dualpipe.orders.lowering import compute_actions, lower, validate_order
from titan_dualpipe.sim.schedules import torch_order

WORLD = 4  # the module's pool (tests/conftest.py)
GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
F, I, W = _ComputationType.FORWARD, _ComputationType.BACKWARD_INPUT, _ComputationType.BACKWARD_WEIGHT
UNSHARD = _ComputationType.UNSHARD
SCHEDULES = {"DualPipeV": ScheduleDualPipeV, "DualPipe": ScheduleDualPipe}

# torch's TestSchedulePlan cases: (stages per rank, microbatches, pipeline ranks)
TORCH_PLAN_CASES = [
    (2, 2, 2), (2, 4, 4), (2, 8, 2), (2, 8, 4), (2, 8, 8), (4, 4, 4), (4, 8, 4), (4, 8, 8),
    (4, 16, 4), (4, 32, 4), (4, 64, 4), (4, 16, 16), (4, 32, 32), (4, 128, 64),
    (3, 2, 2), (3, 8, 2), (3, 12, 4), (4, 6, 3), (4, 10, 5), (2, 3, 4), (2, 4, 4), (2, 10, 4), (2, 15, 4),
]


class _StandInStage(PipelineStage):
    """torch's ``MockPipelineStage``: what a schedule's constructor reads from a stage (ids, the
    group's size and this rank in it) and nothing that runs."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int = 0,
                 submod: nn.Module | None = None) -> None:  # torch's own __init__ is skipped on purpose
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank, self.group = group_size, group_rank, None
        self.submod = submod if submod is not None else nn.Linear(2, 2)
        self.device = torch.device("cpu")
        self.stage_index_to_group_rank = None
        self.p2p_per_edge = False

    def _create_grad_recv_info(self, *args, **kwargs):
        return None

    def _prepare_forward_infra(self, *args, **kwargs):
        return None

    def _prepare_backward_infra(self, *args, **kwargs):
        return None


@pytest.fixture(scope="module")
def one_rank():
    """This process as a gloo group of one rank: a schedule's construction agrees on its stages."""
    yield from one_rank_process_group()


def _stand_ins(local: int, n_stages: int, group_size: int, rank: int = 0, **kwargs) -> list[_StandInStage]:
    """Rank ``rank``'s stand-in stages where ours place them (``r`` and ``2 * pp - 1 - r``), or
    ``local`` of them (torch's cases with other than two stages per rank)."""
    ids = [rank, n_stages - 1 - rank] if local == 2 else [rank + k * group_size for k in range(local)]
    return [_StandInStage(s, n_stages, group_size, rank, **kwargs) for s in ids]


def _expected_refusal(schedule: str, local: int, n: int, pp: int) -> str:
    if local != 2:
        return "needs exactly two stages per rank"
    if schedule == "DualPipe" and n % 2:
        return "needs an even number of microbatches"
    if n < 2 * pp:
        return "needs n_microbatches >= 2 * pp_size"
    return ""


# -- test_schedule.py: TestSchedulePlan, TestScheduleCsv, ScheduleTest (one process) ---------------

@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
def test_pipeline_order_for_v_schedules(one_rank, schedule):
    """torch's cases: a rank with other than two stages is refused, as are too few microbatches
    (torch's ``ScheduleDualPipeV`` needs ``n >= num_stages``, ours the same ``n >= 2 * pp``; DualPipe
    also an even ``n``), with a ValueError (our PipelineConfigError); the others build, and their
    order passes torch's ``_validate_schedule`` (DualPipe: ours, whose stages run ``n / 2``
    microbatches each where torch's validator wants ``n``)."""
    built = 0
    for local, n, pp in TORCH_PLAN_CASES:
        stages = _stand_ins(local, local * pp, pp)
        refusal = _expected_refusal(schedule, local, n, pp)
        if refusal:
            with pytest.raises(ValueError, match=re.escape(refusal)):
                SCHEDULES[schedule](stages, n)
            continue
        sched = SCHEDULES[schedule](stages, n)
        if schedule == "DualPipeV":
            _validate_schedule(sched.pipeline_order, pp, 2 * pp, n)
        else:
            validate_order(sched.pipeline_order, placement(schedule, pp, n))
        assert sched.pipeline_order == compute_order(schedule, pp, n)
        built += 1
    assert built == (4 if schedule == "DualPipeV" else 3)


def _valid_plan_cases(schedule: str) -> list[tuple[int, int]]:
    """(pp, n) of torch's cases with two stages per rank that ``schedule`` runs."""
    return [(pp, n) for local, n, pp in TORCH_PLAN_CASES if local == 2 and not _expected_refusal(schedule, 2, n, pp)]


COMMS = {_ComputationType.SEND_F, _ComputationType.RECV_F, _ComputationType.SEND_B, _ComputationType.RECV_B}


def _comms(actions: list) -> Counter:
    return Counter(str(a) for a in actions if a is not None and a.computation_type in COMMS)


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
def test_pipeline_order(schedule):
    """torch's lower-and-simulate check on its cases: the order, lowered with its sends and
    receives (ours follow both of DualPipe's chains; receives posted early or each just before
    its use), completes in a dry run that matches messages in posting order as untagged p2p
    does. torch's ``_simulate_comms_compute`` cannot run these orders (it fails on ``OVERLAP_F_B``
    pairs); torch's ``_add_send_recv``, which assumes one chain, lowers DualPipeV's to the same
    sends and receives on every rank as ours."""
    for pp, n in _valid_plan_cases(schedule):
        order, place = compute_order(schedule, pp, n), placement(schedule, pp, n)
        for defer in (False, True):
            assert dry_run(lower(order, place, defer_recv=defer), place) > 0, (pp, n, defer)
        if schedule == "DualPipeV":
            torchs = _add_send_recv({r: list(a) for r, a in order.items()}, place.rank_of, 2 * pp)  # it consumes its input
            ours = lower(order, place)
            assert all(_comms(torchs[r]) == _comms(ours[r]) for r in range(pp)), (pp, n)


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
def test_pipeline_order_flex_and_zero_bubble(schedule):
    """The zero-bubble side of torch's cases: every split backward's W comes after its I on the
    same rank and there are as many of each, so the split leaves no weight gradient behind; every
    stage runs one forward and one backward (B, or I and W) per microbatch."""
    for pp, n in _valid_plan_cases(schedule):
        place = placement(schedule, pp, n)
        for rank, actions in compute_order(schedule, pp, n).items():
            leaves = compute_actions(actions)
            seen_i: set = set()
            for a in leaves:
                key = (a.stage_index, a.microbatch_index)
                if a.computation_type == I:
                    seen_i.add(key)
                elif a.computation_type == W:
                    assert key in seen_i, f"pp={pp} n={n} rank {rank}: {a} before its I"
            counts = Counter((a.stage_index, a.computation_type) for a in leaves)
            for s in place.stages_of(rank):
                mbs = len(place.microbatches(s))
                assert counts[(s, I)] == counts[(s, W)] and counts[(s, F)] == mbs, (pp, n, s, counts)
                assert counts[(s, _ComputationType.FULL_BACKWARD)] + counts[(s, I)] == mbs, (pp, n, s, counts)


def _read_csv(path: str) -> dict[int, list[_Action]]:
    with open(path, newline="") as f:
        return {rank: [_Action.from_str(cell) for cell in row if cell.strip()] for rank, row in enumerate(csv.reader(f))}


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
def test_csv_compare(one_rank, tmp_path, schedule):
    """torch's regression CSV of its ``ScheduleDualPipeV`` (4 ranks, 10 microbatches): ours gives
    the same order as torch's class, computed here from torch's own code rather than read from
    its file; DualPipe (4 ranks, 10 microbatches) the order recorded from DeepSeek's reference
    (``tests/golden``). The order round-trips through torch's CSV format: ``_dump_csv`` rows parse
    back with ``_Action.from_str``, and ``_load_csv`` into a second schedule lowers to the same
    compute+comms order."""
    pp, n = 4, 10
    sched = SCHEDULES[schedule](_stand_ins(2, 2 * pp, pp), n)
    if schedule == "DualPipeV":
        assert sched.pipeline_order == torch_order("torch:DualPipeV", pp, n)
    else:
        assert sched.pipeline_order == load_csv(os.path.join(GOLDEN, f"dualpipe_pp{pp}_n{n}.csv"))
    path = str(tmp_path / "order.csv")
    sched._dump_csv(path, "compute_only")
    assert _read_csv(path) == sched.pipeline_order
    loaded = SCHEDULES[schedule](_stand_ins(2, 2 * pp, pp), n)
    loaded._load_csv(path)
    assert loaded.pipeline_order == sched.pipeline_order
    assert loaded.pipeline_order_with_comms == sched.pipeline_order_with_comms


def _activation_intervals(actions: list, stages: tuple[int, ...]) -> dict[tuple[int, int], tuple[int, int]]:
    """(stage, microbatch) -> (position of its forward, position of the action releasing its
    activations: B, or W of a split backward), pairs' sub-actions at the pair's position."""
    starts: dict = {}
    ends: dict = {}
    for position, action in enumerate(a for a in actions if a is not None):
        for leaf in action.sub_actions or (action,):
            if leaf.stage_index not in stages or leaf.microbatch_index is None:
                continue
            key = (leaf.stage_index, leaf.microbatch_index)
            if leaf.computation_type == F:
                starts[key] = position
            elif leaf.computation_type in (_ComputationType.FULL_BACKWARD, W):
                ends[key] = position
    return {key: (starts[key], ends[key]) for key in starts}


def _peak_overlap(intervals) -> int:
    events = sorted(e for start, end in intervals for e in ((start, 1), (end + 1, -1)))
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def test_pipeline_activation_liveness_with_dual_pipe_v(one_rank):
    """torch 2.15's ``analyze_pipeline_activation_liveness`` on our DualPipeV (2 ranks, 4
    microbatches): per rank, as many slots as activations live at once (forward to its B or W,
    derived here independently), a slot and the same lifetime for every (stage, microbatch), and
    different slots for lifetimes that overlap."""
    analyze = getattr(torch.distributed.pipelining, "analyze_pipeline_activation_liveness", None)
    if analyze is None:
        pytest.skip(f"torch {torch.__version__} has no activation-liveness analyzer (2.15 adds it)")
    pp, n = 2, 4
    sched = ScheduleDualPipeV(_stand_ins(2, 2 * pp, pp), n)
    for rank in range(pp):
        stages = placement("DualPipeV", pp, n).stages_of(rank)
        plan = analyze(sched, pp_rank=rank, stage_indices=stages, granularity="stage_microbatch")
        intervals = _activation_intervals(sched.pipeline_order_with_comms[rank], stages)
        assert set(plan.slot_by_stage_and_microbatch) == {(s, mb) for s in stages for mb in range(n)}
        assert plan.num_slots == _peak_overlap(intervals.values())
        for key, lifetime in intervals.items():
            assert plan.get_activation_lifetime(*key) == lifetime, key
        items = list(intervals.items())
        for k, (a, (a0, a1)) in enumerate(items):
            for b, (b0, b1) in items[k + 1:]:
                if a0 <= b1 and b0 <= a1:
                    assert plan.slot_for(*a) != plan.slot_for(*b), (a, b)


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
def test_zero_bubble_schedule_errors_with_compile(one_rank, schedule):
    """torch's zero-bubble schedules (its ``ScheduleDualPipeV`` too) raise for a stage holding a
    ``torch.compile``'d module; ours take it (its backward runs whole at I, docs/compile.md), so
    this checks the opposite: the schedule builds and runs both compiled stages whole. A rank with
    one stage only, as torch's test passes, is refused by ours anyway (a PipelineConfigError is a
    RuntimeError, what torch's test expects, for another reason)."""
    pp = 2 if schedule == "DualPipe" else 1
    model = torch.compile(cases.MLPChain(8, 2))
    stages = _stand_ins(2, 2 * pp, pp, submod=model)
    sched = SCHEDULES[schedule](stages, 2 * pp)
    assert sched.weight_policy.whole_stages == {s.stage_index for s in stages}
    with pytest.raises(RuntimeError, match="needs exactly two stages per rank"):
        SCHEDULES[schedule](stages[:1], 2 * pp)
    if schedule == "DualPipeV":
        with pytest.raises(RuntimeError, match="schedule is not supported with"):
            TorchDualPipeV(_stand_ins(2, 2, 1, submod=model), 2)


def _unshards(sched, rank: int) -> list[tuple[int, int]]:
    """(stage, position) of each UNSHARD in ``rank``'s compute+comms order."""
    actions = [a for a in sched.pipeline_order_with_comms[rank] if a is not None]
    return [(a.stage_index, k) for k, a in enumerate(actions) if a.computation_type == UNSHARD]


def _first_compute(sched, rank: int, stage: int) -> int:
    actions = [a for a in sched.pipeline_order_with_comms[rank] if a is not None]
    return next(k for k, a in enumerate(actions) for leaf in (a.sub_actions or (a,))
                if leaf.stage_index == stage and leaf.is_compute_op)


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
def test_max_active_stages_is_used_for_lowering(one_rank, schedule):
    """torch's test lowers a 4-stage-per-rank schedule with ``max_active_stages`` 3 and 4 and counts
    a stage's UNSHARDs. Ours hold two stages per rank, which a pair computes on at once: with the
    default (3) and with 2 each stage is unsharded once, before its first compute; 1 is refused.
    ``unshard_lookahead=1`` per rank (torch 2.15) issues a rank's second UNSHARD only after its
    first stage's first compute; an older torch refuses it, naming 2.15."""
    pp, n = 4, 16
    for limit in (3, 2):
        sched = SCHEDULES[schedule](_stand_ins(2, 2 * pp, pp, rank=pp - 1), n, max_active_stages=limit)
        for rank in range(pp):
            unshards = _unshards(sched, rank)
            assert sorted(s for s, _ in unshards) == sorted(placement(schedule, pp, n).stages_of(rank)), unshards
            assert all(k < _first_compute(sched, rank, s) for s, k in unshards), unshards
    with pytest.raises(PipelineConfigError, match="max_active_stages=1"):
        SCHEDULES[schedule](_stand_ins(2, 2 * pp, pp), n, max_active_stages=1)
    stages = _stand_ins(2, 2 * pp, pp)
    try:
        sched = SCHEDULES[schedule](stages, n, max_active_stages=2, unshard_lookahead=(1,) * pp)
    except PipelineConfigError as err:
        assert "needs torch 2.15 or later" in str(err), err
        assert "unshard_lookahead" not in inspect.signature(TorchDualPipeV.__init__).parameters
        return
    for rank in range(pp):
        (first, _), (_, at_second) = sorted(_unshards(sched, rank), key=lambda u: u[1])
        assert at_second > _first_compute(sched, rank, first), _unshards(sched, rank)


# -- test_schedule.py on one rank (torch: one stage; ours: a V of two stages, pp = 1) -------------

def test_schedule_with_single_stage(pool):
    r = ran(pool.run(cases.single_rank_training))
    assert r == [{**r[0], "outputs": 256, "losses": 2, "grads": 8}], r


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 1, 2), ("DualPipe", 2, 4)])
def test_schedule_with_pre_split_inputs(pool, schedule, pp, n):
    r = ran(pool.run(cases.pre_split_inputs, schedule=schedule, pp=pp, n=n))
    assert len(r) == pp and all(x["grads"] == 4 for x in r), r
    assert sum(x["losses"] for x in r) == n * (2 if schedule == "DualPipe" else 1), r


def test_schedule_eval_then_train(pool):
    r = ran(pool.run(cases.eval_then_train))
    assert r == [{"grads": 8, "losses": 2}], r


# -- test_schedule_multiproc.py: ScheduleTest (4 ranks) ---------------------------------------------

BOTH = [("DualPipeV", 4, 8), ("DualPipe", 4, 8)]  # torch runs 4 microbatches on 4 ranks: ours need 2 * pp


def test_forward_only(pool):
    r = ran(pool.run(cases.forward_only))
    assert [x["outputs"] for x in r] == [cases.BATCH, 0, 0, 0], r


@pytest.mark.parametrize("schedule,pp,n", BOTH)
def test_eval_inference_mode(pool, schedule, pp, n):
    r = ran(pool.run(cases.eval_inference_mode, schedule=schedule, pp=pp, n=n))
    assert sum(x["losses"] for x in r) == n * (2 if schedule == "DualPipe" else 1), r
    assert sum(x["outputs"] for x in r) == cases.BATCH, r


@pytest.mark.parametrize("schedule,pp,n", BOTH)
def test_return_output(pool, schedule, pp, n):
    r = ran(pool.run(cases.return_output, schedule=schedule, pp=pp, n=n))
    assert [x["holds_last"] for x in r] == [placement(schedule, pp, n).feeds_batch(k) for k in range(pp)], r


@pytest.mark.parametrize("schedule,pp,n", BOTH)
def test_multi_iter(pool, schedule, pp, n):
    r = ran(pool.run(cases.multi_iter, schedule=schedule, pp=pp, n=n))
    assert all(x["steps"] == 20 for x in r), r


def _trained(results: list, n: int, schedule: str) -> None:
    """Every rank checked all its gradients; the ranks with a last stage, every output row and all
    ``n`` losses."""
    assert all(x["grads"] > 0 for x in results), results
    assert sum(x["outputs"] for x in results) == cases.BATCH, results
    assert sum(x["losses"] for x in results) == n * (2 if schedule == "DualPipe" else 1), results


def test_grad_with_tracer(pool):
    _trained(ran(pool.run(cases.grad_with_tracer, pp=4, n=8)), 8, "DualPipeV")


@pytest.mark.parametrize("shape_inference", [True, False])
@pytest.mark.parametrize("schedule,pp,n", BOTH)
def test_grad_with_manual(pool, schedule, pp, n, shape_inference):
    _trained(ran(pool.run(cases.grad_with_manual, schedule=schedule, pp=pp, n=n, shape_inference=shape_inference)),
             n, schedule)


@pytest.mark.parametrize("schedule,pp,n", BOTH)
def test_grad_with_manual_interleaved(pool, schedule, pp, n):
    _trained(ran(pool.run(cases.grad_with_manual_interleaved, schedule=schedule, pp=pp, n=n)), n, schedule)


@pytest.mark.parametrize("schedule,pp,n", BOTH)
def test_schedule_with_weight_update_mlp_e2e(pool, schedule, pp, n):
    _trained(ran(pool.run(cases.weight_update_mlp_e2e, schedule=schedule, pp=pp, n=n)), n, schedule)


@pytest.mark.parametrize("schedule,pp,n", BOTH)
def test_v_shape_schedules(pool, schedule, pp, n):
    _trained(ran(pool.run(cases.v_shape_schedules, schedule=schedule, pp=pp, n=n)), n, schedule)


def test_custom_function_callback(pool):
    r = ran(pool.run(cases.custom_function_callback, pp=4, n=8))
    _trained(r, 8, "DualPipeV")


@pytest.mark.parametrize("schedule,pp,n", BOTH)
def test_zero_bubble_with_model_kwargs(pool, schedule, pp, n):
    _trained(ran(pool.run(cases.zero_bubble_with_model_kwargs, schedule=schedule, pp=pp, n=n)), n, schedule)


# -- test_schedule_multiproc.py: CustomSchedulesTest (2 ranks) ---------------------------------------

@pytest.mark.parametrize("layout", ["v_shaped", "unbalanced"])
def test_non_symmetric_stage_ids(pool, layout):
    r = ran(pool.run(cases.non_symmetric_stage_ids, layout=layout))
    if layout == "unbalanced":
        assert len(r) == 2 and len({x["refused"] for x in r}) == 1, r
        assert "needs exactly two stages per rank, got 3" in r[0]["refused"], r
        assert "needs stages [1, 2] with num_stages=4" in r[0]["refused"], r
    else:
        _trained(r, 4, "DualPipeV")


def test_pipeline_schedule_runtime_custom_sched(pool):
    _trained(ran(pool.run(cases.runtime_custom_sched)), 4, "DualPipeV")


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
def test_schedule_with_native_zero_bubble(pool, schedule):
    r = ran(pool.run(cases.native_zero_bubble, schedule=schedule, pp=2, n=4))
    assert sum(x["weight_actions"] for x in r) > 0, r
    assert not [x["mismatch"] for x in r if x["mismatch"]], r
    assert all(x["grads"] == 8 for x in r), r
