"""``titan-dualpipe profile``: measure a real run, draw it, and feed its costs to the simulator.

Runs our schedule on ``pp`` local CPU processes (TinyLM stages; our MoE module with ``--moe``)
with ``record_timeline=True``. From the last step's per-action times it draws the measured
timeline, simulates the same order with each action kind's median time as its cost (predicted
against measured step time), and sets each rank's measured peak activation memory
(:class:`~titan_dualpipe.sim.memory.ActivationMeter`) next to the simulator's prediction and
torch's own liveness analysis. ``--ac``, ``--compile`` and ``--two-batch`` change the stages and
what the costs mean; ``--moe`` also sets each rank's exposed exchange time next to its floor.
What each option does and prints: docs/simulate.md#profile; the output's JSON keys:
benchmarks/README.md#profile.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Collection
from dataclasses import replace

import torch
import torch.distributed as dist

from ..cli import HelpFormatter
from ..exposure.floor import floor
from ..exposure.record import ExposureRecorder, StepTrace, pair_exposure, start_recording, step_exposure, stop_recording
from ..orders import Placement, canonical_name, placement
from .costs import Costs
from .._compat.pipelining import F
from ..orders.dataflow import Chains
from .engine import peak_activations, simulate
from .memory import ActivationMeter, order_activation_counts, peak_activation_bytes
from .schedules import pipeline_for
from .timeline import TimedAction, action_kind, draw_timeline, write_trace
from .sub_batch_costs import freed_at_input, runs_backward, sub_batch_actions
from ..testing.model import AC_MODES

COMPILE_BACKENDS = ("inductor", "aot_eager")
COMPUTE_KINDS = ("F", "B", "I", "W", "F&B")  # as action_kind names them
ROWS_PER_MICROBATCH = 4  # batch rows per microbatch: two-batch overlap needs 2 or more to split


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("profile", help="time a real CPU run per action; draw it; simulate with its costs",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--schedule", default="DualPipeV", help="DualPipeV or DualPipe")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks = local processes")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    p.add_argument("--steps", type=int, default=3, help="steps run; the last one is measured")
    p.add_argument("--dim", type=int, default=128, help="TinyLM model width")
    p.add_argument("--layers", type=int, default=8, help="TinyLM blocks, split over the stages")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--no-overlap", action="store_true", help="run pairs sequentially")
    p.add_argument("--two-batch", action="store_true",
                   help="two_batch_overlap='all': lone forwards and their lone backwards on two sub-batches of the "
                        "microbatch; their medians are the costs F2 and B2, simulated with two-batch overlap")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every block in place first (backward whole at I, W a no-op: W=0)")
    p.add_argument("--compile-backend", help=f"with --compile: {' or '.join(COMPILE_BACKENDS)} (default inductor)")
    p.add_argument("--ac", default="none", help=f"activation checkpointing of every block: {', '.join(AC_MODES)}")
    p.add_argument("--moe", action="store_true",
                   help="our MoE module instead of TinyLM, its exchanges emulated: exposure against its floor")
    p.add_argument("--comm-ratio", type=float, default=1.0,
                   help="with --moe: a block's four exchanges cost this times its forward+backward")
    p.add_argument("-o", "--output", help="picture of the measured timeline (png/svg/pdf; needs matplotlib)")
    p.add_argument("--trace", help="Chrome/Perfetto trace of the measured timeline")
    p.add_argument("--json", action="store_true", help="print costs and times as JSON")
    p.set_defaults(func=run)


def _deferring_copy(module: torch.nn.Module):
    """A copy of a stage module with its weight GEMMs deferred into a queue of its own: (copy, queue)."""
    from ..weights.install import install
    from ..weights.queue import WeightGradQueue

    module, queue = copy.deepcopy(module), WeightGradQueue()
    install(module, queue)
    return module, queue


def _deferred_input_backward(module, queue, stage, place: Placement, rows: int, cfg: dict) -> float:
    """One microbatch's forward on ``module`` (a non-first stage's) and its backward as an I: the
    weight GEMMs wait in ``queue`` under the key ``(stage, 0)``. Returns when the backward began
    (``time.perf_counter()``)."""
    from ..testing.model import lm_loss

    with queue.deferring():
        out = module(torch.randn(rows, cfg["seq"], cfg["dim"], requires_grad=True))
    if place.is_last(stage.stage_index):
        roots, grads = [lm_loss(out, torch.zeros(rows, cfg["seq"], dtype=torch.long))], None
    else:
        roots, grads = [out], [torch.ones_like(out)]
    start = time.perf_counter()
    with queue.collecting((stage.stage_index, 0)):
        torch.autograd.backward(roots, grads)
    return start


def _split_backward_sample(stage, place: Placement, x_rows: int, cfg: dict, repeats: int = 5,
                           module: torch.nn.Module | None = None) -> tuple[float, float]:
    """Median seconds of an eager split backward as the runtime runs it by default (I with the
    weight GEMMs deferred, W running them) of one microbatch on a copy of ``stage``'s module, a
    stage that is not its chain's first (there the weight part is the whole backward); on a copy
    of ``module`` if given (an uncompiled copy of a compiled stage's module)."""
    module, queue = _deferring_copy(stage.submod if module is None else module)
    samples = []
    for _ in range(repeats):
        start = _deferred_input_backward(module, queue, stage, place, x_rows, cfg)
        middle = time.perf_counter()
        queue.run((stage.stage_index, 0))
        samples.append((middle - start, time.perf_counter() - middle))
        module.zero_grad(set_to_none=True)
    return statistics.median(i for i, _ in samples), statistics.median(w for _, w in samples)


def _measure(cfg: dict) -> dict:
    """Runs on every rank; rank 0 returns the measured timeline and step time."""
    from torch.distributed.pipelining import PipelineStage

    from .. import ScheduleDualPipe, ScheduleDualPipeV
    from ..cut import cut_layers
    from ..testing.model import TinyLM, checkpoint_block, compile_blocks, lm_loss

    rank = dist.get_rank()
    place = placement(cfg["schedule"], cfg["pp"], cfg["microbatches"])
    torch.manual_seed(0)
    n_parts = place.num_stages if not place.bidirectional else place.pp_size
    comm = None
    if cfg.get("moe"):
        parts, comm = _moe_parts(cfg, n_parts)
    else:
        parts = cut_layers(TinyLM(vocab=512, dim=cfg["dim"], layers=cfg["layers"], heads=4), n_parts)
        for part in parts:
            for block in part.layers.values():
                checkpoint_block(block, cfg["ac"])
    eager_parts = copy.deepcopy(parts) if cfg["compile"] else parts
    if cfg["compile"]:
        for part in parts:
            compile_blocks(part.layers.values(), cfg["compile"])
    stages = [PipelineStage(parts[place.model_part(s)], s, place.num_stages, torch.device("cpu"))
              for s in place.stages_of(rank)]
    cls = ScheduleDualPipe if place.bidirectional else ScheduleDualPipeV
    schedule = cls(stages, place.n_microbatches, loss_fn=lm_loss, record_timeline=True, overlap=cfg["overlap"],
                   two_batch_overlap="all" if cfg["two_batch"] else False)
    rows = ROWS_PER_MICROBATCH
    x = torch.randint(0, 512, (rows * place.n_microbatches, cfg["seq"]))
    feeds = place.feeds_batch(rank)
    meter = ActivationMeter(p for s in stages for p in s.submod.parameters())
    sub_batch_calls = [0]
    hooks = _count_sub_batches(stages, rows, sub_batch_calls) if cfg["two_batch"] else []
    record: ExposureRecorder | None = None
    if comm is not None:
        comm.network = _emulated_network(parts[place.model_part(stages[0].stage_index)], cfg)
        record = start_recording()
    for step in range(cfg["steps"]):
        sub_batch_calls[0] = 0  # the last step's count stays
        dist.barrier()
        start = time.perf_counter()
        measured = step == cfg["steps"] - 1
        if record is not None:
            record.take()  # the measured step's pairs and exchanges only
        schedule.weight_policy.queue.on_hold = meter.hold if measured else None  # deferred GEMMs' operands: live until W
        with meter if measured else contextlib.nullcontext():
            schedule.step(x, target=x) if feeds else schedule.step()
        step_time = time.perf_counter() - start
    exposure: list = [None] * place.pp_size
    if record is not None:
        stop_recording()
        dist.all_gather_object(exposure, _rank_exposure(record.take(), schedule.timeline, start, comm))
    schedule.weight_policy.queue.on_hold = None
    for hook in hooks:
        hook.remove()
    times = [0.0] * place.pp_size
    dist.all_gather_object(times, step_time)
    in_sub_batches: list = [0] * place.pp_size
    dist.all_gather_object(in_sub_batches, sub_batch_calls[0] // 2)
    timeline = schedule.collect_timeline()
    probe = next(s for s in stages if not place.is_first(s.stage_index))
    split: list = [None] * place.pp_size
    eager_probe = eager_parts[place.model_part(probe.stage_index)]
    dist.all_gather_object(split, _split_backward_sample(probe, place, rows, cfg, module=eager_probe))
    memory: list = [None] * place.pp_size
    dist.all_gather_object(memory, (meter.peak, {s.stage_index: _stage_activation_bytes(s, place, rows, cfg)
                                                 for s in stages},
                                    {s.stage_index: _stage_held_bytes(s, place, rows, cfg) for s in stages
                                     if s.stage_index in schedule.weight_policy.deferred_stages and not place.is_first(s.stage_index)}))
    calls: list = [None] * place.pp_size
    if cfg["compile"]:  # one more step, under the profiler: compiled backward calls per action kind
        step = (lambda: schedule.step(x, target=x)) if feeds else schedule.step
        dist.all_gather_object(calls, compiled_backward_calls_per_kind(schedule, place, rank, step))
    return {"timeline": timeline, "step_time": max(times), "split_backward": split, "memory": memory,
            "order": schedule.pipeline_order, "compiled_backward_calls": calls, "forwards_in_sub_batches": sum(in_sub_batches),
            "exposure": exposure if record is not None else None}


def _moe_parts(cfg: dict, n_parts: int) -> tuple[list[torch.nn.Module], object]:
    """Our MoE module's pipeline parts on one expert-parallel rank, and the communicator they
    share (no network yet: :func:`_emulated_network` sets it)."""
    from ..overlap.comm import ExpertParallelComm
    from ..cut import cut_layers
    from ..overlap.moe import MoEArgs, MoETransformer, expert_parallel

    args = MoEArgs(vocab_size=512, dim=cfg["dim"], n_layers=cfg["layers"], n_heads=4, num_experts=4, top_k=2,
                   moe_inter_dim=2 * cfg["dim"])
    checkpointing = {"none": False, "full": True, "selective": "selective"}[cfg["ac"]]
    parts = cut_layers(MoETransformer(args, activation_checkpoint=checkpointing), n_parts)
    comm = ExpertParallelComm(None)  # one rank: the data stays, an emulated network's time passes
    for part in parts:
        expert_parallel(part, comm)
    return parts, comm


def _emulated_network(part: torch.nn.Module, cfg: dict):
    """Each exchange's cost: ``comm_ratio`` times a quarter of a block's forward and backward
    (median of a few on this rank, median over the ranks, all timing at once)."""
    from ..overlap.comm import EmulatedNetwork

    block = next(iter(part.layers.values()))
    h = torch.randn(ROWS_PER_MICROBATCH, cfg["seq"], cfg["dim"], requires_grad=True)
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        block(h).sum().backward()
        samples.append(time.perf_counter() - start)
    part.zero_grad(set_to_none=True)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, statistics.median(samples[2:]))
    return EmulatedNetwork(latency_s=cfg["comm_ratio"] * statistics.median(ranks) / 4)


def _rank_exposure(step: StepTrace, actions: list[TimedAction], step_start: float, comm) -> dict:
    """This rank's exposure in the measured step (:func:`~titan_dualpipe.exposure.record.step_exposure`,
    each pair's) and what the picture draws of it: the measured waits and the floor's idle times,
    as ``(start, end, kind)`` on the timeline's clock. The clock's zero is found from the pairs,
    which start with their OVERLAP_F_B actions (else the step's start)."""
    pair_starts = sorted(a.start for a in actions if action_kind(a.action) == "F&B")
    offset = step_start
    if step.pairs and pair_starts:  # the recorder's clock minus the timeline's, from the closest pair action
        offset = statistics.median(p.start - min(pair_starts, key=lambda s: abs(p.start - offset - s))
                                   for p in step.pairs)
    marks = []
    for pair in step.pairs:
        marks += [(a - offset, b - offset, "exposed") for half in pair.waits for a, b in half]
        halves = [h for h in pair.halves if h]
        placed = floor(halves).placed if halves else ()
        marks += [(pair.start - offset + p.start - p.idle, pair.start - offset + p.start, "floor")
                  for p in placed if p.idle > 0]
    marks += [(a - offset, b - offset, "exposed") for a, b in step.lone_waits]
    if len(step.lone_waits) == len(step.lone):  # each lone exchange ends at its wait: its floor, from the wait's start
        alone = [(a, s.exchange.seconds - min(s.exchange.lead, s.compute)) for (a, _), s in zip(step.lone_waits, step.lone)]
        marks += [(a - offset, a - offset + exposed, "floor") for a, exposed in alone if exposed > 0]
    return {"exposure": step_exposure(step), "pairs": [vars(pair_exposure(p)) for p in step.pairs],
            "marks": marks, "exchange_s": comm.network.seconds(0)}


def _count_sub_batches(stages, rows: int, calls: list[int]) -> list:
    """Hooks adding to ``calls[0]`` each forward call of a stage's first block on fewer than
    ``rows`` rows: a forward the runtime ran as two sub-batches makes two."""
    def count(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        # the MoE module calls a block once per segment: its first (attention) takes the rows
        if args and args[0].shape[0] < rows and kwargs.get("segment") in (None, "attention"):
            calls[0] += 1

    firsts = {id(block): block for block in (next(iter(s.submod.layers.values())) for s in stages)}
    return [block.register_forward_pre_hook(count, with_kwargs=True) for block in firsts.values()]


def compiled_backward_calls_per_kind(schedule, place: Placement, rank: int, step) -> dict[str, int]:
    """Compiled backward calls ``step()`` ran on this rank, by the kind of action they ran in, as
    :func:`costs_from` counts kinds: a chain-first stage's W is its full backward (``B``), its I
    nothing."""
    from .._compat.pipelining import _get_profiler_function_name
    from ..testing.compiled_calls import compiled_backwards_by_range

    actions = {_get_profiler_function_name(a): a for a in schedule.pipeline_order_with_comms[rank] if a is not None}
    counts: dict[str, int] = dict.fromkeys(COMPUTE_KINDS, 0)
    for name, n in compiled_backwards_by_range(step).items():
        action = actions.get(name)
        kind = action_kind(action) if action is not None else "outside actions"
        if kind in ("I", "W") and place.is_first(action.stage_index):
            kind = "B" if kind == "W" else "I on a chain-first stage"
        if n or kind in COMPUTE_KINDS:
            counts[kind] = counts.get(kind, 0) + n
    return dict(counts)


def _stage_activation_bytes(stage, place: Placement, rows: int, cfg: dict) -> int:
    """Bytes one microbatch's forward on ``stage`` keeps for its backward (loss included on a last stage)."""
    from ..testing.model import lm_loss

    module = stage.submod
    if place.is_first(stage.stage_index):
        x = torch.randint(0, 512, (rows, cfg["seq"]))
    else:
        x = torch.randn(rows, cfg["seq"], cfg["dim"], requires_grad=True)
    with ActivationMeter(module.parameters()) as meter:
        out = module(x)
        if place.is_last(stage.stage_index):
            out = lm_loss(out, torch.zeros(rows, cfg["seq"], dtype=torch.long))
        held = meter.live
    del out
    return held


def _stage_held_bytes(stage, place: Placement, rows: int, cfg: dict) -> int:
    """Bytes one microbatch's deferred weight GEMMs hold from its I to its W on ``stage`` (a
    stage that defers and is not its chain's first), on a copy of its module."""
    module, queue = _deferring_copy(stage.submod)
    with ActivationMeter(module.parameters()) as meter:
        queue.on_hold = meter.hold
        _deferred_input_backward(module, queue, stage, place, rows, cfg)
        held = meter.live  # the graph is gone: what the queue holds
        queue.clear()
    return held


def activation_memory(measured: dict, freed: Collection[tuple[int, int]] = ()) -> dict:
    """Per rank: the measured peak of saved activations (and of deferred weight GEMMs' operands)
    and the simulator's prediction (its live-activation rule over the order, each
    stage-microbatch weighing its measured bytes, and from I to W on a deferring stage the
    bytes its GEMMs hold; ``freed``: the ``(stage, microbatch)`` whose backward runs whole at
    I, freed there)."""
    per_stage = {s: b for _, stages, _ in measured["memory"] for s, b in stages.items()}
    held = {s: b for _, _, stages in measured["memory"] for s, b in stages.items()}
    order = measured["order"]
    measured_peak = [peak for peak, _, _ in measured["memory"]]
    simulated = [peak_activation_bytes(order[rank], per_stage, freed, held) for rank in range(len(measured_peak))]
    counts = [peak_activations([a for a in order[rank] if a is not None], freed) for rank in range(len(measured_peak))]
    return {"measured_peak_bytes": measured_peak, "simulated_peak_bytes": simulated,
            "simulated_peak_stage_microbatches": counts,
            "bytes_per_stage_microbatch": dict(sorted(per_stage.items())),
            "held_bytes_per_stage_microbatch": dict(sorted(held.items())),
            "measured_over_simulated": [m / s if s else None for m, s in zip(measured_peak, simulated)]}


def _liveness(counts: dict[int, tuple[int, int | None]]) -> dict:
    """Per rank, ours and torch's count of live stage-microbatches (torch's None before 2.15)."""
    ours = [o for o, _ in counts.values()]
    theirs = [t for _, t in counts.values()]
    return {"ours": ours, "torch": None if None in theirs else theirs}


def costs_from(timeline: list[TimedAction], place: Chains,
               split_samples: list[tuple[float, float]] | None = None, whole_stages: Collection[int] = ()) -> Costs:
    """Median duration of each action kind; a missing kind is derived from the others.

    Actions marked ``sub_batches`` (two-batch overlap) give ``F2`` (forwards) and ``B2`` (the B, I
    or chain-first W that ran the whole backward; the other of I and W is left out); where no
    action of a kind ran whole, the sub-batches' cost stands in for it (F = F2, B = B2).

    On a chain's first stage torch's split backward has no input gradient to compute, so its I
    takes nothing and its W runs the whole backward: those count as full backwards. On
    ``whole_stages`` (stages whose backward runs whole at I, e.g. torch.compile'd ones) the I is
    the full backward and the W a no-op: the I count as full backwards, the W not at all. W then
    comes from the other stages' W actions, or, where the schedule splits backwards on first
    stages only (DualPipe at pp=2), from ``split_samples`` (each rank's (input, weight) seconds
    of a split backward on a non-first stage) as their weight share of the measured B; with
    neither, ``W = 0`` (``I = B``).
    """
    by_kind: dict[str, list[float]] = defaultdict(list)
    for event in timeline:
        kind = _sample_kind(event, place, whole_stages)
        if kind is not None:
            by_kind[kind].append(event.end - event.start)
    median = {kind: statistics.median(d) for kind, d in by_kind.items()}
    f2, b2 = median.get("F2"), median.get("B2")
    parts = median.get("I", 0.0) + median.get("W", 0.0)
    b = median.get("B", parts if parts or b2 is None else b2)  # whole B, else I + W, else the sub-batches' B2
    w = median.get("W")
    if w is None:
        shares = [weight / (inp + weight) for inp, weight in split_samples or [] if inp + weight > 0]
        w = b * statistics.median(shares) if shares else 0.0
    return Costs(F=median.get("F", f2), B=max(b, w), W=w, FB=median.get("F&B"), F2=f2, B2=b2)


def _sample_kind(event: TimedAction, place: Chains, whole_stages: Collection[int]) -> str | None:
    """Which cost ``event``'s duration samples (see :func:`costs_from`), or None for none."""
    kind = action_kind(event.action)
    stage = event.action.stage_index
    if event.sub_batches:
        if kind == "F":
            return "F2"
        return "B2" if runs_backward(event.action, place) else None
    if kind in ("I", "W") and (place.is_first(stage) or stage in whole_stages):
        full = "W" if place.is_first(stage) else "I"  # the action that ran the whole backward
        return "B" if kind == full else None
    return kind


def _config(args: argparse.Namespace) -> dict:
    """The workers' config from the command line; ValueError naming a bad option and its fix."""
    schedule = canonical_name(args.schedule)
    place = placement(schedule, args.pp, args.microbatches)  # ValueError before spawning
    parts = place.pp_size if place.bidirectional else place.num_stages
    if args.layers < parts:
        raise ValueError(f"--layers {args.layers}: {schedule} at --pp {args.pp} cuts the model into {parts} parts; "
                         f"give --layers {parts} or more")
    if args.two_batch and args.no_overlap:
        raise ValueError("--two-batch runs sub-batches as a relay, which needs overlap: drop --no-overlap (or --two-batch)")
    if args.compile_backend is not None and not args.compile:
        raise ValueError(f"--compile-backend {args.compile_backend}: add --compile (or drop --compile-backend)")
    if args.ac not in AC_MODES:
        raise ValueError(f"--ac {args.ac!r}: give one of {', '.join(AC_MODES)}")
    if not args.comm_ratio >= 0:
        raise ValueError(f"--comm-ratio must be >= 0, got {args.comm_ratio}")
    backend = args.compile_backend or COMPILE_BACKENDS[0]
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"--compile-backend {backend!r}: give one of {', '.join(COMPILE_BACKENDS)}")
    return {"schedule": schedule, "pp": args.pp, "microbatches": args.microbatches, "steps": max(1, args.steps),
            "dim": args.dim, "layers": args.layers, "seq": args.seq, "overlap": not args.no_overlap,
            "two_batch": args.two_batch, "ac": args.ac,
            "compile": backend if args.compile else None, "moe": args.moe, "comm_ratio": args.comm_ratio}


def compiled_summary(measured: dict, place: Placement, pipe, costs: Costs) -> dict:
    """What compiling does to the costs and the bubble: the measured I and W actions of non-first
    stages (a full backward, a no-op), the compiled backward calls per action kind over all ranks,
    and the simulation with ``W = 0`` next to one with the eager split's weight share of ``B``."""
    durations: dict[str, list[float]] = defaultdict(list)
    for event in measured["timeline"]:
        kind = action_kind(event.action)
        if kind in ("I", "W") and not place.is_first(event.action.stage_index):
            durations[kind].append(event.end - event.start)
    calls: dict[str, int] = defaultdict(int)
    for rank_calls in measured["compiled_backward_calls"]:
        for kind, n in rank_calls.items():
            calls[kind] += n
    shares = [w / (i + w) for i, w in measured["split_backward"] if i + w > 0]
    eager = replace(costs, W=costs.B * statistics.median(shares)) if shares else costs
    eager_run = simulate(pipe, eager, two_batch=measured["two_batch"])
    return {"backend": measured["backend"], "W": costs.W,
            "measured_action_s": {kind: statistics.median(d) for kind, d in sorted(durations.items())},
            "compiled_backward_calls": dict(sorted(calls.items())),
            "eager_split": {"weight_share": eager.W / eager.B, "costs_s": eager.as_dict(),
                            "simulated_step_s": eager_run.makespan, "simulated_bubble_ratio": eager_run.bubble_ratio}}


def _print_compiled(result: dict) -> None:
    compiled, eager = result["compiled"], result["compiled"]["eager_split"]
    actions = compiled["measured_action_s"]
    print(f"compiled blocks ({compiled['backend']}): every stage's backward runs whole at I and its W is a no-op, "
          f"so the simulation takes I=B, W={compiled['W']:g}")
    if actions:
        print("  measured on non-first stages: " + ", ".join(f"{k} {v:.6f} s" for k, v in actions.items()))
    print("  compiled backward calls in one more step, by action kind: "
          + ", ".join(f"{k} {n}" for k, n in compiled["compiled_backward_calls"].items()))
    print(f"  simulated: W=0 step {result['simulated_step_s']:.4f} s, "
          f"bubble {result['simulated_bubble_ratio']:.1%}; "
          f"with the eager split (W={eager['costs_s']['W']:.4f} s, {eager['weight_share']:.0%} of B) "
          f"step {eager['simulated_step_s']:.4f} s, bubble {eager['simulated_bubble_ratio']:.1%}")


def _print_result(result: dict, costs: Costs) -> None:
    memory = result["activation_memory"]
    print(f"measured costs (s), AC {result['ac']}: {costs}"
          + (" (F2, B2: on two sub-batches; two-batch overlap)" if result["two_batch"] else ""))
    print(f"step time: measured {result['measured_step_s']:.4f} s, simulated with these costs "
          f"{result['simulated_step_s']:.4f} s (bubble {result['simulated_bubble_ratio']:.1%})")
    if "compiled" in result:
        _print_compiled(result)
    if "whole_at_input" in result:
        whole = result["whole_at_input"]
        print(f"  with each backward whole at I (W=0, the same costs): step {whole['simulated_step_s']:.4f} s, "
              f"bubble {whole['simulated_bubble_ratio']:.1%}")
    if "forwards_in_sub_batches" in result:
        counted = result["forwards_in_sub_batches"]
        print(f"two-batch overlap: {counted['measured']} forwards ran as two sub-batches "
              f"(the order's lone forwards: {counted['lone_in_order']})")
    print("activation memory, saved for backward (MiB); simulated: live stage-microbatches x their measured size")
    print(f"{'rank':>4}  {'measured peak':>13}  {'simulated':>9}  {'measured/simulated':>18}  {'live at peak':>12}")
    rows = zip(memory["measured_peak_bytes"], memory["simulated_peak_bytes"], memory["simulated_peak_stage_microbatches"])
    for rank, (m, p, count) in enumerate(rows):
        print(f"{rank:>4}  {m / 2**20:>13.2f}  {p / 2**20:>9.2f}  {m / p if p else float('nan'):>18.3f}  {count:>12}")
    print(_liveness_line(result["activation_liveness"]))
    if "exposure" in result:
        print(exposure_lines(result["exposure"], result["exchange_s"]))


def exposure_lines(per_rank: list[dict[str, float]], exchange_s: float) -> str:
    """Per rank: the measured step's exposed exchange time next to its floor and 1F1B's, ms."""
    lines = [f"exposed exchange time in the measured step, ms ({exchange_s * 1e3:.2f} ms per exchange): measured "
             "(late: of it, past the emulated arrival, a sleep woken late), floor (each pair's halves in the order "
             "that exposes least; lone halves: every exchange but what their own compute covers), 1F1B (every "
             "exchange exposed); in pairs: in order (the pair's segments in the order they ran)",
             f"{'rank':>4}{'measured':>10}{'late':>7}{'floor':>7}{'1F1B':>7}{'pairs: meas':>13}{'late':>7}"
             f"{'in order':>10}{'floor':>7}{'lone: meas':>12}{'late':>7}{'floor':>7}"]
    for rank, e in enumerate(per_rank):
        lines.append(f"{rank:>4}{e['measured'] * 1e3:>10.1f}{e['late'] * 1e3:>7.1f}{e['floor'] * 1e3:>7.1f}"
                     f"{e['serial'] * 1e3:>7.1f}{e['pairs_measured'] * 1e3:>13.1f}{e['pairs_late'] * 1e3:>7.1f}"
                     f"{e['pairs_in_order'] * 1e3:>10.1f}{e['pairs_floor'] * 1e3:>7.1f}"
                     f"{e['lone_measured'] * 1e3:>12.1f}{e['lone_late'] * 1e3:>7.1f}{e['lone_floor'] * 1e3:>7.1f}")
    return "\n".join(lines)


def _liveness_line(liveness: dict) -> str:
    """One line: per rank, our count of live stage-microbatches over the order and torch's."""
    ours, theirs = liveness["ours"], liveness["torch"]
    line = "live stage-microbatches at the order's peak, per rank: ours " + ", ".join(map(str, ours))
    if theirs is None:
        return line + "; torch's liveness: n/a before torch 2.15"
    differ = [rank for rank, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    return (line + "; torch's liveness analysis " + ", ".join(map(str, theirs))
            + (f" (differ at ranks {differ})" if differ else " (equal)"))


def run(args: argparse.Namespace) -> int:
    from ..testing.spawn import run_on_processes

    cfg = _config(args)
    schedule = cfg["schedule"]
    place = placement(schedule, args.pp, args.microbatches)
    measured = run_on_processes(_measure, args.pp, cfg)
    measured["backend"], measured["two_batch"] = cfg["compile"], cfg["two_batch"]
    split = sub_batch_actions(measured["order"]) if cfg["two_batch"] else frozenset()
    timeline = [e._replace(sub_batches=e.action in split) for e in measured["timeline"]]
    whole = range(place.num_stages) if cfg["compile"] else ()  # every stage holds compiled blocks
    costs = costs_from(timeline, place, None if cfg["compile"] else measured["split_backward"], whole_stages=whole)
    pipe = pipeline_for(schedule, args.pp, args.microbatches)
    simulated = simulate(pipe, costs, two_batch=cfg["two_batch"])
    exposure = measured["exposure"]
    if args.output:
        direction_of = place.chain_of if place.bidirectional else (lambda stage: int(stage >= place.pp_size))
        marks = None if exposure is None else [(rank, *mark) for rank, e in enumerate(exposure) for mark in e["marks"]]
        draw_timeline(timeline, args.output, title=f"{schedule} pp={args.pp} n={args.microbatches}, measured"
                      + (" (under each rank: exchanges exposed, measured and at the floor)" if marks else ""),
                      direction_of=direction_of, time_label="seconds", marks=marks)
    if args.trace:
        write_trace(timeline, args.trace, us_per_unit=1e6)
    result = {"costs_s": costs.as_dict(), "ac": cfg["ac"], "two_batch": cfg["two_batch"],
              "measured_step_s": measured["step_time"],
              "simulated_step_s": simulated.makespan, "simulated_bubble_ratio": simulated.bubble_ratio,
              "activation_memory": activation_memory(measured, freed_at_input(split, place)),
              "activation_liveness": _liveness(order_activation_counts(measured["order"], place))}
    if cfg["compile"]:
        result["compiled"] = compiled_summary(measured, place, pipe, costs)
    else:  # the same costs with each backward whole at I (W = 0): what deferring the weight GEMMs gains
        whole_run = simulate(pipe, replace(costs, W=0.0), two_batch=cfg["two_batch"])
        result["whole_at_input"] = {"simulated_step_s": whole_run.makespan,
                                    "simulated_bubble_ratio": whole_run.bubble_ratio}
    if cfg["two_batch"]:
        result["forwards_in_sub_batches"] = {"measured": measured["forwards_in_sub_batches"],
                                        "lone_in_order": sum(a.computation_type == F for a in split)}
    if exposure is not None:  # per rank: the measured step's exposure keys and each pair's, seconds
        result["exchange_s"] = exposure[0]["exchange_s"]
        result["exposure"] = [e["exposure"] for e in exposure]
        result["exposure_pairs"] = [e["pairs"] for e in exposure]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_result(result, costs)
        print(f"wrote {args.output}" if args.output
              else "no picture drawn: -o FILE (.png, .svg, .pdf) draws the measured timeline")
    return 0
