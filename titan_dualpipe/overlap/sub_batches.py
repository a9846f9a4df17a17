"""Two-batch overlap: a lone action's microbatch as two sub-batches, relayed like a pair.

A forward with no pair partner (:mod:`titan_dualpipe.orders.lone_actions` says which) runs its stage
module on the two sub-batches of its microbatch, split along the batch, so that each sub-batch's exchanges
fly while the other sub-batch computes (DeepSeek's two-batch overlap, applied to training actions); a
lone backward of such a microbatch runs on its sub-batches too. The sub-batches run through the module's
:class:`~titan_dualpipe.overlap.protocol.OverlappedSubBatches` when it has one, else as a relay
(:mod:`~titan_dualpipe.overlap.relay`). The stage output is the sub-batches' outputs concatenated, so
the pipeline, the loss and torch's stage bookkeeping see one microbatch. Which inputs split, the
backward with an accelerator, FSDP2, numerics and random numbers: docs/overlap.md#two-batch-overlap
and docs/overlap.md#random-numbers.
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
from ..runtime.fsdp import gathered_for_both_sub_batches
from .comm import warn_once_if_exchange_traced
from .protocol import sub_batches_implementation
from .relay import run_relayed
from .segments import Root, root_of

SubBatchInputs = tuple[tuple, dict]


@dataclass
class SubBatchRecord:
    """What a forward as sub-batches leaves for its backward."""

    sizes: list[int]  # rows of each sub-batch
    joined: list[torch.Tensor]  # the stage output's tensors (the sub-batches' outputs concatenated)
    # each sub-batch's output tensors, as joined, by their place in the graph (``root_of``): the
    # concatenation saves nothing, so holding the tensors would keep a second stage output alive
    sub_batches: tuple[list[Root], list[Root]]


def split_into_sub_batches(args: tuple, kwargs: dict) -> tuple[list[int], list[SubBatchInputs]] | None:
    """The two sub-batches of a microbatch's inputs, or None when its batch (dimension 0 of its first
    input tensor) is below 2. Tensors and flex-attention block masks whose dimension 0 is the
    batch are split; anything else goes whole to both sub-batches."""
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
            return _sub_batch_block_mask(value, rows[i])
        return value

    return sizes, [tree_map(lambda v, i=i: split(v, i), (args, kwargs), is_leaf=_is_block_mask) for i in (0, 1)]


def _is_block_mask(value: Any) -> bool:
    return isinstance(value, BlockMask)


def _sub_batch_block_mask(mask: BlockMask, rows: slice) -> BlockMask:
    """``mask``'s rows of the batch, its ``mask_mod`` reading them by their place in the whole
    batch (torch's slicing leaves a ``mask_mod`` that refuses to run)."""
    sub_batch = mask[rows]
    whole_mask_mod, offset = mask.mask_mod, rows.start
    sub_batch.mask_mod = lambda b, h, q_idx, kv_idx: whole_mask_mod(b + offset, h, q_idx, kv_idx)
    return sub_batch


def join_sub_batches(outputs: list[Any], sizes: list[int]) -> tuple[Any, SubBatchRecord]:
    """The sub-batches' outputs concatenated along the batch, and the record of both for the backward."""
    (first, spec), (second, _) = tree_flatten(outputs[0]), tree_flatten(outputs[1])
    joined: list[Any] = []
    for a, b in zip(first, second, strict=True):
        if not isinstance(a, torch.Tensor):
            joined.append(a)
            continue
        if a.dim() == 0 or a.shape[0] != sizes[0] or b.shape[0] != sizes[1]:
            raise ValueError(
                f"two-batch overlap: the stage module returned a tensor of shape {tuple(a.shape)} for a sub-batch "
                f"of {sizes[0]} rows; every output tensor must keep the batch as dimension 0 to be "
                "joined: pass two_batch_overlap=False to the schedule")
        joined.append(torch.cat([a, b]))
    tensors = [i for i, t in enumerate(joined) if isinstance(t, torch.Tensor)]
    record = SubBatchRecord(sizes, [joined[i] for i in tensors],
                             ([root_of(first[i]) for i in tensors], [root_of(second[i]) for i in tensors]))
    return tree_unflatten(joined, spec), record


def run_forward_in_sub_batches(executor: StepExecutor, action: _Action) -> None:
    """A lone forward on the two sub-batches of its microbatch (whole when its batch is 1)."""
    key = (action.stage_index, action.microbatch_index)
    module = executor.stages[action.stage_index].submod
    own_forward = "forward" not in module.__dict__  # no instance-level forward (a wrapper's) in the way
    whole_forward = module.forward

    def forward_in_sub_batches(*args: Any, **kwargs: Any) -> Any:
        split = split_into_sub_batches(args, kwargs)
        if split is None:
            return whole_forward(*args, **kwargs)
        sizes, sub_batches = split
        fused = sub_batches_implementation(module) if own_forward else None
        with gathered_for_both_sub_batches(module):  # FSDP2: one all-gather per call for both sub-batches
            if fused is not None:
                outputs = fused.overlapped_sub_batches_forward(module, sub_batches)
            else:
                outputs = _relay_sub_batches([lambda h=h: whole_forward(*h[0], **h[1]) for h in sub_batches])
        joined, record = join_sub_batches(outputs, sizes)
        executor.sub_batches[key] = record
        executor.plan.keep_whole(*key)
        return joined

    with module_forward_replaced(module, forward_in_sub_batches):
        executor.run_forward(action)


def run_backward_in_sub_batches(executor: StepExecutor, action: _Action, run: Callable[[], None]) -> None:
    """``run`` (B, I or W) with the microbatch's backward on its two sub-batches where they can run
    apart (:func:`_backward_apart`), else through both at once."""
    key = (action.stage_index, action.microbatch_index)
    stage = executor.stages[action.stage_index]
    apart = _backward_apart(stage.submod, stage.device)

    def backward_in_sub_batches(stage_output: Any, output_grads: Any, input_values: list) -> tuple:
        record = executor.sub_batches.pop(key)
        sub_batches = _sub_batch_grads(record, stage_output, output_grads)
        if apart == "protocol":
            sub_batches_implementation(stage.submod).overlapped_sub_batches_backward(stage.submod, sub_batches)
        else:
            _relay_sub_batches([lambda h=h: torch.autograd.backward(*h) for h in sub_batches])
        return input_grads(input_values)

    if apart is None:  # torch's own backward, through the concatenation
        executor.sub_batches.pop(key)
        run()
        return
    with stage_backward_replaced(backward_in_sub_batches):
        run()


def _backward_apart(module: torch.nn.Module, device: torch.device) -> str | None:
    """How a split microbatch's backward runs on its sub-batches: "protocol", "relay", or None for
    through the concatenation (relay modules with an accelerator)."""
    if sub_batches_implementation(module) is not None:
        return "protocol"
    return "relay" if device.type == "cpu" else None


def _sub_batch_grads(record: SubBatchRecord, stage_output: Any, output_grads: Any) -> list[tuple[list, list]]:
    """Each sub-batch's ``(outputs, gradients)`` for a backward of the joined stage output (or of a
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
                    raise RuntimeError("two-batch overlap: a stage output is not one of the joined sub-batches' outputs")
                pairs.append((position[id(output)], grad))
    return [([record.sub_batches[h][i] for i, _ in pairs], [g.split(record.sizes)[h] for _, g in pairs]) for h in (0, 1)]


def _relay_sub_batches(sub_batches: list[Callable[[], Any]]) -> list[Any]:
    """Run two callables as a relay (the first on this thread); their results."""
    results: list[Any] = [None, None]

    def run(i: int) -> None:
        results[i] = sub_batches[i]()

    run_relayed(lambda: run(0), lambda: run(1))
    warn_once_if_exchange_traced()
    return results


class TwoBatchRunner:
    """The :class:`~titan_dualpipe.runtime.sub_batch_runner.SubBatchRunner` of the schedules the package
    exports (:mod:`.schedules`)."""

    forward = staticmethod(run_forward_in_sub_batches)
    backward = staticmethod(run_backward_in_sub_batches)
