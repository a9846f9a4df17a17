"""torch's pipelining IR and runtime under the names the package uses: the action types and their
shorthands, torch's lowering passes and batched p2p, the stage classes, the split backward, and the
flags of the torch problems we work around. Read against torch 2.11.0, 2.13.0, 2.14.1, 2.15.0.

Across the range: ``defer_pp_recv`` and ``loss_kwargs`` (torch keywords from 2.13) and pre-split
microbatches (2.14) are ours on every version (:func:`schedule_kwargs`); each torch problem we work
around has a flag here, checked per version by ``tests/test_torch_versions.py``
(docs/numerics.md#torch-problems-handled); 2.15's WAIT_REDUCE_GRAD, ``_forward_chunk_states``,
``release_fwd_send_outputs`` and ``unshard_lookahead`` are served on every release by
:func:`add_reduce_grad`, :func:`forward_states`, :func:`release_sent_outputs` and
:func:`add_unshard_reshard`, and its activation-liveness analysis by :func:`torch_activation_slots`.
"""

from __future__ import annotations

import contextlib
import inspect
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import stage as _stage_module
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _split_tensor
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    _Action,
    _get_profiler_function_name,
    _ComputationType,
    _PipelineContext,
    _PipelineScheduleRuntime,
    _add_reduce_grad,
    _add_send_recv,
    _add_unshard_reshard,
    _format_pipeline_order,
    _validate_schedule,
    _wait_batch_p2p,
    _batch_p2p,
    get_schedule_class,
)
from torch.distributed.pipelining.stage import _PipelineStage as TracedPipelineStage  # pipeline(...).build_stage
from torch.distributed.pipelining.stage import _PipelineStageBase

try:  # 2.12+: static/dynamic stage metadata inference
    from torch.distributed.pipelining._utils import InferenceMode
except ImportError:  # 2.11: shapes are inferred by a p2p exchange at initialisation
    InferenceMode = None  # type: ignore[assignment,misc]

# torch's receive deferral reorders receives from one peer; ours keeps per-peer order (torch's is
# what tests/test_torch_versions.py checks)
try:  # 2.13+
    from torch.distributed.pipelining.schedules import _defer_recv_ops as TORCH_DEFER_RECV_OPS
except ImportError:  # torch has no receive deferral before 2.13
    TORCH_DEFER_RECV_OPS = None

try:  # 2.15+
    from torch.distributed.pipelining.schedules import analyze_pipeline_activation_liveness
except ImportError:  # no liveness analysis before 2.15
    analyze_pipeline_activation_liveness = None

HAS_METADATA_VOTE: bool = InferenceMode is not None

# With nested FSDP2, a split backward (I, then W) that runs before the stage's first full
# backward loses its weight gradient: the weights are looked up while the nested modules are
# resharded. Seen on every supported version (tests/test_torch_versions.py checks torch's
# own ScheduleZBVZeroBubble and ScheduleDualPipeV against this flag on each); our executor
# unshards them first.
SPLIT_BACKWARD_NEEDS_UNSHARD: bool = True

F = _ComputationType.FORWARD
I = _ComputationType.BACKWARD_INPUT  # noqa: E741 - torch's own shorthand
W = _ComputationType.BACKWARD_WEIGHT
B = _ComputationType.FULL_BACKWARD
OVERLAP_F_B = _ComputationType.OVERLAP_F_B
SEND_F = _ComputationType.SEND_F
RECV_F = _ComputationType.RECV_F
SEND_B = _ComputationType.SEND_B
RECV_B = _ComputationType.RECV_B
UNSHARD = _ComputationType.UNSHARD
RESHARD = _ComputationType.RESHARD
REDUCE_GRAD = _ComputationType.REDUCE_GRAD
# 2.15+ (None before): REDUCE_GRAD's wait, and a send's own wait
WAIT_REDUCE_GRAD = getattr(_ComputationType, "WAIT_REDUCE_GRAD", None)
WAIT_SEND_F = getattr(_ComputationType, "WAIT_SEND_F", None)
WAIT_SEND_B = getattr(_ComputationType, "WAIT_SEND_B", None)
ASYNC_REDUCE_GRAD: bool = WAIT_REDUCE_GRAD is not None  # FSDP2's reduction started at REDUCE_GRAD, waited later
UNSHARD_LOOKAHEAD: bool = "unshard_lookahead" in inspect.signature(_add_unshard_reshard).parameters  # 2.15+

# Static stage metadata (PipelineStage(..., input_args=, output_args=), no shape inference), 2.12+
# (its static/dynamic metadata code): the received activations' requires_grad comes from the
# example inputs (False for inputs made without it), the gradient metadata from the example
# outputs': no input gradient is computed, no receive buffer for output gradients made, and the
# backward fails ("Output gradient: ('None',)"; torch's own ScheduleDualPipeV too; seen on 2.13.0
# and 2.14.1). Shape inference and the tracer mark floating-point activations passed between
# stages as requiring grad; initialize_stages does the same for static metadata
# (mark_static_inputs_differentiable, in stage_init.py). 2.11's static metadata trains correctly
# (checked on 2.11.0). tests/test_torch_versions.py checks torch's own V schedule against this flag.
STATIC_METADATA_DROPS_INPUT_GRADS: bool = InferenceMode is not None

_TORCH_SCHEDULE_KEYWORDS = frozenset(inspect.signature(PipelineScheduleMulti.__init__).parameters)


def schedule_kwargs(**kwargs: Any) -> dict[str, Any]:
    """The keywords of ``PipelineScheduleMulti.__init__`` this torch accepts (``defer_pp_recv``
    is 2.13+; our schedules implement it themselves either way)."""
    return {k: v for k, v in kwargs.items() if k in _TORCH_SCHEDULE_KEYWORDS}


def split_target(target: torch.Tensor, n_microbatches: int) -> list[torch.Tensor]:
    """torch's split of a whole-batch target into microbatches (dim 0)."""
    return list(_split_tensor(target, TensorChunkSpec(0), n_microbatches))


@contextlib.contextmanager
def stage_backward_replaced(fn: Callable[[Any, Any, list], tuple]) -> Iterator[None]:
    """Within the block, a stage's full backward calls ``fn(stage_output, output_grads,
    input_values) -> input grads`` instead of torch's ``stage_backward``.

    Everything else ``backward_one_chunk`` does (fwd-cache lookup, FSDP/DDP no-sync
    flags, caching input grads for the send) stays torch's own.
    """
    original = _stage_module.stage_backward
    _stage_module.stage_backward = fn
    try:
        yield
    finally:
        _stage_module.stage_backward = original


def input_grads(input_values: list) -> tuple:
    """What torch's ``stage_backward`` returns after its autograd call: each input's grad
    (cleared from the input so it is not accumulated again)."""
    grads = []
    for value in input_values:
        if isinstance(value, torch.Tensor):
            grads.append(value.grad)
            value.grad = None
        else:
            grads.append(None)
    return tuple(grads)


def forward_states(stage: _PipelineStageBase) -> dict[int, Any]:
    """What ``stage`` keeps of each microbatch's forward for its backward, by microbatch: 2.15+
    ``_forward_chunk_states``, before it ``fwd_cache``."""
    states = getattr(stage, "_forward_chunk_states", None)
    return states if states is not None else stage.fwd_cache


def forget_forward(stage: _PipelineStageBase, mb: int | None = None) -> None:
    """Drop what ``stage`` keeps of microbatch ``mb``'s forward (every microbatch's when None)."""
    states = forward_states(stage)
    if mb is None:
        states.clear()
    else:
        states.pop(mb, None)


def release_sent_outputs(stage: _PipelineStageBase, mb: int) -> None:
    """2.15+: drop the stage's reference to microbatch ``mb``'s outputs whose send completed (its
    backward starts from their autograd edges); before 2.15 the stage keeps them to its backward."""
    release = getattr(stage, "release_fwd_send_outputs", None)
    if release is not None:
        release(mb)


def reduces_asynchronously(stage: _PipelineStageBase) -> bool:
    """Whether ``stage`` can start its FSDP2 gradient reduction and wait for it later (2.15+:
    ``start_gradient_reduction`` / ``wait_for_gradient_reduction``, an FSDP2 module)."""
    from torch.distributed.fsdp import FSDPModule

    return hasattr(stage, "start_gradient_reduction") and isinstance(stage.submod, FSDPModule) and stage.has_backward


def add_unshard_reshard(actions: list, max_active_stages: int, lookahead: int) -> list:
    """torch's ``_add_unshard_reshard``: at most ``max_active_stages`` stages unsharded at once,
    unshards issued ``lookahead`` distinct stages ahead (2.15+; before it, ``max_active_stages``
    ahead: a smaller lookahead is refused before, see :data:`UNSHARD_LOOKAHEAD`)."""
    if UNSHARD_LOOKAHEAD:
        return _add_unshard_reshard(actions, max_active_stages, unshard_lookahead=lookahead)
    return _add_unshard_reshard(actions, max_active_stages)


def add_reduce_grad(actions: list, n_microbatches: int, defer_wait: bool) -> list:
    """torch's ``_add_reduce_grad``: REDUCE_GRAD after a stage's n-th backward; 2.15+ with its
    WAIT_REDUCE_GRAD, right after it or (``defer_wait``) before the next reduction or at the end."""
    if WAIT_REDUCE_GRAD is None:
        return _add_reduce_grad(actions, n_microbatches)
    return _add_reduce_grad(actions, n_microbatches, defer_reduce_grad_wait=defer_wait)


def reduce_grad_actions(stage_index: int) -> list[_Action]:
    """A synchronous reduction of ``stage_index``'s gradients as this torch's order writes it."""
    actions = [_Action(stage_index, REDUCE_GRAD, None)]
    if WAIT_REDUCE_GRAD is not None:
        actions.append(_Action(stage_index, WAIT_REDUCE_GRAD, None))
    return actions


def torch_activation_slots(order_of_rank: list, n_microbatches: int, rank: int,
                           stages: Sequence[int]) -> int | None:
    """torch's count of activations live at once on ``rank`` running ``order_of_rank``: the
    ``num_slots`` of 2.15's ``analyze_pipeline_activation_liveness`` at granularity
    ``"stage_microbatch"``; None before 2.15, where torch has no such analysis. Read against 2.15.0.

    torch's analysis takes a schedule instance and reads ``pipeline_order[rank]`` (a
    ``_PipelineScheduleRuntime``'s ``pipeline_order_with_comms``) and ``_n_microbatches``; here a
    stand-in holding just those two stands for the schedule, so any order can be analysed
    without building stages. Each ``(stage, microbatch)`` activation lives from its F to its B,
    or to its W where the backward is split (an I does not end it), both positions inclusive,
    the parts of an overlapped pair sharing one position; slots are reused greedily by start,
    so ``num_slots`` is the most intervals overlapping at one position. torch requires every
    stage in ``stages`` to run each microbatch ``0 .. n_microbatches - 1`` exactly once on
    ``rank`` (ValueError otherwise): renumber an order whose stages run other microbatch ids
    (DualPipe's second direction) before calling."""
    if analyze_pipeline_activation_liveness is None:
        return None
    stand_in = SimpleNamespace(pipeline_order={rank: order_of_rank}, _n_microbatches=n_microbatches)
    liveness = analyze_pipeline_activation_liveness(stand_in, pp_rank=rank, stage_indices=tuple(stages),
                                                    granularity="stage_microbatch")
    return liveness.num_slots


__all__ = [
    "ASYNC_REDUCE_GRAD",
    "B",
    "F",
    "HAS_METADATA_VOTE",
    "I",
    "InferenceMode",
    "OVERLAP_F_B",
    "PipelineStage",
    "RECV_B",
    "RECV_F",
    "REDUCE_GRAD",
    "RESHARD",
    "SEND_B",
    "SEND_F",
    "SPLIT_BACKWARD_NEEDS_UNSHARD",
    "STATIC_METADATA_DROPS_INPUT_GRADS",
    "TORCH_DEFER_RECV_OPS",
    "TracedPipelineStage",
    "UNSHARD",
    "UNSHARD_LOOKAHEAD",
    "W",
    "WAIT_REDUCE_GRAD",
    "WAIT_SEND_B",
    "WAIT_SEND_F",
    "_Action",
    "_ComputationType",
    "_PipelineContext",
    "_PipelineScheduleRuntime",
    "_PipelineStageBase",
    "_add_reduce_grad",
    "_add_send_recv",
    "_add_unshard_reshard",
    "_batch_p2p",
    "_format_pipeline_order",
    "_get_profiler_function_name",
    "_validate_schedule",
    "_wait_batch_p2p",
    "add_reduce_grad",
    "add_unshard_reshard",
    "forget_forward",
    "forward_states",
    "get_schedule_class",
    "input_grads",
    "reduce_grad_actions",
    "reduces_asynchronously",
    "release_sent_outputs",
    "schedule_kwargs",
    "split_target",
    "stage_backward_input",
    "stage_backward_replaced",
    "stage_backward_weight",
    "torch_activation_slots",
]
