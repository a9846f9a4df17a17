"""Counting compiled backward calls by the profiler range they ran in (``bench compile`` and
``profile --compile``: which of a pipeline's actions ran a torch.compile'd stage's backward)."""

from __future__ import annotations

from typing import Any, Callable

import torch

COMPILED_BACKWARD_EVENT = "CompiledFunctionBackward"  # one profiler event per compiled backward call


def compiled_backwards_by_range(fn: Callable[[], Any]) -> dict[str, int]:
    """Compiled backward calls ``fn()`` ran (profiler events ``CompiledFunctionBackward``) by the
    range they ran in: a pipeline action's profiler name (``PP:1I0``, ``PP:1W0``, as the executor
    names them) or a ``split:`` range; calls outside any such range under ``''``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.events()
    ranges = [e for e in events if e.name.startswith(("PP:", "split:"))]
    counts: dict[str, int] = {r.name: 0 for r in ranges}
    for event in events:
        if event.name != COMPILED_BACKWARD_EVENT:
            continue
        inside = [r.name for r in ranges
                  if r.time_range.start <= event.time_range.start and event.time_range.end <= r.time_range.end]
        key = inside[-1] if inside else ""
        counts[key] = counts.get(key, 0) + 1
    return counts
