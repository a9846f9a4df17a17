"""torchtitan integration: end-to-end CPU runs (2 processes, gloo) and config checks.

The end-to-end runs are module fixtures shared by several tests, so each configuration is
trained once: DualPipe (with checkpoints, the twin probe), its 1F1B twin config, DualPipeV
(overlapped pairs run sequentially), DualPipeV from a CSV (launched from another directory), a
resume, one bad config, and the MoE debug model with expert parallelism (4 processes): DualPipe
with overlapped and with sequential pairs, and DualPipeV.

This file is also imported inside the trainer processes (``--experimental.custom_import
test_titan``) when ``PROBE_ENV`` is set: it then records, at ``Trainer.close``, each rank's
schedule class, its ``overlap`` setting, how many pairs ran as a relay and how often their
halves switched, and a hash of every parameter (and MoE expert bias) of every stage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "train_configs"
STEPS = 6
CHECKPOINT_STEP = 3
PROBE_ENV = "TITAN_DUALPIPE_TEST_PROBE_DIR"
LOG_LINE = re.compile(r"\[rank(\d+)\]:.*step:\s*(\d+)\s+loss:\s*(-?[\d.]+)\s+grad_norm:\s*([\d.]+)")
VALIDATION_LINE = re.compile(r"\[rank(\d+)\]:.*validate step:\s*(\d+)\s+loss:\s*(-?[\d.]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
VALIDATION = ("--validation.enable", "--validation.freq", "3")  # at steps 1, 3 and 6


# ---------------------------------------------------------------------------------------------
# Probe (runs inside the trainer processes)


def _param_hashes(module) -> dict[str, str]:
    """Parameters and MoE expert biases (routing state), this rank's shard of each."""
    tensors = [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if n.endswith("expert_bias"))]
    return {
        name: hashlib.sha1(getattr(t, "to_local", t.detach)().detach().contiguous().cpu().numpy().tobytes()).hexdigest()
        for name, t in tensors
    }


def _install_probe(out_dir: str) -> None:
    import torch.distributed as dist
    import torchtitan.train as titan_train
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    from titan_dualpipe.overlap import pair

    original_close = titan_train.Trainer.close
    relayed = {"pairs": 0, "hand_overs": 0}
    run_relayed = pair.run_relayed

    def counted_run_relayed(forward_half, backward_half):
        done = run_relayed(forward_half, backward_half)
        relayed["pairs"] += 1
        relayed["hand_overs"] += done.hand_overs
        return done

    pair.run_relayed = counted_run_relayed

    def close(self) -> None:
        schedule = getattr(self, "pp_schedule", None)
        if schedule is not None:
            record = {
                "schedule_mro": [c.__module__ + "." + c.__name__ for c in type(schedule).__mro__],
                "overlap_callback": OVERLAP_F_B in schedule._comp_type_to_function_map,
                "overlap": getattr(schedule, "overlap", None),
                "relayed": relayed,
                "stages": {str(s.stage_index): _param_hashes(s.submod) for s in schedule._stages},
            }
            path = Path(out_dir) / f"probe_rank{dist.get_rank()}.json"
            path.write_text(json.dumps(record))
        original_close(self)

    titan_train.Trainer.close = close


if os.environ.get(PROBE_ENV) and "torchtitan.train" in sys.modules:
    _install_probe(os.environ[PROBE_ENV])


# ---------------------------------------------------------------------------------------------
# Launching


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float
    out_dir: Path

    def logged(self) -> dict[int, dict[int, tuple[float, float]]]:
        """{rank: {step: (loss, grad_norm)}} from the console lines."""
        table: dict[int, dict[int, tuple[float, float]]] = {}
        for rank, step, loss, norm in LOG_LINE.findall(ANSI.sub("", self.output)):
            table.setdefault(int(rank), {})[int(step)] = (float(loss), float(norm))
        return table

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


def train(config: Path, out_dir: Path, *overrides: str, cwd: Path = ROOT, probe: bool = False,
          torchrun: bool = False, env: dict[str, str] | None = None, nproc: int = 2, steps: int = STEPS) -> Run:
    """``nproc`` processes, every rank's output shown with its "[rankN]:" prefix.

    ``python -m titan_dualpipe train`` by default; ``torchrun=True`` runs the plain cluster
    command (``torchrun ... -m torchtitan.train``), which loads us through ``custom_import``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **(env or {})}
    env.pop(PROBE_ENV, None)
    if probe:
        env[PROBE_ENV] = str(out_dir)
        overrides = (*overrides, "--experimental.custom_import", "test_titan")
    if torchrun:
        launcher = ["torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--local-ranks-filter", "0,1",
                    "--role", "rank", "--tee", "3", "-m", "torchtitan.train", "--job.config_file", str(config)]
    else:
        launcher = ["titan_dualpipe", "train", str(config), "--nproc", str(nproc), "--log-ranks", "all"]
    cmd = [sys.executable, "-m", *launcher, "--job.dump_folder", str(out_dir), "--training.steps", str(steps),
           *overrides]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    run = Run(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start, out_dir)
    (out_dir / "console.log").write_text(run.output)
    return run


def _ok(run: Run) -> Run:
    assert run.returncode == 0, run.output[-6000:]
    return run


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("titan")


@pytest.fixture(scope="module")
def dualpipe_run(runs_dir: Path) -> Run:
    return _ok(train(CONFIGS / "debug_dualpipe.toml", runs_dir / "dualpipe", "--checkpoint.enable",
                     "--checkpoint.interval", str(CHECKPOINT_STEP), *VALIDATION, probe=True))


@pytest.fixture(scope="module")
def one_f_one_b_run(runs_dir: Path) -> Run:
    return _ok(train(CONFIGS / "debug_dualpipe.toml", runs_dir / "1f1b",
                     "--parallelism.pipeline_parallel_schedule", "1F1B", *VALIDATION))


@pytest.fixture(scope="module")
def dualpipev_run(runs_dir: Path) -> Run:
    return _ok(train(CONFIGS / "debug_dualpipev.toml", runs_dir / "dualpipev",
                     "--parallelism.no-pipeline-parallel-expert-parallel-overlap", *VALIDATION, probe=True))


# ---------------------------------------------------------------------------------------------
# End-to-end


def _assert_trains(losses: dict[int, float], steps: int = STEPS) -> None:
    assert sorted(losses) == list(range(1, steps + 1)), losses
    values = [losses[s] for s in sorted(losses)]
    assert all(math.isfinite(v) and v > 0 for v in values), values
    assert values[-1] < values[0] - 1.0, f"loss did not fall: {values}"


def _assert_close(ours: dict[int, float], reference: dict[int, float], rel: float) -> None:
    assert sorted(ours) == sorted(reference)
    for step in reference:
        assert ours[step] == pytest.approx(reference[step], rel=rel), (step, ours, reference)


@pytest.mark.titan_e2e
def test_dualpipe_matches_1f1b(dualpipe_run: Run, one_f_one_b_run: Run) -> None:
    """Same model split and initial weights as 1F1B: same losses, and a grad norm that
    counts each twin once (counted twice it would be sqrt(2) larger)."""
    _assert_trains(dualpipe_run.losses())
    _assert_trains(one_f_one_b_run.losses(rank=1))  # 1F1B: the last PP rank has the loss
    _assert_close(dualpipe_run.losses(), one_f_one_b_run.losses(rank=1), rel=1e-4)
    _assert_close(dualpipe_run.grad_norms(), one_f_one_b_run.grad_norms(rank=1), rel=1e-4)


def _assert_twins_identical(run: Run, rank0: int = 0, rank1: int = 1) -> None:
    """pp=2: pipeline rank 0 holds stages 0 (part 0) and 3 (part 1); rank 1 holds 1 (part 1) and 2 (part 0)."""
    first, second = run.probe(rank0)["stages"], run.probe(rank1)["stages"]
    assert set(first) == {"0", "3"} and set(second) == {"1", "2"}
    assert first["0"] == second["2"] and first["0"]
    assert second["1"] == first["3"] and second["1"]
    assert first["0"].keys().isdisjoint(first["3"].keys())


@pytest.mark.titan_e2e
def test_dualpipe_twins_identical_at_end(dualpipe_run: Run) -> None:
    _assert_twins_identical(dualpipe_run)


@pytest.mark.titan_e2e
def test_our_classes_run_without_torchtitans_overlap_callback(dualpipe_run: Run, dualpipev_run: Run) -> None:
    for run, name in ((dualpipe_run, "ScheduleDualPipe"), (dualpipev_run, "ScheduleDualPipeV")):
        for rank in (0, 1):
            record = run.probe(rank)
            assert record["schedule_mro"][0] == f"titan_dualpipe.runtime.schedules.{name}"
            assert "torch.distributed.pipelining.schedules.ScheduleDualPipeV" not in record["schedule_mro"]
            assert not record["overlap_callback"]
            # [parallelism] pipeline_parallel_expert_parallel_overlap: default true, off for the DualPipeV run
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
    _assert_close(dualpipe_run.validation_losses()[0], reference, rel=1e-4)


@pytest.mark.titan_e2e
def test_dualpipev_trains_close_to_1f1b(dualpipev_run: Run, one_f_one_b_run: Run) -> None:
    """Four stages instead of two draw other initial weights: close, not equal."""
    _assert_trains(dualpipev_run.losses())
    _assert_close(dualpipev_run.losses(), one_f_one_b_run.losses(rank=1), rel=0.05)


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
    run = _ok(train(CONFIGS / "debug_dualpipev.toml", runs_dir / "csv",
                    "--parallelism.pipeline_parallel_schedule_csv", str(csv), cwd=elsewhere))
    assert "from " + str(csv) in run.output
    assert "pairs run sequentially" in dualpipev_run.output and "pairs run sequentially" not in run.output
    _assert_close(run.losses(), dualpipev_run.losses(), rel=1e-6)


@pytest.mark.titan_e2e
def test_dualpipe_resume_continues_with_same_losses(runs_dir: Path, dualpipe_run: Run) -> None:
    """Resumed with the plain torchrun command line (our module loaded by custom_import)."""
    resumed_dir = runs_dir / "resumed"
    step_dir = f"step-{CHECKPOINT_STEP}"
    shutil.copytree(dualpipe_run.out_dir / "checkpoint" / step_dir, resumed_dir / "checkpoint" / step_dir)
    run = _ok(train(CONFIGS / "debug_dualpipe.toml", resumed_dir, "--checkpoint.enable",
                    "--checkpoint.interval", str(CHECKPOINT_STEP), torchrun=True))
    assert f"Training starts at step {CHECKPOINT_STEP + 1}" in run.output
    expected = {s: v for s, v in dualpipe_run.losses().items() if s > CHECKPOINT_STEP}
    assert run.losses() == expected
    assert run.losses(rank=1) == expected


@pytest.mark.titan_e2e
def test_bad_config_stops_every_rank_before_any_collective(runs_dir: Path) -> None:
    """Each rank checks the config itself before init_process_group. torchrun stops the other
    ranks once one has failed; a 3 s monitor interval lets a late-starting rank reach its own
    check first, so the test sees every rank's error."""
    run = train(CONFIGS / "debug_dualpipe.toml", runs_dir / "bad", "--training.local_batch_size", "2",
                env={"PET_MONITOR_INTERVAL": "3"})
    assert run.returncode != 0
    text = ANSI.sub("", run.output)
    message = "DualPipe needs at least 2 * [parallelism] pipeline_parallel_degree = 4 microbatches, got 2"
    assert message in text and "[training] local_batch_size" in text
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\]:ValueError: {re.escape(message)}", text), text[-4000:]
    assert "Successfully created meshes" not in text  # stopped before the process group was used
    assert run.seconds < 120


@pytest.mark.titan_e2e
def test_moe_dualpipe_expert_parallel_on_4_processes(runs_dir: Path) -> None:
    """deepseek_v3 MoE debug model, pp=2 x EP 2 on CPU. Twins (global ranks 0/2 and 1/3 hold
    the same parts, same expert shard) end with identical weights and expert biases: each
    copy counts the twin's routed tokens too before the bias update.

    The pairs' halves switch at torchtitan's expert-parallel all-to-all; a run with the
    pairs sequential ends with bitwise the same weights and logs the same losses. (Both use
    deterministic algorithms: without them this MoE model is not bitwise reproducible on
    CPU even between two identical sequential runs.)"""
    steps = 5
    deterministic = "--debug.deterministic"
    run = _ok(train(CONFIGS / "debug_moe_dualpipe.toml", runs_dir / "moe", deterministic, probe=True, nproc=4,
                    steps=steps))
    _assert_trains(run.losses(), steps)
    logged = run.logged()
    assert sorted(logged) == [0, 1, 2, 3] and all(logged[rank] == logged[0] for rank in logged)
    assert any(name.endswith("moe.expert_bias") for name in run.probe(0)["stages"]["0"])
    _assert_twins_identical(run, 0, 2)
    _assert_twins_identical(run, 1, 3)

    sequential = _ok(train(CONFIGS / "debug_moe_dualpipe.toml", runs_dir / "moe_sequential", deterministic,
                           "--parallelism.no-pipeline-parallel-expert-parallel-overlap", probe=True, nproc=4,
                           steps=steps))
    assert sequential.logged() == logged
    for rank in range(4):
        relayed, plain = run.probe(rank), sequential.probe(rank)
        assert relayed["relayed"]["hand_overs"] > 0 and plain["relayed"]["pairs"] == 0, (relayed, plain)
        assert relayed["stages"] == plain["stages"]


@pytest.mark.titan_e2e
def test_moe_dualpipev_expert_parallel_overlaps_on_4_processes(runs_dir: Path) -> None:
    """The same model under DualPipeV with full activation checkpointing (the backward half
    recomputes each block's exchanges): it trains and every rank's pairs switch halves at
    torchtitan's expert-parallel all-to-all."""
    steps = 4
    run = _ok(train(CONFIGS / "debug_moe_dualpipe.toml", runs_dir / "moe_v", "--parallelism.pipeline_parallel_schedule",
                    "DualPipeV", "--activation_checkpoint.mode", "full", probe=True, nproc=4, steps=steps))
    assert "Applied full activation checkpointing" in run.output
    _assert_trains(run.losses(), steps)
    assert sorted(run.logged()) == [0, 1, 2, 3]
    for rank in range(4):
        assert run.probe(rank)["schedule_mro"][0] == "titan_dualpipe.runtime.schedules.ScheduleDualPipeV"
        assert run.probe(rank)["relayed"]["hand_overs"] > 0, run.probe(rank)["relayed"]


# ---------------------------------------------------------------------------------------------
# In-process checks (no trainer processes)


def _job_config(config: Path, *overrides: str):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(config), *overrides])


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_train_configs_load_and_validate(config: Path) -> None:
    import titan_dualpipe.titan as adapter
    from titan_dualpipe.titan.trainer_hooks import _n_layers

    job = _job_config(config)
    assert job.experimental.custom_import == "titan_dualpipe.titan"
    plan = adapter.check_job_config(job, _n_layers(job))
    assert plan is not None and plan.schedule == adapter.our_schedule(job.parallelism.pipeline_parallel_schedule)


GPU_CONFIGS = {  # config -> the world it is written for (the README's launch commands)
    "llama3_8b_dualpipev.toml": {"world": 8, "pp": 4, "dp_shard": 2, "ep": 1, "stages": 8},
    "deepseek_v3_16b_dualpipe.toml": {"world": 16, "pp": 4, "dp_shard": 4, "ep": 4, "stages": 8},
}


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_configs_fit_the_world_they_declare(name: str) -> None:
    """The GPU starting points, through torchtitan's parser, its parallel-dims validation for
    their world size, the model flavour's layers and experts, and our config checks."""
    import titan_dualpipe.titan as adapter
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.train_spec import get_train_spec

    expected = GPU_CONFIGS[name]
    job = _job_config(CONFIGS / name)
    par = job.parallelism
    dims = ParallelDims(dp_shard=par.data_parallel_shard_degree, dp_replicate=par.data_parallel_replicate_degree,
                        cp=par.context_parallel_degree, tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
                        ep=par.expert_parallel_degree, etp=par.expert_tensor_parallel_degree, world_size=expected["world"])
    assert (dims.pp, dims.dp_shard, dims.ep) == (expected["pp"], expected["dp_shard"], expected["ep"])
    model = get_train_spec(job.model.name).model_args[job.model.flavor]
    plan = adapter.check_job_config(job, model.n_layers)
    assert plan is not None and 2 * plan.pp == expected["stages"] and plan.n_microbatches >= 2 * plan.pp
    moe = getattr(model, "moe_args", None)
    if dims.ep > 1:
        assert moe is not None and moe.num_experts % dims.ep == 0
        assert (dims.dp_shard * dims.cp) % dims.ep == 0, "torchtitan shards experts inside the FSDP x CP group"
    assert not job.compile.enable and job.activation_checkpoint.mode in ("selective", "full")


@pytest.mark.parametrize(
    "overrides, keys",
    [
        (["--parallelism.pipeline_parallel_degree", "3"], ["[parallelism] pipeline_parallel_degree", "got 3", "2 or 4"]),
        (["--training.local_batch_size", "6", "--parallelism.pipeline_parallel_microbatch_size", "2"],
         ["microbatches", "[training] local_batch_size", "pipeline_parallel_microbatch_size"]),
        (["--training.local_batch_size", "7", "--parallelism.pipeline_parallel_microbatch_size", "2"],
         ["[training] local_batch_size = 7", "[parallelism] pipeline_parallel_microbatch_size = 2"]),
        (["--parallelism.pipeline_parallel_layers_per_stage", "2"],
         ["[parallelism] pipeline_parallel_layers_per_stage = 2", "remove it"]),
        (["--parallelism.pipeline_parallel_degree", "10", "--training.local_batch_size", "20"],
         ["[parallelism] pipeline_parallel_degree = 10", "pipeline_parallel_first_stage_less_layers"]),
        (["--validation.enable", "--validation.local_batch_size", "12"],
         ["[validation] local_batch_size = 12", "8 microbatches", "Set it to 8"]),
        (["--compile.enable"], ["[compile] enable = true", "pytorch#161904", 'components = ["loss"]']),
    ],
    ids=["odd-pp", "too-few-microbatches", "batch-not-multiple", "layers-per-stage", "too-many-parts", "validation-batch",
         "compiled-model"],
)
def test_bad_dualpipe_configs_name_the_keys(overrides: list[str], keys: list[str]) -> None:
    from titan_dualpipe.titan import check_job_config

    with pytest.raises(ValueError) as err:
        check_job_config(_job_config(CONFIGS / "debug_dualpipe.toml", *overrides), n_layers=6)
    for key in keys:
        assert key in str(err.value)


def test_bad_dualpipev_stage_counts_name_the_keys(tmp_path: Path) -> None:
    from titan_dualpipe.titan import check_job_config

    job = _job_config(CONFIGS / "debug_dualpipev.toml", "--parallelism.pipeline_parallel_layers_per_stage", "4")
    with pytest.raises(ValueError, match=r"pipeline_parallel_layers_per_stage = 4 .* into 2: .*set it to 2"):
        check_job_config(job, n_layers=6)  # (6 layers + 2) / 4 = 2 stages; DualPipeV needs 4
    job = _job_config(CONFIGS / "debug_dualpipev.toml")
    job.parallelism.module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    with pytest.raises(ValueError, match=r"needs 4 model parts .*module_fqns_per_model_part lists 2"):
        check_job_config(job, n_layers=6)
    csv = tmp_path / "pp4.csv"
    from titan_dualpipe import compute_order
    from titan_dualpipe.orders.csv_io import write_csv

    with csv.open("w", newline="") as f:
        write_csv(compute_order("DualPipeV", 4, 8), f)
    with pytest.raises(ValueError, match=r"4 rows .*pipeline_parallel_degree = 2.*titan-dualpipe csv"):
        check_job_config(_job_config(CONFIGS / "debug_dualpipev.toml",
                                     f"--parallelism.pipeline_parallel_schedule_csv={csv}"), n_layers=6)


def test_schedule_names_resolve_case_insensitively_and_others_unchanged() -> None:
    import titan_dualpipe.titan  # noqa: F401 - installs the registration
    from torch.distributed.pipelining import schedules as torch_schedules
    from torchtitan.distributed import pipeline_parallel

    from titan_dualpipe import ScheduleDualPipe, ScheduleDualPipeV

    lookup = pipeline_parallel.get_schedule_class
    for name in ("DualPipeV", "dualpipev", "DUALPIPEV"):
        assert lookup(name) is ScheduleDualPipeV
    for name in ("DualPipe", "dualpipe"):
        assert lookup(name) is ScheduleDualPipe
    assert not issubclass(ScheduleDualPipeV, torch_schedules.ScheduleDualPipeV)
    for name in ("1F1B", "interleaved1f1b", "GPipe", "ZBVZeroBubble", "PipelineScheduleMulti"):
        assert lookup(name) is torch_schedules.get_schedule_class(name)
    with pytest.raises(ValueError, match="Unknown schedule name 'DualPipeX'"):
        lookup("DualPipeX")


def test_dual_pipe_v_flag_off_for_our_names_only() -> None:
    """torchtitan's EP SyncHooks / AC refusal keyed on "dualpipev": not for our schedules."""
    from types import SimpleNamespace

    import titan_dualpipe.titan  # noqa: F401 - installs the patches
    from torchtitan.distributed import dual_pipe_v
    from torchtitan.protocols.train_spec import get_train_spec

    from titan_dualpipe.titan.pipeline import make_dual_pipe_v_flag

    def job(name: str) -> SimpleNamespace:
        par = SimpleNamespace(pipeline_parallel_schedule=name, pipeline_parallel_expert_parallel_overlap=True)
        return SimpleNamespace(parallelism=par, activation_checkpoint=SimpleNamespace(mode="full"))

    dims = SimpleNamespace(ep_enabled=True, pp_enabled=True)
    parallelize = sys.modules[get_train_spec("deepseek_v3").parallelize_fn.__module__]
    for flag in (dual_pipe_v.get_dual_pipe_v_flag, parallelize.get_dual_pipe_v_flag):
        assert flag(job("DualPipeV"), dims) is False  # torchtitan's own raises NotImplementedError (AC)
    flag = make_dual_pipe_v_flag(lambda job, dims: "torchtitan's answer")
    assert flag(job("dualpipev"), dims) is False and flag(job("DualPipe"), dims) is False
    assert flag(job("1F1B"), dims) == flag(job("ZBVZeroBubble"), dims) == "torchtitan's answer"


def test_cpu_integer_histc_is_exact() -> None:
    import torch

    from titan_dualpipe.titan.cpu_moe import TorchWithIntegerHistc

    histc = TorchWithIntegerHistc().histc
    values = torch.randint(-3, 12, (1000,), generator=torch.Generator().manual_seed(0))
    for bins, low, high in ((8, 0, 8), (5, 0, 10), (4, -2, 2), (3, 0, 0)):
        counts = histc(values, bins=bins, min=low, max=high)
        assert counts.dtype == torch.int64
        assert torch.equal(counts, torch.histc(values.double(), bins, low, high).long())
    floats = torch.rand(100)
    assert torch.equal(histc(floats, bins=4, min=0, max=1), torch.histc(floats, 4, 0, 1))


def test_cpu_mode_only_without_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torchtitan.components import metrics
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    from titan_dualpipe.titan import cpu

    assert cpu.enable() and utils.device_type == "cpu" and dist_utils.device_type == "cpu"
    assert metrics.device_module.current_device() == 0
    assert metrics.device_module.get_device_properties().total_memory > 0
    monkeypatch.setattr(torch._utils, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(utils, "device_type", "cuda")
    assert not cpu.enable() and utils.device_type == "cuda"


def test_shipped_assets_found_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_dualpipe.titan.data import resolve_asset_path

    monkeypatch.chdir(tmp_path)
    resolved = resolve_asset_path("./titan_dualpipe/titan/assets/tokenizer")
    assert resolved is not None and (Path(resolved) / "tokenizer.json").is_file()
    assert resolve_asset_path("assets/missing") == "assets/missing"
    size = sum(f.stat().st_size for f in (ROOT / "titan_dualpipe/titan/assets").rglob("*") if f.is_file())
    assert size < 1_000_000


def test_launcher_options_may_follow_the_config() -> None:
    from titan_dualpipe.titan import launch

    parser = argparse.ArgumentParser()
    launch.add_parser(parser.add_subparsers())
    args = parser.parse_args(["train", "c.toml", "--training.steps", "3", "--nproc", "4", "--log-ranks", "1"])
    args, overrides = launch.split_arguments(args)
    assert (args.nproc, args.log_ranks, overrides) == (4, "1", ["--training.steps", "3"])
    argv = launch.torchrun_argv("c.toml", 4, "all", overrides, None)
    assert argv[-6:] == ["-m", launch.WORKER_MODULE, "--job.config_file", "c.toml", "--training.steps", "3"]
    assert argv[argv.index("--local-ranks-filter") + 1] == "0,1,2,3"
    # Shown by default: a rank with the loss (torchtitan's last-stage rule, rank 0 for ours).
    config = str(CONFIGS / "debug_dualpipe.toml")
    assert launch.loss_rank(config, [], 2) == 0
    assert launch.loss_rank(config, ["--parallelism.pipeline-parallel-schedule", "1F1B"], 2) == 1
    assert launch.loss_rank(config, ["--parallelism.pipeline_parallel_schedule=GPipe",
                                     "--parallelism.pipeline_parallel_degree", "4"], 8) == 6


def _twin_counts_worker(rank: int, init_file: str, results) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from titan_dualpipe.titan.moe_twins import sum_twin_counts

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    parts = {}
    for part in (0, 1):  # both ranks hold parts 0 and 1 (pp=2), each saw other microbatches
        module = nn.Module()
        module.register_buffer("tokens_per_expert", torch.full((4,), float(10 * rank + part)))
        parts[part] = nn.ModuleDict({"moe": module})
    sum_twin_counts(parts, peer=1 - rank, group=None)
    results[rank] = [parts[p].moe.tokens_per_expert.tolist() for p in (0, 1)]
    dist.destroy_process_group()


def test_moe_twin_expert_counts_summed(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_twin_counts_worker, args=(str(tmp_path / "init"), results), nprocs=2)
    assert results[0] == results[1] == [[10.0] * 4, [12.0] * 4]


def test_untested_torchtitan_is_refused_by_name() -> None:
    from titan_dualpipe.titan import TORCHTITAN_VERSION, check_torchtitan_version

    assert TORCHTITAN_VERSION == "0.2.2"
    with pytest.raises(ImportError, match=r"supports torchtitan 0.2.2; found torchtitan 0.1.0"):
        check_torchtitan_version("0.1.0")
