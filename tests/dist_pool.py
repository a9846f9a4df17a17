"""A pool of gloo worker processes, spawned once per test module.

``pool.run(fn, **kwargs)`` runs ``fn(**kwargs)`` on every rank and returns the per-rank
results; an exception on any rank, a dead worker or a call that does not finish in time fails
the call with every rank's story and kills the pool (the next call starts a fresh one).
``pool.outcomes`` returns every rank's outcome instead, for cases that expect failures.
"""

from __future__ import annotations

import importlib
import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results, paths: list[str], pg_timeout_s: float) -> None:
    sys.path[:0] = [p for p in paths if p not in sys.path]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout_s))
    while (task := tasks.get()) is not None:
        module, name, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(**kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RemoteError(AssertionError):
    pass


class WorkerPool:
    def __init__(self, world: int, pg_timeout_s: float = 120.0) -> None:
        self.world = world
        self.pg_timeout_s = pg_timeout_s
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        port = _free_port()
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        paths = [tests_dir, os.path.dirname(tests_dir)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world, port, self._tasks[r], self._results, paths, self.pg_timeout_s), daemon=True)
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], timeout_s: float = 300.0, **kwargs: Any) -> list[Any]:
        """``fn(**kwargs)`` on every rank; the per-rank results. Any failure (an exception, a dead
        worker, the timeout) raises RemoteError with every rank's story and restarts the pool,
        so the next case starts from fresh processes and process groups."""
        outcomes = self.outcomes(fn, timeout_s=timeout_s, **kwargs)
        failures = {r: v for r, (ok, v) in sorted(outcomes.items()) if not ok}
        if failures:
            self.close(kill=True)
            raise RemoteError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures.items()))
        return [outcomes[r][1] for r in range(self.world)]

    def outcomes(self, fn: Callable[..., Any], timeout_s: float = 300.0, **kwargs: Any) -> dict[int, tuple[bool, Any]]:
        """``{rank: (ok, result or traceback)}``; a worker that died gets ``(False, "died ...")``."""
        if not self._procs:
            self._start()
        for q in self._tasks:
            q.put((fn.__module__, fn.__name__, kwargs))
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < self.world:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
                outcomes[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            for rank, proc in enumerate(self._procs):
                if rank not in outcomes and not proc.is_alive():
                    outcomes[rank] = (False, f"worker died (exit code {proc.exitcode})")
            if time.monotonic() > deadline and len(outcomes) < self.world:
                self.close(kill=True)
                missing = sorted(set(range(self.world)) - set(outcomes))
                raise RemoteError(f"{fn.__name__}{kwargs} timed out after {timeout_s}s on ranks {missing}")
        if any(not ok for ok, _ in outcomes.values()):
            self.close(kill=True)
        return outcomes

    def close(self, kill: bool = False) -> None:
        if not self._procs:
            return
        if not kill:
            for q in self._tasks:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if kill else 30)
            if p.is_alive():
                p.kill()
        self._procs = []


def one_rank_process_group():
    """A generator for a module fixture: this process as a gloo group of one rank (yields the
    group); skips when the process already has a group."""
    import pytest
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    yield dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()
