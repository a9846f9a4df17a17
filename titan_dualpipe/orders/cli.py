"""``titan-dualpipe csv``: write a schedule in torch's CSV format."""

from __future__ import annotations

import argparse
import sys

from ..cli import HelpFormatter
from . import compute_order, placement
from .csv_io import write_csv
from .lowering import lower


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("csv", help="write a schedule as a torch pipelining CSV (one row per rank)",
                              formatter_class=HelpFormatter)
    p.add_argument("--schedule", required=True, help="DualPipe or DualPipeV")
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    p.add_argument(
        "--format",
        choices=("compute_only", "compute_comms"),
        default="compute_only",
        help="compute_only (default; torch lowers it when loading) or compute_comms (lowered, run verbatim)",
    )
    p.add_argument("--defer-recv", action="store_true", help="compute_comms: post each RECV just before its use")
    p.add_argument("-o", "--output", help="output file (default: stdout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    order = compute_order(args.schedule, args.pp, args.microbatches)
    if args.format == "compute_comms":
        order = lower(order, placement(args.schedule, args.pp, args.microbatches), defer_recv=args.defer_recv)
    if args.output:
        with open(args.output, "w", newline="") as f:
            write_csv(order, f)
        print(f"wrote {args.output}")
    else:
        write_csv(order, sys.stdout)
    return 0
