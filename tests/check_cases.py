"""What each rank of a ``WorkerPool`` runs for tests/test_check.py (importable by the workers)."""

from __future__ import annotations

from typing import Any

from titan_dualpipe.check import cli as check_cli


def cases_counting_groups(cases: list[check_cli.Case], fault: check_cli.Fault | None = None,
                          case_timeout_s: float = check_cli.CASE_TIMEOUT_S) -> dict[str, Any]:
    """``check``'s worker on this rank, with the process groups alive before and after it."""
    before = check_cli.live_groups()
    outcomes = check_cli._worker(cases, "gloo", fault, case_timeout_s)
    return {"groups_before": before, "groups_after": check_cli.live_groups(), "outcomes": outcomes}
