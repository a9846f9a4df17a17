"""``titan-dualpipe check --nproc N [--backend nccl|gloo]``: the numerics suite on this machine.

Runs every schedule and layout that fits N processes (DualPipeV on every pp dividing N,
DualPipe on every even one, the rest of the processes as FSDP2 data parallelism; plus
deferred receives with sequential pairs at the largest pp) and checks, on every rank, every
microbatch loss and every parameter gradient against a non-pipelined reference over two
steps with an Adam step between (DualPipe's twins bit-identical), that every tensor handed
to a collective lives on the stages' device, and that the communication each rank posted
completes under NCCL's semantics (no buffering). Prints one row per case.

With ``--backend nccl`` rank r uses GPU r (N <= the GPUs of this machine); with gloo the
processes run on the CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..cli import HelpFormatter

MIN_STEPS_TOL = "rtol 1e-5, atol 4e-5"


@dataclass(frozen=True)
class Case:
    schedule: str
    pp: int
    dp: int
    n: int
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def layout(self) -> str:
        text = f"pp {self.pp}" + (f" x FSDP2 {self.dp}" if self.dp > 1 else "")
        return text + "".join(f", {k}={v}" for k, v in self.options)


@dataclass
class Outcome:
    case: Case
    passed: bool = False
    grad_err: float = 0.0
    loss_err: float = 0.0
    order: str = ""
    seconds: float = 0.0
    error: str = ""
    ranks: list[int] = field(default_factory=list)


def cases_for(world: int) -> list[Case]:
    """Every layout of N processes: DualPipeV on each pp dividing N, DualPipe on each even one."""
    cases: list[Case] = []
    for schedule in ("DualPipeV", "DualPipe"):
        pps = [pp for pp in range(1, world + 1) if world % pp == 0 and (schedule == "DualPipeV" or pp % 2 == 0)]
        for pp in pps:
            n = 2 * pp + 1 if schedule == "DualPipeV" else 2 * pp + 2
            cases.append(Case(schedule, pp, world // pp, n))
        if pps and pps[-1] > 1:
            pp = pps[-1]
            cases.append(Case(schedule, pp, world // pp, 2 * pp + 2,
                              (("defer_pp_recv", True), ("overlap", False))))
    return cases


def _run_case(case: Case, device: torch.device) -> dict[str, Any]:
    """One case on this rank: train and compare, record communication; what rank 0 needs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ..runtime.comm_record import CommRecorder
    from .numerics import train_and_compare

    mesh = init_device_mesh(device.type, (case.pp, case.dp), mesh_dim_names=("pp", "dp"))
    fsdp = {}
    if case.dp > 1:
        fsdp = dict(fsdp_mesh=mesh["dp"], dp_index=mesh["dp"].get_local_rank(), dp_size=case.dp)
    start = time.perf_counter()
    try:
        with CommRecorder(device=device) as recorder:
            result = train_and_compare(case.schedule, case.pp, case.n, mesh["pp"].get_group(),
                                       mesh["pp"].get_local_rank(), device=device, **fsdp, **dict(case.options))
        return {"ok": True, **result, "events": recorder.events, "seconds": time.perf_counter() - start,
                "rank": dist.get_rank()}
    except (AssertionError, ValueError, RuntimeError) as err:
        return {"ok": False, "error": f"{type(err).__name__}: {err}", "rank": dist.get_rank(), "events": [],
                "seconds": time.perf_counter() - start}


def _worker(cases: list[Case], backend: str) -> list[dict[str, Any]]:
    """Every case on this rank; rank 0 returns the outcomes."""
    import torch.distributed as dist

    from ..orders.nccl_model import Deadlock, check_completes

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    outcomes = []
    for case in cases:
        mine = _run_case(case, device)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        outcome = Outcome(case, seconds=max(r["seconds"] for r in everyone))
        failed = [r for r in everyone if not r["ok"]]
        if failed:
            outcome.error, outcome.ranks = failed[0]["error"], [r["rank"] for r in failed]
        else:
            outcome.grad_err = max(r["grad_err"] for r in everyone)
            outcome.loss_err = max(r["loss_err"] for r in everyone)
            try:
                check_completes({r["rank"]: r["events"] for r in everyone})
                outcome.order, outcome.passed = "completes", True
            except Deadlock as err:
                outcome.order, outcome.error = "would hang", str(err)
        outcomes.append(asdict(outcome))
    return outcomes


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("check", help="run the numerics suite on N local processes (GPUs or CPU)",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--nproc", type=int, required=True, help="number of processes (with nccl: one GPU each)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="nccl (default when this machine has N GPUs) or gloo (CPU)")
    p.add_argument("--json", action="store_true", help="print the outcomes as JSON instead of a table")
    p.set_defaults(func=run)


def _backend(nproc: int, backend: str | None) -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        return "nccl" if 0 < nproc <= gpus else "gloo"
    if backend == "nccl" and nproc > gpus:
        raise ValueError(f"--backend nccl needs one GPU per process: --nproc {nproc} but this machine has {gpus} "
                         "GPUs; use --nproc <= the GPU count, or --backend gloo (CPU)")
    return backend


def run(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    backend = _backend(args.nproc, args.backend)
    from ..bench.spawn import run_on_processes

    cases = cases_for(args.nproc)
    outcomes = run_on_processes(_worker, args.nproc, cases, backend, backend=backend)
    if args.json:
        print(json.dumps({"backend": backend, "nproc": args.nproc, "torch": torch.__version__, "cases": outcomes},
                         indent=1, default=str))
    else:
        print(format_table(outcomes, backend, args.nproc))
    return 0 if all(o["passed"] for o in outcomes) else 1


def format_table(outcomes: list[dict[str, Any]], backend: str, nproc: int) -> str:
    rows = [("schedule", "layout", "microbatches", "max grad err", "max loss err", "NCCL order", "result", "seconds")]
    for o in outcomes:
        case = o["case"]
        layout = Case(case["schedule"], case["pp"], case["dp"], case["n"], tuple(map(tuple, case["options"]))).layout
        rows.append((case["schedule"], layout, str(case["n"]), f"{o['grad_err']:.2e}", f"{o['loss_err']:.2e}",
                     o["order"] or "-", "pass" if o["passed"] else "FAIL", f"{o['seconds']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"titan-dualpipe check: {nproc} processes, {backend}, torch {torch.__version__} ({MIN_STEPS_TOL})"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for o in outcomes:
        if o["error"]:
            lines.append(f"\n{o['case']['schedule']} pp={o['case']['pp']} failed"
                         + (f" on ranks {o['ranks']}" if o["ranks"] else "") + f":\n{o['error']}")
    return "\n".join(lines)
