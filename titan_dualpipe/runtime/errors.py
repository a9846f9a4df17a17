"""The one exception class for a schedule that cannot run as configured (defined in
:mod:`titan_dualpipe.orders.errors`, so that ``placement()`` raises it too)."""

from __future__ import annotations

from ..orders.errors import PipelineConfigError

__all__ = ["PipelineConfigError"]
