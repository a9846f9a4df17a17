"""Two-batch overlap's pieces in one process: splitting a microbatch's inputs (tensors and
flex-attention block masks), joining the halves' outputs, the schedule option, the orders rule."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from titan_dualpipe._compat import B, F, OVERLAP_F_B, _Action
from titan_dualpipe.orders.two_batch import lone_forwards, paired_backwards
from titan_dualpipe.overlap.halves import join_halves, split_batch
from titan_dualpipe.runtime.halves import two_batch_stages


def test_split_batch_splits_what_has_the_batch_and_passes_the_rest():
    x, positions, freqs = torch.arange(30.0).view(3, 10), torch.arange(30).view(3, 10), torch.ones(10, 4)
    sizes, halves = split_batch((x, freqs), {"positions": positions, "scale": 2})
    assert sizes == [2, 1]
    for (args, kwargs), rows in zip(halves, (slice(0, 2), slice(2, 3)), strict=True):
        assert torch.equal(args[0], x[rows]) and args[1] is freqs
        assert torch.equal(kwargs["positions"], positions[rows]) and kwargs["scale"] == 2


def test_a_batch_of_one_is_not_split():
    assert split_batch((torch.ones(1, 8),), {}) is None
    assert split_batch((torch.tensor(3.0),), {}) is None


def test_block_mask_halves_mask_as_the_whole_does_for_their_rows():
    """A document mask reads the batch index: each half's mask_mod must read its rows' documents
    (torch's own slicing leaves a mask_mod that refuses to run)."""
    seq = 256
    documents = torch.stack([torch.arange(seq) // 64, torch.arange(seq) // 100, torch.arange(seq) // 32, torch.zeros(seq, dtype=torch.long)])

    def document_causal(b, h, q_idx, kv_idx):
        return (documents[b, q_idx] == documents[b, kv_idx]) & (q_idx >= kv_idx)

    whole = create_block_mask(document_causal, 4, None, seq, seq, device="cpu")
    _, halves = split_batch((torch.zeros(4, seq), whole), {})
    for (args, _), rows in zip(halves, (slice(0, 2), slice(2, 4)), strict=True):
        half = args[1]
        assert torch.equal(half.kv_num_blocks, whole.kv_num_blocks[rows])
        want = create_mask(document_causal, 4, 1, seq, seq, device="cpu")[rows]
        assert torch.equal(create_mask(half.mask_mod, 2, 1, seq, seq, device="cpu"), want)


def test_join_halves_concatenates_and_refuses_outputs_without_the_batch():
    a, b = torch.ones(2, 3), torch.zeros(1, 3)
    joined, record = join_halves([(a, "tag"), (b, "tag")], [2, 1])
    assert torch.equal(joined[0], torch.cat([a, b])) and joined[1] == "tag"
    assert record.halves == ([a], [b]) and record.sizes == [2, 1]
    with pytest.raises(ValueError, match=r"shape \(\) for a half batch of 2 rows.*two_batch_overlap=False"):
        join_halves([torch.tensor(1.0), torch.tensor(2.0)], [2, 1])


def test_schedule_option_is_checked():
    modules = {0: torch.nn.Linear(2, 2)}
    assert two_batch_stages(True, True, modules) == set()  # no exchanges: nothing to hide
    assert two_batch_stages("all", True, modules) == {0}
    assert two_batch_stages(False, True, modules) == two_batch_stages(False, False, modules) == set()
    with pytest.raises(ValueError, match="two_batch_overlap='all' needs overlap=True"):
        two_batch_stages("all", False, modules)
    for bad in ("yes", None, 1):
        with pytest.raises(ValueError, match=r"must be False, True \(stages with expert-parallel exchanges\) or 'all'"):
            two_batch_stages(bad, True, modules)


def test_lone_forwards_are_the_forwards_outside_pairs():
    pair = _Action(1, OVERLAP_F_B, None, sub_actions=(_Action(1, F, 3), _Action(2, B, 0)))
    order = [_Action(0, F, 0), _Action(0, F, 1), pair, None]
    assert lone_forwards(order) == {(0, 0), (0, 1)}
    assert paired_backwards(order) == {(2, 0)}


def test_the_record_keeps_no_half_output_alive():
    """The concatenation saves nothing for its backward: the record holds the halves' outputs by
    their place in the graph, so only the joined stage output stays in memory."""
    import gc
    import weakref

    from torch.autograd.graph import GradientEdge

    x = torch.ones(3, 4, requires_grad=True)
    a, b = x[:2] * 2, x[2:] * 3
    alive = weakref.ref(a)
    joined, record = join_halves([a, b], [2, 1])
    del a, b
    gc.collect()
    assert alive() is None and all(isinstance(root, GradientEdge) for half in record.halves for root in half)
    torch.autograd.backward(record.halves[0] + record.halves[1], list(torch.ones_like(joined).split([2, 1])))
    assert torch.equal(x.grad, torch.tensor([[2.0] * 4, [2.0] * 4, [3.0] * 4]))
