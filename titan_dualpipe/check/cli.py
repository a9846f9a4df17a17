"""``titan-dualpipe check --nproc N [--backend nccl|gloo]``: the numerics suite on this machine.

Runs every schedule and layout that fits N processes (DualPipeV on every pp dividing N, DualPipe
on every even one, the other processes as FSDP2 data parallelism) and checks, on every rank, every
microbatch loss and parameter gradient against a non-pipelined reference, that every tensor handed
to a collective lives on the stages' device, and that the communication each rank posted completes
under NCCL's semantics (the communicator model that judged it is printed above the table). With
``--backend nccl`` rank r uses GPU r; with gloo the processes run on the CPU. One row per case; a
case that fails on some ranks only is a FAIL row and the next case still runs; the exit status is
1 when any case failed. More: docs/numerics.md#check.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
import warnings
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..cli import HelpFormatter

MIN_STEPS_TOL = "rtol 1e-5, atol 4e-5"
# a rank blocked on a failed peer gives up after this; shorter than the world group's timeout
# (testing.spawn: 5 minutes) so that the failed rank is still waiting in the agreement
CASE_TIMEOUT_S = 120.0
FAULTS = ("grad", "setup", "step")
# FSDP2 warns when a wrapped module returns a view: the last part's vocabulary head (F.linear
# on a 3-D input) returns one. The warning is about in-place ops on that view, which would skip
# FSDP's pre-backward all-gather; here the logits go straight to the loss (out of place), and
# every gradient is compared with the reference, so a skipped gather would be a FAIL row. Its
# text ("can cause backward to fail") would read as a failure of the check.
_HARMLESS_WARNING = r"FSDP2-wrapped module \(FSDPTinyLM\) returned a view tensor"
_MESH_IDS = itertools.count()  # see _run_case
LAZY_INIT, EAGER_INIT = "lazy init", "eager init"
COMMUNICATOR_MODELS = {
    LAZY_INIT: "no device bound to the group, as torchtitan runs NCCL: lone p2p ops on two-rank communicators "
               "created at their first use",
    EAGER_INIT: "init_process_group(device_id=...): one communicator per process group, created with it, running "
                "every op of the group, lone p2p ops included, in issue order",
}


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
    nccl_models: list[str] = field(default_factory=list)  # the communicator models the order was judged under
    graphs: list[list[int]] = field(default_factory=list)  # [rank, stage, graphs compiled] per compiled stage


def cases_for(world: int, compile_backend: str | None = None) -> list[Case]:
    """Every layout of N processes: DualPipeV on each pp dividing N, DualPipe on each even one;
    each schedule's deepest layout again with deferred receives and sequential pairs, and with
    two-batch overlap; with ``compile_backend``, each schedule's deepest layout again with its blocks compiled in
    place, against the eager reference (each compiled stage must build graphs)."""
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
        if pps:  # lone forwards (and their lone backwards) on two halves of the microbatch
            pp = pps[-1]
            cases.append(Case(schedule, pp, world // pp, 2 * pp + 2, (("two_batch_overlap", "all"),)))
        if pps and compile_backend:
            pp = pps[-1]
            cases.append(Case(schedule, pp, world // pp, 2 * pp + 2,
                              (("compile_backend", compile_backend), ("compile_reference", False))))
    return cases


@dataclass(frozen=True)
class Fault:
    """An injected failure of case ``case`` (its index) on rank ``rank``, for tests of the
    failure path: ``grad`` (a numerics mismatch), ``setup`` (raises before any traffic) or
    ``step`` (raises mid-step)."""
    case: int
    rank: int
    kind: str

    @classmethod
    def parse(cls, text: str) -> Fault:
        case, rank, kind = text.split(":")
        if kind not in FAULTS:
            raise argparse.ArgumentTypeError(f"fault kind must be one of {FAULTS}, got {kind!r}")
        return cls(int(case), int(rank), kind)


def live_groups() -> int:
    """The process groups this process holds, the world's included. Reads ``_world.pg_map``, a
    private name of torch.distributed.distributed_c10d (there in torch 2.11 to 2.14): torch has
    no public way to list them."""
    return len(dist.distributed_c10d._world.pg_map)


def _case_groups(case: Case, timeout_s: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """This rank's pipeline and data-parallel groups for ``case``, laid out as
    ``init_device_mesh(("pp", "dp"))`` would (rank = pp index * dp + dp index), but created
    for this case only: with their own timeout, and never the world group, so that they can
    be destroyed after it. Every rank creates every group (``new_group`` is collective)."""
    rank, dp, timeout = dist.get_rank(), case.dp, timedelta(seconds=timeout_s)
    pp_groups = [dist.new_group([j + k * dp for k in range(case.pp)], timeout=timeout) for j in range(dp)]
    if dp == 1:
        return pp_groups[0], None
    dp_groups = [dist.new_group(list(range(i * dp, (i + 1) * dp)), timeout=timeout) for i in range(case.pp)]
    return pp_groups[rank % dp], dp_groups[rank // dp]


class _Ready:
    """The case's agreement before its first communication: one all-reduce of a flag over the
    world group, which every rank must run exactly once per case."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.asked = device, False

    def __call__(self, ok: bool) -> bool:
        """Whether every rank is ready (``ok``)."""
        self.asked = True
        flag = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


def _raise_in_forward(module: torch.nn.Module, args: Any) -> None:
    raise RuntimeError("injected fault: raised mid-step")


def _factory(schedule: str, ready: _Ready, fault: str | None) -> Callable[..., Any]:
    """Builds the schedule once every rank is ready: its constructor is the case's first
    communication (it agrees on the configuration over the pipeline group)."""
    from .numerics import SCHEDULES

    def build(stages: list, n: int, **kwargs: Any) -> Any:
        if fault == "setup":
            raise RuntimeError("injected fault: raised before any traffic")
        if not ready(True):
            raise RuntimeError("not run: another rank failed before the case's first communication")
        if fault == "step":
            stages[0].submod.register_forward_pre_hook(_raise_in_forward)
        return SCHEDULES[schedule](stages, n, **kwargs)
    return build


def _run_case(case: Case, device: torch.device, fault: str | None = None,
              timeout_s: float = CASE_TIMEOUT_S) -> dict[str, Any]:
    """One case on this rank: train and compare, record communication; what the others need."""
    from torch.distributed.device_mesh import DeviceMesh

    from ..runtime.comm_record import CommRecorder, nccl_eager_init
    from .numerics import train_and_compare

    pp_group, dp_group = _case_groups(case, timeout_s)
    fsdp: dict[str, Any] = {}
    if dp_group is not None:
        # DTensor caches sharding decisions by mesh equality, which ignores the mesh's groups: a
        # mesh equal to an earlier case's would be handed cached specs naming destroyed groups.
        # A dimension name of its own keeps every case's mesh unequal to the earlier ones.
        mesh = DeviceMesh.from_group(dp_group, device.type, mesh_dim_names=(f"dp{next(_MESH_IDS)}",))
        fsdp = dict(fsdp_mesh=mesh, dp_index=dist.get_rank(dp_group), dp_size=case.dp)
    ready, start = _Ready(device), time.perf_counter()
    try:
        with CommRecorder(device=device) as recorder:
            result = train_and_compare(case.schedule, case.pp, case.n, pp_group, dist.get_rank(pp_group),
                                       device=device, factory=_factory(case.schedule, ready, fault),
                                       grad_fault=1.0 if fault == "grad" else 0.0, count_graphs=True, **fsdp,
                                       **dict(case.options))
        # the case's groups, and any other the steps used, whose NCCL communicator was made eagerly
        eager = {g.group_name for g in (pp_group, dp_group) if g is not None and nccl_eager_init(g)}
        return {"ok": True, **result, "events": recorder.events, "eager_groups": eager | recorder.eager_groups,
                "seconds": time.perf_counter() - start, "rank": dist.get_rank()}
    except Exception as err:  # noqa: BLE001 - any failure is this case's FAIL row, on every rank
        failed_at = time.time()  # one machine: ranks' clocks order their failures
        if not ready.asked:  # the others wait in the agreement: tell them
            ready(False)
        return {"ok": False, "error": f"rank {dist.get_rank()}: {type(err).__name__}: {err}", "rank": dist.get_rank(),
                "events": [], "seconds": time.perf_counter() - start, "failed_at": failed_at}
    finally:
        for group in (pp_group, dp_group):
            if group is not None:
                dist.destroy_process_group(group)


def _communicator_models(backend: str, eager_groups: set[str]) -> list[tuple[str, set[str] | None]]:
    """The models to judge a run's order under: (name, the eagerly initialised groups; None: all)."""
    if backend != "nccl":  # gloo has no communicators: the order must suit both ways NCCL runs
        return [(LAZY_INIT, set()), (EAGER_INIT, None)]
    return [(EAGER_INIT if eager_groups else LAZY_INIT, eager_groups)]


def _outcome(case: Case, everyone: list[dict[str, Any]], backend: str = "gloo") -> Outcome:
    """The row every rank agrees on, from every rank's result."""
    from ..orders.nccl_model import Deadlock, check_completes_eager

    outcome = Outcome(case, seconds=max(r["seconds"] for r in everyone))
    failed = sorted((r for r in everyone if not r["ok"]), key=lambda r: r["failed_at"])
    if failed:
        outcome.error, outcome.ranks = "\n".join(r["error"] for r in failed), sorted(r["rank"] for r in failed)
        return outcome
    outcome.grad_err = max(r["grad_err"] for r in everyone)
    outcome.loss_err = max(r["loss_err"] for r in everyone)
    outcome.graphs = [[r["rank"], s, g] for r in everyone for s, g in sorted(r.get("compiled_graphs", {}).items())]
    models = _communicator_models(backend, set().union(*(r["eager_groups"] for r in everyone)))
    outcome.nccl_models = [name for name, _ in models]
    trace = {r["rank"]: r["events"] for r in everyone}
    try:
        for name, eager_groups in models:
            try:
                check_completes_eager(trace, eager_groups)
            except Deadlock as err:
                raise Deadlock(f"under NCCL {name} ({COMMUNICATOR_MODELS[name]}): {err}") from None
        outcome.order, outcome.passed = "completes", True
    except Deadlock as err:
        outcome.order, outcome.error = "would hang", str(err)
    return outcome


def _worker(cases: list[Case], backend: str, fault: Fault | None = None,
            case_timeout_s: float = CASE_TIMEOUT_S) -> list[dict[str, Any]]:
    """Every case on this rank; the outcomes, the same on every rank.

    A failure stays in its case: after each case every rank gathers every rank's result, so all
    agree on its row; a case runs on process groups of its own (:func:`_case_groups`), and all
    ranks agree before its first communication (:class:`_Ready`); a numerics mismatch never stops
    a rank early (:mod:`.numerics`). A rank that raises mid-step strands its peers in the step's
    traffic: under gloo their waits fail by the groups' timeout (``case_timeout_s``, shorter than
    the world's); under NCCL the watchdog then aborts the run, an error instead of a hang."""
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    outcomes = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_HARMLESS_WARNING, category=UserWarning)
        for index, case in enumerate(cases):
            mine = fault.kind if fault and (fault.case, fault.rank) == (index, dist.get_rank()) else None
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, _run_case(case, device, mine, case_timeout_s))
            outcomes.append(asdict(_outcome(case, everyone, backend)))
    return outcomes


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("check", help="run the numerics suite on N local processes (GPUs or CPU)",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--nproc", type=int, required=True, help="number of processes (with nccl: one GPU each)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="nccl (default when this machine has N GPUs) or gloo (CPU)")
    p.add_argument("--json", action="store_true", help="print the outcomes as JSON instead of a table")
    p.add_argument("--compile", metavar="BACKEND", choices=("inductor", "aot_eager"), default=None,
                   help="also run each schedule with its blocks torch.compile'd in place (reference compiled alike)")
    # CASE:RANK:KIND, makes one case fail on one rank (tests of the failure path); not for users
    p.add_argument("--fault", type=Fault.parse, default=None, help=argparse.SUPPRESS)
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
    from ..testing.spawn import run_on_processes

    cases = cases_for(args.nproc, args.compile)
    outcomes = run_on_processes(_worker, args.nproc, cases, backend, args.fault, backend=backend)
    if args.json:
        print(json.dumps({"backend": backend, "nproc": args.nproc, "torch": torch.__version__, "cases": outcomes},
                         indent=1, default=str))
    else:
        print(format_table(outcomes, backend, args.nproc))
    return 0 if all(o["passed"] for o in outcomes) else 1


def _graphs_per_stage(graphs: list[list[int]]) -> str:
    """The graphs each compiled stage built, as a range over stages ('-': nothing compiled)."""
    counts = sorted(g for _, _, g in graphs)
    if not counts:
        return "-"
    return f"{counts[0]}/stage" if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}/stage"


def format_table(outcomes: list[dict[str, Any]], backend: str, nproc: int) -> str:
    rows = [("schedule", "layout", "microbatches", "max grad err", "max loss err", "graphs", "NCCL order", "result",
             "seconds")]
    for o in outcomes:
        case = o["case"]
        layout = Case(case["schedule"], case["pp"], case["dp"], case["n"], tuple(map(tuple, case["options"]))).layout
        graphs = _graphs_per_stage(o.get("graphs", []))
        rows.append((case["schedule"], layout, str(case["n"]), f"{o['grad_err']:.2e}", f"{o['loss_err']:.2e}", graphs,
                     o["order"] or "-", "pass" if o["passed"] else "FAIL", f"{o['seconds']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"titan-dualpipe check: {nproc} processes, {backend}, torch {torch.__version__} ({MIN_STEPS_TOL})"]
    for model in dict.fromkeys(m for o in outcomes for m in o.get("nccl_models", [])):
        lines.append(f"NCCL order judged under {model}: {COMMUNICATOR_MODELS[model]}")
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for o in outcomes:
        if o["error"]:
            lines.append(f"\n{o['case']['schedule']} pp={o['case']['pp']} failed"
                         + (f" on ranks {o['ranks']}" if o["ranks"] else "") + f":\n{o['error']}")
    return "\n".join(lines)
