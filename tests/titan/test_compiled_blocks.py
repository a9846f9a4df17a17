"""torch.compile in torchtitan: its compiled blocks (inductor, C++ on the CPU) under both schedules,
end to end on 2 CPU processes, with the losses and grad norms of the eager runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from cases.titan_runs import COMPILE, MEMORY_BUDGET_AC, REGISTRY, SHORT_STEPS, assert_close, ok, train
from titan_dualpipe.switches import WEIGHT_GRADIENTS_ENV

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
    run = ok(train(name, runs_dir / f"compiled_{name}", *COMPILE, *COMPILE_RUNS[schedule], steps=SHORT_STEPS,
                   env=env, probe=True))
    assert COMPILED_BLOCKS_LOG in run.output
    assert ("budget option" in run.output) is bool(COMPILE_RUNS[schedule])
    # W ran the compiled blocks' weight GEMMs on both ranks (rank 1 holds blocks only), or none: on
    # 0.3.0 each layer's forward is wrapped on the instance, and wrapped layers keep their GEMMs in
    # the compiled backward
    ran = [run.probe(rank)["deferred_last_step"].get("linear", 0) for rank in (0, 1)]
    assert all(ran) if deferring and not REGISTRY else not any(ran), ran
    steps = range(1, SHORT_STEPS + 1)
    assert_close(run.losses(), {s: reference.losses()[s] for s in steps}, rel=COMPILE_TOLERANCE)
    assert_close(run.grad_norms(), {s: reference.grad_norms()[s] for s in steps}, rel=COMPILE_TOLERANCE)
