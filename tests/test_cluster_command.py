"""docs/torchtitan.md's two-node command (Clusters: plain torchrun), run as two torchrun "nodes"
on this machine: ``--nnodes 2 --nproc-per-node 1``, c10d rendezvous on 127.0.0.1, one pipeline
rank per node. The command is read from the page itself, so the test runs what the page says,
with only the values a cluster fills in replaced: processes per node (1), node rank, rendezvous
endpoint and id, and the config (the page's is a 16-GPU one; here ``debug_dualpipev``, pp=2).

Both nodes must exit 0 and log, step for step, the losses and grad norms of the one-node
two-process run of the same config and steps (``titan-dualpipe train ... --nproc 2``). The runs
are deterministic on CPU (one thread per process, gloo, the same ranks computing the same
stages), so the figures as logged (loss to 5 decimals, grad norm to 4) are compared for
equality, not within a tolerance.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cases.titan_runs import DUMP_FOLDER, REGISTRY, ROOT, STEPS, Run, assert_trains, config, ok, train
from test_docs import _shell_lines, _tokens
from titan_dualpipe.launch import ANSI, DEFAULT_MODULE, config_arguments
from titan_dualpipe.switches import TEST_PROBE_ENV
from titan_dualpipe.testing.spawn import free_port

DOCS = ROOT / "docs" / "torchtitan.md"
NAME = "debug_dualpipev"
NODES = 2
NODE_TIMEOUT_S = 300  # a node that hangs (e.g. in the rendezvous, waiting for the other) fails the test
STOP_GRACE_S = 30  # after SIGTERM, torchrun stops its workers; then SIGKILL

# What a cluster fills in on the page's command, and the page's placeholder for it.
PLACEHOLDERS = {"--node-rank": "$NODE_RANK", "--rdzv-endpoint": "$MASTER_ADDR:29500", "--rdzv-id": "$JOB_ID"}


def documented_command() -> list[str]:
    """The page's two-node ``torchrun`` line, as tokens (comments dropped, continuations joined).
    Its comment gives the 0.3.0 form of the config, the form the test runs on 0.3.0."""
    lines = _shell_lines(DOCS.read_text())
    commands = [line for line in lines if "--nnodes" in _tokens(line)]
    assert len(commands) == 1, f"{DOCS.name}: expected one multi-node torchrun line, found {commands}"
    comment = lines[lines.index(commands[0]) - 1]
    assert comment.lstrip().startswith("# two nodes"), comment
    assert f"0.3.0: --module {DEFAULT_MODULE} --config" in comment, comment
    return _tokens(commands[0])


def node_command(documented: list[str], node_rank: int, endpoint: str, run_id: str, out_dir: Path) -> list[str]:
    """The page's command for one node of this machine's two-node cluster: its torchrun options
    with the cluster's values, and the same trainer with ``NAME`` instead of the page's config."""
    assert documented[0] == "torchrun", documented
    trainer = documented.index("-m")
    options, (module, *config_args) = documented[1:trainer], documented[trainer + 1:]
    values = dict(zip(options[::2], options[1::2]))
    assert len(options) % 2 == 0 and all(flag.startswith("--") for flag in values), options
    assert values["--nnodes"] == str(NODES) and values["--rdzv-backend"] == "c10d", values
    for flag, placeholder in PLACEHOLDERS.items():
        assert values[flag] == placeholder, (flag, values)
    values.update({"--nproc-per-node": "1", "--node-rank": str(node_rank), "--rdzv-endpoint": endpoint,
                   "--rdzv-id": run_id})
    # 0.2.2: the page's `--job.config_file TOML`; 0.3.0 (the comment above it): `--module ... --config NAME`
    assert module == "torchtitan.train" and config_args[0] == "--job.config_file", documented
    titan_args = config_arguments(config(NAME), DEFAULT_MODULE, REGISTRY)
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    return [*torchrun, *(token for flag, value in values.items() for token in (flag, value)), "-m", module,
            *titan_args, DUMP_FOLDER, str(out_dir), "--training.steps", str(STEPS)]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (torchrun then stops its workers, which run in sessions of their own), then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_nodes(out_dir: Path) -> list[Run]:
    """Both nodes at once, sharing the dump folder as cluster nodes share a file system."""
    out_dir.mkdir(parents=True, exist_ok=True)
    documented = documented_command()
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"titan-dualpipe-{uuid.uuid4().hex[:12]}"
    # torchrun sets one thread per process only when it starts more than one per node; the
    # one-node reference runs with one, so its figures are reproduced bit for bit (and 2 cores
    # are not oversubscribed).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(TEST_PROBE_ENV, None)
    procs, logs, timed_out = [], [], False
    start = time.monotonic()
    try:
        for node in range(NODES):
            cmd = node_command(documented, node, endpoint, run_id, out_dir)
            logs.append(open(out_dir / f"node{node}.log", "w"))
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logs[-1], stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = start + NODE_TIMEOUT_S
        for proc in procs:
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for proc in procs:
            _stop(proc)
        for log in logs:
            log.close()
    seconds = time.monotonic() - start
    runs = [Run(proc.returncode, (out_dir / f"node{node}.log").read_text(errors="replace"), seconds, out_dir)
            for node, proc in enumerate(procs)]
    for node, run in enumerate(runs):
        assert not timed_out and run.returncode == 0, (
            f"node {node}: exit {run.returncode}{f' (stopped after {NODE_TIMEOUT_S} s)' if timed_out else ''}:\n"
            f"{run.output[-4000:]}")
    return runs


@pytest.mark.titan_e2e
def test_two_node_command_trains_with_the_losses_of_one_node(tmp_path: Path) -> None:
    """The one-node reference trains while the two nodes do (4 processes on this machine)."""
    with ThreadPoolExecutor(1) as pool:
        one_node = pool.submit(train, NAME, tmp_path / "one_node")
        nodes = run_nodes(tmp_path / "two_nodes")
        reference = ok(one_node.result())
    expected = reference.logged()[0]  # {step: (loss, grad_norm)}; every rank logs them under DualPipeV
    assert reference.logged()[1] == expected
    assert_trains(reference.losses())
    pipeline_ranks = []
    for node, run in enumerate(nodes):
        logged = run.logged()  # each node shows its local rank 0
        assert list(logged) == [0], (node, sorted(logged))
        assert logged[0] == expected, (node, logged[0], expected)
        pipeline_ranks += re.findall(r"PP rank (\d+) is building stage_idx", ANSI.sub("", run.output))
    assert sorted(set(pipeline_ranks)) == ["0", "1"], pipeline_ranks  # one pipeline over both nodes
