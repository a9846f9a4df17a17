"""torch's pipelining CSV format: one row per rank, one action per cell, empty cell = idle."""

from __future__ import annotations

import csv
from typing import IO

from .._compat.pipelining import _Action


def write_csv(order: dict[int, list[_Action | None]], stream: IO[str]) -> None:
    writer = csv.writer(stream)
    for rank in sorted(order):
        writer.writerow("" if a is None else str(a) for a in order[rank])


def read_csv(stream: IO[str]) -> dict[int, list[_Action | None]]:
    """Parse a CSV written by :func:`write_csv` or by torch's ``_dump_csv``."""
    return {rank: [_Action.from_str(cell) for cell in row] for rank, row in enumerate(csv.reader(stream))}


def load_csv(path: str) -> dict[int, list[_Action | None]]:
    with open(path, newline="") as f:
        return read_csv(f)
