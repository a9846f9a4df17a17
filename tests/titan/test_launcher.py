"""``titan-dualpipe train``, the launcher: its options, the config form each torchtitan takes, and
what it reports when a run fails; end to end, failures on every rank as the launcher shows them:
a bad config stopped before any collective, a killed rank named by the other, a parse error."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cases.titan_runs import AFTER_PROCESS_GROUP_LOG, CONFIGS, REGISTRY, ROOT, config, key, train
from titan_dualpipe.launch import ANSI
from titan_dualpipe.switches import TEST_KILL_ENV


def test_launcher_options_may_follow_the_config() -> None:
    from titan_dualpipe import launch

    parser = argparse.ArgumentParser()
    launch.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "c.toml", "--training.steps", "3", "--nproc", "4", "--log-ranks", "1"])
    args, overrides = launch.split_arguments(args)
    assert (args.nproc, args.log_ranks, args.module, overrides) == (4, "1", "titan_dualpipe.titan", ["--training.steps", "3"])
    argv = launch.torchrun_argv(launch.config_arguments("c.toml", args.module, False), 4, "all", overrides, None)
    assert argv[-6:] == ["-m", launch.WORKER_MODULE, "--job.config_file", "c.toml", "--training.steps", "3"]
    assert argv[argv.index("--local-ranks-filter") + 1] == "0,1,2,3"
    assert launch.config_arguments("debug_dualpipe", "my_registry", True) == [
        "--module", "my_registry", "--config", "debug_dualpipe"]


def test_launcher_shows_a_rank_with_the_loss_by_default() -> None:
    """torchtitan's last-stage rule, rank 0 for ours; read from the TOML (0.2.2) or the config function (0.3.0)."""
    from titan_dualpipe import launch

    def shown(*overrides: str, nproc: int = 2) -> int:
        return launch._default_log_rank(config("debug_dualpipe"), launch.DEFAULT_MODULE, REGISTRY, list(overrides), nproc)

    assert shown() == 0
    assert shown("--parallelism.pipeline-parallel-schedule", "1F1B") == 1
    assert shown("--parallelism.pipeline_parallel_schedule=GPipe", "--parallelism.pipeline_parallel_degree", "4",
                 nproc=8) == 6


def test_launcher_takes_the_config_form_of_the_installed_torchtitan(tmp_path: Path) -> None:
    """A TOML for 0.2.2, a config name for 0.3.0; the other form, or an unknown name, is a
    ValueError that says what to give instead (checked for both releases on either)."""
    from titan_dualpipe import launch

    toml = str(CONFIGS / "debug_dualpipev.toml")
    launch._check_config(toml, "0.2.2")
    launch._check_config("debug_dualpipev", "0.3.0")
    with pytest.raises(ValueError, match=r"torchtitan 0.3.0 has no TOML configs.*e\.g\. debug_dualpipev.*"
                                         r"see docs/torchtitan\.md#shipped-configs"):
        launch._check_config(toml, "0.3.0")
    with pytest.raises(ValueError, match=r"torchtitan 0.2.2 reads TOML files.*train_configs/debug_dualpipev\.toml"):
        launch._check_config("debug_dualpipev", "0.2.2")
    with pytest.raises(ValueError, match="is not a file"):
        launch._check_config(str(tmp_path / "missing.toml"), "0.2.2")
    if REGISTRY:
        with pytest.raises(ValueError, match=r"'debug_dualpipeX' not found in .*'debug_dualpipev'"):
            launch.load_registry_config(launch.DEFAULT_MODULE, "debug_dualpipeX")
        with pytest.raises(ValueError, match="--module no_such_module: Cannot import module 'no_such_module'"):
            launch.load_registry_config("no_such_module", "debug_dualpipev")
        assert launch.load_registry_config("llama3", "llama3_debugmodel").parallelism.pipeline_parallel_degree == 1


def test_launcher_reports_a_ranks_own_error_before_the_stop_signals(tmp_path: Path) -> None:
    """torchrun stops the other ranks with SIGTERM once one fails; the report names the failed
    rank's error: its traceback when it wrote one, else the end of its stderr (a parse error)."""
    from types import SimpleNamespace

    from titan_dualpipe.launch import first_error

    def failure(exitcode: int, message: str, error_file: str = "", timestamp: int = 0) -> SimpleNamespace:
        return SimpleNamespace(exitcode=exitcode, message=message, error_file=error_file, timestamp=timestamp,
                               local_rank=None)

    stopped = failure(-15, "Signal 15 (SIGTERM) received by PID 7")
    error_file = tmp_path / "error.json"
    error_file.write_text("{}")
    raised = failure(1, {"message": "ValueError: bad microbatches"}, str(error_file))
    assert first_error({0: stopped, 1: raised}, None) == "[rank1]: ValueError: bad microbatches"
    assert first_error({0: stopped, 1: stopped}, None).startswith("[rank0]: Signal 15")
    log = tmp_path / "run_x" / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("[titan] starting\n\x1b[31mUnrecognized options: false\x1b[0m\n")
    parse_error = failure(2, "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
    parse_error.local_rank = 1
    report = first_error({0: stopped, 1: parse_error}, str(tmp_path))
    assert report.startswith("[rank1]: exit code 2") and report.endswith("Unrecognized options: false")
    earlier = failure(1, {"message": "RuntimeError: first"}, str(error_file))
    later_file = tmp_path / "later.json"
    later_file.write_text("{}")
    os.utime(later_file, (error_file.stat().st_mtime + 5,) * 2)
    later = failure(1, {"message": "RuntimeError: peer closed"}, str(later_file))
    assert first_error({0: later, 1: earlier}, None) == "[rank1]: RuntimeError: first"


def test_cli_works_without_torchtitan(tmp_path: Path) -> None:
    """Only the adapter needs torchtitan: the command line builds, `csv` runs, and `train` says what to install."""
    code = (
        "import sys; sys.modules['torchtitan'] = None\n"
        "import titan_dualpipe.torchtitan_version as v; v.installed = lambda package: None\n"
        "from titan_dualpipe.cli import main\n"
        f"assert main(['csv', '--schedule', 'DualPipe', '--pp', '2', '--microbatches', '4', '-o', {str(tmp_path / 'o.csv')!r}]) == 0\n"
        "sys.exit(main(['train', 'debug_dualpipev', '--nproc', '2']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "titan-dualpipe train: error: titan_dualpipe.titan needs torchtitan: pip install" in proc.stderr
    assert (tmp_path / "o.csv").is_file()


@pytest.mark.titan_e2e
def test_bad_config_stops_every_rank_before_any_collective(runs_dir: Path) -> None:
    """Each rank checks the config itself before init_process_group. torchrun stops the other
    ranks once it sees one has failed; its monitor is slowed to 20 s so that a late-starting
    rank (seconds behind on a loaded machine) reaches its own check first, and the test sees
    every rank's error."""
    run = train("debug_dualpipe", runs_dir / "bad", "--training.local_batch_size", "2",
                env={"PET_MONITOR_INTERVAL": "20"})
    assert run.returncode != 0
    text = ANSI.sub("", run.output)
    message = f"DualPipe needs at least 2 * {key('parallelism.pipeline_parallel_degree')} = 4 microbatches, got 2"
    assert message in text and key("training.local_batch_size") in text
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\]:ValueError: {re.escape(message)}", text), text[-4000:]
    assert AFTER_PROCESS_GROUP_LOG not in text  # stopped before the process group was used
    assert run.seconds < 120


@pytest.mark.titan_e2e
def test_a_killed_rank_is_named_by_the_other_rank_and_the_launcher(runs_dir: Path) -> None:
    """Rank 1 SIGKILLs itself in the middle of step 2 (its 6th forward). Rank 0, waiting on it,
    raises PeerFailed naming pipeline rank 1 (its neighbour's connection closed) well before the
    group timeout, and the launcher reports rank 0's error as the first real one (rank 1 wrote
    none). torchrun's monitor polls every 45 s, so its first poll comes well after the kill (about
    20-25 s from launch on a loaded 2-core machine) and it is rank 0 that stops the run: with a
    20 s poll, a slow start put the kill just before the poll, and torchrun stopped rank 0 first."""
    run = train("debug_dualpipe", runs_dir / "killed", probe=True,
                env={TEST_KILL_ENV: "1:6", "PET_MONITOR_INTERVAL": "45"})
    assert run.returncode != 0
    text = ANSI.sub("", run.output)
    assert re.search(r"\[rank0\]:.*PeerFailed: .*pipeline rank 1 \(global rank 1\)", text), text[-6000:]
    report = ANSI.sub("", run.stdout).split("first error:", 1)[1]
    assert report.lstrip().startswith("[rank0]:") and "PeerFailed" in report, report
    assert run.seconds < 120, run.seconds


@pytest.mark.titan_e2e
def test_launcher_reports_a_parse_error_not_the_stop_signal(runs_dir: Path) -> None:
    """A value torchtitan's parser rejects stops that rank with exit code 2 and no traceback file;
    torchrun then stops the others with SIGTERM. The launcher names the parser's message."""
    run = train("debug_dualpipe", runs_dir / "unparsable", "--checkpoint.last_save_model_only", "false")
    assert run.returncode == 1
    report = ANSI.sub("", run.stdout).split("first error:", 1)[1]  # the launcher's last words, on stdout
    assert "exit code 2" in report and "Unrecognized options" in report and "false" in report, report
    assert "SIGTERM" not in report and "To enable traceback" not in report
