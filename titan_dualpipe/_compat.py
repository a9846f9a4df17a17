"""The one place that touches torch's private pipelining names.

Supported torch range: ``>=2.13,<2.14`` (see ``SUPPORTED_TORCH``). Every private
name below was checked against torch 2.13.0; a newer torch may move or change them,
so the range is pinned and checked at import.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import stage as _stage_module
from torch.distributed.pipelining._utils import InferenceMode
from torch.distributed.pipelining.schedules import (
    _Action,
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
from torch.distributed.pipelining.stage import _PipelineStageBase

SUPPORTED_TORCH = (">=2.13", "<2.14")

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


def _check_torch_version() -> None:
    major, minor = (int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if (major, minor) != (2, 13):
        raise ImportError(
            f"titan_dualpipe supports torch {','.join(SUPPORTED_TORCH)} (it builds on "
            f"torch's private pipelining runtime); found torch {torch.__version__}. "
            "Install torch==2.13.*"
        )


_check_torch_version()


def _chain_first(stage: Any) -> bool:
    return stage._chain_first


def _chain_last(stage: Any) -> bool:
    return stage._chain_last


_CHAIN_END_CLASSES: dict[type, type] = {}


def set_chain_ends(stage: _PipelineStageBase, *, first: bool, last: bool) -> None:
    """Make ``stage.is_first`` / ``is_last`` follow its own chain, not ``stage_index``.

    torch assumes one chain ``0..num_stages-1``. DualPipe has two (one per direction), so
    the last stage of direction 0 and the first stage of direction 1 sit in the middle of
    the index range. Every torch stage method keys input and loss handling on these two
    properties, so the stage's class is swapped for a subclass that overrides just them.
    """
    base = type(stage)
    if base not in _CHAIN_END_CLASSES.values():
        cls = _CHAIN_END_CLASSES.get(base)
        if cls is None:
            attrs = {"__slots__": (), "is_first": property(_chain_first), "is_last": property(_chain_last)}
            cls = _CHAIN_END_CLASSES[base] = type(f"ChainEnd{base.__name__}", (base,), attrs)
        stage.__class__ = cls
    stage._chain_first = first  # type: ignore[attr-defined]
    stage._chain_last = last  # type: ignore[attr-defined]


def inference_mode_for(stage: PipelineStage, has_backward: bool) -> InferenceMode:
    """The metadata-inference mode one stage would vote for."""
    if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
        return InferenceMode.DYNAMIC
    return InferenceMode.STATIC


__all__ = [
    "PipelineStage",
    "InferenceMode",
    "_Action",
    "_ComputationType",
    "_PipelineContext",
    "_PipelineScheduleRuntime",
    "_PipelineStageBase",
    "_add_reduce_grad",
    "_add_send_recv",
    "_add_unshard_reshard",
    "_format_pipeline_order",
    "_validate_schedule",
    "_wait_batch_p2p",
    "_batch_p2p",
    "get_schedule_class",
    "set_chain_ends",
    "stage_backward_replaced",
    "module_forward_replaced",
    "input_grads",
    "inference_mode_for",
    "SUPPORTED_TORCH",
]


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


@contextlib.contextmanager
def module_forward_replaced(module: torch.nn.Module, fn: Callable[..., Any]) -> Iterator[None]:
    """Within the block, ``module(...)`` runs ``fn`` in place of ``module.forward``
    (module hooks, e.g. FSDP's unshard, still run around it)."""
    previous = module.__dict__.get("forward")  # an instance-level forward set by someone else
    module.forward = fn  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


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


def post_all_to_all_single(
    x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group: Any
) -> torch.Tensor:
    """Start an all-to-all with torch's functional collective op (not differentiated here);
    the result may be read only after :func:`wait_collective`. Activation checkpointing
    policies see the same op as for ``all_to_all_single_autograd``."""
    return torch.ops._c10d_functional.all_to_all_single(x, output_split_sizes, input_split_sizes, group.group_name)


def wait_collective(t: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(t)
