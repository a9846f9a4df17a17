"""``titan-dualpipe check``: the numerics suite a user runs on their own machine."""

from __future__ import annotations

import json

import pytest

from titan_dualpipe.check import cli as check_cli
from titan_dualpipe.cli import main as cli_main


def test_layouts_cover_every_pp_that_fits():
    layouts = {(c.schedule, c.pp, c.dp, c.options != ()) for c in check_cli.cases_for(8)}
    assert {("DualPipeV", pp, 8 // pp, False) for pp in (1, 2, 4, 8)} <= layouts
    assert {("DualPipe", pp, 8 // pp, False) for pp in (2, 4, 8)} <= layouts
    assert ("DualPipeV", 8, 1, True) in layouts and ("DualPipe", 8, 1, True) in layouts
    assert all(c.n >= 2 * c.pp for c in check_cli.cases_for(8))
    assert [c.schedule for c in check_cli.cases_for(1)] == ["DualPipeV"]  # DualPipe needs an even pp


def test_check_on_two_cpu_processes_passes_every_case(capsys):
    assert cli_main(["check", "--nproc", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "gloo" and len(report["cases"]) == len(check_cli.cases_for(2)) == 5
    for outcome in report["cases"]:
        assert outcome["passed"] and outcome["order"] == "completes", outcome
        assert 0 <= outcome["grad_err"] <= 4e-5 and outcome["seconds"] > 0


def test_a_failing_case_is_shown_and_sets_the_exit_code(monkeypatch, capsys):
    case = check_cli.Case("DualPipe", 2, 1, 6)
    failed = check_cli.Outcome(case, passed=False, order="would hang", error="rank 0: kernel 3 ...")
    from dataclasses import asdict

    monkeypatch.setattr("titan_dualpipe.bench.spawn.run_on_processes", lambda *a, **k: [asdict(failed)])
    assert cli_main(["check", "--nproc", "2", "--backend", "gloo"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "would hang" in out and "rank 0: kernel 3" in out


def test_nccl_without_enough_gpus_is_refused(capsys):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 64:
        pytest.skip("this machine has 64 GPUs")
    assert cli_main(["check", "--nproc", "64", "--backend", "nccl"]) == 2
    assert "needs one GPU per process" in capsys.readouterr().err
