"""torchtitan 0.3.0: a trainer config with our ``dualpipe`` section (overlap and weight-gradient switches).

torchtitan 0.3.0 has no config key for our schedules' ``overlap`` (0.2.2 reused its
``pipeline_parallel_expert_parallel_overlap``), ``two_batch_overlap`` or ``weight_gradients``, and
its configs are dataclasses whose fields are the command line. :class:`DualPipeTrainer` is
torchtitan's ``Trainer`` unchanged; its ``Config`` adds one section (:class:`DualPipeOptions`:
``--dualpipe.no-overlap``, ``--dualpipe.two-batch-overlap``, ``--dualpipe.weight-gradients``,
``--dualpipe.pair-first``, ...),
which :func:`with_dualpipe` adds to a config of a ``config_registry``. A plain ``Trainer.Config``
works with our schedules too, with the defaults. Usage: docs/torchtitan.md#in-your-own-config_registry-torchtitan-030.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from torchtitan.trainer import Trainer


@dataclass(kw_only=True, slots=True)
class DualPipeOptions:
    overlap: bool = True
    """Overlap the forward and backward halves of DualPipe / DualPipeV's overlapped pairs
    (relay or module protocol); false runs them one after the other. Same results either way."""

    two_batch_overlap: bool = False
    """Run each lone forward (one without a pair partner) of a stage that posts expert-parallel
    exchanges as two sub-batches, one computing while the other's exchange is in flight (needs
    ``overlap`` and microbatches of >= 2 rows). On when this is true or when the environment has
    ``TITAN_DUALPIPE_TWO_BATCH=1`` (either turns it on; the variable alone also works on
    torchtitan 0.2.2, which has no config key for it)."""

    weight_gradients: str = "deferred"
    """How an I leaves the weight gradient to its W: "deferred" (one backward at I, the weight
    GEMMs queued for W; activation-checkpointed blocks recompute once; compiled blocks run whole at
    I), "deferred_compiled" (the same, the linear layers of compiled blocks deferring too), "split"
    (torch's split of the graph; checkpointed microbatches run whole at I) or "whole" (every
    backward whole at I).
    ``TITAN_DUALPIPE_WEIGHT_GRADIENTS`` overrides it (and sets it on torchtitan 0.2.2)."""

    not_deferred: list[str] = field(default_factory=list)
    """Module names or fnmatch patterns inside a stage (e.g. "output", "layers.*.moe.*") whose
    weight GEMMs are not deferred. ``TITAN_DUALPIPE_NOT_DEFERRED`` (comma-separated) adds to it."""

    pair_first: str = "forward"
    """Which half of a relayed pair runs first, and where it hands over: "forward", "backward"
    (alternating from that half), "measured" (per kind of pair, the order the floor's model finds
    best for the second step's segments, agreed over all ranks) or "measured_first" (the same,
    alternating from the better half). Only the CPU's emulated exchanges have known times,
    elsewhere the forward first. ``TITAN_DUALPIPE_PAIR_FIRST`` overrides it (and sets it on
    torchtitan 0.2.2)."""


class DualPipeTrainer(Trainer):
    """torchtitan's ``Trainer``; its ``Config`` carries :class:`DualPipeOptions`."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        dualpipe: DualPipeOptions = field(default_factory=DualPipeOptions)


def with_dualpipe(config: Trainer.Config, overlap: bool = True, two_batch_overlap: bool = False,
                  weight_gradients: str = "deferred") -> DualPipeTrainer.Config:
    """``config`` (a ``Trainer.Config``) with the ``dualpipe`` section added, every other field kept."""
    if type(config) is not Trainer.Config and not isinstance(config, DualPipeTrainer.Config):
        raise ValueError(
            f"with_dualpipe takes torchtitan's Trainer.Config, got {type(config).__qualname__}: "
            "add a `dualpipe: DualPipeOptions` field to that config class instead."
        )
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    values["dualpipe"] = DualPipeOptions(overlap=overlap, two_batch_overlap=two_batch_overlap,
                                         weight_gradients=weight_gradients)
    return DualPipeTrainer.Config(**values)
