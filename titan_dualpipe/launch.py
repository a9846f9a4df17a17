"""``titan-dualpipe train CONFIG.toml --nproc N [torchtitan overrides...]``.

Starts ``N`` local processes the way ``torchrun --standalone`` does (it calls
``torch.distributed.run``) and runs torchtitan's trainer with titan_dualpipe loaded in each.
Arguments that are not this command's own go to torchtitan, e.g. ``--training.steps 20``.
Multi-node clusters use ``torchrun`` directly (see the README).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

WORKER_MODULE = "titan_dualpipe.titan.train"


_OPTIONS: dict[str, dict] = {
    "--nproc": dict(type=int, default=None, help="number of processes (one per GPU; on CPU any number)"),
    "--log-ranks": dict(
        default=None, help='comma-separated ranks whose output is shown, or "all" (default: a rank that logs the loss)'
    ),
    "--master-port": dict(type=int, default=None, help="rendezvous port (default: a free one)"),
}


def _add_options(parser: argparse.ArgumentParser, with_defaults: bool = True) -> argparse.ArgumentParser:
    for flag, spec in _OPTIONS.items():
        parser.add_argument(flag, **(spec if with_defaults else {**spec, "default": argparse.SUPPRESS}))
    return parser


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train with torchtitan on N local processes (DualPipe / DualPipeV available by name)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="torchtitan TOML, e.g. train_configs/debug_dualpipev.toml")
    _add_options(p)
    p.add_argument("overrides", nargs=argparse.REMAINDER, help="torchtitan overrides, e.g. --training.steps 20")
    p.set_defaults(func=run)


def split_arguments(args: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    """Our options may also follow CONFIG, where the remainder swallowed them: take them back."""
    late, rest = _add_options(argparse.ArgumentParser(add_help=False), with_defaults=False).parse_known_args(
        args.overrides
    )
    for key, value in vars(late).items():
        setattr(args, key, value)
    return args, rest


def torchrun_argv(config: str, nproc: int, log_ranks: str, overrides: list[str], port: int | None) -> list[str]:
    rendezvous = ["--standalone"] if port is None else ["--rdzv-backend", "c10d", f"--rdzv-endpoint=localhost:{port}"]
    shown = ",".join(map(str, range(nproc))) if log_ranks == "all" else log_ranks
    # As torchtitan's run_train.sh: the shown ranks' output, each line prefixed "[rankN]:".
    argv = [*rendezvous, "--nnodes", "1", "--nproc-per-node", str(nproc)]
    argv += ["--local-ranks-filter", shown, "--role", "rank", "--tee", "3"]
    return [*argv, "-m", WORKER_MODULE, "--job.config_file", config, *overrides]


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


def loss_rank(config: str, overrides: list[str], nproc: int) -> int:
    """The rank whose log shows the loss: torchtitan's rule, and rank 0 for our schedules."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(config, "rb") as f:
            parallelism = tomllib.load(f).get("parallelism", {})
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"config {config!r} is not valid TOML: {err}") from None
    schedule = _option(overrides, "parallelism.pipeline_parallel_schedule") or parallelism.get(
        "pipeline_parallel_schedule", "1F1B"
    )
    degree = _option(overrides, "parallelism.pipeline_parallel_degree") or parallelism.get("pipeline_parallel_degree", 1)
    pp = int(degree) if str(degree).isdigit() else 1  # torchtitan reports a bad value itself
    if pp <= 1 or str(schedule).lower() in ("dualpipev", "dualpipe", "zbvzerobubble"):
        return 0
    return (nproc // pp) * (pp - 1)  # first rank of the last pipeline stage


def _check(config: str, nproc: int | None, log_ranks: str) -> None:
    if not Path(config).is_file():
        raise ValueError(f"config {config!r} is not a file (relative paths start at {os.getcwd()})")
    if nproc is None or nproc < 1:
        raise ValueError(f"give --nproc N, the number of processes (one per GPU; on CPU e.g. 2); got {nproc}")
    if log_ranks != "all":
        ranks = log_ranks.split(",")
        if not all(r.isdigit() and int(r) < nproc for r in ranks):
            raise ValueError(f"--log-ranks {log_ranks!r}: give ranks below --nproc {nproc}, comma-separated, or 'all'")


def run(args: argparse.Namespace) -> int:
    args, overrides = split_arguments(args)
    _check(args.config, args.nproc, args.log_ranks or "all")
    if args.log_ranks is None:
        args.log_ranks = str(loss_rank(args.config, overrides, args.nproc))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run as torchrun

    argv = torchrun_argv(args.config, args.nproc, args.log_ranks, overrides, args.master_port)
    try:
        torchrun(get_args_parser().parse_args(argv))
    except ChildFailedError as err:
        print(f"titan-dualpipe train: {len(err.failures)} process(es) failed; first error:\n{_first_error(err)}")
        return 1
    return 0


def _first_error(err: object) -> str:
    failures = getattr(err, "failures", {})
    if not failures:
        return str(err)
    message = getattr(failures[min(failures)], "message", "")
    return str(message.get("message", message) if isinstance(message, dict) else message)
