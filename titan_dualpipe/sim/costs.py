"""Per-action costs for the simulator, and the ``F=1,B=2,W=1,FB=2.5`` string form.

``F`` is one forward of one stage on one microbatch, ``B`` its full backward, ``W`` the
weight-gradient part of ``B`` (so a split backward runs ``I = B - W`` then ``W``), and
``FB`` an overlapped forward+backward pair (``OVERLAP_F_B``); ``FB`` defaults to ``F + B``,
i.e. no gain from overlapping. ``I`` may be given too, for a split backward that costs more
than the full one (activation checkpointing recomputes its region in the I and again in the
W); a backward run whole at I (``runtime/split_backward.py``) is ``I=B,W=0``. Units are arbitrary (the simulator only adds them up), so
measured seconds can be fed in as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

_KEYS = ("F", "B", "W", "FB", "I")
_ALIASES = {"F&B": "FB", "F+B": "FB"}


@dataclass(frozen=True)
class Costs:
    """Time of one action of each kind; ``FB=None`` means ``F + B``, ``split_input=None`` (the
    ``I`` key) means ``I = B - W``."""

    F: float = 1.0
    B: float = 2.0
    W: float = 1.0
    FB: float | None = None
    split_input: float | None = None

    def __post_init__(self) -> None:
        values = {"F": self.F, "B": self.B, "W": self.W, "FB": self.FB, "I": self.split_input}
        for key, value in values.items():
            if value is None and key in ("FB", "I"):
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"cost {key}={value!r} must be a finite number >= 0.")
        if self.F <= 0 or self.B <= 0:
            raise ValueError(f"costs F={self.F} and B={self.B} must both be > 0.")
        if self.W > self.B and self.split_input is None:
            raise ValueError(
                f"cost W={self.W} is the weight-gradient part of the backward B={self.B}, so it "
                f"cannot exceed it: use W <= {self.B}, or give I too (a split backward dearer than B)."
            )

    @property
    def I(self) -> float:  # noqa: E743 - torch's name for the input-gradient part
        """Input-gradient part of a split backward."""
        return self.B - self.W if self.split_input is None else self.split_input

    @property
    def overlapped(self) -> float:
        """Time of an overlapped F+B pair."""
        return self.F + self.B if self.FB is None else self.FB

    def scaled(self, factor: float) -> "Costs":
        """The same costs for a stage ``factor`` times as large (e.g. 0.5 for half the layers)."""
        fb = None if self.FB is None else self.FB * factor
        split_input = None if self.split_input is None else self.split_input * factor
        return replace(self, F=self.F * factor, B=self.B * factor, W=self.W * factor, FB=fb, split_input=split_input)

    def as_dict(self) -> dict[str, float]:
        return {"F": self.F, "B": self.B, "W": self.W, "I": self.I, "FB": self.overlapped}

    def __str__(self) -> str:
        return ",".join(f"{key}={_fmt(value)}" for key, value in self.as_dict().items())


def _fmt(value: float) -> str:
    return f"{value:g}"


def parse_costs(text: str) -> Costs:
    """Parse ``"F=1,B=2,W=0.5,FB=2.2"``; keys are case-insensitive, missing ones keep defaults."""
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip().upper()
        key = _ALIASES.get(key, key)
        if not sep or key not in _KEYS:
            raise ValueError(
                f"cannot read cost {item!r} in {text!r}: write KEY=VALUE pairs separated by commas "
                f"with KEY one of {', '.join(_KEYS)}, e.g. F=1,B=2,W=0.5,FB=2.2."
            )
        try:
            values[key] = float(raw)
        except ValueError:
            raise ValueError(f"cost {key}={raw.strip()!r} in {text!r} is not a number.") from None
    if "I" in values:
        values["split_input"] = values.pop("I")
    return Costs(**values)
