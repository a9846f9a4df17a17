"""``titan-dualpipe simulate`` and ``titan-dualpipe draw``: cost-model runs of schedule orders."""

from __future__ import annotations

import argparse
import json
from typing import Callable, Sequence

from ..cli import HelpFormatter
from . import JSON_KEYS_HELP
from .costs import Costs, parse_costs
from .engine import SimResult, simulate
from .schedules import SCHEDULE_NAMES, TORCH_SCHEDULES, Pipeline, pipeline_for, pipeline_from_csv
from .timeline import draw_timeline, write_trace

DEFAULT_COSTS = "F=1,B=2,W=1"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    _add_simulate(subparsers)
    _add_draw(subparsers)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", help=f"one of {', '.join(SCHEDULE_NAMES)} (case-insensitive)")
    p.add_argument("--pp", type=int, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, help="microbatches per step")
    p.add_argument("--cost", default=DEFAULT_COSTS, type=_costs_argument,
                   help=f"per-action costs KEY=VALUE,... with F, B (full backward), W (weight part of B), "
                        f"I (input part of a split backward, default B - W; I=B,W=0: backwards run whole at I), "
                        f"FB (overlapped F+B pair, default F+B), F2 and B2 (a forward and a full backward on two "
                        f"sub-batches of the microbatch, with --two-batch; default F and B) (default {DEFAULT_COSTS})")
    p.add_argument("--two-batch", action="store_true",
                   help="two-batch overlap (DualPipe, DualPipeV): lone forwards and their lone backwards run on two "
                        "sub-batches of the microbatch, costing F2 and B2 (see --cost); a backward run whole at I makes "
                        "its W cost 0")
    p.add_argument("--p2p", type=float, default=0.0, help="latency added to each cross-rank hand-off (default 0)")
    p.add_argument("--csv", metavar="FILE", help="a torch-format CSV order (one row per rank) instead of --schedule")


def _costs_argument(text: str) -> Costs:
    try:
        return parse_costs(text)
    except ValueError as err:  # argparse would replace a ValueError's message with its own
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_simulate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="time a schedule's order with per-action costs: bubbles, makespan, peak activations",
        description="Event-driven simulation: every rank runs its actions in order; F waits for the\n"
                    "previous stage's F, B/I for the next stage's B/I, W for its I; an overlapped\n"
                    "F&B pair for the inputs of both halves.",
        epilog=JSON_KEYS_HELP,
        formatter_class=HelpFormatter,
    )
    _add_common(p)
    p.add_argument("--json", action="store_true", help="print JSON (keys below) instead of a table")
    p.add_argument("--compare", action="store_true",
                   help="one table of every schedule (and --csv) for the same --pp, --microbatches and costs; "
                        "costs are for a stage of 1/pp of the model and halved on schedules with 2*pp stages "
                        "in a chain, so every row does the same work; with --two-batch, DualPipe, DualPipeV "
                        "(and --csv) get a second row with two-batch overlap")
    p.set_defaults(func=run_simulate)


def _add_draw(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "draw", help="draw a simulated schedule (one row per rank) and/or write it as a Perfetto trace",
        formatter_class=HelpFormatter)
    _add_common(p)
    p.add_argument("-o", "--output", help="picture file (.png, .svg, .pdf); needs matplotlib")
    p.add_argument("--trace", metavar="FILE", help="also write a Chrome/Perfetto trace (JSON)")
    p.add_argument("--title", help="picture title (default: schedule, sizes and costs)")
    p.set_defaults(func=run_draw)


def _pipeline(args: argparse.Namespace) -> Pipeline:
    if args.csv:
        if args.schedule:
            raise ValueError("give either --schedule or --csv, not both.")
        return pipeline_from_csv(args.csv)
    _require(args, "--schedule", "--pp", "--microbatches")
    return pipeline_for(args.schedule, args.pp, args.microbatches)


def _require(args: argparse.Namespace, *flags: str) -> None:
    missing = [flag for flag in flags if getattr(args, flag.lstrip("-")) is None]
    if missing:
        raise ValueError(f"{args.command} needs {', '.join(missing)} (or --csv FILE for a saved order).")


def run_simulate(args: argparse.Namespace) -> int:
    if args.compare:
        return _run_compare(args)
    result = simulate(_pipeline(args), args.cost, args.p2p, args.two_batch)
    print(json.dumps(result.to_json(), indent=2) if args.json else format_result(result))
    return 0


def format_result(result: SimResult) -> str:
    pipe = result.pipeline
    lines = [
        f"{pipe.name}: pp={pipe.pp_size}, microbatches={pipe.n_microbatches}, {pipe.num_stages} stages, "
        f"costs {result.costs}, p2p={result.p2p:g}" + (", two-batch overlap" if result.two_batch else ""),
        f"makespan {result.makespan:g}, bubble ratio {result.bubble_ratio:.1%}",
        "",
        f"{'rank':>4} {'busy':>9} {'bubble':>9} {'bubble %':>9} {'peak act':>9} {'actions':>8}",
    ]
    for r in result.ranks:
        lines.append(f"{r.rank:>4} {r.busy:>9g} {r.bubble:>9g} {r.bubble_ratio:>9.1%} "
                     f"{r.peak_activations:>9} {r.actions:>8}")
    return "\n".join(lines)


# ---- compare ------------------------------------------------------------------------------


TWO_BATCH_ROW = " two-batch"  # name suffix of a compare row with two-batch overlap


def compare(pp: int, n_microbatches: int, costs: Costs, p2p: float = 0.0,
            extra: Sequence[Pipeline] = (), two_batch: bool = False) -> list[tuple[str, float, SimResult | str]]:
    """Every named schedule (plus ``extra``) at the same sizes: ``(name, cost scale, result or why not)``;
    with ``two_batch``, each of ours and ``extra`` once more with two-batch overlap (name + ``TWO_BATCH_ROW``).

    ``costs`` are for a stage holding ``1/pp`` of the model; a schedule whose chains hold
    ``2 * pp`` stages runs each action at half those costs.
    """
    rows: list[tuple[str, float, SimResult | str]] = []
    builders: list[tuple[str, Callable[[], Pipeline]]] = [
        (name, lambda name=name: pipeline_for(name, pp, n_microbatches)) for name in SCHEDULE_NAMES
    ]
    builders += [(pipe.name, lambda pipe=pipe: pipe) for pipe in extra]
    for name, build in builders:
        split = (False, True) if two_batch and name not in TORCH_SCHEDULES else (False,)
        for sub_batches in split:
            label = name + (TWO_BATCH_ROW if sub_batches else "")
            try:
                pipe = build()
                rows.append((label, pipe.model_share, simulate(pipe, costs.scaled(pipe.model_share), p2p, sub_batches)))
            except ValueError as err:
                rows.append((label, 1.0, str(err).splitlines()[0]))
    return rows


def _run_compare(args: argparse.Namespace) -> int:
    _require(args, "--pp", "--microbatches")
    extra = [pipeline_from_csv(args.csv)] if args.csv else []
    for pipe in extra:
        if (pipe.pp_size, pipe.n_microbatches) != (args.pp, args.microbatches):
            raise ValueError(f"{args.csv} has pp={pipe.pp_size}, microbatches={pipe.n_microbatches}; "
                             f"compare it with --pp {pipe.pp_size} --microbatches {pipe.n_microbatches}.")
    rows = compare(args.pp, args.microbatches, args.cost, args.p2p, extra, args.two_batch)
    if args.json:
        print(json.dumps(_compare_json(args, rows), indent=2))
    else:
        print(format_compare(args.pp, args.microbatches, args.cost, args.p2p, rows))
    return 0


def _compare_json(args: argparse.Namespace, rows: list[tuple[str, float, SimResult | str]]) -> dict:
    schedules = []
    for name, scale, result in rows:
        if isinstance(result, str):
            schedules.append({"schedule": name, "error": result})
        else:
            schedules.append({**result.to_json(), "cost_scale": scale})
    return {"pp": args.pp, "microbatches": args.microbatches, "costs": args.cost.as_dict(), "p2p": args.p2p,
            "schedules": schedules}


def format_compare(pp: int, n: int, costs: Costs, p2p: float,
                   rows: list[tuple[str, float, SimResult | str]]) -> str:
    header = (f"{'schedule':<24} {'stages':>6} {'cost x':>6} {'makespan':>9} {'bubble min':>10} "
              f"{'bubble max':>10} {'bubble %':>8} {'peak act':>8} {'act mem':>7}")
    lines = [
        f"pp={pp}, microbatches={n}, costs {costs} per stage of 1/pp of the model "
        f"(x0.5 with 2*pp stages per chain), p2p={p2p:g}",
        "peak act: live stage-microbatch activations on the fullest rank; act mem: the same times "
        "the stage size (cost x), in microbatch activations of 1/pp of the model",
        "",
        header,
    ]
    notes = []
    for name, scale, result in rows:
        if isinstance(result, str):
            lines.append(f"{name:<24} {'-':>6} {'-':>6} {'cannot run (see below)':>30}")
            notes.append(f"  {name}: {result}")
            continue
        bubbles = [r.bubble for r in result.ranks]
        lines.append(f"{name:<24} {result.pipeline.num_stages:>6} {scale:>6g} {result.makespan:>9g} "
                     f"{min(bubbles):>10g} {max(bubbles):>10g} {result.bubble_ratio:>8.1%} "
                     f"{result.peak_activations:>8} {result.peak_activations * scale:>7g}")
    return "\n".join(lines + ([""] + notes if notes else []))


# ---- draw ---------------------------------------------------------------------------------


def _direction(pipe: Pipeline) -> tuple[Callable[[int], int] | None, str]:
    """Which stages get the lighter shade, and what the legend calls them."""
    if len(pipe.chains) > 1:
        return pipe.chain_of, "direction 1"
    if pipe.num_stages == 2 * pipe.pp_size:
        return (lambda stage: int(stage >= pipe.pp_size)), f"stages {pipe.pp_size}-{pipe.num_stages - 1}"
    return None, ""


def run_draw(args: argparse.Namespace) -> int:
    if not args.output and not args.trace:
        raise ValueError("draw needs -o FILE (picture) and/or --trace FILE (Perfetto trace).")
    result = simulate(_pipeline(args), args.cost, args.p2p, args.two_batch)
    if args.trace:
        write_trace(result.timeline, args.trace)
        print(f"wrote {args.trace}")
    if args.output:
        pipe = result.pipeline
        two_batch = ", two-batch overlap" if result.two_batch else ""
        title = args.title or (f"{pipe.name}, pp={pipe.pp_size}, {pipe.n_microbatches} microbatches, costs {result.costs}{two_batch}\n"
                               f"makespan {result.makespan:g}, bubble {result.bubble_ratio:.1%}")
        direction_of, label = _direction(pipe)
        draw_timeline(result.timeline, args.output, title, direction_of, label)
        print(f"wrote {args.output}")
    return 0
