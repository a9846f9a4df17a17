"""Run a function on N local processes (gloo on CPU, or NCCL with one GPU each) and return
what rank 0 puts out; and the start-up every spawned rank shares (the test suite's process pool,
tests/cases/dist_pool.py, joins its group through :func:`join_process_group` too)."""

from __future__ import annotations

import faulthandler
import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._compat.c10d import native_stacks_on_fatal_signal


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_process_group(rank: int, world: int, port: int, backend: str = "gloo",
                       timeout: timedelta = timedelta(minutes=5)) -> None:
    """This spawned process as rank ``rank`` of ``world`` (rendezvous on 127.0.0.1:``port``), one
    CPU thread, rank ``r`` on GPU ``r`` with ``backend="nccl"``. A crash (SIGSEGV, SIGABRT...)
    prints every thread's C++ stack; enable ``faulthandler`` before, and it adds the Python ones."""
    native_stacks_on_fatal_signal()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device_id = None
    if backend == "nccl":
        device_id = torch.device("cuda", rank)
        torch.cuda.set_device(device_id)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, device_id=device_id)


def _entry(rank: int, world: int, port: int, backend: str, fn: Callable[..., Any], args: tuple, out: Any) -> None:
    faulthandler.enable(all_threads=True)
    join_process_group(rank, world, port, backend)
    try:
        result = fn(*args)
        if rank == 0:
            out.put(result)
    finally:
        if dist.is_initialized():  # ``fn`` may have destroyed it itself
            dist.destroy_process_group()
        # Python stacks mean nothing once the interpreter exits, and faulthandler can loop on a
        # thread's half-freed frames there: a crash at exit should abort, not spin.
        faulthandler.disable()


def run_on_processes(fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo",
                     timeout_s: float | None = None) -> Any:
    """``fn(*args)`` on ``world`` spawned ranks (one CPU thread each; with ``backend="nccl"``,
    rank r on GPU r); rank 0's return value. Ranks still running when another rank failed, when
    this call is interrupted (a test's timeout), or after ``timeout_s`` (TimeoutError) are killed.

    ``fn`` must be importable (a module-level function) for spawn.
    """
    out = mp.get_context("spawn").SimpleQueue()
    context = mp.start_processes(_entry, args=(world, free_port(), backend, fn, args, out), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not context.join(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())):
            if deadline is not None and time.monotonic() >= deadline:
                running = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                raise TimeoutError(f"{fn.__name__} still ran on ranks {running} of {world} after {timeout_s:.0f} s")
    finally:
        for process in context.processes:  # none may outlive the call: an orphan keeps the caller's pipes
            if process.is_alive():
                process.kill()
                process.join()
    return out.get()
