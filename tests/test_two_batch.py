"""Two-batch overlap's pieces in one process: splitting a microbatch's inputs (tensors and
flex-attention block masks), joining the sub-batches' outputs, the schedule option, the orders rule,
and a lone forward run as a relay (thread-local state, random numbers)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from titan_dualpipe._compat.pipelining import B, F, I, OVERLAP_F_B, W, _Action
from titan_dualpipe.orders.lone_actions import lone_forwards, paired_backwards
from titan_dualpipe.overlap.sub_batches import join_sub_batches, run_forward_in_sub_batches, split_into_sub_batches
from titan_dualpipe.overlap.relay import hand_over
from titan_dualpipe.runtime.sub_batch_runner import two_batch_stages
from titan_dualpipe.runtime.timeline import TimedAction
from titan_dualpipe.runtime.two_batch_choice import MeasuredTwoBatch, lone_seconds
from titan_dualpipe.weights.plan import BackwardPlan
from titan_dualpipe.weights.queue import WeightGradQueue


def test_split_into_sub_batches_splits_what_has_the_batch_and_passes_the_rest():
    x, positions, freqs = torch.arange(30.0).view(3, 10), torch.arange(30).view(3, 10), torch.ones(10, 4)
    sizes, sub_batches = split_into_sub_batches((x, freqs), {"positions": positions, "scale": 2})
    assert sizes == [2, 1]
    for (args, kwargs), rows in zip(sub_batches, (slice(0, 2), slice(2, 3)), strict=True):
        assert torch.equal(args[0], x[rows]) and args[1] is freqs
        assert torch.equal(kwargs["positions"], positions[rows]) and kwargs["scale"] == 2


def test_a_batch_of_one_is_not_split():
    assert split_into_sub_batches((torch.ones(1, 8),), {}) is None
    assert split_into_sub_batches((torch.tensor(3.0),), {}) is None


def test_block_mask_sub_batches_mask_as_the_whole_does_for_their_rows():
    """A document mask reads the batch index: each sub-batch's mask_mod must read its rows' documents
    (torch's own slicing leaves a mask_mod that refuses to run)."""
    seq = 256
    documents = torch.stack([torch.arange(seq) // 64, torch.arange(seq) // 100, torch.arange(seq) // 32, torch.zeros(seq, dtype=torch.long)])

    def document_causal(b, h, q_idx, kv_idx):
        return (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)

    whole = create_block_mask(document_causal, 4, None, seq, seq, device="cpu")
    _, sub_batches = split_into_sub_batches((torch.zeros(4, seq), whole), {})
    for (args, _), rows in zip(sub_batches, (slice(0, 2), slice(2, 4)), strict=True):
        sub_batch = args[1]
        assert torch.equal(sub_batch.kv_num_blocks, whole.kv_num_blocks[rows])
        want = create_mask(document_causal, 4, 1, seq, seq, device="cpu")[rows]
        assert torch.equal(create_mask(sub_batch.mask_mod, 2, 1, seq, seq, device="cpu"), want)


def test_join_sub_batches_concatenates_and_refuses_outputs_without_the_batch():
    a, b = torch.ones(2, 3), torch.zeros(1, 3)
    joined, record = join_sub_batches([(a, "tag"), (b, "tag")], [2, 1])
    assert torch.equal(joined[0], torch.cat([a, b])) and joined[1] == "tag"
    assert record.sub_batches == ([a], [b]) and record.sizes == [2, 1]
    with pytest.raises(ValueError, match=r"shape \(\) for a sub-batch of 2 rows.*two_batch_overlap=False"):
        join_sub_batches([torch.tensor(1.0), torch.tensor(2.0)], [2, 1])


def test_schedule_option_is_checked():
    modules = {0: torch.nn.Linear(2, 2)}
    assert two_batch_stages(True, True, modules) == set()  # no exchanges: nothing to hide
    assert two_batch_stages("all", True, modules) == {0}
    assert two_batch_stages(False, True, modules) == two_batch_stages(False, False, modules) == set()
    assert two_batch_stages("measured", True, modules) == set()  # measures the stages True splits
    for option in ("all", "measured"):
        with pytest.raises(ValueError, match=f"two_batch_overlap='{option}' needs overlap=True"):
            two_batch_stages(option, False, modules)
    for bad in ("yes", None, 1):
        with pytest.raises(ValueError, match=r"must be False, True \(stages with expert-parallel exchanges\), "
                                             r"'all' \(every stage\) or 'measured'"):
            two_batch_stages(bad, True, modules)


def test_measured_choice_times_the_actions_two_batch_overlap_changes():
    """Lone forwards and their backward actions count, per stage, a pair under its backward's stage
    when that backward is one of theirs; the actions of microbatches whose forward ran in a pair do not."""
    pair = _Action(1, OVERLAP_F_B, None, sub_actions=(_Action(1, F, 3), _Action(0, B, 0)))
    other_pair = _Action(1, OVERLAP_F_B, None, sub_actions=(_Action(1, F, 4), _Action(0, B, 3)))
    timeline = [TimedAction(0, _Action(0, F, 0), 0.0, 1.0), TimedAction(0, _Action(1, F, 0), 1.0, 1.5),
                TimedAction(0, pair, 1.5, 4.0), TimedAction(0, other_pair, 4.0, 6.0),
                TimedAction(0, _Action(1, I, 0), 6.0, 6.25), TimedAction(0, _Action(1, W, 0), 6.25, 7.0),
                TimedAction(0, _Action(1, B, 3), 7.0, 9.0)]
    assert lone_seconds(timeline, {(0, 0), (1, 0)}) == {0: 3.5, 1: 1.5}


@pytest.fixture
def world_of_one():
    from cases.dist_pool import one_rank_process_group

    yield from one_rank_process_group()


def test_measured_choice_splits_where_it_saved_enough(world_of_one):
    """A stage splits where some microbatch split and it saved at least MIN_SAVING (2%) of its whole
    time in both rounds; a stage where none split (one-row microbatches) has no saving to show."""
    choice = MeasuredTwoBatch({0, 1, 2, 3, 4}, 5, torch.device("cpu"))
    whole = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
    split = [{0: 0.9, 1: 0.99, 2: 1.2, 3: 0.5, 4: 0.5}, {0: 0.95, 1: 0.99, 2: 1.2, 3: 1.01, 4: 0.5}]
    choice._decide([whole, split[0], whole, split[1]], {0: 4, 1: 2, 2: 2, 3: 2})
    assert choice.savings == pytest.approx({0: 0.15, 1: 0.02, 2: -0.4, 3: 0.49})
    assert choice.chosen == choice.chosen_everywhere == {0}  # 3 saved in one round only


def test_measured_choice_runs_whole_then_split_then_as_chosen():
    """Which stages split step by step before the choice, and which steps are timed."""
    choice = MeasuredTwoBatch({0, 3}, 4, torch.device("cpu"))
    seen = []
    for _ in range(6):
        seen.append((sorted(choice.stages(True)), choice.times(True), sorted(choice.stages(False)), choice.times(False)))
        choice._steps += 1
    assert seen == [([], False, [], False), ([], True, [], False), ([0, 3], True, [], False), ([], True, [], False),
                    ([0, 3], True, [], False), ([], False, [], False)]  # the last: undecided, as after a bad count
    choice.chosen = frozenset({3})
    assert choice.stages(True) == choice.stages(False) == {3} and not choice.times(True)


def test_lone_forwards_are_the_forwards_outside_pairs():
    pair = _Action(1, OVERLAP_F_B, None, sub_actions=(_Action(1, F, 3), _Action(2, B, 0)))
    order = [_Action(0, F, 0), _Action(0, F, 1), pair, None]
    assert lone_forwards(order) == {(0, 0), (0, 1)}
    assert paired_backwards(order) == {(2, 0)}


def test_the_record_keeps_no_sub_batch_output_alive():
    """The concatenation saves nothing for its backward: the record holds the sub-batches' outputs by
    their place in the graph, so only the joined stage output stays in memory."""
    import gc
    import weakref

    from torch.autograd.graph import GradientEdge

    x = torch.ones(3, 4, requires_grad=True)
    a, b = x[:2] * 2, x[2:] * 3
    alive = weakref.ref(a)
    joined, record = join_sub_batches([a, b], [2, 1])
    del a, b
    gc.collect()
    assert alive() is None and all(isinstance(root, GradientEdge) for sub_batch in record.sub_batches for root in sub_batch)
    torch.autograd.backward(record.sub_batches[0] + record.sub_batches[1], list(torch.ones_like(joined).split([2, 1])))
    assert torch.equal(x.grad, torch.tensor([[2.0] * 4, [2.0] * 4, [3.0] * 4]))


class _HandsOverMidForward(torch.nn.Module):
    """Linear, dropout, a hand-over (where an expert-parallel exchange would post), linear, dropout.
    Records what each sub-batch ran: the thread, the generator state it started from, the output
    dtype and dropout masks."""

    def __init__(self, width: int = 4, p: float = 0.0) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(p)
        self.runs: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        run = {"thread": threading.get_ident(), "rng": torch.get_rng_state()}
        self.runs.append(run)
        h = self.drop(self.first(x))
        hand_over()
        out = self.drop(self.second(h))
        run.update(dtype=out.dtype, masks=[h != 0, out != 0])
        return out


def _forward_in_halves(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A lone forward of ``module`` on ``x`` through the runtime's two-batch path (split, relay,
    join), the executor reduced to what that path reads; the joined output and its record."""
    outputs: list = []
    executor = SimpleNamespace(stages={0: SimpleNamespace(submod=module)}, sub_batches={}, plan=BackwardPlan("split", frozenset(), frozenset(), set(), WeightGradQueue()),
                               run_forward=lambda action: outputs.append(module(x)))
    run_forward_in_sub_batches(executor, _Action(0, F, 0))
    return outputs[0], executor.sub_batches[(0, 0)]


def test_relayed_sub_batches_run_in_the_callers_autocast():
    """Under CPU autocast both sub-batches compute in bfloat16 (the second one on the relay's helper
    thread), so the joined output has the dtype the next stage's receive is sized for."""
    torch.manual_seed(0)
    module = _HandsOverMidForward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        joined, _ = _forward_in_halves(module, torch.randn(2, 4))
    assert len({run["thread"] for run in module.runs}) == 2  # the second sub-batch ran on the helper thread
    assert [run["dtype"] for run in module.runs] == [torch.bfloat16] * 2 and joined.dtype == torch.bfloat16
    module.runs.clear()
    joined, _ = _forward_in_halves(module, torch.randn(2, 4))  # outside autocast, on the same helper thread
    assert [run["dtype"] for run in module.runs] == [torch.float32] * 2 and joined.dtype == torch.float32


def test_saved_tensor_hooks_a_forward_pre_hook_enters_apply_to_both_sub_batches():
    """A forward pre-hook enters saved-tensor hooks (a forward hook leaves them), as activation
    offloading and memory meters do: what the second sub-batch saves on the helper thread is packed too."""
    torch.manual_seed(0)
    module = _HandsOverMidForward()
    packed: list[int] = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(threading.get_ident()) or t, lambda t: t)
    module.register_forward_pre_hook(lambda *_: hooks.__enter__())
    module.register_forward_hook(lambda *_: hooks.__exit__())
    x = torch.randn(2, 4, requires_grad=True)
    module(x[:1])
    per_half = len(packed)
    packed.clear()
    joined, _ = _forward_in_halves(module, x)
    threads = [run["thread"] for run in module.runs[1:]]
    assert per_half > 0 and sorted(packed) == sorted(threads * per_half), (per_half, packed, threads)
    joined.sum().backward()
    assert x.grad is not None


def test_relayed_sub_batches_draw_their_own_dropout_masks():
    """Each sub_batch draws from a stream of its own: the first exactly what it draws as the first of the
    two sub-batches run one after the other, the second what it draws alone from its own stream's start,
    none of the first sub-batch's masks; the generators end where the first sub-batch ended."""
    module = _HandsOverMidForward(width=64, p=0.5)
    x = torch.randn(2, 64)
    torch.manual_seed(0)
    module(x[:1])
    first_alone, end_of_first = module.runs.pop(), torch.get_rng_state()
    torch.manual_seed(0)
    _forward_in_halves(module, x)
    first, second = module.runs
    assert first["thread"] != second["thread"]
    assert all(torch.equal(a, b) for a, b in zip(first["masks"], first_alone["masks"], strict=True))
    assert torch.equal(torch.get_rng_state(), end_of_first)
    # none of the first sub-batch's masks (the second sub-batch's first mask was the first sub-batch's second one)
    assert not any(torch.equal(a, b) for a in second["masks"] for b in first["masks"])
    torch.set_rng_state(second["rng"])
    module(x[1:])
    assert all(torch.equal(a, b) for a, b in zip(second["masks"], module.runs[-1]["masks"], strict=True))
