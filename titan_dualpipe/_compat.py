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
  whether torch's own path is still wrong (``tests/test_torch_versions.py``):
  :data:`TORCH_DEFER_RECV_OPS` (reorders receives from one peer; absent before 2.13),
  :data:`SPLIT_BACKWARD_NEEDS_UNSHARD` (nested FSDP2 loses weight grads in a split backward),
  :data:`STATIC_METADATA_DROPS_INPUT_GRADS` (static stage metadata loses input gradients)
  and torch's single-chain send/recv lowering (``_add_send_recv``; DualPipe has two chains).
- Warm-up messages from a rank to itself, which gloo rejects (2.11; traced stages on 2.12+):
  :func:`warm_up_neighbours` leaves them out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
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
from torch.distributed.pipelining.stage import _PipelineStage as TracedPipelineStage  # pipeline(...).build_stage
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.utils import checkpoint as _checkpoint_module

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

# Static stage metadata (PipelineStage(..., input_args=, output_args=), no shape inference), 2.12+
# (its static/dynamic metadata code): the received activations' requires_grad comes from the
# example inputs (False for inputs made without it), the gradient metadata from the example
# outputs': no input gradient is computed, no receive buffer for output gradients made, and the
# backward fails ("Output gradient: ('None',)"; torch's own ScheduleDualPipeV too; seen on 2.13.0
# and 2.14.1). Shape inference and the tracer mark floating-point activations passed between
# stages as requiring grad; initialize_stages does the same for static metadata
# (mark_static_inputs_differentiable). 2.11's static metadata trains correctly (checked on
# 2.11.0). tests/test_torch_versions.py checks torch's own V schedule against this flag.
STATIC_METADATA_DROPS_INPUT_GRADS: bool = InferenceMode is not None

_TORCH_SCHEDULE_KEYWORDS = frozenset(inspect.signature(PipelineScheduleMulti.__init__).parameters)


def schedule_kwargs(**kwargs: Any) -> dict[str, Any]:
    """The keywords of ``PipelineScheduleMulti.__init__`` this torch accepts (``defer_pp_recv``
    is 2.13+; our schedules implement it themselves either way)."""
    return {k: v for k, v in kwargs.items() if k in _TORCH_SCHEDULE_KEYWORDS}


_INIT_STAGES_KEYWORDS = frozenset(inspect.signature(PipelineScheduleMulti._initialize_stages).parameters)


def initialize_stages(schedule: PipelineScheduleMulti, args: tuple, kwargs: dict, target: Any,
                      loss_kwargs: dict | None) -> None:
    """torch's stage initialisation (metadata, receive buffers) before the first action."""
    mark_static_inputs_differentiable(schedule._stages)
    if "loss_kwargs" in _INIT_STAGES_KEYWORDS:  # 2.13+
        schedule._initialize_stages(args, kwargs, target, loss_kwargs)
    elif "target" in _INIT_STAGES_KEYWORDS:  # 2.12
        schedule._initialize_stages(args, kwargs, target)
    else:  # 2.11
        _initialize_stages_by_shape_exchange(schedule, args, kwargs)


def mark_static_inputs_differentiable(stages: list[_PipelineStageBase]) -> None:
    """Received floating-point inputs of stages with static metadata require grad, as shape
    inference would have them (see :data:`STATIC_METADATA_DROPS_INPUT_GRADS`)."""
    if not STATIC_METADATA_DROPS_INPUT_GRADS:
        return
    for stage in stages:
        meta = getattr(stage, "_user_meta", None)  # 2.12+: what the user passed as input_args/output_args
        if meta is None:
            continue
        if meta.inputs and not stage.is_first:  # received activations
            meta.inputs = _differentiable(meta.inputs)
        if meta.outputs and not stage.is_last:  # sent activations: their grads come back
            meta.outputs = _differentiable(meta.outputs)


def _differentiable(metas: tuple) -> tuple:
    return tuple(m if m is None or m.requires_grad or not m.dtype.is_floating_point
                 else dataclasses.replace(m, requires_grad=True) for m in metas)


def _initialize_stages_by_shape_exchange(schedule: PipelineScheduleMulti, args: tuple, kwargs: dict) -> None:
    """torch 2.11's ``_initialize_stages`` without its warm-up messages from a rank to itself.

    2.11 warms every stage's neighbour links up with a message, also where both neighbours
    live on one rank (a V's turn, or pp=1), which gloo cannot send. Shapes then flow along
    each chain: a chain's first stage infers from the batch, the others receive their input
    shapes (or take them in memory from a same-rank predecessor).
    """
    if not schedule._stages_forward_initialized:
        warm_up_neighbours(schedule._stages)
        passed_on: tuple = ()
        for stage in schedule._stages:
            passed_on = stage._prepare_forward_infra(
                schedule._n_microbatches, args if stage.is_first else passed_on, kwargs
            )
        schedule._stages_forward_initialized = True
    if schedule._has_backward and not schedule._stages_backward_initialized:
        for stage in schedule._stages:
            _receive_buffers_require_grad(stage)
            stage._prepare_backward_infra(schedule._n_microbatches)
        schedule._stages_backward_initialized = True


def _receive_buffers_require_grad(stage: _PipelineStageBase) -> None:
    """2.11 makes a receive buffer require grad when it creates it for a step with a backward; after
    an eval() first, a step would get no input gradients (torch's own schedules too). 2.12+
    decides at each forward."""
    for infos in stage.args_recv_info.values():
        for info in infos:
            buffer = getattr(info, "buffer", None)  # a root argument (the batch) has none
            if isinstance(buffer, torch.Tensor) and buffer.is_floating_point():
                buffer.requires_grad_(True)


def warm_up_neighbours(stages: list[_PipelineStageBase]) -> None:
    """torch's warm-up message to every neighbour stage, leaving out those to this rank itself
    (a V's turn, pp=1), which gloo rejects ("Pair is not connected"). torch sends them where
    stage metadata is not voted on: on 2.11, and for traced stages (``pipeline(...).build_stage``)."""
    me = dist.get_rank()
    warm_up = [op for stage in stages for op in stage._get_init_p2p_neighbors_ops() if op.peer != me]
    if warm_up:
        _wait_batch_p2p(_batch_p2p(warm_up))


def runnable_on_gloo(schedule: PipelineScheduleMulti) -> PipelineScheduleMulti:
    """torch's own multi-stage schedule, able to start on gloo: its initialisation sends warm-up
    messages from a rank to itself (V schedules, pp=1), which gloo rejects, on 2.11 and on 2.12+
    with traced stages; it then gets :func:`_initialize_stages_by_shape_exchange` (2.11) or
    :func:`warm_up_neighbours` (2.12+, traced stages) instead. Otherwise unchanged."""
    if "target" not in _INIT_STAGES_KEYWORDS:
        schedule._initialize_stages = types.MethodType(_initialize_stages_by_shape_exchange, schedule)
    elif not all(isinstance(stage, PipelineStage) for stage in schedule._stages):
        schedule._warmup_p2p = _warm_up_unless_done
    return schedule


def _warm_up_unless_done(stages: list[_PipelineStageBase], has_backward: bool, p2p_done: bool) -> None:
    if not p2p_done:
        warm_up_neighbours(stages)


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
    (HSDP: the shard dimension's group); none for a group that only replicates (composable
    ``replicate_with_fsdp``, whose mesh info has no shard group)."""
    return [dist.get_process_group_ranks(group.mesh_info.shard_process_group) for group in _fsdp_param_groups(module)
            if getattr(group.mesh_info, "shard_process_group", None) is not None]


def replicated_by_ddp(module: torch.nn.Module) -> list[str]:
    """Names of ``module``'s modules (``""``: itself) under composable ``replicate`` of
    ``torch.distributed._composable.replicate`` (DDP's reducer, in autograd's accumulation hooks),
    not the FSDP-based ``replicate_with_fsdp`` (an ``FSDPModule``)."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.fsdp import FSDPModule

    return [name for name, m in module.named_modules()
            if "replicate" in (_get_registry(m) or {}) and not isinstance(m, FSDPModule)]


@contextlib.contextmanager
def fsdp_post_forward_decided(modules: list[Any], reshard: Callable[[Any], bool]) -> Iterator[list[Any]]:
    """Within the block, each post-forward of an FSDP2 parameter group of ``modules`` asks
    ``reshard(group)``: False keeps the group's parameters gathered; True reshards them as a lone
    forward's post-forward does (by the group's ``reshard_after_forward``). FSDP2 itself applies that
    setting only to a group still in its forward: a group that another forward's post-forward left
    idle is resharded whatever the setting. Yields the groups (for :func:`fsdp_reshard_after_forward`)."""
    groups = [group for module in modules for group in _fsdp_param_groups(module)]
    for group in groups:
        group.post_forward = _decided_post_forward(group, type(group).post_forward.__get__(group), reshard)
    try:
        yield groups
    finally:
        for group in groups:
            group.__dict__.pop("post_forward", None)


def _decided_post_forward(group: Any, post_forward: Callable[..., Any],
                          reshard: Callable[[Any], bool]) -> Callable[..., Any]:
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    def decided(module: Any, args: Any, output: Any) -> Any:
        if reshard(group):
            if group._training_state == TrainingState.IDLE:
                group._training_state = TrainingState.FORWARD
            return post_forward(module, args, output)
        group.reshard = _keep_gathered  # for this call: the method's lookup finds the instance's first
        try:
            return post_forward(module, args, output)
        finally:
            del group.reshard

    return decided


def _keep_gathered() -> None:
    pass


def fsdp_reshard_after_forward(group: Any) -> None:
    """Reshard an idle FSDP2 parameter group (one of :func:`fsdp_post_forward_decided`'s) as a
    post-forward does: only when its ``reshard_after_forward`` says so."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    if group._training_state != TrainingState.IDLE:
        return
    group._training_state = TrainingState.FORWARD
    try:
        group.reshard()
    finally:
        group._training_state = TrainingState.IDLE


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


def _skip_at(end: str, method: Callable[..., Any], doing: str) -> Callable[..., Any]:
    """``method``, ignored on a stage at chain end ``end`` (``"_chain_first"``/``"_chain_last"``)."""

    def hand_off(self: Any, value: Any, mb_index: int) -> None:
        if not getattr(self, end):
            method(self, value, mb_index)

    hand_off.__doc__ = f"torch's {method.__name__}; on a DualPipe chain end, {doing}."
    return hand_off


def _input_grads_of_chain_first(base: type) -> Callable[[Any, int], Any]:
    def get_local_bwd_output(self: Any, mb_index: int) -> Any:
        if self._chain_first:  # the grads of the batch's inputs: nobody on this chain receives them
            return self.bwd_cache.pop(mb_index, ())
        return base.get_local_bwd_output(self, mb_index)

    return get_local_bwd_output


_CHAIN_END_CLASSES: dict[type, type] = {}


def set_chain_ends(stage: _PipelineStageBase, *, first: bool, last: bool) -> None:
    """Make ``stage.is_first`` / ``is_last`` follow its own chain, not ``stage_index``.

    torch assumes one chain ``0..num_stages-1``. DualPipe has two (one per direction), so
    the last stage of direction 0 and the first stage of direction 1 sit in the middle of
    the index range. Every torch stage method keys input and loss handling on these two
    properties, so the stage's class is swapped for a subclass that overrides them.

    Code written for torch's single chain hands data between same-rank stages ``s`` and ``s+1``;
    on DualPipe's rank pp-1 those are the two chain ends (stages pp-1 and pp), which exchange
    nothing: the subclass ignores those hand-offs (``set_local_fwd_input`` on a chain's first
    stage, ``set_local_bwd_input`` on a last one) and gives a first stage's input grads back.
    """
    base = type(stage)
    if base not in _CHAIN_END_CLASSES.values():
        cls = _CHAIN_END_CLASSES.get(base)
        if cls is None:
            attrs = {"__slots__": (), "is_first": property(_chain_first), "is_last": property(_chain_last),
                     "set_local_fwd_input": _skip_at("_chain_first", base.set_local_fwd_input,
                                                     "ignored on a first stage (it reads the batch)"),
                     "set_local_bwd_input": _skip_at("_chain_last", base.set_local_bwd_input,
                                                     "ignored on a last stage (it starts from the loss)"),
                     "get_local_bwd_output": _input_grads_of_chain_first(base)}
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


_SAC_FORWARD_MODE = _checkpoint_module._CachingTorchDispatchMode  # SAC's forward-side dispatch mode
_CHECKPOINT_HOOKS = _checkpoint_module._checkpoint_hook  # every non-reentrant checkpoint region's hooks
# (class, method entered by every region of that kind, kind)
_OBSERVED = ((_SAC_FORWARD_MODE, "__enter__", "selective"), (_CHECKPOINT_HOOKS, "__enter__", "checkpoint"))
_regions_seen = threading.local()
_observers_lock = threading.Lock()
_observers: list[int] = [0]  # open checkpoint_regions_seen blocks, all threads
_OWN = "titan_dualpipe_own_"


def _recording(kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def record_then_call(*args: Any, **kwargs: Any) -> Any:
        seen = getattr(_regions_seen, "kinds", None)
        if seen is not None:
            seen.add(kind)
        return original(*args, **kwargs)

    return record_then_call


def _install_observers(install: bool) -> None:
    for cls, name, kind in _OBSERVED:
        if install:
            own = cls.__dict__.get(name)
            setattr(cls, _OWN + name, own)
            setattr(cls, name, _recording(kind, getattr(cls, name)))
        else:
            own = cls.__dict__[_OWN + name]
            delattr(cls, _OWN + name)
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)


@contextlib.contextmanager
def donated_buffers_off() -> Iterator[None]:
    """``torch._functorch.config.donated_buffer = False`` inside, restored after: the only way
    torch's split backward (I, then W) can run a compiled graph twice (pytorch#161904). Our
    schedules never need it (a compiled stage's backward runs whole); ``bench compile`` uses
    it to time the rejected alternative."""
    from torch._functorch import config as functorch_config

    with functorch_config.patch(donated_buffer=False):
        yield


def compiler_fn(backend: str) -> Callable[..., Any]:
    """What ``torch.compile(backend=backend)`` compiles each graph with
    (``torch._dynamo.lookup_backend``): a backend that calls it compiles the same graphs."""
    from torch._dynamo import lookup_backend

    return lookup_backend(backend)


@contextlib.contextmanager
def checkpoint_regions_seen() -> Iterator[set[str]]:
    """Within the block, collect which kinds of non-reentrant activation-checkpoint regions run
    on this thread: ``"checkpoint"`` for any non-reentrant one (``torch.utils.checkpoint.checkpoint(...,
    use_reentrant=False)``, torch's ``checkpoint_wrapper``), ``"selective"`` for selective ones
    (``context_fn=create_selective_checkpoint_contexts(...)``), whose saved values serve one
    backward only. Seen when a region enters its saved-tensor hooks and SAC dispatch mode; torch's
    classes get their own methods back when the last open block ends."""
    with _observers_lock:
        if _observers[0] == 0:
            _install_observers(True)
        _observers[0] += 1
    outer = getattr(_regions_seen, "kinds", None)
    kinds: set[str] = set()
    _regions_seen.kinds = kinds
    try:
        yield kinds
    finally:
        _regions_seen.kinds = outer
        if outer is not None:
            outer |= kinds
        with _observers_lock:
            _observers[0] -= 1
            if _observers[0] == 0:
                _install_observers(False)


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


# -- Thread-local state behind private names ------------------------------------------------------
# torch hands a thread's state to autograd's worker threads in C++ (``at::ThreadLocalState``), which
# Python cannot reach; the relay's helper thread takes the caller's state part by part, these parts
# through the private names below (the public ones, grad mode and autocast, in the relay).


@dataclasses.dataclass(frozen=True)
class PrivateThreadState:
    """A thread's state that torch exposes through private names only (see :func:`private_thread_state`)."""

    saved_tensors_hooks: tuple[Callable[..., Any], Callable[..., Any]] | None  # the innermost pair, the one applied
    saved_tensors_hooks_disabled: str | None  # ``disable_saved_tensors_hooks``'s message
    function_modes: tuple[Any, ...]  # TorchFunctionModes, innermost last
    dispatch_modes: tuple[Any, ...]  # TorchDispatchModes, innermost last
    torch_function_disabled: str | None  # "all" (``DisableTorchFunction``), "subclasses" (``...Subclass``)
    dispatch_keys: tuple[Any, Any]  # the dispatcher's local include and exclude sets
    autograd_multithreading: bool  # ``torch.autograd.set_multithreading_enabled``
    view_replay: bool  # ``torch.autograd._force_original_view_tracking``
    functorch_transform: bool  # inside ``torch.func`` transforms, whose interpreter stack stays on the thread


def private_thread_state() -> PrivateThreadState:
    """This thread's :class:`PrivateThreadState`."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    disabled = ("all" if torch._C._is_torch_function_all_disabled()
                else None if torch._C._is_torch_function_enabled() else "subclasses")
    return PrivateThreadState(
        saved_tensors_hooks=torch._C._autograd._top_saved_tensors_default_hooks(True),
        saved_tensors_hooks_disabled=torch._C._autograd._saved_tensors_hooks_get_disabled_error_message(),
        function_modes=tuple(torch.overrides._get_current_function_mode_stack()),
        dispatch_modes=tuple(_get_current_dispatch_mode_stack()),
        torch_function_disabled=disabled,
        dispatch_keys=(torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()),
        autograd_multithreading=torch._C._is_multithreading_enabled(),
        view_replay=torch._C._is_view_replay_enabled(),
        functorch_transform=torch._C._functorch.peek_interpreter_stack() is not None,
    )


@contextlib.contextmanager
def private_thread_state_entered(state: PrivateThreadState) -> Iterator[None]:
    """``state`` on this thread within the block (a thread with none of its own: no hooks, no modes);
    the thread's own state after it. Enter it after the public parts (autocast, inference mode): the
    dispatcher's key sets are forced last, to exactly the captured ones. The modes are pushed after
    the flags and hooks are set, and popped before those are reset: a TorchFunctionMode would see
    torch's setters (``torch._C._set_multithreading_enabled``...) as calls of its own."""
    with contextlib.ExitStack() as stack:
        if not state.autograd_multithreading:
            stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        if state.view_replay:
            stack.enter_context(torch.autograd._force_original_view_tracking(True))
        if state.saved_tensors_hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*state.saved_tensors_hooks))
        if state.saved_tensors_hooks_disabled is not None:
            stack.enter_context(torch.autograd.graph.disable_saved_tensors_hooks(state.saved_tensors_hooks_disabled))
        for mode in state.dispatch_modes:  # the stack as it is, without running the modes' __enter__
            torch._C._push_on_torch_dispatch_stack(mode)
            stack.callback(torch._C._pop_torch_dispatch_stack, None)  # the innermost mode
        for mode in state.function_modes:
            torch.overrides._push_mode(mode)
            stack.callback(torch.overrides._pop_mode)
        if state.torch_function_disabled == "all":
            stack.enter_context(torch._C.DisableTorchFunction())
        elif state.torch_function_disabled == "subclasses":
            stack.enter_context(torch._C.DisableTorchFunctionSubclass())
        stack.enter_context(torch._C._ForceDispatchKeyGuard(*state.dispatch_keys))
        yield


def inside_backward() -> bool:
    """Whether this thread runs an autograd backward now (a node's backward, or a checkpointed
    region's recomputation inside one), rather than a forward."""
    return torch._C._current_graph_task_id() != -1


def torch_function_bypassed() -> Any:
    """A context within which no TorchFunctionMode (nor tensor subclass) sees tensor calls: for
    bookkeeping that must stay out of what a user's mode observes."""
    return torch._C.DisableTorchFunction()


def native_stacks_on_fatal_signal() -> None:
    """On a fatal signal (SIGABRT, SIGSEGV, SIGBUS, SIGILL, SIGFPE), print every thread's C++
    stack to stderr, then hand the signal on to the handler installed before (``faulthandler``'s,
    which adds the Python stacks). A ``std::terminate`` in a communication thread has no Python
    stack to show: this is where it shows. For the package's own worker processes (tests,
    ``check``, benchmarks), not for a user's training run."""
    torch._C._set_print_stack_traces_on_fatal_signal(True)


__all__ = [
    "HAS_METADATA_VOTE",
    "PipelineStage",
    "PrivateThreadState",
    "SPLIT_BACKWARD_NEEDS_UNSHARD",
    "STATIC_METADATA_DROPS_INPUT_GRADS",
    "SUPPORTED_TORCH",
    "TORCH_DEFER_RECV_OPS",
    "TORCH_VERSION",
    "TracedPipelineStage",
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
    "checkpoint_regions_seen",
    "compiler_fn",
    "default_store",
    "donated_buffers_off",
    "fsdp_data_parallel_sizes",
    "fsdp_gradient_divide_factors",
    "fsdp_post_forward_decided",
    "fsdp_reshard_after_forward",
    "fsdp_shard_group_ranks",
    "get_schedule_class",
    "initialize_stages",
    "inside_backward",
    "mark_static_inputs_differentiable",
    "input_grads",
    "module_forward_replaced",
    "native_stacks_on_fatal_signal",
    "post_all_to_all_single",
    "private_thread_state",
    "private_thread_state_entered",
    "replicated_by_ddp",
    "runnable_on_gloo",
    "schedule_kwargs",
    "set_chain_ends",
    "stage_backward_input",
    "stage_backward_weight",
    "split_target",
    "stage_backward_replaced",
    "torch_function_bypassed",
    "torch_version",
    "warm_up_neighbours",
    "wait_collective",
]
