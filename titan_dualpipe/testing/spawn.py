"""Run a function on N local processes (gloo on CPU, or NCCL with one GPU each) and return
what rank 0 puts out."""

from __future__ import annotations

import faulthandler
import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._compat.c10d import native_stacks_on_fatal_signal


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, backend: str, fn: Callable[..., Any], args: tuple, out: Any) -> None:
    faulthandler.enable(all_threads=True)  # a crash (SIGSEGV, SIGABRT...) prints every thread's stack:
    native_stacks_on_fatal_signal()  # the C++ ones first, then faulthandler the Python ones
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device_id = None
    if backend == "nccl":
        device_id = torch.device("cuda", rank)
        torch.cuda.set_device(device_id)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(minutes=5), device_id=device_id)
    try:
        result = fn(*args)
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def run_on_processes(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo") -> Any:
    """``fn(*args)`` on ``world`` spawned ranks (one CPU thread each; with ``backend="nccl"``,
    rank r on GPU r); rank 0's return value.

    ``fn`` must be importable (a module-level function) for spawn.
    """
    out = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_entry, args=(world, _free_port(), backend, fn, args, out), nprocs=world, start_method="spawn")
    return out.get()
