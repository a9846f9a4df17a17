"""The one exception class for a schedule that cannot run as configured."""

from __future__ import annotations


class PipelineConfigError(ValueError, RuntimeError):
    """Stages, microbatch counts, placements or ``step()`` inputs that cannot work, raised on every
    rank before any pipeline traffic.

    A ``ValueError`` (what this package documents) and a ``RuntimeError`` (what torch's pipelining
    schedules raise for configurations they refuse), so code written for either catches it.
    """
