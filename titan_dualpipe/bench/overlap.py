"""``titan-dualpipe bench overlap``: what overlapping MoE all-to-all in DualPipeV pairs saves.

``--pp P --ep E`` processes train :class:`~titan_dualpipe.overlap.moe.MoETransformer` on the same
model and batches under each schedule: our ScheduleDualPipeV with overlap (through the module's
protocol, and as a relay) and without, both overlapped runs again with two-batch overlap, torch's
ScheduleDualPipeV and ScheduleZBVZeroBubble, and on request our ScheduleDualPipe and compiled
blocks. Every all-to-all pays an emulated network's cost (a sleep on the CPU, a sleep kernel on
a GPU's side stream), calibrated against a block's compute. Paired rotated rounds give step time,
exposed communication, on the CPU the CPU bound, and each run's exposure next to its floor (on a
GPU its segments timed by CUDA events).
The runs, the emulated network, every column and JSON key: benchmarks/README.md#bench-overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..cli import HelpFormatter
from ..exposure.record import (STEP_KEYS, DeferredRecorder, ExposureRecorder, StepTrace, pair_exposure,
                               start_recording, step_exposure, stop_recording)
from ..overlap.comm import EmulatedNetwork, ExpertParallelComm
from ..cut import cut_layers
from ..overlap.moe import MoEArgs, MoETransformer, expert_parallel, set_exchange_chunks
from ..testing.model import compile_blocks, lm_loss
from ..testing.spawn import run_on_processes

DUALPIPE_CONFIGS = ("dualpipe_overlap", "dualpipe_sequential")
# (name, run as a relay, overlap) of the runs with compiled blocks
COMPILED_CONFIGS = (("compiled_overlap", False, True), ("compiled_relay", True, True),
                    ("compiled_sequential", False, False))
# --dim / --seq when not given: a GPU needs blocks large enough to be compute-bound, not launch-bound.
DEFAULT_SIZES = {"cpu": {"dim": 64, "seq": 32}, "cuda": {"dim": 1024, "seq": 1024}}


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("overlap", help="MoE all-to-all overlap in DualPipeV pairs (default: 4 CPU processes, "
                                         "pp=2 x ep=2)",
                         formatter_class=HelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel ranks per pipeline rank")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: gloo processes; cuda: NCCL, one GPU per process (--pp 1 --ep 1 on one GPU)")
    p.add_argument("--rounds", type=int, default=5, help="paired rounds")
    p.add_argument("--steps", type=int, default=1, help="timed steps per schedule per round")
    p.add_argument("--microbatches", type=int, default=24, help="per step, >= 2 * pp")
    p.add_argument("--layers", type=int, default=4, help="MoE blocks, split over 2 * pp stages")
    p.add_argument("--dim", type=int, default=None, help="model dim (default: 64 on cpu, 1024 on cuda)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 32 on cpu, 1024 on cuda)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--comm-ratio", type=float, default=1.0,
                   help="calibrated cost of a block's four exchanges / its compute")
    p.add_argument("--latency-ms", type=float, default=None, help="fixed latency per all-to-all (skips calibration)")
    p.add_argument("--bandwidth-gbps", type=float, default=None,
                   help="fixed bandwidth in GB/s (1e9 bytes/s) per all-to-all (skips calibration)")
    p.add_argument("--dualpipe", action="store_true", help="also time our ScheduleDualPipe, overlap on and off")
    p.add_argument("--compile", metavar="BACKEND", choices=("inductor", "aot_eager"), default=None,
                   help="also time the blocks torch.compile'd in place (overlap, relay, sequential)")
    p.add_argument("--exchange-chunks", type=int, default=1, metavar="K",
                   help="also time both overlapped runs (protocol, relay) with every dispatch and combine cut into K "
                        "exchanges (docs/overlap.md#chunked-exchanges), paired with the whole ones; at most "
                        "--experts / --ep")
    p.add_argument("--charged-ep", type=int, default=None, metavar="N",
                   help="the emulated network charges each exchange the bytes N expert-parallel ranks would send "
                        "away (default: --ep). On one rank (--ep 1) nothing leaves and an exchange costs its latency "
                        "alone; --charged-ep 8 gives it a cost that grows with its size, as chunks need")
    p.add_argument("--no-relay", dest="relay", action="store_false",
                   help="skip the overlap_relay run (the module without its protocol)")
    p.add_argument("--per-pair", action="store_true",
                   help="also print each pair of rank 0's last step: measured, in order, floor and 1F1B exposure")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.set_defaults(func=run)


def _check(cfg: dict) -> None:
    pp, ep = cfg["pp"], cfg["ep"]
    if cfg["device"] == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if pp * ep > gpus:
            raise ValueError(f"--device cuda needs one GPU per process: --pp {pp} x --ep {ep} = {pp * ep} processes, "
                             f"{gpus} GPUs here; on one GPU use --pp 1 --ep 1")
    if cfg["comm_ratio"] < 0:
        raise ValueError(f"--comm-ratio must be >= 0, got {cfg['comm_ratio']}")
    if cfg["latency_ms"] is not None and cfg["latency_ms"] < 0:
        raise ValueError(f"--latency-ms must be >= 0, got {cfg['latency_ms']}")
    if cfg["bandwidth_gbps"] is not None and cfg["bandwidth_gbps"] <= 0:
        raise ValueError(f"--bandwidth-gbps must be > 0, got {cfg['bandwidth_gbps']}")
    for name in ("pp", "ep", "rounds", "steps", "dim", "seq", "experts"):
        if cfg[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {cfg[name]}")
    if cfg.get("charged_ep") is not None and cfg["charged_ep"] < 1:
        raise ValueError(f"--charged-ep must be >= 1, got {cfg['charged_ep']}")
    if cfg["microbatches"] < 2 * pp or (cfg["dualpipe"] and cfg["microbatches"] % 2):
        raise ValueError(f"--microbatches must be >= {2 * pp} (2 * pp; and even with --dualpipe), "
                         f"got {cfg['microbatches']}")
    if cfg["dualpipe"] and pp % 2:
        raise ValueError(f"--dualpipe needs an even --pp, got {pp}")
    if cfg["layers"] < 2 * pp:
        raise ValueError(f"--layers must be >= {2 * pp} (one block per stage at least), got {cfg['layers']}")
    if cfg["experts"] % ep:
        raise ValueError(f"--experts must be divisible by the expert-parallel size {ep}, got {cfg['experts']}")
    chunks, local = cfg.get("exchange_chunks", 1), cfg["experts"] // ep
    if not 1 <= chunks <= local:
        raise ValueError(f"--exchange-chunks must be from 1 to {local} (a chunk holds whole experts: --experts "
                         f"{cfg['experts']} / --ep {ep} local experts), got {chunks}")


# -- per rank -----------------------------------------------------------------------------------
def _model_args(cfg: dict) -> MoEArgs:
    return MoEArgs(vocab_size=512, dim=cfg["dim"], n_layers=cfg["layers"], n_heads=4, num_experts=cfg["experts"],
                   top_k=2, moe_inter_dim=2 * cfg["dim"], capacity_factor=1.25)


def _groups(pp: int, ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None, int, int]:
    """This rank's pipeline group, expert-parallel group (None for one rank) and indices."""
    rank = dist.get_rank()
    ep_groups = [dist.new_group([p * ep + e for e in range(ep)]) for p in range(pp)]
    pp_groups = [dist.new_group([p * ep + e for p in range(pp)]) for e in range(ep)]
    pp_rank, ep_index = divmod(rank, ep)
    return pp_groups[ep_index], ep_groups[pp_rank] if ep > 1 else None, pp_rank, ep_index


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _block_seconds(cfg: dict, comm: ExpertParallelComm) -> float:
    """Median forward + backward time of one block on one microbatch, exchanges free."""
    torch.manual_seed(0)
    device = _device()
    block = MoETransformer(_model_args(cfg)).layers["0"]
    expert_parallel(block, comm)
    block.to(device)
    h = torch.randn(2, cfg["seq"], cfg["dim"], device=device, requires_grad=True)
    times = []
    for _ in range(12):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        block(h).sum().backward()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def _network(cfg: dict, comm: ExpertParallelComm) -> tuple[EmulatedNetwork, dict]:
    args = _model_args(cfg)
    tokens = 2 * cfg["seq"]
    exchange_bytes = args.num_experts * args.capacity(tokens) * args.dim * 4  # fp32 dispatch buffer
    charged = cfg.get("charged_ep") or cfg["ep"]
    remote_bytes = exchange_bytes * (charged - 1) // charged
    if cfg["latency_ms"] is not None or cfg["bandwidth_gbps"] is not None:
        latency = (cfg["latency_ms"] or 0.0) / 1e3
        bandwidth = cfg["bandwidth_gbps"] * 1e9 if cfg["bandwidth_gbps"] else float("inf")
        block_s = None
    else:
        samples: list = [None] * dist.get_world_size()
        dist.all_gather_object(samples, _block_seconds(cfg, comm))
        block_s = statistics.median(samples)
        per_exchange = cfg["comm_ratio"] * block_s / 4
        if remote_bytes and per_exchange:  # half latency, half bandwidth
            latency, bandwidth = per_exchange / 2, remote_bytes / (per_exchange / 2)
        else:  # one expert-parallel rank: nothing crosses a network, the time still passes
            latency, bandwidth = per_exchange, float("inf")
    net = EmulatedNetwork(latency, bandwidth)
    settings = {"latency_ms": latency * 1e3, "bandwidth_gbps": bandwidth / 1e9, "exchange_remote_bytes": remote_bytes,
                "exchange_ms": net.seconds(remote_bytes) * 1e3,
                "block_compute_ms": None if block_s is None else block_s * 1e3, "comm_ratio": cfg["comm_ratio"]}
    return net, settings


class RelayedMoETransformer(MoETransformer):
    """The same module without its overlap protocols: the runtime overlaps its pairs (and
    two-batch sub-batches) as a relay switching at the exchanges, as it does for
    torchtitan's MoE blocks."""

    overlapped_forward_backward = None
    overlapped_sub_batches_forward = None
    overlapped_sub_batches_backward = None


@dataclass
class _Parts:
    """Builds this rank's stages of the benchmark model (every copy from the same initial weights)."""

    model: MoETransformer
    pp: int
    pp_rank: int
    pp_group: Any
    comm: ExpertParallelComm
    device: torch.device

    def ready(self, module: MoETransformer, relay: bool = False,
              compile_backend: str | None = None, chunks: int = 1) -> MoETransformer:
        """``module`` relayed (no overlap protocols) if asked, over ``comm``, its exchanges cut in ``chunks``,
        on the device, compiled if asked."""
        if relay:
            module.__class__ = RelayedMoETransformer
        expert_parallel(module, self.comm)
        set_exchange_chunks(module, chunks)
        module.to(self.device)
        if compile_backend:
            compile_blocks(module.layers.values(), compile_backend)
        return module

    def v_modules(self, relay: bool = False, compile_backend: str | None = None,
                  chunks: int = 1) -> dict[int, MoETransformer]:
        """A fresh copy of this rank's two DualPipeV parts (the same model split again), by stage."""
        parts = cut_layers(self.model, 2 * self.pp)
        return {s: self.ready(parts[s], relay, compile_backend, chunks)
                for s in (self.pp_rank, 2 * self.pp - 1 - self.pp_rank)}

    def dualpipe_modules(self, n: int) -> dict[int, MoETransformer]:
        """This rank's two DualPipe parts (a model part per direction), by stage."""
        from .. import placement

        place = placement("DualPipe", self.pp, n)
        parts = cut_layers(self.model, self.pp)
        return {s: self.ready(parts[place.model_part(s)]) for s in place.stages_of(self.pp_rank)}

    def stages(self, modules: dict[int, MoETransformer]) -> list:
        from torch.distributed.pipelining import PipelineStage

        return [PipelineStage(m, s, 2 * self.pp, self.device, group=self.pp_group) for s, m in modules.items()]


def _schedules(cfg: dict, pp_group, comm: ExpertParallelComm, pp_rank: int) -> dict[str, tuple[Any, bool]]:
    """Config name -> (schedule, whether this rank passes inputs and targets)."""
    device = _device()
    torch.manual_seed(0)
    parts = _Parts(MoETransformer(_model_args(cfg)), cfg["pp"], pp_rank, pp_group, comm, device)
    out = _v_schedules(parts, cfg["microbatches"])
    if cfg["relay"]:
        out |= _relay_schedules(parts, cfg["microbatches"])
    if cfg.get("exchange_chunks", 1) > 1:
        out |= _chunked_schedules(parts, cfg["microbatches"], cfg["exchange_chunks"], cfg["relay"])
    if cfg["compile"]:
        out |= _compiled_schedules(parts, cfg["microbatches"], cfg["compile"], cfg["relay"])
    if cfg["dualpipe"]:
        out |= _dualpipe_schedules(parts, cfg["microbatches"])
    return out


def _v_schedules(parts: _Parts, n: int) -> dict[str, tuple[Any, bool]]:
    """Ours with and without overlap and two-batch overlap on the same modules, and torch's V
    schedules on a copy of them (the same weights, without our deferrable layers)."""
    from torch.distributed.pipelining import ScheduleDualPipeV as TorchDualPipeV
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    from .. import ScheduleDualPipeV
    from .._compat.stage_init import runnable_on_gloo

    modules, torch_modules, feeds = parts.v_modules(), parts.v_modules(), parts.pp_rank == 0
    return {
        "overlap": (ScheduleDualPipeV(parts.stages(modules), n, loss_fn=lm_loss, overlap=True), feeds),
        "overlap_two_batch": (ScheduleDualPipeV(parts.stages(modules), n, loss_fn=lm_loss, overlap=True,
                                                two_batch_overlap=True), feeds),
        TWO_BATCH_MEASURED[0]: (ScheduleDualPipeV(parts.stages(modules), n, loss_fn=lm_loss, overlap=True,
                                                  two_batch_overlap="measured"), feeds),
        "sequential": (ScheduleDualPipeV(parts.stages(modules), n, loss_fn=lm_loss, overlap=False), feeds),
        "torch_dualpipev": (runnable_on_gloo(TorchDualPipeV(parts.stages(torch_modules), n, loss_fn=lm_loss)),
                            feeds),
        "torch_zbv": (runnable_on_gloo(ScheduleZBVZeroBubble(parts.stages(torch_modules), n, loss_fn=lm_loss)),
                      feeds),
    }


# the relay with pair_first="measured" (each kind of pair in the order measured to expose least) and
# "measured_first" (alternating, from the half measured to expose less)
MEASURED = ("relay_measured_order", "relay_measured_first")
# two-batch overlap on the stages where the run's own times say it pays: through the protocol, as a relay
TWO_BATCH_MEASURED = ("overlap_two_batch_measured", "relay_two_batch_measured")
# warm-up steps before the timed rounds: one (shape inference, the allocator), and what "measured" options time
WARM_UP_STEPS = {MEASURED[0]: 2, MEASURED[1]: 2, TWO_BATCH_MEASURED[0]: 5, TWO_BATCH_MEASURED[1]: 5}


def _relay_schedules(parts: _Parts, n: int) -> dict[str, tuple[Any, bool]]:
    """Overlap and two-batch overlap (on, and "measured") as a relay, and the relay with
    ``pair_first="measured"`` and ``"measured_first"``, each on its own copy."""
    from .. import ScheduleDualPipeV

    feeds = parts.pp_rank == 0
    return {
        "overlap_relay": (ScheduleDualPipeV(parts.stages(parts.v_modules(relay=True)), n, loss_fn=lm_loss,
                                            overlap=True), feeds),
        **{name: (ScheduleDualPipeV(parts.stages(parts.v_modules(relay=True)), n, loss_fn=lm_loss, overlap=True,
                                    pair_first=mode), feeds)
           for name, mode in zip(MEASURED, ("measured", "measured_first"))},
        "relay_two_batch": (ScheduleDualPipeV(parts.stages(parts.v_modules(relay=True)), n, loss_fn=lm_loss,
                                              overlap=True, two_batch_overlap=True), feeds),
        TWO_BATCH_MEASURED[1]: (ScheduleDualPipeV(parts.stages(parts.v_modules(relay=True)), n, loss_fn=lm_loss,
                                                  overlap=True, two_batch_overlap="measured"), feeds),
    }


def chunked_names(chunks: int) -> tuple[str, str]:
    """The runs with exchanges cut in ``chunks``: through the protocol, as a relay."""
    return f"overlap_chunks{chunks}", f"relay_chunks{chunks}"


def _chunked_schedules(parts: _Parts, n: int, chunks: int, relay_too: bool) -> dict[str, tuple[Any, bool]]:
    """Overlap (and as a relay) with every exchange cut in ``chunks``, each on its own copy."""
    from .. import ScheduleDualPipeV

    out = {}
    for name, relay in zip(chunked_names(chunks), (False, True), strict=True):
        if relay and not relay_too:
            continue
        stages = parts.stages(parts.v_modules(relay=relay, chunks=chunks))
        out[name] = (ScheduleDualPipeV(stages, n, loss_fn=lm_loss, overlap=True), parts.pp_rank == 0)
    return out


def _compiled_schedules(parts: _Parts, n: int, backend: str, relay_too: bool) -> dict[str, tuple[Any, bool]]:
    """:data:`COMPILED_CONFIGS`, each on its own compiled copy (graphs guard on their module)."""
    from .. import ScheduleDualPipeV

    out = {}
    for name, relay, overlap in COMPILED_CONFIGS:
        if relay and not relay_too:
            continue
        stages = parts.stages(parts.v_modules(relay=relay, compile_backend=backend))
        out[name] = (ScheduleDualPipeV(stages, n, loss_fn=lm_loss, overlap=overlap), parts.pp_rank == 0)
    return out


def _dualpipe_schedules(parts: _Parts, n: int) -> dict[str, tuple[Any, bool]]:
    """DualPipe with and without overlap, on the same modules (every rank passes inputs)."""
    from .. import ScheduleDualPipe

    modules = parts.dualpipe_modules(n)
    return {name: (ScheduleDualPipe(parts.stages(modules), n, loss_fn=lm_loss, overlap=overlap), True)
            for name, overlap in zip(DUALPIPE_CONFIGS, (True, False), strict=True)}


def _timed_steps(schedule, feeds: bool, x, y, steps: int, comm: ExpertParallelComm,
                 modules: Callable[[], list], record: ExposureRecorder | DeferredRecorder | None = None,
                 traces: list[StepTrace] | None = None) -> tuple[float, float, float, list[float]]:
    """Per step on this rank: seconds, seconds blocked in all-to-all waits, CPU seconds
    (all threads of the process, gloo's included), exchanges charged [forward, backward]; with
    ``record``, each step's trace of pairs and exchanges is appended to ``traces``."""
    device = x.device
    _sync(device)
    dist.barrier()
    comm.stats.reset()
    if record is not None:
        record.take()  # what ran before (the barrier, the previous run's last clean-up) is no step's
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        schedule.step(x, target=y) if feeds else schedule.step()
        if record is not None and traces is not None:
            traces.append(record.take())
        for m in modules():
            m.zero_grad(set_to_none=True)
    _sync(device)
    waited, cpu = comm.stats.collect(), time.process_time() - cpu_start
    charged = [comm.stats.charged_forward / steps, comm.stats.charged_backward / steps,
               comm.stats.charged_bytes / steps]
    dist.barrier()
    return (time.perf_counter() - start) / steps, waited / steps, cpu / steps, charged


def _queue(device: torch.device) -> str:
    """How this emulator's exchanges queue in the floor's model: on the CPU each flies on its own
    (no channel); on a GPU their delays run one after another on one side stream."""
    return "serial" if device.type == "cuda" else "fifo"


def _exposure(traces: dict[str, list[list[StepTrace]]], device: torch.device) -> dict[str, dict[str, float]]:
    """Per run: each of :data:`STEP_KEYS` per step (mean over a round's steps, median over rounds),
    mean over ranks."""
    names = list(traces)
    queue = _queue(device)
    medians = [[statistics.median(statistics.mean(step_exposure(t, queue)[key] for t in steps) for steps in traces[name])
                for key in STEP_KEYS] for name in names]
    values = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(values)
    values /= dist.get_world_size()
    return {name: dict(zip(STEP_KEYS, row, strict=True)) for name, row in zip(names, values.tolist(), strict=True)}


def _per_pair(step: StepTrace, device: torch.device) -> list[dict[str, float]]:
    return [vars(pair_exposure(pair, _queue(device))) for pair in step.pairs]


def _worker(cfg: dict) -> dict:
    pp_group, ep_group, pp_rank, ep_index = _groups(cfg["pp"], cfg["ep"])
    comm = ExpertParallelComm(ep_group, charged_size=cfg.get("charged_ep"))
    net, settings = _network(cfg, comm)
    comm.network = net
    comm.stats.timing = True  # GPU stalls timed per exchange; each _timed_steps drains them
    n = cfg["microbatches"]
    g = torch.Generator().manual_seed(1 + ep_index)  # each pipeline its own data shard
    x = torch.randint(0, 512, (2 * n, cfg["seq"]), generator=g).to(_device())
    y = torch.randint(0, 512, (2 * n, cfg["seq"]), generator=g).to(_device())
    schedules = _schedules(cfg, pp_group, comm, pp_rank)
    names = list(schedules)

    def modules_of(name: str) -> Callable[[], list]:
        return lambda: [stage.submod for stage in schedules[name][0]._stages]

    for name in names:  # warm-up: shape inference, allocator; the "measured" options' own steps
        _timed_steps(*schedules[name], x, y, WARM_UP_STEPS.get(name, 1), comm, modules_of(name))
    # The floor's segments: timed by the host's clock on the CPU, by CUDA events on the compute
    # stream on a GPU (whose kernels run behind the host), read once per step.
    record = start_recording(device=_device())
    step_s: dict[str, list[float]] = {name: [] for name in names}
    exposed: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    charged: dict[str, list[float]] = {}  # the same every round
    # Per round, per step. The floor's model has one exchange in flight per half: chunked runs, which post
    # a cut exchange's chunks at once, are recorded (the same overhead) but get no floor.
    traces: dict[str, list[list[StepTrace]]] = {name: [] for name in names
                                                if name not in chunked_names(cfg.get("exchange_chunks", 1))}
    try:
        for r in range(cfg["rounds"]):
            for name in names[r % len(names):] + names[: r % len(names)]:
                kept = traces[name] if name in traces else []
                kept.append([])
                t, w, c, charged[name] = _timed_steps(*schedules[name], x, y, cfg["steps"], comm, modules_of(name),
                                                      record, kept[-1])
                step_s[name].append(t)
                exposed[name].append(w)
                cpu[name].append(c)
    finally:
        stop_recording()
    device = _device()
    charged_total = torch.tensor([charged[name] for name in names], dtype=torch.float64, device=device)
    dist.all_reduce(charged_total)
    exposed_mean = torch.tensor([statistics.median(exposed[name]) for name in names], dtype=torch.float64, device=device)
    dist.all_reduce(exposed_mean)
    exposed_mean /= dist.get_world_size()
    cpu_total = torch.tensor([statistics.median(cpu[name]) for name in names], dtype=torch.float64, device=device)
    dist.all_reduce(cpu_total)
    return {"step_time": {name: statistics.median(step_s[name]) for name in names}, "step_rounds": step_s,
            "exposed_comm": dict(zip(names, exposed_mean.tolist(), strict=True)),
            "cpu_seconds": dict(zip(names, cpu_total.tolist(), strict=True)),
            "charged": dict(zip(names, charged_total.tolist(), strict=True)), "network": settings,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "exposure": _exposure(traces, device),
            "pairs": {name: _per_pair(traces[name][-1][-1], device) for name in traces},
            "two_batch_savings": {name: schedules[name][0].two_batch_choice.savings
                                  for name in TWO_BATCH_MEASURED if name in schedules},
            "two_batch_chosen": {name: sorted(schedules[name][0].two_batch_choice.chosen_everywhere)
                                 for name in TWO_BATCH_MEASURED if name in schedules}}


# -- driver -------------------------------------------------------------------------------------
def measure(cfg: dict) -> dict:
    _check(cfg)
    world = cfg["pp"] * cfg["ep"]
    raw = run_on_processes(_worker, world, cfg, backend="nccl" if cfg["device"] == "cuda" else "gloo")
    result = {f"step_time_{name}": raw["step_time"][name] for name in raw["step_time"]}
    result.update({f"exposed_comm_{name}": raw["exposed_comm"][name] for name in raw["exposed_comm"]})
    for name, (forward, backward, remote_bytes) in raw["charged"].items():  # per step, all ranks
        result[f"charged_forward_{name}"], result[f"charged_backward_{name}"] = forward, backward
        result[f"charged_bytes_{name}"] = remote_bytes
    if cfg["device"] == "cpu":  # no schedule can finish a step before the cores did all its CPU work
        cores = min(len(os.sched_getaffinity(0)), world)
        result.update({f"cpu_bound_{name}": raw["cpu_seconds"][name] / cores for name in raw["cpu_seconds"]})
        result["cores"] = cores
    result["overlap_vs_sequential"] = result["step_time_overlap"] / result["step_time_sequential"]
    result["two_batch_vs_overlap"] = result["step_time_overlap_two_batch"] / result["step_time_overlap"]
    if cfg["relay"]:
        result["overlap_relay_vs_sequential"] = result["step_time_overlap_relay"] / result["step_time_sequential"]
    if cfg["compile"]:
        for name in ("compiled_overlap", "compiled_relay"):
            if f"step_time_{name}" in result:
                result[f"{name}_vs_sequential"] = result[f"step_time_{name}"] / result["step_time_compiled_sequential"]
    if cfg.get("exchange_chunks", 1) > 1:
        result["exchange_chunks"] = _chunked_vs_whole(raw["step_rounds"], cfg["exchange_chunks"])
    if cfg["dualpipe"]:
        result["dualpipe_overlap_vs_sequential"] = (result["step_time_dualpipe_overlap"]
                                                    / result["step_time_dualpipe_sequential"])
    # s/step: measured, floor, 1F1B (every exchange exposed); by pairs and lone halves
    result["exposure"] = raw["exposure"]
    result["pairs_last_step_rank0"] = raw["pairs"]
    result["network"] = raw["network"]
    if raw["gpu"] is not None:
        result["gpu"] = raw["gpu"]
    result["two_batch_savings"] = raw["two_batch_savings"]  # by stage, seconds the split step saved, all ranks
    result["two_batch_chosen"] = raw["two_batch_chosen"]  # the stages that split after it
    result["config"] = cfg
    return result


def _chunked_vs_whole(rounds: dict[str, list[float]], chunks: int) -> dict[str, list[float]]:
    """Per overlapped run: its step time with exchanges in ``chunks`` over whole, within each round (rank 0's)."""
    out = {}
    for whole, chunked in zip(("overlap", "overlap_relay"), chunked_names(chunks), strict=True):
        if chunked in rounds:
            out[whole] = [c / w for c, w in zip(rounds[chunked], rounds[whole], strict=True)]
    return out


def run(args: argparse.Namespace) -> int:
    keys = ("pp", "ep", "device", "rounds", "steps", "microbatches", "layers", "dim", "seq", "experts", "comm_ratio",
            "latency_ms", "bandwidth_gbps", "dualpipe", "relay", "compile", "exchange_chunks", "charged_ep")
    cfg = {k: getattr(args, k) for k in keys}
    for name, size in DEFAULT_SIZES[cfg["device"]].items():
        cfg[name] = size if cfg[name] is None else cfg[name]
    result = measure(cfg)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    net = result["network"]
    how = (f"calibrated: block forward+backward {net['block_compute_ms']:.2f} ms, comm ratio {net['comm_ratio']}"
           if net["block_compute_ms"] is not None else "set on the command line")
    where = f"GPU processes ({result['gpu']})" if "gpu" in result else "CPU processes"
    print(f"pp={cfg['pp']} x ep={cfg['ep']} {where}, "
          f"{cfg['microbatches']} microbatches, {cfg['layers']} MoE blocks "
          f"(dim {cfg['dim']}, {cfg['experts']} experts, top-2), seq {cfg['seq']}; "
          f"median of {cfg['rounds']} paired rounds x {cfg['steps']} steps")
    print(f"emulated network ({how}): latency {net['latency_ms']:.3f} ms, bandwidth {net['bandwidth_gbps']:.4f} GB/s "
          f"-> {net['exchange_ms']:.2f} ms per all-to-all ({net['exchange_remote_bytes']} remote bytes)")
    _print_table(result, cpu=cfg["device"] == "cpu")
    print()
    print(exposure_table(result["exposure"]))
    if args.per_pair:
        print()
        print(per_pair_table(result["pairs_last_step_rank0"]))
    print()
    print(f"overlap / sequential step time: {result['overlap_vs_sequential']:.3f}"
          + (f" (relay: {result['overlap_relay_vs_sequential']:.3f})" if cfg["relay"] else ""))
    print(f"with two-batch overlap / without: step time {result['two_batch_vs_overlap']:.3f}, exposed comm "
          f"{result['exposed_comm_overlap_two_batch']:.4f} / {result['exposed_comm_overlap']:.4f} s")
    for name, savings in result["two_batch_savings"].items():
        print(f"{name}: splitting saved, per stage (s, the warm-up's split steps against its whole steps, all ranks): "
              + ", ".join(f"{stage}: {saved:+.4f}" for stage, saved in sorted(savings.items()))
              + f"; split from then on: stages {result['two_batch_chosen'][name]}")
    if "exchange_chunks" in result:
        _print_chunked(result, cfg["exchange_chunks"])
    if cfg["compile"]:
        relay = f", relay {result['compiled_relay_vs_sequential']:.3f}" if cfg["relay"] else ""
        print(f"compiled blocks ({cfg['compile']}), over compiled sequential: "
              f"overlap {result['compiled_overlap_vs_sequential']:.3f}{relay}")
    return 0


def _print_chunked(result: dict, chunks: int) -> None:
    """Each overlapped run with whole exchanges and cut in ``chunks``, side by side."""
    for (whole, ratios), chunked in zip(result["exchange_chunks"].items(), chunked_names(chunks)):
        per_round = " ".join(f"{r:.3f}" for r in ratios)
        print(f"exchanges in {chunks} chunks / whole, {whole}: step time {result['step_time_' + chunked]:.4f} / "
              f"{result['step_time_' + whole]:.4f} s (per round: {per_round}; median {statistics.median(ratios):.3f}), "
              f"exposed comm {result['exposed_comm_' + chunked]:.4f} / {result['exposed_comm_' + whole]:.4f} s")


def exposure_table(exposure: dict[str, dict[str, float]]) -> str:
    """Measured exposure, its floor and 1F1B's side by side, per run (seconds per step, mean over
    ranks), in all and split into pairs and lone halves."""
    width = max(26, *(len(name) + 2 for name in exposure))
    lines = [
        "exposed all-to-all, s/step, mean over ranks: measured (blocked in waits); late (of it, past the emulated "
        "time: a peer posting late, a sleep woken late; slept: the sleeps' part; counts: token-count reads'); "
        "floor (each pair's halves in the order that exposes least, from the run's own segment and exchange times; "
        "lone halves: every exchange but what their own compute covers); 1F1B (every exchange exposed); in order: "
        "the pairs' measured segments in the order they ran",
        f"{'schedule':<{width}}{'measured':>9}{'late':>8}{'slept':>8}{'counts':>8}{'floor':>8}{'1F1B':>8}"
        f"{'floor/1F1B':>11}{'meas/1F1B':>10}{'pairs: meas':>12}{'late':>8}{'in order':>9}{'floor':>8}{'1F1B':>8}"
        f"{'lone: meas':>11}{'late':>8}{'floor':>8}"]
    for name, e in exposure.items():
        share = (lambda v: f"{v / e['serial']:.2f}") if e["serial"] else (lambda v: "-")
        lines.append(f"{name:<{width}}{e['measured']:>9.4f}{e['late']:>8.4f}{e['overslept']:>8.4f}"
                     f"{e['count_late']:>8.4f}{e['floor']:>8.4f}{e['serial']:>8.4f}"
                     f"{share(e['floor']):>11}{share(e['measured']):>10}{e['pairs_measured']:>12.4f}"
                     f"{e['pairs_late']:>8.4f}{e['pairs_in_order']:>9.4f}{e['pairs_floor']:>8.4f}"
                     f"{e['pairs_serial']:>8.4f}{e['lone_measured']:>11.4f}{e['lone_late']:>8.4f}"
                     f"{e['lone_floor']:>8.4f}")
    return "\n".join(lines)


def per_pair_table(pairs: dict[str, list[dict[str, float]]]) -> str:
    """Each pair of rank 0's last step, per run with pairs: exposure in ms."""
    lines = ["each pair of rank 0's last step, exposed all-to-all in ms: measured (late) / in order / floor / 1F1B"]
    for name, rows in pairs.items():
        if rows:
            lines.append(f"{name}: " + "  ".join(f"{p['measured'] * 1e3:.1f} ({p['late'] * 1e3:.1f})/"
                                                 f"{p['in_order'] * 1e3:.1f}/{p['floor'] * 1e3:.1f}/"
                                                 f"{p['serial'] * 1e3:.1f}" for p in rows))
    return "\n".join(lines)


def _print_table(result: dict, cpu: bool) -> None:
    """One row per run: step time, exposed comm, CPU bound (CPU runs), exchanges charged."""
    print(f"{'schedule':<26}{'s/step':>10}{'exposed comm s/step':>22}" + (f"{'CPU bound s/step':>19}" if cpu else "")
          + f"{'exchanges fwd+bwd/step':>25}{'MB/step':>10}")
    charged = set()
    for key in [k for k in result if k.startswith("step_time_")]:
        name = key[len("step_time_"):]
        exchanges = f"{result['charged_forward_' + name]:g}+{result['charged_backward_' + name]:g}"
        charged.add(result["charged_bytes_" + name])
        print(f"{name:<26}{result[key]:>10.4f}{result['exposed_comm_' + name]:>22.4f}"
              + (f"{result['cpu_bound_' + name]:>19.4f}" if cpu else "") + f"{exchanges:>25}"
              + f"{result['charged_bytes_' + name] / 1e6:>10.3f}")
    # Equal bytes: every run paid the emulated network for the same data (equal work); two-batch
    # runs send it in more, smaller exchanges (each paying the latency).
    print("exchanges: all-to-alls charged by the emulated network per step, all ranks, and their remote bytes; "
          + ("the same bytes in every run" if len(charged) == 1 else "NOT the same bytes in every run: unequal work"))
    if cpu:
        print(f"CPU bound: all processes' CPU seconds per step / {result['cores']} usable cores")
