"""``titan-dualpipe gpu-kit REPORT.md [--parts ...] [--dry-run]``: everything one GPU can prove,
written up as a short Markdown report.

Parts (``--dry-run`` prints their command lines): ``tests/gpu`` (the GPU test suite), ``check``
(the numerics suite, inductor-compiled blocks too), ``bench overlap``, ``bench compile``, ``train``
(torchtitan's llama3 debug model through our DualPipeV, a V of two stages on the one rank) and
``bench titan`` (the same run, timed with CUDA events). Each part runs as a subprocess in a session
of its own, with a timeout: a hang stops that part and the next one runs. A part passes when it
exits 0 and its output shows what it must (``Part.must_show``); output goes to ``REPORT_logs/``.
The exit status is 1 when any part failed, 2 without CUDA. The parts' timeouts add up to more than
one 10-minute session: ``--parts`` runs a subset, e.g. ``tests/gpu,check,bench overlap`` then
``bench compile,train,bench titan``. More: docs/numerics.md#the-gpu-tests-and-the-gpu-kit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..launch import ANSI, dump_folder_flag, shipped_config
from ..switches import CPU_STAND_IN_ENV  # tests/gpu on the CPU: never in the kit
from ..torchtitan_version import REGISTRY_RELEASES, installed

ROOT = Path(__file__).resolve().parents[2]  # the checkout (titan_dualpipe/check/gpu_kit.py): tests/gpu, train_configs/
TRAIN_NAME = "debug_dualpipev"  # a shipped config: its TOML for 0.2.2, a config_registry function for 0.3.0
ONE_RANK = ("--parallelism.pipeline_parallel_degree", "1")  # DualPipeV's two stages on the one rank
TRAIN_STEPS = 20
# what the trainer logs when it built our DualPipeV as a V of two stages on one rank (titan.pipeline)
ONE_RANK_V_LOG = r"Using titan_dualpipe DualPipeV with (\d+) microbatches and 2 stages"
TAIL_LINES = 20  # of a failed part's output, in the report
STOP_GRACE_S = 40  # after SIGTERM: torchrun's agent stops its workers, then everything gets SIGKILL


@dataclass(frozen=True)
class Part:
    name: str
    argv: tuple[str, ...]
    timeout_s: int
    proves: str  # one line in the report
    figures: Callable[[str], str]  # key figures from its stdout then stderr; may raise (the report says so)
    must_show: tuple[str, ...] = ()  # regular expressions its output must match to pass


@dataclass(frozen=True)
class Outcome:
    part: Part
    returncode: int | None  # None: timed out
    seconds: float
    figures: str
    tail: str  # the end of its output when it failed
    log: str  # where its stdout and stderr are
    missing: tuple[str, ...] = ()  # the part's must_show patterns its output did not match

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.missing

    @property
    def status(self) -> str:
        if self.returncode is None:
            return f"FAIL (timed out after {self.part.timeout_s} s)"
        if self.returncode != 0:
            return f"FAIL (exit {self.returncode})"
        return f"FAIL (did not show {', '.join(self.missing)})" if self.missing else "pass"


# -- key figures of each part, from its output ---------------------------------------------------
def pytest_figures(out: str) -> str:
    """pytest's summary line (``14 passed in 80.1s``)."""
    lines = [ln.strip(" =") for ln in out.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return lines[-1]


def _json_object(out: str) -> dict:
    """The JSON object a ``--json`` command printed (at its first line that opens one; what follows
    it, such as warnings on stderr, is left out)."""
    start = re.search(r"^\{", out, re.MULTILINE)
    return json.JSONDecoder().raw_decode(out, start.start())[0]


def check_figures(out: str) -> str:
    cases = _json_object(out)["cases"]
    passed = sum(bool(c["passed"]) for c in cases)
    grad = max(float(c["grad_err"]) for c in cases)
    loss = max(float(c["loss_err"]) for c in cases)
    return f"{passed}/{len(cases)} cases pass; max grad err {grad:.1e}, max loss err {loss:.1e}"


def overlap_figures(out: str) -> str:
    result = _json_object(out)
    names = [k[len("step_time_"):] for k in result if k.startswith("step_time_")]
    steps = ", ".join(f"{n} {result['step_time_' + n] * 1e3:.1f}" for n in names)
    exposed = ", ".join(f"{n} {result['exposed_comm_' + n] * 1e3:.1f}" for n in names)
    chunked = ", ".join(f"{n} {statistics.median(r):.3f}" for n, r in result.get("exchange_chunks", {}).items())
    floors = ", ".join(f"{n} {e['measured'] * 1e3:.1f}/{e['floor'] * 1e3:.1f}/{e['serial'] * 1e3:.1f}"
                       for n, e in result.get("exposure", {}).items())
    return (f"overlap/sequential {result['overlap_vs_sequential']:.3f}; ms/step: {steps}; "
            f"exposed comm ms/step: {exposed}; {result['network']['exchange_ms']:.2f} ms per all-to-all"
            + (f"; exposure ms/step measured/floor/1F1B (CUDA events): {floors}" if floors else "")
            + (f"; 2 chunks / whole step, median of rounds: {chunked}" if chunked else ""))


def train_figures(out: str) -> str:
    """The schedule torchtitan built (our one-rank V, when it did), the first and last logged
    loss, and the last step's throughput and memory (torchtitan's log)."""
    text = ANSI.sub("", out)
    steps = re.findall(r"step:\s*(\d+)\s+loss:\s*([-\d.]+).*?memory:\s*(\S+).*?tps:\s*([\d,]+)", text)
    (first, first_loss, _, _), (last, last_loss, memory, tps) = steps[0], steps[-1]
    built = re.search(ONE_RANK_V_LOG, text)
    schedule = f"DualPipeV, 2 stages on one rank, {built.group(1)} microbatches; " if built else "no DualPipeV built; "
    return f"{schedule}loss {first_loss} (step {first}) -> {last_loss} (step {last}); tps {tps}; memory {memory}"


def bench_titan_figures(out: str) -> str:
    result = _json_object(out)
    (label, s), = result["schedules"].items()
    phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in result["phases"][label].items())
    return (f"{s['step_time'] * 1e3:.1f} ms/step, {s['tokens_per_s']:.0f} tokens/s, exposed comm "
            f"{s['exposed_comm'] * 1e3:.2f} ms; phases ms: {phases} (CUDA events)")


def compile_figures(out: str) -> str:
    """(I+W)/full of each split variant, eager and compiled, and the full backward they divide by."""
    result = _json_object(out)
    rows, device = result["rows"], result["config"].get("device", "cpu")
    ratios = [f"{r['kind']} {r['variant']} " + (f"{r['ratio_to_full']:.2f}x" if "error" not in r else "cannot run")
              for r in rows if r["variant"] != "full"]
    full = ", ".join(f"{r['kind']} {r['full_s'] * 1e3:.2f}" for r in rows if r["variant"] == "full")
    return f"(I+W)/full: {', '.join(ratios)}; full backward ms per microbatch: {full} ({device})"


# -- the parts ----------------------------------------------------------------------------------
def _cli(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "titan_dualpipe", *args)


def _registry() -> bool:
    return installed("torchtitan") in REGISTRY_RELEASES


def parts(logs: Path) -> list[Part]:
    config = (shipped_config(TRAIN_NAME, _registry()),)
    return [
        Part("tests/gpu", (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"), 600,
             "schedules, overlapped pairs (protocol, relay, AC), two-batch overlap splitting on one rank (counted), "
             "FSDP2, CSV orders, device checks and timing, NCCL on one rank", pytest_figures),
        Part("check", _cli("check", "--nproc", "1", "--backend", "nccl", "--compile", "inductor", "--json"), 420,
             "the numerics suite against a non-pipelined reference, NCCL order (blocks compiled too)", check_figures),
        Part("bench overlap", _cli("bench", "overlap", "--device", "cuda", "--pp", "1", "--ep", "1", "--compile",
                                   "inductor", "--exchange-chunks", "2", "--charged-ep", "8", "--json"), 420,
             "MoE all-to-all overlap in DualPipeV pairs through the protocol and as a relay, each run's exposure "
             "next to its floor, exchanges whole and in 2 chunks (emulated network: a sleep kernel on a side "
             "stream, half latency, half the bytes 8 expert-parallel ranks would send away)",
             overlap_figures),
        Part("bench compile", _cli("bench", "compile", "--device", "cuda", "--blocks", "4", "--dim", "1024",
                                   "--tokens", "8192", "--seq", "512", "--microbatches", "4", "--rounds", "5",
                                   "--json"), 300,
             "a stage's backward split into I and W against its full backward on the GPU, eager and "
             "inductor-compiled (our runtime runs a compiled stage's backward whole at I)", compile_figures),
        Part("train", _cli("train", *config, "--nproc", "1", *ONE_RANK, "--training.steps", str(TRAIN_STEPS),
                           dump_folder_flag(_registry()), str(logs / "train_dump")), 420,
             "torchtitan trains the llama3 debug model through our DualPipeV: pp 1, the V's two stages on one GPU",
             train_figures, must_show=(ONE_RANK_V_LOG,)),
        Part("bench titan", _cli("bench", "titan", *config, "--nproc", "1", "--comm-ratio", "0", "--schedules",
                                 "DualPipeV", "--rounds", "1", "--steps", "6", "--warmup", "2", "--json", *ONE_RANK),
             420, "bench titan's device timing of our one-rank DualPipeV (CUDA events, our executor's phases)",
             bench_titan_figures, must_show=(r'"compute": ',)),
    ]


# -- running them -------------------------------------------------------------------------------
def _stop(proc: subprocess.Popen) -> None:
    """End a part that ran out of time: its whole process group (it runs in a session of its own)."""
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def run_part(part: Part, logs: Path) -> Outcome:
    out_path, err_path = logs / f"{_slug(part.name)}.out", logs / f"{_slug(part.name)}.err"
    start = time.perf_counter()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(part.argv, cwd=ROOT, stdout=out, stderr=err, start_new_session=True, env=_env())
        try:
            code: int | None = proc.wait(timeout=part.timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            code = None
    seconds = time.perf_counter() - start
    output = out_path.read_text(errors="replace") + "\n" + err_path.read_text(errors="replace")
    try:
        figures = part.figures(output)
    except Exception as err:  # noqa: BLE001 - missing figures are reported, not raised
        figures = f"(no figures: {type(err).__name__})"
    missing = tuple(pattern for pattern in part.must_show if not re.search(pattern, ANSI.sub("", output)))
    tail = "" if code == 0 and not missing else _tail(output)
    return Outcome(part, code, seconds, figures, tail, f"{out_path} / {err_path.name}", missing)


def _env() -> dict[str, str]:
    """This environment, output unbuffered (a stopped part keeps what it printed), GPU tests on the GPU."""
    env = {k: v for k, v in os.environ.items() if k != CPU_STAND_IN_ENV}
    return {**env, "PYTHONUNBUFFERED": "1"}


def _tail(text: str) -> str:
    return "\n".join(ANSI.sub("", text).rstrip().splitlines()[-TAIL_LINES:])


# -- the report ---------------------------------------------------------------------------------
def report(outcomes: list[Outcome], machine: dict[str, str], wall_s: float) -> str:
    verdict = "PASS" if all(o.passed for o in outcomes) else "FAIL"
    lines = [f"# titan_dualpipe GPU kit: {verdict}", ""]
    lines += [f"- {key}: {value}" for key, value in machine.items()]
    lines += [f"- wall time: {wall_s:.0f} s", "", "| part | result | wall s | key figures |", "|---|---|---|---|"]
    lines += [f"| {o.part.name} | {o.status} | {o.seconds:.0f} | {o.figures.replace('|', '/')} |" for o in outcomes]
    for o in outcomes:
        lines += ["", f"## {o.part.name}: {o.status}", "", o.part.proves, "", "```", shlex.join(o.part.argv), "```",
                  "", f"{o.seconds:.1f} s; {o.figures}; log: `{o.log}`"]
        if o.tail:
            lines += ["", "```", o.tail, "```"]
    return "\n".join(lines) + "\n"


def machine_facts() -> dict[str, str]:
    """What the figures were measured on (CUDA must be there)."""
    import torch

    return {"GPU": f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible)",
            "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
            "torchtitan": installed("torchtitan") or "not installed", "commit": _commit(),
            "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def _commit(root: Path = ROOT) -> str:
    """The checkout's commit, and whether its tracked files differ from it (a copied tree can
    carry an older ``.git``)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown"
    return f"{commit} with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else commit


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        build = torch.version.cuda or "none"
        raise ValueError(f"no CUDA device here (torch {torch.__version__}, CUDA build: {build}): "
                         "run it on a machine with a GPU; --dry-run lists the commands")


def _selected(all_parts: list[Part], names: str | None) -> list[Part]:
    if names is None:
        return all_parts
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = set(wanted) - {p.name for p in all_parts}
    if unknown or not wanted:
        known = ", ".join(p.name for p in all_parts)
        raise ValueError(f"--parts: unknown {sorted(unknown) or wanted}; choose from {known}")
    return [p for p in all_parts if p.name in wanted]


def logs_dir(report_path: Path) -> Path:
    return report_path.with_name(report_path.stem + "_logs")


def run(args: argparse.Namespace) -> int:
    report_path = Path(args.report or "gpu_kit_report.md").resolve()
    chosen = _selected(parts(logs_dir(report_path)), args.parts)
    if args.dry_run:
        for part in chosen:
            print(f"# {part.name} (timeout {part.timeout_s} s)\n{shlex.join(part.argv)}")
        return 0
    if args.report is None:
        raise ValueError("give the report's path, e.g. titan-dualpipe gpu-kit gpu_report.md")
    _require_cuda()
    logs_dir(report_path).mkdir(parents=True, exist_ok=True)
    machine, start, outcomes = machine_facts(), time.perf_counter(), []
    for part in chosen:
        print(f"gpu-kit: {part.name} ...", flush=True)
        outcomes.append(run_part(part, logs_dir(report_path)))
        print(f"gpu-kit: {part.name}: {outcomes[-1].status} ({outcomes[-1].seconds:.0f} s)", flush=True)
        # rewritten after every part: a kit stopped from outside still leaves what it proved
        report_path.write_text(report(outcomes, machine, time.perf_counter() - start))
    print(f"gpu-kit: report written to {report_path}")
    return 0 if all(o.passed for o in outcomes) else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ..cli import HelpFormatter

    p = subparsers.add_parser("gpu-kit", help="everything one GPU can prove, with a Markdown report",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("report", nargs="?", default=None, help="where to write the Markdown report")
    p.add_argument("--parts", default=None, help="comma-separated subset of: tests/gpu, check, bench overlap, "
                                                 "bench compile, train, bench titan (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print the commands it would run, run nothing")
    p.set_defaults(func=run)
