"""``titan-dualpipe gpu-kit``: its commands (well formed, pointing at what exists), its report, its
handling of failing and hanging parts, and its refusal without CUDA; all on the CPU."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from titan_dualpipe.check import gpu_kit
from titan_dualpipe.cli import build_parser, main
from titan_dualpipe.torchtitan_version import REGISTRY_RELEASES, installed

ROOT = Path(__file__).resolve().parent.parent
NAMES = ["tests/gpu", "check", "bench overlap", "bench compile", "train", "bench titan"]


def _dry_run(capsys, *extra: str) -> list[tuple[str, list[str]]]:
    """(part name, argv) of every command ``--dry-run`` prints."""
    assert main(["gpu-kit", "--dry-run", *extra]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) % 2 == 0 and all(line.startswith("# ") for line in lines[0::2])
    return [(head[2:].split(" (timeout")[0], shlex.split(cmd)) for head, cmd in zip(lines[0::2], lines[1::2])]


def test_dry_run_lists_every_part_as_a_command_of_this_python(capsys):
    commands = _dry_run(capsys)
    assert [name for name, _ in commands] == NAMES
    assert all(argv[:2] == [sys.executable, "-m"] for _, argv in commands)


def test_dry_run_pytest_points_at_the_gpu_tests(capsys):
    """The parts run in ``gpu_kit.ROOT``, the checkout, where their relative paths resolve."""
    (_, argv), = _dry_run(capsys, "--parts", "tests/gpu")
    assert gpu_kit.ROOT == ROOT
    assert argv[2] == "pytest" and (gpu_kit.ROOT / argv[-1] / "test_gpu.py").is_file()


def test_dry_run_subcommands_parse_with_our_command_line(capsys):
    """Every ``-m titan_dualpipe`` command is a valid sub-command with valid options (what the
    parser accepts; torchtitan's overrides are checked below)."""
    commands = [(name, argv) for name, argv in _dry_run(capsys) if argv[2] == "titan_dualpipe"]
    parsed = {name: build_parser().parse_args(argv[3:]) for name, argv in commands}
    assert list(parsed) == NAMES[1:]
    check, overlap, split = parsed["check"], parsed["bench overlap"], parsed["bench compile"]
    assert (check.command, check.nproc, check.backend, check.json) == ("check", 1, "nccl", True)
    assert (overlap.kind, overlap.device, overlap.pp, overlap.ep, overlap.json) == ("overlap", "cuda", 1, 1, True)
    assert overlap.exchange_chunks == 2  # chunked exchanges beside whole ones
    assert (split.kind, split.device, split.json) == ("compile", "cuda", True)
    assert parsed["train"].command == "train" and parsed["bench titan"].kind == "titan"


def test_dry_run_bench_compile_options_pass_its_checks(capsys):
    """The (I+W)/full part's sizes are valid ``bench compile`` options (the CUDA check aside)."""
    from titan_dualpipe.bench.compile import check_config

    (_, argv), = _dry_run(capsys, "--parts", "bench compile")
    args = build_parser().parse_args(argv[3:])
    cfg = {key: getattr(args, key) for key in ("model", "blocks", "dim", "tokens", "seq", "microbatches", "rounds",
                                               "backend", "threads")}
    check_config({**cfg, "device": "cpu"})
    assert args.device == "cuda" and args.backend == "inductor"


def test_train_and_bench_titan_run_our_dualpipev_on_one_rank(capsys):
    """One GPU is one rank: both torchtitan parts run DualPipeV at pipeline degree 1 (the V's two
    stages on that rank) and pass only when the output shows our schedule ran."""
    for name, argv in _dry_run(capsys, "--parts", "train,bench titan"):
        config, overrides = _torchtitan_overrides(name, argv)
        assert overrides[overrides.index("--parallelism.pipeline_parallel_degree") + 1] == "1"
        assert Path(config).stem == gpu_kit.TRAIN_NAME == "debug_dualpipev"  # its schedule is DualPipeV
    parts = {p.name: p for p in gpu_kit.parts(Path("logs"))}
    titan = build_parser().parse_args(list(parts["bench titan"].argv[3:]))
    assert bench_titan_schedules(titan) == ["DualPipeV"]
    log = "[rank0]:[titan] 2026-01-01 - root - INFO - Using titan_dualpipe DualPipeV with 8 microbatches and 2 stages"
    assert all(re.search(pattern, log) for pattern in parts["train"].must_show)
    assert not any(re.search(pattern, log.replace("2 stages", "4 stages")) for pattern in parts["train"].must_show)
    assert all(re.search(pattern, json.dumps({"phases": {"DualPipeV": {"compute": 0.1}}}, indent=2))
               for pattern in parts["bench titan"].must_show)


def bench_titan_schedules(args) -> list[str]:
    from titan_dualpipe.bench import titan as bench_titan

    return [v.label for v in bench_titan._check(bench_titan.split_arguments(args))]


def _torchtitan_overrides(name: str, argv: list[str]) -> tuple[str, list[str]]:
    """CONFIG and the torchtitan overrides of a train or bench titan command, as they split them."""
    from titan_dualpipe import launch
    from titan_dualpipe.bench import titan as bench_titan

    args = build_parser().parse_args(argv[3:])
    if name == "train":
        args, overrides = launch.split_arguments(args)
        assert args.nproc == 1
    else:
        args = bench_titan.split_arguments(args)
        overrides = args.overrides
        assert args.nproc == 1 and args.comm_ratio == 0 and bench_titan._check(args)
    return args.config, overrides


@pytest.mark.skipif(installed("torchtitan") in REGISTRY_RELEASES or installed("torchtitan") is None,
                    reason="checks a torchtitan 0.2.2 TOML and its overrides")
def test_dry_run_torchtitan_runs_name_a_shipped_config_and_valid_overrides(capsys):
    from torchtitan.config import ConfigManager

    for name, argv in _dry_run(capsys, "--parts", "train,bench titan"):
        config, overrides = _torchtitan_overrides(name, argv)
        assert (ROOT / config).is_file()
        job = ConfigManager().parse_args(["--job.config_file", str(ROOT / config), *overrides])
        assert job.parallelism.pipeline_parallel_degree == 1  # one GPU is one rank: a one-rank V
        assert job.parallelism.pipeline_parallel_schedule == "DualPipeV"
        assert job.experimental.custom_import == "titan_dualpipe.titan"


def test_unknown_parts_are_refused(capsys):
    assert main(["gpu-kit", "--dry-run", "--parts", "check,nope"]) == 2
    assert "unknown ['nope']" in capsys.readouterr().err


def test_without_cuda_it_says_so_and_exits_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["gpu-kit", str(tmp_path / "report.md")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device here" in err and "Traceback" not in err
    assert not (tmp_path / "report.md").exists()


# -- the report ---------------------------------------------------------------------------------
def _part(name: str, argv: tuple[str, ...] = ("python", "-c", "pass"), timeout_s: int = 60) -> gpu_kit.Part:
    return gpu_kit.Part(name, argv, timeout_s, f"what {name} proves", gpu_kit.pytest_figures)


MACHINE = {"GPU": "NVIDIA H100 80GB HBM3 (1 visible)", "torch": "2.11.0+cu130 (CUDA 13.0)"}


def test_report_names_each_part_its_result_figures_and_the_machine():
    outcomes = [
        gpu_kit.Outcome(_part("tests/gpu"), 0, 81.2, "18 passed in 80.1s", "", "logs/tests_gpu.out / tests_gpu.err"),
        gpu_kit.Outcome(_part("check", ("python", "-m", "titan_dualpipe", "check")), 1, 12.0, "3/4 cases pass",
                        "AssertionError: grad mismatch", "logs/check.out / check.err"),
        gpu_kit.Outcome(_part("train", timeout_s=420), None, 425.0, "(no figures: IndexError)", "stuck at step 3",
                        "logs/train.out / train.err"),
    ]
    text = gpu_kit.report(outcomes, MACHINE, 518.4)
    assert text.startswith("# titan_dualpipe GPU kit: FAIL\n")
    assert "- GPU: NVIDIA H100 80GB HBM3 (1 visible)" in text and "- torch: 2.11.0+cu130 (CUDA 13.0)" in text
    assert "- wall time: 518 s" in text
    assert "| tests/gpu | pass | 81 | 18 passed in 80.1s |" in text
    assert "| check | FAIL (exit 1) | 12 | 3/4 cases pass |" in text
    assert "| train | FAIL (timed out after 420 s) | 425 | (no figures: IndexError) |" in text
    assert "python -m titan_dualpipe check" in text and "what check proves" in text
    assert "AssertionError: grad mismatch" in text and "stuck at step 3" in text
    passing = gpu_kit.report(outcomes[:1], MACHINE, 81.0)
    assert passing.startswith("# titan_dualpipe GPU kit: PASS\n") and "```\n\n" not in passing.split("18 passed")[-1]


def test_key_figures_from_each_part():
    ansi = ("\x1b[31mstep:  {s}  \x1b[32mloss:  {l}  \x1b[38;2;180;60;0mgrad_norm:  1.3  "
            "\x1b[38;2;54;234;195mmemory:  0.83GiB(3.52%)  \x1b[34mtps: {t}  \x1b[36mtflops: 0.04  "
            "\x1b[35mmfu: 0.01%\x1b[39m")
    log = "\n".join("[rank0]:[titan] 2026-01-01 - root - INFO - " + ansi.format(s=s, l=l, t=t)
                    for s, l, t in ((1, "8.13", "1,096"), (20, "5.02", "98,765")))
    assert gpu_kit.train_figures(log) == ("no DualPipeV built; loss 8.13 (step 1) -> 5.02 (step 20); tps 98,765; "
                                          "memory 0.83GiB(3.52%)")
    assert gpu_kit.pytest_figures("....\n==== 18 passed, 1 warning in 80.10s (0:01:20) ====\n") \
        == "18 passed, 1 warning in 80.10s (0:01:20)"
    cases = {"cases": [{"passed": True, "grad_err": 2e-8, "loss_err": 4e-7}, {"passed": False, "grad_err": 1e-3,
                                                                              "loss_err": 0.0}]}
    assert gpu_kit.check_figures(json.dumps(cases, indent=1) + "\nsome warning on stderr\n") \
        == "1/2 cases pass; max grad err 1.0e-03, max loss err 4.0e-07"
    overlap = {"step_time_overlap": 0.1, "step_time_sequential": 0.2, "exposed_comm_overlap": 0.01,
               "exposed_comm_sequential": 0.05, "overlap_vs_sequential": 0.5, "network": {"exchange_ms": 1.25}}
    assert gpu_kit.overlap_figures("calibrating\n" + json.dumps(overlap, indent=2)) == (
        "overlap/sequential 0.500; ms/step: overlap 100.0, sequential 200.0; "
        "exposed comm ms/step: overlap 10.0, sequential 50.0; 1.25 ms per all-to-all")
    chunked = {**overlap, "exchange_chunks": {"overlap": [1.2, 1.0, 1.1], "overlap_relay": [0.9, 0.8]}}
    assert gpu_kit.overlap_figures(json.dumps(chunked)).endswith(
        "; 2 chunks / whole step, median of rounds: overlap 1.100, overlap_relay 0.850")
    floored = {**overlap, "exposure": {"overlap": {"measured": 0.01, "floor": 0.004, "serial": 0.05}}}
    assert gpu_kit.overlap_figures(json.dumps(floored)).endswith(
        "1.25 ms per all-to-all; exposure ms/step measured/floor/1F1B (CUDA events): overlap 10.0/4.0/50.0")
    titan = {"schedules": {"1F1B": {"step_time": 0.05, "tokens_per_s": 20480.0, "exposed_comm": 0.0}},
             "phases": {"1F1B": {"clip": 0.001, "optimizer": 0.002, "other": 0.047}}}
    assert gpu_kit.bench_titan_figures(json.dumps(titan, indent=2)) == (
        "50.0 ms/step, 20480 tokens/s, exposed comm 0.00 ms; phases ms: clip 1.0, optimizer 2.0, other 47.0 "
        "(CUDA events)")


def test_train_figures_name_the_one_rank_v():
    line = "[rank0]:[titan] 2026-01-01 - root - INFO - step: {s}  loss: {l}  grad_norm: 1.3  memory: 0.8GiB(3%)  tps: 9,876"
    steps = "\n".join(line.format(s=s, l=l) for s, l in ((1, "8.13"), (20, "5.02")))
    built = "[rank0]:[titan] 2026-01-01 - root - INFO - Using titan_dualpipe DualPipeV with 8 microbatches and 2 stages\n"
    assert gpu_kit.train_figures(built + steps) == (
        "DualPipeV, 2 stages on one rank, 8 microbatches; loss 8.13 (step 1) -> 5.02 (step 20); tps 9,876; memory 0.8GiB(3%)")
    assert gpu_kit.train_figures(steps).startswith("no DualPipeV built; loss 8.13")


def test_compile_figures_give_i_plus_w_over_full():
    """``bench compile --json`` as the kit's (I+W)/full figures (sample output of its structure)."""
    rows = [{"kind": "compiled", "variant": "full", "full_s": 0.010, "ratio_to_full": 1.0},
            {"kind": "compiled", "variant": "runtime", "full_s": 0.010, "ratio_to_full": 1.012},
            {"kind": "compiled", "variant": "torch split", "full_s": 0.010, "error": "RuntimeError: no"},
            {"kind": "eager", "variant": "full", "full_s": 0.0125, "ratio_to_full": 1.0},
            {"kind": "eager", "variant": "runtime", "full_s": 0.0125, "ratio_to_full": 1.1},
            {"kind": "eager", "variant": "torch split", "full_s": 0.0125, "ratio_to_full": 1.094}]
    out = "compiling\n" + json.dumps({"rows": rows, "torch": "2.11.0", "config": {"device": "cuda"}}, indent=2)
    assert gpu_kit.compile_figures(out) == (
        "(I+W)/full: compiled runtime 1.01x, compiled torch split cannot run, eager runtime 1.10x, "
        "eager torch split 1.09x; full backward ms per microbatch: compiled 10.00, eager 12.50 (cuda)")


def test_a_part_that_does_not_show_what_it_must_fails(tmp_path):
    part = gpu_kit.Part("train", (sys.executable, "-c", "print('trained without a pipeline')"), 60, "proves",
                        gpu_kit.train_figures, must_show=(gpu_kit.ONE_RANK_V_LOG,))
    outcome = gpu_kit.run_part(part, tmp_path)
    assert outcome.returncode == 0 and not outcome.passed and outcome.missing == (gpu_kit.ONE_RANK_V_LOG,)
    assert outcome.status.startswith("FAIL (did not show Using titan_dualpipe DualPipeV")
    assert "trained without a pipeline" in outcome.tail


# -- running parts: pass, fail, hang ------------------------------------------------------------
def test_a_failing_and_a_hanging_part_do_not_stop_the_report(monkeypatch, tmp_path, capsys):
    """Three parts: one passes, one fails, one hangs (with a child of its own) past its timeout.
    The report covers all three, the hang's process group is gone, the exit status is 1."""
    pid_file = tmp_path / "child.pid"
    hang = ("import subprocess, sys, time; "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(600)")
    fake = [_part("tests/gpu", (sys.executable, "-c", "print('== 3 passed in 0.1s ==')")),
            _part("check", (sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)")),
            _part("train", (sys.executable, "-c", hang), timeout_s=3)]
    monkeypatch.setattr(gpu_kit, "parts", lambda logs: fake)
    monkeypatch.setattr(gpu_kit, "_require_cuda", lambda: None)
    monkeypatch.setattr(gpu_kit, "machine_facts", lambda: MACHINE)
    monkeypatch.setattr(gpu_kit, "STOP_GRACE_S", 5)
    report_path = tmp_path / "kit.md"
    start = time.perf_counter()
    assert main(["gpu-kit", str(report_path)]) == 1
    assert time.perf_counter() - start < 30
    text = report_path.read_text()
    assert "| tests/gpu | pass |" in text and "3 passed in 0.1s" in text
    assert "| check | FAIL (exit 3) |" in text and "boom" in text
    assert "| train | FAIL (timed out after 3 s) |" in text and "started" in text
    child = int(pid_file.read_text())
    assert not _alive(child), "the hanging part's child outlived its timeout"
    assert (tmp_path / "kit_logs" / "check.err").read_text().strip() == "boom"


def _alive(pid: int) -> bool:
    """Still running after 5 s (a zombie awaiting its new parent's reaping counts as ended)."""
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def test_the_report_says_when_the_tree_differs_from_its_commit(tmp_path):
    """A tree copied with an older ``.git`` must not pass for that commit."""
    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.name=kit", "-c", "user.email=kit@example.com", *args], cwd=tmp_path,
                       check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    commit = gpu_kit._commit(tmp_path)
    assert len(commit) >= 7 and " " not in commit
    (tmp_path / "a.py").write_text("x = 2\n")
    assert gpu_kit._commit(tmp_path) == f"{commit} with uncommitted changes"
