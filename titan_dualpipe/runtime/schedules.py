"""``ScheduleDualPipeV`` and ``ScheduleDualPipe``: torch pipelining schedules.

Both are ``PipelineScheduleMulti`` subclasses (through torch's ``_PipelineScheduleRuntime``,
so CSV loading, ``eval()`` and the stage API are torch's) that execute their order with
:class:`~titan_dualpipe.runtime.executor.StepExecutor`. Each rank passes its two
``PipelineStage`` objects, stage ids ``r`` and ``2*pp-1-r`` with ``num_stages=2*pp``.
The first step creates the two-rank communicators its sends and receives run on before any
action (``_create_pair_communicators``), so none is created lazily mid-schedule.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.distributed as dist

from .._compat.pipelining import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    PipelineStage,
    TracedPipelineStage,
    _PipelineScheduleRuntime,
    _PipelineStageBase,
    _batch_p2p,
    _wait_batch_p2p,
    schedule_kwargs,
    split_target,
)
from .._compat.stage_init import agreed_inference_mode, initialize_stages, torch_start_up, warm_up_traced, with_start_up
from ..orders import compute_order, placement
from ..orders.lone_pairs import pair_lone_actions
from ..orders.dataflow import peer_stage
from ..orders.lone_actions import lone_forwards
from ..orders.lowering import lower, validate_order
from .timeline import TimedAction
from .agreement import agree
from .chain_ends import set_chain_ends
from .errors import PipelineConfigError
from .executor import StepExecutor
from .failures import named_for_every_rank, record, schedule_scope, step_scope
from .fsdp import unshard_all
from .p2p import local_tensor, swap, with_layout_of
from .sub_batch_runner import SubBatchRunner, has_exchanges, two_batch_stages
from .two_batch_choice import MeasuredTwoBatch
from .pairs import PairOrder, PairRunner, lone_pairs_problem, pair_first_problem, pair_runner
from .view import ScheduleView, StepOptions, TorchStepState
from ..weights.in_flight import in_flight_mode_problem
from ..weights.policy import WeightGradients, min_flops_option, weight_gradients_problem
from .twins import copy_to_twin, folded_into_fsdp, grads_before_step, prepare_folded, sum_twin_grads
from .validation import (changed_inputs_problem, cross_rank_problem, data_parallel_problem, microbatch_signature,
                         runtime_options_problem,
                         requirements_problem, split_problem, stage_problem, step_inputs_problem)


logger = logging.getLogger("titan_dualpipe")


def _agree_on_construction(name: str, stages: Any, n_microbatches: int) -> None:
    """PipelineConfigError on every rank when any rank's stages or microbatch count cannot work (one
    collective over the stages' group; a rank without a single stage has no group to tell)."""
    problem = stage_problem(name, stages)
    if not isinstance(stages, (list, tuple)) or not stages:
        raise PipelineConfigError(problem)
    if not problem:
        problem = requirements_problem(name, stages[0].group_size, n_microbatches) or data_parallel_problem(name, stages)
    agree(problem, stages[0].group, stages[0].device)


_RENAMED_KEYWORDS = {"weights_in_flight": "weight_gemms_in_flight"}  # old -> new


def _renamed_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """Accept a renamed keyword under its old name, with a DeprecationWarning naming the new one."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        for old, new in _RENAMED_KEYWORDS.items():
            if old in kwargs:
                warnings.warn(f"{type(self).__name__}({old}=...) is deprecated: use {new}=...", DeprecationWarning,
                              stacklevel=2)
                kwargs[new] = kwargs.pop(old)
        init(self, *args, **kwargs)

    return wrapper


@with_start_up
class _DualPipeFamily(_PipelineScheduleRuntime):
    """What ScheduleDualPipeV and ScheduleDualPipe share.

    Arguments as torch 2.15's ``ScheduleDualPipeV`` (on every supported torch; ``unshard_lookahead``
    other than ``"full"`` and ``defer_reduce_grad_wait`` need 2.15), plus keyword-only:

    - ``overlap`` (default True): run overlapped pairs with overlap (see
      :mod:`titan_dualpipe.overlap`); False runs each pair's halves one after the other.
    - ``two_batch_overlap`` (default False): True runs each forward that has no pair partner on
      two sub-batches of its microbatch, relayed like a pair, so each sub-batch's exchanges hide behind the
      other's compute, on stages with expert-parallel exchanges; ``"all"`` on every stage;
      ``"measured"`` on those of True where steps 1 to 4, timed whole and split in turn, say it
      pays (:mod:`titan_dualpipe.runtime.sub_batch_runner`,
      :mod:`titan_dualpipe.runtime.two_batch_choice`, :mod:`titan_dualpipe.overlap.sub_batches`).
    - ``weight_gradients`` (default ``"deferred"``): how an ``I`` leaves the weight gradient to
      its ``W``. ``"deferred"``: one autograd pass at ``I``, each ``nn.Linear``'s weight GEMM
      queued for ``W`` (:mod:`titan_dualpipe.weights`; activation-checkpointed
      regions recompute once); ``"split"``: torch's split of the graph (a checkpointed
      microbatch then runs whole at ``I``); ``"whole"``: every backward whole at ``I``, ``W``
      a no-op. A stage holding compiled blocks runs whole at ``I`` (torch's split would run a
      compiled graph twice), except under ``"deferred_compiled"``: ``"deferred"`` with the
      ``nn.Linear`` modules inside compiled regions deferring too, through a custom operator
      (docs/compile.md: measured slower on CPU than whole at ``I``).
    - ``not_deferred``: module names (``fnmatch`` patterns or module paths inside a stage module)
      whose weight GEMMs are not deferred; ``deferred_weights[stage_index]`` lists those that are.
    - ``min_weight_gemm_flops`` (default None): a weight GEMM of fewer FLOPs (its parameter's first
      call of a step decides) is left to autograd at ``I``, where deferral's Python nodes would
      cost more than moving it saves. None: ``TITAN_DUALPIPE_MIN_WEIGHT_GEMM_FLOPS`` where set,
      else 8 MFLOP on a CPU and 0 (every GEMM) on other devices; 0 defers every one.
    - ``weight_gemms_in_flight`` (default True): a full backward (``B``, a pair's backward) of a
      deferring stage that posts expert-parallel exchanges queues its weight GEMMs too, and each
      exchange it posts runs those queued so far while it travels
      (:mod:`titan_dualpipe.weights.in_flight`); False computes them inline; ``"fill"`` computes
      only what fits before the exchange the pair waits on next arrives (fillers, where arrival
      times are known: the CPU's emulated exchanges). Same gradients.
    - ``pair_first`` (default ``"forward"``): which half of a relayed pair (a pair whose stage
      modules have no overlap protocol) runs first, and where it hands over: ``"forward"`` and
      ``"backward"`` alternate from that half; ``"measured"``: per kind of pair (its two stages and
      whether it holds a forward with a backward or is a lone pair, below), the
      order the floor's model finds best for the second step's recorded segments (the half that
      starts, and at each hand-over whether the partner runs next), agreed by two all-reduces over
      the default process group (every rank steps); ``"measured_first"``: the same, alternating from
      the half that exposes less. Only exchanges of known time (the CPU's emulated ones) measure,
      elsewhere the forward first (:mod:`titan_dualpipe.overlap.pair_first`).
    - ``lone_pairs`` (default False): adjacent lone actions of one direction (two forwards, or two
      backwards) where the first does not feed the second run as one relayed pair, kept where the
      order still runs (:mod:`titan_dualpipe.orders.lone_pairs`); not with ``two_batch_overlap``.
    - ``record_timeline``: record each compute action's start and end in ``self.timeline``
      (this rank, last step); :meth:`collect_timeline` gathers all ranks.

    ``defer_pp_recv=True`` posts each receive just before its consumer, keeping receives
    from one peer in order (see :func:`titan_dualpipe.orders.lowering.defer_recvs`).
    """

    schedule_name: ClassVar[str]
    # the runners of overlapped pairs and of lone forwards as sub-batches: the runtime has none (it never
    # imports titan_dualpipe.overlap); the classes the package exports (overlap/schedules.py) set both
    overlapped_pair_runner: ClassVar[PairRunner | None] = None
    sub_batch_runner: ClassVar[SubBatchRunner | None] = None
    # builds the pair_first option's order, (mode, number of stages, device) -> PairOrder; set with the runners
    pair_order_class: ClassVar[Callable[[str, int, torch.device], PairOrder] | None] = None

    @_renamed_keywords
    def __init__(
        self,
        stages: list[_PipelineStageBase],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        max_active_stages: int = 3,
        unshard_lookahead: str | tuple[int, ...] = "full",
        *,
        defer_reduce_grad_wait: bool = False,
        max_outstanding_sends: int | None = None,
        overlap: bool = True,
        two_batch_overlap: bool | str = False,
        weight_gradients: str = "deferred",
        not_deferred: Sequence[str] = (),
        min_weight_gemm_flops: int | None = None,
        weight_gemms_in_flight: bool | str = True,
        pair_first: str = "forward",
        lone_pairs: bool = False,
        record_timeline: bool = False,
    ) -> None:
        weight_gradients_problem(weight_gradients, not_deferred, min_weight_gemm_flops)
        min_weight_gemm_flops = min_flops_option(min_weight_gemm_flops)  # the environment's, checked here
        if in_flight_mode_problem(weight_gemms_in_flight):
            raise PipelineConfigError(in_flight_mode_problem(weight_gemms_in_flight))
        if pair_first_problem(pair_first, overlap):
            raise PipelineConfigError(pair_first_problem(pair_first, overlap))
        if lone_pairs_problem(lone_pairs, two_batch_overlap):
            raise PipelineConfigError(lone_pairs_problem(lone_pairs, two_batch_overlap))
        pp = stages[0].group_size if isinstance(stages, (list, tuple)) and stages else 1
        problem = runtime_options_problem(self.schedule_name, pp, max_active_stages, unshard_lookahead,
                                          defer_reduce_grad_wait, max_outstanding_sends)
        if problem:
            raise PipelineConfigError(problem)
        split_stages = self._check_and_place(stages, n_microbatches, overlap, two_batch_overlap)
        super().__init__(
            stages=sorted(stages, key=lambda s: s.stage_index),
            n_microbatches=n_microbatches,
            loss_fn=loss_fn,
            args_chunk_spec=args_chunk_spec,
            kwargs_chunk_spec=kwargs_chunk_spec,
            output_merge_spec=output_merge_spec,
            scale_grads=scale_grads,
            backward_requires_autograd=backward_requires_autograd,
            **schedule_kwargs(defer_pp_recv=defer_pp_recv),
        )
        self._init_step_state(defer_pp_recv)
        self.defer_reduce_grad_wait = defer_reduce_grad_wait
        self.max_active_stages, self.unshard_lookahead = max_active_stages, unshard_lookahead
        self.max_outstanding_sends = max_outstanding_sends
        self._map_stages_to_ranks()
        self._choose_how_actions_run(overlap, split_stages, record_timeline, pair_first)
        self._choose_two_batch(two_batch_overlap, split_stages)
        self._choose_weight_gradients(weight_gradients, not_deferred, weight_gemms_in_flight, min_weight_gemm_flops)
        self.lone_pairs = lone_pairs
        self.pipeline_order = compute_order(self.schedule_name, self.placement.pp_size, n_microbatches)
        if lone_pairs:
            self.pipeline_order = pair_lone_actions(self.pipeline_order, self.placement)
        self._prepare_schedule_with_comms(self.pipeline_order)

    def _check_and_place(self, stages: list[_PipelineStageBase], n_microbatches: int, overlap: bool,
                         two_batch_overlap: bool | str) -> set[int]:
        """Check the options (before any collective), agree on the construction across ranks and
        set the placement; returns the stages whose lone microbatches run as sub-batches."""
        modules = {s.stage_index: s.submod for s in stages} if isinstance(stages, (list, tuple)) else {}
        split_stages = two_batch_stages(two_batch_overlap, overlap, modules)
        _agree_on_construction(self.schedule_name, stages, n_microbatches)
        self.placement = placement(self.schedule_name, stages[0].group_size, n_microbatches)
        return split_stages

    def _init_step_state(self, defer_pp_recv: bool) -> None:
        self._defer_pp_recv = defer_pp_recv
        self._step_losses: dict[int, torch.Tensor] = {}  # this step's losses by microbatch (last stages)
        self._step_loss_kwargs: dict | None = None
        self._failure_scope = schedule_scope(self._stages[0].group)
        self._steps_run = 0
        self._agreed_inputs: dict[bool, tuple] = {}  # by has_backward: the signature of the inputs agreed on

    def _map_stages_to_ranks(self) -> None:
        """Tell each stage which rank holds every stage and, under DualPipe (two chains), where its own chain ends."""
        place = self.placement
        self.stage_index_to_group_rank = {s: place.rank_of(s) for s in range(place.num_stages)}
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.stage_index_to_group_rank
            if place.bidirectional:
                set_chain_ends(stage, first=place.is_first(stage.stage_index), last=place.is_last(stage.stage_index))

    def _choose_how_actions_run(self, overlap: bool, split_stages: set[int], record_timeline: bool,
                                pair_first: str) -> None:
        """Pairs overlapped or not (which half first), lone forwards as sub-batches, FSDP at the step's
        edges, whole backwards."""
        self.record_timeline = record_timeline
        self.timeline: list[TimedAction] = []
        self.overlap = overlap
        self.pair_runner: PairRunner = pair_runner(overlap, type(self).overlapped_pair_runner)
        order_class = type(self).pair_order_class
        self.pair_order: PairOrder | None = None
        if overlap and order_class is not None:
            self.pair_order = order_class(pair_first, self.placement.num_stages, self._stages[0].device)
        self.fsdp_at_step_edges = self._folds_twins()
        self.whole_backwards: set[tuple[int, int]] = set()

    def _choose_two_batch(self, option: bool | str, split_stages: set[int]) -> None:
        """The stages whose lone microbatches split (``two_batch_stages``); under "measured", none
        until the choice (``two_batch_choice``) is made."""
        self.two_batch_choice: MeasuredTwoBatch | None = None
        self.two_batch_stages = split_stages
        if option == "measured":
            self.two_batch_choice = MeasuredTwoBatch(split_stages, self.placement.num_stages, self._stages[0].device)
            self.two_batch_stages = set()

    def _choose_weight_gradients(self, mode: str, not_deferred: Sequence[str], in_flight: bool | str,
                                 min_flops: int | None) -> None:
        """Install deferred weight GEMMs on the stages that can take them (see ``weight_gradients``)."""
        modules = self._stage_modules()
        exchanges = {s for s, module in modules.items() if has_exchanges(module)}
        self.weight_policy = WeightGradients(mode, not_deferred, in_flight, modules, exchanges, min_flops)

    @property
    def weight_gradients(self) -> str:
        """The ``weight_gradients`` option."""
        return self.weight_policy.mode

    @property
    def least_weight_gemm_flops(self) -> int:
        """The least FLOPs of a weight GEMM that defers on this rank's stages' device (0: every one)."""
        return self.weight_policy.queue.least_flops(self._stages[0].device)

    @property
    def deferred_weights(self) -> dict[int, list[str]]:
        """By deferring stage, the modules whose weight GEMMs wait for ``W``."""
        return self.weight_policy.deferred_weights

    def _stage_modules(self) -> dict[int, torch.nn.Module]:
        return {stage.stage_index: stage.submod for stage in self._stages}

    def _folds_twins(self) -> bool:
        """Whether FSDP2 shards DualPipe's twin copies as one parameter (see ``ScheduleDualPipe``)."""
        return False

    # -- schedule IR -------------------------------------------------------------------------
    def _validate_and_set_stage_mapping(self, actions: dict) -> None:
        """Validation for torch's ``_load_csv``: per-stage microbatch counts follow the placement."""
        validate_order(actions, self.placement)

    def _prepare_schedule_with_comms(self, actions: dict, format: str = "compute_only") -> None:
        """Lower a compute-only order with our chain-aware passes, or take a compute_comms one as is."""
        if format == "compute_only":
            self.pipeline_order_with_comms = lower(actions, self.placement, defer_recv=self._defer_pp_recv,
                                                   fsdp_at_step_edges=self.fsdp_at_step_edges,
                                                   defer_reduce_grad_wait=self.defer_reduce_grad_wait,
                                                   max_active_stages=self.max_active_stages,
                                                   unshard_lookahead=self.unshard_lookahead)
        elif format == "compute_comms":
            compute = {r: [a for a in acts if a is not None and a.is_compute_op] for r, acts in actions.items()}
            validate_order(compute, self.placement)
            self.pipeline_order_with_comms = {r: [a for a in acts if a is not None] for r, acts in actions.items()}
        else:
            raise PipelineConfigError(f"format must be 'compute_only' or 'compute_comms', got {format!r}")
        self._check_send_cap()

    def _check_send_cap(self) -> None:
        """With ``max_outstanding_sends``, the order must still complete where a send completes only
        against its posted receive (NCCL; gloo buffers): checked on the model of
        :mod:`titan_dualpipe.orders.nccl_model`, the same on every rank, before any traffic."""
        cap = self.max_outstanding_sends
        if cap is None:
            return
        from ..orders.nccl_model import Deadlock, check_completes, planned_trace

        def completes(limit: int) -> bool:
            try:
                check_completes(planned_trace(self.pipeline_order_with_comms, self.placement, max_outstanding_sends=limit))
            except Deadlock:
                return False
            return True

        if not completes(cap):
            least = next(k for k in range(cap + 1, 4 * self._n_microbatches + 1) if completes(k))
            raise PipelineConfigError(
                f"{self.schedule_name}: max_outstanding_sends={cap} cannot complete this order on NCCL (a rank would wait "
                f"for a send whose receive its peer posts later); the least that completes for pp="
                f"{self.placement.pp_size}, {self._n_microbatches} microbatches is {least}")

    # -- step -------------------------------------------------------------------------------
    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             loss_kwargs: dict | None = None, arg_mbs: list | None = None, kwarg_mbs: list | None = None,
             target_mbs: list | None = None, **kwargs):
        """Run one step: whole-batch ``args``/``kwargs``/``target`` (split into microbatches
        here) or pre-split ``arg_mbs``/``kwarg_mbs``/``target_mbs`` (one entry per microbatch:
        a tuple of positional inputs, a dict of keyword inputs, a target). Steps may switch form
        as long as the microbatches keep their shapes, as with torch's schedules.

        See the class docstring for which ranks pass inputs. ``losses`` receives every
        microbatch's loss on the ranks that hold a last stage; ``loss_kwargs`` go to
        ``loss_fn``. Returns the merged outputs of this rank's last stage (or None).
        """
        if self._has_backward and self._backward_requires_autograd and not torch.is_grad_enabled():
            raise RuntimeError("step() needs gradients enabled (it runs the backward); use eval() under torch.no_grad()")
        arg_mbs, kwarg_mbs, target_mbs = self._agreed_microbatches(args, kwargs, target, arg_mbs, kwarg_mbs,
                                                                   target_mbs)
        self.weight_policy.route(self._stage_modules())
        for stage in self._stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs)
        for stage in self._stages:
            if stage.is_last and return_outputs:
                return self._merge_outputs(stage.output_chunks)
        return None

    def eval(self, *args, target=None, losses: list | None = None, return_outputs: bool = True,
             arg_mbs: list | None = None, kwarg_mbs: list | None = None, target_mbs: list | None = None, **kwargs):
        """Forward only (no gradients), with ``step()``'s inputs.

        Returns the merged outputs of this rank's last stage, as torch's schedules do.
        ``return_outputs=False`` returns None and keeps no stage output beyond its last use (its
        send, the next stage's forward, the loss): a language model's logits then live one
        microbatch at a time instead of all at once (the torchtitan adapter passes it: its
        validator reads the losses only). Losses and returned outputs come without autograd
        graphs."""
        has_backward = self._has_backward
        try:
            self._has_backward = False
            return self.step(*args, target=target, losses=losses, return_outputs=return_outputs, arg_mbs=arg_mbs,
                             kwarg_mbs=kwarg_mbs, target_mbs=target_mbs, **kwargs)
        finally:
            self._has_backward = has_backward

    def _compute_loss(self, output, target, loss_kwargs=None):
        return self._loss_fn(output, target, **(loss_kwargs or {}))

    # torch's runtime hooks, for custom functions (register_custom_function) written against
    # torch's _PipelineScheduleRuntime: the same calls, keyed by microbatch and chain ends.
    def _maybe_compute_loss(self, stage, output, target_mbs, mb_index, loss_kwargs=None) -> None:
        """The loss of microbatch ``mb_index`` when ``stage`` ends its chain (``step()``'s ``loss_kwargs``
        unless given)."""
        if self.placement.is_last(stage.stage_index) and self._loss_fn is not None and target_mbs is not None:
            kwargs = self._step_loss_kwargs if loss_kwargs is None else loss_kwargs
            loss = self._compute_loss(output, target_mbs[mb_index], kwargs)
            self._step_losses[mb_index] = loss if self._has_backward else loss.detach()  # eval: no graph kept

    def _maybe_get_loss(self, stage, mb_index) -> torch.Tensor | None:
        """The loss a chain's last stage backpropagates for ``mb_index`` (None on other stages)."""
        if not self.placement.is_last(stage.stage_index) or self._loss_fn is None:
            return None
        if mb_index not in self._step_losses:
            raise RuntimeError(f"rank {self.rank}: no loss for microbatch {mb_index} on stage {stage.stage_index}: "
                               f"its forward has not run this step (losses so far: {sorted(self._step_losses)})")
        return self._step_losses[mb_index]

    def _reset_step_state(self, loss_kwargs: dict | None) -> None:
        """Fresh per-step state under torch's runtime names (what its ``_step_microbatches`` keeps)."""
        self.fwd_recv_ops.clear()
        self.bwd_recv_ops.clear()
        self.backward_counter.clear()
        self._step_losses = {}
        self._step_loss_kwargs = loss_kwargs

    def _microbatches(self, args: tuple, kwargs: dict, target: Any, arg_mbs: list | None, kwarg_mbs: list | None,
                      target_mbs: list | None) -> tuple[list, list, list | None]:
        """The step's microbatches, from either form of input (the whole batch split as torch splits it)."""
        n = self._n_microbatches
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            arg_mbs, kwarg_mbs = self._split_inputs(args, kwargs)
            target_mbs = split_target(target, n) if target is not None else None
        arg_mbs = arg_mbs if arg_mbs is not None else [()] * n
        return arg_mbs, kwarg_mbs if kwarg_mbs is not None else [{}] * n, target_mbs

    def _agreed_microbatches(self, args: tuple, kwargs: dict, target: Any, arg_mbs: Any, kwarg_mbs: Any,
                             target_mbs: Any) -> tuple[list, list, list | None]:
        """The step's microbatches; every rank raises when any rank's step() inputs are wrong, before
        pipeline traffic.

        Ranks agree (a collective, then a host sync) at the first step() and the first eval() of
        the schedule only: the stages take those steps' shapes for good. A later step whose
        microbatches have the same signature (shapes, dtypes, structure), in either form (whole
        batch or ``arg_mbs``/``kwarg_mbs``/``target_mbs``, as torch's schedules), needs no
        agreement; one whose microbatches changed or whose inputs are wrong raises on this rank
        (recorded as the step's first failure, so the other ranks' errors name it when their
        pipeline traffic fails)."""
        problem, size = step_inputs_problem(self, args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
        microbatches: tuple = ([], [], None)
        if not problem:
            try:
                microbatches = self._microbatches(args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs)
                problem = split_problem(self.rank, self._n_microbatches, microbatches)
            except Exception as err:  # noqa: BLE001 - torch's split of any input: every rank must hear of it
                problem = (f"rank {self.rank}: the inputs do not split into {self._n_microbatches} microbatches "
                           f"({type(err).__name__}: {err}); pass inputs whose batch dimension every tensor shares")
        first = self._agreed_inputs.get(self._has_backward)
        if first is not None:
            problem = problem or changed_inputs_problem(self.rank, first, microbatch_signature(*microbatches))
            if problem:
                record(step_scope(self._failure_scope, self._steps_run), problem)
                raise PipelineConfigError(problem)
            return microbatches
        holds_last = any(self.placement.is_last(s.stage_index) for s in self._stages)
        passes_target = target is not None or target_mbs is not None
        group, device = self._stages[0].group, self._stages[0].device
        problem = problem or self._stage_modules_problem()
        table = agree(problem, group, device, facts=[int(holds_last), int(holds_last and passes_target), size])
        problem = cross_rank_problem(self.placement, table)
        if problem:  # the same on every rank: the table is
            raise PipelineConfigError(problem)
        self._agreed_inputs[self._has_backward] = microbatch_signature(*microbatches)
        return microbatches

    def _stage_modules_problem(self) -> str:
        """What the stage modules have become since construction that this schedule cannot run (hooks
        registered on compiled blocks' deferred weights, say); checked at the first step and eval."""
        return self.weight_policy.modules_problem(self._stage_modules())

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs=True, loss_kwargs=None):
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        scope = step_scope(self._failure_scope, self._steps_run)
        self._steps_run += 1
        # torch's stage initialisation runs forwards, a backward and its own collectives: a failure
        # there (or in the twins' exchanges) must reach every rank as one in the order does
        with named_for_every_rank(scope, self.rank_name(), "before the first action"):
            self._before_stage_init()
            initialize_stages(self, arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
            self._before_first_step()
        self._reset_step_state(loss_kwargs)
        choice, training = self.two_batch_choice, self._has_backward
        executor = StepExecutor(self._view(choice), self.placement, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs,
                                return_outputs, failure_scope=scope)
        ordered = self.pair_order is not None and training  # eval() runs no pairs
        with self.pair_order.step() if ordered else contextlib.nullcontext():
            executor.run(self.pipeline_order_with_comms[self.rank])
        if self.unshard_ops:
            raise RuntimeError(f"rank {self.rank}: unshard operations left unused: {sorted(self.unshard_ops)}")
        with named_for_every_rank(scope, self.rank_name(), "after the last action"):
            if choice is not None and choice.chosen is None and training:  # its all-reduce fails as the others do
                self._two_batch_step_ended(choice, executor)
            self._after_step(executor)
        self.whole_backwards = set(executor.plan.whole)  # (stage, mb) whose I ran the full backward
        if self.record_timeline:
            self.timeline = executor.timeline
        self._publish_losses(executor, losses)
        self._reset_step_state(None)  # the step's losses and receives are not kept past it

    def _two_batch_step_ended(self, choice: MeasuredTwoBatch, executor: StepExecutor) -> None:
        """Tell "measured" two-batch overlap, still undecided, what the step's lone actions took;
        once it has chosen, its stages split."""
        actions = self.pipeline_order_with_comms[self.rank]
        choice.step_ended(executor.timeline or [], lone_forwards(actions), executor.split)
        if choice.chosen is not None:
            self.two_batch_stages = set(choice.chosen)
            saved = ", ".join(f"stage {s}: {seconds:+.4f} s" for s, seconds in sorted(choice.savings.items()))
            logger.info("two-batch overlap (measured): splitting lone microbatches saved %s (all ranks, both rounds); "
                        "stages %s split from now on", saved or "nothing (no microbatch split)",
                        sorted(choice.chosen_everywhere))

    def _view(self, choice: MeasuredTwoBatch | None = None) -> ScheduleView:
        """What the executor sees of this schedule for one step (``choice``: "measured" two-batch
        overlap's, which says which stages split and whether the step is timed)."""
        training = self._has_backward
        split = choice.stages(training) if choice is not None else self.two_batch_stages
        timed = self.record_timeline or (choice is not None and choice.times(training))
        options = StepOptions(self._n_microbatches, self.scale_grads, self.defer_reduce_grad_wait,
                              self.max_outstanding_sends, timed)
        state = TorchStepState(self._step_losses, self.fwd_recv_ops, self.bwd_recv_ops, self.backward_counter,
                               self.unshard_ops, self.unsharded_stages, self._assert_unsharded)
        compute_loss = self._compute_loss if self._loss_fn is not None else None
        return ScheduleView(self.rank, self.rank_name(), {s.stage_index: s for s in self._stages}, self._has_backward,
                            self.pipeline_order_with_comms, options, state, self.weight_policy, self.pair_runner,
                            self.pair_order, type(self).sub_batch_runner, split, compute_loss,
                            self._comp_type_to_function_map, self)

    def rank_name(self) -> str:
        """How failure reports name this rank: "pipeline rank r (global rank g)"."""
        return f"pipeline rank {self.rank} (global rank {dist.get_rank()})"

    def collect_timeline(self) -> list[TimedAction]:
        """Every rank's recorded actions of the last step (``record_timeline=True``), on every rank.

        Collective over the pipeline group. Times are seconds since each rank started the
        step's executor; their clocks line up as far as the ranks entered step() together (a barrier
        before it, as ``profile`` does).
        """
        everyone: list[list[TimedAction]] = [[] for _ in range(self.pp_group_size)]
        dist.all_gather_object(everyone, list(self.timeline), group=self._stages[0].group)
        return [event for events in everyone for event in events]

    def _start_up(self, stages, has_backward, connect: bool) -> None:
        """torch's start-up exchange (2.12+; ``connect``: the first, p2p not yet set up). Stages from
        torch's tracer get torch's warm-up without messages from a rank to itself (a V's turn, pp=1),
        which gloo rejects; ``PipelineStage``s vote on their metadata-inference mode. Then the
        pipeline's pair communicators are created."""
        if all(isinstance(stage, PipelineStage) for stage in stages):
            self._vote_inference_mode(stages, has_backward, connect)
        else:
            warm_up_traced(self, stages, has_backward, connect)
        if connect:
            self._create_pair_communicators()

    def _create_pair_communicators(self) -> None:
        """One message to every rank this rank's SEND/RECV actions exchange with, posted as the
        executor posts them (torch's ``_batch_p2p``). From torch 2.13 a one-direction batch goes
        as lone ops, which NCCL runs on a communicator per pair of ranks, created at its first use
        and blocking both ranks until both get there; torch's own vote (a chain of sends) creates
        them, ours (one all-reduce) does not, so step 1 would create them mid-schedule. Every rank
        takes its pairs in one global order, by (lower rank, higher rank): the least pair not yet
        created always has both ranks waiting at it, so creation cannot deadlock."""
        me, place = self.rank, self.placement
        comms = (SEND_F, RECV_F, SEND_B, RECV_B)
        peers = {place.rank_of(peer_stage(a, place)) for a in self.pipeline_order_with_comms.get(me, [])
                 if a is not None and a.computation_type in comms} - {me}
        group, device = self._stages[0].group, self._stages[0].device
        works: list[dist.Work] = []
        for peer in sorted(peers, key=lambda p: (min(me, p), max(me, p))):
            op = dist.isend if me < peer else dist.irecv
            works += _batch_p2p([dist.P2POp(op, torch.zeros(1, device=device), group=group, group_peer=peer)])
        _wait_batch_p2p(works)

    def _vote_inference_mode(self, stages, has_backward, connect: bool) -> None:
        torch_start_up(self, stages, has_backward, connect)

    def _before_stage_init(self) -> None:
        """Hook run before torch's stage initialisation (whose shape inference runs forwards)."""

    def _before_first_step(self) -> None:
        """Hook run after stage initialisation, before the first action of every step."""

    def _after_step(self, executor: StepExecutor) -> None:
        """Hook run after every action of the step completed on this rank."""

    def _gather_losses(self, executor: StepExecutor) -> dict[int, torch.Tensor]:
        return executor.losses

    def _publish_losses(self, executor: StepExecutor, losses: list | None) -> None:
        by_mb = self._gather_losses(executor)
        if losses is None or not by_mb:
            return
        if sorted(by_mb) != list(range(self._n_microbatches)):
            raise RuntimeError(f"rank {self.rank}: losses for microbatches {sorted(by_mb)}, expected all")
        losses.clear()
        losses.extend(by_mb[mb] for mb in range(self._n_microbatches))


class ScheduleDualPipeV(_DualPipeFamily):
    """DualPipeV (DeepSeek's "cut-in-half" DualPipe): two stages per rank in a V, one model copy.

    Rank ``r`` holds stages ``r`` and ``2*pp-1-r``. Rank 0 holds the first and the last stage
    and passes ``x`` and ``target`` to ``step()``; other ranks call ``step()``. Needs
    ``n_microbatches >= 2*pp``. ``scale_grads=True`` gives the gradient of the mean of the
    microbatch losses, ``False`` of their sum.
    """

    schedule_name = "DualPipeV"


class ScheduleDualPipe(_DualPipeFamily):
    """DualPipe (DeepSeek-V3): micro-batches enter from both ends of the pipeline.

    The model is split into ``pp`` parts; rank ``r`` holds part ``r`` as stage ``r``
    (direction 0, microbatches ``0..n/2-1``) and part ``pp-1-r`` as stage ``2*pp-1-r``
    (direction 1, microbatches ``n/2..n-1``). Ranks 0 and ``pp-1`` both pass the whole
    batch ``x`` and ``target``; each receives all ``n`` losses in microbatch order, and
    ``step()`` returns the outputs of the microbatches whose last stage it holds (rank 0:
    ``n/2..n-1``, rank ``pp-1``: ``0..n/2-1``).

    Twins: the two copies of each part are made identical at the first ``step()``
    (direction-0 copy wins; call :meth:`sync_twin_weights` again after changing weights
    outside the optimizer), and ``step()`` sums their gradients, so both copies hold the
    full-batch gradient and one optimizer step on every rank keeps them identical.
    Needs an even ``pp``, an even ``n_microbatches`` and ``n_microbatches >= 2*pp``.

    Folded twins: when both stage modules are FSDP2-sharded over a mesh that holds the twin
    rank too (ranks r and pp-1-r times the data-parallel replicas), the two copies are one
    sharded parameter: nothing to copy, FSDP's reduce-scatter sums the twins' gradients (no
    second exchange), optimizer state and sharded weights take half the memory. FSDP then
    gathers both parts at the step's start and reduces them at its end, in part order, on
    every rank of the mesh (``fsdp_at_step_edges``).
    """

    schedule_name = "DualPipe"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._twins_synced = False
        self._grads_before: dict[int, torch.Tensor] = {}  # a step's gradients on entry (accumulated earlier)
        for stage in self._stages:
            if not isinstance(stage, (PipelineStage, TracedPipelineStage)):
                raise PipelineConfigError(
                    f"DualPipe needs torch.distributed.pipelining.PipelineStage stages (or traced ones, "
                    f"pipeline(...).build_stage), got {type(stage).__name__}"
                )

    @property
    def _group(self) -> dist.ProcessGroup | None:
        return self._stages[0].group

    def _twin_peer(self) -> int:
        twin = self.placement.twin_rank(self.rank)
        return dist.get_global_rank(self._group, twin) if self._group is not None else twin

    def _folds_twins(self) -> bool:
        modules = [s.submod for s in self._stages]
        folded, problem = folded_into_fsdp(modules, self._twin_peer())
        table = agree(problem, self._stages[0].group, self._stages[0].device, facts=[int(folded)])
        if table[:, 1].any() and not table[:, 1].all():  # half-folded pipelines would misalign FSDP's collectives
            ranks = [r for r in range(len(table)) if table[r, 1]]
            raise PipelineConfigError(f"DualPipe: the twins of pipeline ranks {ranks} are folded into FSDP (each part sharded "
                             "over a mesh holding its twin rank), those of the other ranks are not; shard every "
                             "part over twins x replicas, or every part over replicas only")
        if folded:
            prepare_folded(modules)
        return folded

    def _before_stage_init(self) -> None:
        # Folded twins: gather both parts now, in part order, as every rank of the fold group
        # does; torch's shape inference would otherwise gather them inside its forwards, at
        # points the twin rank (waiting for shapes from a neighbour) does not reach in step.
        if self.fsdp_at_step_edges:
            for stage in sorted(self._stages, key=lambda s: self.placement.model_part(s.stage_index)):
                unshard_all(stage.submod)

    def sync_twin_weights(self) -> None:
        """Copy each direction-0 part onto its direction-1 twin (collective over twin pairs;
        nothing to do when the twins are folded into FSDP: they are one parameter)."""
        if not self.fsdp_at_step_edges:
            near, far = self._stages  # sorted: direction-0 stage r, direction-1 stage 2pp-1-r
            copy_to_twin(near.submod, far.submod, self._twin_peer(), self._group, near.device)
        self._twins_synced = True

    def _before_first_step(self) -> None:
        if not self._twins_synced:
            self.sync_twin_weights()
        self._grads_before = grads_before_step(self._parts()) if self._sums_twin_grads() else {}

    def _after_step(self, executor: StepExecutor) -> None:
        if self._sums_twin_grads():
            sum_twin_grads(self._parts(), self._twin_peer(), self._group, self._grads_before)
        self._grads_before = {}

    def _sums_twin_grads(self) -> bool:
        return self._has_backward and not self.fsdp_at_step_edges  # folded: FSDP's reduction sums them

    def _parts(self) -> dict[int, torch.nn.Module]:
        return {self.placement.model_part(s.stage_index): s.submod for s in self._stages}

    def _gather_losses(self, executor: StepExecutor) -> dict[int, torch.Tensor]:
        """Ranks 0 and pp-1 each computed half of the losses; swap halves."""
        mine = executor.losses
        if not mine:
            return mine
        other_end = self.pp_group_size - 1 - self.rank
        peer = dist.get_global_rank(self._group, other_end) if self._group is not None else other_end
        own_mbs = sorted(mine)
        other_mbs = [mb for mb in range(self._n_microbatches) if mb not in mine]
        sent = torch.stack([local_tensor(mine[mb]).detach() for mb in own_mbs])  # DTensor under loss parallel
        (received,) = swap([sent], [sent], peer, self._group)
        layout = mine[own_mbs[0]]
        return {**mine, **{mb: with_layout_of(layout, loss) for mb, loss in zip(other_mbs, received.unbind())}}

    def _vote_inference_mode(self, stages, has_backward, connect: bool) -> None:
        """Metadata-inference mode agreed by all ranks (torch 2.13+; torch's vote before 2.15 assumes a single chain)."""

        def everyone_static(local_static: bool) -> bool:
            vote = torch.tensor([int(local_static)], device=self._stages[0].device)
            dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self._group)
            return bool(vote.item())

        agreed_inference_mode(stages, has_backward, everyone_static)
