"""The torchtitan runs several tests of tests/titan/ compare with, each trained once per session:
DualPipe (with checkpoints and the twin probe), its 1F1B twin config, and DualPipeV (overlapped
pairs run sequentially), each validated at steps 1, 3 and 6."""

from __future__ import annotations

from pathlib import Path

import pytest

from cases.titan_runs import CHECKPOINT_STEP, NO_OVERLAP, VALIDATION, Run, ok, train


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("titan")


@pytest.fixture(scope="session")
def dualpipe_run(runs_dir: Path) -> Run:
    return ok(train("debug_dualpipe", runs_dir / "dualpipe", "--checkpoint.enable",
                    "--checkpoint.interval", str(CHECKPOINT_STEP), *VALIDATION, probe=True))


@pytest.fixture(scope="session")
def one_f_one_b_run(runs_dir: Path) -> Run:
    return ok(train("debug_dualpipe", runs_dir / "1f1b",
                    "--parallelism.pipeline_parallel_schedule", "1F1B", *VALIDATION))


@pytest.fixture(scope="session")
def dualpipev_run(runs_dir: Path) -> Run:
    return ok(train("debug_dualpipev", runs_dir / "dualpipev", *NO_OVERLAP, *VALIDATION, probe=True))
