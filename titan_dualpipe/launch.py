"""``titan-dualpipe train CONFIG --nproc N [torchtitan overrides...]``.

CONFIG is what the installed torchtitan reads: a TOML file for torchtitan 0.2.2
(``train_configs/debug_dualpipev.toml``), a config name for 0.3.0 (``debug_dualpipev``, a
function of ``--module``, default ``titan_dualpipe.titan``). Starts ``N`` local processes the
way ``torchrun --standalone`` does (it calls ``torch.distributed.run``) and runs torchtitan's
trainer with titan_dualpipe loaded in each. Arguments that are not this command's own go to
torchtitan, e.g. ``--training.steps 20``. When processes fail it reports the first real error
(not the stop signal the others then receive), parse errors included. Multi-node clusters use
``torchrun`` directly (docs/torchtitan.md#clusters-plain-torchrun).

Importing this module needs neither torch nor torchtitan: the sub-command is listed even where
torchtitan is missing, and says so when run.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from .torchtitan_version import check_torchtitan_version, uses_config_registry

WORKER_MODULE = "titan_dualpipe.titan.train"
DEFAULT_MODULE = "titan_dualpipe.titan"

_OPTIONS: dict[str, dict] = {
    "--nproc": dict(type=int, default=None, help="number of processes (one per GPU; on CPU any number)"),
    "--log-ranks": dict(
        default=None, help='comma-separated ranks whose output is shown, or "all" (default: a rank that logs the loss)'
    ),
    "--master-port": dict(type=int, default=None, help="rendezvous port (default: a free one)"),
    "--module": dict(
        default=DEFAULT_MODULE, help=f"torchtitan 0.3.0: the module whose config_registry holds CONFIG (default {DEFAULT_MODULE})"
    ),
}


def add_options(parser: argparse.ArgumentParser, options: dict[str, dict],
                with_defaults: bool = True) -> argparse.ArgumentParser:
    """Add ``{flag: add_argument keywords}`` to ``parser`` (without defaults: only given ones are set)."""
    for flag, spec in options.items():
        parser.add_argument(flag, **(spec if with_defaults else {**spec, "default": argparse.SUPPRESS}))
    return parser


def take_back_options(args: argparse.Namespace, options: dict[str, dict]) -> list[str]:
    """A command's own ``options`` may also follow CONFIG, where the ``overrides`` remainder
    swallowed them: set them on ``args``; returns the rest of the remainder."""
    parser = add_options(argparse.ArgumentParser(add_help=False), options, with_defaults=False)
    late, rest = parser.parse_known_args(args.overrides)
    for key, value in vars(late).items():
        setattr(args, key, value)
    return rest


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train with torchtitan on N local processes (DualPipe / DualPipeV available by name)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="torchtitan 0.2.2: a TOML (train_configs/debug_dualpipev.toml); 0.3.0: a config "
                                  "name (debug_dualpipev)")
    add_options(p, _OPTIONS)
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="torchtitan overrides, e.g. --training.steps 20")
    p.set_defaults(func=run)


def split_arguments(args: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    """Our options may also follow CONFIG (see :func:`take_back_options`)."""
    return args, take_back_options(args, _OPTIONS)


def config_arguments(config: str, module: str, registry: bool) -> list[str]:
    """How torchtitan is told the config: ``--job.config_file`` (0.2.2), ``--module/--config`` (0.3.0)."""
    return ["--module", module, "--config", config] if registry else ["--job.config_file", config]


def torchrun_argv(config_args: list[str], nproc: int, log_ranks: str, overrides: list[str], port: int | None,
                  log_dir: str | None = None) -> list[str]:
    rendezvous = ["--standalone"] if port is None else ["--rdzv-backend", "c10d", f"--rdzv-endpoint=localhost:{port}"]
    shown = ",".join(map(str, range(nproc))) if log_ranks == "all" else log_ranks
    # As torchtitan's run_train.sh: the shown ranks' output, each line prefixed "[rankN]:".
    argv = [*rendezvous, "--nnodes", "1", "--nproc-per-node", str(nproc)]
    argv += ["--local-ranks-filter", shown, "--role", "rank", "--tee", "3"]
    argv += ["--log-dir", log_dir] if log_dir else []
    return [*argv, "-m", WORKER_MODULE, *config_args, *overrides]


def _option(overrides: list[str], key: str) -> str | None:
    """The last value given to torchtitan option ``--key`` (``--key v`` or ``--key=v``)."""
    value = None
    for i, arg in enumerate(overrides):
        name, eq, inline = arg.partition("=")
        if name.replace("-", "_") != f"__{key}":  # tyro takes dashes or underscores
            continue
        if eq:
            value = inline
        elif i + 1 < len(overrides):
            value = overrides[i + 1]
    return value


def _toml_parallelism(config: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(config, "rb") as f:
            return tomllib.load(f).get("parallelism", {})
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config {config!r} is not valid TOML: {err}") from None


def load_registry_config(module: str, name: str) -> Any:
    """The config ``--module module --config name`` gives torchtitan 0.3.0 (its own lookup)."""
    from torchtitan.config import ConfigManager

    try:
        config, _ = ConfigManager()._load_config(["--module", module, "--config", name])
    except ImportError as err:
        raise ValueError(f"--module {module}: {err}") from None
    return config


def loss_rank(schedule: str, degree: Any, nproc: int) -> int:
    """The rank whose log shows the loss: torchtitan's rule, and rank 0 for our schedules."""
    pp = int(degree) if str(degree).isdigit() else 1  # torchtitan reports a bad value itself
    if pp <= 1 or str(schedule).lower() in ("dualpipev", "dualpipe", "zbvzerobubble"):
        return 0
    return (nproc // pp) * (pp - 1)  # first rank of the last pipeline stage


def _default_log_rank(config: str, module: str, registry: bool, overrides: list[str], nproc: int) -> int:
    if registry:
        par = load_registry_config(module, config).parallelism
        schedule, degree = par.pipeline_parallel_schedule, par.pipeline_parallel_degree
    else:
        par = _toml_parallelism(config)
        schedule, degree = par.get("pipeline_parallel_schedule", "1F1B"), par.get("pipeline_parallel_degree", 1)
    schedule = _option(overrides, "parallelism.pipeline_parallel_schedule") or schedule
    degree = _option(overrides, "parallelism.pipeline_parallel_degree") or degree
    return loss_rank(schedule, degree, nproc)


def _check_config(config: str, release: str) -> None:
    """A TOML for 0.2.2, a config name for 0.3.0; ValueError naming the fix otherwise."""
    is_toml = config.endswith(".toml")
    stem = Path(config).stem
    if uses_config_registry(release) and is_toml:
        raise ValueError(
            f"torchtitan {release} has no TOML configs; give a config name instead of {config!r} "
            f"(ours: e.g. {stem}, from --module {DEFAULT_MODULE}; see docs/torchtitan.md#shipped-configs)"
        )
    if not uses_config_registry(release) and not is_toml:
        raise ValueError(
            f"torchtitan {release} reads TOML files; {config!r} is not one (config names are torchtitan 0.3.0's; "
            f"the 0.2.2 TOML of ours is train_configs/{stem}.toml)"
        )
    if is_toml and not Path(config).is_file():
        raise ValueError(f"config {config!r} is not a file (relative paths start at {os.getcwd()})")


def _check(nproc: int | None, log_ranks: str) -> None:
    if nproc is None or nproc < 1:
        raise ValueError(f"give --nproc N, the number of processes (one per GPU; on CPU e.g. 2); got {nproc}")
    if log_ranks != "all":
        ranks = log_ranks.split(",")
        if not all(r.isdigit() and int(r) < nproc for r in ranks):
            raise ValueError(f"--log-ranks {log_ranks!r}: give ranks below --nproc {nproc}, comma-separated, or 'all'")


SHIPPED_TOMLS = Path(__file__).resolve().parent.parent / "train_configs"  # a checkout's 0.2.2 configs


def shipped_config(name: str, registry: bool) -> str:
    """A shipped config as the installed torchtitan takes it: its name (config registry, 0.3.0) or
    its TOML (0.2.2)."""
    return name if registry else str(SHIPPED_TOMLS / f"{name}.toml")


def dump_folder_flag(registry: bool) -> str:
    """torchtitan's option naming a run's output folder, as the release spells it."""
    return "--dump_folder" if registry else "--job.dump_folder"


def _release() -> str:
    try:
        return check_torchtitan_version()
    except ImportError as err:
        raise ValueError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    args, overrides = split_arguments(args)
    release = _release()
    registry = uses_config_registry(release)
    _check_config(args.config, release)
    _check(args.nproc, args.log_ranks or "all")
    if args.log_ranks is None:
        args.log_ranks = str(_default_log_rank(args.config, args.module, registry, overrides, args.nproc))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run as torchrun

    with tempfile.TemporaryDirectory(prefix="titan_dualpipe_logs_") as log_dir:
        config_args = config_arguments(args.config, args.module, registry)
        argv = torchrun_argv(config_args, args.nproc, args.log_ranks, overrides, args.master_port, log_dir)
        try:
            torchrun(get_args_parser().parse_args(argv))
        except ChildFailedError as err:
            print(f"titan-dualpipe train: {len(err.failures)} process(es) failed; first error:\n"
                  f"{first_error(err.failures, log_dir)}")
            return 1
    return 0


ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal colours in torchtitan's log lines
# a rank's metrics line as this command shows it: "[rankN]:... step: S  loss: L  grad_norm: G"
LOG_LINE = re.compile(r"\[rank(\d+)\]:.*step:\s*(\d+)\s+loss:\s*(-?[\d.]+)\s+grad_norm:\s*([\d.]+)")
TAIL_LINES = 20


def logged_steps(output: str) -> dict[int, dict[int, tuple[float, float]]]:
    """``{rank: {step: (loss, grad_norm)}}`` from the output of a run of this command."""
    table: dict[int, dict[int, tuple[float, float]]] = {}
    for rank, step, loss, norm in LOG_LINE.findall(ANSI.sub("", output)):
        table.setdefault(int(rank), {})[int(step)] = (float(loss), float(norm))
    return table


def _failure_order(item: tuple[int, Any]) -> tuple[float, int]:
    """When a rank failed: its error file's write time, else the moment the agent saw it."""
    rank, failure = item
    error_file = getattr(failure, "error_file", None)
    when = os.path.getmtime(error_file) if error_file and os.path.isfile(error_file) else float(failure.timestamp)
    return when, rank


def _stderr_tail(log_dir: str, local_rank: int) -> str:
    """The last lines a rank wrote to stderr (torchrun's ``--log-dir`` copy)."""
    logs = sorted(glob.glob(os.path.join(log_dir, "*", "attempt_*", str(local_rank), "stderr.log")))
    if not logs:
        return ""
    lines = [ANSI.sub("", line).rstrip() for line in Path(logs[-1]).read_text(errors="replace").splitlines()]
    return "\n".join([line for line in lines if line.strip()][-TAIL_LINES:])


def first_error(failures: dict[int, Any], log_dir: str | None) -> str:
    """The first real failure: a rank's own error (exit code > 0) before the signal torchrun sends
    the others; with a traceback when the rank wrote one, else the end of its stderr."""
    real = {rank: f for rank, f in failures.items() if f.exitcode > 0}
    rank, failure = min((real or failures).items(), key=_failure_order)
    message = failure.message
    message = str(message.get("message", message) if isinstance(message, dict) else message)
    has_error_file = bool(failure.error_file) and os.path.isfile(failure.error_file)
    if has_error_file or failure.exitcode < 0 or log_dir is None:
        return f"[rank{rank}]: {message}"
    tail = _stderr_tail(log_dir, getattr(failure, "local_rank", rank))
    return f"[rank{rank}]: exit code {failure.exitcode}; the end of its output:\n{tail or message}"
