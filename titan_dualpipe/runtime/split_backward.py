"""Deprecated path: ``register_whole_backward_rule`` lives in :mod:`titan_dualpipe.weights`."""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    if name != "register_whole_backward_rule":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn("titan_dualpipe.runtime.split_backward.register_whole_backward_rule moved to "
                  "titan_dualpipe.weights.register_whole_backward_rule", DeprecationWarning, stacklevel=2)
    from .. import weights

    return weights.register_whole_backward_rule
