"""``titan-dualpipe profile``: measure a real run, draw it, and feed its costs to the simulator.

Runs our schedule on ``pp`` local CPU processes with a TinyLM stage module and
``record_timeline=True``, then from the last step's per-action times:
- draws the measured timeline (``-o``) and writes it as a Perfetto trace (``--trace``);
- takes the median time of each action kind (F, B, I, W, an overlapped pair) as costs and
  simulates the same order with them, so predicted and measured step time can be compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from ..orders import Placement, canonical_name, placement
from .costs import Costs
from .engine import simulate
from .schedules import pipeline_for
from .timeline import TimedAction, action_kind, draw_timeline, write_trace


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("profile", help="time a real CPU run per action; draw it; simulate with its costs")
    p.add_argument("--schedule", default="DualPipeV", help="DualPipeV or DualPipe")
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks = local processes (default 2)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="steps run; the last one is measured (default 3)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--no-overlap", action="store_true", help="run pairs sequentially")
    p.add_argument("-o", "--output", help="picture of the measured timeline (png/svg/pdf; needs matplotlib)")
    p.add_argument("--trace", help="Chrome/Perfetto trace of the measured timeline")
    p.add_argument("--json", action="store_true", help="print costs and times as JSON")
    p.set_defaults(func=run)


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
    for _ in range(cfg["steps"]):
        dist.barrier()
        start = time.perf_counter()
        schedule.step(x, target=x) if feeds else schedule.step()
        step_time = time.perf_counter() - start
    times = [0.0] * place.pp_size
    dist.all_gather_object(times, step_time)
    return {"timeline": schedule.collect_timeline(), "step_time": max(times)}


def costs_from(timeline: list[TimedAction], place: Placement) -> Costs:
    """Median duration of each action kind; a missing kind is derived from the others.

    Split backwards on a chain's first stage are left out: there the I has no input
    gradient to compute and the W runs the whole backward.
    """
    by_kind: dict[str, list[float]] = defaultdict(list)
    for event in timeline:
        kind = action_kind(event.action)
        if kind in ("I", "W") and place.is_first(event.action.stage_index):
            continue
        by_kind[kind].append(event.end - event.start)
    median = {kind: statistics.median(d) for kind, d in by_kind.items()}
    w = median.get("W", 0.0)
    b = median.get("B", median.get("I", 0.0) + w)
    f = median["F"]
    return Costs(F=f, B=max(b, w), W=w, FB=median.get("F&B"))


def run(args: argparse.Namespace) -> int:
    from ..bench.spawn import run_on_processes

    schedule = canonical_name(args.schedule)
    placement(schedule, args.pp, args.microbatches)  # ValueError before spawning
    cfg = {"schedule": schedule, "pp": args.pp, "microbatches": args.microbatches, "steps": max(1, args.steps),
           "dim": args.dim, "layers": args.layers, "seq": args.seq, "overlap": not args.no_overlap}
    measured = run_on_processes(_measure, args.pp, cfg)
    timeline = measured["timeline"]
    costs = costs_from(timeline, placement(schedule, args.pp, args.microbatches))
    predicted = simulate(pipeline_for(schedule, args.pp, args.microbatches), costs).makespan
    if args.output:
        place = placement(schedule, args.pp, args.microbatches)
        direction_of = place.chain_of if place.bidirectional else (lambda stage: int(stage >= place.pp_size))
        draw_timeline(timeline, args.output, title=f"{schedule} pp={args.pp} n={args.microbatches}, measured",
                      direction_of=direction_of, time_label="seconds")
    if args.trace:
        write_trace(timeline, args.trace, us_per_unit=1e6)
    result = {"costs_s": costs.as_dict(), "measured_step_s": measured["step_time"], "simulated_step_s": predicted}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"measured costs (s): {costs}")
        print(f"step time: measured {measured['step_time']:.4f} s, simulated with these costs {predicted:.4f} s")
    return 0
