"""torchtitan's MoE exchanges cut by groups of experts (titan_dualpipe.titan.expert_chunks): the
plan on hand-made counts, the chunks against one exchange on 2 ranks, and the checks of the switch. The chunked training runs, bitwise against
whole exchanges, are in test_parallelisms.py (test_moe_dualpipev_expert_parallel_overlaps_on_4_processes)."""

from __future__ import annotations

import pytest
import torch

from cases import titan_cases
from titan_dualpipe.switches import EXCHANGE_CHUNKS_ENV
from titan_dualpipe.testing.spawn import run_on_processes
from titan_dualpipe.overlap.moe import expert_groups
from titan_dualpipe.titan.expert_chunks import check_exchange_chunks, exchange_chunks_option, plan_chunks
from titan_dualpipe.titan.generation import GEN


def test_expert_groups_are_consecutive_and_differ_by_at_most_one() -> None:
    assert expert_groups(4, 2) == [range(0, 2), range(2, 4)]
    assert expert_groups(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert expert_groups(3, 1) == [range(0, 3)]


def test_plan_sends_each_peers_experts_of_a_group_together() -> None:
    """2 ranks x 2 local experts. This rank routes rows 0-1 to expert 0, row 2 to expert 1, rows
    3-5 to expert 2 (peer 1's first); it receives 1 and 2 rows for its experts from peer 0, 0 and
    4 from peer 1."""
    plan = plan_chunks([2, 1, 3, 0], [1, 2, 0, 4], ep_size=2, chunks=2, group=None, device=torch.device("cpu"))
    assert plan.experts == [range(0, 1), range(1, 2)]
    assert plan.order.tolist() == [0, 1, 3, 4, 5, 2]  # chunk 0: each peer's first expert; chunk 1: its second
    assert plan.restore.tolist() == [0, 1, 5, 2, 3, 4]
    assert plan.send_splits == [[2, 3], [1, 0]]
    assert plan.receive_splits == [[1, 0], [2, 4]]
    assert plan.received_counts == [[1, 0], [2, 4]]
    rows = torch.arange(6.0)
    assert torch.equal(rows[plan.order][plan.restore], rows)


def test_plan_with_one_chunk_is_the_whole_exchange() -> None:
    plan = plan_chunks([2, 1, 3, 0], [1, 2, 0, 4], ep_size=2, chunks=1, group=None, device=torch.device("cpu"))
    assert plan.order.tolist() == list(range(6))
    assert plan.send_splits == [[3, 3]] and plan.receive_splits == [[3, 4]]
    assert plan.received_counts == [[1, 2, 0, 4]]


def test_more_chunks_than_local_experts_is_named() -> None:
    with pytest.raises(ValueError, match=rf"{EXCHANGE_CHUNKS_ENV}=3: use an int from 1 to 2, the local experts"):
        plan_chunks([1, 1, 1, 1], [1, 1, 1, 1], ep_size=2, chunks=3, group=None, device=torch.device("cpu"))


@pytest.mark.parametrize("value, expected", [(None, 1), ("1", 1), ("4", 4)])
def test_the_variable_gives_the_chunks(value, expected, monkeypatch: pytest.MonkeyPatch) -> None:
    if value is None:
        monkeypatch.delenv(EXCHANGE_CHUNKS_ENV, raising=False)
    else:
        monkeypatch.setenv(EXCHANGE_CHUNKS_ENV, value)
    assert exchange_chunks_option() == expected


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_variable_is_named(value, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EXCHANGE_CHUNKS_ENV, value)
    with pytest.raises(ValueError, match=rf"{EXCHANGE_CHUNKS_ENV}='{value}': use an int from 1"):
        exchange_chunks_option()


def test_chunks_beyond_a_layers_local_experts_are_refused_before_the_first_step() -> None:
    class GroupedExperts(torch.nn.Module):  # torchtitan's: 8 experts
        def __init__(self) -> None:
            super().__init__()
            setattr(self, "w1_EFD" if GEN.registry else "w1", torch.nn.Parameter(torch.zeros(8, 2, 3)))

    class FSDPGroupedExperts(GroupedExperts):  # the class FSDP2 puts on a module it shards
        pass

    stage = torch.nn.ModuleDict({"moe": FSDPGroupedExperts()})
    check_exchange_chunks([stage], 4, ep_degree=2)
    with pytest.raises(ValueError, match=rf"{EXCHANGE_CHUNKS_ENV}=5: moe holds 4 experts on each of the 2 "
                                         "expert-parallel ranks; use an int from 1 to 4"):
        check_exchange_chunks([stage], 5, ep_degree=2)


def test_chunks_are_bitwise_one_exchange_and_fly_behind_their_neighbours() -> None:
    """Outputs and gradients bit for bit those of one exchange each way. The forward posts both
    dispatch chunks before waiting for the first, and each combine before waiting for the next
    dispatch; the backward posts both reverse combines before waiting for either, and each
    reverse dispatch before waiting for the next reverse combine."""
    results = run_on_processes(titan_cases.chunked_against_whole, 2)
    forward = ["post", "post", "wait", "post", "wait", "post", "wait", "wait"]
    backward = ["post", "post", "wait", "post", "wait", "post", "wait", "wait"]
    for result in results:
        assert result["equal"] == [True, True, True], result
        assert result["log"] == forward + backward, result["log"]
