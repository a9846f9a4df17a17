"""The test pool itself: what it reports when a worker crashes or hangs, and the workers' stderr;
and what run_on_processes leaves behind when its ranks hang."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from cases.dist_pool import RemoteError, WorkerPool


def abort_from_a_thread(rank_to_crash: int) -> int:
    """``rank_to_crash`` aborts the process from a second thread (as ``std::terminate`` would)."""
    import os

    import torch.distributed as dist

    if dist.get_rank() == rank_to_crash:
        def crash_in_helper() -> None:
            os.abort()

        thread = threading.Thread(target=crash_in_helper, name="crashing-helper")
        thread.start()
        thread.join()
    return dist.get_rank()


def sleep_on(rank_to_hang: int, seconds: float) -> int:
    import torch.distributed as dist

    if dist.get_rank() == rank_to_hang:
        time.sleep(seconds)
    return dist.get_rank()


def say_on_stderr(text: str) -> int:
    import torch.distributed as dist

    print(text, file=sys.stderr, flush=True)
    return dist.get_rank()


def test_a_crashed_worker_reports_its_signal_and_every_threads_stack(capsys):
    pool = WorkerPool(2)
    try:
        outcomes = pool.outcomes(abort_from_a_thread, timeout_s=120, rank_to_crash=1)
    finally:
        pool.close(kill=True)
    assert outcomes[0] == (True, 0), outcomes
    ok, report = outcomes[1]
    assert not ok and report.startswith("worker died (killed by SIGABRT)"), report
    assert "Fatal Python error: Aborted" in report, report
    assert 'in crash_in_helper' in report and "Current thread" in report, report  # the crashing thread's stack
    assert "in abort_from_a_thread" in report, report  # and the other threads' (the joining main thread)
    # Before them, on the relayed stderr: every thread's C++ stack, the crashing one through abort()
    native = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[rank 1] ")]
    threads = [line for line in native if line.startswith("[rank 1] SIGABRT(6), PID: ")]
    assert len(threads) >= 2 and any(" abort + 0x" in line for line in native), "\n".join(native)


def test_a_hung_worker_reports_its_stack_before_it_is_killed():
    pool = WorkerPool(2)
    try:
        assert pool.run(sleep_on, rank_to_hang=1, seconds=0) == [0, 1]  # started: the timeout counts the call only
        with pytest.raises(RemoteError, match=r"timed out after 5s on ranks \[1\]") as failure:
            pool.run(sleep_on, timeout_s=5, rank_to_hang=1, seconds=120)
    finally:
        pool.close(kill=True)
    assert "--- rank 1 stderr ---" in str(failure.value) and "in sleep_on" in str(failure.value), failure.value


def test_workers_stderr_reaches_the_callers_stderr(capsys):
    pool = WorkerPool(2)
    try:
        assert pool.run(say_on_stderr, text="a line from a worker") == [0, 1]
    finally:
        pool.close()
    err = capsys.readouterr().err
    assert "[rank 0] a line from a worker" in err and "[rank 1] a line from a worker" in err, err


def write_pid_and_sleep(folder: str) -> None:
    import torch.distributed as dist

    Path(folder, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def test_run_on_processes_kills_ranks_still_running_at_its_timeout(tmp_path: Path) -> None:
    """A hung case ends in a TimeoutError naming the ranks, and leaves no process behind (an orphan
    would hold the caller's output pipes open, and a CI run would wait on them)."""
    from titan_dualpipe.testing.spawn import run_on_processes

    with pytest.raises(TimeoutError, match=r"write_pid_and_sleep still ran on ranks \[0, 1\] of 2 after 15 s"):
        run_on_processes(write_pid_and_sleep, 2, str(tmp_path), timeout_s=15)
    pids = [int(path.read_text()) for path in sorted(tmp_path.glob("*.pid"))]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
