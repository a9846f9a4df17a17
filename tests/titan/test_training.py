"""torchtitan end to end on 2 CPU processes (gloo): DualPipe and DualPipeV train as 1F1B does, on
every rank, through torchtitan's validation, checkpoints and resume, and from a CSV of our command line.

The reference runs (tests/titan/conftest.py) are trained once and shared with the other modules.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cases.titan_runs import CHECKPOINT_STEP, STEPS, Run, assert_close, assert_trains, assert_twins_identical, ok, train
from titan_dualpipe.launch import ANSI


@pytest.mark.titan_e2e
def test_dualpipe_matches_1f1b(dualpipe_run: Run, one_f_one_b_run: Run) -> None:
    """Same model split and initial weights as 1F1B: same losses, and a grad norm that
    counts each twin once (counted twice it would be sqrt(2) larger)."""
    assert_trains(dualpipe_run.losses())
    assert_trains(one_f_one_b_run.losses(rank=1))  # 1F1B: the last PP rank has the loss
    assert_close(dualpipe_run.losses(), one_f_one_b_run.losses(rank=1), rel=1e-4)
    assert_close(dualpipe_run.grad_norms(), one_f_one_b_run.grad_norms(rank=1), rel=1e-4)


@pytest.mark.titan_e2e
def test_dualpipe_twins_identical_at_end(dualpipe_run: Run) -> None:
    assert_twins_identical(dualpipe_run)


@pytest.mark.titan_e2e
def test_our_classes_run_without_torchtitans_overlap_callback(dualpipe_run: Run, dualpipev_run: Run) -> None:
    for run, name in ((dualpipe_run, "ScheduleDualPipe"), (dualpipev_run, "ScheduleDualPipeV")):
        for rank in (0, 1):
            record = run.probe(rank)
            assert record["schedule_mro"][0] == f"titan_dualpipe.overlap.schedules.{name}"
            assert "torch.distributed.pipelining.schedules.ScheduleDualPipeV" not in record["schedule_mro"]
            assert not record["overlap_callback"]
            # the overlap switch: default true, off for the DualPipeV run
            assert record["overlap"] is (run is dualpipe_run)
            # dense model: pairs run as a relay (pipeline send overlap), no exchange hands over
            pairs = record["relayed"]["pairs"]
            assert (pairs > 0) if run is dualpipe_run else (pairs == 0)
            assert record["relayed"]["hand_overs"] == 0


@pytest.mark.titan_e2e
def test_loss_logged_on_every_rank(dualpipe_run: Run, dualpipev_run: Run) -> None:
    """DualPipeV's rank 1 holds no last stage; it logs rank 0's loss, never -1."""
    for run in (dualpipe_run, dualpipev_run):
        logged = run.logged()
        assert sorted(logged) == [0, 1]
        assert logged[0] == logged[1]
        assert "loss: -1" not in ANSI.sub("", run.output)


@pytest.mark.titan_e2e
def test_validation_runs_our_schedules_and_logs_on_every_rank(
    dualpipe_run: Run, one_f_one_b_run: Run, dualpipev_run: Run
) -> None:
    """torchtitan validates with the training schedule's eval(). DualPipe gives 1F1B's validation
    losses; DualPipeV's rank 1 (no last stage) logs rank 0's loss, not -1 / tokens."""
    reference = one_f_one_b_run.validation_losses()[1]
    assert sorted(reference) == [1, 3, 6]
    for run in (dualpipe_run, dualpipev_run):
        logged = run.validation_losses()
        assert sorted(logged) == [0, 1] and logged[0] == logged[1]
        assert all(0 < loss < 20 for loss in logged[0].values()), logged
    assert_close(dualpipe_run.validation_losses()[0], reference, rel=1e-4)


@pytest.mark.titan_e2e
def test_dualpipev_trains_close_to_1f1b(dualpipev_run: Run, one_f_one_b_run: Run) -> None:
    """Four stages instead of two draw other initial weights: close, not equal."""
    assert_trains(dualpipev_run.losses())
    assert_close(dualpipev_run.losses(), one_f_one_b_run.losses(rank=1), rel=0.05)


@pytest.mark.titan_e2e
def test_csv_from_our_cli_trains_from_another_directory(runs_dir: Path, dualpipev_run: Run) -> None:
    """A DualPipeV CSV from `titan-dualpipe csv` gives the built-in order's losses. Run from
    outside the repository: shipped tokenizer and dataset are found through the package.
    Its overlapped pairs overlap; the reference run ran them sequentially: same losses."""
    from titan_dualpipe.cli import main as cli_main

    csv = runs_dir / "dualpipev_pp2_n8.csv"
    assert cli_main(["csv", "--schedule", "DualPipeV", "--pp", "2", "--microbatches", "8", "-o", str(csv)]) == 0
    elsewhere = runs_dir / "elsewhere"
    elsewhere.mkdir()
    run = ok(train("debug_dualpipev", runs_dir / "csv",
                   "--parallelism.pipeline_parallel_schedule_csv", str(csv), cwd=elsewhere))
    assert "from " + str(csv) in run.output
    assert "pairs run sequentially" in dualpipev_run.output and "pairs run sequentially" not in run.output
    assert_close(run.losses(), dualpipev_run.losses(), rel=1e-6)


@pytest.mark.titan_e2e
def test_dualpipe_resume_continues_with_same_losses(runs_dir: Path, dualpipe_run: Run) -> None:
    """Resumed with the plain torchrun command line (our module loaded by custom_import or --module)."""
    resumed_dir = runs_dir / "resumed"
    step_dir = f"step-{CHECKPOINT_STEP}"
    shutil.copytree(dualpipe_run.out_dir / "checkpoint" / step_dir, resumed_dir / "checkpoint" / step_dir)
    run = ok(train("debug_dualpipe", resumed_dir, "--checkpoint.enable",
                   "--checkpoint.interval", str(CHECKPOINT_STEP), torchrun=True))
    assert f"Training starts at step {CHECKPOINT_STEP + 1}" in run.output
    expected = {s: v for s, v in dualpipe_run.losses().items() if s > CHECKPOINT_STEP}
    assert run.losses() == expected
    assert run.losses(rank=1) == expected


@pytest.mark.titan_e2e
def test_finished_run_goes_on_from_its_last_checkpoint(runs_dir: Path, dualpipe_run: Run) -> None:
    """docs/torchtitan.md's resume (checkpoints): started again with more steps, a finished run loads its last
    checkpoint (the shipped configs save it with the training state; torchtitan's default saves
    it model-only, and loading that fails on the missing data-loader state)."""
    extended = runs_dir / "extended"
    last = f"step-{STEPS}"
    shutil.copytree(dualpipe_run.out_dir / "checkpoint" / last, extended / "checkpoint" / last)
    run = ok(train("debug_dualpipe", extended, "--checkpoint.enable", steps=STEPS + 2))
    assert f"Training starts at step {STEPS + 1}" in run.output
    losses = run.losses()
    assert sorted(losses) == [STEPS + 1, STEPS + 2] and all(0 < v < dualpipe_run.losses()[1] for v in losses.values())
