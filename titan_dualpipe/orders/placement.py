"""Where the stages of a DualPipe-family schedule live and how data flows between them.

Both schedules use ``2 * pp`` stage ids and torch's "v" placement: rank ``r`` holds
stages ``r`` and ``2 * pp - 1 - r``.

- DualPipeV: one chain ``0 -> 1 -> ... -> 2pp-1``; every stage runs all microbatches.
- DualPipe: two chains. Direction 0 is ``0 -> ... -> pp-1`` (stage ``s`` holds model part
  ``s``) and runs microbatches ``0 .. n/2-1``; direction 1 is ``pp -> ... -> 2pp-1``
  (stage ``pp + j`` holds model part ``j``, on rank ``pp-1-j``) and runs ``n/2 .. n-1``.
  Ranks ``0`` and ``pp-1`` each hold one first and one last stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from .dataflow import Chains
from .errors import PipelineConfigError

SCHEDULES = ("DualPipeV", "DualPipe")


def canonical_name(schedule: str) -> str:
    """Map a case-insensitive schedule name to its canonical spelling."""
    for name in SCHEDULES:
        if name.lower() == str(schedule).lower():
            return name
    raise PipelineConfigError(
        f"Unknown schedule {schedule!r}: titan_dualpipe provides {', '.join(SCHEDULES)} "
        "(names are case-insensitive)."
    )


@dataclass(frozen=True)
class Placement(Chains):
    """Stage-to-rank map and data-flow chains of one schedule instance (neighbours: :class:`Chains`)."""

    schedule: str
    pp_size: int
    n_microbatches: int

    @property
    def num_stages(self) -> int:
        return 2 * self.pp_size

    @property
    def bidirectional(self) -> bool:
        return self.schedule == "DualPipe"

    @property  # type: ignore[override]
    def chains(self) -> tuple[tuple[int, ...], ...]:
        """Stage ids of each chain, in data-flow order."""
        if self.bidirectional:
            return (tuple(range(self.pp_size)), tuple(range(self.pp_size, self.num_stages)))
        return (tuple(range(self.num_stages)),)

    def rank_of(self, stage: int) -> int:
        self._check_stage(stage)
        return stage if stage < self.pp_size else self.num_stages - 1 - stage

    def stages_of(self, rank: int) -> tuple[int, int]:
        """The two stages of ``rank``, direction-0 (or V's first leg) stage first."""
        if not 0 <= rank < self.pp_size:
            raise PipelineConfigError(f"rank {rank} is outside the pipeline of {self.pp_size} ranks")
        return rank, self.num_stages - 1 - rank

    def feeds_batch(self, rank: int) -> bool:
        """Whether ``rank`` holds a first or a last stage, so passes the whole batch
        (inputs and target) to ``step()``: DualPipeV rank 0, DualPipe ranks 0 and pp-1."""
        return any(self.is_first(s) or self.is_last(s) for s in self.stages_of(rank))

    def microbatches(self, stage: int) -> range:
        """Microbatch ids that ``stage`` processes, in FIFO order."""
        n = self.n_microbatches
        if not self.bidirectional:
            return range(n)
        return range(n // 2, n) if self.chain_of(stage) else range(n // 2)

    def microbatches_per_stage(self) -> int:
        return len(self.microbatches(0))

    def model_part(self, stage: int) -> int:
        """Index of the model part a stage holds (DualPipe: ``pp`` parts, each twice)."""
        self._check_stage(stage)
        if self.bidirectional:
            return stage % self.pp_size
        return stage

    def twin_rank(self, rank: int) -> int | None:
        """DualPipe: the rank holding the other copies of ``rank``'s two model parts."""
        return self.pp_size - 1 - rank if self.bidirectional else None

    def _check_stage(self, stage: int) -> None:
        if not 0 <= stage < self.num_stages:
            raise PipelineConfigError(
                f"stage {stage} is outside 0..{self.num_stages - 1} ({self.schedule}, pp={self.pp_size})"
            )


def check_requirements(schedule: str, pp_size: int, n_microbatches: int) -> str:
    """Raise :class:`PipelineConfigError` (a ``ValueError``) naming the values and the fix if (schedule, pp, n)
    cannot run."""
    name = canonical_name(schedule)
    if not isinstance(pp_size, int) or pp_size < 1:
        raise PipelineConfigError(f"{name} needs a pipeline size >= 1, got pp_size={pp_size!r}.")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise PipelineConfigError(f"{name} needs n_microbatches >= 1, got {n_microbatches!r}.")
    if name == "DualPipe":
        if pp_size % 2:
            even = f"{pp_size - 1} or {pp_size + 1}" if pp_size > 1 else "2"
            raise PipelineConfigError(
                f"DualPipe needs an even pipeline size, got pp_size={pp_size}: use an even pp ({even}) or "
                "DualPipeV, which takes any pp."
            )
        if n_microbatches % 2:
            raise PipelineConfigError(
                f"DualPipe needs an even number of microbatches (half enter at each end), got "
                f"n_microbatches={n_microbatches}: use {n_microbatches + 1}."
            )
    if n_microbatches < 2 * pp_size:
        raise PipelineConfigError(
            f"{name} needs n_microbatches >= 2 * pp_size, got n_microbatches={n_microbatches} "
            f"with pp_size={pp_size}: use at least {2 * pp_size} microbatches or a smaller pp."
        )
    return name


def placement(schedule: str, pp_size: int, n_microbatches: int) -> Placement:
    """Validated placement for ``schedule`` on ``pp_size`` ranks with ``n_microbatches`` microbatches per
    step (they decide which microbatches each stage runs); :class:`PipelineConfigError` if they cannot run."""
    name = check_requirements(schedule, pp_size, n_microbatches)
    return Placement(name, pp_size, n_microbatches)
