"""torchtitan integration: end-to-end CPU runs (2 processes, gloo) and config checks, against the
installed torchtitan: 0.2.2 (TOMLs, in ``.venv``) or 0.3.0 (config names, in the venv that
``bootstrap.py --torchtitan 0.3.0`` makes). The module-level table below says how each release
spells what the tests ask for; every assertion is the same for both.

The end-to-end runs are module fixtures shared by several tests, so each configuration is
trained once: DualPipe (with checkpoints, the twin probe), its 1F1B twin config, DualPipeV
(overlapped pairs run sequentially), DualPipeV from a CSV (launched from another directory), a
resume, one bad config, one unparsable override, and the MoE debug model with expert
parallelism (4 processes): DualPipe with overlapped and with sequential pairs, and DualPipeV; the
debug model with torchtitan's compiled blocks (inductor) under DualPipeV and DualPipe.
Runs with ``probe=True`` load ``tests/titan_probe.py`` into the trainer processes (on 0.3.0 as
the ``--module``: a config registry of one's own that imports ours).
"""

from __future__ import annotations

import argparse
import ast
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

from titan_dualpipe.launch import ANSI, dump_folder_flag, logged_steps, shipped_config
from titan_dualpipe.orders import compute_order
from titan_dualpipe.orders.two_batch import lone_forwards, paired_backwards
from titan_dualpipe.switches import (FOLD_ENV, NOT_DEFERRED_ENV, TEST_KILL_ENV, TEST_PROBE_ENV, TWO_BATCH_ENV,
                                     WEIGHT_GRADIENTS_ENV, WEIGHTS_IN_FLIGHT_ENV)
from titan_dualpipe.torchtitan_version import installed, uses_config_registry

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "train_configs"
REGISTRY_FILE = ROOT / "titan_dualpipe" / "titan" / "config_registry.py"
STEPS = 6
CHECKPOINT_STEP = 3
VALIDATION_LINE = re.compile(r"\[rank(\d+)\]:.*validate step:\s*(\d+)\s+loss:\s*(-?[\d.]+)")

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
    module = "titan_probe" if probe else "titan_dualpipe.titan"
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


def _ok(run: Run) -> Run:
    assert run.returncode == 0, run.output[-6000:]
    return run


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("titan")


@pytest.fixture(scope="module")
def dualpipe_run(runs_dir: Path) -> Run:
    return _ok(train("debug_dualpipe", runs_dir / "dualpipe", "--checkpoint.enable",
                     "--checkpoint.interval", str(CHECKPOINT_STEP), *VALIDATION, probe=True))


@pytest.fixture(scope="module")
def one_f_one_b_run(runs_dir: Path) -> Run:
    return _ok(train("debug_dualpipe", runs_dir / "1f1b",
                     "--parallelism.pipeline_parallel_schedule", "1F1B", *VALIDATION))


@pytest.fixture(scope="module")
def dualpipev_run(runs_dir: Path) -> Run:
    return _ok(train("debug_dualpipev", runs_dir / "dualpipev", *NO_OVERLAP, *VALIDATION, probe=True))


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
    run = _ok(train("debug_dualpipev", runs_dir / "csv",
                    "--parallelism.pipeline_parallel_schedule_csv", str(csv), cwd=elsewhere))
    assert "from " + str(csv) in run.output
    assert "pairs run sequentially" in dualpipev_run.output and "pairs run sequentially" not in run.output
    _assert_close(run.losses(), dualpipev_run.losses(), rel=1e-6)


@pytest.mark.titan_e2e
def test_dualpipe_resume_continues_with_same_losses(runs_dir: Path, dualpipe_run: Run) -> None:
    """Resumed with the plain torchrun command line (our module loaded by custom_import or --module)."""
    resumed_dir = runs_dir / "resumed"
    step_dir = f"step-{CHECKPOINT_STEP}"
    shutil.copytree(dualpipe_run.out_dir / "checkpoint" / step_dir, resumed_dir / "checkpoint" / step_dir)
    run = _ok(train("debug_dualpipe", resumed_dir, "--checkpoint.enable",
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
    run = _ok(train("debug_dualpipe", extended, "--checkpoint.enable", steps=STEPS + 2))
    assert f"Training starts at step {STEPS + 1}" in run.output
    losses = run.losses()
    assert sorted(losses) == [STEPS + 1, STEPS + 2] and all(0 < v < dualpipe_run.losses()[1] for v in losses.values())


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


def _seed_checkpoint(runs_dir: Path, name: str) -> list[str]:
    """torchtitan's seed checkpoint of ``name`` (one process, no parallelism), and the
    overrides that start a run from it: the same initial weights under any layout."""
    seed = runs_dir / f"{name}_seed"
    _ok(train(name, seed, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
              "--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.pipeline_parallel_degree", "1",
              "--parallelism.expert_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", "1", nproc=1))
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed / "checkpoint" / "step-0")]


def _assert_expert_biases_identical(run: Run, rank0: int, rank1: int) -> None:
    """Twins folded into FSDP are one parameter (each rank hashes its shard); their MoE routing
    state is not a parameter: the two copies of each part must hold the same expert biases."""
    def biases(rank: int, stage: str) -> dict[str, str]:
        return {k: v for k, v in run.probe(rank)["stages"][stage].items() if "expert_bias" in k}

    assert biases(rank0, "0") == biases(rank1, "2") and biases(rank0, "0")
    assert biases(rank1, "1") == biases(rank0, "3") and biases(rank1, "1")


@pytest.mark.titan_e2e
def test_moe_dualpipe_expert_parallel_on_4_processes(runs_dir: Path) -> None:
    """deepseek_v3 MoE debug model, pp=2 x EP 2 on CPU. Twins (global ranks 0/2 and 1/3 hold
    the same parts, same expert shard) keep the same expert biases: each copy counts the twin's
    routed tokens too before the bias update. The twins are folded into FSDP (each part sharded
    over all 4 ranks; on 0.3.0 under ``spmd_backend = "partial_dtensor"``); a run that sums
    them by an exchange instead (0.2.2: ``TITAN_DUALPIPE_FOLD_TWINS=0``; 0.3.0: its default
    ``spmd_types`` backend), from the same seed checkpoint, ends with identical twins and logs
    the same losses and grad norms (within float summation order; a twin counted twice or not
    at all would be sqrt(2) or 2x off).

    The pairs' halves switch at torchtitan's expert-parallel all-to-all; a run with the
    pairs sequential ends with bitwise the same weights and logs the same losses. (These use
    deterministic algorithms: without them this MoE model is not bitwise reproducible on
    CPU even between two identical sequential runs.)"""
    steps = 3
    common = ["--debug.deterministic", *_seed_checkpoint(runs_dir, "debug_moe_dualpipe")]
    folding = [*common, "--parallelism.spmd_backend", "partial_dtensor"] if REGISTRY else common
    run = _ok(train("debug_moe_dualpipe", runs_dir / "moe", *folding, probe=True, nproc=4, steps=steps))
    _assert_trains(run.losses(), steps)
    logged = run.logged()
    assert sorted(logged) == [0, 1, 2, 3] and all(logged[rank] == logged[0] for rank in logged)
    assert all(run.probe(rank)["folded"] is True for rank in range(4)) and "twins folded into FSDP" in run.output
    assert "token counts exchanged on their own communicator (expert-parallel ranks" in run.output
    assert "CPU mode: FSDP computes in float32" in run.output
    assert any("moe.expert_bias" in name for name in run.probe(0)["stages"]["0"])
    for rank0, rank1 in ((0, 2), (1, 3)):
        _assert_expert_biases_identical(run, rank0, rank1)

    sequential = _ok(train("debug_moe_dualpipe", runs_dir / "moe_sequential", *folding, *NO_OVERLAP, probe=True,
                           nproc=4, steps=steps))
    assert sequential.logged() == logged
    for rank in range(4):
        relayed, plain = run.probe(rank), sequential.probe(rank)
        assert relayed["relayed"]["hand_overs"] > 0 and plain["relayed"]["pairs"] == 0, (relayed, plain)
        assert relayed["stages"] == plain["stages"]

    exchange = _ok(train("debug_moe_dualpipe", runs_dir / "moe_exchange", *common, probe=True, nproc=4,
                         steps=steps, env=None if REGISTRY else {FOLD_ENV: "0"}))
    assert all(exchange.probe(rank)["folded"] is False for rank in range(4))
    assert "token counts exchanged on their own communicator (expert-parallel ranks" in exchange.output
    assert "twins summed by an exchange" + (" (spmd_backend=spmd_types;" if REGISTRY else "") in exchange.output
    _assert_twins_identical(exchange, 0, 2)
    _assert_twins_identical(exchange, 1, 3)
    _assert_close(run.losses(), exchange.losses(), rel=1e-3)
    _assert_close(run.grad_norms(), exchange.grad_norms(), rel=1e-3)


@pytest.mark.titan_e2e
def test_dualpipe_under_tensor_parallel_swaps_loss_parallel_losses(runs_dir: Path) -> None:
    """pp=2 x TP 2 on 4 processes, with loss parallel (torchtitan's default once TP > 1): each
    loss is a DTensor, and DualPipe's two loss ranks swap their halves of them. Same losses and
    grad norms as 1F1B on the same layout (same weights at start); 1F1B logs them on the last
    pipeline rank's processes (global 2 and 3), ours on every rank."""
    steps = 4
    tensor_parallel = ("--parallelism.tensor_parallel_degree", "2")
    ours = _ok(train("debug_dualpipe", runs_dir / "tp_dualpipe", *tensor_parallel, nproc=4, steps=steps))
    reference = _ok(train("debug_dualpipe", runs_dir / "tp_1f1b", *tensor_parallel,
                          "--parallelism.pipeline_parallel_schedule", "1F1B", nproc=4, steps=steps))
    assert sorted(ours.logged()) == [0, 1, 2, 3]
    _assert_trains(ours.losses(), steps)
    for rank in range(4):
        _assert_close(ours.losses(rank), reference.losses(rank=2), rel=1e-4)
        _assert_close(ours.grad_norms(rank), reference.grad_norms(rank=2), rel=1e-4)


@pytest.mark.titan_e2e
def test_moe_dualpipev_expert_parallel_overlaps_on_4_processes(runs_dir: Path) -> None:
    """The same model under DualPipeV with full activation checkpointing (the backward half
    recomputes each block's exchanges), microbatches of 2 rows: it trains, every rank's pairs
    switch halves at torchtitan's expert-parallel all-to-all, and with two-batch overlap on
    (``TITAN_DUALPIPE_TWO_BATCH=1``) the lone forwards of its MoE stages run as two relayed halves
    that switch there too. The run without it (the default) logs the same losses and grad norms
    (a split microbatch's weight gradients are sums of two half-batch gradients: summation order).
    Full backwards compute their weight GEMMs while their exchanges fly (never inside a block's
    recomputation) and accumulate them in one order: a run computing them inline
    (``TITAN_DUALPIPE_WEIGHTS_IN_FLIGHT=0``) ends with bitwise the same weights."""
    steps = 3
    two_rows = ("--parallelism.pipeline_parallel_microbatch_size", "2", "--training.local_batch_size", "8",
                "--training.seq_len", "32")
    # deterministic algorithms: otherwise two identical runs of this model differ on CPU
    args = ("--parallelism.pipeline_parallel_schedule", "DualPipeV", "--debug.deterministic", *two_rows,
            *FULL_AC)  # FULL_AC last (0.3.0)
    run = _ok(train("debug_moe_dualpipe", runs_dir / "moe_v", *args, probe=True, nproc=4, steps=steps,
                    env={TWO_BATCH_ENV: "1"}))
    assert FULL_AC_LOG in run.output and "run in two halves (two-batch overlap) on stages [3]" in run.output
    _assert_trains(run.losses(), steps)
    assert sorted(run.logged()) == [0, 1, 2, 3]
    order = compute_order("DualPipeV", 2, 4)
    for rank in range(4):
        probe = run.probe(rank)
        assert probe["schedule_mro"][:2] == ["titan_dualpipe.overlap.schedules.ScheduleDualPipeV",
                                         "titan_dualpipe.runtime.schedules.ScheduleDualPipeV"]
        assert probe["relayed"]["hand_overs"] > 0, probe["relayed"]
        # every stage holding a MoE layer (stage 0 holds the dense first layer only)
        assert probe["two_batch_stages"] == ([3] if rank < 2 else [1, 2]), probe
        split = [key for key in lone_forwards(order[rank // 2]) if key[0] in probe["two_batch_stages"]]
        assert probe["halves"]["microbatches"] == len(split) * steps and probe["halves"]["hand_overs"] > 0, probe
        # a split microbatch's lone backward runs its halves apart too, under torchtitan's FSDP2
        lone_backwards = [key for key in split if key not in paired_backwards(order[rank // 2])]
        assert probe["halves"]["relays"] == (len(split) + len(lone_backwards)) * steps, probe
        # deferred weight GEMMs under full AC: torchtitan's routed experts and linear layers waited for W
        assert any(name.endswith("experts") for names in probe["deferred_weights"].values() for name in names), probe
        assert probe["deferred_last_step"].get("experts", 0) > 0 and probe["deferred_last_step"]["linear"] > 0, probe
    whole = _ok(train("debug_moe_dualpipe", runs_dir / "moe_v_whole", *args, probe=True, nproc=4, steps=steps))
    assert all(whole.probe(rank)["halves"]["microbatches"] == 0 for rank in range(4))
    _assert_close(run.losses(), whole.losses(), rel=1e-4)
    _assert_close(run.grad_norms(), whole.grad_norms(), rel=1e-4)
    inline = _ok(train("debug_moe_dualpipe", runs_dir / "moe_v_inline", *args, probe=True, nproc=4, steps=steps,
                       env={WEIGHTS_IN_FLIGHT_ENV: "0"}))
    assert inline.logged() == whole.logged()
    for rank in range(4):
        assert whole.probe(rank)["deferred_in_flight"] > 0 and inline.probe(rank)["deferred_in_flight"] == 0
        assert inline.probe(rank)["stages"] == whole.probe(rank)["stages"], rank


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


@pytest.mark.titan_e2e
def test_bench_titan_measures_every_schedule_it_runs(runs_dir: Path) -> None:
    """``bench titan`` on the MoE config: the calibrated network costs each exchange about a
    quarter of a block's compute, every schedule reports its figures, the sequential ones
    leave exchanges exposed, and tokens per second follow from the step time."""
    labels = "1F1B,DualPipe"  # torch's executor and ours
    cmd = [sys.executable, "-m", "titan_dualpipe", "bench", "titan", config("debug_moe_dualpipe"), "--nproc", "4",
           "--rounds", "1", "--steps", "2", "--warmup", "1", "--schedules", labels, "--json"]
    cmd += ["--module", "titan_dualpipe.titan"] if REGISTRY else []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert list(result["schedules"]) == labels.split(",")
    assert 0 < result["exchange_s"] == pytest.approx(result["block_compute_s"] / 4)
    tokens_per_step = 4 * 64 * 2  # local batch x sequence x data-parallel replicas
    for label, figures in result["schedules"].items():
        assert set(figures) == {"step_time", "tokens_per_s", "peak_memory_bytes", "exposed_comm", "exposed_by_action"}
        assert figures["tokens_per_s"] == pytest.approx(tokens_per_step / figures["step_time"])
        assert figures["peak_memory_bytes"] > 2**20 and figures["step_time"] > 0, (label, figures)
    sequential = result["schedules"]["1F1B"]  # every exchange waits out its cost, in torch's executor
    assert sequential["exposed_comm"] > result["exchange_s"], result
    assert set(sequential["exposed_by_action"]) == {"outside our actions"}
    ours = dict(result["schedules"]["DualPipe"]["exposed_by_action"])  # waits fall in our actions
    outside = ours.pop("outside our actions", 0.0)
    # torchtitan's pairs run as relays: each wait is charged to the half that waited
    assert set(ours) <= {"lone F", "lone B", "lone I", "W", "pair F", "pair B"}, ours
    assert ours.get("pair F", 0) + ours.get("pair B", 0) > 0, ours
    assert outside <= 0.05 * sum(ours.values()), (outside, ours)
    phases = result["phases"]
    assert "compute" not in phases["1F1B"] and phases["1F1B"]["schedule"] > 0  # torch's executor: not split
    assert phases["DualPipe"]["compute"] > 0 and phases["DualPipe"]["fsdp_reduce"] > 0, phases["DualPipe"]
    for label, parts in phases.items():  # the phases of a step add up to about the step
        step = sum(parts[p] for p in ("schedule", "clip", "optimizer", "other"))
        assert step == pytest.approx(result["schedules"][label]["step_time"], rel=0.5), (label, parts)


# ---------------------------------------------------------------------------------------------
# Activation checkpointing: every mode under both schedules, and the GPU configs at a debug size

AC_STEPS = 3  # steps 1-3 use the warm-up learning rates only: comparable with the 6-step runs
AC_TOLERANCE = 1e-4  # relative, losses and grad norms: recomputation and unsplit backwards sum in another order
if REGISTRY:  # 0.3.0: AC policies are config classes, chosen by a subcommand (last on the command line)
    AC_MODES = {  # overrides, and the log line that says torchtitan applied them
        "full": (("activation-checkpoint:full",), "Applied FullAC activation checkpointing"),
        "selective_op": (("activation-checkpoint:selective",), "Applied SelectiveAC activation checkpointing"),
    }
    AC_RUNS = [("DualPipeV", "full"), ("DualPipe", "selective_op")]
else:
    AC_MODES = {
        "full": (("--activation_checkpoint.mode", "full"), "Applied full activation checkpointing"),
        "selective_op": (("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option",
                          "op"), "Applied selective activation checkpointing"),
        "selective_layer": (("--activation_checkpoint.mode", "selective",
                             "--activation_checkpoint.selective_ac_option", "2"),
                            "Applied selective activation checkpointing"),
    }
    # DualPipeV with selective per-op AC runs as llama3_8b_dualpipev at debug size (below)
    AC_RUNS = [("DualPipeV", "full"), ("DualPipe", "selective_op"), ("DualPipe", "selective_layer")]
# Each mode with one schedule, each schedule with some mode: torchtitan wraps our stage modules the
# same way under both (the runtime tests check every mode under both schedules on TinyLM).
DEBUG_SIZE = (  # a GPU config at debug_dualpipev's size, data and optimizer: its AC and schedule kept
    "--model.flavor", "debugmodel", "--model.hf_assets_path", "titan_dualpipe/titan/assets/tokenizer",
    "--training.dataset", "titan_dualpipe_tiny", "--training.seq_len", "128", "--training.local_batch_size", "8",
    "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
    "--optimizer.lr", "8e-4", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
    "--metrics.no-enable-tensorboard", "--debug.seed", "42",
)


def _assert_same_training(run: Run, reference: Run, reference_rank: int = 0) -> None:
    steps = range(1, AC_STEPS + 1)
    _assert_close(run.losses(), {s: reference.losses(reference_rank)[s] for s in steps}, rel=AC_TOLERANCE)
    _assert_close(run.grad_norms(), {s: reference.grad_norms(reference_rank)[s] for s in steps}, rel=AC_TOLERANCE)


@pytest.mark.titan_e2e
@pytest.mark.parametrize("schedule,mode", AC_RUNS, ids=[f"{s}-{m}" for s, m in AC_RUNS])
def test_activation_checkpointing_trains_with_the_losses_of_no_ac(runs_dir: Path, request: pytest.FixtureRequest,
                                                                   schedule: str, mode: str) -> None:
    """Full, selective per-op and (0.2.2) selective per-layer AC: the same losses and grad norms as the
    run without AC (selective AC's saved values serve one backward: its microbatches' backwards run whole)."""
    overrides, applied = AC_MODES[mode]
    name = "debug_dualpipev" if schedule == "DualPipeV" else "debug_dualpipe"
    reference = request.getfixturevalue("dualpipev_run" if schedule == "DualPipeV" else "dualpipe_run")
    run = _ok(train(name, runs_dir / f"ac_{name}_{mode}", *overrides, steps=AC_STEPS))
    assert applied in run.output
    _assert_same_training(run, reference)


@pytest.mark.titan_e2e
@pytest.mark.skipif(REGISTRY, reason="the debug-size overrides are torchtitan 0.2.2's")
def test_llama3_8b_config_trains_at_debug_size_with_its_selective_ac(runs_dir: Path, dualpipev_run: Run) -> None:
    """The shipped Llama 3 8B config (DualPipeV, selective per-op AC), at debug_dualpipev's size:
    the same losses as debug_dualpipev without AC."""
    run = _ok(train("llama3_8b_dualpipev", runs_dir / "llama3_8b_debug", *DEBUG_SIZE, steps=AC_STEPS))
    assert AC_MODES["selective_op"][1] in run.output and "DualPipeV" in run.output
    _assert_same_training(run, dualpipev_run)


@pytest.mark.titan_e2e
@pytest.mark.skipif(REGISTRY, reason="the debug-size overrides are torchtitan 0.2.2's")
def test_deepseek_v3_16b_config_trains_at_debug_size_with_its_full_ac(runs_dir: Path) -> None:
    """The shipped DeepSeek-V3 16B config (DualPipe, full AC, MoE) on the deepseek_v3 debug model,
    2 processes (no expert parallelism): it trains."""
    run = _ok(train("deepseek_v3_16b_dualpipe", runs_dir / "deepseek_16b_debug", *DEBUG_SIZE,
                    "--training.local_batch_size", "4", "--training.seq_len", "64",
                    "--parallelism.expert_parallel_degree", "1", steps=AC_STEPS))
    assert AC_MODES["full"][1] in run.output
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) and v > 0 for v in losses.values())
    assert losses[3] < losses[1], losses


# ---------------------------------------------------------------------------------------------
# torch.compile: torchtitan's compiled blocks (inductor, C++ on the CPU) under both schedules

COMPILE = ("--compile.enable", "--compile.components", "model,loss")
COMPILED_BLOCKS_LOG = "Compiling each TransformerBlock with torch.compile"
# Relative, losses and grad norms. Inductor fuses the blocks' float32 ops and reorders their
# reductions (norms, softmax, matmul epilogues): the same sums in another order. Measured over 4
# steps, against the eager run of the same schedule: losses equal to the log's 5 decimals (below
# 1.3e-6 relative) and grad norms within 1e-7 on the dense debug model, both releases, DualPipeV and
# DualPipe; 8e-6 on the MoE debug model with expert parallelism. 1e-4 leaves 100x margin over that and
# still catches a wrong gradient: a W that ran the compiled backward twice, or a microbatch's backward
# lost, moves step 2's loss by more than 1e-2 relative.
COMPILE_TOLERANCE = 1e-4
# DualPipeV: the compiled blocks alone, their weight GEMMs deferred ("deferred_compiled"); DualPipe: with memory-budget AC, torch.compile's partitioner
# choosing what to recompute inside them (two runs instead of three keep CI's added time small).
COMPILE_RUNS = {"DualPipeV": (), "DualPipe": MEMORY_BUDGET_AC[0]}


@pytest.fixture(scope="module")
def inductor_cache(runs_dir: Path) -> dict[str, str]:
    """One inductor cache for the compiled runs of this module: the processes of a run and the
    runs after it reuse the C++ kernels compiled first (the blocks are the same graph), which a
    cold build on 2 cores pays once (about 35 s on this machine)."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(runs_dir / "inductor_cache")}


@pytest.mark.titan_e2e
@pytest.mark.parametrize("schedule", sorted(COMPILE_RUNS, reverse=True))
def test_compiled_model_trains_with_the_losses_of_the_eager_run(runs_dir: Path, request: pytest.FixtureRequest,
                                                                 inductor_cache: dict[str, str], schedule: str) -> None:
    """torchtitan's compiled blocks (each compiled in place, fullgraph, inductor) under our schedules:
    each microbatch's compiled backward runs once, at I (a split graph would stop at W:
    pytorch#161904): whole (DualPipe, the default, with memory-budget AC) or with the blocks'
    linear layers leaving their weight GEMMs to W (DualPipeV, ``deferred_compiled``), giving the
    eager run's losses and grad norms."""
    name = "debug_dualpipev" if schedule == "DualPipeV" else "debug_dualpipe"
    reference = request.getfixturevalue("dualpipev_run" if schedule == "DualPipeV" else "dualpipe_run")
    deferring = schedule == "DualPipeV"
    env = {**inductor_cache, **({WEIGHT_GRADIENTS_ENV: "deferred_compiled"} if deferring else {})}
    run = _ok(train(name, runs_dir / f"compiled_{name}", *COMPILE, *COMPILE_RUNS[schedule], steps=AC_STEPS,
                    env=env, probe=True))
    assert COMPILED_BLOCKS_LOG in run.output
    assert ("budget option" in run.output) is bool(COMPILE_RUNS[schedule])
    # W ran the compiled blocks' weight GEMMs on both ranks (rank 1 holds blocks only), or none: on
    # 0.3.0 each layer's forward is wrapped on the instance, and wrapped layers keep their GEMMs in
    # the compiled backward
    ran = [run.probe(rank)["deferred_last_step"].get("linear", 0) for rank in (0, 1)]
    assert all(ran) if deferring and not REGISTRY else not any(ran), ran
    steps = range(1, AC_STEPS + 1)
    _assert_close(run.losses(), {s: reference.losses()[s] for s in steps}, rel=COMPILE_TOLERANCE)
    _assert_close(run.grad_norms(), {s: reference.grad_norms()[s] for s in steps}, rel=COMPILE_TOLERANCE)


# ---------------------------------------------------------------------------------------------
# In-process checks (no trainer processes)

SHIPPED = ("debug_dualpipe", "debug_dualpipev", "debug_moe_dualpipe", "deepseek_v3_16b_dualpipe", "llama3_8b_dualpipev")


def _job_config(name: str, *overrides: str):
    from torchtitan.config import ConfigManager

    titan_args = ["--module", "titan_dualpipe.titan", "--config", name] if REGISTRY else ["--job.config_file", config(name)]
    return ConfigManager().parse_args([*titan_args, *overrides])


def test_both_torchtitan_generations_ship_the_same_configs() -> None:
    """0.2.2 TOMLs and 0.3.0 config functions, one of each per name (read without importing either)."""
    tree = ast.parse(REGISTRY_FILE.read_text())
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}
    assert {p.stem for p in CONFIGS.glob("*.toml")} == functions == set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_train_configs_load_and_validate(name: str) -> None:
    import titan_dualpipe.titan as adapter
    from titan_dualpipe.titan.data import DATASET_NAME, TOKENIZER_DIR, resolve_asset_path

    job = _job_config(name)
    plan = adapter.check_job_config(job, adapter.GEN.n_layers(job))
    assert plan is not None and plan.schedule == adapter.our_schedule(job.parallelism.pipeline_parallel_schedule)
    assert job.checkpoint.last_save_model_only is False  # the last checkpoint can be resumed from
    if REGISTRY:
        assert job.dualpipe.overlap is True and job.training.disable_cuda_graphs
        dataset, tokenizer = job.dataloader.dataset, job.hf_assets_path
    else:
        assert job.experimental.custom_import == "titan_dualpipe.titan"
        dataset, tokenizer = job.training.dataset, resolve_asset_path(job.model.hf_assets_path)
    if name.startswith("debug_"):  # shipped data only
        assert dataset == DATASET_NAME and Path(tokenizer).resolve() == TOKENIZER_DIR


GPU_CONFIGS = {  # config -> the world it is written for (docs/torchtitan.md's launch commands)
    "llama3_8b_dualpipev": {"world": 8, "pp": 4, "dp_shard": 2, "ep": 1, "stages": 8,
                            "compile": (False, ["model", "loss"])},  # torchtitan's compile settings, kept
    "deepseek_v3_16b_dualpipe": {"world": 16, "pp": 4, "dp_shard": 4, "ep": 4, "stages": 8,
                                 "compile": (True, ["loss"])},
}


def _parallel_dims_and_experts(job, world: int) -> tuple:
    """torchtitan's parallel dims of ``job`` on ``world`` processes, and the model's expert count (or None)."""
    from torchtitan.distributed import ParallelDims

    par = job.parallelism
    if REGISTRY:
        from torchtitan.models.common.moe import GroupedExperts

        experts = [cfg.num_experts for _, cfg, _, _ in job.model_spec.model.traverse(GroupedExperts.Config)]
        return ParallelDims.from_config(par, world), (experts[0] if experts else None)
    from torchtitan.protocols.train_spec import get_train_spec

    dims = ParallelDims(dp_shard=par.data_parallel_shard_degree, dp_replicate=par.data_parallel_replicate_degree,
                        cp=par.context_parallel_degree, tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
                        ep=par.expert_parallel_degree, etp=par.expert_tensor_parallel_degree, world_size=world)
    moe = getattr(get_train_spec(job.model.name).model_args[job.model.flavor], "moe_args", None)
    return dims, (moe.num_experts if moe is not None else None)


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_configs_fit_the_world_they_declare(name: str) -> None:
    """The GPU starting points, through torchtitan's parser, its parallel-dims validation for
    their world size, the model flavour's layers and experts, and our config checks."""
    import titan_dualpipe.titan as adapter

    expected = GPU_CONFIGS[name]
    job = _job_config(name)
    dims, experts = _parallel_dims_and_experts(job, expected["world"])
    assert (dims.pp, dims.dp_shard, dims.ep) == (expected["pp"], expected["dp_shard"], expected["ep"])
    plan = adapter.check_job_config(job, adapter.GEN.n_layers(job))
    assert plan is not None and 2 * plan.pp == expected["stages"] and plan.n_microbatches >= 2 * plan.pp
    if dims.ep > 1:
        assert experts is not None and experts % dims.ep == 0
        assert (dims.dp_shard * dims.cp) % dims.ep == 0, "torchtitan shards experts inside the FSDP x CP group"
    assert (job.compile.enable, list(job.compile.components)) == expected["compile"]
    ac = job.activation_checkpoint
    assert ac is not None if REGISTRY else ac.mode in ("selective", "full")


@pytest.mark.parametrize(
    "overrides, keys",
    [
        (["--parallelism.pipeline_parallel_degree", "3"], [key("parallelism.pipeline_parallel_degree"), "got 3", "2 or 4"]),
        (["--training.local_batch_size", "6", "--parallelism.pipeline_parallel_microbatch_size", "2"],
         ["microbatches", key("training.local_batch_size"), "pipeline_parallel_microbatch_size"]),
        pytest.param(
            ["--training.local_batch_size", "7", "--parallelism.pipeline_parallel_microbatch_size", "2"],
            [key("training.local_batch_size") + " = 7", key("parallelism.pipeline_parallel_microbatch_size") + " = 2"],
            marks=pytest.mark.skipif(REGISTRY, reason="0.3.0's own config check refuses it first, naming both"),
        ),
        (["--parallelism.pipeline_parallel_layers_per_stage", "2"],
         [key("parallelism.pipeline_parallel_layers_per_stage") + " = 2", "remove it"]),
        (["--parallelism.pipeline_parallel_degree", "10", "--training.local_batch_size", "20"],
         [key("parallelism.pipeline_parallel_degree") + " = 10", "pipeline_parallel_first_stage_less_layers"]),
        pytest.param(
            ["--validation.enable", "--validation.local_batch_size", "12"],
            [key("validation.local_batch_size") + " = 12", "8 microbatches", "Set it to 8"],
            marks=pytest.mark.skipif(REGISTRY, reason="0.3.0 validates with the training batch"),
        ),
        pytest.param(
            ["--compile.components", "model,loss", *MEMORY_BUDGET_AC[0]],
            [MEMORY_BUDGET_AC[1], "needs the model compiled", key("compile.enable") + " = true",
             '"model" in ' + key("compile.components"), *MEMORY_BUDGET_AC[2]],
            marks=pytest.mark.skipif(REGISTRY, reason="0.3.0's own config refuses it first, naming --compile.enable"),
        ),
    ],
    ids=["odd-pp", "too-few-microbatches", "batch-not-multiple", "layers-per-stage", "too-many-parts", "validation-batch",
         "memory-budget-ac-uncompiled"],
)
def test_bad_dualpipe_configs_name_the_keys(overrides: list[str], keys: list[str]) -> None:
    from titan_dualpipe.titan import check_job_config

    with pytest.raises(ValueError) as err:
        check_job_config(_job_config("debug_dualpipe", *overrides), n_layers=6)
    for expected in keys:
        assert expected in str(err.value)


@pytest.mark.parametrize("name", ["debug_dualpipev", "debug_dualpipe"])
def test_compiled_model_and_memory_budget_ac_pass_the_config_check(name: str) -> None:
    """Compiled blocks run under both schedules (their backward whole at I), memory-budget AC with them."""
    from titan_dualpipe.titan import check_job_config

    for overrides in (COMPILE, (*COMPILE, *MEMORY_BUDGET_AC[0])):
        job = _job_config(name, *overrides)
        assert job.compile.enable and "model" in job.compile.components
        assert check_job_config(job, n_layers=6) is not None


@pytest.mark.skipif(REGISTRY, reason="0.3.0: CPU mode computes flex attention with plain tensor ops")
def test_flex_attention_on_cpu_is_refused_naming_the_flavour_and_torch() -> None:
    """torch's flex attention has no backward on CPU, compiled or not: refused before any collective."""
    import torch

    from titan_dualpipe.titan.config_check import check_cpu_attention, check_job_config

    job = _job_config("debug_dualpipev", "--model.flavor", "debugmodel_flex_attn", *COMPILE)
    plan = check_job_config(job, n_layers=6)
    with pytest.raises(ValueError) as err:
        check_cpu_attention(plan, job)
    for expected in ("'debugmodel_flex_attn'", "no backward on CPU", torch.__version__.split("+")[0], '"debugmodel"'):
        assert expected in str(err.value)
    check_cpu_attention(plan, _job_config("debug_dualpipev", *COMPILE))  # sdpa: passes


def test_0_3_0_refuses_a_batch_that_is_no_multiple_of_the_microbatch(capfd: pytest.CaptureFixture) -> None:
    """0.3.0's own config check names both fields; its parser then exits like any parse error."""
    if not REGISTRY:
        pytest.skip("0.2.2: our check names it (test_bad_dualpipe_configs_name_the_keys)")
    with pytest.raises(SystemExit):
        _job_config("debug_dualpipe", "--training.local_batch_size", "7", "--parallelism.pipeline_parallel_microbatch_size", "2")
    printed = " ".join(capfd.readouterr().err.split())
    assert "training.local_batch_size (7)" in printed and "microbatch_size (2)" in printed, printed


def test_bad_dualpipev_stage_counts_name_the_keys(tmp_path: Path) -> None:
    from titan_dualpipe.titan import check_job_config

    job = _job_config("debug_dualpipev", "--parallelism.pipeline_parallel_layers_per_stage", "4")
    with pytest.raises(ValueError, match=r"pipeline_parallel_layers_per_stage = 4 .* into 2: .*set it to 2"):
        check_job_config(job, n_layers=6)  # (6 layers + 2) / 4 = 2 stages; DualPipeV needs 4
    job = _job_config("debug_dualpipev")
    job.parallelism.module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    with pytest.raises(ValueError, match=r"needs 4 model parts .*module_fqns_per_model_part lists 2"):
        check_job_config(job, n_layers=6)
    csv = tmp_path / "pp4.csv"
    from titan_dualpipe import compute_order
    from titan_dualpipe.orders.csv_io import write_csv

    with csv.open("w", newline="") as f:
        write_csv(compute_order("DualPipeV", 4, 8), f)
    with pytest.raises(ValueError, match=r"4 rows .*pipeline_parallel_degree = 2.*titan-dualpipe csv"):
        check_job_config(_job_config("debug_dualpipev", f"--parallelism.pipeline_parallel_schedule_csv={csv}"), n_layers=6)


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
    for name in ("TorchDualPipeV", "torchdualpipev"):  # torch's own, for comparisons
        assert lookup(name) is torch_schedules.ScheduleDualPipeV
    for name in ("1F1B", "interleaved1f1b", "GPipe", "ZBVZeroBubble", "PipelineScheduleMulti"):
        assert lookup(name) is torch_schedules.get_schedule_class(name)
    with pytest.raises(ValueError, match="Unknown schedule name 'DualPipeX'"):
        lookup("DualPipeX")


@pytest.mark.skipif(REGISTRY, reason="torchtitan 0.3.0 has no DualPipeV expert-parallel hooks")
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


def test_dualpipe_overlap_switch_and_with_dualpipe() -> None:
    if not REGISTRY:
        pytest.skip("0.2.2's switch is torchtitan's own [parallelism] pipeline_parallel_expert_parallel_overlap")
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from titan_dualpipe.titan import GEN
    from titan_dualpipe.titan.trainer_config import DualPipeTrainer, with_dualpipe

    assert GEN.overlap(_job_config("debug_dualpipev")) is True
    assert GEN.overlap(_job_config("debug_dualpipev", "--dualpipe.no-overlap")) is False
    plain = llama3_debugmodel()
    assert GEN.overlap(plain) is True  # a plain Trainer.Config: overlap on
    ours = with_dualpipe(plain, overlap=False)
    assert isinstance(ours, DualPipeTrainer.Config) and GEN.overlap(ours) is False
    assert ours.training == plain.training and ours.model_spec is plain.model_spec
    with pytest.raises(ValueError, match="with_dualpipe takes torchtitan's Trainer.Config"):
        with_dualpipe(plain.training)


def test_dualpipe_two_batch_overlap_field() -> None:
    """0.3.0: ``--dualpipe.two-batch-overlap`` (off by default, also through ``with_dualpipe``)."""
    if not REGISTRY:
        pytest.skip("0.2.2 has no config key for two-batch overlap: TITAN_DUALPIPE_TWO_BATCH=1 alone")
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from titan_dualpipe.titan import GEN
    from titan_dualpipe.titan.trainer_config import with_dualpipe

    default = _job_config("debug_moe_dualpipe")
    assert default.dualpipe.two_batch_overlap is False and GEN.two_batch_overlap(default) is False
    on = _job_config("debug_moe_dualpipe", "--dualpipe.two-batch-overlap")
    assert on.dualpipe.two_batch_overlap is True and GEN.two_batch_overlap(on) is True
    assert on.dualpipe.overlap is True
    assert GEN.two_batch_overlap(llama3_debugmodel()) is False  # a plain Trainer.Config: off
    assert GEN.two_batch_overlap(with_dualpipe(llama3_debugmodel(), two_batch_overlap=True)) is True


class _RecordedSchedule:
    """Stands in for our schedule class: keeps the keywords the builder passes."""

    fsdp_at_step_edges = False
    two_batch_stages: frozenset = frozenset()
    deferred_weights: dict = {}

    def __init__(self, stages: list, **kwargs) -> None:
        self.kwargs = kwargs
        self.weight_gradients = kwargs.get("weight_gradients")

    def eval(self, *args, return_outputs: bool = True, **kwargs) -> bool:
        return return_outputs


# (config switch given, TITAN_DUALPIPE_TWO_BATCH, two_batch_overlap the schedule gets): either turns it on
TWO_BATCH_CASES = [(False, None, False), (False, "0", False), (False, "1", True),
                   (True, None, True), (True, "0", True), (True, "1", True)]


@pytest.fixture
def active_run_kept():
    """The adapter's record of this process's pipeline, restored after the test."""
    from titan_dualpipe.titan.active import ACTIVE

    saved = dict(vars(ACTIVE))
    yield ACTIVE
    vars(ACTIVE).clear()
    vars(ACTIVE).update(saved)


@pytest.mark.parametrize("field,env,expected", TWO_BATCH_CASES)
def test_two_batch_overlap_reaches_the_schedule_built(field: bool, env: str | None, expected: bool,
                                                      monkeypatch: pytest.MonkeyPatch, active_run_kept) -> None:
    """The config's switch (0.3.0) and the environment (both releases) as the trainer hooks
    record them, through torchtitan's pipeline-schedule builder as we replace it, to our class's
    ``two_batch_overlap``."""
    if field and not REGISTRY:
        pytest.skip("0.2.2 has no config key for two-batch overlap")
    from titan_dualpipe.titan import pipeline, trainer_hooks

    monkeypatch.setattr(trainer_hooks.expert_overlap, "install", lambda: None)
    monkeypatch.setattr(pipeline, "schedule_class", lambda name: _RecordedSchedule)
    if env is None:
        monkeypatch.delenv(TWO_BATCH_ENV, raising=False)
    else:
        monkeypatch.setenv(TWO_BATCH_ENV, env)
    job = _job_config("debug_dualpipev", *(["--dualpipe.two-batch-overlap"] if field else []))
    trainer_hooks.prepare(job)

    def torchtitans(*args, **kwargs):
        raise AssertionError("torchtitan's own builder ran for our schedule")

    par, batch = job.parallelism, job.training.local_batch_size
    if REGISTRY:
        built = pipeline.make_build_schedule_030(torchtitans)(
            parallelism=par, local_batch_size=batch, stages=[], loss_fn=lambda *a: (a, None))
    else:
        built = pipeline.make_build_schedule(torchtitans)(job, [], lambda *a: a)
    assert isinstance(built, _RecordedSchedule)
    assert built.kwargs["two_batch_overlap"] is expected and built.kwargs["overlap"] is True


def _built_with(monkeypatch: pytest.MonkeyPatch, *args: str) -> _RecordedSchedule:
    """Our schedule as torchtitan's builder (as we replace it) builds it for ``debug_dualpipev`` and ``args``."""
    from titan_dualpipe.titan import pipeline, trainer_hooks

    monkeypatch.setattr(trainer_hooks.expert_overlap, "install", lambda: None)
    monkeypatch.setattr(pipeline, "schedule_class", lambda name: _RecordedSchedule)
    job = _job_config("debug_dualpipev", *args)
    trainer_hooks.prepare(job)

    def torchtitans(*args, **kwargs):
        raise AssertionError("torchtitan's own builder ran for our schedule")

    par, batch = job.parallelism, job.training.local_batch_size
    if REGISTRY:
        return pipeline.make_build_schedule_030(torchtitans)(
            parallelism=par, local_batch_size=batch, stages=[], loss_fn=lambda *a: (a, None))
    return pipeline.make_build_schedule(torchtitans)(job, [], lambda *a: a)


def test_the_adapters_eval_keeps_no_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's validator reads the losses only: the schedule the adapter builds evaluates with
    ``return_outputs=False`` (eval's default, torch's, returns every microbatch's logits)."""
    assert _built_with(monkeypatch).eval() is False


# (config field (0.3.0), TITAN_DUALPIPE_WEIGHT_GRADIENTS, TITAN_DUALPIPE_NOT_DEFERRED, what the schedule gets)
WEIGHT_GRADIENT_CASES = [
    (None, None, None, ("deferred", [])),
    (None, "split", "output, layers.*.moe.*", ("split", ["output", "layers.*.moe.*"])),
    ("whole", None, None, ("whole", [])),
    ("whole", "deferred", "output", ("deferred", ["output"])),
    (None, "deferred_compiled", None, ("deferred_compiled", [])),
]


@pytest.mark.parametrize("field,env,names,expected", WEIGHT_GRADIENT_CASES)
def test_weight_gradient_switches_reach_the_schedule_built(field, env, names, expected, monkeypatch, active_run_kept):
    """``dualpipe.weight_gradients`` (0.3.0) and the environment (both releases; the variable wins,
    ``TITAN_DUALPIPE_NOT_DEFERRED`` adds names) become our class's ``weight_gradients`` and
    ``not_deferred``; a bad value is named with the choices."""
    if field and not REGISTRY:
        pytest.skip("0.2.2 has no config key for weight gradients")
    for var, value in ((WEIGHT_GRADIENTS_ENV, env), (NOT_DEFERRED_ENV, names)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    built = _built_with(monkeypatch, *(["--dualpipe.weight-gradients", field] if field else []))
    assert (built.kwargs["weight_gradients"], built.kwargs["not_deferred"]) == expected
    assert built.kwargs["weights_in_flight"] is True
    monkeypatch.setenv(WEIGHTS_IN_FLIGHT_ENV, "0")
    assert _built_with(monkeypatch).kwargs["weights_in_flight"] is False
    monkeypatch.setenv(WEIGHTS_IN_FLIGHT_ENV, "no")
    with pytest.raises(ValueError, match=r"TITAN_DUALPIPE_WEIGHTS_IN_FLIGHT='no': use 1 .* or 0 \(inline\)"):
        _built_with(monkeypatch)
    monkeypatch.delenv(WEIGHTS_IN_FLIGHT_ENV)
    monkeypatch.setenv(WEIGHT_GRADIENTS_ENV, "later")
    with pytest.raises(ValueError, match=r"TITAN_DUALPIPE_WEIGHT_GRADIENTS='later': use one of deferred, deferred_compiled, split, whole"):
        _built_with(monkeypatch)


def test_a_bad_two_batch_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_dualpipe.titan import pipeline

    monkeypatch.setenv(TWO_BATCH_ENV, "yes")
    with pytest.raises(ValueError, match=r"TITAN_DUALPIPE_TWO_BATCH='yes': use 1 \(on\) or 0"):
        pipeline.two_batch_option()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_cpu_attention_equals_flex_attention_and_has_a_backward() -> None:
    """0.3.0's CPU mode attends with plain tensor ops: flex attention's outputs and log-sum-exp for
    packed documents, causal, grouped-query heads; and a backward that flex attention lacks on CPU."""
    if not REGISTRY:
        pytest.skip("0.2.2's models attend with SDPA")
    import torch
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    from titan_dualpipe.titan.cpu_attention import masked_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 64, 16, generator=gen) for h in (4, 2, 2))
    starts = torch.zeros(2, 64, dtype=torch.long)
    starts[0, 20:], starts[1, 50:] = 1, 1  # document ids: a boundary inside each sample

    def document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (starts[b, q_idx] == starts[b, kv_idx])

    mask = create_block_mask(document_causal, 2, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    want, aux = flex_attention(q, k, v, block_mask=mask, scale=0.3, enable_gqa=True, return_aux=AuxRequest(lse=True))
    got, lse = masked_attention(q, k, v, score_mod=None, block_mask=mask, scale=0.3, enable_gqa=True,
                                return_aux=AuxRequest(lse=True), kernel_options={})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.lse, aux.lse, rtol=1e-5, atol=1e-5)
    q.requires_grad_(True)
    out, _ = masked_attention(q, k, v, score_mod=None, block_mask=mask, scale=0.3, enable_gqa=True,
                              return_aux=AuxRequest(lse=False), kernel_options={})
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


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


def _built_model(job):
    """The model ``job`` names, built and initialized as torchtitan's trainer builds it (no parallelism)."""
    import torch

    if REGISTRY:
        model_config = job.model_spec.model
        model_config.update_from_config(config=job)
        model = model_config.build()
        init = model.init_states
    else:
        from torchtitan.protocols.train_spec import get_train_spec

        spec = get_train_spec(job.model.name)
        args = spec.model_args[job.model.flavor]
        args.update_from_config(job)
        model = spec.model_cls(args)
        init = model.init_weights
    with torch.no_grad():
        init()
    return model


def test_cpu_float32_grouped_mm_traces_and_equals_torchs() -> None:
    """CPU mode's float32 expert multiply: torch's ``_grouped_mm`` bit for bit, forward and both
    gradients, eager and traced by torch.compile (whose fake kernel for torch's op takes no float32)."""
    import torch

    from titan_dualpipe.titan.cpu_moe import grouped_mm_float32

    torch.manual_seed(0)
    tokens, experts = torch.randn(40, 16, requires_grad=True), torch.randn(4, 16, 24, requires_grad=True)
    offs = torch.tensor([8, 8, 25, 40], dtype=torch.int32)  # an expert without tokens included
    grad = torch.randn(40, 24)

    def run(mm) -> list[torch.Tensor]:
        out = mm(tokens, experts, offs)
        return [out, *torch.autograd.grad(out, (tokens, experts), grad)]

    expected = run(lambda a, b, o: torch._grouped_mm(a, b, offs=o))
    compiled = torch.compile(grouped_mm_float32, backend="aot_eager", fullgraph=True)
    for got in (run(grouped_mm_float32), run(compiled)):
        assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_cpu_mode_computes_moe_models_in_float32() -> None:
    """CPU mode: FSDP gathers parameters in float32 and the MoE experts multiply in float32
    (CPUs without bfloat16 units run bfloat16 matmuls ~50x slower). Every matmul of a forward
    and backward of the MoE debug model's MoE layers, experts included, has float32 operands."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import titan_dualpipe.titan  # noqa: F401 - CPU mode
    from titan_dualpipe.titan import cpu

    job = _job_config("debug_moe_dualpipe")
    assert job.training.mixed_precision_param == "bfloat16"  # torchtitan's default, in the shipped config
    cpu.prepare_config(job)
    assert job.training.mixed_precision_param == "float32"

    matmuls = {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.aten.baddbmm,
               torch.ops.aten._grouped_mm}
    seen: list[tuple[str, set]] = []

    class MatmulDtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in matmuls:
                seen.append((str(func), {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = _built_model(job)
    moes = [m for m in model.modules() if type(m).__name__ == "MoE"]
    experts = [m for m in model.modules() if type(m).__name__ == "GroupedExperts"]
    calls = []
    for module in experts:
        module.register_forward_hook(lambda *_: calls.append(1))
    hidden = torch.randn(2, 16, model.tok_embeddings.weight.shape[1], requires_grad=True)
    with MatmulDtypes():
        sum(moe(hidden).square().mean() for moe in moes).backward()
    assert moes and len(calls) == len(experts) == len(moes), (len(moes), len(experts), len(calls))
    assert seen and all(dtypes == {torch.float32} for _, dtypes in seen), sorted({(f, tuple(d)) for f, d in seen} - {
        (f, (torch.float32,)) for f, _ in seen})


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


def _twin_counts_worker(rank: int, init_file: str, results) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from titan_dualpipe.titan import GEN
    from titan_dualpipe.titan.moe_twins import sum_twin_counts

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    parts = {}
    for part in (0, 1):  # both ranks hold parts 0 and 1 (pp=2), each saw other microbatches
        module = nn.Module()
        module.register_buffer(GEN.expert_count_buffer, torch.full((4,), float(10 * rank + part)))
        parts[part] = nn.ModuleDict({"moe": module})
    sum_twin_counts(parts, peer=1 - rank, group=None)
    results[rank] = [getattr(parts[p].moe, GEN.expert_count_buffer).tolist() for p in (0, 1)]
    dist.destroy_process_group()


def test_moe_twin_expert_counts_summed(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_twin_counts_worker, args=(str(tmp_path / "init"), results), nprocs=2)
    assert results[0] == results[1] == [[10.0] * 4, [12.0] * 4]


def _count_exchange_worker(rank: int, init_file: str, results) -> None:
    """torchtitan's own token dispatch (0.2.2: ``ExpertParallel._token_dispatch``; 0.3.0:
    ``AllToAllTokenDispatcher.dispatch``) as the forward half of a relayed pair on 2 EP ranks,
    with its collectives logged in order next to the partner half's turns: once as our schedules
    run it, once with the bench's comparison hand-over at the count exchange."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_dualpipe.overlap.comm import emulate_relayed_exchanges
    from titan_dualpipe.overlap.count_groups import count_group, make_count_groups
    from titan_dualpipe.overlap.relay import hand_over, run_relayed
    from titan_dualpipe.titan import GEN, expert_overlap

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    expert_overlap.install()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    make_count_groups([mesh])  # as build_schedule does before the first step
    names = {mesh.get_group().group_name: "post tokens", count_group(mesh).group_name: "post counts"}
    log: list[str] = []

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and func.overloadpacket.__name__ == "all_to_all_single":
                log.append(names[args[3]])
            elif func.namespace == "_c10d_functional" and func.overloadpacket.__name__ == "wait_tensor":
                log.append("wait")
            return func(*args, **(kwargs or {}))

    experts, dim, tokens = 4, 3, 6
    expert_ids = torch.tensor([[0], [1], [2], [3], [1], [2]]) if rank == 0 else torch.tensor([[3], [3], [0], [1], [2], [0]])
    counts = torch.bincount(expert_ids.view(-1), minlength=experts)
    x = torch.randn(tokens, dim)

    def forward() -> None:
        with Collectives():
            if GEN.registry:
                from torchtitan.distributed import utils as titan_utils
                from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

                titan_utils.set_spmd_backend("partial_dtensor")
                dispatcher = AllToAllTokenDispatcher(AllToAllTokenDispatcher.Config(num_experts=experts, top_k=1))
                dispatcher.wire_meshes(ep_mesh=mesh)
                dispatcher.dispatch(x, torch.ones(tokens, 1), expert_ids, counts)
            else:
                from torchtitan.distributed.expert_parallel import ExpertParallel

                routed = x[expert_ids.view(-1).argsort(stable=True)]
                ExpertParallel()._token_dispatch(None, (routed, counts), mesh)

    def backward() -> None:
        for turn in range(3):
            log.append(f"B{turn}")
            hand_over()

    for hand_over_counts in (False, True):
        emulate_relayed_exchanges(0.0).count_hand_over = hand_over_counts
        run_relayed(forward, backward)
        results[(rank, hand_over_counts)] = log[:]
        log.clear()
    emulate_relayed_exchanges(None)
    dist.destroy_process_group()


def test_token_count_exchange_is_read_at_once_on_its_own_communicator(tmp_path: Path) -> None:
    """As torchtitan does, the count all-to-all is posted and read on the CPU before the token
    exchange hands over to the partner half, but on the count communicator, not the expert-parallel
    group's (where it would queue behind the partner's token exchange), and waited for once, inside
    the bench's exposed span; bench titan's comparison run hands over in between."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_count_exchange_worker, args=(str(tmp_path / "init"), results), nprocs=2)
    for rank in (0, 1):
        read_at_once, handed_over = results[(rank, False)][:6], results[(rank, True)][:6]
        assert read_at_once == ["post counts", "wait", "post tokens", "B0", "wait", "B1"], read_at_once
        assert handed_over == ["post counts", "B0", "wait", "post tokens", "B1", "wait"], handed_over


def test_folded_rank_map_puts_twins_side_by_side() -> None:
    """torchtitan numbers rank (pipeline rank p, replica d, rest x) as (p*dpr + d)*rest + x; in
    the folded order (pair, replica, twin, rest) each run of 2*rest ranks is one replica's
    slice of a twin pair: pipeline ranks r and pp-1-r."""
    from titan_dualpipe.titan.fold import folded_rank_map

    for pp, dpr, world in ((2, 1, 4), (4, 1, 8), (4, 2, 16), (8, 1, 8), (2, 2, 8)):
        order = folded_rank_map(pp, dpr, world)
        assert sorted(order) == list(range(world))
        rest = world // (pp * dpr)
        for start in range(0, world, 2 * rest):
            run = order[start:start + 2 * rest]
            pipeline = [r // rest // dpr for r in run]
            assert len({r // rest % dpr for r in run}) == 1, (pp, dpr, run)
            assert set(pipeline[:rest]) | set(pipeline[rest:]) == {pipeline[0], pp - 1 - pipeline[0]}, (pp, dpr, run)
    with pytest.raises(ValueError, match="even pp"):
        folded_rank_map(3, 1, 6)


def _fold_worker(rank: int, init_file: str, results) -> None:
    """4 processes = pp 2 x fsdp 2 with EP 2 over the fsdp ranks, torchtitan's layout."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_dualpipe.runtime.twins import folded_into_fsdp
    from titan_dualpipe.titan.cpu import AllReduceScatter
    from titan_dualpipe.titan.fold import build_folded_meshes

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    dims = SimpleNamespace(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2, etp=1, world_size=4)
    meshes = build_folded_meshes(dims, "cpu")
    mesh = {name: meshes.lookup([name]) for name in ("fsdp", "efsdp", "ep")}
    twin = (rank + 2) % 4  # pipeline rank 1 - p, same fsdp index

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(distribute_tensor(torch.ones(4, 8, 8), mesh["ep"], [Shard(0)]))

        def forward(self, scale: torch.Tensor) -> torch.Tensor:
            return self.w.to_local().sum() * scale

    def model(dense_mesh):  # a dense layer and 4 experts split over EP, FSDP-sharded as torchtitan does
        m = nn.Module()
        m.dense, m.experts = nn.Linear(8, 8), Experts()
        fully_shard(m.experts, mesh=mesh["efsdp"])
        fully_shard(m.dense, mesh=dense_mesh)
        return m

    def grads(m, comm=None):
        for fsdp_module in (m.dense, m.experts):  # sums, as torchtitan's CPU runs reduce them
            fsdp_module.set_gradient_divide_factor(1.0)
            fsdp_module.set_force_sum_reduction_for_comms(True)
            if comm is not None:
                fsdp_module.set_custom_reduce_scatter(comm)
        (m.dense(torch.full((2, 8), float(rank + 1))).sum() + m.experts(torch.tensor(float(rank + 1)))).backward()
        return [p.grad.to_local().clone() for p in (m.dense.weight, m.dense.bias, m.experts.w)]

    folded = model(mesh["fsdp"])
    default, all_reduced = grads(folded), grads(model(mesh["fsdp"]), AllReduceScatter())
    init_order, init_sums = _init_parts_folded(rank, mesh["fsdp"])
    results[rank] = {
        "groups": {name: dist.get_process_group_ranks(m.get_group()) for name, m in mesh.items()},
        "folded": folded_into_fsdp([folded], twin),
        "not_twin": folded_into_fsdp([folded], (rank + 1) % 4)[0],
        "half_folded": folded_into_fsdp([model(mesh["ep"])], twin),  # dense over a group without the twin
        "outside_fsdp": folded_into_fsdp([folded, nn.Linear(2, 2)], twin),
        "same_sums": all(torch.equal(a, b) for a, b in zip(default, all_reduced)),
        "grad_sums": [float(g.sum()) for g in default],
        "init_order": init_order,
        "init_sums": init_sums,
    }
    dist.destroy_process_group()


def _init_parts_folded(rank: int, fsdp_mesh) -> tuple[list[int], list[float]]:
    """Two model parts of different sizes sharded over the folded mesh, held in opposite order
    by twins (pipeline rank 0: parts 0, 1; pipeline rank 1: parts 1, 0) and initialized as
    torchtitan does, each in the rank's own order. Each init gathers its part's full weight (as
    torch 2.14's trunc_normal_ gathers its mask), so parts reached in different orders on
    twins would mismatch the gathers."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from titan_dualpipe.titan.fold import init_parts_in_order

    order: list[int] = []
    sums: dict[int, float] = {}

    class Part(nn.Linear):
        def init_weights(self, buffer_device=None) -> None:
            nn.init.trunc_normal_(self.weight, std=0.02)
            order.append(self.part)
            sums[self.part] = float(self.weight.full_tensor().sum())

    with torch.device("meta"):
        parts = {part: Part(8, 8 * (part + 1)) for part in (0, 1)}
    for part, module in parts.items():
        module.part = part
        fully_shard(module, mesh=fsdp_mesh)
    init_parts_in_order(parts)
    for part in (0, 1) if rank // 2 == 0 else (1, 0):
        parts[part].to_empty(device="cpu")
        with torch.no_grad():
            parts[part].init_weights(buffer_device=None)
    return order, [sums[0], sums[1]]


def test_twins_fold_into_torchtitan_style_fsdp_and_ep_meshes(tmp_path: Path) -> None:
    """The folded meshes on torchtitan's layout (pp 2 x fsdp 2, EP 2): ``fsdp`` spans both
    pipeline ranks, ``efsdp`` each rank and its twin, ``ep`` stays within a pipeline rank, and
    FSDP2 composes ``efsdp`` with ``ep`` (one root). Gradients are summed over twins and
    replicas; the schedule's check sees every module folded, and names a rank folded in part.
    CPU mode's all-reduce-based reduce-scatter gives the same sums as gloo's reduce-scatter.
    Twins initialize their model parts in one order (part order), whatever order each holds."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_fold_worker, args=(str(tmp_path / "init"), results), nprocs=4)
    for rank in range(4):
        got = results[rank]
        assert got["groups"] == {"fsdp": [0, 1, 2, 3], "efsdp": sorted([rank, (rank + 2) % 4]),
                                 "ep": [rank - rank % 2, rank - rank % 2 + 1]}, got
        assert got["folded"] == (True, "") and got["not_twin"] is False
        assert got["half_folded"][0] is False and "1 of 2 FSDP parameter groups" in got["half_folded"][1]
        assert "outside FSDP" in got["outside_fsdp"][1], got["outside_fsdp"]
        assert got["same_sums"], got
        # dense: inputs rank+1 summed over all 4 ranks (weight: 2 of 8 rows, 2 rows of input each;
        # bias: 2 of 8); experts: this EP shard's scale summed over the rank and its twin
        experts = 64 * (1 + 3 if rank % 2 == 0 else 2 + 4)
        assert got["grad_sums"] == [16 * 2 * 10, 2 * 2 * 4, experts], (rank, got["grad_sums"])
        assert got["init_order"] == [0, 1] and got["init_sums"] == results[0]["init_sums"], got


def test_untested_torchtitan_is_refused_by_name() -> None:
    from titan_dualpipe.titan import TORCHTITAN_VERSION, check_torchtitan_version

    assert TORCHTITAN_VERSION == TORCHTITAN in ("0.2.2", "0.3.0")
    with pytest.raises(ImportError, match=r"supports torchtitan 0.2.2 and 0.3.0; found torchtitan 0.1.0"):
        check_torchtitan_version("0.1.0")
    with pytest.raises(ImportError, match=r"tested with torchtitan 0.3.0 on torch 2.14 to 2.15; found torch 2.13.0"):
        check_torchtitan_version("0.3.0", torch="2.13.0+cpu")
    with pytest.raises(ImportError, match=r"tested with torchtitan 0.2.2 on torch 2.11 to 2.14; found torch 2.15.0"):
        check_torchtitan_version("0.2.2", torch="2.15.0")
    assert check_torchtitan_version("0.2.2", torch="2.11.0") == "0.2.2"
    assert check_torchtitan_version("0.3.0", torch="2.15.0+cu132") == "0.3.0"


def test_bench_titan_checks_its_options_and_summarizes_ranks() -> None:
    """Options may follow CONFIG; bad ones are named before any run; figures: the slowest rank
    per step, median over steps after warm-up, exposed time averaged over ranks."""
    from titan_dualpipe.bench import titan as bench

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = bench.split_arguments(parser.parse_args(["titan", "c.toml", "--nproc", "4", "--schedules", "DualPipe",
                                                    "--training.seq_len", "32"]))
    assert (args.nproc, args.schedules, args.overrides) == (4, "DualPipe", ["--training.seq_len", "32"])
    assert [v.schedule for v in bench._check(args)] == ["DualPipe"]
    for change, message in [({"schedules": "DualPipe,ZB"}, "unknown ['ZB']"), ({"steps": 3, "warmup": 3}, "--steps 3"),
                            ({"nproc": None}, "give --nproc N"), ({"comm_ratio": -1.0}, "--comm-ratio must be")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            bench._check(argparse.Namespace(**{**vars(args), **change}))
    ranks = [{"step_s": [9.0, 1.0, 2.0, 3.0], "exposed_s": [9.0, 0.5, 0.5, 0.5], "tokens_per_step": 100,
              "peak_memory_bytes": 7, "exposed_by_action": [{"pair": 9.0}] + [{"lone F": 0.4, "pair": 0.1}] * 3},
             {"step_s": [9.0, 1.5, 1.0, 3.5], "exposed_s": [9.0, 0.1, 0.3, 0.1], "tokens_per_step": 100,
              "peak_memory_bytes": 9, "exposed_by_action": [{"pair": 9.0}] + [{"pair": 0.1}, {"pair": 0.3}, {"pair": 0.1}]}]
    figures = bench.summarize([ranks], warmup=1)
    by_action = figures.pop("exposed_by_action")
    assert figures == pytest.approx({"step_time": 2.0, "tokens_per_s": 50.0, "peak_memory_bytes": 9, "exposed_comm": 0.3})
    assert by_action == pytest.approx({"lone F": 0.2, "pair": 0.1})  # mean over ranks, median over steps
    table = bench._exposed_by_action_table({"DualPipe": {"exposed_by_action": by_action}, "1F1B": {
        "exposed_by_action": {"outside our actions": 0.5}}}, 22)
    assert table[2].split() == ["schedule", "lone", "F", "pair"]  # the kinds that occur, in their order
    assert [line.split() for line in table[3:]] == [["DualPipe", "200", "100"]]
    ranks[0]["phases"] = [{"schedule": 9.0}, {"schedule": 1.0, "compute": 0.5}, {"schedule": 2.0, "compute": 1.0},
                          {"schedule": 3.0, "compute": 1.5}]
    ranks[1]["phases"] = [{"schedule": 9.0}, {"schedule": 3.0, "clip": 0.2}, {"schedule": 4.0}, {"schedule": 5.0}]
    assert bench.phase_breakdown([ranks], warmup=1) == pytest.approx({"schedule": 3.0, "compute": 0.5, "clip": 0.0})
    with pytest.raises(ValueError, match="no MoE blocks"):
        bench.block_seconds([{"block_forward_s": [], "block_backward_s": []}])
    with pytest.MonkeyPatch.context() as patch:  # a GPU machine: its network is real
        patch.setattr(bench, "_has_cuda", lambda: True)
        with pytest.raises(ValueError, match="give --comm-ratio 0"):
            bench._check(args)
        assert bench._check(argparse.Namespace(**{**vars(args), "comm_ratio": 0.0}))


def test_bench_titan_compile_runs_each_schedule_compiled_beside_eager(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``--compile``: each schedule's compiled run next to its eager one in the rounds, with
    torchtitan's compile overrides and one inductor cache for every run; the table's ``vs eager``."""
    from types import SimpleNamespace

    from titan_dualpipe.bench import titan as bench

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = bench.split_arguments(parser.parse_args(["titan", "c.toml", "--nproc", "1", "--schedules",
                                                    "1F1B,DualPipeV,DualPipe", "--compile"]))
    variants = bench._check(args)
    assert [v.label for v in variants] == ["1F1B", "1F1B compiled", "DualPipeV", "DualPipeV compiled", "DualPipe",
                                           "DualPipe compiled"]
    for eager, compiled in zip(variants[::2], variants[1::2]):
        assert (compiled.schedule, compiled.overlap) == (eager.schedule, eager.overlap)
        assert compiled.compiled and not eager.compiled
    seen: list[tuple[list[str], dict[str, str]]] = []

    def fake_run(argv: list[str], env: dict[str, str], **_: object) -> SimpleNamespace:
        seen.append((argv, env))
        (Path(env[bench.BENCH_DIR_ENV]) / "bench_rank0.json").write_text("{}")
        return SimpleNamespace(returncode=0)

    monkeypatch.delenv(bench.INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    launcher = bench.Launcher("c.toml", 1, None, [], tmp_path)
    for variant in variants[:2]:
        launcher.run(variant, 3, 0.0)
    (eager_argv, eager_env), (compiled_argv, compiled_env) = seen
    assert "--compile.enable" not in eager_argv and " ".join(bench.COMPILE_OVERRIDES) in " ".join(compiled_argv)
    cache = str(tmp_path / "inductor_cache")
    assert eager_env[bench.INDUCTOR_CACHE_ENV] == compiled_env[bench.INDUCTOR_CACHE_ENV] == cache
    figures = {"tokens_per_s": 1.0, "peak_memory_bytes": 2**20, "exposed_comm": 0.0}
    schedules = {"1F1B": {**figures, "step_time": 2.0}, "1F1B compiled": {**figures, "step_time": 0.5},
                 "DualPipe compiled": {**figures, "step_time": 1.0}}
    assert bench.vs_eager(schedules, "1F1B compiled") == 4.0
    assert bench.vs_eager(schedules, "1F1B") is None and bench.vs_eager(schedules, "DualPipe compiled") is None
    table = bench.format_table({"schedules": schedules, "block_compute_s": None, "rounds": 1, "steps": 3, "warmup": 1,
                                "nproc": 1})
    assert "vs eager" in table.splitlines()[0] and "4.00x" in table.splitlines()[2]


def test_bench_titan_w_at_i_runs_each_backward_whole_at_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``... W at I`` (on request, not by default) runs our schedule with
    ``TITAN_DUALPIPE_WEIGHT_GRADIENTS=whole``; the other runs keep the environment's setting."""
    from types import SimpleNamespace

    from titan_dualpipe.bench import titan as bench
    from titan_dualpipe.switches import WEIGHT_GRADIENTS_ENV

    assert not any("W at I" in label for label in bench.DEFAULT_LABELS)
    seen: list[dict[str, str]] = []

    def fake_run(argv: list[str], env: dict[str, str], **_: object) -> SimpleNamespace:
        seen.append(env)
        (Path(env[bench.BENCH_DIR_ENV]) / "bench_rank0.json").write_text("{}")
        return SimpleNamespace(returncode=0)

    monkeypatch.delenv(WEIGHT_GRADIENTS_ENV, raising=False)
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    launcher = bench.Launcher("c.toml", 1, None, [], tmp_path)
    for label in ("DualPipeV", "DualPipeV W at I", "DualPipe W at I"):
        launcher.run(bench.BY_LABEL[label], 3, 0.0)
    assert [env.get(WEIGHT_GRADIENTS_ENV) for env in seen] == [None, "whole", "whole"]


def test_matrix_covers_every_layout_and_flags_a_differing_rank() -> None:
    """The composability matrix (titan-dualpipe matrix): both schedules on every layout, DualPipe's
    twins folded and exchanged where FSDP can fold them; a cell fails on any rank's step off the
    reference by more than its tolerance."""
    from titan_dualpipe.check import matrix

    names = [c.name for c in matrix.cells()]
    for layout in matrix.LAYOUTS:
        assert f"{layout.name} DualPipeV" in names and f"{layout.name} DualPipe (exchanged twins)" in names
        assert (f"{layout.name} DualPipe (folded twins)" in names) == layout.folds
    reference = {1: (8.0, 2.0), 2: (7.0, 1.5)}
    same = {0: dict(reference), 3: dict(reference)}
    assert matrix.compare(same, reference, steps=2, rel=1e-4).startswith("OK")
    off = {0: dict(reference), 3: {1: (8.0, 2.0), 2: (7.0, 1.5 * (1 + 2e-4))}}
    assert matrix.compare(off, reference, steps=2, rel=1e-4).startswith("rank 3 step 2 grad_norm")
    assert matrix.compare({0: {1: (8.0, 2.0)}}, reference, steps=2, rel=1e-4) == "rank 0 logged steps [1]"
    table = matrix.markdown([matrix.Outcome("tp DualPipe (exchanged twins)", "0.2.2", True, "OK (worst rel 1e-05)")])
    assert "| tp | DualPipe (exchanged twins) | 0.2.2 | tested on CPU: OK" in table and "| cp |" in table
    log = ("[rank0]: ...; on this rank 12 weight GEMMs per microbatch wait for W (stage 0: 6, stage 3: 6; deferred "
           "weight gradients)\n"
           "[rank1]: ...; on this rank 16 weight GEMMs per microbatch wait for W (stage 1: 8, stage 2: 8; deferred "
           "weight gradients)\n")
    assert matrix._weight_gradients(log) == "; deferred W: up to 16 weight GEMMs per microbatch on a rank"
    assert matrix._weight_gradients("...; weight gradients: whole\n") == "; weight gradients: whole"
    assert matrix._weight_gradients("no note") == ""
    assert matrix._twins_args(matrix.Cell(matrix.LAYOUTS[0], "DualPipe", "exchanged"), registry=False)[1] == {
        FOLD_ENV: "0"}
    assert matrix._twins_args(matrix.Cell(matrix.LAYOUTS[0], "DualPipe", "folded"), registry=True)[0] == (
        "--parallelism.spmd_backend", "partial_dtensor")


def test_deferred_gemm_count_in_the_log_is_this_ranks_per_stage() -> None:
    """Every rank logs its own line: the count is this rank's, its stages named one by one."""
    from types import SimpleNamespace

    from titan_dualpipe.check import matrix
    from titan_dualpipe.titan.pipeline import _weight_gradients_note

    schedule = SimpleNamespace(weight_gradients="deferred", deferred_weights={3: ["a", "b"], 0: ["c", "d", "e", "f"]})
    note = _weight_gradients_note(schedule)
    assert note == ("; on this rank 6 weight GEMMs per microbatch wait for W (stage 0: 4, stage 3: 2; deferred "
                    "weight gradients)")
    assert matrix._weight_gradients(note) == "; deferred W: up to 6 weight GEMMs per microbatch on a rank"
    assert _weight_gradients_note(SimpleNamespace(weight_gradients="whole")) == "; weight gradients: whole"


def test_twins_are_not_folded_under_context_parallelism(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP shards over dp_shard x cp with context parallelism, a layout no CPU run can check:
    DualPipe's twins are then summed by the exchange, and its log line says why."""
    from types import SimpleNamespace

    from titan_dualpipe.titan import fold, pipeline

    monkeypatch.delenv(fold.FOLD_ENV, raising=False)
    dims = dict(pp=2, dp_replicate=1, fsdp_enabled=True, ep_enabled=False)
    assert fold.applies(SimpleNamespace(**dims, cp=1))
    assert not fold.applies(SimpleNamespace(**dims, cp=2))
    config = SimpleNamespace(context_parallel_degree=2)
    assert "context parallelism" in pipeline._twins_note("DualPipe", config)
