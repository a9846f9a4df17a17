"""The one exception class for a schedule that cannot run as configured.

Defined here, in the bottom layer, so that ``placement()`` and ``compute_order()`` raise it as the
schedules do; ``titan_dualpipe.PipelineConfigError`` and ``titan_dualpipe.runtime.errors`` re-export it.
"""

from __future__ import annotations


class PipelineConfigError(ValueError, RuntimeError):
    """Stages, microbatch counts, placements or ``step()`` inputs that cannot work, raised on every
    rank before any pipeline traffic (and by ``placement()`` / ``compute_order()``, which need no ranks).

    A ``ValueError`` (what this package documents) and a ``RuntimeError`` (what torch's pipelining
    schedules raise for configurations they refuse), so code written for either catches it.
    """
