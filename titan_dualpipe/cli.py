"""``titan-dualpipe`` / ``python -m titan_dualpipe``: one sub-command per module.

Each module in ``COMMAND_MODULES`` defines ``add_parser(subparsers)`` and sets
``func`` on its parser; heavy imports (torchtitan, matplotlib) stay inside ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "titan_dualpipe.orders.cli",  # csv
    "titan_dualpipe.check.cli",  # check
    "titan_dualpipe.bench.cli",  # bench
    "titan_dualpipe.launch",  # train (torchtitan is imported only when it runs)
    "titan_dualpipe.sim.cli",  # simulate, draw
    "titan_dualpipe.sim.profile",  # profile
    "titan_dualpipe.check.gpu_kit",  # gpu-kit (every part runs in a subprocess)
    "titan_dualpipe.check.matrix",  # matrix (torchtitan runs in subprocesses)
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every sub-command's help: defaults shown (where there is one), descriptions as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="titan-dualpipe", description="DualPipe / DualPipeV pipeline schedules for torch and torchtitan"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as err:
        print(f"titan-dualpipe {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file named on the command line: missing, a directory, not writable
        if err.filename is None:
            raise
        print(f"titan-dualpipe {args.command}: error: {err.filename}: {err.strerror or err}", file=sys.stderr)
        return 2
