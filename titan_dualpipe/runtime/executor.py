"""The small runtime: executes one rank's lowered order for one ``step()``.

One handler per action type (``_HANDLERS``), over per-step state: the receives posted and not yet
waited, the sends in flight, the backward counts and the step's
:class:`~titan_dualpipe.weights.plan.BackwardPlan`, which says how each ``B``, ``I`` and ``W``
runs. It reads its schedule only through :class:`~titan_dualpipe.runtime.view.ScheduleView`.
docs/architecture.md#the-executor tells what each action does.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_map_only
from torch.distributed.fsdp import FSDPModule

from .._compat.pipelining import (
    B,
    F,
    I,
    OVERLAP_F_B,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    SPLIT_BACKWARD_NEEDS_UNSHARD,
    SEND_B,
    SEND_F,
    UNSHARD,
    W,
    WAIT_REDUCE_GRAD,
    _Action,
    _batch_p2p,
    _format_pipeline_order,
    _get_profiler_function_name,
    _PipelineContext,
    _wait_batch_p2p,
    forget_forward,
    reduces_asynchronously,
    release_sent_outputs,
)
from .failures import PeerFailed, first_line, peer_failed, record, root_cause
from .fsdp import fsdp_modules, unshard_all
from ..orders.dataflow import input_source, output_destination, peer_stage
from ..orders.placement import Placement
from ..orders.lone_actions import lone_forwards
from ..weights.plan import AT_WEIGHT, COLLECTED, DEFERRED, DONE, QUEUED, WHOLE, BackwardPlan
from .timeline import StepClock, TimedAction, clock_for, span_seconds
from .view import ScheduleView

BACKWARD_ONLY = (B, I, W, SEND_B, RECV_B, REDUCE_GRAD, WAIT_REDUCE_GRAD)
_HANDLERS: dict[Any, str] = {  # action type -> StepExecutor method
    F: "handle_forward", B: "handle_backward", I: "handle_backward", W: "handle_weight", OVERLAP_F_B: "handle_pair",
    SEND_F: "send_forward", SEND_B: "send_backward", RECV_F: "recv_forward", RECV_B: "recv_backward",
    UNSHARD: "unshard", RESHARD: "reshard", REDUCE_GRAD: "reduce_grad", WAIT_REDUCE_GRAD: "wait_reduce_grad",
}
logger = logging.getLogger("titan_dualpipe")


class StepExecutor:
    """Per-step state and one handler per action type.

    ``handle_*`` take an action from the order (timed, on sub-batches where its microbatch runs as
    two); ``run_forward`` / ``run_backward`` / ``run_weight`` do one stage's work for one
    microbatch, and are what the pair and sub-batch runners call."""

    def __init__(
        self,
        view: ScheduleView,
        place: Placement,
        arg_mbs: list,
        kwarg_mbs: list,
        target_mbs: list | None,
        loss_kwargs: dict | None,
        return_outputs: bool,
        failure_scope: str = "",
    ) -> None:
        self.view = view
        self.options = view.options
        self.failure_scope = failure_scope
        self.place = place
        self.stages = view.stages
        self.rank = view.rank
        self.me = view.rank_name
        self.arg_mbs, self.kwarg_mbs, self.target_mbs = arg_mbs, kwarg_mbs, target_mbs
        self.loss_kwargs = loss_kwargs
        self.return_outputs = return_outputs
        self.training = view.training
        # torch's runtime state (see TorchStepState): custom functions written for it find it there
        self.torch_state = view.state
        self.losses: dict[int, torch.Tensor] = view.state.losses
        self.fwd_recvs: dict[tuple[int, int], list[dist.Work]] = view.state.fwd_recvs
        self.bwd_recvs: dict[tuple[int, int], list[dist.Work]] = view.state.bwd_recvs
        self.backward_count: Counter[int] = view.state.backward_count
        self.sends: list[tuple[_Action, list[dist.Work]]] = []
        self.upcoming: list[_Action] = []  # the rest of the order, while run() executes it
        self.done_early: set[_Action] = set()  # communication posted ahead of its place
        self.unreduced_holders: dict[int, set[int]] = {}  # by parameter: this rank's stages yet to REDUCE_GRAD it
        self.reducing: set[int] = set()  # stages whose FSDP reduction was started, not yet waited for
        for s, stage in self.stages.items():
            for param in stage.submod.parameters():
                self.unreduced_holders.setdefault(id(param), set()).add(s)
        self.plan: BackwardPlan | None = None  # how each backward runs (set by run())
        self.two_batch: set[tuple[int, int]] = set()  # (stage, mb) whose forward runs as two sub-batches if it can
        self.sub_batches: dict[tuple[int, int], Any] = {}  # microbatches that ran as sub-batches, until their backward
        self.split: set[tuple[int, int]] = set()  # every microbatch whose forward ran as sub-batches this step
        self.timeline: list[TimedAction] | None = [] if self.options.record_timeline else None
        # Timed on the stages' device (CUDA events on a GPU, where the host clock would time
        # launches); the marks become seconds once the step is over (_resolve_timeline).
        self._clock: StepClock | None = None
        if self.options.record_timeline:
            self._clock = clock_for(next(iter(self.stages.values())).device)
        self._spans: list[tuple[_Action, Any, Any]] = []

    # -- driver ---------------------------------------------------------------------------
    def run(self, actions: list[_Action]) -> None:
        """Run this rank's order; each action under torch's profiler name (``PP:<action>``). On an
        exception: record it for the other ranks (:mod:`.failures`), log the order with the
        failing action's row marked, re-raise."""
        self.upcoming = list(reversed(actions))  # popped from the end
        self.two_batch = {key for key in lone_forwards(actions) if key[0] in self.view.two_batch_stages}
        self.plan = self.view.weights.plan_step(actions, self.place, self.view.custom_functions, self.two_batch,
                                                self.training)
        action: _Action | None = None
        try:
            while self.upcoming:
                action = self.upcoming.pop()
                if action in self.done_early:
                    self.done_early.remove(action)
                    continue
                if not self.training and action.computation_type in BACKWARD_ONLY:
                    continue
                with record_function(_get_profiler_function_name(action)):
                    self._perform(action)
            action = None
            while self.sends:
                self._retire_send(0)
            for s in sorted(self.reducing):  # a hand-written order may leave a reduction unwaited
                self._finish_reduction(s)
            if not self.training:  # forwards of custom functions (register_custom_function) cached theirs too
                for stage in self.stages.values():
                    forget_forward(stage)
            self._resolve_timeline()
        except BaseException as err:
            self._report(err, actions, action)
            raise
        finally:
            self.view.weights.end_step()

    def _perform(self, action: _Action) -> None:
        """``action`` by its custom function (``register_custom_function``, called as torch's runtime
        does) or its handler. Forward only (eval): a pair runs its forward actions alone."""
        if not self.training and action.computation_type == OVERLAP_F_B:
            for sub in action.sub_actions:
                if sub.computation_type == F:
                    self._perform(sub)
            return
        custom = self.view.custom_functions.get(action.computation_type)
        if custom is not None:
            custom(action, _PipelineContext(self.view.torch_schedule, self.arg_mbs, self.kwarg_mbs, self.target_mbs, None))
        else:
            self._handle(action)

    def _handle(self, action: _Action) -> None:
        # Looked up by name on each call: a dict of bound methods on self would be a reference
        # cycle, keeping every step's inputs and losses alive until the cycle collector runs.
        getattr(self, _HANDLERS[action.computation_type])(action)

    def _report(self, err: BaseException, actions: list[_Action], action: _Action | None) -> None:
        where = f"at {action}" if action is not None else "waiting for its sends at the end of the step"
        if not isinstance(err, PeerFailed):
            root = root_cause(err)  # torch wraps a stage's own error: name that one
            record(self.failure_scope, f"{self.me} raised {type(root).__name__} {where}: {first_line(root)}")
        row = actions.index(action) if action is not None else None
        logger.error("pipeline rank %s failed %s (row %s of its order, marked):\n%s", self.rank, where, row,
                     _format_pipeline_order(self.view.order_with_comms, error_step_number=row))

    def _post(self, ops: list[dist.P2POp], action: _Action) -> list[dist.Work]:
        """Post ``action``'s p2p ops; if its peer stopped (gloo can tell at posting), raise
        :class:`PeerFailed` naming it."""
        try:
            return _batch_p2p(ops)
        except RuntimeError as err:
            raise self._lost_peer(action, err) from err

    def _wait(self, works: list[dist.Work], action: _Action) -> None:
        """Wait for ``action``'s p2p ops; if its peer stopped, raise :class:`PeerFailed` naming it."""
        try:
            _wait_batch_p2p(works)
        except RuntimeError as err:
            raise self._lost_peer(action, err) from err

    def _lost_peer(self, action: _Action, err: RuntimeError) -> PeerFailed:
        source = input_source(action, self.place)
        peer = self.place.rank_of(source.stage if source is not None else peer_stage(action, self.place))
        group = self.stages[action.stage_index].group
        peer_global = dist.get_global_rank(group, peer) if group is not None else peer
        return peer_failed(self.failure_scope,
                           f"{self.me} lost pipeline rank {peer} (global rank {peer_global}) at {action}: {first_line(err)}")

    def timed(self, action: _Action, fn: Callable[[], None]) -> None:
        if self._clock is None:
            fn()
            return
        start = self._clock.mark()
        fn()
        self._spans.append((action, start, self._clock.mark()))

    def _resolve_timeline(self) -> None:
        """The step's spans as :class:`TimedAction` seconds since the executor started (on a GPU
        after one synchronize, so the step's kernels are not held back while it runs)."""
        if self._clock is None:
            return
        seconds = span_seconds(self._clock, [(start, end) for _, start, end in self._spans])
        self.timeline = [TimedAction(self.rank, action, start, end)
                         for (action, _, _), (start, end) in zip(self._spans, seconds)]

    # -- compute ----------------------------------------------------------------------------
    def handle_forward(self, action: _Action) -> None:
        """A lone forward: on two sub-batches of its microbatch where two-batch overlap is on."""
        key = (action.stage_index, action.microbatch_index)
        if key in self.two_batch:
            self.timed(action, lambda: self.view.sub_batch_runner.forward(self, action))
            if key in self.sub_batches:  # else it ran whole (a microbatch of one row)
                self.split.add(key)
            if not self.training:  # no backward will read the sub-batches: keep neither them nor the joined output
                self.sub_batches.pop(key, None)
        else:
            self.timed(action, lambda: self.run_forward(action))

    def handle_backward(self, action: _Action) -> None:
        self.timed(action, self._on_sub_batches(action, lambda: self.run_backward(action)))

    def handle_weight(self, action: _Action) -> None:
        self.timed(action, self._on_sub_batches(action, lambda: self.run_weight(action)))

    def _on_sub_batches(self, action: _Action, run: Callable[[], None]) -> Callable[[], None]:
        """``run``, with its backward on the two sub-batches when the microbatch's forward ran as sub-batches."""
        if (action.stage_index, action.microbatch_index) not in self.sub_batches:
            return run
        return lambda: self.view.sub_batch_runner.backward(self, action, run)

    def handle_pair(self, action: _Action) -> None:
        """An overlapped pair: forward ``sub_actions[0]``, full backward ``sub_actions[1]``; or a
        lone pair (:mod:`titan_dualpipe.orders.lone_pairs`): two forwards, or two backwards."""
        first, second = action.sub_actions
        if not self.training:
            for sub in (first, second):
                if sub.computation_type == F:
                    self.handle_forward(sub)
            return
        self.timed(action, lambda: self.view.pair_runner(self, first, second))

    def run_forward(self, action: _Action) -> None:
        s, mb = action.stage_index, action.microbatch_index
        stage = self.stages[s]
        self.torch_state.assert_unsharded(stage)
        self.wait_input(action)
        with self.plan.forward(s, mb):
            output = stage.forward_one_chunk(
                mb, self.arg_mbs[mb], self.kwarg_mbs[mb], save_forward_output=self.return_outputs
            )
        compute_loss = self.view.compute_loss
        if self.place.is_last(s) and compute_loss is not None and self.target_mbs is not None:
            loss = compute_loss(output, self.target_mbs[mb], self.loss_kwargs)
            self.losses[mb] = loss if self.training else loss.detach()
        dest = output_destination(action, self.place)
        if dest is not None and dest.stage in self.stages:  # same-rank neighbour: in memory
            self.stages[dest.stage].set_local_fwd_input(output, mb)
        if not self.training:
            self._forward_only_done(stage, mb, sent=dest is not None and dest.stage not in self.stages)

    def _forward_only_done(self, stage: Any, mb: int, sent: bool) -> None:
        """eval(): keep no forward's output beyond its use. torch's ``forward_one_chunk`` caches every
        output (with its graph when gradients are enabled) for a backward that will not come: drop it
        now, or once its send is posted when it goes to another rank. A returned output is kept
        without its graph."""
        if not sent:
            forget_forward(stage, mb)
        if self.return_outputs and stage.is_last and stage.output_chunks:
            stage.output_chunks[-1] = tree_map_only(torch.Tensor, torch.Tensor.detach, stage.output_chunks[-1])

    def run_backward(self, action: _Action) -> None:
        s, mb = action.stage_index, action.microbatch_index
        stage = self.stages[s]
        self.torch_state.assert_unsharded(stage)
        self.wait_input(action)
        how = self.plan.at_backward(action.computation_type == I, s, mb, self.place.is_first(s))
        if how == AT_WEIGHT:
            return
        loss = self.losses.get(mb)
        if how == COLLECTED:
            self._collected_full_backward(stage, mb, self.count_backward(s))
        elif how == DEFERRED:  # the weight GEMMs wait in the queue for W, which counts the backward
            self.plan.queued_at_input((s, mb), lambda: stage.backward_one_chunk(
                mb, loss=loss, full_backward=True, last_backward=False))
            self._backward_done(s, mb)
        elif how == WHOLE:
            stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=self.count_backward(s))
            self._backward_done(s, mb)
        else:  # SPLIT: torch's input half; its W runs the weight half
            _unshard_nested(stage)
            stage.backward_one_chunk(mb, loss=loss, full_backward=False, last_backward=False)
        dest = output_destination(action, self.place)
        if dest is not None and dest.stage in self.stages:  # same-rank neighbour: in memory
            self.stages[dest.stage].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

    def _collected_full_backward(self, stage: Any, mb: int, last: bool) -> None:
        """A full backward whose forward deferred: its weight GEMMs computed while its exchanges fly
        and given to autograd at its end (:meth:`~titan_dualpipe.weights.plan.BackwardPlan.collected`)."""
        self.plan.collected((stage.stage_index, mb), lambda: stage.backward_one_chunk(
            mb, loss=self.losses.get(mb), full_backward=True, last_backward=last))
        self._backward_done(stage.stage_index, mb)

    def run_weight(self, action: _Action) -> None:
        s, mb = action.stage_index, action.microbatch_index
        stage = self.stages[s]
        self.torch_state.assert_unsharded(stage)
        how = self.plan.at_weight(s, mb)
        if how == DONE:  # its I ran the whole backward (and counted it)
            return
        last = self.count_backward(s)
        if how == COLLECTED:
            self._collected_full_backward(stage, mb, last)
            return
        if how == QUEUED:
            self.plan.run_queued((s, mb))
        elif how == WHOLE:
            stage.backward_one_chunk(mb, loss=self.losses.get(mb), full_backward=True, last_backward=last)
        else:
            _unshard_nested(stage)
            stage.backward_weight_one_chunk(mb, last_backward=last)
        self._backward_done(s, mb)

    def _backward_done(self, stage_index: int, mb: int) -> None:
        """Keep a finished microbatch's loss and returned output without their graph: after a
        split backward, what only the input gradient needed (attention's and activations'
        saved tensors) lives as long as the graph does, which these would hold to the step's end."""
        if not self.place.is_last(stage_index):
            return
        if mb in self.losses:
            self.losses[mb] = self.losses[mb].detach()
        outputs = self.stages[stage_index].output_chunks  # one per forward, in microbatch order
        if mb < len(outputs):
            outputs[mb] = tree_map_only(torch.Tensor, torch.Tensor.detach, outputs[mb])

    def count_backward(self, stage_index: int) -> bool:
        """Count a completed backward of a stage; True for its last one this step."""
        self.backward_count[stage_index] += 1
        return self.backward_count[stage_index] == self.place.microbatches_per_stage()

    def wait_input(self, action: _Action) -> None:
        """Wait for the recv feeding ``action`` unless its source is a chain end or on this rank."""
        s, mb = action.stage_index, action.microbatch_index
        source = input_source(action, self.place)
        if source is None or source.stage in self.stages:
            return
        recvs = self.fwd_recvs if action.computation_type == F else self.bwd_recvs
        works = recvs.pop((s, mb), None)
        if works is None:
            raise RuntimeError(f"rank {self.rank}: {action} runs before its input was received")
        self._wait(works, action)

    # -- communication ----------------------------------------------------------------------
    def send_forward(self, action: _Action) -> None:
        stage = self.stages[action.stage_index]
        ops = stage.get_fwd_send_ops(action.microbatch_index)
        for op in ops:  # a posted send's work holds its tensor until waited; torch 2.11's, the graph with it
            op.tensor = op.tensor.detach()
        works = self._post(ops, action)
        self._posted_send(action, works)
        if not self.training:  # eval(): the output's last use (see _forward_only_done)
            forget_forward(stage, action.microbatch_index)

    def send_backward(self, action: _Action) -> None:
        works = self._post(self.stages[action.stage_index].get_bwd_send_ops(action.microbatch_index), action)
        self._posted_send(action, works)

    def _posted_send(self, action: _Action, works: list[dist.Work]) -> None:
        """Keep a posted send until it completes. Those already complete are retired now (torch 2.15+:
        the stage then drops its references to a forward's outputs, whose backward starts from their
        autograd edges); with ``max_outstanding_sends``, the oldest are waited for until no more than
        that many are pending (``orders.nccl_model.planned_trace`` checks that order at construction)."""
        for i in reversed(range(len(self.sends))):
            if all(work.is_completed() for work in self.sends[i][1]):
                self._retire_send(i)
        self.sends.append((action, works))
        cap = self.options.max_outstanding_sends
        while cap is not None and len(self.sends) > cap:
            self._retire_send(0)

    def _retire_send(self, i: int) -> None:
        send, works = self.sends.pop(i)
        self._wait(works, send)
        if send.computation_type == SEND_F and self.training:
            release_sent_outputs(self.stages[send.stage_index], send.microbatch_index)

    def post_send_early(self, send: _Action) -> None:
        """Post a forward send now, ahead of its place in the order (which then skips it).

        Only when nothing but receives stands between here and the send in the order: those
        are posted first, so this rank's communication keeps its order (NCCL runs a
        communicator's ops in posting order and does not buffer). Otherwise, or when the
        order has no such send (same-rank next stage, chain end), the send waits its turn.
        """
        ahead: list[_Action] = []
        for action in reversed(self.upcoming):
            if action == send:
                break
            if action.computation_type not in (RECV_F, RECV_B):
                return
            ahead.append(action)
        else:
            return
        for action in (*ahead, send):
            self._handle(action)
            self.done_early.add(action)

    def recv_forward(self, action: _Action) -> None:
        key = (action.stage_index, action.microbatch_index)
        self.fwd_recvs[key] = self._post(self.stages[action.stage_index].get_fwd_recv_ops(key[1]), action)

    def recv_backward(self, action: _Action) -> None:
        key = (action.stage_index, action.microbatch_index)
        self.bwd_recvs[key] = self._post(self.stages[action.stage_index].get_bwd_recv_ops(key[1]), action)

    # -- FSDP -------------------------------------------------------------------------------
    def unshard(self, action: _Action) -> None:
        stage = self.stages[action.stage_index]
        if isinstance(stage.submod, FSDPModule):
            handles = self.torch_state.unshard_ops[action.stage_index]
            handles.extend(module.unshard(async_op=True) for module in fsdp_modules(stage.submod))

    def reshard(self, action: _Action) -> None:
        stage = self.stages[action.stage_index]
        if isinstance(stage.submod, FSDPModule):
            if action.stage_index in self.reducing:  # its reduction reshards it when it finishes
                self.torch_state.unsharded_stages.discard(action.stage_index)
                return
            self.torch_state.assert_unsharded(stage)  # finishes a pending unshard first
            for module in fsdp_modules(stage.submod):
                module.reshard()
            self.torch_state.unsharded_stages.discard(action.stage_index)

    def reduce_grad(self, action: _Action) -> None:
        """torch's reduction (FSDP's post-backward), then each of the stage's gradients divided by the
        microbatch count once: a parameter two stages of this rank hold (tied weights) once both
        have reduced (torch's ``scale_grads`` divides it once per stage). With
        ``defer_reduce_grad_wait`` an FSDP2 reduction is only started here (its WAIT_REDUCE_GRAD
        finishes it), so it runs while the rank computes on."""
        stage = self.stages[action.stage_index]
        if self.options.defer_reduce_grad_wait and reduces_asynchronously(stage):
            stage.start_gradient_reduction()
            self.reducing.add(action.stage_index)
            return
        stage.perform_reduce_grad(1)
        self._scale_reduced(action.stage_index)

    def wait_reduce_grad(self, action: _Action) -> None:
        """Finish a reduction REDUCE_GRAD started (nothing when it ran synchronously)."""
        if action.stage_index in self.reducing:
            self._finish_reduction(action.stage_index)

    def _finish_reduction(self, stage_index: int) -> None:
        self.stages[stage_index].wait_for_gradient_reduction(1)
        self.reducing.discard(stage_index)
        self._scale_reduced(stage_index)

    def _scale_reduced(self, stage_index: int) -> None:
        stage = self.stages[stage_index]
        if not self.options.scale_grads:
            return
        for param in stage.submod.parameters():
            holders = self.unreduced_holders.get(id(param), set())  # FSDP2 may have swapped in other objects
            holders.discard(stage_index)
            if not holders and param.grad is not None:
                param.grad.div_(self.options.n_microbatches)


def _unshard_nested(stage: Any) -> None:
    """Unshard every FSDP module of a stage before a split (I or W) backward.

    The split backward finds weights through ``submod.parameters()`` before autograd
    runs; a nested FSDP module resharded after forward would list its sharded
    parameters, which are not in the graph, and its weight gradient would be lost.
    Unsharded, it lists the same parameter objects the forward used. (The backward
    pre-hooks would unshard these modules moments later anyway.)
    """
    if SPLIT_BACKWARD_NEEDS_UNSHARD:
        unshard_all(stage.submod)
