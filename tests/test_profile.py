"""Costs measured from a recorded timeline (the part of `titan-dualpipe profile` that needs no processes)."""

from __future__ import annotations

import pytest

from titan_dualpipe import placement
from titan_dualpipe._compat.pipelining import B, F, I, OVERLAP_F_B, W, _Action
from titan_dualpipe._compat import TORCH_VERSION
from titan_dualpipe.sim.profile import _liveness_line, costs_from
from titan_dualpipe.sim.timeline import TimedAction


def _event(action: _Action, seconds: float, start: float = 0.0) -> TimedAction:
    return TimedAction(0, action, start, start + seconds)


def test_costs_are_medians_per_kind_and_first_stage_weight_parts_count_as_full_backwards():
    place = placement("DualPipeV", 2, 4)
    pair = _Action(-1, OVERLAP_F_B, None, (_Action(1, F, 2), _Action(2, B, 0)))
    timeline = [
        _event(_Action(1, F, 0), 1.0), _event(_Action(1, F, 1), 3.0), _event(_Action(2, F, 0), 2.0),
        _event(_Action(2, B, 1), 4.0),
        _event(_Action(2, I, 3), 1.5), _event(_Action(2, W, 3), 2.5),
        _event(_Action(0, I, 3), 0.0), _event(_Action(0, W, 3), 9.0),  # first stage: W is the whole backward
        _event(pair, 5.0),
    ]
    costs = costs_from(timeline, place)
    assert (costs.F, costs.B, costs.W, costs.overlapped) == (2.0, 6.5, 2.5, 5.0)  # B: median of 4.0 and 9.0


def test_weight_share_comes_from_split_samples_when_only_first_stages_split():
    """DualPipe at pp=2 splits backwards on chain-first stages only: W is the sampled weight
    share of the measured full backward, not 0."""
    place = placement("DualPipe", 2, 4)
    timeline = [_event(_Action(1, F, 0), 1.0), _event(_Action(1, B, 0), 3.0),
                _event(_Action(0, I, 1), 0.0), _event(_Action(0, W, 1), 3.0)]
    costs = costs_from(timeline, place, split_samples=[(1.0, 2.0), (2.0, 2.0)])
    assert costs.B == 3.0 and costs.W == pytest.approx(3.0 * (2 / 3 + 1 / 2) / 2)
    assert costs_from(timeline, place).W == 0.0  # nothing to measure it from


def test_backward_derived_from_split_parts_when_no_full_backward_ran():
    place = placement("DualPipeV", 2, 4)
    timeline = [_event(_Action(1, F, 0), 1.0), _event(_Action(1, I, 0), 1.5), _event(_Action(1, W, 0), 0.5)]
    costs = costs_from(timeline, place)
    assert costs.B == pytest.approx(2.0) and costs.W == 0.5 and costs.overlapped == pytest.approx(3.0)


def test_profile_command_measures_a_real_run(tmp_path, capsys):
    import json

    from titan_dualpipe.cli import main

    trace = tmp_path / "measured.json"
    argv = ["profile", "--schedule", "DualPipe", "--pp", "2", "--microbatches", "4", "--steps", "2",
            "--dim", "16", "--layers", "2", "--seq", "8", "--json", "--trace", str(trace)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["measured_step_s"] > 0 and result["simulated_step_s"] > 0
    assert result["costs_s"]["F"] > 0 and result["costs_s"]["FB"] > 0
    assert 0 < result["costs_s"]["W"] < result["costs_s"]["B"]  # measured although only first stages split
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    assert sum(e["name"].count("&") for e in events) >= 1  # overlapped pairs were recorded
    liveness = result["activation_liveness"]  # DualPipe pp 2 n 4: 3 live stage-microbatches per rank
    assert liveness == {"ours": [3, 3], "torch": [3, 3] if TORCH_VERSION >= (2, 15) else None}
    assert result["activation_memory"]["simulated_peak_stage_microbatches"] == liveness["ours"]


def test_liveness_line_sets_ours_next_to_torchs():
    assert _liveness_line({"ours": [5, 5], "torch": [5, 5]}).endswith(
        "ours 5, 5; torch's liveness analysis 5, 5 (equal)")
    assert _liveness_line({"ours": [5, 4], "torch": [5, 5]}).endswith("(differ at ranks [1])")
    assert _liveness_line({"ours": [5, 5], "torch": None}).endswith("torch's liveness: n/a before torch 2.15")


@pytest.mark.parametrize("schedule,pp,n,ac", [("DualPipeV", 2, 8, "none"), ("DualPipe", 2, 8, "none"),
                                               ("DualPipeV", 4, 8, "none"), ("DualPipeV", 2, 8, "full"),
                                               ("DualPipe", 2, 8, "selective")])
def test_profile_measures_activation_memory_as_the_simulator_predicts(schedule, pp, n, ac, capsys):
    """Measured peak of saved activations and deferred GEMMs' operands per rank == the
    simulator's live-activation count, each stage-microbatch weighing its measured saved bytes
    and, from I to W, the bytes its deferred GEMMs hold (within 1% without AC, 5% with: the
    operands queue while the recomputed activations are freed). A last stage's split backward
    once held its graph to the step's end through the loss and returned output: 12% above.
    Under full AC the operands outweigh what a forward saves many times over, so a model
    without them would be far off."""
    import json

    from titan_dualpipe.cli import main
    from titan_dualpipe.orders import placement

    argv = ["profile", "--schedule", schedule, "--pp", str(pp), "--microbatches", str(n), "--steps", "2",
            "--dim", "32", "--layers", str(2 * pp), "--seq", "16", "--ac", ac, "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    memory = result["activation_memory"]
    assert len(memory["measured_peak_bytes"]) == pp
    assert all(count > 1 for count in memory["simulated_peak_stage_microbatches"]), memory
    held, saved = memory["held_bytes_per_stage_microbatch"], memory["bytes_per_stage_microbatch"]
    place = placement(schedule, pp, n)
    assert set(held) == {str(s) for s in range(place.num_stages) if not place.is_first(s)}  # a chain's first: no I
    assert memory["measured_over_simulated"] == pytest.approx([1.0] * pp, rel=0.01 if ac == "none" else 0.05), memory
    if ac == "full":
        assert all(held[s] > 4 * saved[s] for s in held if not place.is_last(int(s))), memory  # last: logits saved
    # deferred W fills bubbles that a backward whole at I leaves
    assert result["simulated_bubble_ratio"] <= result["whole_at_input"]["simulated_bubble_ratio"], result


def test_activation_meter_counts_saved_tensors_once_and_frees_with_the_graph():
    import torch

    from titan_dualpipe._compat.pipelining import stage_backward_input, stage_backward_weight
    from titan_dualpipe.sim.memory import ActivationMeter

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(32, 8, requires_grad=True)
    with ActivationMeter(module.parameters()) as meter:
        out = module(x)
        # saved: x (by the first linear), its output (by GELU), GELU's output (by the second linear)
        assert meter.live == (32 * 8 + 32 * 16 + 32 * 16) * 4
        out.sum().backward()
        assert meter.live == 0 and meter.peak == (32 * 8 + 32 * 16 + 32 * 16) * 4
        for _ in range(3):  # split backward: the meter itself must not keep graphs alive
            out = module(x)
            _, groups = stage_backward_input([out], [torch.ones_like(out)], [x], module.parameters())
            stage_backward_weight(module.parameters(), groups)
            del out, groups
        assert meter.live == 0


def test_whole_backward_stages_count_their_input_part_as_the_full_backward_and_no_weight():
    """A stage whose backward runs whole at I (torch.compile'd): its I is a full backward and its
    W a no-op, so B takes the I and W comes out 0 (I = B), whatever the no-op W measured."""
    place = placement("DualPipeV", 2, 4)
    timeline = [_event(_Action(1, F, 0), 1.0), _event(_Action(2, B, 0), 4.0),
                _event(_Action(2, I, 3), 4.5), _event(_Action(2, W, 3), 1e-5),
                _event(_Action(0, I, 3), 0.0), _event(_Action(0, W, 3), 5.0)]
    costs = costs_from(timeline, place, whole_stages=range(4))
    assert (costs.B, costs.W, costs.I) == (4.5, 0.0, 4.5)  # B: median of 4.0, 4.5 and 5.0
    assert costs_from(timeline, place).W == 1e-5  # not whole: the W measured


def test_profile_compile_runs_each_compiled_backward_whole_at_input(capsys):
    """``profile --compile``: every block compiled in place; the profiled step's W actions ran no
    compiled backward, each microbatch of each stage ran exactly one (at B, a pair, a
    non-first stage's I or a first stage's W), and the costs carry W = 0."""
    import json

    from titan_dualpipe.cli import main

    pp, n, layers = 2, 4, 4  # DualPipeV: 2 * pp stages of one block each
    argv = ["profile", "--schedule", "DualPipeV", "--pp", str(pp), "--microbatches", str(n), "--steps", "2",
            "--dim", "16", "--layers", str(layers), "--seq", "8", "--compile", "--compile-backend", "aot_eager",
            "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    compiled = result["compiled"]
    calls = compiled["compiled_backward_calls"]
    assert calls["W"] == 0 and calls["F"] == 0 and calls["I"] > 0, calls
    assert calls["B"] + calls["I"] + calls["F&B"] == layers * n, calls  # one compiled backward per block and microbatch
    assert result["costs_s"]["W"] == 0 and result["costs_s"]["I"] == result["costs_s"]["B"] > 0
    assert compiled["W"] == 0 and 0 < compiled["eager_split"]["costs_s"]["W"] < compiled["eager_split"]["costs_s"]["B"]
    assert 0 <= result["simulated_bubble_ratio"] < 1 and 0 <= compiled["eager_split"]["simulated_bubble_ratio"] < 1


@pytest.mark.parametrize("extra,named", [(["--compile-backend", "aot_eager"], "add --compile"),
                                         (["--compile", "--compile-backend", "eager"], "--compile-backend 'eager'")])
def test_profile_compile_options_are_checked_before_spawning(extra, named, capsys):
    from titan_dualpipe.cli import main

    assert main(["profile", "--pp", "2", *extra]) == 2
    assert named in capsys.readouterr().err


def test_halves_give_f2_and_b2_from_the_action_that_ran_the_backward():
    """Actions marked ``sub_batches``: forwards give F2; B, a non-first stage's I and a chain-first
    stage's W give B2 (the other of I and W ran nothing); F comes from F2 when every forward split."""
    place = placement("DualPipeV", 2, 4)
    pair = _Action(-1, OVERLAP_F_B, None, (_Action(1, F, 3), _Action(2, B, 1)))
    halves = [_event(_Action(1, F, 0), 0.8), _event(_Action(2, F, 0), 1.0), _event(_Action(2, B, 0), 1.5),
              _event(_Action(3, I, 0), 1.7), _event(_Action(3, W, 0), 1e-5),
              _event(_Action(0, I, 2), 1e-5), _event(_Action(0, W, 2), 1.9)]
    timeline = [e._replace(sub_batches=True) for e in halves] + [_event(_Action(1, B, 2), 2.0), _event(pair, 2.5)]
    costs = costs_from(timeline, place)
    assert (costs.F2, costs.B2, costs.F, costs.B, costs.overlapped) == (0.9, 1.7, 0.9, 2.0, 2.5)


def test_profile_two_batch_needs_overlap(capsys):
    from titan_dualpipe.cli import main

    assert main(["profile", "--pp", "2", "--two-batch", "--no-overlap"]) == 2
    assert "drop --no-overlap" in capsys.readouterr().err


def test_profile_two_batch_runs_lone_forwards_on_halves_without_raising_peak_memory(tmp_path, capsys):
    """``profile --two-batch`` (two_batch_overlap="all" on TinyLM): the runtime ran exactly the
    order's lone forwards on two halves, F2 and B2 are measured, the simulator's activation
    prediction still matches the measured peak, and that peak is not above the run without halves."""
    import json

    from titan_dualpipe.cli import main

    argv = ["profile", "--schedule", "DualPipeV", "--pp", "2", "--microbatches", "8", "--steps", "2",
            "--dim", "16", "--layers", "4", "--seq", "8", "--json"]
    trace = tmp_path / "halves.json"
    runs = {}
    for extra in ([], ["--two-batch", "--trace", str(trace)]):
        assert main(argv + extra) == 0
        runs[bool(extra)] = json.loads(capsys.readouterr().out)
    halves, whole = runs[True], runs[False]
    assert halves["two_batch"] and not whole["two_batch"] and "F2" not in whole["costs_s"]
    assert halves["forwards_in_sub_batches"] == {"measured": 10, "lone_in_order": 10}  # 5 per rank at pp=2
    assert halves["costs_s"]["F2"] > 0 and halves["costs_s"]["B2"] > 0 and halves["simulated_step_s"] > 0
    memory = halves["activation_memory"]
    assert memory["measured_over_simulated"] == pytest.approx([1.0, 1.0], rel=0.01), memory
    measured_whole = whole["activation_memory"]["measured_peak_bytes"]
    assert all(h <= w for h, w in zip(memory["measured_peak_bytes"], measured_whole)), (memory, measured_whole)
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    assert {"F0½", "F1½", "F2½"} <= names and "F3&B1" in names
