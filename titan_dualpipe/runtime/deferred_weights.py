"""Deprecated path: the weight-gradient names users called from here live in :mod:`titan_dualpipe.weights`."""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = {"register_expert_class", "uninstall"}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"titan_dualpipe.runtime.deferred_weights.{name} moved to titan_dualpipe.weights.{name}",
                  DeprecationWarning, stacklevel=2)
    from .. import weights

    return getattr(weights, name)
