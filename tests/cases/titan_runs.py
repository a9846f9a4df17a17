"""torchtitan runs for the tests in tests/titan/: the shipped configs trained on CPU processes as a user
launches them (``python -m titan_dualpipe train``, or the plain ``torchrun ... -m torchtitan.train``),
what their logs and probes say, and how the installed torchtitan spells what the tests ask for.

Against the installed torchtitan: 0.2.2 (TOMLs, in ``.venv``) or 0.3.0 (config names, in the venv
that ``bootstrap.py --torchtitan 0.3.0`` makes); every assertion is the same for both. Runs with
``probe=True`` load ``tests/cases/titan_probe.py`` into the trainer processes (on 0.3.0 as the
``--module``: a config registry of one's own that imports ours).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from titan_dualpipe.launch import ANSI, dump_folder_flag, logged_steps, shipped_config
from titan_dualpipe.switches import TEST_PROBE_ENV
from titan_dualpipe.torchtitan_version import installed, uses_config_registry

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "train_configs"
PROBE_MODULE = "cases.titan_probe"  # tests/cases/titan_probe.py, importable in the trainer processes
STEPS = 6
CHECKPOINT_STEP = 3
SHORT_STEPS = 3  # steps 1-3 use the warm-up learning rates only: comparable with the 6-step runs
VALIDATION_LINE = re.compile(r"\[rank(\d+)\]:.*validate step:\s*(\d+)\s+loss:\s*(-?[\d.]+)")
COMPILE = ("--compile.enable", "--compile.components", "model,loss")

# How the installed torchtitan spells what these tests ask for.
TORCHTITAN = installed("torchtitan") or "0.2.2"
REGISTRY = uses_config_registry(TORCHTITAN)
DUMP_FOLDER = dump_folder_flag(REGISTRY)
if REGISTRY:  # 0.3.0: config functions, tyro flags in their CLI spelling, our dualpipe section
    VALIDATION = ("--validator.enable", "--validator.freq", "3")  # at steps 1, 3 and 6
    NO_OVERLAP = ("--dualpipe.no-overlap",)
    FULL_AC = ("activation-checkpoint:full",)  # a tyro subcommand: last on the command line
    FULL_AC_LOG = "Applied FullAC activation checkpointing"
    MEMORY_BUDGET_AC = (("activation-checkpoint:memory-budget",), "MemoryBudgetAC.Config()",
                        ("activation-checkpoint:selective", "activation-checkpoint:full"))
    AFTER_PROCESS_GROUP_LOG = "Building llama3 debugmodel"
else:  # 0.2.2: TOMLs
    VALIDATION = ("--validation.enable", "--validation.freq", "3")
    NO_OVERLAP = ("--parallelism.no-pipeline-parallel-expert-parallel-overlap",)
    FULL_AC = ("--activation_checkpoint.mode", "full")
    FULL_AC_LOG = "Applied full activation checkpointing"
    MEMORY_BUDGET_AC = (("--activation_checkpoint.mode", "memory_budget"), '[activation_checkpoint] mode = "memory_budget"',
                        ('"selective"', '"full"'))
    AFTER_PROCESS_GROUP_LOG = "Successfully created meshes"


def config(name: str) -> str:
    """A shipped config as the installed torchtitan takes it: its name (0.3.0) or its TOML (0.2.2)."""
    return shipped_config(name, REGISTRY)


def key(dotted: str) -> str:
    """Config field ``section.field`` as errors name it: CLI form (0.3.0), TOML form (0.2.2)."""
    section, name = dotted.split(".")
    return dotted if REGISTRY else f"[{section}] {name}"


# ---------------------------------------------------------------------------------------------
# Launching


@dataclass
class Run:
    returncode: int
    output: str  # stdout and stderr
    seconds: float
    out_dir: Path
    stdout: str = ""

    def logged(self) -> dict[int, dict[int, tuple[float, float]]]:
        """{rank: {step: (loss, grad_norm)}} from the console lines."""
        return logged_steps(self.output)

    def losses(self, rank: int = 0) -> dict[int, float]:
        return {step: loss for step, (loss, _) in self.logged().get(rank, {}).items()}

    def grad_norms(self, rank: int = 0) -> dict[int, float]:
        return {step: norm for step, (_, norm) in self.logged().get(rank, {}).items()}

    def validation_losses(self) -> dict[int, dict[int, float]]:
        """{rank: {step: validation loss}}."""
        table: dict[int, dict[int, float]] = {}
        for rank, step, loss in VALIDATION_LINE.findall(ANSI.sub("", self.output)):
            table.setdefault(int(rank), {})[int(step)] = float(loss)
        return table

    def probe(self, rank: int) -> dict:
        return json.loads((self.out_dir / f"probe_rank{rank}.json").read_text())


def train(name: str, out_dir: Path, *overrides: str, cwd: Path = ROOT, probe: bool = False,
          torchrun: bool = False, env: dict[str, str] | None = None, nproc: int = 2, steps: int = STEPS) -> Run:
    """Shipped config ``name`` on ``nproc`` processes, every rank's output shown with its "[rankN]:" prefix.

    ``python -m titan_dualpipe train`` by default; ``torchrun=True`` runs the plain cluster
    command (``torchrun ... -m torchtitan.train``), which loads us through ``custom_import``
    (0.2.2) or ``--module titan_dualpipe.titan`` (0.3.0).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **(env or {})}
    env.pop(TEST_PROBE_ENV, None)
    module = PROBE_MODULE if probe else "titan_dualpipe.titan"
    if probe:
        env[TEST_PROBE_ENV] = str(out_dir)
    probe_args = ["--experimental.custom_import", module] if probe and not REGISTRY else []
    titan_args = ["--module", module, "--config", name] if REGISTRY else ["--job.config_file", config(name)]
    if torchrun:
        launcher = ["torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--local-ranks-filter", "0,1",
                    "--role", "rank", "--tee", "3", "-m", "torchtitan.train", *titan_args]
    else:
        launcher = ["titan_dualpipe", "train", config(name), "--nproc", str(nproc), "--log-ranks", "all"]
        launcher += ["--module", module] if REGISTRY else []
    cmd = [sys.executable, "-m", *launcher, DUMP_FOLDER, str(out_dir), "--training.steps", str(steps), *probe_args,
           *overrides]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    run = Run(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start, out_dir, proc.stdout)
    (out_dir / "console.log").write_text(run.output)
    return run


def ok(run: Run) -> Run:
    assert run.returncode == 0, run.output[-6000:]
    return run


# ---------------------------------------------------------------------------------------------
# What the runs say


def assert_trains(losses: dict[int, float], steps: int = STEPS) -> None:
    assert sorted(losses) == list(range(1, steps + 1)), losses
    values = [losses[s] for s in sorted(losses)]
    assert all(math.isfinite(v) and v > 0 for v in values), values
    assert values[-1] < values[0] - 1.0, f"loss did not fall: {values}"


def assert_close(ours: dict[int, float], reference: dict[int, float], rel: float) -> None:
    assert sorted(ours) == sorted(reference)
    for step in reference:
        assert ours[step] == pytest.approx(reference[step], rel=rel), (step, ours, reference)


def assert_twins_identical(run: Run, rank0: int = 0, rank1: int = 1) -> None:
    """pp=2: pipeline rank 0 holds stages 0 (part 0) and 3 (part 1); rank 1 holds 1 (part 1) and 2 (part 0)."""
    first, second = run.probe(rank0)["stages"], run.probe(rank1)["stages"]
    assert set(first) == {"0", "3"} and set(second) == {"1", "2"}
    assert first["0"] == second["2"] and first["0"]
    assert second["1"] == first["3"] and second["1"]
    assert first["0"].keys().isdisjoint(first["3"].keys())


def job_config(name: str, *overrides: str):
    """Shipped config ``name`` (and ``overrides``) as torchtitan's parser gives it, in this process."""
    from torchtitan.config import ConfigManager

    titan_args = ["--module", "titan_dualpipe.titan", "--config", name] if REGISTRY else ["--job.config_file", config(name)]
    return ConfigManager().parse_args([*titan_args, *overrides])
