"""``titan-dualpipe bench runtime``: step time of our schedules vs torch's, 2 CPU processes.

Every schedule trains the same TinyLM on the same batches. Repetitions are paired: each
round times a few steps of every schedule (in a rotated order), and the medians over
rounds are reported, with ratios to torch's ScheduleDualPipeV.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..cli import HelpFormatter
from ..cut import cut_layers
from ..testing.model import TinyLM, lm_loss
from ..testing.spawn import run_on_processes

OURS = ("DualPipeV", "DualPipeV sequential", "DualPipe")  # sequential: overlap=False
TORCH = ("torch DualPipeV", "ZBVZeroBubble", "Interleaved1F1B")
PP = 2


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("runtime", help="our DualPipeV/DualPipe vs torch's schedules (2 CPU processes)",
                         formatter_class=HelpFormatter)
    p.add_argument("--rounds", type=int, default=7, help="paired rounds")
    p.add_argument("--steps", type=int, default=3, help="timed steps per schedule per round")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    p.add_argument("--dim", type=int, default=128, help="TinyLM model width")
    p.add_argument("--layers", type=int, default=8, help="TinyLM blocks")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.set_defaults(func=run)


def _stage_ids(name: str, rank: int) -> list[int]:
    if name == "Interleaved1F1B":
        return [rank, rank + PP]  # loop placement
    return [rank, 2 * PP - 1 - rank]  # V placement


def _schedule(name: str, model: TinyLM, n: int, rank: int):
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV as TorchDualPipeV
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

    from .. import ScheduleDualPipe, ScheduleDualPipeV
    from .._compat.stage_init import runnable_on_gloo

    classes: dict[str, Callable[..., Any]] = {
        "DualPipeV": ScheduleDualPipeV, "DualPipeV sequential": functools.partial(ScheduleDualPipeV, overlap=False),
        "DualPipe": ScheduleDualPipe, "torch DualPipeV": TorchDualPipeV,
        "ZBVZeroBubble": ScheduleZBVZeroBubble, "Interleaved1F1B": ScheduleInterleaved1F1B,
    }
    num_stages = 2 * PP
    parts = cut_layers(model, PP if name == "DualPipe" else num_stages)
    stages = []
    for s in _stage_ids(name, rank):
        part = parts[s % PP] if name == "DualPipe" else parts[s]
        stages.append(PipelineStage(part, s, num_stages, torch.device("cpu")))
    return runnable_on_gloo(classes[name](stages, n, loss_fn=lm_loss)), stages


def _feeds(name: str, rank: int) -> bool:
    """Whether this rank passes inputs/targets: it holds a first or a last stage."""
    ids = _stage_ids(name, rank)
    if name == "DualPipe":
        return rank in (0, PP - 1)
    return 0 in ids or 2 * PP - 1 in ids


def _time_steps(schedule, feeds: bool, x, y, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        schedule.step(x, target=y) if feeds else schedule.step()
    dist.barrier()
    return (time.perf_counter() - start) / steps


def _worker(cfg: dict) -> dict[str, float]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM(vocab=512, dim=cfg["dim"], layers=cfg["layers"], heads=4)
    n = cfg["microbatches"]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 512, (4 * n, cfg["seq"]), generator=g)
    y = torch.randint(0, 512, (4 * n, cfg["seq"]), generator=g)
    names = list(OURS + TORCH)
    schedules = {name: _schedule(name, model, n, rank)[0] for name in names}
    for name in names:  # warm-up: shape inference, allocator
        _time_steps(schedules[name], _feeds(name, rank), x, y, 1)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(cfg["rounds"]):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(_time_steps(schedules[name], _feeds(name, rank), x, y, cfg["steps"]))
    return {name: statistics.median(t) for name, t in times.items()}


def measure(cfg: dict) -> dict:
    step_time = run_on_processes(_worker, PP, cfg)
    base = step_time["torch DualPipeV"]
    ratios = {name: step_time[name] / base for name in step_time if name != "torch DualPipeV"}
    return {"ratio_to_torch_dualpipev": ratios, "step_time_s": step_time, "config": cfg}


def run(args: argparse.Namespace) -> int:
    cfg = {k: getattr(args, k) for k in ("rounds", "steps", "microbatches", "dim", "layers", "seq")}
    result = measure(cfg)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"pp={PP} CPU processes, {cfg['microbatches']} microbatches, TinyLM dim={cfg['dim']} "
          f"layers={cfg['layers']} seq={cfg['seq']}; median of {cfg['rounds']} paired rounds x {cfg['steps']} steps")
    print(f"{'schedule':<18}{'s/step':>10}{'vs torch DualPipeV':>20}")
    for name, t in result["step_time_s"].items():
        ratio = result["ratio_to_torch_dualpipev"].get(name, 1.0)
        print(f"{name:<18}{t:>10.4f}{ratio:>19.3f}x")
    return 0
