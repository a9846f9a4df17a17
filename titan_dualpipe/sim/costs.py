"""Per-action costs for the simulator, and the ``F=1,B=2,W=1,FB=2.5`` string form.

``F`` is one forward of one stage on one microbatch, ``B`` its full backward, ``W`` the
weight-gradient part of ``B`` (so a split backward runs ``I = B - W`` then ``W``), and
``FB`` an overlapped forward+backward pair (``OVERLAP_F_B``); ``FB`` defaults to ``F + B``,
i.e. no gain from overlapping. ``I`` may be given too, for a split backward that costs more
than the full one (activation checkpointing recomputes its region in the I and again in the
W); a backward run whole at I (``weights/plan.py``) is ``I=B,W=0``. Units are arbitrary (the simulator only adds them up), so
measured seconds can be fed in as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

_KEYS = ("F", "B", "W", "FB", "I", "F2", "B2")
_OPTIONAL = ("FB", "I", "F2", "B2")  # None: derived from the others
_ALIASES = {"F&B": "FB", "F+B": "FB"}


@dataclass(frozen=True)
class Costs:
    """Time of one action of each kind; ``FB=None`` means ``F + B``, ``split_input=None`` (the
    ``I`` key) means ``I = B - W``, ``F2=None`` / ``B2=None`` mean ``F`` / ``B``."""

    F: float = 1.0
    B: float = 2.0
    W: float = 1.0
    FB: float | None = None
    split_input: float | None = None
    F2: float | None = None
    B2: float | None = None

    def __post_init__(self) -> None:
        for key, value in self._given().items():
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"cost {key}={value!r} must be a finite number >= 0.")
        if self.F <= 0 or self.B <= 0:
            raise ValueError(f"costs F={self.F} and B={self.B} must both be > 0.")
        for key in ("F2", "B2"):
            if getattr(self, key) == 0:
                raise ValueError(f"cost {key}=0: an action on two sub-batches takes time, give {key} > 0 "
                                 f"(or leave it out for {key[0]}).")
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

    @property
    def forward_in_sub_batches(self) -> float:
        """Time of a forward on the two sub-batches of its microbatch."""
        return self.F if self.F2 is None else self.F2

    @property
    def backward_in_sub_batches(self) -> float:
        """Time of a full backward on the two sub-batches of its microbatch."""
        return self.B if self.B2 is None else self.B2

    def _given(self) -> dict[str, float]:
        """The costs set, by their string-form keys (optional ones only when given)."""
        values = {"F": self.F, "B": self.B, "W": self.W, "FB": self.FB, "I": self.split_input,
                  "F2": self.F2, "B2": self.B2}
        return {key: value for key, value in values.items() if value is not None or key not in _OPTIONAL}

    def scaled(self, factor: float) -> "Costs":
        """The same costs for a stage ``factor`` times as large (e.g. 0.5 for half the layers)."""
        def times(value: float | None) -> float | None:
            return None if value is None else value * factor

        return replace(self, F=self.F * factor, B=self.B * factor, W=self.W * factor, FB=times(self.FB),
                       split_input=times(self.split_input), F2=times(self.F2), B2=times(self.B2))

    def as_dict(self) -> dict[str, float]:
        """F, B, W, I, FB, and F2 / B2 where given."""
        sub_batches = {key: value for key, value in (("F2", self.F2), ("B2", self.B2)) if value is not None}
        return {"F": self.F, "B": self.B, "W": self.W, "I": self.I, "FB": self.overlapped, **sub_batches}

    def __str__(self) -> str:
        return ",".join(f"{key}={_fmt(value)}" for key, value in self.as_dict().items())


def _fmt(value: float) -> str:
    return f"{value:g}"


def parse_costs(text: str) -> Costs:
    """Parse ``"F=1,B=2,W=0.5,FB=2.2,F2=0.8,B2=1.6"``; keys are case-insensitive, missing ones keep defaults."""
    values: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip().upper()
        key = _ALIASES.get(key, key)
        if not sep or key not in _KEYS:
            raise ValueError(
                f"cannot read cost {item!r} in {text!r}: write KEY=VALUE pairs separated by commas "
                f"with KEY one of {', '.join(_KEYS)}, e.g. F=1,B=2,W=0.5,FB=2.2,F2=0.8,B2=1.6."
            )
        try:
            values[key] = float(raw)
        except ValueError:
            raise ValueError(f"cost {key}={raw.strip()!r} in {text!r} is not a number.") from None
    if "I" in values:
        values["split_input"] = values.pop("I")
    return Costs(**values)
