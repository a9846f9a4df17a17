"""How each I (input gradient) leaves the weight gradient to its W.

Under the schedules' default, ``weight_gradients="deferred"``, an I runs one backward with the
weight GEMMs queued for W (:mod:`.deferred_weights`), whatever regions the forward ran; only
stages kept whole by a static rule (compiled blocks, below) run whole, unless their compiled
blocks defer too (``"deferred_compiled"``). The rest of this docstring is about
``weight_gradients="split"``, torch's split of the graph.

torch's split backward runs autograd twice through a microbatch's graph: I with ``retain_graph``,
then W. Some regions cannot be run twice, or pay twice when they are:

- selective activation checkpointing (``checkpoint(..., use_reentrant=False,
  context_fn=create_selective_checkpoint_contexts(...))``, torchtitan's ``selective`` modes):
  its saved values serve one backward; the second stops with "Trying to backward an extra
  time";
- full activation checkpointing recomputes its region in each backward, so I and W pay for
  the recomputation twice (measured: far more than twice, docs/activation_checkpointing.md).

- torch.compile'd modules: a compiled backward runs once per graph (after one full backward it
  refuses ``retain_graph``, "donated buffers", pytorch#161904), and a W after an I would run the
  compiled backward a second time (about 2.5x the full backward, measured on 4 compiled MLP
  blocks): a stage holding compiled modules keeps its backward whole.

A microbatch of a stage whose forward ran such a region gets a full backward at its I (input
and weight gradients in one autograd pass), and its W does nothing. Its I then costs what a
full backward costs and its W nothing, which the simulator models as ``W = 0`` for those stages
(``titan_dualpipe.sim``). The verdict is taken per stage and microbatch while the forward runs
(:func:`~titan_dualpipe._compat.autograd.checkpoint_regions_seen`), so it holds for checkpoint regions
wherever they are: torch's ``checkpoint_wrapper`` modules (torchtitan) and ``checkpoint(...)``
calls inside a user's ``forward``. Other reasons to keep a stage whole are static and module
based: :func:`register_whole_backward_rule` adds one (a rule returns why a stage module needs
a full backward, or ``''``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch._dynamo.eval_frame import OptimizedModule

from .._compat.autograd import checkpoint_regions_seen

# Region kinds seen in a forward that make its backward run whole at I. "checkpoint" covers
# full activation checkpointing too: one recomputation instead of two (docs/activation_checkpointing.md
# for the measurement).
WHOLE_BACKWARD_REGIONS = frozenset({"selective", "checkpoint"})

StageRule = Callable[[torch.nn.Module], str]
_stage_rules: list[StageRule] = []


def register_whole_backward_rule(rule: StageRule) -> None:
    """Add a static rule: ``rule(stage_module)`` returns why the stage's backward must run whole
    at I (and its W be a no-op), or ``''``."""
    if rule not in _stage_rules:
        _stage_rules.append(rule)


def compiled_modules(module: torch.nn.Module) -> list[str]:
    """Names of the torch.compile'd modules inside ``module`` (wrapped, or compiled in place)."""
    return [name or "<stage module>" for name, m in module.named_modules()
            if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None]


def _compiled_reason(module: torch.nn.Module) -> str:
    names = compiled_modules(module)
    if not names:
        return ""
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return f"torch.compile'd modules ({shown}): a compiled backward runs once per graph"


register_whole_backward_rule(_compiled_reason)


def whole_backward_reason(module: torch.nn.Module) -> str:
    """Why ``module``'s backward runs whole at I by a static rule, or ``''``."""
    for rule in _stage_rules:
        reason = rule(module)
        if reason:
            return reason
    return ""


class SplitDecisions:
    """Per step: how each (stage, microbatch)'s ``I`` runs.

    - ``"deferred"``: the full backward with the weight GEMMs queued for ``W``
      (:mod:`.deferred_weights`), on the stages the schedule installed them on;
    - ``"whole"``: the full backward, ``W`` a no-op (a static rule, ``weight_gradients="whole"``,
      or, under ``"split"``, a checkpointed forward or one run in halves);
    - ``"split"``: torch's split of the graph (``I`` with ``retain_graph``, then ``W``).
    """

    def __init__(self, static_whole: set[int], mode: str = "split", deferred_stages: frozenset[int] = frozenset()) -> None:
        self.static_whole = static_whole  # stages kept whole by a static rule
        self.mode = mode
        self.deferred_stages = deferred_stages
        self.whole: set[tuple[int, int]] = set()
        self.done_at_input: set[tuple[int, int]] = set()
        self.deferred: set[tuple[int, int]] = set()

    @contextlib.contextmanager
    def observe_forward(self, stage_index: int, mb: int) -> Iterator[None]:
        """Run a forward of ``stage_index`` for ``mb``; note whether it ran a region whose backward must not split."""
        with checkpoint_regions_seen() as kinds:
            yield
        if stage_index in self.static_whole or self.mode == "whole":
            self.whole.add((stage_index, mb))
        elif stage_index not in self.deferred_stages and kinds & WHOLE_BACKWARD_REGIONS:
            self.whole.add((stage_index, mb))

    def keep_whole(self, stage_index: int, mb: int) -> None:
        """A microbatch that ran in halves: torch's split cannot take its backward apart
        (deferred GEMMs can: both halves queue theirs)."""
        if stage_index not in self.deferred_stages:
            self.whole.add((stage_index, mb))

    def at_input(self, stage_index: int, mb: int) -> str:
        """``"deferred"``, ``"whole"`` or ``"split"``: how ``mb``'s ``I`` on ``stage_index`` runs."""
        if (stage_index, mb) in self.whole:
            return "whole"
        return "deferred" if stage_index in self.deferred_stages else "split"

    def ran_at_input(self, stage_index: int, mb: int, how: str) -> None:
        (self.deferred if how == "deferred" else self.done_at_input).add((stage_index, mb))

    def weight_already_done(self, stage_index: int, mb: int) -> bool:
        """True (once) when ``mb``'s W on ``stage_index`` has nothing left: its I ran the whole backward."""
        if (stage_index, mb) in self.done_at_input:
            self.done_at_input.remove((stage_index, mb))
            return True
        return False

    def take_deferred(self, stage_index: int, mb: int) -> bool:
        """True (once) when ``mb``'s W on ``stage_index`` runs GEMMs its I queued."""
        if (stage_index, mb) in self.deferred:
            self.deferred.remove((stage_index, mb))
            return True
        return False
