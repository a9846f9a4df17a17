"""DualPipeV at ``pipeline_parallel_degree`` 1 under torchtitan: a V of two stages on one rank.

torchtitan pipelines only above degree 1, so by itself it would train such a config without any
pipeline; the adapter makes it take its pipeline path for this one plan (a real "pp" group of one
rank, our schedule), which is what runs on a single GPU (NCCL allows one rank per GPU). The config
checks and torchtitan's parallel dims are checked in this process; one end-to-end run (1 process,
gloo) trains through our schedule and logs the unpipelined model's losses.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from cases.dist_pool import one_rank_process_group
from cases.titan_runs import PROBE_MODULE
from titan_dualpipe.launch import ANSI, dump_folder_flag, logged_steps, shipped_config
from titan_dualpipe.switches import TEST_PROBE_ENV
from titan_dualpipe.torchtitan_version import installed, uses_config_registry

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = uses_config_registry(installed("torchtitan") or "0.2.2")
ONE_RANK = ("--parallelism.pipeline_parallel_degree", "1")
STEPS = 3


def _job_config(name: str, *overrides: str):
    from torchtitan.config import ConfigManager

    titan_args = (["--module", "titan_dualpipe.titan", "--config", name] if REGISTRY
                  else ["--job.config_file", shipped_config(name, False)])
    return ConfigManager().parse_args([*titan_args, *overrides])


def _key(dotted: str) -> str:
    section, name = dotted.split(".")
    return dotted if REGISTRY else f"[{section}] {name}"


def test_dualpipev_at_degree_1_is_planned_as_a_one_rank_v():
    from titan_dualpipe.titan import Plan, check_job_config

    assert check_job_config(_job_config("debug_dualpipev", *ONE_RANK), n_layers=6) == Plan("DualPipeV", 1, 8)
    # torchtitan's answer stays for every other schedule at degree 1: no pipeline, no plan
    assert check_job_config(_job_config("debug_dualpipe", *ONE_RANK), n_layers=6) is None
    assert check_job_config(_job_config("debug_dualpipev", *ONE_RANK, "--parallelism.pipeline_parallel_schedule",
                                        "1F1B"), n_layers=6) is None
    with pytest.raises(ValueError, match=re.escape(f"DualPipeV needs at least 2 * {_key('parallelism.pipeline_parallel_degree')}"
                                                   " = 2 microbatches, got 1")):
        check_job_config(_job_config("debug_dualpipev", *ONE_RANK, "--training.local_batch_size", "1"), n_layers=6)


@pytest.fixture(scope="module")
def world_of_one():
    yield from one_rank_process_group()


def _parallel_dims(job):
    """torchtitan's parallel dims of ``job`` on one process."""
    from torchtitan.distributed import ParallelDims

    par = job.parallelism
    if REGISTRY:
        return ParallelDims.from_config(par, 1)
    return ParallelDims(dp_shard=par.data_parallel_shard_degree, dp_replicate=par.data_parallel_replicate_degree,
                        cp=par.context_parallel_degree, tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
                        ep=par.expert_parallel_degree, etp=par.expert_tensor_parallel_degree, world_size=1)


def test_torchtitan_pipelines_a_one_rank_v_over_a_group_of_one(world_of_one, monkeypatch):
    """With the one-rank V planned, torchtitan's parallel dims enable pipeline parallelism and give
    the "pp" dimension a real process group (at degree 1 it is otherwise a placeholder, which
    ``get_mesh`` refuses); planned otherwise, they keep torchtitan's answers."""
    import titan_dualpipe.titan as adapter
    from titan_dualpipe.titan.active import ACTIVE

    job = _job_config("debug_dualpipev", *ONE_RANK)
    monkeypatch.setattr(ACTIVE, "plan", adapter.check_job_config(job, n_layers=6))
    dims = _parallel_dims(job)
    assert dims.pp == 1 and dims.pp_enabled
    mesh = dims.get_mesh("pp")
    assert mesh.size() == 1 and dist.get_backend(mesh.get_group()) == dist.get_backend(world_of_one)
    for plan in (None, adapter.Plan("DualPipeV", 2, 8)):  # no plan of ours; a plan of two pipeline ranks
        monkeypatch.setattr(ACTIVE, "plan", plan)
        dims = _parallel_dims(job)
        assert not dims.pp_enabled and dims.get_optional_mesh("pp") is None


def _train(out_dir: Path, *overrides: str, probe: bool = False) -> str:
    """``titan-dualpipe train debug_dualpipev --nproc 1`` (with ``tests/cases/titan_probe.py`` loaded
    when ``probe``); its output."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    module = PROBE_MODULE if probe else "titan_dualpipe.titan"
    if probe:
        env[TEST_PROBE_ENV] = str(out_dir)
    argv = [sys.executable, "-m", "titan_dualpipe", "train", shipped_config("debug_dualpipev", REGISTRY),
            "--nproc", "1", "--log-ranks", "all"]
    argv += ["--module", module] if REGISTRY else []
    argv += [dump_folder_flag(REGISTRY), str(out_dir), "--training.steps", str(STEPS), *ONE_RANK, *overrides]
    argv += ["--experimental.custom_import", module] if probe and not REGISTRY else []
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


@pytest.mark.titan_e2e
def test_one_rank_v_trains_through_our_schedule_as_the_unpipelined_model(tmp_path: Path):
    """One process: DualPipeV's two stages on rank 0, overlapped pairs run as relays, the losses of
    torchtitan's unpipelined run of the same model (same initial weights, same data); the grad
    norm differs from it only by torchtitan's scale of the pipelined loss, the same every step."""
    import json

    ours = _train(tmp_path / "v", probe=True)
    plain = _train(tmp_path / "plain", "--parallelism.pipeline_parallel_schedule", "1F1B")
    assert "Using titan_dualpipe DualPipeV with 8 microbatches and 2 stages" in ANSI.sub("", ours)
    record = json.loads((tmp_path / "v" / "probe_rank0.json").read_text())
    assert record["schedule_mro"][0] == "titan_dualpipe.overlap.schedules.ScheduleDualPipeV"
    assert set(record["stages"]) == {"0", "1"} and record["relayed"]["pairs"] > 0
    (v_steps,), (plain_steps,) = logged_steps(ours).values(), logged_steps(plain).values()
    assert sorted(v_steps) == sorted(plain_steps) == list(range(1, STEPS + 1))
    for step, (loss, _) in plain_steps.items():
        assert math.isfinite(loss) and v_steps[step][0] == pytest.approx(loss, rel=2e-5), (v_steps, plain_steps)
    scales = [v_steps[step][1] / norm for step, (_, norm) in plain_steps.items()]
    assert scales == pytest.approx([scales[0]] * STEPS, rel=1e-3), (v_steps, plain_steps)
