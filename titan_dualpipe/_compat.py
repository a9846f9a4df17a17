"""The one place that touches torch's private pipelining names and their version differences.

Supported torch range: ``>=2.11,<2.15`` (2.11, 2.12, 2.13, 2.14; ``SUPPORTED_TORCH``), checked
at import. Everything below was read and tested against 2.11.0, 2.13.0 and 2.14.1. The rest of
the package never branches on the torch version: what differs is adapted here.

What differs across the range, and what we do about it:

- Stage metadata. 2.11 infers shapes with a p2p exchange in ``_initialize_stages(args,
  kwargs)``; 2.12 added static/dynamic metadata inference (``InferenceMode``, a vote in
  ``_warmup_p2p``, ``_initialize_stages(args, kwargs, target)``), 2.13 its ``loss_kwargs``.
  :func:`initialize_stages` calls whichever exists; :data:`HAS_METADATA_VOTE` says whether
  the vote runs (our DualPipe replaces it, see ``ScheduleDualPipe._warmup_p2p``).
- ``defer_pp_recv`` and ``loss_kwargs`` are torch keywords from 2.13 on; ours implement both
  themselves on every version (:func:`schedule_kwargs`).
- Pre-split microbatches (``step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``) arrived in
  2.14; our schedules own ``step()`` and accept them on every version.
- torch problems we work around, each with a flag here and a test that shows, per version,
  whether torch's own path is still wrong (``tests/test_torch_workarounds.py``):
  :data:`TORCH_DEFER_RECV_OPS` (reorders receives from one peer; absent before 2.13),
  :data:`SPLIT_BACKWARD_NEEDS_UNSHARD` (nested FSDP2 loses weight grads in a split backward)
  and torch's single-chain send/recv lowering (``_add_send_recv``; DualPipe has two chains).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
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
from torch.distributed.pipelining.stage import _PipelineStageBase

SUPPORTED_TORCH = (">=2.11", "<2.15")
_SUPPORTED_MINORS = ((2, 11), (2, 14))  # inclusive bounds of SUPPORTED_TORCH


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the running torch)."""
    major, minor = (int(p) for p in (version or torch.__version__).split("+")[0].split(".")[:2])
    return major, minor


def check_torch_version(version: str | None = None) -> None:
    """ImportError naming the supported range unless ``version`` (default: the running torch) is in it."""
    found = version or torch.__version__
    low, high = _SUPPORTED_MINORS
    if not low <= torch_version(found) <= high:
        raise ImportError(
            f"titan_dualpipe supports torch {','.join(SUPPORTED_TORCH)} (2.11 to 2.14; it builds on "
            f"torch's private pipelining runtime, adapted per version); found torch {found}. "
            "Install a torch in that range, e.g. pip install 'torch>=2.11,<2.15'."
        )


check_torch_version()
TORCH_VERSION = torch_version()

try:  # 2.12+: static/dynamic stage metadata inference
    from torch.distributed.pipelining._utils import InferenceMode
except ImportError:  # 2.11: shapes are inferred by a p2p exchange at initialisation
    InferenceMode = None  # type: ignore[assignment,misc]

try:  # 2.13+
    from torch.distributed.pipelining.schedules import _defer_recv_ops as TORCH_DEFER_RECV_OPS
except ImportError:  # torch has no receive deferral before 2.13
    TORCH_DEFER_RECV_OPS = None

HAS_METADATA_VOTE: bool = InferenceMode is not None

# With nested FSDP2, a split backward (I, then W) that runs before the stage's first full
# backward loses its weight gradient: the weights are looked up while the nested modules are
# resharded. Seen on every supported version (tests/test_torch_workarounds.py checks torch's
# own ScheduleZBVZeroBubble against this flag on each); our executor unshards them first.
SPLIT_BACKWARD_NEEDS_UNSHARD: bool = True

# torch.compile'd blocks inside a stage fail in a split backward (I, then W): torch's
# stage_backward_input cannot differentiate part of a compiled graph (pytorch#161904). Still
# so on 2.14 (tests/test_torch_versions.py runs it); our schedules refuse compiled stages.
COMPILED_SPLIT_BACKWARD_WORKS: bool = False

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

_TORCH_SCHEDULE_KEYWORDS = frozenset(inspect.signature(PipelineScheduleMulti.__init__).parameters)


def schedule_kwargs(**kwargs: Any) -> dict[str, Any]:
    """The keywords of ``PipelineScheduleMulti.__init__`` this torch accepts (``defer_pp_recv``
    is 2.13+; our schedules implement it themselves either way)."""
    return {k: v for k, v in kwargs.items() if k in _TORCH_SCHEDULE_KEYWORDS}


_INIT_STAGES_KEYWORDS = frozenset(inspect.signature(PipelineScheduleMulti._initialize_stages).parameters)


def initialize_stages(schedule: PipelineScheduleMulti, args: tuple, kwargs: dict, target: Any,
                      loss_kwargs: dict | None) -> None:
    """torch's stage initialisation (metadata, receive buffers) before the first action."""
    if "loss_kwargs" in _INIT_STAGES_KEYWORDS:  # 2.13+
        schedule._initialize_stages(args, kwargs, target, loss_kwargs)
    elif "target" in _INIT_STAGES_KEYWORDS:  # 2.12
        schedule._initialize_stages(args, kwargs, target)
    else:  # 2.11
        _initialize_stages_by_shape_exchange(schedule, args, kwargs)


def _initialize_stages_by_shape_exchange(schedule: PipelineScheduleMulti, args: tuple, kwargs: dict) -> None:
    """torch 2.11's ``_initialize_stages`` without its warm-up messages from a rank to itself.

    2.11 warms every stage's neighbour links up with a message, also where both neighbours
    live on one rank (a V's turn, or pp=1), which gloo cannot send. Shapes then flow along
    each chain: a chain's first stage infers from the batch, the others receive their input
    shapes (or take them in memory from a same-rank predecessor).
    """
    if not schedule._stages_forward_initialized:
        me = dist.get_rank()
        warm_up = [op for stage in schedule._stages for op in stage._get_init_p2p_neighbors_ops() if op.peer != me]
        if warm_up:
            _wait_batch_p2p(_batch_p2p(warm_up))
        passed_on: tuple = ()
        for stage in schedule._stages:
            passed_on = stage._prepare_forward_infra(
                schedule._n_microbatches, args if stage.is_first else passed_on, kwargs
            )
        schedule._stages_forward_initialized = True
    if schedule._has_backward and not schedule._stages_backward_initialized:
        for stage in schedule._stages:
            stage._prepare_backward_infra(schedule._n_microbatches)
        schedule._stages_backward_initialized = True


def runnable_on_gloo(schedule: PipelineScheduleMulti) -> PipelineScheduleMulti:
    """torch's own multi-stage schedule, able to start on gloo: on 2.11 its initialisation
    sends warm-up messages from a rank to itself (V schedules, pp=1), which gloo rejects; it
    then gets :func:`_initialize_stages_by_shape_exchange` instead. Unchanged on 2.12+."""
    if "target" not in _INIT_STAGES_KEYWORDS:
        schedule._initialize_stages = types.MethodType(_initialize_stages_by_shape_exchange, schedule)
    return schedule


def _fsdp_param_groups(module: Any) -> list[Any]:
    """FSDP2's parameter groups of ``module``: one per module before torch 2.13
    (``_fsdp_param_group``), a list from 2.13 on (``_fsdp_param_groups``)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return list(groups)


def fsdp_gradient_divide_factors(module: Any) -> list[float | None]:
    """The gradient divide factor of each FSDP2 parameter group of ``module`` (None: FSDP's
    default, the mean over its mesh)."""
    return [group.gradient_divide_factor for group in _fsdp_param_groups(module)]


def fsdp_data_parallel_sizes(module: Any) -> list[int]:
    """Ranks each FSDP2 parameter group of ``module`` averages over by default (its data-parallel
    mesh: shard x replicate; an expert group's mesh excludes the expert-parallel dimension)."""
    return [group.mesh_info.mesh.size() for group in _fsdp_param_groups(module)]


def fsdp_shard_group_ranks(module: Any) -> list[list[int]]:
    """Global ranks of the process group each FSDP2 parameter group of ``module`` shards over
    (HSDP: the shard dimension's group)."""
    return [dist.get_process_group_ranks(group.mesh_info.shard_process_group) for group in _fsdp_param_groups(module)]


def default_store() -> dist.Store:
    """The default process group's key-value store."""
    return dist.distributed_c10d._get_default_store()


def split_target(target: torch.Tensor, n_microbatches: int) -> list[torch.Tensor]:
    """torch's split of a whole-batch target into microbatches (dim 0)."""
    return list(_split_tensor(target, TensorChunkSpec(0), n_microbatches))


def agreed_inference_mode(stages: list[Any], has_backward: bool, vote: Callable[[bool], bool]) -> None:
    """2.13+: set every stage's metadata-inference mode to STATIC when ``vote(all local STATIC)``
    (a MIN over the pipeline group) says every rank can, else DYNAMIC."""
    local_static = all(not InferenceMode.needs_dynamic(s._user_meta, has_backward) for s in stages)
    mode = InferenceMode.STATIC if vote(local_static) else InferenceMode.DYNAMIC
    for stage in stages:
        stage._inference_mode = mode


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


__all__ = [
    "COMPILED_SPLIT_BACKWARD_WORKS",
    "HAS_METADATA_VOTE",
    "PipelineStage",
    "SPLIT_BACKWARD_NEEDS_UNSHARD",
    "SUPPORTED_TORCH",
    "TORCH_DEFER_RECV_OPS",
    "TORCH_VERSION",
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
    "agreed_inference_mode",
    "check_torch_version",
    "default_store",
    "fsdp_data_parallel_sizes",
    "fsdp_gradient_divide_factors",
    "fsdp_shard_group_ranks",
    "get_schedule_class",
    "initialize_stages",
    "input_grads",
    "module_forward_replaced",
    "post_all_to_all_single",
    "runnable_on_gloo",
    "schedule_kwargs",
    "set_chain_ends",
    "stage_backward_input",
    "stage_backward_weight",
    "split_target",
    "stage_backward_replaced",
    "torch_version",
    "wait_collective",
]
