"""Runtime schedules vs a single-process reference (CPU, gloo, 4 spawned ranks).

Each case trains two steps with an Adam step between and checks per-microbatch losses
and every parameter gradient of every stage on every rank (rtol 1e-5, atol 4e-5).
"""

from __future__ import annotations

import pytest

from cases import pipeline_cases as cases, tp_cases
from cases.dist_pool import WorkerPool, ran as _ran
from titan_dualpipe._compat import pipelining
from titan_dualpipe.orders import compute_order, placement
from titan_dualpipe.orders.lone_actions import lone_forwards

WORLD = 4  # the module's pool (tests/conftest.py)


NUMERICS = [
    ("DualPipeV", 1, 2), ("DualPipeV", 1, 3),
    ("DualPipeV", 2, 4), ("DualPipeV", 2, 7),
    ("DualPipeV", 4, 8), ("DualPipeV", 4, 11),
    ("DualPipe", 2, 4), ("DualPipe", 2, 6),
    ("DualPipe", 4, 8), ("DualPipe", 4, 10),
]


@pytest.mark.parametrize("schedule,pp,n", NUMERICS)
def test_matches_reference(pool, schedule, pp, n):
    ran = _ran(pool.run(cases.numerics, schedule=schedule, pp=pp, n=n))
    assert len(ran) == pp
    assert sum(r["losses_checked"] for r in ran) == (2 if schedule == "DualPipe" else 1) * 2 * n
    assert max(r["grad_err"] for r in ran) <= cases.ATOL
    if schedule == "DualPipe":
        assert all(r["twin_parts"] == pp for r in ran)


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 2, 5), ("DualPipe", 4, 8)])
def test_sum_of_losses_without_grad_scaling(pool, schedule, pp, n):
    _ran(pool.run(cases.numerics, schedule=schedule, pp=pp, n=n, scale_grads=False))


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 2, 5), ("DualPipeV", 4, 8), ("DualPipe", 2, 4), ("DualPipe", 4, 10)])
def test_deferred_recv(pool, schedule, pp, n):
    _ran(pool.run(cases.numerics, schedule=schedule, pp=pp, n=n, defer_pp_recv=True))


@pytest.mark.parametrize("schedule,pp,n", [
    ("DualPipeV", 2, 5), ("DualPipe", 2, 4),  # 2 (pp) x 2 (dp) mesh
    ("DualPipeV", 4, 8), ("DualPipe", 4, 8),  # 4 x 1: split backwards run first on most ranks
])
def test_fsdp2(pool, schedule, pp, n):
    """Nested fully_shard (per layer and per stage); the twin sum composes with FSDP's reduction."""
    ran = _ran(pool.run(cases.numerics, schedule=schedule, pp=pp, n=n, fsdp=True))
    assert len(ran) == WORLD


_TORCH_2_15_OPTIONS = {"defer_reduce_grad_wait": pipelining.ASYNC_REDUCE_GRAD, "unshard_lookahead": pipelining.UNSHARD_LOOKAHEAD}


@pytest.mark.parametrize("schedule,pp,n,options", [
    ("DualPipeV", 2, 5, {"defer_reduce_grad_wait": True}), ("DualPipe", 2, 4, {"defer_reduce_grad_wait": True}),
    ("DualPipeV", 4, 8, {"defer_reduce_grad_wait": True, "unshard_lookahead": "auto"}),
    ("DualPipeV", 2, 5, {"unshard_lookahead": (1, 1)}), ("DualPipe", 4, 8, {"max_active_stages": 2, "unshard_lookahead": (1,) * 4}),
])
def test_torchs_fsdp_options_train_as_the_reference(pool, schedule, pp, n, options):
    """torch 2.15's FSDP options of its runtime, on ours, with FSDP2: the reduction started at
    REDUCE_GRAD and waited later (before the next reduction, or at the end), one stage unsharded
    unshards issued one stage ahead (a rank's second stage unsharded at its first compute). On a torch without them, the same
    PipelineConfigError names the release on every rank."""
    missing = [name for name in options if not _TORCH_2_15_OPTIONS.get(name, True)
               and options[name] not in (False, "full")]
    if missing:
        errors = [e for e in pool.run(cases.bad_schedule_options, schedule=schedule, pp=pp, n=n, **options) if e]
        assert len(errors) == pp and len(set(errors)) == 1 and "needs torch 2.15 or later" in errors[0], errors
        return
    ran = _ran(pool.run(cases.numerics, schedule=schedule, pp=pp, n=n, fsdp=True, **options))
    assert len(ran) == WORLD


@pytest.mark.parametrize("schedule,pp,n,cap", [("DualPipeV", 2, 5, 1), ("DualPipeV", 4, 8, 2), ("DualPipe", 4, 8, 2)])
def test_capped_outstanding_sends_train_as_the_reference(pool, schedule, pp, n, cap):
    """``max_outstanding_sends``: the oldest sends are waited for once more are pending (every
    torch); the cap is one the NCCL model completes (checked at construction)."""
    _ran(pool.run(cases.numerics, schedule=schedule, pp=pp, n=n, max_outstanding_sends=cap))


@pytest.mark.parametrize("schedule,pp,n,options", [
    ("DualPipeV", 2, 4, {}), ("DualPipe", 2, 4, {}), ("DualPipeV", 2, 4, {"overlap": False}),
    ("DualPipeV", 2, 4, {"two_batch_overlap": "all"}),
])
def test_forward_contexts_enter_once_per_forward(pool, schedule, pp, n, options):
    """torch 2.15's ``PipelineStage.register_forward_context``: ours enter it once around every
    forward of every stage, pairs and two-batch halves included (a forward in halves: once)."""
    if not hasattr(pipelining.PipelineStage, "register_forward_context"):
        pytest.skip("torch's stages take a forward context from 2.15 on")
    place = placement(schedule, pp, n)
    for rank, seen in enumerate(pool.run(cases.forward_contexts_seen, schedule=schedule, pp=pp, n=n, **options)[:pp]):
        want = sorted((s, mb) for s in place.stages_of(rank) for mb in place.microbatches(s))
        assert seen == want, (rank, seen)


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 2, 4), ("DualPipe", 4, 8)])
def test_sent_outputs_are_released_once_sent(pool, schedule, pp, n):
    """torch 2.15's stages can drop a forward's outputs once their send completed (the backward
    starts from their autograd edges): ours release every sent microbatch, once."""
    if not hasattr(pipelining.PipelineStage, "release_fwd_send_outputs"):
        pytest.skip("torch's stages hold sent outputs to their backward before 2.15")
    for r in pool.run(cases.released_after_send, schedule=schedule, pp=pp, n=n)[:pp]:
        assert r["released"] == r["sends"], r
        assert any(r["sends"].values()), r


def test_fewer_than_two_active_stages_are_refused(pool):
    """A pair computes on both of a rank's stages at once: ``max_active_stages=1`` is refused on
    every rank, naming why (torch 2.15's lowering raises for it mid-construction)."""
    errors = pool.run(cases.bad_schedule_options, schedule="DualPipeV", pp=2, n=4, max_active_stages=1)
    assert errors[:2] == [errors[0]] * 2 and "max_active_stages=1: an overlapped pair" in errors[0], errors


@pytest.mark.parametrize("defer_recv", [False, True])
def test_every_send_cap_completes_on_nccl(defer_recv):
    """On the NCCL model (no buffering: a waited send blocks its rank until the peer posts the
    receive), DualPipe(V)'s orders complete under any ``max_outstanding_sends``, 0 (each send
    waited at once) included: every receive is posted before its rank waits on anything its
    sender posts later. The constructor still checks a hand-made (CSV) order against its cap."""
    from titan_dualpipe.orders.lowering import lower
    from titan_dualpipe.orders.nccl_model import Wait, check_completes, planned_trace

    for schedule, pp, n in (("DualPipeV", 2, 5), ("DualPipeV", 4, 8), ("DualPipeV", 8, 17), ("DualPipe", 2, 4),
                            ("DualPipe", 4, 10), ("DualPipe", 8, 16)):
        place = placement(schedule, pp, n)
        lowered = lower(compute_order(schedule, pp, n), place, defer_recv=defer_recv)
        uncapped = planned_trace(lowered, place)
        for cap in (0, 1, 2):
            capped = planned_trace(lowered, place, max_outstanding_sends=cap)
            assert sum(isinstance(e, Wait) for events in capped.values() for e in events) == \
                sum(isinstance(e, Wait) for events in uncapped.values() for e in events)  # each send waited once
            check_completes(capped)


@pytest.mark.parametrize("schedule,pp,n,runtime", [
    ("DualPipeV", 2, 5, "torch_csv"),  # torch's _PipelineScheduleRuntime loads our CSV and runs it
    ("DualPipeV", 2, 5, "ours_csv_compute_only"),
    ("DualPipe", 4, 8, "ours_csv_compute_only"),
    ("DualPipeV", 4, 9, "ours_csv_compute_comms"),
    ("DualPipe", 2, 6, "ours_csv_compute_comms"),
])
def test_csv_orders_train_correctly(pool, schedule, pp, n, runtime):
    ran = _ran(pool.run(cases.numerics, schedule=schedule, pp=pp, n=n, runtime=runtime))
    assert max(r["grad_err"] for r in ran) <= cases.ATOL


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 2, 5), ("DualPipeV", 4, 8), ("DualPipe", 2, 4), ("DualPipe", 4, 10)])
def test_overlapped_pairs_bitwise_equal_sequential_and_timeline(pool, schedule, pp, n):
    ran = _ran(pool.run(cases.overlap_matches_sequential, schedule=schedule, pp=pp, n=n))
    assert all(r["values_compared"] > 0 and r["timed_actions"] > 0 for r in ran)


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 2, 4), ("DualPipe", 4, 8)])
def test_schedules_over_the_same_modules_each_route_their_own_weight_gradients(pool, schedule, pp, n):
    """A schedule built later over the same modules (an eval schedule, a baseline) must not take
    over the deferred GEMMs of the first, nor leave our nodes in torch's split W."""
    ran = _ran(pool.run(cases.schedules_over_shared_modules, schedule=schedule, pp=pp, n=n))
    for r in ran:
        assert [name for name, _ in r["grad_err"]] == ["A", "split", "A", "B"]
        assert all(err <= cases.ATOL for _, err in r["grad_err"]), r
    a, split, a_again, b = (sum(r["deferred_gemms"][i][1] for r in ran) for i in range(4))  # over the ranks
    assert a > 0 and split == 0 and a_again == a and b == a, ran


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 2, 4), ("DualPipe", 2, 4), ("DualPipe", 4, 8)])
def test_eval_forward_only(pool, schedule, pp, n):
    ran = _ran(pool.run(cases.eval_matches_reference, schedule=schedule, pp=pp, n=n))
    assert sum(r["outputs_checked"] for r in ran) == n


@pytest.mark.parametrize("schedule,pp,n,mistake,expected", [
    ("DualPipeV", 2, 4, "no_target", ["pass target="]),
    ("DualPipe", 4, 8, "no_target", ["pass target="]),
    ("DualPipeV", 2, 8, "batch", ["the batch has 13 samples", "not a multiple of n_microbatches=8", "e.g. 8"]),
    ("DualPipe", 2, 6, "batch", ["the batch has 9 samples", "n_microbatches=6"]),
    ("DualPipe", 4, 8, "halves", ["rank 0: 16 samples, rank 3: 8 samples", "same batch on ranks 0 and pp-1"]),
    ("DualPipeV", 2, 4, "mixed", ["whole-batch inputs together with arg_mbs"]),
    ("DualPipe", 2, 4, "unsplittable", ["rank 0: the whole-batch inputs split into 3 microbatches", "n_microbatches=4"]),
    ("DualPipeV", 2, 4, "entries", ["rank 0: arg_mbs[0] is a Tensor", "pass arg_mbs=[(x0,), (x1,), ...]"]),
])
def test_bad_step_inputs_raise_on_every_rank(pool, schedule, pp, n, mistake, expected):
    messages = _ran(pool.run(cases.bad_step_inputs, timeout_s=60, schedule=schedule, pp=pp, n=n, mistake=mistake))
    assert len(messages) == pp and len(set(messages)) == 1, messages
    assert all(e in messages[0] for e in expected), messages[0]


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
@pytest.mark.parametrize("mistake,expected", [
    ("one_stage", "exactly two stages per rank"),
    ("wrong_ids", "Rank r holds stages r and 2*pp-1-r"),
    ("num_stages", "num_stages=4"),
])
def test_bad_stage_lists(pool, schedule, mistake, expected):
    messages = _ran(pool.run(cases.bad_stage_list, timeout_s=60, schedule=schedule, pp=2, n=4, mistake=mistake))
    assert all(expected in m for m in messages), messages


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
def test_a_mistake_on_one_rank_raises_on_every_rank(pool, schedule):
    """Rank 1 alone passes stage ids [2, 2]: ranks 0, 2 and 3 raise the same error, naming the ids as passed."""
    messages = _ran(pool.run(cases.bad_stage_list, timeout_s=60, schedule=schedule, pp=4, n=8,
                             mistake="same_id_twice", only_rank=1))
    assert len(messages) == 4 and len(set(messages)) == 1, messages
    assert "rank 1 of 4 needs stages [1, 6]" in messages[0] and "got stage ids [6, 6]" in messages[0]


@pytest.mark.parametrize("schedule,n,expected", [
    ("DualPipeV", 3, "n_microbatches >= 2 * pp_size"),
    ("DualPipe", 5, "even number of microbatches"),
    ("DualPipe", 2, "n_microbatches >= 2 * pp_size"),
])
def test_bad_microbatch_counts(pool, schedule, n, expected):
    messages = _ran(pool.run(cases.bad_stage_list, schedule=schedule, pp=2, n=n, mistake="none"))
    assert all(expected in m for m in messages), messages


GROUP_TIMEOUT_S = 10


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 4, 8), ("DualPipe", 4, 8)])
def test_a_killed_rank_is_named_by_every_other_rank(schedule, pp, n):
    """Pipeline rank 1 is killed mid-step: its neighbours lose the connection at once, the
    others wait at most the group timeout, and every one of them names rank 1."""
    with WorkerPool(WORLD, pg_timeout_s=GROUP_TIMEOUT_S) as own:
        outcomes = own.outcomes(cases.killed_mid_step, timeout_s=GROUP_TIMEOUT_S + 90, schedule=schedule, pp=pp, n=n,
                                victim=1, group_timeout_s=GROUP_TIMEOUT_S)
    assert outcomes[1][0] is False and "died" in outcomes[1][1], outcomes[1]
    for rank in (0, 2, 3):
        ok, result = outcomes[rank]
        assert ok and result["raised"].startswith("PeerFailed: "), (rank, result)
        assert "pipeline rank 1 (global rank 1)" in result["raised"], (rank, result)
        assert result["elapsed_s"] < GROUP_TIMEOUT_S + 15, (rank, result)


@pytest.mark.parametrize("pp,n", [(2, 4), (4, 8)])  # fold groups: all 4 ranks; {0, 3} and {1, 2}
def test_twins_folded_into_fsdp(pool, pp, n):
    """FSDP2 over twins x replicas: the twins are one sharded parameter, FSDP's reduce-scatter
    sums their gradients (no twin exchange); losses and every gradient match the reference,
    and every rank's FSDP collectives line up with its fold group's (NCCL's semantics)."""
    from titan_dualpipe.orders.nccl_model import check_completes

    ran = _ran(pool.run(cases.folded_twins, pp=pp, n=n))
    assert all(r["folded"] for r in ran) and len(ran) == WORLD
    assert max(r["grad_err"] for r in ran) <= cases.ATOL and all(r["twin_parts"] == pp for r in ran)
    check_completes({r["rank"]: r["events"] for r in ran})


AC_CASES = [("DualPipeV", 2, 5, "selective"), ("DualPipeV", 4, 8, "mixed"),
            ("DualPipe", 2, 4, "selective"), ("DualPipe", 4, 8, "mixed")]


def _checkpointed(r: dict, style: str) -> set[int]:
    """The stages of a rank that hold a checkpointed block (``mixed``: every block but each third)."""
    return {s for s, names in r["layers"].items() if any(style == "selective" or int(name) % 3 != 2 for name in names)}


def _checkpointed_blocks(r: dict, style: str) -> set[str]:
    return {name for names in r["layers"].values() for name in names if style == "selective" or int(name) % 3 != 2}


@pytest.mark.parametrize("schedule,pp,n,style", AC_CASES)
def test_activation_checkpointed_blocks_with_torchs_split(pool, schedule, pp, n, style):
    """Blocks under torch's checkpoint(use_reentrant=False), selective (create_selective_checkpoint_contexts)
    and full, as user code writes it, with ``weight_gradients="split"``: losses and every gradient
    equal the reference without AC; the backwards of exactly the microbatches of stages holding a
    checkpointed block run whole at I."""
    ran = _ran(pool.run(cases.checkpointed_numerics, schedule=schedule, pp=pp, n=n, style=style,
                        weight_gradients="split"))
    assert len(ran) == pp and max(r["grad_err"] for r in ran) <= cases.ATOL
    assert sum(r["losses_checked"] for r in ran) == (2 if schedule == "DualPipe" else 1) * 2 * n
    for r in ran:
        checkpointed = _checkpointed(r, style)
        assert {s for s, _ in r["whole_at_input"]} == checkpointed, r
        assert len(r["whole_at_input"]) == len(checkpointed) * (n // 2 if schedule == "DualPipe" else n), r
        assert not r["deferred_gemms"], r


@pytest.mark.parametrize("schedule,pp,n,style", [*AC_CASES[:2], ("DualPipe", 4, 8, "selective"), AC_CASES[3]])
def test_activation_checkpointed_blocks_defer_their_weight_gemms(pool, schedule, pp, n, style):
    """The same blocks under the default ``weight_gradients="deferred"``: every gradient equals the
    reference; no I runs whole, every I (all stages but a chain's first, whose I has nothing to
    do) queues one weight GEMM per nn.Linear for its W (counted in the last step); each checkpointed block is recomputed
    exactly once per microbatch (counted inside the last step's backwards), an unchecked one never."""
    ran = _ran(pool.run(cases.checkpointed_numerics, schedule=schedule, pp=pp, n=n, style=style))
    assert len(ran) == pp and max(r["grad_err"] for r in ran) <= cases.ATOL
    assert sum(c for r in ran for c in r["deferred_gemms"].values()) > 0
    assert any(_checkpointed_blocks(r, style) for r in ran)
    per_stage = n // 2 if schedule == "DualPipe" else n
    order = compute_order(schedule, pp, n)
    for r in ran:
        assert not r["whole_at_input"], r
        # TinyLM posts no exchange: a B computes its weight GEMMs inline, none waits for a flight
        assert (r["in_flight_stages"], r["in_flight_gemms"]) == ([], 0), r
        for stage, linears in r["linears"].items():
            assert linears == r["linear_modules"][stage] > 0, r
            inputs = [a for acts in order.values() for a in acts
                      if a is not None and a.stage_index == stage and a.computation_type == pipelining.I]
            first = placement(schedule, pp, n).is_first(stage)
            want = 0 if first else linears * len(inputs)  # the last step's
            assert r["deferred_gemms"].get(stage, 0) == want, (stage, r)
        checkpointed = _checkpointed_blocks(r, style)
        for name in (n for names in r["layers"].values() for n in names):
            assert r["recomputes"].get(name, 0) == (per_stage if name in checkpointed else 0), (name, r)


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
@pytest.mark.parametrize("weight_gradients,not_deferred", [
    ("whole", ()), ("split", ()), ("deferred", ("output", "layers.*.w2")),
])
def test_weight_gradient_modes(pool, schedule, weight_gradients, not_deferred):
    """pp 4, no AC: every mode gives the reference's gradients. ``whole``: every I runs the full
    backward; ``split``: none does and nothing is deferred; ``deferred`` with names left out: those
    modules keep autograd's weight gradient, the others' GEMMs wait for W."""
    pp, n = 4, 8
    ran = _ran(pool.run(cases.checkpointed_numerics, schedule=schedule, pp=pp, n=n, style="none",
                        weight_gradients=weight_gradients, not_deferred=list(not_deferred)))
    assert len(ran) == pp and max(r["grad_err"] for r in ran) <= cases.ATOL
    order = compute_order(schedule, pp, n)
    place = placement(schedule, pp, n)
    for r in ran:
        inputs = {s: sum(1 for acts in order.values() for a in acts
                         if a is not None and a.stage_index == s and a.computation_type == pipelining.I)
                  for s in r["layers"]}
        whole = {s: sum(1 for stage, _ in r["whole_at_input"] if stage == s) for s in r["layers"]}
        if weight_gradients == "whole":  # every microbatch of every stage, should its backward be an I
            per_stage = n // 2 if schedule == "DualPipe" else n
            assert set(whole.values()) == {per_stage} and not r["deferred_gemms"] and not r["deferred_names"], r
            continue
        assert not any(whole.values()), r
        if weight_gradients == "split":
            assert not r["deferred_gemms"] and not r["deferred_names"], r
            continue
        for s, names in r["deferred_names"].items():
            assert sorted(names) == sorted(f"layers.{layer}.{m}" for layer in r["layers"][s] for m in ("qkv", "proj", "w1"))
            want = 0 if place.is_first(s) else len(names) * inputs[s]
            assert r["deferred_gemms"].get(s, 0) == want, (s, r)


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 2, 5), ("DualPipe", 2, 4)])
def test_static_rule_keeps_a_stages_backward_whole(pool, schedule, pp, n):
    """The per-stage rule (the hook for regions known from the module, not from the forward):
    the marked stage's backwards all run whole at I, the other stage's split, gradients exact."""
    ran = _ran(pool.run(cases.whole_backward_by_rule, schedule=schedule, pp=pp, n=n))
    assert max(r["grad_err"] for r in ran) <= cases.ATOL
    for r in ran:
        (marked,) = r["marked"]
        assert {s for s, _ in r["whole_at_input"]} == {marked}, r
        assert len(r["whole_at_input"]) == (n // 2 if schedule == "DualPipe" else n), r


# -- torch's schedule contract --------------------------------------------------------------------

GC_CASES = [("DualPipeV", 1, 2), ("DualPipeV", 2, 4), ("DualPipeV", 4, 8), ("DualPipe", 2, 4), ("DualPipe", 4, 8)]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sequential"])
@pytest.mark.parametrize("schedule,pp,n", GC_CASES)
def test_a_step_leaves_no_tensor_to_the_cycle_collector(pool, schedule, pp, n, overlap):
    """torch's check_leaked_tensors: with the cycle collector off, a second step() leaves no
    tensor in a reference cycle (every rank; 1, 2 and 4 ranks; pairs overlapped and sequential)."""
    ran = _ran(pool.run(cases.tensors_left_for_gc, schedule=schedule, pp=pp, n=n, overlap=overlap))
    assert len(ran) == pp
    assert all(r["tensors"] == 0 for r in ran), ran


@pytest.mark.parametrize("schedule,pp,n,callbacks", [
    ("DualPipeV", 2, 4, "torchtitan"), ("DualPipeV", 4, 8, "torchtitan"),
    ("DualPipeV", 2, 5, "torch_tests"), ("DualPipeV", 4, 8, "torch_tests"),
    ("DualPipe", 2, 4, "torch_tests"), ("DualPipe", 4, 8, "torch_tests"),
])
def test_custom_functions_written_for_torchs_runtime(pool, schedule, pp, n, callbacks):
    """register_custom_function with functions written against torch's _PipelineScheduleRuntime
    (torchtitan 0.2.2's DualPipeV overlap_callback; torch's own test callbacks for F and
    OVERLAP_F_B): they run every pair (and forward) of both steps, and train like the reference."""
    if callbacks == "torchtitan":
        pytest.importorskip("torchtitan.distributed.dual_pipe_v")
    ran = _ran(pool.run(cases.custom_functions_numerics, schedule=schedule, pp=pp, n=n, callbacks=callbacks))
    assert len(ran) == pp and max(r["grad_err"] for r in ran) <= cases.ATOL
    assert sum(r["losses_checked"] for r in ran) == (2 if schedule == "DualPipe" else 1) * 2 * n
    for r in ran:
        assert r["pairs"] > 0 and r["calls"]["OVERLAP_F_B"] == 2 * r["pairs"], r
        if callbacks == "torch_tests":
            assert r["calls"]["F"] == 2 * (r["forwards"] + r["pairs"]), r


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 1, 2), ("DualPipeV", 2, 4), ("DualPipeV", 4, 8),
                                           ("DualPipe", 2, 4), ("DualPipe", 4, 8)])
def test_static_stage_metadata(pool, schedule, pp, n):
    """Stages built with input_args=/output_args= (no shape inference) train like the reference."""
    ran = _ran(pool.run(cases.static_metadata_numerics, schedule=schedule, pp=pp, n=n))
    assert len(ran) == pp and max(r["grad_err"] for r in ran) <= cases.ATOL
    assert sum(r["losses_checked"] for r in ran) == (2 if schedule == "DualPipe" else 1) * 2 * n
    if pipelining.HAS_METADATA_VOTE:
        assert all(r["modes"] == ["InferenceMode.STATIC"] for r in ran), ran


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 1, 2), ("DualPipeV", 2, 4), ("DualPipeV", 4, 9),
                                           ("DualPipe", 2, 4), ("DualPipe", 4, 8)])
def test_traced_stages_on_gloo(pool, schedule, pp, n):
    """Stages from torch's tracer frontend (pipeline(...), build_stage) start on gloo and train
    like the reference: every loss and gradient, two steps with Adam between."""
    ran = _ran(pool.run(cases.traced_numerics, schedule=schedule, pp=pp, n=n))
    assert len(ran) == pp and max(r["grad_err"] for r in ran) <= cases.ATOL
    assert sum(r["losses_checked"] for r in ran) == (2 if schedule == "DualPipe" else 1) * 2 * n


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
def test_configuration_errors_are_value_and_runtime_errors(pool, schedule):
    """Code written against torch's schedules catches RuntimeError, ours ValueError: one class is both."""
    from titan_dualpipe import PipelineConfigError

    assert issubclass(PipelineConfigError, ValueError) and issubclass(PipelineConfigError, RuntimeError)
    kinds = _ran(pool.run(cases.bad_stage_list, schedule=schedule, pp=2, n=4, mistake="wrong_ids", error_kind=True))
    assert kinds == ["PipelineConfigError"] * 2, kinds


@pytest.mark.parametrize("schedule,pp,n,runtime", [
    ("DualPipeV", 2, 5, "ours_selective_ac"), ("DualPipe", 2, 4, "ours_mixed_ac"),  # 2 (pp) x 2 (dp) mesh
    ("DualPipeV", 4, 8, "ours_mixed_ac"),  # 4 x 1
])
@pytest.mark.parametrize("weight_gradients", ["deferred", "split"])
def test_checkpointed_blocks_with_fsdp2(pool, schedule, pp, n, runtime, weight_gradients):
    """Checkpointed blocks (selective AC; selective / full / none in turn) inside nested fully_shard:
    every loss and gradient equal the reference without AC on every rank (FSDP2 reduces after the
    last W). Deferred: weight GEMMs waited for W, no backward ran whole; split: some ran whole."""
    ran = _ran(pool.run(cases.checkpointed_fsdp_numerics, schedule=schedule, pp=pp, n=n, runtime=runtime,
                        weight_gradients=weight_gradients))
    assert len(ran) == WORLD and max(r["grad_err"] for r in ran) <= cases.ATOL
    if weight_gradients == "deferred":  # DualPipe at pp 2 has I actions on its chains' first stages only
        can_defer = not (schedule == "DualPipe" and pp == 2)
        assert (sum(r["deferred_gemms"] for r in ran) > 0) == can_defer and not any(r["whole_at_input"] for r in ran), ran
    else:
        assert sum(r["whole_at_input"] for r in ran) > 0 and not any(r["deferred_gemms"] for r in ran), ran


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 2, 4), ("DualPipe", 2, 4), ("DualPipeV", 1, 2)])
def test_inputs_agreed_at_the_first_step_and_eval_only(pool, schedule, pp, n):
    """A step (or eval) whose inputs have the first one's shapes posts no agreement collective (no
    host sync); a changed shape raises on the rank that passed it."""
    ran = _ran(pool.run(cases.agreement_collectives, schedule=schedule, pp=pp, n=n))
    for r in ran:
        first_step, second_step, first_eval, second_eval = r["all_gathers"]
        assert first_step >= 1 and first_eval >= 1, r
        assert second_step == 0 and second_eval == 0, r
    if pp == 1:
        assert "differ from the first step's" in ran[0]["changed_inputs_error"], ran[0]
        error = ran[0]["changed_inputs_error"]
        assert "microbatch 0: " in error and "(2, 8) int64" in error and "(2, 7) int64" in error, error


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 2, 4), ("DualPipe", 2, 4), ("DualPipe", 4, 8)])
def test_whole_batch_and_pre_split_calls_interchange(pool, schedule, pp, n):
    """As torch's schedules: step()/eval() with the whole batch and with arg_mbs=/target_mbs= of the same
    microbatches alternate in any order (ranks agree on a mode's first call only, by microbatches);
    evals give equal losses, steps the reference's losses and gradients."""
    ran = _ran(pool.run(cases.microbatch_forms, schedule=schedule, pp=pp, n=n))
    assert len(ran) == pp and max(r["grad_err"] for r in ran) <= cases.ATOL
    assert sum(r["eval_losses"] for r in ran) == (2 if schedule == "DualPipe" else 1) * n


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 2, 4), ("DualPipe", 4, 8)])
def test_changed_microbatch_shapes_raise_on_every_rank(pool, schedule, pp, n):
    """Pre-split microbatches unlike the first eval's (one token shorter): the ranks passing them raise
    naming both shapes; every other rank's error, when its traffic fails, names that first failure."""
    ran = _ran(pool.run(cases.changed_microbatches, schedule=schedule, pp=pp, n=n, group_timeout_s=4))
    assert len(ran) == pp
    for r in ran:
        raised = r["raised"]
        assert "differ from the first step's" in raised and "(2, 8) int64" in raised and "(2, 7) int64" in raised, r
        assert raised.startswith("PipelineConfigError: " if r["feeds"] else "PeerFailed: "), r
    assert any(not r["feeds"] for r in ran)


@pytest.mark.parametrize("schedule,pp,n,two_batch,grad", [
    ("DualPipeV", 2, 4, False, False), ("DualPipe", 2, 4, False, False),
    ("DualPipeV", 2, 4, True, False), ("DualPipe", 2, 4, True, True), ("DualPipeV", 2, 4, False, True),
])
def test_eval_holds_no_output_it_does_not_return(pool, schedule, pp, n, two_batch, grad):
    """eval(losses=..., return_outputs=False) (the torchtitan adapter's) frees each stage output at
    its last use: no stage's ``fwd_cache`` and no two-batch halves hold any at the end, and from n
    to 2n microbatches the peak grows by less than the added last-stage outputs (logits), where
    eval's default (torch's: the outputs returned) grows by at least them. The default returns the
    outputs, with the same losses (checked against the reference)."""
    ran = _ran(pool.run(cases.eval_held_outputs, schedule=schedule, pp=pp, n=n, two_batch=two_batch, grad=grad))
    for r in ran:
        assert all(not any(held.values()) for held in r["fwd_cache"].values()), r
        assert all(not any(held) for held in r["halves"].values()), r
        assert r["outputs_checked"] == r["last_microbatches"], r
        added = r["last_microbatches"][2 * n] - r["last_microbatches"][n]
        if added:
            assert r["peak"][2 * n] - r["peak"][n] < added * r["logits_bytes"], r
            assert r["peak_with_outputs"][2 * n] - r["peak_with_outputs"][n] >= added * r["logits_bytes"], r
        print(f"eval peak bytes, rank {r['rank']}: return_outputs=False {r['peak']}, default {r['peak_with_outputs']}")
    assert sum(r["last_microbatches"][n] for r in ran) == n  # every microbatch's output checked once


@pytest.mark.parametrize("schedule,n", [("DualPipeV", 4), ("DualPipe", 4)])
@pytest.mark.parametrize("with_loss_parallel,fsdp", [(True, False), (False, False), (True, True)],
                         ids=["loss_parallel", "gathered_logits", "fsdp_x_tp"])
def test_tensor_parallel_matches_reference(pool, schedule, n, with_loss_parallel, fsdp):
    """pp 2 x tp 2: sharded parameters and gradients (DualPipe's twin copies and sums among them;
    DualPipeV's weight GEMMs deferred on sharded weights) and, with loss parallel, DTensor losses (swapped between DualPipe's ends) match the reference;
    also with FSDP2 over TP (parameters sharded on two mesh dimensions)."""
    ran = _ran(pool.run(tp_cases.tp_numerics, schedule=schedule, n=n, with_loss_parallel=with_loss_parallel,
                        fsdp=fsdp))
    assert len(ran) == WORLD
    ends = 4 if schedule == "DualPipe" else 2  # ranks holding a last stage: both tp ranks of each
    assert sum(r["losses_checked"] for r in ran) == ends * 2 * n
    # TP shards the MLPs and the head; FSDP2 shards every parameter
    assert all(r["sharded_grads"] > 0 and (fsdp or r["grads_checked"] > r["sharded_grads"]) for r in ran)
    assert sum(r["dtensor_losses"] for r in ran) == (ends * 2 * n if with_loss_parallel else 0)
    # deferred weight GEMMs on sharded weights (DualPipe at pp 2 runs I only on its chains' first stages)
    assert all(r["deferred_dtensor_weights"] > 0 for r in ran)
    assert all((r["deferred_gemms"] > 0) == (schedule == "DualPipeV") for r in ran), ran
    if schedule == "DualPipe":
        assert all(r["twin_parts"] == 2 for r in ran)


COMPILED_LAYOUTS = [(schedule, pp, 2 * pp, overlap) for schedule, pps in (("DualPipeV", (1, 2, 4)), ("DualPipe", (2, 4)))
                    for pp in pps for overlap in (True, False)]


def _stages_with_deferring_inputs(schedule: str, pp: int, n: int, rank: int) -> set[int]:
    """The stages of pipeline rank ``rank`` with an I whose weight GEMMs wait for a W of their own
    (a first stage's backward has no input gradient to send first: it runs whole)."""
    place = placement(schedule, pp, n)
    return {a.stage_index for a in compute_order(schedule, pp, n)[rank]
            if a is not None and a.computation_type == pipelining.I and not place.is_first(a.stage_index)}


@pytest.mark.parametrize("schedule,pp,n,overlap", COMPILED_LAYOUTS)
def test_compiled_blocks_train_correctly(pool, schedule, pp, n, overlap):
    """Blocks torch.compile'd in place (torchtitan's way, ``aot_eager``), with
    ``weight_gradients="deferred_compiled"``: each compiled backward runs once per microbatch, at
    I, with the blocks' weight GEMMs waiting for W (a custom operator the compiled graph keeps
    opaque decides at run time); losses and gradients equal the reference compiled the same way
    on every rank."""
    ran = _ran(pool.run(cases.compiled_stages_numerics, schedule=schedule, pp=pp, n=n, overlap=overlap,
                        weight_gradients="deferred_compiled"))
    assert len(ran) == pp and max(r["grad_err"] for r in ran) <= cases.ATOL
    assert sum(r["losses_checked"] for r in ran) == (2 if schedule == "DualPipe" else 1) * 2 * n
    for rank, r in enumerate(ran):
        assert {s for s, count in r["gemms_at_w"].items() if count} == _stages_with_deferring_inputs(schedule, pp, n, rank), ran


@pytest.mark.parametrize("weight_gradients", ["deferred", "split"])
def test_compiled_blocks_run_whole_at_input_by_default(pool, weight_gradients):
    """The default (and torch's split, which would run a compiled graph twice): a stage holding
    compiled blocks runs each backward whole at I and W runs nothing; gradients equal the reference."""
    ran = _ran(pool.run(cases.compiled_stages_numerics, schedule="DualPipeV", pp=2, n=4,
                        weight_gradients=weight_gradients))
    assert len(ran) == 2 and max(r["grad_err"] for r in ran) <= cases.ATOL
    assert all(not any(r["gemms_at_w"].values()) for r in ran), ran


@pytest.mark.parametrize("weight_gradients", ["deferred", "deferred_compiled"])
@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
def test_compiled_blocks_with_fsdp2(pool, schedule, weight_gradients):
    """Blocks compiled in place, then FSDP2 (torchtitan's order), pp 2 x dp 2: every gradient on
    every rank equals the compiled reference's, whole at I or with the compiled blocks' weight
    GEMMs run at W (added to the gathered weights)."""
    ran = _ran(pool.run(cases.compiled_stages_numerics, schedule=schedule, pp=2, n=4, fsdp=True,
                        weight_gradients=weight_gradients))
    assert len(ran) == WORLD and max(r["grad_err"] for r in ran) <= cases.ATOL
    for rank, r in enumerate(ran):  # mesh (pp, dp): pipeline rank rank // 2
        want = _stages_with_deferring_inputs(schedule, 2, 4, rank // (WORLD // 2)) if weight_gradients != "deferred" else set()
        assert {s for s, count in r["gemms_at_w"].items() if count} == want, ran


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
@pytest.mark.parametrize("compile_reference", [True, False], ids=["compiled-reference", "eager-reference"])
def test_inductor_compiled_blocks_match_both_references(pool, schedule, compile_reference):
    """Inductor-compiled blocks (their weight GEMMs deferred to W: ``"deferred_compiled"``) against
    the reference compiled the same way and against the eager reference, both at the suite's
    tolerance (rtol 1e-5, atol 4e-5). Inductor fuses and reorders fp32 reductions: each reordered
    sum of K terms moves by at most about K ulp (K <= 64 here, so under 1e-5 relative); measured:
    largest gradient difference about 1e-8. Two ranks (FSDP2 with compiled blocks runs above with
    aot_eager): inductor's first C++ build is the cost here."""
    ran = _ran(pool.run(cases.compiled_stages_numerics, schedule=schedule, pp=2, n=4, backend="inductor",
                        compile_reference=compile_reference, weight_gradients="deferred_compiled"))
    assert len(ran) == 2 and max(r["grad_err"] for r in ran) <= cases.ATOL
    for rank, r in enumerate(ran):  # inductor's graphs defer through the operator too
        assert {s for s, count in r["gemms_at_w"].items() if count} == _stages_with_deferring_inputs(schedule, 2, 4, rank), ran


@pytest.mark.parametrize("schedule,pp,n,fsdp", [
    ("DualPipeV", 1, 2, False), ("DualPipeV", 2, 5, False), ("DualPipeV", 4, 8, False),
    ("DualPipe", 2, 4, False), ("DualPipe", 4, 8, False), ("DualPipeV", 2, 5, True), ("DualPipe", 2, 4, True),
])
def test_two_batch_overlap_matches_reference(pool, schedule, pp, n, fsdp):
    """``two_batch_overlap="all"``: every lone forward runs its microbatch (2 rows) as two halves
    (a relay; their backward too, where lone, under FSDP2 as well); losses and every gradient
    on every rank match the reference at RTOL/ATOL over two steps."""
    ran = _ran(pool.run(cases.two_batch_numerics, schedule=schedule, pp=pp, n=n, fsdp=fsdp))
    assert max(r["grad_err"] for r in ran) <= cases.ATOL
    order = compute_order(schedule, pp, n)
    lone = sum(len(lone_forwards(order[rank])) for rank in range(pp))
    assert sum(r["split"] for r in ran) == 2 * lone * (WORLD // pp if fsdp else 1), ran  # 2 steps
