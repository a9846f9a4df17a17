"""Lone actions paired with each other (:mod:`titan_dualpipe.orders.lone_pairs`): pure order checks."""

from __future__ import annotations

import pytest

from cases import overlap_cases, pipeline_cases as cases

from titan_dualpipe.orders import compute_order
from titan_dualpipe.orders.dryrun import dry_run
from titan_dualpipe.orders.lone_pairs import is_lone_pair, lone_pair, pair_lone_actions, pairable
from titan_dualpipe.orders.lowering import insert_send_recv, leaf_actions, lower
from titan_dualpipe.orders.placement import placement

WORLD = 4  # the module's pool (tests/conftest.py)
CASES = [("DualPipeV", 2, 4), ("DualPipeV", 2, 16), ("DualPipeV", 4, 16), ("DualPipe", 2, 16), ("DualPipe", 4, 8)]


@pytest.mark.parametrize("schedule,pp,n", CASES)
def test_paired_orders_run_the_same_actions_and_pair_only_what_does_not_feed_itself(schedule, pp, n):
    place = placement(schedule, pp, n)
    order = compute_order(schedule, pp, n)
    paired = pair_lone_actions(order, place)
    for rank in order:
        leaves = [leaf for a in paired[rank] for leaf in leaf_actions(a)]
        assert leaves == [leaf for a in order[rank] for leaf in leaf_actions(a)]  # same actions, same order
        for entry in paired[rank]:
            if is_lone_pair(entry):
                assert pairable(*entry.sub_actions, place)
    assert sum(is_lone_pair(a) for acts in paired.values() for a in acts) > 0
    dry_run(lower(paired, place), place)  # no deadlock, every message matched


def _greedy_by_dry_runs(order: dict, place) -> dict:
    """The pass's rule spelled the slow way: each candidate kept where a dry run of the whole
    order with it still completes."""
    out = {rank: list(actions) for rank, actions in order.items()}
    for rank in sorted(out):
        i = 0
        while i + 1 < len(out[rank]):
            actions = out[rank]
            if pairable(actions[i], actions[i + 1], place):
                trial = {**out, rank: actions[:i] + [lone_pair(actions[i], actions[i + 1])] + actions[i + 2:]}
                try:
                    insert_send_recv(trial, place)
                    out = trial
                except ValueError:
                    pass
            i += 1
    return out


@pytest.mark.parametrize("schedule", ["DualPipeV", "DualPipe"])
def test_the_dependency_search_keeps_exactly_the_pairs_a_dry_run_would(schedule):
    """The pass decides each candidate from the order's dependency graph; a dry run of the whole
    order per candidate decides the same, in every case here (some candidates refused)."""
    refused = 0
    sizes = [(2, 4), (2, 5), (2, 16), (4, 8), (4, 9), (4, 16), (6, 12)]
    for pp, n in sizes if schedule == "DualPipeV" else [(pp, n + n % 2) for pp, n in sizes]:
        place = placement(schedule, pp, n)
        order = compute_order(schedule, pp, n)
        want = _greedy_by_dry_runs(order, place)
        assert pair_lone_actions(order, place) == want, (pp, n)
        candidates = sum(pairable(a, b, place) for acts in order.values() for a, b in zip(acts, acts[1:]))
        refused += candidates > sum(is_lone_pair(a) for acts in want.values() for a in acts)
    assert refused > 0  # the graph had cycles to find


def test_two_forwards_of_one_microbatch_down_the_v_are_never_paired():
    place = placement("DualPipeV", 2, 16)
    paired = pair_lone_actions(compute_order("DualPipeV", 2, 16), place)
    # rank 1 runs 1F0 then 2F0 (stage 1 feeds stage 2): 2F0 pairs with 1F1 instead
    assert [str(a) for a in paired[1][:3]] == ["1F0", "(2F0;1F1)OVERLAP_F_B", "(2F1;1F2)OVERLAP_F_B"]
    # rank 0's last stage's backward pairs with the first stage's I of the microbatch before
    assert "(3B15;0I14)OVERLAP_F_B" in [str(a) for a in paired[0]]


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 2, 6), ("DualPipeV", 4, 8), ("DualPipe", 2, 4), ("DualPipe", 4, 8)])
@pytest.mark.parametrize("overlap", [True, False], ids=["relay", "sequential"])
def test_lone_pairs_match_the_reference(pool, schedule, pp, n, overlap):
    """Lone pairs, relayed or one after the other: two steps with Adam between, every stage's
    gradients and every loss against the non-pipelined reference."""
    ran = [r for r in pool.run(cases.numerics, schedule=schedule, pp=pp, n=n, lone_pairs=True, overlap=overlap)
           if r is not None]
    assert len(ran) == pp
    assert sum(r["losses_checked"] for r in ran) == (2 if schedule == "DualPipe" else 1) * 2 * n
    assert max(r["grad_err"] for r in ran) <= cases.ATOL


@pytest.mark.parametrize("schedule,n", [("DualPipeV", 4), ("DualPipe", 4)])
def test_relayed_lone_pairs_of_a_moe_model_hand_over_and_change_no_bit(pool, schedule, n):
    """The relayed MoE pipeline (pp 2 x EP 2) with lone pairs against overlap=False: the reference's
    losses and gradients, and the same bits; the lone pairs' halves switched at their exchanges."""
    results = pool.run(overlap_cases.moe_numerics, schedule=schedule, n=n, relay=True, lone_pairs=True)
    assert all(r["grad_err"] <= cases.ATOL and r["bitwise_tensors"] > 0 for r in results), results
    assert all(r["lone_pair_hand_overs"] > 0 for r in results), results


@pytest.mark.parametrize("schedule,pp,n", [("DualPipeV", 2, 6), ("DualPipe", 4, 8)])
def test_eval_runs_both_forwards_of_a_lone_pair(pool, schedule, pp, n):
    """eval() with lone pairs: every microbatch's output and loss equal the reference forward's
    (a pair of two forwards runs both)."""
    ran = [r for r in pool.run(cases.eval_matches_reference, schedule=schedule, pp=pp, n=n, lone_pairs=True)
           if r is not None]
    assert sum(r["outputs_checked"] for r in ran) == n


@pytest.mark.parametrize("value,two_batch,message", [
    ("yes", False, "lone_pairs must be True or False, got 'yes'"),
    (True, True, "lone_pairs=True and two_batch_overlap=True both take the lone actions"),
    (True, "measured", "pass one of them"),
])
def test_a_bad_lone_pairs_is_named_before_any_collective(value, two_batch, message):
    from titan_dualpipe import ScheduleDualPipeV
    from titan_dualpipe.runtime.errors import PipelineConfigError

    with pytest.raises(PipelineConfigError, match=message):
        ScheduleDualPipeV([], 4, lone_pairs=value, two_batch_overlap=two_batch)  # no stages, no process group
