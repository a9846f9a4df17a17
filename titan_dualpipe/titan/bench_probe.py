"""What ``titan-dualpipe bench titan`` measures inside torchtitan's trainer processes.

Active only when ``BENCH_DIR_ENV`` names a folder (the bench sets it for the runs it starts). It
routes torchtitan's expert all-to-all through
:func:`~titan_dualpipe.overlap.comm.relayed_all_to_all_single` under every schedule, so each
exchange can cost an emulated network's time (``EXCHANGE_S_ENV``, CPU only) and its exposed time
is counted alike for all; times each ``Trainer.train_step``, its phases and its exposed exchange
time by the kind of our action that waited; with ``CALIBRATE_ENV``, times each MoE block's
forward and backward; on the CPU, records each step's pairs and exchanges for the floor; and at
``Trainer.close`` writes each rank's ``bench_rank<R>.json``. What each figure means and the
file's keys: benchmarks/README.md#bench-titan.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from ..exposure.record import ExposureRecorder, StepTrace, pair_exposure, start_recording, step_exposure
from ..orders.lone_pairs import is_lone_pair
from ..overlap.relay import running_half
from ..runtime.timeline import CpuClock, StepClock, clock_for, span_seconds
from ..switches import BENCH_DIR_ENV, CALIBRATE_ENV, COUNT_HAND_OVER_ENV, EXCHANGE_S_ENV
from .generation import GEN


class _Record:
    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.exposed_s: list[float] = []
        self.block_forward_s: list[float] = []
        self.block_backward_s: list[float] = []
        self.phases: list[dict[str, float]] = []  # per step
        self.exposed_by_action: list[dict[str, float]] = []  # per step: exposed seconds by action kind
        self.tokens_per_step = 0
        self.traces: list[StepTrace] = []  # per step (CPU): pairs and exchanges, for the floor


def _floors(traces: list[StepTrace]) -> dict[str, Any]:
    """Per step: the exposure keys of :func:`~titan_dualpipe.exposure.record.step_exposure` and
    each pair's (the emulated network queues each communicator's exchanges in order: "fifo")."""
    return {"exposure": [step_exposure(t, queue="fifo") for t in traces],
            "pairs": [[vars(pair_exposure(p, queue="fifo")) for p in t.pairs] for t in traces]}


def _moe_blocks(model_parts: list[Any]) -> list[Any]:
    """Transformer blocks holding a MoE layer (torchtitan names it ``moe`` in both releases)."""
    from torch import nn

    return [m for part in model_parts for m in part.modules() if isinstance(getattr(m, "moe", None), nn.Module)]


def _time_blocks(model_parts: list[Any], record: _Record) -> None:
    """Forward and backward seconds of every MoE block call (run under a single-threaded
    schedule: nothing else computes between a block's pre- and post-hook)."""
    started: dict[int, float] = {}

    def begin(module: Any, *_: Any) -> None:
        started[id(module)] = time.perf_counter()

    def end_forward(module: Any, *_: Any) -> None:
        record.block_forward_s.append(time.perf_counter() - started.pop(id(module)))

    def end_backward(module: Any, *_: Any) -> None:
        record.block_backward_s.append(time.perf_counter() - started.pop(id(module)))

    for block in _moe_blocks(model_parts):
        block.register_forward_pre_hook(begin)
        block.register_forward_hook(end_forward)
        block.register_full_backward_pre_hook(begin)
        block.register_full_backward_hook(end_backward)


# our executor's action types (torch's _ComputationType names) -> phase
ACTION_PHASES = {"FORWARD": "compute", "FULL_BACKWARD": "compute", "BACKWARD_INPUT": "compute",
                 "BACKWARD_WEIGHT": "compute", "OVERLAP_F_B": "compute", "SEND_F": "p2p", "SEND_B": "p2p",
                 "RECV_F": "p2p", "RECV_B": "p2p", "UNSHARD": "fsdp_gather", "RESHARD": "fsdp_gather",
                 "REDUCE_GRAD": "fsdp_reduce"}


STEP, EXPOSED = "step", "exposed"  # spans besides the phases: the whole train step, exchange waits
# our executor's compute actions -> the kind an exchange wait inside one is charged to
ACTION_KINDS = {"FORWARD": "lone F", "FULL_BACKWARD": "lone B", "BACKWARD_INPUT": "lone I",
                "BACKWARD_WEIGHT": "W", "OVERLAP_F_B": "pair"}
PAIR = ACTION_KINDS["OVERLAP_F_B"]
LONE_PAIR = "lone pair"  # an OVERLAP_F_B of two forwards or two backwards (titan_dualpipe.orders.lone_pairs)
OUTSIDE = "outside our actions"  # torch's executor, or between our actions


class _PhaseClock:
    """Spans of the wrapped calls of the current step, by phase, on the step's clock: the host
    clock on the CPU; on a GPU, CUDA events (a phase is then the GPU time of the work queued
    in it, not the time to launch it), resolved with one synchronize after the step."""

    def __init__(self) -> None:
        self.clock: StepClock = CpuClock()
        self.spans: list[tuple[str, Any, Any]] = []
        self.action_kind: str | None = None  # the ACTION_KINDS entry of our compute action running now

    def start_step(self, device: Any) -> None:
        self.clock, self.spans = clock_for(device), []

    def timed(self, phase: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = self.clock.mark()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((phase(*args) if callable(phase) else phase, start, self.clock.mark()))

        return call

    def totals(self) -> Counter[str]:
        """Seconds per phase of the step just run."""
        totals: Counter[str] = Counter()
        seconds = span_seconds(self.clock, [(start, end) for _, start, end in self.spans])
        for (phase, _, _), (start, end) in zip(self.spans, seconds):
            totals[phase] += end - start
        return totals


def _time_exposed(stats: Any, clock: _PhaseClock) -> None:
    """Time every exchange wait on the step's clock, charged to the kind of our action it falls
    in (a relay's helper thread waits inside its pair): on a GPU the wait only makes the compute
    stream wait, so the exposed time is that stream's stall, not the host's time in the call."""
    stats.wait_until = clock.timed(lambda *_: f"{EXPOSED}:{_wait_kind(clock.action_kind)}", stats.wait_until)


def _action_kind(action: Any) -> str | None:
    """The ACTION_KINDS entry of one of our actions (a lone pair's own)."""
    return LONE_PAIR if is_lone_pair(action) else ACTION_KINDS.get(action.computation_type.name)


def _wait_kind(action_kind: str | None) -> str:
    """What an exchange wait is charged to: the action kind, and in a relayed pair the half that
    waits (``pair F``: the forward half waits for its exchange while the backward half's segment
    ran; ``pair B``: the other way round)."""
    if action_kind is None:
        return OUTSIDE
    half = running_half() if action_kind == PAIR else None
    return f"{PAIR} {half[0].upper()}" if half else action_kind


def _record_step(record: _Record, totals: Counter[str]) -> None:
    """The step's time, its exposed exchange time (in all and by action kind) and its phases
    (``other``: the rest of the step)."""
    step = totals.pop(STEP)
    record.step_s.append(step)
    exposed = {key.split(":", 1)[1]: totals.pop(key) for key in list(totals) if key.startswith(EXPOSED + ":")}
    record.exposed_s.append(sum(exposed.values()))
    record.exposed_by_action.append(exposed)
    phases = dict(totals)
    phases["other"] = step - sum(phases.get(k, 0.0) for k in ("schedule", "clip", "optimizer"))
    record.phases.append(phases)


def _device(trainer: Any) -> Any:
    """Where the trainer computes (torchtitan's ``Trainer.device``)."""
    device = getattr(trainer, "device", None)
    return device if device is not None else next(trainer.model_parts[0].parameters()).device


def _time_phases(trainer: Any, clock: _PhaseClock) -> None:
    """Wrap what a train step runs: the pipeline step (and our executor's actions, DualPipe's
    twin exchange inside it), gradient clipping and the optimizer step."""
    from torchtitan.distributed import utils as dist_utils

    from ..runtime.executor import StepExecutor
    from ..runtime.schedules import ScheduleDualPipe

    schedule = getattr(trainer, "pp_schedule", None)  # None: a run without pipeline parallelism
    if schedule is not None:
        schedule.step = clock.timed("schedule", schedule.step)
    trainer.optimizers.step = clock.timed("optimizer", trainer.optimizers.step)
    dist_utils.clip_grad_norm_ = clock.timed("clip", dist_utils.clip_grad_norm_)
    perform = StepExecutor._perform

    def perform_noting_kind(self: Any, action: Any) -> None:
        previous, clock.action_kind = clock.action_kind, _action_kind(action)
        try:
            perform(self, action)
        finally:
            clock.action_kind = previous

    StepExecutor._perform = clock.timed(lambda _self, action: ACTION_PHASES.get(action.computation_type.name, "p2p"),
                                        perform_noting_kind)
    ScheduleDualPipe._after_step = clock.timed("twin_sum", ScheduleDualPipe._after_step)


def _peak_memory_bytes() -> int:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _token_exchange_rows(trainer: Any) -> int | None:
    """Rows a whole microbatch's token exchange sends from one rank: its tokens times the
    router's top-k (torchtitan's routers name it ``top_k`` in both releases); None without MoE."""
    config = GEN.trainer_config(trainer)
    top_k = next((m.top_k for part in trainer.model_parts for m in part.modules()
                  if isinstance(getattr(m, "top_k", None), int)), None)
    if top_k is None:
        return None
    return config.parallelism.pipeline_parallel_microbatch_size * config.training.seq_len * top_k


def _tokens_per_step(trainer: Any) -> int:
    """Tokens one optimizer step trains on, all data-parallel replicas together."""
    config = GEN.trainer_config(trainer)
    dims = trainer.parallel_dims
    return config.training.local_batch_size * config.training.seq_len * dims.dp_replicate * dims.dp_shard


def install(out_dir: str, exchange_s: float, calibrate: bool) -> None:
    import torch
    import torch.distributed as dist

    from ..overlap.comm import emulate_relayed_exchanges
    from . import expert_overlap
    from .expert_chunks import exchange_chunks_option
    from .trainer_hooks import trainer_classes

    if exchange_s > 0 and torch.cuda.is_available():
        raise ValueError(f"the emulated network ({EXCHANGE_S_ENV}={exchange_s}) is for CPU runs: on GPUs the "
                         "exchanges cross the real network; run the bench with --comm-ratio 0")
    expert_overlap.install()
    cost = emulate_relayed_exchanges(exchange_s)  # exchange_s is a number: always a cost
    cost.count_hand_over = os.environ.get(COUNT_HAND_OVER_ENV, "0") == "1"
    record, clock = _Record(), _PhaseClock()
    _time_exposed(cost.stats, clock)
    # The floor times segments with the host's clock: CPU runs only. Its model has one exchange in flight
    # per half: runs that post a cut exchange's chunks at once get no floor (as in bench overlap).
    floored = not torch.cuda.is_available() and exchange_chunks_option() == 1
    recorder: ExposureRecorder | None = start_recording() if floored else None

    for trainer_class in trainer_classes():
        original_step, original_close = trainer_class.train_step, trainer_class.close

        def train_step(self: Any, *args: Any, _original: Any = original_step, **kwargs: Any) -> Any:
            if not record.step_s:
                cost.reference_rows = _token_exchange_rows(self)
                _time_phases(self, clock)
                if calibrate:
                    _time_blocks(self.model_parts, record)
            clock.start_step(_device(self))
            if recorder is not None:
                recorder.take()  # nothing between steps is a step's
            result = clock.timed(STEP, _original)(self, *args, **kwargs)
            if recorder is not None:
                record.traces.append(recorder.take())
            _record_step(record, clock.totals())
            record.tokens_per_step = _tokens_per_step(self)
            return result

        def close(self: Any, _original: Any = original_close) -> None:
            out = {**vars(record), "peak_memory_bytes": _peak_memory_bytes(), "exchanges": cost.stats.posted}
            out.pop("traces")
            out.update(_floors(record.traces) if recorder is not None else {})
            Path(out_dir, f"bench_rank{dist.get_rank()}.json").write_text(json.dumps(out))
            _original(self)

        trainer_class.train_step, trainer_class.close = train_step, close


def install_from_env() -> None:
    out_dir = os.environ.get(BENCH_DIR_ENV)
    if out_dir:
        install(out_dir, float(os.environ.get(EXCHANGE_S_ENV, "0")), bool(os.environ.get(CALIBRATE_ENV)))
