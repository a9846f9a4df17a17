"""Activation checkpointing under our schedules in torchtitan, end to end on 2 CPU processes: every
mode with one schedule and each schedule with some mode (torchtitan wraps our stage modules the same
way under both; the runtime tests check every mode under both on TinyLM), and the shipped GPU configs
at a debug size, each with its own AC."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from cases.titan_runs import REGISTRY, SHORT_STEPS, Run, assert_close, ok, train

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
    steps = range(1, SHORT_STEPS + 1)
    assert_close(run.losses(), {s: reference.losses(reference_rank)[s] for s in steps}, rel=AC_TOLERANCE)
    assert_close(run.grad_norms(), {s: reference.grad_norms(reference_rank)[s] for s in steps}, rel=AC_TOLERANCE)


@pytest.mark.titan_e2e
@pytest.mark.parametrize("schedule,mode", AC_RUNS, ids=[f"{s}-{m}" for s, m in AC_RUNS])
def test_activation_checkpointing_trains_with_the_losses_of_no_ac(runs_dir: Path, request: pytest.FixtureRequest,
                                                                   schedule: str, mode: str) -> None:
    """Full, selective per-op and (0.2.2) selective per-layer AC: the same losses and grad norms as the
    run without AC (selective AC's saved values serve one backward: its microbatches' backwards run whole)."""
    overrides, applied = AC_MODES[mode]
    name = "debug_dualpipev" if schedule == "DualPipeV" else "debug_dualpipe"
    reference = request.getfixturevalue("dualpipev_run" if schedule == "DualPipeV" else "dualpipe_run")
    run = ok(train(name, runs_dir / f"ac_{name}_{mode}", *overrides, steps=SHORT_STEPS))
    assert applied in run.output
    _assert_same_training(run, reference)


@pytest.mark.titan_e2e
@pytest.mark.skipif(REGISTRY, reason="the debug-size overrides are torchtitan 0.2.2's")
def test_llama3_8b_config_trains_at_debug_size_with_its_selective_ac(runs_dir: Path, dualpipev_run: Run) -> None:
    """The shipped Llama 3 8B config (DualPipeV, selective per-op AC), at debug_dualpipev's size:
    the same losses as debug_dualpipev without AC."""
    run = ok(train("llama3_8b_dualpipev", runs_dir / "llama3_8b_debug", *DEBUG_SIZE, steps=SHORT_STEPS))
    assert AC_MODES["selective_op"][1] in run.output and "DualPipeV" in run.output
    _assert_same_training(run, dualpipev_run)


@pytest.mark.titan_e2e
@pytest.mark.skipif(REGISTRY, reason="the debug-size overrides are torchtitan 0.2.2's")
def test_deepseek_v3_16b_config_trains_at_debug_size_with_its_full_ac(runs_dir: Path) -> None:
    """The shipped DeepSeek-V3 16B config (DualPipe, full AC, MoE) on the deepseek_v3 debug model,
    2 processes (no expert parallelism): it trains."""
    run = ok(train("deepseek_v3_16b_dualpipe", runs_dir / "deepseek_16b_debug", *DEBUG_SIZE,
                   "--training.local_batch_size", "4", "--training.seq_len", "64",
                   "--parallelism.expert_parallel_degree", "1", steps=SHORT_STEPS))
    assert AC_MODES["full"][1] in run.output
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) and v > 0 for v in losses.values())
    assert losses[3] < losses[1], losses
