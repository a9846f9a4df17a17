"""torch's stage initialisation before a schedule's first action, per release: stage metadata
(shape inference, static metadata, the vote on it) and the warm-up messages between neighbour
stages. Read against torch 2.11.0, 2.13.0, 2.14.1, 2.15.0.

- Stage metadata: 2.11 infers shapes with a p2p exchange, 2.12 added static/dynamic inference and
  a vote on it, 2.13 ``loss_kwargs``: :func:`initialize_stages` calls whichever exists
  (``pipelining.HAS_METADATA_VOTE``: whether the vote runs).
- The start-up, ``_warmup_p2p`` to 2.14, ``_initialize_pipeline_distributed_state`` from 2.15:
  :func:`with_start_up` installs a schedule's ``_start_up`` under this torch's name,
  :func:`torch_start_up` calls torch's own.
- Warm-up messages from a rank to itself, which gloo rejects (2.11; traced stages on 2.12-2.14):
  :func:`warm_up_neighbours` leaves them out; 2.15 sends none.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from .pipelining import (
    STATIC_METADATA_DROPS_INPUT_GRADS,
    InferenceMode,
    _PipelineStageBase,
    _batch_p2p,
    _wait_batch_p2p,
)

_INIT_STAGES_KEYWORDS = frozenset(inspect.signature(PipelineScheduleMulti._initialize_stages).parameters)


# 2.15+: torch's start-up (metadata vote, p2p edges connected up front) is
# ``_initialize_pipeline_distributed_state(stages, has_backward, initialize_p2p)``; before it,
# ``_warmup_p2p(stages, has_backward, p2p_done)``. Same arguments, the last one negated.
START_UP_METHOD = ("_initialize_pipeline_distributed_state"
                   if hasattr(PipelineScheduleMulti, "_initialize_pipeline_distributed_state") else "_warmup_p2p")
_WARMUP_P2P = START_UP_METHOD == "_warmup_p2p"  # before 2.15: its last argument is "p2p done", not "connect"


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
    elif _WARMUP_P2P and not all(isinstance(stage, PipelineStage) for stage in schedule._stages):
        schedule._warmup_p2p = _warm_up_unless_done
    return schedule


def _warm_up_unless_done(stages: list[_PipelineStageBase], has_backward: bool, p2p_done: bool) -> None:
    if not p2p_done:
        warm_up_neighbours(stages)


def agreed_inference_mode(stages: list[Any], has_backward: bool, vote: Callable[[bool], bool]) -> None:
    """2.13+: set every stage's metadata-inference mode to STATIC when ``vote(all local STATIC)``
    (a MIN over the pipeline group) says every rank can, else DYNAMIC."""
    local_static = all(not InferenceMode.needs_dynamic(s._user_meta, has_backward) for s in stages)
    mode = InferenceMode.STATIC if vote(local_static) else InferenceMode.DYNAMIC
    for stage in stages:
        stage._inference_mode = mode


def torch_start_up(schedule: PipelineScheduleMulti, stages: list[_PipelineStageBase], has_backward: bool,
                   connect: bool) -> None:
    """torch's own start-up for ``schedule``'s stages: the metadata-inference vote, and with
    ``connect`` (the first time) its p2p warm-up (before 2.15: messages to the neighbour stages; 2.15+:
    one exchange per pair of ranks, none to a rank itself)."""
    method = getattr(PipelineScheduleMulti, START_UP_METHOD)
    method(schedule, stages, has_backward, not connect if _WARMUP_P2P else connect)


def with_start_up(cls: type) -> type:
    """Class decorator: torch's stage initialisation calls ``cls._start_up(stages, has_backward,
    connect)`` (``connect``: p2p not set up yet) under this torch's name for its start-up."""

    def start_up(self: Any, stages: list, has_backward: bool, flag: bool) -> None:
        self._start_up(stages, has_backward, not flag if _WARMUP_P2P else flag)

    start_up.__doc__ = f"torch's {START_UP_METHOD}: runs ``_start_up``."
    setattr(cls, START_UP_METHOD, start_up)
    return cls


def warm_up_traced(schedule: PipelineScheduleMulti, stages: list[_PipelineStageBase], has_backward: bool,
                   connect: bool) -> None:
    """Start-up for stages from torch's tracer (``pipeline(...).build_stage``): 2.15+ torch's own
    (it sends nothing to a rank itself); before it, torch's warm-up messages without those to this
    rank itself (:func:`warm_up_neighbours`)."""
    if not _WARMUP_P2P:
        torch_start_up(schedule, stages, has_backward, connect)
    elif connect:
        warm_up_neighbours(stages)


__all__ = [
    "START_UP_METHOD",
    "agreed_inference_mode",
    "initialize_stages",
    "mark_static_inputs_differentiable",
    "runnable_on_gloo",
    "torch_start_up",
    "warm_up_neighbours",
    "warm_up_traced",
    "with_start_up",
]
