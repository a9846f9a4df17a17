"""``titan-dualpipe bench KIND``: benchmarks that print figures."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "runtime": "titan_dualpipe.bench.runtime",
    "overlap": "titan_dualpipe.bench.overlap",
    "titan": "titan_dualpipe.bench.titan",
    "compile": "titan_dualpipe.bench.compile",
    "backward": "titan_dualpipe.bench.backward",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (print figures, paired runs)")
    kinds = p.add_subparsers(dest="kind", required=True)
    for name, module in BENCHMARKS.items():
        importlib.import_module(module).add_parser(kinds)
