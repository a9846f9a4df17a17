"""Our schedules under torchtitan's other parallelisms: expert parallelism with the MoE debug model
and tensor parallelism, end to end on 4 CPU processes; DualPipe's twins folded into FSDP (the
meshes, the rank order) or summed by an exchange; the MoE token counts each pair's halves exchange,
on spawned gloo ranks (tests/cases/titan_cases.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cases import titan_cases
from cases.titan_runs import (FULL_AC, FULL_AC_LOG, NO_OVERLAP, REGISTRY, Run, assert_close, assert_trains,
                              assert_twins_identical, ok, train)
from titan_dualpipe.orders import compute_order
from titan_dualpipe.orders.lone_actions import lone_forwards, paired_backwards
from titan_dualpipe.switches import EXCHANGE_CHUNKS_ENV, FOLD_ENV, TWO_BATCH_ENV, WEIGHT_GEMMS_IN_FLIGHT_ENV
from titan_dualpipe.testing.spawn import run_on_processes


def _seed_checkpoint(runs_dir: Path, name: str) -> list[str]:
    """torchtitan's seed checkpoint of ``name`` (one process, no parallelism), and the
    overrides that start a run from it: the same initial weights under any layout."""
    seed = runs_dir / f"{name}_seed"
    ok(train(name, seed, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
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
    run = ok(train("debug_moe_dualpipe", runs_dir / "moe", *folding, probe=True, nproc=4, steps=steps))
    assert_trains(run.losses(), steps)
    logged = run.logged()
    assert sorted(logged) == [0, 1, 2, 3] and all(logged[rank] == logged[0] for rank in logged)
    assert all(run.probe(rank)["folded"] is True for rank in range(4)) and "twins folded into FSDP" in run.output
    assert "token counts exchanged on their own communicator (expert-parallel ranks" in run.output
    assert "CPU mode: FSDP computes in float32" in run.output
    assert any("moe.expert_bias" in name for name in run.probe(0)["stages"]["0"])
    for rank0, rank1 in ((0, 2), (1, 3)):
        _assert_expert_biases_identical(run, rank0, rank1)

    sequential = ok(train("debug_moe_dualpipe", runs_dir / "moe_sequential", *folding, *NO_OVERLAP, probe=True,
                          nproc=4, steps=steps))
    assert sequential.logged() == logged
    for rank in range(4):
        relayed, plain = run.probe(rank), sequential.probe(rank)
        assert relayed["relayed"]["hand_overs"] > 0 and plain["relayed"]["pairs"] == 0, (relayed, plain)
        assert relayed["stages"] == plain["stages"]

    exchange = ok(train("debug_moe_dualpipe", runs_dir / "moe_exchange", *common, probe=True, nproc=4,
                        steps=steps, env=None if REGISTRY else {FOLD_ENV: "0"}))
    assert all(exchange.probe(rank)["folded"] is False for rank in range(4))
    assert "token counts exchanged on their own communicator (expert-parallel ranks" in exchange.output
    assert "twins summed by an exchange" + (" (spmd_backend=spmd_types;" if REGISTRY else "") in exchange.output
    assert_twins_identical(exchange, 0, 2)
    assert_twins_identical(exchange, 1, 3)
    assert_close(run.losses(), exchange.losses(), rel=1e-3)
    assert_close(run.grad_norms(), exchange.grad_norms(), rel=1e-3)


@pytest.mark.titan_e2e
def test_dualpipe_under_tensor_parallel_swaps_loss_parallel_losses(runs_dir: Path) -> None:
    """pp=2 x TP 2 on 4 processes, with loss parallel (torchtitan's default once TP > 1): each
    loss is a DTensor, and DualPipe's two loss ranks swap their halves of them. Same losses and
    grad norms as 1F1B on the same layout (same weights at start); 1F1B logs them on the last
    pipeline rank's processes (global 2 and 3), ours on every rank."""
    steps = 4
    tensor_parallel = ("--parallelism.tensor_parallel_degree", "2")
    ours = ok(train("debug_dualpipe", runs_dir / "tp_dualpipe", *tensor_parallel, nproc=4, steps=steps))
    reference = ok(train("debug_dualpipe", runs_dir / "tp_1f1b", *tensor_parallel,
                         "--parallelism.pipeline_parallel_schedule", "1F1B", nproc=4, steps=steps))
    assert sorted(ours.logged()) == [0, 1, 2, 3]
    assert_trains(ours.losses(), steps)
    for rank in range(4):
        assert_close(ours.losses(rank), reference.losses(rank=2), rel=1e-4)
        assert_close(ours.grad_norms(rank), reference.grad_norms(rank=2), rel=1e-4)


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
    (``TITAN_DUALPIPE_WEIGHT_GEMMS_IN_FLIGHT=0``) ends with bitwise the same weights, and so does a
    run whose MoE layers exchange in two chunks (``TITAN_DUALPIPE_EXCHANGE_CHUNKS=2``)."""
    steps = 3
    two_rows = ("--parallelism.pipeline_parallel_microbatch_size", "2", "--training.local_batch_size", "8",
                "--training.seq_len", "32")
    # deterministic algorithms: otherwise two identical runs of this model differ on CPU
    args = ("--parallelism.pipeline_parallel_schedule", "DualPipeV", "--debug.deterministic", *two_rows,
            *FULL_AC)  # FULL_AC last (0.3.0)
    run = ok(train("debug_moe_dualpipe", runs_dir / "moe_v", *args, probe=True, nproc=4, steps=steps,
                   env={TWO_BATCH_ENV: "1"}))
    assert FULL_AC_LOG in run.output and "run as two sub-batches (two-batch overlap) on stages [3]" in run.output
    assert_trains(run.losses(), steps)
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
    whole = ok(train("debug_moe_dualpipe", runs_dir / "moe_v_whole", *args, probe=True, nproc=4, steps=steps))
    assert all(whole.probe(rank)["halves"]["microbatches"] == 0 for rank in range(4))
    assert_close(run.losses(), whole.losses(), rel=1e-4)
    assert_close(run.grad_norms(), whole.grad_norms(), rel=1e-4)
    inline = ok(train("debug_moe_dualpipe", runs_dir / "moe_v_inline", *args, probe=True, nproc=4, steps=steps,
                      env={WEIGHT_GEMMS_IN_FLIGHT_ENV: "0"}))
    assert inline.logged() == whole.logged()
    for rank in range(4):
        assert whole.probe(rank)["deferred_in_flight"] > 0 and inline.probe(rank)["deferred_in_flight"] == 0
        assert inline.probe(rank)["stages"] == whole.probe(rank)["stages"], rank
    chunked = ok(train("debug_moe_dualpipe", runs_dir / "moe_v_chunked", *args, probe=True, nproc=4, steps=steps,
                       env={EXCHANGE_CHUNKS_ENV: "2"}))
    assert "each MoE layer's token dispatch and combine run as 2 exchanges" in chunked.output
    assert chunked.logged() == whole.logged()
    for rank in range(4):
        probe = chunked.probe(rank)
        assert whole.probe(rank)["chunked"]["layers"] == 0 and probe["chunked"]["layers"] > 0, probe
        if rank >= 2:  # both stages hold MoE layers: each exchange a hand-over, twice as many exchanges
            assert probe["relayed"]["hand_overs"] == 2 * whole.probe(rank)["relayed"]["hand_overs"], rank
        assert probe["stages"] == whole.probe(rank)["stages"], rank


def test_moe_twin_expert_counts_summed() -> None:
    counts = run_on_processes(titan_cases.twin_expert_counts, 2)
    assert counts[0] == counts[1] == [[10.0] * 4, [12.0] * 4]


def test_token_count_exchange_is_read_at_once_on_its_own_communicator() -> None:
    """As torchtitan does, the count all-to-all is posted and read on the CPU before the token
    exchange hands over to the partner half, but on the count communicator, not the expert-parallel
    group's (where it would queue behind the partner's token exchange), and waited for once, inside
    the bench's exposed span; bench titan's comparison run hands over in between. On 0.3.0 under
    both SPMD backends: under its default, torchtitan's own count exchange is a blocking
    ``dist.all_to_all``, whose wait the bench would have counted as compute."""
    logs = run_on_processes(titan_cases.count_exchange_posts, 2)
    for rank in (0, 1):
        for backend, log in logs[rank].items():
            read_at_once, handed_over = log[False][:6], log[True][:6]
            assert read_at_once == ["post counts", "wait", "post tokens", "B0", "wait", "B1"], (backend, read_at_once)
            assert handed_over == ["post counts", "B0", "wait", "post tokens", "B1", "wait"], (backend, handed_over)


def test_count_twins_go_with_their_process_group() -> None:
    """Once torch lets go of the default group (destroy_process_group), nothing of ours holds it
    or the count communicators made in it."""
    assert run_on_processes(titan_cases.count_twins_released, 2) == {"made": True, "still held": []}


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


def test_twins_fold_into_torchtitan_style_fsdp_and_ep_meshes() -> None:
    """The folded meshes on torchtitan's layout (pp 2 x fsdp 2, EP 2): ``fsdp`` spans both
    pipeline ranks, ``efsdp`` each rank and its twin, ``ep`` stays within a pipeline rank, and
    FSDP2 composes ``efsdp`` with ``ep`` (one root). Gradients are summed over twins and
    replicas; the schedule's check sees every module folded, and names a rank folded in part.
    CPU mode's all-reduce-based reduce-scatter gives the same sums as gloo's reduce-scatter.
    Twins initialize their model parts in one order (part order), whatever order each holds."""
    results = run_on_processes(titan_cases.folded_meshes, 4)
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
