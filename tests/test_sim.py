"""Simulator, cost parser, CSV input, CLI output, timeline picture and trace (pure, no process group)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

import titan_dualpipe.cli as main_cli
import titan_dualpipe.sim as sim_package
from titan_dualpipe._compat import TORCH_VERSION
from titan_dualpipe._compat.pipelining import B, F, I, OVERLAP_F_B, W, _Action, torch_activation_slots
from titan_dualpipe.orders import compute_order, placement
from titan_dualpipe.orders.csv_io import write_csv
from titan_dualpipe.orders.lowering import leaf_actions, lower
from titan_dualpipe.sim import (
    JSON_KEYS_HELP,
    SCHEDULE_NAMES,
    Costs,
    Pipeline,
    TimedAction,
    parse_costs,
    pipeline_for,
    pipeline_from_csv,
    simulate,
    trace_events,
)
from titan_dualpipe.sim.cli import compare
from titan_dualpipe.sim.engine import peak_activations
from titan_dualpipe.sim.memory import activation_counts

TORCH_LIVENESS = TORCH_VERSION >= (2, 15)
NO_TORCH_LIVENESS = "torch's analyze_pipeline_activation_liveness arrived in torch 2.15"


def pairs_per_rank(pipe: Pipeline) -> list[int]:
    return [sum(a.computation_type == OVERLAP_F_B for a in acts) for _, acts in sorted(pipe.order.items())]


# ---- DeepSeek's table -----------------------------------------------------------------------
#
# The table's assumption: a forward chunk, the input-gradient part of a backward (I) and the
# weight part (W) take the same time, so F = I = W = 1 and B = 2; F&B (an overlapped pair)
# lies between F + I (perfect overlap) and F + B (none). PP is the number of stages in a
# chain: DualPipe on pp ranks has chains of pp stages (PP = pp); DualPipeV on P ranks has
# one chain of 2P stages (PP = 2P, and it is DualPipe(2P) folded); 1F1B on PP ranks, PP.
# The table assumes enough microbatches for the steady phase: we check the smallest count
# each schedule accepts (DualPipe 2*pp, DualPipeV 2*P, 1F1B PP) and a larger one.

TABLE_COSTS = [Costs(F=1, B=2, W=1, FB=fb) for fb in (2.0, 2.4, 3.0)]  # F&B = F+I .. F+B
EVEN_PP = range(2, 33, 2)


def _dualpipe_family(PP: int) -> list[Pipeline]:
    return [
        pipeline_for("DualPipe", PP, 2 * PP),
        pipeline_for("DualPipe", PP, 2 * PP + 6),
        pipeline_for("DualPipeV", PP // 2, PP),
        pipeline_for("DualPipeV", PP // 2, PP + 3),
    ]


@pytest.mark.parametrize("PP", EVEN_PP)
def test_dualpipe_family_matches_deepseek_table(PP: int) -> None:
    for pipe in _dualpipe_family(PP):
        pairs = pairs_per_rank(pipe)
        for costs in TABLE_COSTS:
            result = simulate(pipe, costs)
            table_bubble = (PP / 2 - 1) * (costs.overlapped + costs.B - 3 * costs.W)
            assert result.max_bubble == pytest.approx(table_bubble), (pipe.name, pipe.pp_size, costs)
            # The table's figure is the bubble of the ranks that overlap the most pairs; a rank
            # with fewer pairs is busier by (F + B - F&B) per missing pair and idles that much less.
            saving = costs.F + costs.B - costs.overlapped
            expected = [table_bubble - saving * (max(pairs) - p) for p in pairs]
            assert [r.bubble for r in result.ranks] == pytest.approx(expected)
            assert [r.peak_activations for r in result.ranks] == [PP + 1] * pipe.pp_size


@pytest.mark.parametrize("PP", EVEN_PP)
def test_1f1b_matches_deepseek_table(PP: int) -> None:
    costs = TABLE_COSTS[1]
    for n in (PP, 2 * PP):
        result = simulate(pipeline_for("1F1B", PP, n), costs)
        assert [r.bubble for r in result.ranks] == pytest.approx([(PP - 1) * (costs.F + costs.B)] * PP)
        # torch's 1F1B runs num_stages - rank forwards before its first backward
        assert [r.peak_activations for r in result.ranks] == [PP - rank for rank in range(PP)]


def test_torch_dualpipev_runs_like_ours() -> None:
    costs = Costs(F=1, B=2, W=0.5, FB=2.2)
    for pp, n in ((2, 4), (4, 9), (5, 12)):
        ours, theirs = simulate(pipeline_for("DualPipeV", pp, n), costs), simulate(pipeline_for("torch:DualPipeV", pp, n), costs)
        assert [(e.rank, str(e.action), e.start, e.end) for e in ours.timeline] == [
            (e.rank, str(e.action), e.start, e.end) for e in theirs.timeline
        ]


# ---- engine ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_rank_runs_its_whole_order_once(name: str) -> None:
    pp, n = 4, 8
    pipe = pipeline_for(name, pp, n)
    result = simulate(pipe, Costs(F=1, B=2, W=0.5, FB=2.5), p2p=0.1)
    for rank, actions in pipe.order.items():
        ran = [e for e in result.timeline if e.rank == rank]
        assert Counter(e.action for e in ran) == Counter(actions)
        assert [e.action for e in sorted(ran, key=lambda e: e.start)] == actions  # in list order
        assert all(a.end <= b.start + 1e-12 for a, b in zip(ran, ran[1:]))  # one at a time
    leaves = Counter(leaf.computation_type for e in result.timeline for leaf in leaf_actions(e.action))
    stages = pipe.num_stages
    assert leaves[F] == stages * n // len(pipe.chains)
    assert leaves[B] + leaves[I] == leaves[F] and leaves[W] == leaves[I]


def test_p2p_latency_applies_to_cross_rank_edges_only() -> None:
    # 1F1B on 2 ranks, 2 microbatches: rank 1 runs F0 B0 F1 B1, rank 0 F0 F1 B0 B1.
    pipe = pipeline_for("1F1B", 2, 2)
    assert simulate(pipe, Costs(F=1, B=2), p2p=0.0).makespan == pytest.approx(9.0)
    # r1: F0 1.5-2.5, B0 -4.5, F1 -5.5, B1 -7.5; r0: B0 waits until 5.0 -> 7.0, B1 8.0 -> 10.0
    assert simulate(pipe, Costs(F=1, B=2), p2p=0.5).makespan == pytest.approx(10.0)
    # DualPipeV on one rank: both stages on rank 0, nothing crosses ranks
    single = pipeline_for("DualPipeV", 1, 4)
    assert simulate(single, p2p=5.0).makespan == simulate(single, p2p=0.0).makespan


def test_pair_waits_for_both_halves_and_costs_fb() -> None:
    # rank 0 holds stage 0 (first) and stage 1 (last) of one chain; the pair (0F1;1B0) needs 1F0.
    pair = _Action(-1, OVERLAP_F_B, None, (_Action(0, F, 1), _Action(1, B, 0)))
    order = {0: [_Action(0, F, 0), _Action(1, F, 0), pair, _Action(1, F, 1), _Action(1, B, 1),
                 _Action(0, B, 0), _Action(0, B, 1)]}
    result = simulate(Pipeline("hand-made", order, ((0, 1),), 2), Costs(F=1, B=2, FB=2.5))
    pair_event = next(e for e in result.timeline if e.action == pair)
    assert (pair_event.start, pair_event.end) == (2.0, 4.5)
    assert result.makespan == pytest.approx(2 + 2.5 + 1 + 2 + 2 + 2)


def test_malformed_order_is_reported_not_looped() -> None:
    # rank 1 runs its backward before the forward it needs; rank 0 then waits forever too.
    order = {0: [_Action(0, F, 0), _Action(0, B, 0)], 1: [_Action(1, B, 0), _Action(1, F, 0)]}
    with pytest.raises(ValueError) as err:
        simulate(Pipeline("broken", order, ((0, 1),), 1))
    message = str(err.value)
    assert "rank 0: 0B0" in message and "waits for 1B0 or 1I0" in message
    assert "rank 1: 1B0" in message and "waits for 1F0" in message


def test_weight_grad_without_its_input_grad_is_reported() -> None:
    order = {0: [_Action(0, F, 0), _Action(0, W, 0), _Action(0, I, 0)]}
    with pytest.raises(ValueError, match=r"0W0 \(action 2 of 3\) waits for 0I0"):
        simulate(Pipeline("W first", order, ((0,),), 1))


def test_stage_on_two_ranks_or_outside_the_chains_is_rejected() -> None:
    twice = {0: [_Action(0, F, 0)], 1: [_Action(0, B, 0)]}
    with pytest.raises(ValueError, match="stage 0 runs on ranks 0 and 1"):
        simulate(Pipeline("split stage", twice, ((0,),), 1))
    with pytest.raises(ValueError, match=r"stages \[5\] run but belong to no chain"):
        simulate(Pipeline("stray stage", {0: [_Action(5, F, 0)]}, ((0,),), 1))


def test_peak_activations_counts_pairs_and_split_backwards() -> None:
    f0, f1 = _Action(0, F, 0), _Action(0, F, 1)
    assert peak_activations([f0, f1, _Action(0, B, 0), _Action(0, B, 1)]) == 2
    # a pair allocates its forward before its backward frees
    assert peak_activations([f0, _Action(-1, OVERLAP_F_B, None, (f1, _Action(0, B, 0)))]) == 2
    # I keeps the activation alive until W
    assert peak_activations([f0, _Action(0, I, 0), f1, _Action(0, W, 0)]) == 2
    assert peak_activations([f0, _Action(0, B, 0), f1]) == 1


@pytest.mark.parametrize("schedule,pp,n,peaks", [("DualPipeV", 2, 4, [5, 5]), ("DualPipe", 2, 4, [3, 3])])
def test_activation_counts_match_the_peaks_counted_by_hand(schedule: str, pp: int, n: int, peaks: list[int]) -> None:
    """Live stage-microbatches (+1 at F, -1 at B or W; a pair's F before its B), counted by hand:

    DualPipeV pp 2 n 4, rank 0: 0F0 1, 0F1 2, 0F2 3, 3F0 4, 3I0 4, 3W0 3, 3F1 4, (0F3;3B1) 5 then 4,
    (3F2;0B0) 5 then 4, 3B2 3, (3F3;0B1) 4 then 3, 3B3 2, 0I2 0W2 1, 0I3 0W3 0: peak 5.
    Rank 1: 1F0 1, 2F0 2, 1F1 3, 2F1 4, 1F2 5, 2B0 4, then three pairs each 5 then 4: peak 5.
    DualPipe pp 2 n 4, rank 0: 0F0 1, 3F2 2, 0F1 3, 3B2 2, (3F3;0B0) 3 then 2, 3B3 1, 0I1 0W1 0:
    peak 3; rank 1 mirrors it (2F2, 1F0, 2F3, 1B0, (1F1;2B2), ...): peak 3.
    torch's analysis (2.15+) gives the same; before 2.15 there is none (None)."""
    counts = activation_counts(schedule, pp, n)
    assert [ours for ours, _ in counts.values()] == peaks
    theirs = [t for _, t in counts.values()]
    assert theirs == (peaks if TORCH_LIVENESS else [None] * pp)


LIVENESS_CASES = ([("DualPipeV", pp, n) for pp in (1, 2, 4, 8) for n in range(2 * pp, 2 * pp + 4)]
                  + [("DualPipe", pp, n) for pp in (2, 4, 8) for n in range(2 * pp, 2 * pp + 8, 2)])


@pytest.mark.skipif(not TORCH_LIVENESS, reason=NO_TORCH_LIVENESS)
@pytest.mark.parametrize("schedule,pp,n", LIVENESS_CASES)
def test_torch_liveness_analysis_counts_what_the_simulator_counts(schedule: str, pp: int, n: int) -> None:
    """torch's ``num_slots`` == our peak on every rank. Both take a stage-microbatch live from its F
    through its B or W (an I does not end it), an overlapped pair's F alongside its B (torch: one
    inclusive position; ours: F counted before B frees); torch's greedy slot reuse by start is
    optimal for intervals, so its slots are the most live at once. For DualPipe each stage's
    microbatch ids are renumbered from 0 and torch is given n/2 (see the test below)."""
    counts = activation_counts(schedule, pp, n)
    assert all(ours == theirs for ours, theirs in counts.values()), counts
    assert [ours for ours, _ in counts.values()] == [2 * pp + 1 if schedule == "DualPipeV" else pp + 1] * pp


@pytest.mark.parametrize("schedule,pp,n", LIVENESS_CASES)
def test_two_batch_freeing_at_input_leaves_the_order_peak(schedule: str, pp: int, n: int) -> None:
    """With two-batch overlap a split microbatch whose backward runs whole at its I is freed there,
    which torch's liveness rule (I never frees) does not model; the peak is the same either way,
    so ``profile --two-batch``'s count still compares with torch's."""
    from titan_dualpipe.sim.sub_batch_costs import freed_at_input, sub_batch_actions

    order, place = compute_order(schedule, pp, n), placement(schedule, pp, n)
    freed = freed_at_input(sub_batch_actions(order), place)
    # it applies wherever some I is not a chain-first stage's (not DualPipeV pp 1, DualPipe pp 2)
    assert bool(freed) == (pp > (2 if schedule == "DualPipe" else 1))
    ours = [count for count, _ in activation_counts(schedule, pp, n).values()]
    assert [peak_activations(order[r], freed) for r in order] == ours


@pytest.mark.skipif(not TORCH_LIVENESS, reason=NO_TORCH_LIVENESS)
def test_torch_liveness_analysis_needs_every_stage_to_run_microbatches_from_zero() -> None:
    """DualPipe's direction-1 stages run microbatches n/2 .. n-1: torch refuses that order as it is,
    hence the renumbering in :func:`titan_dualpipe.sim.memory.order_activation_counts`."""
    place, order = placement("DualPipe", 2, 4), compute_order("DualPipe", 2, 4)
    with pytest.raises(ValueError, match="microbatch outside"):
        torch_activation_slots(order[0], 2, 0, place.stages_of(0))
    with pytest.raises(ValueError, match="do not match tracked activations"):
        torch_activation_slots(order[0], 4, 0, place.stages_of(0))


# ---- costs ----------------------------------------------------------------------------------


def test_parse_costs() -> None:
    costs = parse_costs("F=1,B=2,W=0.5,FB=2.2")
    assert (costs.F, costs.B, costs.W, costs.I, costs.overlapped) == (1, 2, 0.5, 1.5, 2.2)
    assert parse_costs("f=2, b=3").overlapped == 5  # FB defaults to F + B
    assert parse_costs("F&B=2.5").overlapped == 2.5
    assert Costs().scaled(0.5).as_dict() == {"F": 0.5, "B": 1.0, "W": 0.5, "I": 0.5, "FB": 1.5}


def test_split_input_cost_models_dearer_split_backwards_and_whole_backwards_at_i() -> None:
    """``I`` given: a split backward dearer than the full one (AC recomputes in I and in W) is
    allowed and slows the schedule down; ``I=B,W=0`` is a backward run whole at I."""
    costs = parse_costs("F=1,B=3,I=2,W=2")
    assert (costs.I, costs.W, costs.B) == (2, 2, 3) and parse_costs(str(costs)).I == 2
    assert costs.scaled(0.5).I == 1
    pipeline = pipeline_for("DualPipeV", 4, 16)
    ideal = simulate(pipeline, parse_costs("F=1,B=3,W=1")).makespan
    assert simulate(pipeline, parse_costs("F=1,B=3,I=2,W=1")).makespan == ideal  # I = B - W spelled out
    assert simulate(pipeline, costs).makespan > ideal
    whole = simulate(pipeline, parse_costs("F=1,B=3,I=3,W=0"))
    assert whole.makespan == simulate(pipeline, parse_costs("F=1,B=3,W=0")).makespan > ideal


@pytest.mark.parametrize("text, named", [
    ("F=1,X=2", "'X=2'"), ("F=one", "'one'"), ("F", "'F'"), ("W=3", "W=3"), ("F=-1", "F=-1"), ("B=0", "B=0"),
])
def test_bad_costs_name_the_value(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        parse_costs(text)


# ---- CSV ------------------------------------------------------------------------------------


def _timings(result) -> list[tuple]:
    return [(e.rank, str(e.action), e.start, e.end) for e in result.timeline]


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_dualpipe_csv_runs_like_the_named_schedule(tmp_path, fmt: str) -> None:
    pp, n = 4, 10
    order = compute_order("DualPipe", pp, n)
    if fmt == "compute_comms":
        order = lower(order, placement("DualPipe", pp, n))
    path = tmp_path / "dualpipe.csv"
    with open(path, "w", newline="") as f:
        write_csv(order, f)
    from_csv = pipeline_from_csv(str(path))
    assert from_csv.chains == ((0, 1, 2, 3), (4, 5, 6, 7))  # read off the microbatches
    costs = Costs(F=1, B=2, W=1, FB=2.5)
    assert _timings(simulate(from_csv, costs, 0.1)) == _timings(simulate(pipeline_for("DualPipe", pp, n), costs, 0.1))


def test_single_chain_csv(tmp_path) -> None:
    path = tmp_path / "zbv.csv"
    pipe = pipeline_for("ZBVZeroBubble", 2, 4)
    with open(path, "w", newline="") as f:
        write_csv(pipe.order, f)
    from_csv = pipeline_from_csv(str(path))
    assert from_csv.chains == ((0, 1, 2, 3),) and from_csv.n_microbatches == 4
    assert _timings(simulate(from_csv)) == _timings(simulate(pipe))


def test_bad_csv_cell_is_a_value_error(tmp_path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0X1\n")
    with pytest.raises(ValueError, match="bad.csv"):
        pipeline_from_csv(str(path))


# ---- CLI ------------------------------------------------------------------------------------


@pytest.fixture
def sim_only_cli(monkeypatch):
    """The package CLI with just this module's commands (others may need optional extras)."""
    assert "titan_dualpipe.sim.cli" in main_cli.COMMAND_MODULES
    monkeypatch.setattr(main_cli, "COMMAND_MODULES", ("titan_dualpipe.sim.cli",))
    return main_cli.main


def _documented_keys() -> set[str]:
    body = JSON_KEYS_HELP.split(":\n", 1)[1]
    return {line.split()[0] for line in body.splitlines() if line.startswith("  ") and not line.startswith("   ")}


def test_json_keys_are_documented(sim_only_cli, capsys) -> None:
    assert sim_only_cli(["simulate", "--schedule", "DualPipe", "--pp", "4", "--microbatches", "8",
                         "--cost", "F=1,B=2,W=1,FB=2.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == _documented_keys()
    assert {"makespan", "bubble_per_rank", "bubble_ratio", "peak_activations_per_rank"} <= set(out)
    assert out["bubble_per_rank"] == pytest.approx([out["makespan"] - b for b in out["busy_per_rank"]])
    assert out["peak_activations_per_rank"] == [5, 5, 5, 5]
    assert JSON_KEYS_HELP in sim_package.__doc__
    with pytest.raises(SystemExit):
        sim_only_cli(["simulate", "--help"])
    help_text = capsys.readouterr().out
    assert all(key in help_text for key in _documented_keys())


def test_compare_lists_every_schedule(sim_only_cli, capsys, tmp_path) -> None:
    csv_path = tmp_path / "dp.csv"
    with open(csv_path, "w", newline="") as f:
        write_csv(compute_order("DualPipe", 4, 16), f)
    assert sim_only_cli(["simulate", "--compare", "--pp", "4", "--microbatches", "16", "--csv", str(csv_path),
                         "--json"]) == 0
    rows = {row["schedule"]: row for row in json.loads(capsys.readouterr().out)["schedules"]}
    assert set(rows) == set(SCHEDULE_NAMES) | {f"csv:{csv_path}"}
    assert rows["DualPipe"]["makespan"] == rows[f"csv:{csv_path}"]["makespan"]
    # 2*pp stages per chain run at half the per-stage cost: the same total work on every row
    assert rows["DualPipeV"]["cost_scale"] == 0.5 and rows["1F1B"]["cost_scale"] == 1
    assert rows["DualPipeV"]["busy_per_rank"] == rows["1F1B"]["busy_per_rank"] == [48.0] * 4


def test_compare_reports_schedules_that_cannot_run() -> None:
    rows = {name: result for name, _, result in compare(3, 4, Costs())}
    assert "even pipeline size" in rows["DualPipe"]  # DualPipe needs an even pp
    assert "n_microbatches >= 2 * pp_size" in rows["DualPipeV"]
    assert rows["1F1B"].makespan == pytest.approx((4 + 3 - 1) * 3)


def test_cli_turns_bad_input_into_an_error(sim_only_cli, capsys) -> None:
    assert sim_only_cli(["simulate", "--schedule", "Nope", "--pp", "2", "--microbatches", "4"]) == 2
    assert "unknown schedule 'Nope'" in capsys.readouterr().err
    assert sim_only_cli(["simulate", "--schedule", "DualPipe"]) == 2
    assert "needs --pp, --microbatches" in capsys.readouterr().err
    assert sim_only_cli(["draw", "--schedule", "1F1B", "--pp", "2", "--microbatches", "2"]) == 2
    assert "-o FILE" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse rejects a bad --cost, keeping our message
        sim_only_cli(["simulate", "--compare", "--pp", "2", "--microbatches", "4", "--cost", "F=1,B=x"])
    assert "cost B='x' in 'F=1,B=x' is not a number" in capsys.readouterr().err


def test_simulate_table(sim_only_cli, capsys) -> None:
    assert sim_only_cli(["simulate", "--schedule", "torch:1f1b", "--pp", "2", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "makespan 9, bubble ratio 33.3%" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("   ")]
    assert rows == [["0", "6", "3", "33.3%", "2", "4"], ["1", "6", "3", "33.3%", "1", "4"]]


# ---- timeline: trace and picture ------------------------------------------------------------


def test_trace_has_one_process_per_rank_and_one_event_per_action(tmp_path, sim_only_cli) -> None:
    result = simulate(pipeline_for("DualPipe", 4, 8), Costs(FB=2.5))
    trace = trace_events(result.timeline)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(result.timeline)
    assert {e["pid"] for e in complete} == {0, 1, 2, 3}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1", "rank 2", "rank 3"}
    last = max(complete, key=lambda e: e["ts"] + e["dur"])
    assert (last["ts"] + last["dur"]) / 1000 == pytest.approx(result.makespan)
    assert any(e["cat"] == "F&B" and "&" in e["name"] for e in complete)
    path = tmp_path / "t.json"
    assert sim_only_cli(["draw", "--schedule", "DualPipe", "--pp", "4", "--microbatches", "8", "--trace", str(path)]) == 0
    assert len(json.loads(path.read_text())["traceEvents"]) == len(trace["traceEvents"])


def test_draw_writes_a_png(tmp_path, sim_only_cli) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "schedule.png"
    assert sim_only_cli(["draw", "--schedule", "DualPipe", "--pp", "4", "--microbatches", "8",
                         "--cost", "F=1,B=2,W=1,FB=2.5", "-o", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_draw_a_measured_timeline(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from titan_dualpipe.sim import draw_timeline

    t0 = 1_700_000_000.0  # wall-clock seconds, as a runtime would record them
    events = [TimedAction(0, _Action(0, F, 0), t0, t0 + 0.01), TimedAction(1, _Action(1, F, 0), t0 + 0.012, t0 + 0.02)]
    path = tmp_path / "measured.svg"
    draw_timeline(events, str(path), "measured", time_label="seconds")
    assert path.read_text().lstrip().startswith("<?xml")


def test_draw_without_matplotlib_says_what_to_install(monkeypatch, tmp_path) -> None:
    import sys

    from titan_dualpipe.sim import draw_timeline

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    events = simulate(pipeline_for("1F1B", 2, 2)).timeline
    with pytest.raises(ValueError, match=r"pip install 'titan_dualpipe\[plot\]'"):
        draw_timeline(events, str(tmp_path / "x.png"))


# ---- two-batch overlap ----------------------------------------------------------------------


def _by_action(result) -> dict[_Action, TimedAction]:
    return {e.action: e for e in result.timeline}


def test_two_batch_costs_parse_scale_and_print() -> None:
    costs = parse_costs("F=1,B=2,F2=0.8,b2=1.6")
    assert (costs.forward_in_sub_batches, costs.backward_in_sub_batches) == (0.8, 1.6)
    assert costs.as_dict() == {"F": 1, "B": 2, "W": 1, "I": 1, "FB": 3, "F2": 0.8, "B2": 1.6}
    assert parse_costs(str(costs)).as_dict() == costs.as_dict() and str(costs).endswith("F2=0.8,B2=1.6")
    assert costs.scaled(0.5).as_dict()["F2"] == 0.4 and costs.scaled(0.5).B2 == 0.8
    assert (Costs().forward_in_sub_batches, Costs().backward_in_sub_batches) == (1, 2)  # default: no gain
    assert "F2" not in Costs().as_dict()


@pytest.mark.parametrize("text, named", [("F2=0", "F2=0"), ("B2=-1", "B2=-1"), ("B2=x", "'x'"), ("F3=1", "'F3=1'")])
def test_bad_two_batch_costs_name_the_value(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_costs(text)


@pytest.mark.parametrize("name, pp, n", [("DualPipeV", 2, 4), ("DualPipeV", 4, 10), ("DualPipe", 2, 4), ("DualPipe", 4, 12)])
def test_two_batch_marks_exactly_the_lone_forwards_and_their_lone_backwards(name: str, pp: int, n: int) -> None:
    from titan_dualpipe.orders.lone_actions import lone_forwards, paired_backwards

    pipe = pipeline_for(name, pp, n)
    result = simulate(pipe, two_batch=True)
    for rank, actions in pipe.order.items():
        marked = {e.action for e in result.timeline if e.rank == rank and e.sub_batches}
        lone = lone_forwards(actions)
        assert {(a.stage_index, a.microbatch_index) for a in marked if a.computation_type == F} == lone
        backwards = {a for a in actions if a.computation_type in (B, I, W)
                     and (a.stage_index, a.microbatch_index) in lone - paired_backwards(actions)}
        assert marked - {a for a in marked if a.computation_type == F} == backwards
        assert all(a.computation_type != OVERLAP_F_B for a in marked)  # pairs run as usual
    assert not any(e.sub_batches for e in simulate(pipe).timeline)


def test_two_batch_backward_costs_b2_where_it_runs_whole() -> None:
    """DualPipeV pp=2, n=4: 3I0 (last stage) runs the whole backward (B2), its W nothing; on the
    chain's first stage the I is deferred to the W; a lone B costs B2; unsplit and paired run as usual."""
    result = simulate(pipeline_for("DualPipeV", 2, 4), Costs(F=1, B=2, W=1, FB=2.5, F2=0.7, B2=1.5), two_batch=True)
    timed = _by_action(result)

    def duration(stage: int, kind, mb: int) -> float:
        event = timed[_Action(stage, kind, mb)]
        return event.end - event.start

    assert (duration(3, I, 0), duration(3, W, 0)) == (1.5, 0.0)
    assert (duration(0, I, 2), duration(0, W, 2)) == (0.0, 1.5)  # chain-first stage
    assert duration(2, B, 0) == duration(1, B, 2) == 1.5 and duration(0, F, 0) == 0.7
    assert (duration(0, I, 3), duration(0, W, 3), duration(3, B, 2)) == (1, 1, 2)  # forward paired: whole
    assert not timed[_Action(0, I, 3)].sub_batches and timed[_Action(0, W, 2)].sub_batches


def test_two_batch_makespan_drops_by_the_lone_forwards_on_the_critical_path() -> None:
    """DualPipeV pp=2, n=4 with W=0 (a split backward costs B either way): everything after rank
    1's first backward 2B0 waits for 3I0, which follows rank 0's four lone forwards 0F0 0F1 0F2
    3F0; so F2 = F - d shortens the step by 4d. F2, B2 unset: no change."""
    pipe = pipeline_for("DualPipeV", 2, 4)
    base = simulate(pipe, Costs(F=1, B=2, W=0, FB=2.5)).makespan
    assert simulate(pipe, Costs(F=1, B=2, W=0, FB=2.5), two_batch=True).makespan == base
    for d in (0.1, 0.25, 0.5):
        halves = simulate(pipe, Costs(F=1, B=2, W=0, FB=2.5, F2=1 - d), two_batch=True)
        assert halves.makespan == pytest.approx(base - 4 * d)
        assert [r.busy for r in halves.ranks] == pytest.approx([22.5 - 5 * d] * 2)  # 5 lone forwards per rank


def test_two_batch_frees_a_split_microbatch_at_the_input_part_of_its_backward() -> None:
    f0, f1, i0, w0 = _Action(1, F, 0), _Action(1, F, 1), _Action(1, I, 0), _Action(1, W, 0)
    assert peak_activations([f0, i0, f1, w0]) == 2
    assert peak_activations([f0, i0, f1, w0], freed_at_input={(1, 0)}) == 1
    for name, pp, n in (("DualPipeV", 2, 4), ("DualPipeV", 4, 8), ("DualPipe", 4, 8)):
        pipe = pipeline_for(name, pp, n)
        plain, halves = simulate(pipe).ranks, simulate(pipe, two_batch=True).ranks
        assert all(h.peak_activations <= p.peak_activations for h, p in zip(halves, plain)), (name, pp, n)


def test_two_batch_is_ours_only() -> None:
    with pytest.raises(ValueError, match="not of torch's ZBVZeroBubble"):
        simulate(pipeline_for("ZBVZeroBubble", 2, 4), two_batch=True)
    rows = {name: result for name, _, result in compare(2, 4, Costs(), two_batch=True)}
    assert rows["DualPipeV two-batch"].two_batch and not rows["DualPipeV"].two_batch
    assert "ZBVZeroBubble two-batch" not in rows and not rows["ZBVZeroBubble"].two_batch


def test_two_batch_cli(sim_only_cli, capsys, tmp_path) -> None:
    argv = ["--schedule", "DualPipeV", "--pp", "2", "--microbatches", "4", "--cost", "F=1,B=2,W=0,FB=2.5,F2=0.5",
            "--two-batch"]
    assert sim_only_cli(["simulate", *argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["two_batch"] and out["costs"]["F2"] == 0.5 and out["makespan"] == pytest.approx(26 - 2)
    trace = tmp_path / "t.json"
    assert sim_only_cli(["draw", *argv, "--trace", str(trace)]) == 0
    names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    assert names[:5] == ["F0½", "F1½", "F2½", "F0½", "I0½"] and "F3&B1" in names and "I3" in names
    assert sim_only_cli(["simulate", "--schedule", "1F1B", "--pp", "2", "--microbatches", "2", "--two-batch"]) == 2
    assert "two-batch overlap is a feature of our schedules" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sim_only_cli(["draw", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--two-batch" in help_text and "F2 and B2" in help_text


def test_draw_marks_halves(tmp_path, sim_only_cli) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "two_batch.png"
    assert sim_only_cli(["draw", "--schedule", "DualPipeV", "--pp", "2", "--microbatches", "6", "--two-batch",
                         "--cost", "F=1,B=2,W=1,FB=2.5,F2=0.8,B2=1.6", "-o", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
