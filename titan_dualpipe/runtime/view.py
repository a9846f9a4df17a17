"""What the executor sees of the schedule it runs a step for (:class:`ScheduleView`).

The schedule builds one per step (``_DualPipeFamily._view``): its options, runners, weight-gradient
policy and the step state torch's runtime keeps under its own names on the schedule (custom
functions written for torch's runtime find it there), and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..weights import WeightGradients
from .pairs import PairOrder, PairRunner
from .sub_batch_runner import SubBatchRunner


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The schedule's options the executor applies."""

    n_microbatches: int
    scale_grads: bool
    defer_reduce_grad_wait: bool
    max_outstanding_sends: int | None
    record_timeline: bool


@dataclasses.dataclass(frozen=True)
class TorchStepState:
    """The step state torch's ``_PipelineScheduleRuntime`` keeps on the schedule, under its names:
    ``fwd_recv_ops``, ``bwd_recv_ops``, ``backward_counter``, ``unshard_ops``,
    ``unsharded_stages``, and the losses behind ``_maybe_compute_loss`` / ``_maybe_get_loss``."""

    losses: dict[int, torch.Tensor]
    fwd_recvs: dict[tuple[int, int], list[dist.Work]]
    bwd_recvs: dict[tuple[int, int], list[dist.Work]]
    backward_count: Counter[int]
    unshard_ops: dict[int, list]
    unsharded_stages: set[int]
    assert_unsharded: Callable[[Any], None]  # finishes a stage's pending FSDP unshard


@dataclasses.dataclass(frozen=True)
class ScheduleView:
    """One step's view of a schedule, for :class:`~titan_dualpipe.runtime.executor.StepExecutor`."""

    rank: int
    rank_name: str  # how failure reports name this rank
    stages: dict[int, Any]  # this rank's stages by index
    training: bool  # step() (False: eval())
    order_with_comms: dict[int, list]  # every rank's lowered order (the failure log prints it)
    options: StepOptions
    state: TorchStepState
    weights: WeightGradients
    pair_runner: PairRunner
    pair_order: PairOrder | None  # which half of a relayed pair runs first (None: the forward)
    sub_batch_runner: SubBatchRunner | None
    two_batch_stages: set[int]
    compute_loss: Callable[..., torch.Tensor] | None  # (output, target, loss_kwargs); None without a loss_fn
    custom_functions: dict  # torch's register_custom_function table, by action type
    torch_schedule: Any  # what a custom function's _PipelineContext holds (torch's schedule_ref)
