"""Lone actions paired with each other (:mod:`titan_dualpipe.orders.lone_pairs`): pure order checks."""

from __future__ import annotations

import pytest

from titan_dualpipe.orders import compute_order
from titan_dualpipe.orders.dryrun import dry_run
from titan_dualpipe.orders.lone_pairs import is_lone_pair, pair_lone_actions, pairable
from titan_dualpipe.orders.lowering import leaf_actions, lower
from titan_dualpipe.orders.placement import placement

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


def test_two_forwards_of_one_microbatch_down_the_v_are_never_paired():
    place = placement("DualPipeV", 2, 16)
    paired = pair_lone_actions(compute_order("DualPipeV", 2, 16), place)
    # rank 1 runs 1F0 then 2F0 (stage 1 feeds stage 2): 2F0 pairs with 1F1 instead
    assert [str(a) for a in paired[1][:3]] == ["1F0", "(2F0;1F1)OVERLAP_F_B", "(2F1;1F2)OVERLAP_F_B"]
    # rank 0's last stage's backward pairs with the first stage's I of the microbatch before
    assert "(3B15;0I14)OVERLAP_F_B" in [str(a) for a in paired[0]]
