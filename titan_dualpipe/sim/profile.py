"""``titan-dualpipe profile``: measure a real run, draw it, and feed its costs to the simulator.

Runs our schedule on ``pp`` local CPU processes with a TinyLM stage module and
``record_timeline=True``, then from the last step's per-action times:
- draws the measured timeline (``-o``) and writes it as a Perfetto trace (``--trace``);
- takes the median time of each action kind (F, B, I, W, an overlapped pair) as costs and
  simulates the same order with them, so predicted and measured step time can be compared;
- measures each rank's peak activation memory (bytes autograd saved for backward,
  :class:`~titan_dualpipe.sim.memory.ActivationMeter`) over the last step and sets it next to
  the simulator's prediction: its live-activation count over the order, each stage-microbatch
  weighing what one forward of that stage saves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from ..cli import HelpFormatter
from ..orders import Placement, canonical_name, placement
from .costs import Costs
from .engine import peak_activations, simulate
from .memory import ActivationMeter, peak_activation_bytes
from .schedules import pipeline_for
from .timeline import TimedAction, action_kind, draw_timeline, write_trace


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
    p.add_argument("-o", "--output", help="picture of the measured timeline (png/svg/pdf; needs matplotlib)")
    p.add_argument("--trace", help="Chrome/Perfetto trace of the measured timeline")
    p.add_argument("--json", action="store_true", help="print costs and times as JSON")
    p.set_defaults(func=run)


def _split_backward_sample(stage, place: Placement, x_rows: int, cfg: dict, repeats: int = 5) -> tuple[float, float]:
    """Median seconds of torch's split backward (input part, weight part) of one microbatch on
    ``stage``, a stage that is not its chain's first (there the weight part is the whole backward)."""
    from .._compat import stage_backward_input, stage_backward_weight
    from ..bench.model import lm_loss

    module = stage.submod
    samples = []
    for _ in range(repeats):
        h = torch.randn(x_rows, cfg["seq"], cfg["dim"], requires_grad=True)
        out = module(h)
        if place.is_last(stage.stage_index):
            roots, grads = [lm_loss(out, torch.zeros(x_rows, cfg["seq"], dtype=torch.long))], None
        else:
            roots, grads = [out], [torch.ones_like(out)]
        start = time.perf_counter()
        _, groups = stage_backward_input(roots, grads, [h], module.parameters())
        middle = time.perf_counter()
        stage_backward_weight(module.parameters(), groups)
        samples.append((middle - start, time.perf_counter() - middle))
        module.zero_grad(set_to_none=True)
    return statistics.median(i for i, _ in samples), statistics.median(w for _, w in samples)


def _measure(cfg: dict) -> dict:
    """Runs on every rank; rank 0 returns the measured timeline and step time."""
    from torch.distributed.pipelining import PipelineStage

    from .. import ScheduleDualPipe, ScheduleDualPipeV
    from ..bench.model import TinyLM, lm_loss, split_model

    rank = dist.get_rank()
    place = placement(cfg["schedule"], cfg["pp"], cfg["microbatches"])
    torch.manual_seed(0)
    model = TinyLM(vocab=512, dim=cfg["dim"], layers=cfg["layers"], heads=4)
    parts = split_model(model, place.num_stages if not place.bidirectional else place.pp_size)
    stages = [PipelineStage(parts[place.model_part(s)], s, place.num_stages, torch.device("cpu"))
              for s in place.stages_of(rank)]
    cls = ScheduleDualPipe if place.bidirectional else ScheduleDualPipeV
    schedule = cls(stages, place.n_microbatches, loss_fn=lm_loss, record_timeline=True, overlap=cfg["overlap"])
    x = torch.randint(0, 512, (4 * place.n_microbatches, cfg["seq"]))
    feeds = place.feeds_batch(rank)
    meter = ActivationMeter(p for s in stages for p in s.submod.parameters())
    for step in range(cfg["steps"]):
        dist.barrier()
        start = time.perf_counter()
        with meter if step == cfg["steps"] - 1 else contextlib.nullcontext():  # the measured step
            schedule.step(x, target=x) if feeds else schedule.step()
        step_time = time.perf_counter() - start
    times = [0.0] * place.pp_size
    dist.all_gather_object(times, step_time)
    timeline = schedule.collect_timeline()
    probe = next(s for s in stages if not place.is_first(s.stage_index))
    split: list = [None] * place.pp_size
    dist.all_gather_object(split, _split_backward_sample(probe, place, 4, cfg))
    memory: list = [None] * place.pp_size
    dist.all_gather_object(memory, (meter.peak, {s.stage_index: _stage_activation_bytes(s, place, 4, cfg)
                                                 for s in stages}))
    return {"timeline": timeline, "step_time": max(times), "split_backward": split, "memory": memory,
            "order": schedule.pipeline_order}


def _stage_activation_bytes(stage, place: Placement, rows: int, cfg: dict) -> int:
    """Bytes one microbatch's forward on ``stage`` keeps for its backward (loss included on a last stage)."""
    from ..bench.model import lm_loss

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


def activation_memory(measured: dict) -> dict:
    """Per rank: the measured peak of saved activations and the simulator's prediction (its
    live-activation rule over the order, each stage-microbatch weighing its measured bytes)."""
    per_stage = {s: b for _, stages in measured["memory"] for s, b in stages.items()}
    order = measured["order"]
    measured_peak = [peak for peak, _ in measured["memory"]]
    simulated = [peak_activation_bytes(order[rank], per_stage) for rank in range(len(measured_peak))]
    counts = [peak_activations([a for a in order[rank] if a is not None]) for rank in range(len(measured_peak))]
    return {"measured_peak_bytes": measured_peak, "simulated_peak_bytes": simulated,
            "simulated_peak_stage_microbatches": counts,
            "bytes_per_stage_microbatch": dict(sorted(per_stage.items())),
            "measured_over_simulated": [m / s if s else None for m, s in zip(measured_peak, simulated)]}


def costs_from(timeline: list[TimedAction], place: Placement,
               split_samples: list[tuple[float, float]] | None = None) -> Costs:
    """Median duration of each action kind; a missing kind is derived from the others.

    On a chain's first stage torch's split backward has no input gradient to compute, so its I
    takes nothing and its W runs the whole backward: those count as full backwards. W then
    comes from the other stages' W actions, or, where the schedule splits backwards on first
    stages only (DualPipe at pp=2), from ``split_samples`` (each rank's (input, weight) seconds
    of a split backward on a non-first stage) as their weight share of the measured B.
    """
    by_kind: dict[str, list[float]] = defaultdict(list)
    for event in timeline:
        kind = action_kind(event.action)
        if kind in ("I", "W") and place.is_first(event.action.stage_index):
            if kind == "W":
                by_kind["B"].append(event.end - event.start)
            continue
        by_kind[kind].append(event.end - event.start)
    median = {kind: statistics.median(d) for kind, d in by_kind.items()}
    b = median.get("B", median.get("I", 0.0) + median.get("W", 0.0))
    w = median.get("W")
    if w is None:
        shares = [weight / (inp + weight) for inp, weight in split_samples or [] if inp + weight > 0]
        w = b * statistics.median(shares) if shares else 0.0
    return Costs(F=median["F"], B=max(b, w), W=w, FB=median.get("F&B"))


def run(args: argparse.Namespace) -> int:
    from ..bench.spawn import run_on_processes

    schedule = canonical_name(args.schedule)
    place = placement(schedule, args.pp, args.microbatches)  # ValueError before spawning
    parts = place.pp_size if place.bidirectional else place.num_stages
    if args.layers < parts:
        raise ValueError(f"--layers {args.layers}: {schedule} at --pp {args.pp} cuts the model into {parts} parts; "
                         f"give --layers {parts} or more")
    cfg = {"schedule": schedule, "pp": args.pp, "microbatches": args.microbatches, "steps": max(1, args.steps),
           "dim": args.dim, "layers": args.layers, "seq": args.seq, "overlap": not args.no_overlap}
    measured = run_on_processes(_measure, args.pp, cfg)
    timeline = measured["timeline"]
    costs = costs_from(timeline, placement(schedule, args.pp, args.microbatches), measured["split_backward"])
    predicted = simulate(pipeline_for(schedule, args.pp, args.microbatches), costs).makespan
    if args.output:
        place = placement(schedule, args.pp, args.microbatches)
        direction_of = place.chain_of if place.bidirectional else (lambda stage: int(stage >= place.pp_size))
        draw_timeline(timeline, args.output, title=f"{schedule} pp={args.pp} n={args.microbatches}, measured",
                      direction_of=direction_of, time_label="seconds")
    if args.trace:
        write_trace(timeline, args.trace, us_per_unit=1e6)
    memory = activation_memory(measured)
    result = {"costs_s": costs.as_dict(), "measured_step_s": measured["step_time"], "simulated_step_s": predicted,
              "activation_memory": memory}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"measured costs (s): {costs}")
        print(f"step time: measured {measured['step_time']:.4f} s, simulated with these costs {predicted:.4f} s")
        print("activation memory, saved for backward (MiB); simulated: live stage-microbatches x their measured size")
        print(f"{'rank':>4}  {'measured peak':>13}  {'simulated':>9}  {'measured/simulated':>18}  {'live at peak':>12}")
        rows = zip(memory["measured_peak_bytes"], memory["simulated_peak_bytes"], memory["simulated_peak_stage_microbatches"])
        for rank, (m, p, count) in enumerate(rows):
            print(f"{rank:>4}  {m / 2**20:>13.2f}  {p / 2**20:>9.2f}  {m / p if p else float('nan'):>18.3f}  {count:>12}")
    return 0
