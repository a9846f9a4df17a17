"""``titan-dualpipe matrix``: our schedules composed with the parallelisms torchtitan combines with
pipelining, trained end to end on the CPU with the installed torchtitan.

Each cell trains a debug model a few steps under one layout (pp 2 times FSDP, HSDP, tensor
parallel with and without loss parallel, expert parallel, expert x tensor parallel) with DualPipeV
or DualPipe (twins folded into FSDP or summed by an exchange), from a seed checkpoint, and passes
when every step's loss and grad norm is within ``rel`` of torch's 1F1B from the same checkpoint
(on which layout: docs/compatibility.md#composed-with-other-parallelisms). Layouts the CPU cannot
run (context parallelism) are listed with the reason.

    titan-dualpipe matrix                 # every cell the installed torchtitan supports
    titan-dualpipe matrix --only tp       # cells whose layout name contains "tp"
    python3 titan_dualpipe/bootstrap.py --torchtitan 0.3.0 run -m titan_dualpipe matrix   # the other generation
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..launch import dump_folder_flag, logged_steps, shipped_config
from ..switches import FOLD_ENV
from ..torchtitan_version import installed, uses_config_registry

ROOT = Path(__file__).resolve().parents[2]
DENSE, MOE = "debug_dualpipe", "debug_moe_dualpipe"


@dataclass(frozen=True)
class Layout:
    """A parallel layout on top of pp 2: its processes, overrides, and its reference's."""

    name: str
    model: str  # shipped config whose model it trains
    nproc: int
    overrides: tuple[str, ...]
    reference_nproc: int
    reference_overrides: tuple[str, ...]
    folds: bool  # FSDP shards over the twin ranks: DualPipe's twins can be folded
    rel: float  # tolerance on losses and grad norms against the reference
    generations: tuple[str, ...] = ("0.2.2", "0.3.0")
    note: str = ""


_TP = ("--parallelism.tensor_parallel_degree", "2")
_NO_LP = ("--parallelism.disable_loss_parallel",)
_SHARD2 = ("--parallelism.data_parallel_shard_degree", "2")
_NO_EP = ("--parallelism.expert_parallel_degree", "1")
LAYOUTS = (
    Layout("fsdp", DENSE, 4, _SHARD2, 4, _SHARD2, folds=True, rel=1e-4),
    Layout("hsdp", DENSE, 8, ("--parallelism.data_parallel_replicate_degree", "2", *_SHARD2), 8,
           ("--parallelism.data_parallel_replicate_degree", "2", *_SHARD2), folds=True, rel=1e-4),
    Layout("tp+loss_parallel", DENSE, 4, _TP, 2, (), folds=False, rel=1e-4),
    Layout("tp", DENSE, 4, (*_TP, *_NO_LP), 2, (), folds=False, rel=1e-4, generations=("0.2.2",),
           note="0.3.0 computes the loss vocabulary-parallel whenever TP > 1 (no switch)"),
    Layout("ep", MOE, 4, (), 4, _NO_EP, folds=True, rel=1e-3),
    Layout("ep+etp", MOE, 8, (*_TP, "--parallelism.expert_tensor_parallel_degree", "2"), 8, (*_TP, *_NO_EP),
           folds=True, rel=1e-3, generations=("0.2.2",),
           note="0.3.0 has no expert tensor parallelism (expert_tensor_parallel_degree)"),
    Layout("ep+tp", MOE, 8, _TP, 8, (*_TP, *_NO_EP), folds=True, rel=1e-3, generations=("0.3.0",),
           note="0.2.2: see ep+etp (its experts take the tensor-parallel degree)"),
)
UNSUPPORTED = {
    "cp": "context parallelism: torch has no CPU sharding rule for scaled_dot_product_attention (1F1B fails "
          "the same way); GPU-only, untested here",
}


@dataclass(frozen=True)
class Cell:
    layout: Layout
    schedule: str  # DualPipeV or DualPipe
    twins: str = ""  # DualPipe: "folded" or "exchanged"

    @property
    def name(self) -> str:
        return f"{self.layout.name} {self.schedule}" + (f" ({self.twins} twins)" if self.twins else "")


def cells(layouts: tuple[Layout, ...] = LAYOUTS) -> list[Cell]:
    """Both schedules on every layout; DualPipe's twins both ways where FSDP can fold them."""
    out: list[Cell] = []
    for layout in layouts:
        out.append(Cell(layout, "DualPipeV"))
        out.extend(Cell(layout, "DualPipe", t) for t in (("folded", "exchanged") if layout.folds else ("exchanged",)))
    return out


@dataclass
class Outcome:
    cell: str
    generation: str
    passed: bool
    detail: str
    seconds: float = 0.0


@dataclass
class Runner:
    """Launches the shipped configs with the installed torchtitan (``titan-dualpipe train``)."""

    work: Path
    steps: int
    generation: str = field(default_factory=lambda: installed("torchtitan") or "0.2.2")

    @property
    def registry(self) -> bool:
        return uses_config_registry(self.generation)

    def train(self, model: str, label: str, nproc: int, *overrides: str, env: dict[str, str] | None = None
              ) -> tuple[dict[int, dict[int, tuple[float, float]]], str]:
        out = self.work / label
        cmd = [sys.executable, "-m", "titan_dualpipe", "train", shipped_config(model, self.registry),
               "--nproc", str(nproc), "--log-ranks", "all", dump_folder_flag(self.registry), str(out),
               "--training.steps", str(self.steps), *overrides]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=1200)
        output = proc.stdout + proc.stderr
        if proc.returncode:
            raise RuntimeError(f"{label} failed (exit {proc.returncode}):\n{output[-3000:]}")
        return logged_steps(output), output

    def seed(self, model: str) -> tuple[str, ...]:
        """A seed checkpoint of ``model`` (one process): every run of it starts from its weights."""
        self.train(model, f"{model}_seed", 1, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                   "--parallelism.pipeline_parallel_schedule", "1F1B", "--parallelism.pipeline_parallel_degree", "1",
                   *_NO_EP, "--parallelism.data_parallel_shard_degree", "1")
        return ("--checkpoint.enable", "--checkpoint.initial_load_path",
                str(self.work / f"{model}_seed" / "checkpoint" / "step-0"), "--debug.deterministic")


def _twins_args(cell: Cell, registry: bool) -> tuple[tuple[str, ...], dict[str, str]]:
    """How each generation folds DualPipe's twins into FSDP or sums them by an exchange."""
    if cell.twins == "folded":
        return (("--parallelism.spmd_backend", "partial_dtensor") if registry else ()), {}
    if cell.twins == "exchanged" and not registry:
        return (), {FOLD_ENV: "0"}
    return (), {}  # 0.3.0's default spmd backend sums them by an exchange


def compare(ours: dict[int, dict[int, tuple[float, float]]], reference: dict[int, tuple[float, float]],
            steps: int, rel: float) -> str:
    """'' when every rank logged every step within ``rel`` of the reference, else what differs."""
    if sorted(reference) != list(range(1, steps + 1)):
        return f"the reference logged steps {sorted(reference)}"
    worst = 0.0
    for rank, logged in sorted(ours.items()):
        if sorted(logged) != sorted(reference):
            return f"rank {rank} logged steps {sorted(logged)}"
        for step, values in logged.items():
            for got, want, what in zip(values, reference[step], ("loss", "grad_norm")):
                off = abs(got - want) / max(abs(want), 1e-12)
                if off > rel:
                    return f"rank {rank} step {step} {what} {got} vs {want} (rel {off:.1e} > {rel:g})"
                worst = max(worst, off)
    return f"OK (worst rel {worst:.1e})"


def run_matrix(runner: Runner, only: str = "") -> list[Outcome]:
    outcomes: list[Outcome] = []
    seeds: dict[str, tuple[str, ...]] = {}
    references: dict[tuple, dict[int, tuple[float, float]]] = {}
    for cell in cells():
        layout = cell.layout
        if only and only not in layout.name:
            continue
        if runner.generation not in layout.generations:
            outcomes.append(Outcome(cell.name, runner.generation, True, f"unsupported: {layout.note}"))
            continue
        start = time.monotonic()
        try:
            seed = seeds.setdefault(layout.model, runner.seed(layout.model))
            key = (layout.model, layout.reference_nproc, layout.reference_overrides)
            if key not in references:
                logged, _ = runner.train(layout.model, f"{layout.name}_1f1b", layout.reference_nproc, *seed,
                                         *layout.reference_overrides, "--parallelism.pipeline_parallel_schedule", "1F1B")
                references[key] = logged[_last_stage_rank(layout.reference_nproc)]
            extra, env = _twins_args(cell, runner.registry)
            label = f"{layout.name}_{cell.schedule}_{cell.twins}".replace("+", "_")
            logged, output = runner.train(layout.model, label, layout.nproc, *seed, *layout.overrides, *extra,
                                          "--parallelism.pipeline_parallel_schedule", cell.schedule, env=env)
            detail = compare(logged, references[key], runner.steps, layout.rel) + _weight_gradients(output)
            if cell.twins and f"twins {'folded into FSDP' if cell.twins == 'folded' else 'summed by an exchange'}" not in output:
                detail = f"the run did not report {cell.twins} twins"
            outcomes.append(Outcome(cell.name, runner.generation, detail.startswith("OK"), detail,
                                    time.monotonic() - start))
        except (RuntimeError, subprocess.TimeoutExpired, KeyError) as err:
            outcomes.append(Outcome(cell.name, runner.generation, False, str(err)[-2000:], time.monotonic() - start))
        print(_row(outcomes[-1]), flush=True)
    return outcomes


def _weight_gradients(output: str) -> str:
    """How the run took its weight gradients, from its build log: the most weight GEMMs per
    microbatch that a rank deferred to W, or the mode it named."""
    deferred = [int(n) for n in re.findall(r"(\d+) weight GEMMs per microbatch wait for W", output)]
    if deferred:
        return f"; deferred W: up to {max(deferred)} weight GEMMs per microbatch on a rank"
    named = re.search(r"weight gradients: (\w+)", output)
    return f"; weight gradients: {named.group(1)}" if named else ""


def _last_stage_rank(nproc: int, pp: int = 2) -> int:
    """torchtitan logs 1F1B's loss on the last pipeline stage's processes: the first of them."""
    return (nproc // pp) * (pp - 1)


def _row(outcome: Outcome) -> str:
    status = "PASS" if outcome.passed else "FAIL"
    return f"{status:4}  torchtitan {outcome.generation}  {outcome.cell:38} {outcome.seconds:6.0f} s  {outcome.detail}"


def markdown(outcomes: list[Outcome]) -> str:
    lines = ["| layout | schedule | torchtitan | result |", "|---|---|---|---|"]
    for o in outcomes:
        layout, schedule = o.cell.split(" ", 1)
        lines.append(f"| {layout} | {schedule} | {o.generation} | {'tested on CPU: ' if o.passed and not o.detail.startswith('unsupported') else ''}{o.detail} |")
    for name, reason in UNSUPPORTED.items():
        lines.append(f"| {name} | both | both | {reason} |")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("matrix", help="train our schedules under FSDP, HSDP, TP, EP and EP x TP (CPU), "
                              "against torch's 1F1B", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="only layouts whose name contains this (fsdp, hsdp, tp, ep)")
    p.add_argument("--steps", type=int, default=3, help="training steps per run")
    p.add_argument("--work-dir", default=None, help="where runs write (default: a temporary folder)")
    p.add_argument("--markdown", default=None, help="also write the results as a Markdown table to this file")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2 (the losses must be compared after an optimizer step), got {args.steps}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="titan_dualpipe_matrix_"))
    runner = Runner(work, args.steps)
    print(f"torchtitan {runner.generation}; runs in {work}; not on CPU: " + "; ".join(f"{k}: {v}" for k, v in UNSUPPORTED.items()))
    outcomes = run_matrix(runner, args.only)
    if args.markdown:
        Path(args.markdown).write_text(markdown(outcomes) + "\n")
    failed = [o for o in outcomes if not o.passed]
    tested = [o for o in outcomes if not o.detail.startswith("unsupported")]
    print(f"matrix: {len(tested) - len(failed)} of {len(tested)} cells passed on torchtitan {runner.generation}"
          f" ({len(outcomes) - len(tested)} not supported by it)")
    return 1 if failed else 0
