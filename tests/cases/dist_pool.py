"""A pool of gloo worker processes, spawned once per test module (the ``pool`` fixture of
tests/conftest.py). Each worker joins its process group as every spawned rank of the package's
tools does (:func:`titan_dualpipe.testing.spawn.join_process_group`), then runs cases until closed.

``pool.run(fn, **kwargs)`` runs ``fn(**kwargs)`` on every rank and returns the per-rank
results; an exception on any rank, a dead worker or a call that does not finish in time fails
the call with every rank's story and kills the pool (the next call starts a fresh one).
``pool.outcomes`` returns every rank's outcome instead, for cases that expect failures.

Each worker's stderr (Python's and the C++ runtime's, e.g. a ``std::terminate`` message) goes to
a file the pool relays to its own stderr after every call. When a worker crashes (SIGSEGV,
SIGABRT...), torch's fatal-signal handler writes every thread's C++ stack there, then
``faulthandler`` every thread's Python stack (the C++ one is what shows a ``std::terminate`` in a
communication thread); on a timeout, ``faulthandler`` writes the Python stacks before the pool
kills the worker. A dead or hung worker's failure message ends with the tail of that file.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp

from titan_dualpipe.testing.spawn import free_port, join_process_group


def _stderr_to(path: str) -> None:
    """Send this process's stderr (fd 2) to ``path``; dump every thread's stack there on a crash
    or on SIGUSR1 (the pool's signal before it kills a hung worker)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def _worker(rank: int, world: int, port: int, tasks, results, paths: list[str], pg_timeout_s: float,
            log_path: str) -> None:
    _stderr_to(log_path)
    sys.path[:0] = [p for p in paths if p not in sys.path]
    import torch.distributed as dist

    join_process_group(rank, world, port, timeout=timedelta(seconds=pg_timeout_s))
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


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


class WorkerPool:
    def __init__(self, world: int, pg_timeout_s: float = 120.0) -> None:
        self.world = world
        self.pg_timeout_s = pg_timeout_s
        self._procs: list = []
        self._log_dir = ""
        self._log_read: list[int] = []  # bytes of each worker's log relayed so far

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        port = free_port()
        tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/cases/dist_pool.py
        paths = [tests_dir, os.path.dirname(tests_dir)]  # cases.* and the package importable
        self._log_dir, self._log_read = tempfile.mkdtemp(prefix="dist_pool_"), [0] * self.world
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world, port, self._tasks[r], self._results, paths,
                                              self.pg_timeout_s, self._log_path(r)), daemon=True)
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
                    outcomes[rank] = (False, f"worker died ({_exit_reason(proc.exitcode)}); its stderr ends:\n"
                                             f"{self._log_tail(rank)}")
            if time.monotonic() > deadline and len(outcomes) < self.world:
                missing = sorted(set(range(self.world)) - set(outcomes))
                stacks = self._stacks_of(missing)
                self.close(kill=True)
                raise RemoteError(f"{fn.__name__}{kwargs} timed out after {timeout_s}s on ranks {missing}\n{stacks}")
        self._relay_logs()
        if any(not ok for ok, _ in outcomes.values()):
            self.close(kill=True)
        return outcomes

    def _log_path(self, rank: int) -> str:
        return os.path.join(self._log_dir, f"rank{rank}.log")

    def _log_tail(self, rank: int, chars: int = 8000) -> str:
        try:
            with open(self._log_path(rank), errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def _relay_logs(self) -> None:
        """Write what the workers put on their stderr since the last call to ours (CI's log, or
        the test's captured stderr), each line prefixed with its rank."""
        for rank in range(len(self._log_read)):
            try:
                with open(self._log_path(rank), "rb") as f:
                    f.seek(self._log_read[rank])
                    new = f.read()
            except OSError:
                continue
            self._log_read[rank] += len(new)
            for line in new.decode(errors="replace").splitlines():
                sys.stderr.write(f"[rank {rank}] {line}\n")

    def _stacks_of(self, ranks: list[int]) -> str:
        """Every thread's stack of each of ``ranks`` (hung workers), through faulthandler's SIGUSR1."""
        for rank in ranks:
            if self._procs[rank].is_alive():
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(1.0)
        return "\n".join(f"--- rank {rank} stderr ---\n{self._log_tail(rank)}" for rank in ranks)

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
                p.join(timeout=5)
        self._relay_logs()
        shutil.rmtree(self._log_dir, ignore_errors=True)
        self._procs = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close(kill=True)  # a pool of a case's own: the case may have left its process groups broken


def ran(results: list) -> list:
    """The results of the ranks that ran a case (the others return None); at least one."""
    ran = [r for r in results if r is not None]
    assert ran, "no rank ran the case"
    return ran


def one_rank_process_group():
    """A generator for a module fixture: this process as a gloo group of one rank (yields the
    group); skips when the process already has a group."""
    import pytest
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    yield dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()
