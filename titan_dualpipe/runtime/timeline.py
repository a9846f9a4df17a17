"""What the runtime records per action when ``record_timeline=True`` (drawn by :mod:`..sim.timeline`)."""

from __future__ import annotations

from typing import NamedTuple

from .._compat import _Action


class TimedAction(NamedTuple):
    """One action (an ``OVERLAP_F_B`` pair counts as one) that ran on ``rank`` from ``start`` to ``end``."""

    rank: int
    action: _Action
    start: float
    end: float
