"""This process's pipeline run (:data:`ACTIVE`), shared by the adapter's modules.

Its own module so that the modules that fill it (:mod:`.trainer_hooks`: the plan and switches,
before the process group exists; :mod:`.pipeline`: the stages, as torchtitan builds the pipeline)
and those that read it (also :mod:`.expert_overlap`, :mod:`.grad_clip`, :mod:`.moe_twins`)
import it one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config_check import Plan
from .fold import FoldWindow


@dataclass
class ActiveRun:
    """This process's pipeline: set when the config is checked, filled as it is built."""

    plan: Plan | None = None
    overlap: bool = True
    two_batch: bool = False  # the config's two-batch overlap switch (0.3.0: dualpipe.two_batch_overlap)
    weight_gradients: str = "deferred"  # 0.3.0: dualpipe.weight_gradients
    not_deferred: list[str] = field(default_factory=list)  # 0.3.0: dualpipe.not_deferred
    pair_first: str = "forward"  # 0.3.0: dualpipe.pair_first
    stages: list[Any] = field(default_factory=list)
    folded: bool = False  # DualPipe's twins are one FSDP parameter (:mod:`.fold`)
    fold_window: FoldWindow = field(default_factory=FoldWindow)  # torchtitan's mesh lookups answer folded while open
    expert_parallel: bool = False  # expert_parallel_degree > 1: MoE stages exchange tokens
    exchange_chunks: int = 1  # each MoE layer's dispatch and combine cut into this many exchanges (:mod:`.expert_chunks`)

    @property
    def one_rank_v(self) -> bool:
        """DualPipeV at ``pipeline_parallel_degree`` 1: both stages of the V on each rank."""
        return self.plan is not None and self.plan.schedule == "DualPipeV" and self.plan.pp == 1


ACTIVE = ActiveRun()
