"""``titan-dualpipe bench titan CONFIG --nproc N [--comm-ratio R] [--json]``: torchtitan
training under each pipeline schedule, in paired rotated rounds.

Every run is ``titan-dualpipe train CONFIG`` with the schedule (and our overlap switch)
overridden, measured inside the trainer (:mod:`titan_dualpipe.titan.bench_probe`): step time,
tokens per second, peak memory, the expert all-to-all left exposed (by the kind of action that
waited; on the CPU next to its floor) and where a step's time goes. On the CPU each expert
exchange costs an emulated network's time, ``R`` times the compute it is compared with. Each
round runs every schedule once, in a rotated order, so drifts of the machine fall on all alike.
The schedules, the variants on request, the emulated network, every column and JSON key:
benchmarks/README.md#bench-titan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..launch import add_options, dump_folder_flag, take_back_options
# what a run's trainer processes read (:mod:`titan_dualpipe.titan.bench_probe`, :mod:`titan_dualpipe.titan.fold`)
from ..switches import (BENCH_DIR_ENV, CALIBRATE_ENV, COUNT_GROUPS_ENV, COUNT_HAND_OVER_ENV, EXCHANGE_CHUNKS_ENV,
                        EXCHANGE_S_ENV, FOLD_ENV, LONE_PAIRS_ENV, MIN_FLOPS_ENV, PAIR_FIRST_ENV, TWO_BATCH_ENV,
                        WEIGHT_GRADIENTS_ENV, WEIGHT_GEMMS_IN_FLIGHT_ENV)
from ..torchtitan_version import check_torchtitan_version, uses_config_registry


@dataclass(frozen=True)
class Variant:
    """One benchmarked configuration: torchtitan's schedule name, our overlap switch, and
    whether DualPipe may fold its twins into FSDP (:mod:`titan_dualpipe.titan.fold`)."""

    label: str
    schedule: str
    overlap: bool | None = None  # None: the config's own setting (torch's schedules ignore it)
    fold_twins: bool = True
    count_hand_over: bool = False  # True: a hand-over between posting the token-count exchange and reading it
    count_groups: bool = True  # False: the token counts on the expert-parallel group's communicator
    compiled: bool = False  # True: torchtitan compiles the model's blocks and the loss (--compile)
    two_batch: bool = False  # True: lone forwards of MoE stages run as two sub-batches (needs microbatches of >= 2 rows)
    weight_gradients: str | None = None  # our schedules' weight_gradients (None: the config's, deferred by default)
    # False: a full backward computes its weight GEMMs inline, not while its exchanges fly; "fill": as fillers
    weight_gemms_in_flight: bool | str = True
    min_weight_gemm_flops: int | None = None  # the least FLOPs of a deferred weight GEMM (None: the device's default)
    pair_first: str = "forward"  # which half of a relayed pair runs first (docs/overlap.md#which-half-first)
    exchange_chunks: int = 1  # each MoE layer's dispatch and combine as this many exchanges (docs/overlap.md#chunked-exchanges)
    lone_pairs: bool = False  # adjacent lone actions of one direction as relayed pairs (docs/overlap.md#lone-pairs)


VARIANTS = (
    Variant("1F1B", "1F1B"),
    Variant("Interleaved1F1B", "Interleaved1F1B"),
    Variant("ZBVZeroBubble", "ZBVZeroBubble"),
    Variant("torch DualPipeV", "TorchDualPipeV", overlap=False),  # torchtitan's overlap callback is GPU-only
    Variant("DualPipeV", "DualPipeV", overlap=True),
    Variant("DualPipeV sequential", "DualPipeV", overlap=False),
    Variant("DualPipeV two-batch", "DualPipeV", overlap=True, two_batch=True),
    Variant("DualPipe", "DualPipe", overlap=True),
    Variant("DualPipe sequential", "DualPipe", overlap=False),
    Variant("DualPipe two-batch", "DualPipe", overlap=True, two_batch=True),
    Variant("DualPipe twin exchange", "DualPipe", overlap=True, fold_twins=False),  # no twin folding into FSDP
    Variant("DualPipeV counts handed over", "DualPipeV", overlap=True, count_hand_over=True),
    Variant("DualPipe counts handed over", "DualPipe", overlap=True, count_hand_over=True),
    # the token counts behind the token exchanges, on the expert-parallel group's communicator
    Variant("DualPipeV shared count comm", "DualPipeV", overlap=True, count_groups=False),
    Variant("DualPipe shared count comm", "DualPipe", overlap=True, count_groups=False),
    # each backward whole at I (W a no-op): what deferring the weight GEMMs to W gains, e.g. under AC
    Variant("DualPipeV W at I", "DualPipeV", overlap=True, weight_gradients="whole"),
    Variant("DualPipe W at I", "DualPipe", overlap=True, weight_gradients="whole"),
    # a full backward's weight GEMMs inline, before each exchange is posted (weights/in_flight.py)
    Variant("DualPipeV W inline", "DualPipeV", overlap=True, weight_gemms_in_flight=False),
    Variant("DualPipe W inline", "DualPipe", overlap=True, weight_gemms_in_flight=False),
    # only the weight GEMMs that fit before the partner's exchange arrives (docs/weight_gradients.md#fillers)
    Variant("DualPipeV W fill", "DualPipeV", overlap=True, weight_gemms_in_flight="fill"),
    Variant("DualPipe W fill", "DualPipe", overlap=True, weight_gemms_in_flight="fill"),
    # every weight GEMM deferred, the small ones too (docs/weight_gradients.md#small-gemms)
    Variant("DualPipeV W all deferred", "DualPipeV", overlap=True, min_weight_gemm_flops=0),
    Variant("DualPipe W all deferred", "DualPipe", overlap=True, min_weight_gemm_flops=0),
    # relayed pairs started with their backward half, always or where the second step measures it exposes less
    Variant("DualPipeV backward first", "DualPipeV", overlap=True, pair_first="backward"),
    Variant("DualPipe backward first", "DualPipe", overlap=True, pair_first="backward"),
    Variant("DualPipeV measured first", "DualPipeV", overlap=True, pair_first="measured_first"),
    Variant("DualPipe measured first", "DualPipe", overlap=True, pair_first="measured_first"),
    Variant("DualPipeV measured order", "DualPipeV", overlap=True, pair_first="measured"),
    Variant("DualPipe measured order", "DualPipe", overlap=True, pair_first="measured"),
    Variant("DualPipeV lone pairs", "DualPipeV", overlap=True, lone_pairs=True),
    Variant("DualPipe lone pairs", "DualPipe", overlap=True, lone_pairs=True),
    Variant("DualPipeV lone pairs measured order", "DualPipeV", overlap=True, lone_pairs=True, pair_first="measured"),
    Variant("DualPipe lone pairs measured order", "DualPipe", overlap=True, lone_pairs=True, pair_first="measured"),
    # each MoE layer's exchanges cut in two by groups of experts, pipelined with their experts
    Variant("DualPipeV chunks 2", "DualPipeV", overlap=True, exchange_chunks=2),
    Variant("DualPipe chunks 2", "DualPipe", overlap=True, exchange_chunks=2),
)
BY_LABEL = {v.label: v for v in VARIANTS}
# the others are comparison runs, on request (two-batch: with microbatches of >= 2 rows)
DEFAULT_LABELS = [v.label for v in VARIANTS
                  if not (v.count_hand_over or v.two_batch or v.weight_gradients or not v.count_groups
                          or v.weight_gemms_in_flight is not True or v.min_weight_gemm_flops is not None
                          or v.pair_first != "forward" or v.exchange_chunks != 1 or v.lone_pairs)]
BLOCK_EXCHANGES = 4  # dispatch and combine, forward and backward
COMPILED = " compiled"  # label suffix of a compiled variant
COMPILE_OVERRIDES = ("--compile.enable", "--compile.components", "model,loss")  # same spelling in both releases
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def _in_flight_env(mode: bool | str) -> str:
    return mode if isinstance(mode, str) else "1" if mode else "0"


def compiled(variant: Variant) -> Variant:
    """``variant`` with torchtitan's model (its blocks) and loss compiled."""
    return dataclasses.replace(variant, label=variant.label + COMPILED, compiled=True)


OPTIONS: dict[str, dict] = {
    "--nproc": dict(type=int, default=None, help="number of processes (required)"),
    "--comm-ratio": dict(type=float, default=1.0,
                         help="emulated cost of a MoE block's four all-to-all exchanges / its compute (0: none)"),
    "--rounds": dict(type=int, default=2, help="rounds; each runs every schedule once"),
    "--steps": dict(type=int, default=8, help="training steps per run"),
    "--warmup": dict(type=int, default=3, help="first steps of each run left out of the figures"),
    "--schedules": dict(default=",".join(DEFAULT_LABELS),
                        help="comma-separated, from: " + ", ".join(BY_LABEL) + " (default: all but '... counts handed over', "
                             "'... shared count comm', '... two-batch', '... W at I', '... W inline', '... W fill', "
                             "'... W all deferred', '... backward first', '... measured first', '... measured order', '... chunks 2', "
                             "'... lone pairs' and '... lone pairs measured order')"),
    "--compile": dict(action="store_true", default=False,
                      help="also run each schedule with the model and loss compiled (inductor), side by side"),
    "--module": dict(default=None, help="torchtitan 0.3.0: the module holding CONFIG (as for train)"),
    "--json": dict(action="store_true", default=False, help="print JSON instead of a table"),
}


def add_parser(kinds: argparse._SubParsersAction) -> None:
    from ..cli import HelpFormatter

    p = kinds.add_parser("titan", help="torchtitan training under each schedule (paired rotated rounds)",
                         description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("config", help="torchtitan 0.2.2: a TOML; 0.3.0: a config name (see `titan-dualpipe train`)")
    add_options(p, OPTIONS)
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="torchtitan overrides for every run")
    p.set_defaults(func=run)


def split_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """Our options may also follow CONFIG (see :func:`titan_dualpipe.launch.take_back_options`)."""
    args.overrides = take_back_options(args, OPTIONS)
    return args


def _check(args: argparse.Namespace) -> list[Variant]:
    if args.nproc is None or args.nproc < 1:
        raise ValueError(f"give --nproc N, the number of processes (>= 1); got {args.nproc}")
    if not (args.comm_ratio >= 0):
        raise ValueError(f"--comm-ratio must be >= 0, got {args.comm_ratio}")
    if args.comm_ratio > 0 and _has_cuda():
        raise ValueError(f"--comm-ratio {args.comm_ratio}: the emulated network is for CPU runs; on GPUs the "
                         "exchanges cross the real network: give --comm-ratio 0")
    if args.rounds < 1 or args.warmup < 0 or args.steps <= args.warmup:
        raise ValueError(f"need --rounds >= 1 and --steps > --warmup >= 0; got --rounds {args.rounds}, "
                         f"--steps {args.steps}, --warmup {args.warmup}")
    labels = [s.strip() for s in args.schedules.split(",") if s.strip()]
    unknown = [s for s in labels if s not in BY_LABEL]
    if unknown or not labels:
        raise ValueError(f"--schedules: unknown {unknown or labels}; choose from {', '.join(BY_LABEL)}")
    chosen = [BY_LABEL[s] for s in labels]
    if getattr(args, "compile", False):  # each compiled run next to its eager one in the rotation
        return [v for eager in chosen for v in (eager, compiled(eager))]
    return chosen


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class Launcher:
    """Starts ``titan-dualpipe train`` runs of one config and reads what their ranks recorded."""

    def __init__(self, config: str, nproc: int, module: str | None, overrides: list[str], workdir: Path) -> None:
        self.registry = uses_config_registry(check_torchtitan_version())
        self.config, self.nproc, self.module, self.overrides, self.workdir = config, nproc, module, overrides, workdir
        self.runs = 0

    def _overlap_flag(self, overlap: bool) -> str:
        if self.registry:
            return "--dualpipe.overlap" if overlap else "--dualpipe.no-overlap"
        prefix = "--parallelism." if overlap else "--parallelism.no-"
        return prefix + "pipeline-parallel-expert-parallel-overlap"

    def run(self, variant: Variant, steps: int, exchange_s: float, calibrate: bool = False) -> list[dict]:
        """Every rank's record of one run. A failed run is retried once, its failure shown on
        stderr, so one flaky process does not end a long benchmark; a second failure raises."""
        try:
            return self._run_once(variant, steps, exchange_s, calibrate)
        except RuntimeError as err:
            print(f"{err}\nbench titan: running {variant.label} again", file=sys.stderr)
            return self._run_once(variant, steps, exchange_s, calibrate)

    def _run_once(self, variant: Variant, steps: int, exchange_s: float, calibrate: bool) -> list[dict]:
        self.runs += 1
        out = self.workdir / f"run{self.runs}"
        out.mkdir()
        argv = [sys.executable, "-m", "titan_dualpipe", "train", self.config, "--nproc", str(self.nproc),
                "--log-ranks", "all"]
        argv += ["--module", self.module] if self.module else []
        argv += [dump_folder_flag(self.registry), str(out / "dump")]
        argv += ["--training.steps", str(steps), "--parallelism.pipeline_parallel_schedule", variant.schedule]
        argv += [self._overlap_flag(variant.overlap)] if variant.overlap is not None else []
        argv += list(COMPILE_OVERRIDES) if variant.compiled else []
        env = {**os.environ, BENCH_DIR_ENV: str(out), EXCHANGE_S_ENV: repr(exchange_s),
               FOLD_ENV: "1" if variant.fold_twins else "0", COUNT_HAND_OVER_ENV: "1" if variant.count_hand_over else "0",
               TWO_BATCH_ENV: "1" if variant.two_batch else "0", COUNT_GROUPS_ENV: "1" if variant.count_groups else "0",
               WEIGHT_GEMMS_IN_FLIGHT_ENV: _in_flight_env(variant.weight_gemms_in_flight),
               PAIR_FIRST_ENV: variant.pair_first, EXCHANGE_CHUNKS_ENV: str(variant.exchange_chunks),
               LONE_PAIRS_ENV: "1" if variant.lone_pairs else "0"}
        env.update({WEIGHT_GRADIENTS_ENV: variant.weight_gradients} if variant.weight_gradients else {})
        if variant.min_weight_gemm_flops is not None:
            env[MIN_FLOPS_ENV] = str(variant.min_weight_gemm_flops)
        env.setdefault(INDUCTOR_CACHE_ENV, str(self.workdir / "inductor_cache"))  # kernels built once, for every run
        env.pop(CALIBRATE_ENV, None)
        env.update({CALIBRATE_ENV: "1"} if calibrate else {})
        log = out / "log.txt"
        with open(log, "w") as f:
            done = subprocess.run([*argv, *self.overrides], env=env, stdout=f, stderr=subprocess.STDOUT)
        records = [json.loads(p.read_text()) for p in sorted(out.glob("bench_rank*.json"))]
        if done.returncode != 0 or len(records) != self.nproc:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            raise RuntimeError(f"bench titan: the {variant.label} run failed (exit {done.returncode}, "
                               f"{len(records)}/{self.nproc} ranks reported):\n{tail}")
        return records


def block_seconds(records: list[dict]) -> float:
    """A MoE block's forward + backward (medians over all calls on all ranks)."""
    forward = [s for r in records for s in r["block_forward_s"]]
    backward = [s for r in records for s in r["block_backward_s"]]
    if not forward or not backward:
        raise ValueError("bench titan: the model has no MoE blocks to time; run it with --comm-ratio 0")
    return statistics.median(forward) + statistics.median(backward)


def summarize(runs: list[list[dict]], warmup: int) -> dict[str, float]:
    """One schedule's figures from its runs (each a list of per-rank records)."""
    step_s, exposed_s = [], []
    kinds = {kind for records in runs for r in records for step in r["exposed_by_action"] for kind in step}
    by_kind: dict[str, list[float]] = {kind: [] for kind in sorted(kinds)}
    for records in runs:
        for step in range(warmup, len(records[0]["step_s"])):
            step_s.append(max(r["step_s"][step] for r in records))
            exposed_s.append(statistics.mean(r["exposed_s"][step] for r in records))
            for kind, values in by_kind.items():
                values.append(statistics.mean(r["exposed_by_action"][step].get(kind, 0.0) for r in records))
    step_time = statistics.median(step_s)
    out = {
        "step_time": step_time,
        "tokens_per_s": runs[0][0]["tokens_per_step"] / step_time,
        "peak_memory_bytes": max(r["peak_memory_bytes"] for records in runs for r in records),
        "exposed_comm": statistics.median(exposed_s),
        # seconds per step by the kind of our action the wait fell in (mean over ranks, median over steps)
        "exposed_by_action": {kind: statistics.median(values) for kind, values in by_kind.items()},
    }
    if all("exposure" in r for records in runs for r in records):  # CPU runs: the floor (titan/bench_probe.py)
        out["exposure"] = exposure_summary(runs, warmup)
    return out


def exposure_summary(runs: list[list[dict]], warmup: int) -> dict[str, float]:
    """Seconds per step of each exposure key the ranks recorded (measured, late, floor, 1F1B's
    every exchange exposed; in pairs and lone halves): mean over ranks, median over measured steps."""
    keys = runs[0][0]["exposure"][0].keys() if runs[0][0]["exposure"] else ()
    values: dict[str, list[float]] = {key: [] for key in keys}
    for records in runs:
        for step in range(warmup, len(records[0]["exposure"])):
            for key, per_step in values.items():
                per_step.append(statistics.mean(r["exposure"][step][key] for r in records))
    return {key: statistics.median(v) for key, v in values.items() if v}


PHASES = ("schedule", "compute", "p2p", "fsdp_gather", "fsdp_reduce", "twin_sum", "clip", "optimizer", "other")


def phase_breakdown(runs: list[list[dict]], warmup: int) -> dict[str, float]:
    """Seconds per step in each phase (mean over ranks, median over measured steps and rounds);
    a phase no rank recorded (our executor's actions under torch's schedules) is left out."""
    seen = {phase for records in runs for r in records for step in r["phases"] for phase in step}
    per_phase: dict[str, list[float]] = {phase: [] for phase in PHASES if phase in seen}
    for records in runs:
        for step in range(warmup, len(records[0]["phases"])):
            for phase, values in per_phase.items():
                values.append(statistics.mean(r["phases"][step].get(phase, 0.0) for r in records))
    return {phase: statistics.median(values) for phase, values in per_phase.items()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    variants = _check(args)
    with tempfile.TemporaryDirectory(prefix="titan_dualpipe_bench_") as workdir:
        launcher = Launcher(args.config, args.nproc, args.module, args.overrides, Path(workdir))
        exchange_s, block_s = 0.0, None
        if args.comm_ratio > 0:
            block_s = block_seconds(launcher.run(BY_LABEL["1F1B"], args.warmup + 2, 0.0, calibrate=True))
            exchange_s = args.comm_ratio * block_s / BLOCK_EXCHANGES
        runs: dict[str, list[list[dict]]] = {v.label: [] for v in variants}
        for round_index in range(args.rounds):
            shift = round_index % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                runs[variant.label].append(launcher.run(variant, args.steps, exchange_s))
    schedules = {label: summarize(r, args.warmup) for label, r in runs.items()}
    return {
        "config": args.config, "nproc": args.nproc, "comm_ratio": args.comm_ratio, "rounds": args.rounds,
        "steps": args.steps, "warmup": args.warmup,
        "block_compute_s": block_s, "exchange_s": exchange_s,
        "schedules": schedules,
        "vs_eager": {label: ratio for label in schedules if (ratio := vs_eager(schedules, label)) is not None},
        "phases": {label: phase_breakdown(r, args.warmup) for label, r in runs.items()},
    }


def vs_eager(schedules: dict[str, dict[str, float]], label: str) -> float | None:
    """A compiled variant's speed-up over its eager run (eager s/step / compiled s/step); None
    for an eager variant or one whose eager run was not measured."""
    if not label.endswith(COMPILED) or label[: -len(COMPILED)] not in schedules:
        return None
    return schedules[label[: -len(COMPILED)]]["step_time"] / schedules[label]["step_time"]


def format_table(result: dict[str, Any]) -> str:
    schedules = result["schedules"]
    base = schedules.get("1F1B")
    width = max(22, *(len(label) + 2 for label in schedules))
    lines = [f"{'schedule':<{width}}{'s/step':>9}{'tokens/s':>10}{'vs 1F1B':>9}{'vs eager':>10}{'peak MiB':>10}"
             f"{'exposed a2a s':>15}"]
    for label, s in schedules.items():
        ratio = f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        speed_up = vs_eager(schedules, label)
        eager = f"{speed_up:.2f}x" if speed_up is not None else "-"
        lines.append(f"{label:<{width}}{s['step_time']:>9.3f}{s['tokens_per_s']:>10.0f}{ratio:>9}{eager:>10}"
                     f"{s['peak_memory_bytes'] / 2**20:>10.0f}{s['exposed_comm']:>15.3f}")
    if result["block_compute_s"] is not None:
        lines.append(f"emulated all-to-all: {result['exchange_s'] * 1e3:.2f} ms per exchange = {result['comm_ratio']} x "
                     f"MoE block forward+backward {result['block_compute_s'] * 1e3:.2f} ms / {BLOCK_EXCHANGES}")
    lines.append(f"{result['rounds']} rotated rounds x {result['steps'] - result['warmup']} measured steps "
                 f"(after {result['warmup']}), {result['nproc']} processes")
    lines += ["", "ms per step, mean over ranks (schedule = the pipeline step: compute, p2p, FSDP and twin sum "
              "are inside it; - : torch's executor, not split)", f"{'schedule':<{width}}" + "".join(f"{p:>12}" for p in PHASES)]
    for label, phases in result.get("phases", {}).items():
        lines.append(f"{label:<{width}}" + "".join(f"{phases[p] * 1e3:>12.0f}" if p in phases else f"{'-':>12}"
                                              for p in PHASES))
    return "\n".join(lines + _exposed_by_action_table(schedules, width) + _floor_table(schedules, width))


def _floor_table(schedules: dict[str, dict[str, Any]], width: int) -> list[str]:
    """Measured exposure, its floor and 1F1B's side by side (CPU runs), ms per step."""
    rows = {label: s["exposure"] for label, s in schedules.items() if s.get("exposure")}
    if not rows:
        return []
    one_f_one_b = schedules.get("1F1B", {}).get("exposed_comm")
    lines = ["", "exposed all-to-all against its floor, ms per step, mean over ranks: measured (blocked in waits; "
             "late: of it, past the emulated time; slept: of that, in sleeps woken late; counts: in token-count "
             "reads' collectives; the rest in token exchanges' collectives: a peer posting late); floor (each "
             "pair's halves in the order that exposes least, from the run's own segment and exchange times; lone "
             "halves: every exchange but what their own compute covers); 1F1B: its run's measured exposure; all: "
             "this run's exchanges all exposed; in order: the pairs' measured segments in the order they ran",
             f"{'schedule':<{width}}{'measured':>9}{'late':>7}{'slept':>7}{'counts':>7}{'floor':>7}{'1F1B':>7}"
             f"{'all':>7}{'floor/1F1B':>11}{'meas/1F1B':>10}{'pairs: meas':>12}{'late':>7}{'in order':>9}"
             f"{'floor':>7}{'lone: meas':>11}{'late':>7}{'floor':>7}"]
    for label, e in rows.items():
        share = (lambda v: f"{v / one_f_one_b:.2f}") if one_f_one_b else (lambda v: "-")
        reference = f"{one_f_one_b * 1e3:>7.0f}" if one_f_one_b is not None else f"{'-':>7}"
        lines.append(f"{label:<{width}}{e['measured'] * 1e3:>9.0f}{e['late'] * 1e3:>7.0f}{e['overslept'] * 1e3:>7.0f}"
                     f"{e['count_late'] * 1e3:>7.0f}{e['floor'] * 1e3:>7.0f}"
                     f"{reference}{e['serial'] * 1e3:>7.0f}{share(e['floor']):>11}{share(e['measured']):>10}"
                     f"{e['pairs_measured'] * 1e3:>12.0f}{e['pairs_late'] * 1e3:>7.0f}"
                     f"{e['pairs_in_order'] * 1e3:>9.0f}{e['pairs_floor'] * 1e3:>7.0f}"
                     f"{e['lone_measured'] * 1e3:>11.0f}{e['lone_late'] * 1e3:>7.0f}{e['lone_floor'] * 1e3:>7.0f}")
    return lines


# "pair F" / "pair B": a relayed pair's forward / backward half waited (for its own exchange, while
# the partner half's segment ran); "pair": a pair whose module interleaves its halves itself, or
# whose forward posted no exchange (its backward then runs after it, unpartnered); "lone pair": two
# forwards, or two backwards, relayed (lone_pairs=True)
EXPOSED_KINDS = ("lone F", "lone B", "lone I", "W", "pair F", "pair B", "pair", "lone pair", "outside our actions")


def _exposed_by_action_table(schedules: dict[str, dict[str, Any]], width: int) -> list[str]:
    """Where our schedules leave the all-to-all exposed: ms per step by action kind."""
    ours = {label: s["exposed_by_action"] for label, s in schedules.items()
            if set(s.get("exposed_by_action", {})) - {EXPOSED_KINDS[-1]}}
    if not ours:
        return []
    kinds = [kind for kind in EXPOSED_KINDS if any(kind in by_kind for by_kind in ours.values())]
    lines = ["", "exposed all-to-all by the kind of action it falls in, ms per step, mean over ranks (our schedules)",
             f"{'schedule':<{width}}" + "".join(f"{kind.replace(' our actions', ''):>12}" for kind in kinds)]
    for label, by_kind in ours.items():
        lines.append(f"{label:<{width}}" + "".join(f"{by_kind.get(kind, 0.0) * 1e3:>12.0f}" for kind in kinds))
    return lines


def run(args: argparse.Namespace) -> int:
    result = measure(split_arguments(args))
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0
