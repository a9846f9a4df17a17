"""What the one-stage benchmarks (``bench compile``, ``bench backward``) share: their size checks and output."""

from __future__ import annotations

import json
from typing import Callable

SIZE_OPTIONS = ("blocks", "dim", "tokens", "seq", "microbatches", "rounds", "threads")


def check_stage_sizes(cfg: dict) -> None:
    """ValueError naming a size option that cannot work and its fix."""
    for key in SIZE_OPTIONS:
        if cfg[key] < 1:
            raise ValueError(f"--{key} {cfg[key]}: give 1 or more")
    if cfg["tokens"] % cfg["seq"]:
        raise ValueError(f"--tokens {cfg['tokens']} is not a multiple of --seq {cfg['seq']}: "
                         f"give --tokens {max(1, cfg['tokens'] // cfg['seq']) * cfg['seq']} or another --seq")
    if cfg["model"] == "tinylm" and cfg["dim"] % 4:
        raise ValueError(f"--dim {cfg['dim']}: TinyLM blocks have 4 heads, give a multiple of 4")


def emit(result: dict, as_json: bool, table: Callable[[dict], None]) -> int:
    """Print ``result`` as JSON or as ``table`` lays it out; the command's exit code."""
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        table(result)
    return 0
