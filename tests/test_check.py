"""``titan-dualpipe check``: the numerics suite a user runs on their own machine."""

from __future__ import annotations

import json

import pytest

from cases import check_cases
from titan_dualpipe.check import cli as check_cli
from titan_dualpipe.cli import main as cli_main

WORLD = 2  # the module's pool (tests/conftest.py)
# FSDP2's warning about a module returning a view, harmless in the check (see check/cli.py)
FSDP_VIEW_WARNING = "can cause backward to fail"


def test_layouts_cover_every_pp_that_fits():
    layouts = {(c.schedule, c.pp, c.dp, c.options != ()) for c in check_cli.cases_for(8)}
    assert {("DualPipeV", pp, 8 // pp, False) for pp in (1, 2, 4, 8)} <= layouts
    assert {("DualPipe", pp, 8 // pp, False) for pp in (2, 4, 8)} <= layouts
    assert ("DualPipeV", 8, 1, True) in layouts and ("DualPipe", 8, 1, True) in layouts
    assert all(c.n >= 2 * c.pp for c in check_cli.cases_for(8))
    assert {c.schedule for c in check_cli.cases_for(1)} == {"DualPipeV"}  # DualPipe needs an even pp


def test_check_on_two_cpu_processes_passes_every_case(capfd):
    assert cli_main(["check", "--nproc", "2", "--json", "--compile", "aot_eager"]) == 0
    out, err = capfd.readouterr()  # the ranks' warnings go to the file descriptors
    assert FSDP_VIEW_WARNING not in out + err
    report = json.loads(out)
    assert report["backend"] == "gloo" and len(report["cases"]) == len(check_cli.cases_for(2, "aot_eager")) == 9
    compiled = [o for o in report["cases"] if ["compile_backend", "aot_eager"] in o["case"]["options"]]
    assert [(o["case"]["schedule"], o["case"]["pp"]) for o in compiled] == [("DualPipeV", 2), ("DualPipe", 2)]
    for outcome in compiled:  # compiled for real, under the recorder, and checked against the eager reference
        assert ["compile_reference", False] in outcome["case"]["options"], outcome["case"]
        stages = sorted((rank, stage) for rank, stage, _ in outcome["graphs"])
        assert len(stages) == 4 and {rank for rank, _ in stages} == {0, 1}, outcome["graphs"]  # 2 stages a rank
        assert all(graphs > 0 for _, _, graphs in outcome["graphs"]), outcome["graphs"]
    assert all(o["graphs"] == [] for o in report["cases"] if o not in compiled)
    split = [o["case"] for o in report["cases"] if ["two_batch_overlap", "all"] in o["case"]["options"]]
    assert [(c["schedule"], c["pp"]) for c in split] == [("DualPipeV", 2), ("DualPipe", 2)]
    for outcome in report["cases"]:
        assert outcome["passed"] and outcome["order"] == "completes", outcome
        assert 0 <= outcome["grad_err"] <= 4e-5 and outcome["seconds"] > 0
        assert outcome["nccl_models"] == ["lazy init", "eager init"]  # gloo: both ways NCCL could run it


def _everyone(trace: dict, eager_groups: set[str]) -> list[dict]:
    """Every rank's result of a case that ran ``trace``, its groups' communicators made eagerly or not."""
    return [{"ok": True, "rank": rank, "events": events, "eager_groups": eager_groups, "grad_err": 0.0,
             "loss_err": 0.0, "seconds": 1.0} for rank, events in trace.items()]


def test_the_order_is_judged_under_the_communicators_the_run_used():
    """NCCL with a bound device (eager init, as ``check --backend nccl`` runs): one FIFO per group,
    lone p2p ops included; without one (lazy init): pair communicators; gloo: both must complete."""
    case, trace = check_cli.Case("DualPipeV", 3, 1, 6), check_cases.ring_after_warm_up()
    lazy = check_cli._outcome(case, _everyone(trace, set()), "nccl")
    assert lazy.passed and lazy.order == "completes" and lazy.nccl_models == ["lazy init"], lazy
    eager = check_cli._outcome(case, _everyone(trace, {"pp"}), "nccl")
    assert not eager.passed and eager.order == "would hang" and eager.nccl_models == ["eager init"], eager
    assert eager.error.startswith("under NCCL eager init (init_process_group(device_id=...)"), eager.error
    assert "rank 0: kernel 2 (recv ring20) on ('group', 'pp')" in eager.error, eager.error
    on_gloo = check_cli._outcome(case, _everyone(trace, set()), "gloo")
    assert not on_gloo.passed and on_gloo.nccl_models == ["lazy init", "eager init"] and "eager init" in on_gloo.error


def test_check_prints_the_communicator_model_it_judged_under(monkeypatch, capsys):
    from dataclasses import asdict

    outcome = check_cli.Outcome(check_cli.Case("DualPipeV", 1, 1, 3), passed=True, order="completes",
                                nccl_models=["eager init"])
    monkeypatch.setattr(check_cli, "_backend", lambda nproc, backend: "nccl")
    monkeypatch.setattr("titan_dualpipe.testing.spawn.run_on_processes", lambda *a, **k: [asdict(outcome)])
    assert cli_main(["check", "--nproc", "1", "--backend", "nccl"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("NCCL order judged under eager init: init_process_group(device_id=...): one communicator "
                        "per process group, created with it, running every op of the group, lone p2p ops included, "
                        "in issue order"), lines


def test_a_failing_case_is_shown_and_sets_the_exit_code(monkeypatch, capsys):
    case = check_cli.Case("DualPipe", 2, 1, 6)
    failed = check_cli.Outcome(case, passed=False, order="would hang", error="rank 0: kernel 3 ...")
    from dataclasses import asdict

    monkeypatch.setattr("titan_dualpipe.testing.spawn.run_on_processes", lambda *a, **k: [asdict(failed)])
    assert cli_main(["check", "--nproc", "2", "--backend", "gloo"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "would hang" in out and "rank 0: kernel 3" in out


def test_nccl_without_enough_gpus_is_refused(capsys):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 64:
        pytest.skip("this machine has 64 GPUs")
    assert cli_main(["check", "--nproc", "64", "--backend", "nccl"]) == 2
    assert "needs one GPU per process" in capsys.readouterr().err


@pytest.mark.parametrize("kind", check_cli.FAULTS)
def test_a_case_failing_on_one_rank_fails_on_every_rank_and_the_next_case_runs(pool, kind):
    """A mismatch, a raise before any traffic, a raise mid-step: all ranks agree, nothing leaks."""
    cases = [check_cli.Case("DualPipe", 2, 1, 6), check_cli.Case("DualPipeV", 1, 2, 3)]
    # mid-step, rank 0 is released when rank 1 destroys the case's groups, at the latest when they time out
    ranks = pool.run(check_cases.cases_counting_groups, timeout_s=120, cases=cases,
                     fault=check_cli.Fault(0, 1, kind), case_timeout_s=5.0)
    for rank, report in enumerate(ranks):
        failed, following = report["outcomes"]
        assert not failed["passed"] and 1 in failed["ranks"], (rank, failed)
        assert "rank 1: " in failed["error"] and ("injected" in failed["error"] or kind == "grad"), failed["error"]
        assert following["passed"], (rank, following)
        assert report["groups_after"] == report["groups_before"] == 1, report  # the world group alone
    if kind == "grad":  # seen on rank 1 alone
        assert ranks[0]["outcomes"][0]["ranks"] == [1]


def test_a_case_failing_on_one_rank_is_a_fail_row_and_the_exit_code(capfd):
    assert cli_main(["check", "--nproc", "2", "--fault", "1:1:grad"]) == 1
    out, err = capfd.readouterr()
    rows = [line.split() for line in out.splitlines() if line.startswith(("DualPipeV ", "DualPipe "))]
    assert [row[-2] for row in rows[:5]] == ["pass", "FAIL", "pass", "pass", "pass"], out
    assert "DualPipeV pp=2 failed on ranks [1]:\nrank 1: AssertionError" in out
