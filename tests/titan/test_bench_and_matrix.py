"""``titan-dualpipe bench titan`` (its options, figures and runs; end to end on the MoE config) and the
composability matrix (``titan-dualpipe matrix``: its cells, their comparison and the log notes it reads)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cases.titan_runs import REGISTRY, ROOT, config
from titan_dualpipe.switches import FOLD_ENV


@pytest.mark.titan_e2e
def test_bench_titan_measures_every_schedule_it_runs(runs_dir: Path) -> None:
    """``bench titan`` on the MoE config: the calibrated network costs each exchange about a
    quarter of a block's compute, every schedule reports its figures, the sequential ones
    leave exchanges exposed, and tokens per second follow from the step time."""
    labels = "1F1B,DualPipe"  # torch's executor and ours
    cmd = [sys.executable, "-m", "titan_dualpipe", "bench", "titan", config("debug_moe_dualpipe"), "--nproc", "4",
           "--rounds", "1", "--steps", "2", "--warmup", "1", "--schedules", labels, "--json"]
    cmd += ["--module", "titan_dualpipe.titan"] if REGISTRY else []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert list(result["schedules"]) == labels.split(",")
    assert 0 < result["exchange_s"] == pytest.approx(result["block_compute_s"] / 4)
    tokens_per_step = 4 * 64 * 2  # local batch x sequence x data-parallel replicas
    for label, figures in result["schedules"].items():
        # on CPU the probe records each step's segments and exchanges: exposure next to its floor
        assert set(figures) == {"step_time", "tokens_per_s", "peak_memory_bytes", "exposed_comm", "exposed_by_action",
                                "exposure"}
        exposure = figures["exposure"]
        assert {"measured", "floor", "serial"} <= set(exposure) and min(exposure.values()) >= 0, (label, exposure)
        assert exposure["floor"] <= exposure["serial"] + 1e-9 and exposure["serial"] > 0, (label, exposure)
        assert figures["tokens_per_s"] == pytest.approx(tokens_per_step / figures["step_time"])
        assert figures["peak_memory_bytes"] > 2**20 and figures["step_time"] > 0, (label, figures)
    sequential = result["schedules"]["1F1B"]  # every exchange waits out its cost, in torch's executor
    assert sequential["exposed_comm"] > result["exchange_s"], result
    assert set(sequential["exposed_by_action"]) == {"outside our actions"}
    ours = dict(result["schedules"]["DualPipe"]["exposed_by_action"])  # waits fall in our actions
    outside = ours.pop("outside our actions", 0.0)
    # torchtitan's pairs run as relays: each wait is charged to the half that waited
    assert set(ours) <= {"lone F", "lone B", "lone I", "W", "pair F", "pair B"}, ours
    assert ours.get("pair F", 0) + ours.get("pair B", 0) > 0, ours
    assert outside <= 0.05 * sum(ours.values()), (outside, ours)
    phases = result["phases"]
    assert "compute" not in phases["1F1B"] and phases["1F1B"]["schedule"] > 0  # torch's executor: not split
    assert phases["DualPipe"]["compute"] > 0 and phases["DualPipe"]["fsdp_reduce"] > 0, phases["DualPipe"]
    for label, parts in phases.items():  # the phases of a step add up to about the step
        step = sum(parts[p] for p in ("schedule", "clip", "optimizer", "other"))
        assert step == pytest.approx(result["schedules"][label]["step_time"], rel=0.5), (label, parts)


def test_bench_titan_checks_its_options_and_summarizes_ranks() -> None:
    """Options may follow CONFIG; bad ones are named before any run; figures: the slowest rank
    per step, median over steps after warm-up, exposed time averaged over ranks."""
    from titan_dualpipe.bench import titan as bench

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = bench.split_arguments(parser.parse_args(["titan", "c.toml", "--nproc", "4", "--schedules", "DualPipe",
                                                    "--training.seq_len", "32"]))
    assert (args.nproc, args.schedules, args.overrides) == (4, "DualPipe", ["--training.seq_len", "32"])
    assert [v.schedule for v in bench._check(args)] == ["DualPipe"]
    for change, message in [({"schedules": "DualPipe,ZB"}, "unknown ['ZB']"), ({"steps": 3, "warmup": 3}, "--steps 3"),
                            ({"nproc": None}, "give --nproc N"), ({"comm_ratio": -1.0}, "--comm-ratio must be")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            bench._check(argparse.Namespace(**{**vars(args), **change}))
    ranks = [{"step_s": [9.0, 1.0, 2.0, 3.0], "exposed_s": [9.0, 0.5, 0.5, 0.5], "tokens_per_step": 100,
              "peak_memory_bytes": 7, "exposed_by_action": [{"pair": 9.0}] + [{"lone F": 0.4, "pair": 0.1}] * 3},
             {"step_s": [9.0, 1.5, 1.0, 3.5], "exposed_s": [9.0, 0.1, 0.3, 0.1], "tokens_per_step": 100,
              "peak_memory_bytes": 9, "exposed_by_action": [{"pair": 9.0}] + [{"pair": 0.1}, {"pair": 0.3}, {"pair": 0.1}]}]
    figures = bench.summarize([ranks], warmup=1)
    by_action = figures.pop("exposed_by_action")
    assert figures == pytest.approx({"step_time": 2.0, "tokens_per_s": 50.0, "peak_memory_bytes": 9, "exposed_comm": 0.3})
    assert by_action == pytest.approx({"lone F": 0.2, "pair": 0.1})  # mean over ranks, median over steps
    table = bench._exposed_by_action_table({"DualPipe": {"exposed_by_action": by_action}, "1F1B": {
        "exposed_by_action": {"outside our actions": 0.5}}}, 22)
    assert table[2].split() == ["schedule", "lone", "F", "pair"]  # the kinds that occur, in their order
    assert [line.split() for line in table[3:]] == [["DualPipe", "200", "100"]]
    ranks[0]["phases"] = [{"schedule": 9.0}, {"schedule": 1.0, "compute": 0.5}, {"schedule": 2.0, "compute": 1.0},
                          {"schedule": 3.0, "compute": 1.5}]
    ranks[1]["phases"] = [{"schedule": 9.0}, {"schedule": 3.0, "clip": 0.2}, {"schedule": 4.0}, {"schedule": 5.0}]
    assert bench.phase_breakdown([ranks], warmup=1) == pytest.approx({"schedule": 3.0, "compute": 0.5, "clip": 0.0})
    with pytest.raises(ValueError, match="no MoE blocks"):
        bench.block_seconds([{"block_forward_s": [], "block_backward_s": []}])
    with pytest.MonkeyPatch.context() as patch:  # a GPU machine: its network is real
        patch.setattr(bench, "_has_cuda", lambda: True)
        with pytest.raises(ValueError, match="give --comm-ratio 0"):
            bench._check(args)
        assert bench._check(argparse.Namespace(**{**vars(args), "comm_ratio": 0.0}))


def test_bench_titan_compile_runs_each_schedule_compiled_beside_eager(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``--compile``: each schedule's compiled run next to its eager one in the rounds, with
    torchtitan's compile overrides and one inductor cache for every run; the table's ``vs eager``."""
    from types import SimpleNamespace

    from titan_dualpipe.bench import titan as bench

    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = bench.split_arguments(parser.parse_args(["titan", "c.toml", "--nproc", "1", "--schedules",
                                                    "1F1B,DualPipeV,DualPipe", "--compile"]))
    variants = bench._check(args)
    assert [v.label for v in variants] == ["1F1B", "1F1B compiled", "DualPipeV", "DualPipeV compiled", "DualPipe",
                                           "DualPipe compiled"]
    for eager, compiled in zip(variants[::2], variants[1::2]):
        assert (compiled.schedule, compiled.overlap) == (eager.schedule, eager.overlap)
        assert compiled.compiled and not eager.compiled
    seen: list[tuple[list[str], dict[str, str]]] = []

    def fake_run(argv: list[str], env: dict[str, str], **_: object) -> SimpleNamespace:
        seen.append((argv, env))
        (Path(env[bench.BENCH_DIR_ENV]) / "bench_rank0.json").write_text("{}")
        return SimpleNamespace(returncode=0)

    monkeypatch.delenv(bench.INDUCTOR_CACHE_ENV, raising=False)
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    launcher = bench.Launcher("c.toml", 1, None, [], tmp_path)
    for variant in variants[:2]:
        launcher.run(variant, 3, 0.0)
    (eager_argv, eager_env), (compiled_argv, compiled_env) = seen
    assert "--compile.enable" not in eager_argv and " ".join(bench.COMPILE_OVERRIDES) in " ".join(compiled_argv)
    cache = str(tmp_path / "inductor_cache")
    assert eager_env[bench.INDUCTOR_CACHE_ENV] == compiled_env[bench.INDUCTOR_CACHE_ENV] == cache
    figures = {"tokens_per_s": 1.0, "peak_memory_bytes": 2**20, "exposed_comm": 0.0}
    schedules = {"1F1B": {**figures, "step_time": 2.0}, "1F1B compiled": {**figures, "step_time": 0.5},
                 "DualPipe compiled": {**figures, "step_time": 1.0}}
    assert bench.vs_eager(schedules, "1F1B compiled") == 4.0
    assert bench.vs_eager(schedules, "1F1B") is None and bench.vs_eager(schedules, "DualPipe compiled") is None
    table = bench.format_table({"schedules": schedules, "block_compute_s": None, "rounds": 1, "steps": 3, "warmup": 1,
                                "nproc": 1})
    assert "vs eager" in table.splitlines()[0] and "4.00x" in table.splitlines()[2]


def test_bench_titan_w_at_i_runs_each_backward_whole_at_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``... W at I`` (on request, not by default) runs our schedule with
    ``TITAN_DUALPIPE_WEIGHT_GRADIENTS=whole``; the other runs keep the environment's setting."""
    from types import SimpleNamespace

    from titan_dualpipe.bench import titan as bench
    from titan_dualpipe.switches import WEIGHT_GRADIENTS_ENV

    assert not any("W at I" in label for label in bench.DEFAULT_LABELS)
    seen: list[dict[str, str]] = []

    def fake_run(argv: list[str], env: dict[str, str], **_: object) -> SimpleNamespace:
        seen.append(env)
        (Path(env[bench.BENCH_DIR_ENV]) / "bench_rank0.json").write_text("{}")
        return SimpleNamespace(returncode=0)

    monkeypatch.delenv(WEIGHT_GRADIENTS_ENV, raising=False)
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    launcher = bench.Launcher("c.toml", 1, None, [], tmp_path)
    for label in ("DualPipeV", "DualPipeV W at I", "DualPipe W at I"):
        launcher.run(bench.BY_LABEL[label], 3, 0.0)
    assert [env.get(WEIGHT_GRADIENTS_ENV) for env in seen] == [None, "whole", "whole"]


def test_bench_titan_charges_a_lone_pairs_waits_to_it() -> None:
    """A lone pair's waits (two forwards, or two backwards, relayed) are filed apart from a forward
    with a backward's, which go to the half that waited."""
    from titan_dualpipe._compat.pipelining import _Action, _ComputationType as C
    from titan_dualpipe.orders.lone_pairs import lone_pair
    from titan_dualpipe.titan.bench_probe import _action_kind

    forward, backward = _Action(0, C.FORWARD, 1), _Action(3, C.FULL_BACKWARD, 0)
    assert _action_kind(lone_pair(forward, _Action(0, C.FORWARD, 2))) == "lone pair"
    assert _action_kind(_Action(-1, C.OVERLAP_F_B, None, (forward, backward))) == "pair"
    assert _action_kind(forward) == "lone F" and _action_kind(backward) == "lone B"


def test_matrix_covers_every_layout_and_flags_a_differing_rank() -> None:
    """The composability matrix (titan-dualpipe matrix): both schedules on every layout, DualPipe's
    twins folded and exchanged where FSDP can fold them; a cell fails on any rank's step off the
    reference by more than its tolerance."""
    from titan_dualpipe.check import matrix

    names = [c.name for c in matrix.cells()]
    for layout in matrix.LAYOUTS:
        assert f"{layout.name} DualPipeV" in names and f"{layout.name} DualPipe (exchanged twins)" in names
        assert (f"{layout.name} DualPipe (folded twins)" in names) == layout.folds
    reference = {1: (8.0, 2.0), 2: (7.0, 1.5)}
    same = {0: dict(reference), 3: dict(reference)}
    assert matrix.compare(same, reference, steps=2, rel=1e-4).startswith("OK")
    off = {0: dict(reference), 3: {1: (8.0, 2.0), 2: (7.0, 1.5 * (1 + 2e-4))}}
    assert matrix.compare(off, reference, steps=2, rel=1e-4).startswith("rank 3 step 2 grad_norm")
    assert matrix.compare({0: {1: (8.0, 2.0)}}, reference, steps=2, rel=1e-4) == "rank 0 logged steps [1]"
    table = matrix.markdown([matrix.Outcome("tp DualPipe (exchanged twins)", "0.2.2", True, "OK (worst rel 1e-05)")])
    assert "| tp | DualPipe (exchanged twins) | 0.2.2 | tested on CPU: OK" in table and "| cp |" in table
    log = ("[rank0]: ...; on this rank 12 weight GEMMs per microbatch wait for W (stage 0: 6, stage 3: 6; deferred "
           "weight gradients)\n"
           "[rank1]: ...; on this rank 16 weight GEMMs per microbatch wait for W (stage 1: 8, stage 2: 8; deferred "
           "weight gradients)\n")
    assert matrix._weight_gradients(log) == "; deferred W: up to 16 weight GEMMs per microbatch on a rank"
    assert matrix._weight_gradients("...; weight gradients: whole\n") == "; weight gradients: whole"
    assert matrix._weight_gradients("no note") == ""
    assert matrix._twins_args(matrix.Cell(matrix.LAYOUTS[0], "DualPipe", "exchanged"), registry=False)[1] == {
        FOLD_ENV: "0"}
    assert matrix._twins_args(matrix.Cell(matrix.LAYOUTS[0], "DualPipe", "folded"), registry=True)[0] == (
        "--parallelism.spmd_backend", "partial_dtensor")


def test_deferred_gemm_count_in_the_log_is_this_ranks_per_stage() -> None:
    """Every rank logs its own line: the count is this rank's, its stages named one by one."""
    from types import SimpleNamespace

    from titan_dualpipe.check import matrix
    from titan_dualpipe.titan.pipeline import _weight_gradients_note

    def schedule(least: int) -> SimpleNamespace:
        return SimpleNamespace(weight_gradients="deferred", deferred_weights={3: ["a", "b"], 0: ["c", "d", "e", "f"]},
                               least_weight_gemm_flops=least)

    note = _weight_gradients_note(schedule(0))
    assert note == ("; on this rank 6 weight GEMMs per microbatch wait for W (stage 0: 4, stage 3: 2; deferred "
                    "weight gradients)")
    assert _weight_gradients_note(schedule(8_000_000)) == (
        "; on this rank 6 weight GEMMs per microbatch wait for W (stage 0: 4, stage 3: 2; deferred weight gradients, "
        "those under 8,000,000 FLOPs computed at I)")
    assert matrix._weight_gradients(note) == "; deferred W: up to 6 weight GEMMs per microbatch on a rank"
    assert _weight_gradients_note(SimpleNamespace(weight_gradients="whole")) == "; weight gradients: whole"
