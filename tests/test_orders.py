"""Pure compute orders: validation, lowering, dry runs, goldens, CSV and the CLI (no process group)."""

from __future__ import annotations

import io
import os
from collections import Counter

import pytest

from titan_dualpipe import compute_order, placement
from titan_dualpipe._compat.pipelining import B, F, I, OVERLAP_F_B, W, _Action, _format_pipeline_order
from titan_dualpipe.cli import main as cli_main
from titan_dualpipe.orders.csv_io import load_csv, read_csv, write_csv
from titan_dualpipe.orders.dryrun import dry_run
from titan_dualpipe.orders.lowering import compute_actions, insert_send_recv, lower, validate_order
from titan_dualpipe.sim.schedules import torch_order

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
GRID = [("DualPipeV", pp, n) for pp in range(1, 9) for n in range(2 * pp, 2 * pp + 7)] + [
    ("DualPipe", pp, n) for pp in (2, 4, 6, 8) for n in range(2 * pp, 2 * pp + 7, 2)
]


def _explain(order) -> str:
    return "\n" + _format_pipeline_order(order)


@pytest.mark.parametrize("schedule,pp,n", GRID)
def test_order_validates_lowers_and_runs(schedule, pp, n):
    order = compute_order(schedule, pp, n)
    place = placement(schedule, pp, n)
    validate_order(order, place)
    for defer in (False, True):
        assert dry_run(lower(order, place, defer_recv=defer), place) > 0, _explain(order)
    for stage in range(place.num_stages):
        rank = place.rank_of(stage)
        leaves = [a for a in compute_actions(order[rank]) if a.stage_index == stage]
        counts = Counter(a.computation_type for a in leaves)
        per_stage = len(place.microbatches(stage))
        assert counts[F] == per_stage and counts[B] + counts[I] == per_stage and counts[W] == counts[I], _explain(order)
        forwards = [a.microbatch_index for a in leaves if a.computation_type == F]
        backwards = [a.microbatch_index for a in leaves if a.computation_type in (B, I)]
        assert forwards == backwards == list(place.microbatches(stage)), f"stage {stage} not FIFO" + _explain(order)
    for rank, actions in order.items():
        inputs = [a for a in compute_actions(actions) if a.computation_type == I]
        weights = [a for a in compute_actions(actions) if a.computation_type == W]
        assert [(a.stage_index, a.microbatch_index) for a in weights] == [
            (a.stage_index, a.microbatch_index) for a in inputs], f"rank {rank}: W order != I order" + _explain(order)


@pytest.mark.parametrize("path", sorted(p for p in os.listdir(GOLDEN) if p.endswith(".csv")))
def test_golden_reference_orders(path):
    schedule, pp, n = path[:-4].split("_")
    name = {"dualpipe": "DualPipe", "dualpipev": "DualPipeV"}[schedule]
    golden = load_csv(os.path.join(GOLDEN, path))
    ours = compute_order(name, int(pp[2:]), int(n[1:]))
    assert ours == golden, f"{path}: ours" + _explain(ours) + "golden" + _explain(golden)


@pytest.mark.parametrize("pp", range(1, 9))
def test_dualpipev_equals_torch_order(pp):
    for n in range(2 * pp, 2 * pp + 7):
        assert compute_order("DualPipeV", pp, n) == torch_order("torch:DualPipeV", pp, n)


@pytest.mark.parametrize("pp,n", [(2, 4), (2, 7), (4, 8), (4, 11), (8, 16)])
def test_dualpipe_first_half_is_dualpipev(pp, n):
    """DualPipe on 2P ranks with 2M microbatches runs on ranks 0..P-1 exactly DualPipeV(P, M),
    with V stage 2P-1-r renamed to DualPipe's direction-1 stage 4P-1-r, its microbatch m to M+m."""
    v, dual = compute_order("DualPipeV", pp, n), compute_order("DualPipe", 2 * pp, 2 * n)

    def rename(a: _Action) -> _Action:
        if a.sub_actions:
            return a._replace(sub_actions=tuple(map(rename, a.sub_actions)))
        if a.stage_index < pp:
            return a
        return _Action(a.stage_index + 2 * pp, a.computation_type, a.microbatch_index + n)

    for rank in range(pp):
        assert [rename(a) for a in v[rank]] == dual[rank]


def test_lowering_matches_torch_for_a_single_chain():
    from titan_dualpipe._compat.pipelining import _add_reduce_grad, _add_send_recv, _add_unshard_reshard

    for pp in range(1, 6):
        for n in (2 * pp, 2 * pp + 3):
            place = placement("DualPipeV", pp, n)
            order = compute_order("DualPipeV", pp, n)
            per_rank = {r: _add_reduce_grad(_add_unshard_reshard(list(a)), n) for r, a in order.items()}
            theirs = _add_send_recv({r: list(a) for r, a in per_rank.items()}, place.rank_of, place.num_stages)
            assert insert_send_recv(per_rank, place) == theirs


def test_dry_run_reports_deadlock_with_stuck_actions():
    place = placement("DualPipeV", 2, 4)
    order = compute_order("DualPipeV", 2, 4)
    lowered = lower(order, place)
    lowered[1] = [a for a in lowered[1] if a.computation_type.name != "SEND_F"]  # rank 1 never sends forward
    with pytest.raises(ValueError, match="deadlock: every rank waits; next actions"):
        dry_run(lowered, place)


def test_invalid_order_is_reported_with_the_schedule():
    place = placement("DualPipe", 2, 4)
    order = compute_order("DualPipe", 2, 4)
    order[0] = [a for a in order[0] if a != _Action(0, F, 1)]
    with pytest.raises(ValueError, match=r"(?s)Invalid DualPipe order.*Rank 0"):
        validate_order(order, place)


@pytest.mark.parametrize("schedule,pp,n,fix", [
    ("DualPipeV", 2, 3, "use at least 4 microbatches"),
    ("DualPipeV", 0, 4, "pipeline size >= 1"),
    ("DualPipe", 3, 6, r"even pipeline size, got pp_size=3: use an even pp \(2 or 4\)"),
    ("DualPipe", 1, 4, r"even pipeline size, got pp_size=1: use an even pp \(2\) or DualPipeV"),
    ("DualPipe", 2, 5, "even number of microbatches"),
    ("DualPipe", 4, 6, "n_microbatches=6 with pp_size=4"),
    ("ZeroBubble", 2, 4, "Unknown schedule 'ZeroBubble'"),
])
def test_requirements_raise_value_error(schedule, pp, n, fix):
    with pytest.raises(ValueError, match=fix):
        compute_order(schedule, pp, n)


def test_names_are_case_insensitive():
    assert compute_order("dualpipev", 2, 4) == compute_order("DualPipeV", 2, 4)


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 2, 5), ("DualPipe", 4, 10)])
def test_csv_round_trip(schedule, pp, n):
    order = compute_order(schedule, pp, n)
    lowered = lower(order, placement(schedule, pp, n))
    for value in (order, lowered):
        buf = io.StringIO()
        write_csv(value, buf)
        assert read_csv(io.StringIO(buf.getvalue())) == value


def test_overlapped_pairs_survive_csv():
    buf = io.StringIO()
    write_csv(compute_order("DualPipe", 2, 4), buf)
    assert "(3F3;0B0)OVERLAP_F_B" in buf.getvalue()
    pairs = [a for a in read_csv(io.StringIO(buf.getvalue()))[0] if a.computation_type == OVERLAP_F_B]
    assert pairs and all(len(a.sub_actions) == 2 for a in pairs)


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_cli_writes_csv(tmp_path, fmt, capsys):
    out = tmp_path / "order.csv"
    assert cli_main(["csv", "--schedule", "DualPipe", "--pp", "4", "--microbatches", "8", "--format", fmt, "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    place = placement("DualPipe", 4, 8)
    expected = compute_order("DualPipe", 4, 8)
    if fmt == "compute_comms":
        expected = lower(expected, place)
    assert load_csv(str(out)) == expected


def test_cli_reports_bad_values(capsys):
    assert cli_main(["csv", "--schedule", "DualPipe", "--pp", "3", "--microbatches", "6"]) == 2
    assert "even pipeline size" in capsys.readouterr().err


@pytest.mark.parametrize("args,named", [(("DualPipe", 3, 6), "even pipeline size"),
                                        (("DualPipe", 2, 5), "even number of microbatches"),
                                        (("DualPipeV", 2, 3), "n_microbatches >= 2 \\* pp_size"),
                                        (("GPipe", 2, 4), "Unknown schedule"),
                                        (("DualPipeV", 0, 4), "pipeline size >= 1")])
def test_placement_raises_the_schedules_config_error(args, named):
    """placement() and compute_order() raise what the schedules raise (docs/schedules.md#errors): a
    PipelineConfigError, itself a ValueError and a RuntimeError."""
    from titan_dualpipe import PipelineConfigError
    from titan_dualpipe.runtime.errors import PipelineConfigError as runtime_error

    assert runtime_error is PipelineConfigError and issubclass(PipelineConfigError, (ValueError, RuntimeError))
    for call in (placement, compute_order):
        with pytest.raises(PipelineConfigError, match=named):
            call(*args)
    place = placement("DualPipe", 2, 4)
    for query, bad in ((place.stages_of, 2), (place.rank_of, 4), (place.model_part, -1)):
        with pytest.raises(PipelineConfigError, match="outside"):
            query(bad)


@pytest.mark.parametrize("schedule,pp,feeding", [("DualPipeV", 1, [0]), ("DualPipeV", 4, [0]), ("DualPipe", 2, [0, 1]), ("DualPipe", 6, [0, 5])])
def test_ranks_that_pass_the_batch(schedule, pp, feeding):
    place = placement(schedule, pp, 2 * pp)
    assert [r for r in range(pp) if place.feeds_batch(r)] == feeding


def test_an_order_for_another_schedule_names_the_one_it_fits():
    """A DualPipeV order loaded for DualPipe: the error names the schedule and sizes it was made for."""
    with pytest.raises(ValueError, match=r"This order is DualPipeV's for pp=2 and 8 microbatches: run it as DualPipeV"):
        validate_order(compute_order("DualPipeV", 2, 8), placement("DualPipe", 2, 8))
