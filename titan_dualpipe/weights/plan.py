"""How each backward of a step leaves its weight gradient: the per-step plan the executor asks.

A backward (``B``, ``I``) or ``W`` of one (stage, microbatch) runs one way:

- ``DEFERRED``: ``I`` runs the full backward, its weight GEMMs queued; ``W`` runs them (``QUEUED``);
- ``COLLECTED``: a full backward (a ``B``, or a chain's first stage's backward at its ``W``) whose
  weight GEMMs queue, are computed while its exchanges fly (:mod:`.in_flight`) and go to
  autograd at its end;
- ``WHOLE``: the full backward at ``I`` (``W`` then ``DONE``) or at a ``B``;
- ``SPLIT``: torch's split of the graph, ``I`` with ``retain_graph`` then ``W``.

Which stages and microbatches run whole: docs/activation_checkpointing.md#how-it-works.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
from torch._dynamo.eval_frame import OptimizedModule

from .._compat.autograd import checkpoint_regions_seen
from .in_flight import work_while_exchanges_fly
from .queue import WeightGradQueue

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


Key = tuple[int, int]  # (stage index, microbatch)
DEFERRED, COLLECTED, WHOLE, SPLIT = "deferred", "collected", "whole", "split"  # how a backward runs
AT_WEIGHT = "at_weight"  # a chain's first stage's I: it has no input gradient, its W runs the backward
QUEUED, DONE = "queued", "done"  # a W that runs its I's queued GEMMs; one whose I ran everything


class BackwardPlan:
    """One step's answers to "how does this backward run", and what each answer leaves for ``W``.

    ``deferring``: the (stage, microbatch) whose forward builds deferrable weight GEMMs
    (:meth:`~.policy.WeightGradients.deferring_microbatches`). ``queue``: the schedule's. ``fills``:
    a collected backward's GEMMs run in flight as fillers (:mod:`.in_flight`)."""

    def __init__(self, mode: str, static_whole: frozenset[int], deferred_stages: frozenset[int],
                 deferring: set[Key], queue: WeightGradQueue, fills: bool = False) -> None:
        self.mode = mode
        self.fills = fills
        self.static_whole = static_whole
        self.deferred_stages = deferred_stages
        self.deferring = deferring
        self.queue = queue
        self.deferred_forwards: set[Key] = set()  # forwards that built deferrable GEMMs, until their backward
        self.whole: set[Key] = set()  # microbatches whose I runs the full backward
        self._left_for_weight: dict[Key, str] = {}  # what each W does, set by its I

    @contextlib.contextmanager
    def forward(self, stage_index: int, mb: int) -> Iterator[None]:
        """Run a forward: deferring its weight GEMMs when planned, noting the regions it ran."""
        key = (stage_index, mb)
        defers = key in self.deferring
        with checkpoint_regions_seen() as kinds, self.queue.deferring(defers):
            yield
        if stage_index in self.static_whole or self.mode == "whole":
            self.whole.add(key)
        elif stage_index not in self.deferred_stages and kinds & WHOLE_BACKWARD_REGIONS:
            self.whole.add(key)
        if defers:
            self.deferred_forwards.add(key)

    def keep_whole(self, stage_index: int, mb: int) -> None:
        """A microbatch that ran as two-batch sub-batches: torch's split cannot take its backward apart
        (deferred GEMMs can: both sub-batches queue theirs)."""
        if stage_index not in self.deferred_stages:
            self.whole.add((stage_index, mb))

    def at_backward(self, is_input: bool, stage_index: int, mb: int, first_stage: bool) -> str:
        """How a ``B`` (``is_input`` False) or an ``I`` of ``mb`` on ``stage_index`` runs."""
        key = (stage_index, mb)
        if not is_input:
            return COLLECTED if self._took_deferred_forward(key) else WHOLE
        if first_stage:
            self._left_for_weight[key] = AT_WEIGHT
            return AT_WEIGHT
        if key in self.whole:
            how = WHOLE
        elif stage_index not in self.deferred_stages:
            how = SPLIT
        else:  # a forward that ran elsewhere (torch's shape inference, a custom function) did not defer
            how = DEFERRED if self._took_deferred_forward(key) else WHOLE
        self._left_for_weight[key] = {DEFERRED: QUEUED, WHOLE: DONE, SPLIT: SPLIT}[how]
        return how

    def at_weight(self, stage_index: int, mb: int) -> str:
        """How the ``W`` of ``mb`` on ``stage_index`` runs: ``DONE`` (its I ran everything),
        ``QUEUED``, ``COLLECTED`` or ``WHOLE`` (a chain's first stage), else ``SPLIT``."""
        key = (stage_index, mb)
        how = self._left_for_weight.pop(key, SPLIT)
        if how == AT_WEIGHT:
            return COLLECTED if self._took_deferred_forward(key) else WHOLE
        return how

    def _took_deferred_forward(self, key: Key) -> bool:
        if key in self.deferred_forwards:
            self.deferred_forwards.remove(key)
            return True
        return False

    def queued_at_input(self, key: Key, backward: Callable[[], None]) -> None:
        """Run ``backward`` (an ``I``'s full backward) with its weight GEMMs queued for its ``W``."""
        with self.queue.collecting(key):
            backward()

    def run_queued(self, key: Key) -> None:
        """At ``W``: compute what its ``I`` queued and give it to autograd."""
        self.queue.run(key)

    def collected(self, key: Key, backward: Callable[[], None]) -> None:
        """Run a full backward whose weight GEMMs queue, are computed while its exchanges fly, and go to
        autograd together at its end in the order queued: the gradients do not depend on which ran in
        flight, and each weight's accumulation (its hooks) runs once, as under one plain backward,
        also when the microbatch backpropagates as two sub-batches."""
        work = functools.partial(self.queue.compute_in_flight, key)
        with self.queue.collecting(key), work_while_exchanges_fly(work, fill=self.fills):
            backward()
        self.queue.run(key, at_weight=False)
