"""Two-batch overlap: a lone action's microbatch as two halves, relayed like a pair.

A forward with no pair partner (:mod:`titan_dualpipe.orders.two_batch`) runs its stage
module on the two halves of its microbatch (split along the batch, dimension 0 of every
input tensor that has the batch size): the first half computes until it posts an exchange,
the second half computes meanwhile until it posts one, and so on, so each half's exchanges
are in flight while the other half computes (DeepSeek's two-batch overlap, applied to
training actions). The stage output is the halves' outputs concatenated: the pipeline, the
loss and torch's stage bookkeeping see one microbatch.

How the halves run:

- the stage module provides :class:`~titan_dualpipe.overlap.protocol.OverlappedHalves` (our
  MoE module): it interleaves them itself, forward and backward, on any device;
- otherwise as a relay (:mod:`~titan_dualpipe.overlap.relay`), switching where the module's
  exchanges hand over (torchtitan's MoE under our schedules). The backward halves of a relay
  run on two threads, each calling autograd; with an accelerator autograd runs on one device
  thread per device, which a waiting half would block, so there the two halves backpropagate
  together, through the concatenation, as an unsplit microbatch does.

The microbatch's backward runs on the two halves when it has no partner either (``B``, ``I``,
a first stage's deferred ``W``), under FSDP2 too: each half backpropagates through its own calls
of the blocks, so FSDP2's backward hooks run per half, and the pipeline keeps the parameters
gathered and the gradients unreduced through every backward of the step (torch's stage turns
FSDP2's reshard and gradient sync off there; the gradients are reduced once, after the last W).
The backward of a pair runs through both halves at once. The halves' weight GEMMs wait for the
microbatch's ``W`` (deferred weight gradients); under ``weight_gradients="split"`` a split
microbatch's ``I`` runs its whole backward and its ``W`` nothing, as for compiled stages
(``runtime/split_backward.py``).
Under FSDP2 the halves share each module call's all-gather
(:func:`~titan_dualpipe.runtime.fsdp.gathered_for_both_halves`): a split microbatch posts as
many all-gathers as the whole one.

Numerics: each half computes what the whole computes for its rows, provided the model mixes
no rows of a batch (no batch statistics; our MoE module routes per sequence for this). A
weight's gradient is then the sum of two half-batch gradients instead of one sum over the
batch, a reordered floating-point sum: equal to a few ulp of the sum's terms, not bitwise.
Input gradients are bitwise equal (each half fills its own rows). A microbatch whose batch
is 1 runs whole: splitting the sequence instead would not give independent halves (attention
reads the whole sequence).

Random numbers (dropout): the halves draw other masks than the whole would. As a relay, the
first half draws exactly what it draws as the first of the two halves run one after the other;
the second draws from a stream of its own, seeded from the generators' state when the forward
starts, all its draws in a row (a checkpointed block's recompute finds its masks), none of the
first half's masks; the generators end where the first half ended (see the relay; halves that
never hand over run one after the other, on one stream). The second half cannot draw what it
would draw after the first, as that state exists only once the first half has ended. A
module's own interleaving runs both halves on one thread: they draw from the caller's stream
in the order it runs their segments (the first half's masks up to its first exchange are
those it draws alone; our MoE module draws none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.nn.attention.flex_attention import BlockMask
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .._compat.autograd import module_forward_replaced
from .._compat.pipelining import _Action, input_grads, stage_backward_replaced
from ..runtime.executor import StepExecutor
from ..runtime.fsdp import gathered_for_both_halves
from .comm import warn_once_if_exchange_traced
from .protocol import halves_implementation
from .relay import run_relayed
from .segments import Root, root_of

HalfInputs = tuple[tuple, dict]


@dataclass
class SplitMicrobatch:
    """What a forward in halves leaves for its backward."""

    sizes: list[int]  # rows of each half
    joined: list[torch.Tensor]  # the stage output's tensors (the halves' outputs concatenated)
    # each half's output tensors, as joined, by their place in the graph (``root_of``): the
    # concatenation saves nothing, so holding the tensors would keep a second stage output alive
    halves: tuple[list[Root], list[Root]]


def split_batch(args: tuple, kwargs: dict) -> tuple[list[int], list[HalfInputs]] | None:
    """The two halves of a microbatch's inputs, or None when its batch (dimension 0 of its first
    input tensor) is below 2. Tensors and flex-attention block masks whose dimension 0 is the
    batch are split; anything else goes whole to both halves."""
    leaves, _ = tree_flatten((args, kwargs), is_leaf=_is_block_mask)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0 or tensors[0].shape[0] < 2:
        return None
    batch = tensors[0].shape[0]
    sizes = [batch - batch // 2, batch // 2]
    rows = [slice(0, sizes[0]), slice(sizes[0], batch)]

    def split(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
            return value[rows[i]]
        if _is_block_mask(value) and value.kv_num_blocks.shape[0] == batch:
            return _half_block_mask(value, rows[i])
        return value

    return sizes, [tree_map(lambda v, i=i: split(v, i), (args, kwargs), is_leaf=_is_block_mask) for i in (0, 1)]


def _is_block_mask(value: Any) -> bool:
    return isinstance(value, BlockMask)


def _half_block_mask(mask: BlockMask, rows: slice) -> BlockMask:
    """``mask``'s rows of the batch, its ``mask_mod`` reading them by their place in the whole
    batch (torch's slicing leaves a ``mask_mod`` that refuses to run)."""
    half = mask[rows]
    whole_mask_mod, offset = mask.mask_mod, rows.start
    half.mask_mod = lambda b, h, q_idx, kv_idx: whole_mask_mod(b + offset, h, q_idx, kv_idx)
    return half


def join_halves(outputs: list[Any], sizes: list[int]) -> tuple[Any, SplitMicrobatch]:
    """The halves' outputs concatenated along the batch, and the record of both for the backward."""
    (first, spec), (second, _) = tree_flatten(outputs[0]), tree_flatten(outputs[1])
    joined: list[Any] = []
    for a, b in zip(first, second, strict=True):
        if not isinstance(a, torch.Tensor):
            joined.append(a)
            continue
        if a.dim() == 0 or a.shape[0] != sizes[0] or b.shape[0] != sizes[1]:
            raise ValueError(
                f"two-batch overlap: the stage module returned a tensor of shape {tuple(a.shape)} for a half "
                f"batch of {sizes[0]} rows; every output tensor must keep the batch as dimension 0 to be "
                "joined: pass two_batch_overlap=False to the schedule")
        joined.append(torch.cat([a, b]))
    tensors = [i for i, t in enumerate(joined) if isinstance(t, torch.Tensor)]
    record = SplitMicrobatch(sizes, [joined[i] for i in tensors],
                             ([root_of(first[i]) for i in tensors], [root_of(second[i]) for i in tensors]))
    return tree_unflatten(joined, spec), record


def run_forward_in_halves(executor: StepExecutor, action: _Action) -> None:
    """A lone forward on the two halves of its microbatch (whole when its batch is 1)."""
    key = (action.stage_index, action.microbatch_index)
    module = executor.stages[action.stage_index].submod
    own_forward = "forward" not in module.__dict__  # no instance-level forward (a wrapper's) in the way
    whole_forward = module.forward

    def forward_in_halves(*args: Any, **kwargs: Any) -> Any:
        split = split_batch(args, kwargs)
        if split is None:
            return whole_forward(*args, **kwargs)
        sizes, halves = split
        fused = halves_implementation(module) if own_forward else None
        with gathered_for_both_halves(module):  # FSDP2: one all-gather per call for both halves
            if fused is not None:
                outputs = fused.overlapped_halves_forward(module, halves)
            else:
                outputs = _relay_halves([lambda h=h: whole_forward(*h[0], **h[1]) for h in halves])
        joined, record = join_halves(outputs, sizes)
        executor.halves[key] = record
        executor.split.keep_whole(*key)
        return joined

    with module_forward_replaced(module, forward_in_halves):
        executor.run_forward(action)


def run_backward_in_halves(executor: StepExecutor, action: _Action, run: Callable[[], None]) -> None:
    """``run`` (B, I or W) with the microbatch's backward on its two halves where they can run
    apart (see the module docstring), else through both at once."""
    key = (action.stage_index, action.microbatch_index)
    stage = executor.stages[action.stage_index]
    apart = _backward_apart(stage.submod, stage.device)

    def backward_in_halves(stage_output: Any, output_grads: Any, input_values: list) -> tuple:
        record = executor.halves.pop(key)
        halves = _half_grads(record, stage_output, output_grads)
        if apart == "protocol":
            halves_implementation(stage.submod).overlapped_halves_backward(stage.submod, halves)
        else:
            _relay_halves([lambda h=h: torch.autograd.backward(*h) for h in halves])
        return input_grads(input_values)

    if apart is None:  # torch's own backward, through the concatenation
        executor.halves.pop(key)
        run()
        return
    with stage_backward_replaced(backward_in_halves):
        run()


def _backward_apart(module: torch.nn.Module, device: torch.device) -> str | None:
    """How a split microbatch's backward runs on its halves: "protocol", "relay", or None for
    through the concatenation (relay modules with an accelerator)."""
    if halves_implementation(module) is not None:
        return "protocol"
    return "relay" if device.type == "cpu" else None


def _half_grads(record: SplitMicrobatch, stage_output: Any, output_grads: Any) -> list[tuple[list, list]]:
    """Each half's ``(outputs, gradients)`` for a backward of the joined stage output (or of a
    loss computed from it, on a last stage)."""
    if not isinstance(stage_output, (tuple, list)):  # a last stage's loss: down to the joined output
        wanted = [i for i, t in enumerate(record.joined) if t.requires_grad]
        grads = torch.autograd.grad(stage_output, [record.joined[i] for i in wanted], allow_unused=True)
        pairs = [(i, g) for i, g in zip(wanted, grads) if g is not None]
    else:
        position = {id(t): i for i, t in enumerate(record.joined)}
        pairs = []
        for output, grad in zip(stage_output, output_grads):
            if isinstance(output, torch.Tensor) and output.requires_grad and grad is not None:
                if id(output) not in position:
                    raise RuntimeError("two-batch overlap: a stage output is not one of the joined halves' outputs")
                pairs.append((position[id(output)], grad))
    return [([record.halves[h][i] for i, _ in pairs], [g.split(record.sizes)[h] for _, g in pairs]) for h in (0, 1)]


def _relay_halves(halves: list[Callable[[], Any]]) -> list[Any]:
    """Run two callables as a relay (the first on this thread); their results."""
    results: list[Any] = [None, None]

    def run(i: int) -> None:
        results[i] = halves[i]()

    run_relayed(lambda: run(0), lambda: run(1))
    warn_once_if_exchange_traced()
    return results


class TwoBatchRunner:
    """The :class:`~titan_dualpipe.runtime.two_batch.HalvesRunner` of the schedules the package
    exports (:mod:`.schedules`)."""

    forward = staticmethod(run_forward_in_halves)
    backward = staticmethod(run_backward_in_halves)
