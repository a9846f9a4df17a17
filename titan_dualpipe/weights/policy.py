"""The weight-gradient policy a schedule holds: which stages defer, and each step's plan.

:class:`WeightGradients` is built from the schedules' ``weight_gradients``, ``not_deferred``,
``min_weight_gemm_flops`` and ``weight_gemms_in_flight`` options: it installs deferral on the stages
that can take it, keeps them routed to its queue, and for each step reads from the order which
forwards defer and hands the executor a :class:`~.plan.BackwardPlan`.
"""

from __future__ import annotations

import os
from typing import Any, Collection, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from .._compat.pipelining import B, I, OVERLAP_F_B, W, _Action
from ..orders.errors import PipelineConfigError
from ..orders.placement import Placement
from ..switches import MIN_FLOPS_ENV
from .install import compiled_hooks_problem, install, routed_to, uninstall
from .plan import BackwardPlan, Key, whole_backward_reason
from .queue import WeightGradQueue

WEIGHT_GRADIENT_MODES = ("deferred", "deferred_compiled", "split", "whole")
DEFERRING_MODES = ("deferred", "deferred_compiled")  # the modes that install deferred GEMMs


def weight_gradients_problem(mode: object, not_deferred: object, min_flops: object = None) -> None:
    """PipelineConfigError (before any collective) for a ``weight_gradients`` / ``not_deferred`` /
    ``min_weight_gemm_flops`` option that cannot work."""
    if mode not in WEIGHT_GRADIENT_MODES:
        raise PipelineConfigError(f"weight_gradients={mode!r}: use one of {', '.join(map(repr, WEIGHT_GRADIENT_MODES))}")
    if isinstance(not_deferred, str) or not all(isinstance(name, str) for name in not_deferred):  # type: ignore[union-attr]
        raise PipelineConfigError(f"not_deferred={not_deferred!r}: pass a list of module names or fnmatch patterns, "
                                  f"e.g. ['output', 'layers.*.attention.wq']")
    if min_flops is not None and (isinstance(min_flops, bool) or not isinstance(min_flops, int) or min_flops < 0):
        raise PipelineConfigError(f"min_weight_gemm_flops={min_flops!r}: pass a count of FLOPs >= 0 (0 defers every "
                                  f"weight GEMM) or None (the device's default, {MIN_FLOPS_ENV} where set)")


def min_flops_option(min_flops: int | None) -> int | None:
    """The least FLOPs of a deferred weight GEMM: ``min_flops``, else ``TITAN_DUALPIPE_MIN_WEIGHT_GEMM_FLOPS``
    where set, else None (by device type, :data:`~.queue.DEFAULT_MIN_FLOPS`)."""
    if min_flops is not None:
        return min_flops
    value = os.environ.get(MIN_FLOPS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise PipelineConfigError(f"{MIN_FLOPS_ENV}={value!r}: set a count of FLOPs >= 0 (0 defers every weight GEMM), "
                                  "or unset it for the device's default")
    return int(value)


class WeightGradients:
    """How one schedule's stages leave their weight gradients.

    - ``deferred_weights``: by deferring stage, the modules whose weight GEMMs wait for ``W``;
    - ``in_flight_stages``: deferring stages that post expert-parallel exchanges (``exchanges``),
      whose full backwards compute their GEMMs while those fly (``in_flight``: True, or ``"fill"``
      as fillers, :mod:`.in_flight`);
    - ``whole_stages``: stages a static rule keeps whole at ``I`` (compiled blocks) and that do
      not defer.
    """

    def __init__(self, mode: str, not_deferred: Sequence[str], in_flight: bool | str,
                 modules: dict[int, torch.nn.Module], exchanges: Collection[int], min_flops: int | None = None) -> None:
        self.mode = mode
        self.fills = in_flight == "fill"
        self.not_deferred = list(not_deferred)
        self.compiled = mode == "deferred_compiled"
        self.queue = WeightGradQueue(min_flops)  # None: the device's default
        kept_whole = frozenset(s for s, module in modules.items() if whole_backward_reason(module))
        self.deferred_weights: dict[int, list[str]] = {}
        for s, module in modules.items():
            deferring = (mode in DEFERRING_MODES and not isinstance(module, DistributedDataParallel)  # DDP reduces in autograd's hooks
                         and (self.compiled or s not in kept_whole))
            if deferring:
                self.deferred_weights[s] = install(module, self.queue, self.not_deferred, self.compiled)
            else:
                uninstall(module)
        self.deferred_stages = frozenset(self.deferred_weights)
        self.in_flight_stages = frozenset(s for s in self.deferred_stages if in_flight and s in exchanges)
        self.whole_stages = kept_whole - self.deferred_stages

    def route(self, modules: dict[int, torch.nn.Module]) -> None:
        """Point the deferring stages' modules at this queue, and give the others their own classes
        back. Another schedule built over the same modules (an eval schedule, a benchmark's
        baseline) installs them for itself: left so, this schedule's GEMMs would run inline at
        ``I``, and torch's ``W`` would meet our nodes."""
        for s, module in modules.items():
            names = self.deferred_weights.get(s)
            if names is None:
                uninstall(module)
            elif not routed_to(module, names, self.queue):
                install(module, self.queue, self.not_deferred, self.compiled)

    def modules_problem(self, modules: dict[int, torch.nn.Module]) -> str:
        """What the stage modules have become since construction that deferral cannot run (hooks
        registered on compiled blocks' deferred weights), or ``''``."""
        if not self.compiled:
            return ""
        return next((problem for s, module in modules.items() if s in self.deferred_stages
                     if (problem := compiled_hooks_problem(module, self.not_deferred))), "")

    def plan_step(self, actions: list[_Action], place: Placement, custom: Collection[Any],
                  two_batch: set[Key], training: bool) -> BackwardPlan:
        """A fresh plan for one step of this rank's ``actions``."""
        self.queue.clear()  # nothing a failed step queued
        deferring = self.deferring_microbatches(actions, place, custom, two_batch) if training else set()
        return BackwardPlan(self.mode, self.whole_stages, self.deferred_stages, deferring, self.queue, self.fills)

    def deferring_microbatches(self, actions: list[_Action], place: Placement, custom: Collection[Any],
                               two_batch: set[Key]) -> set[Key]:
        """The (stage, mb) of deferring stages whose forward builds deferrable weight GEMMs: those whose
        backward leaves them to a W (an ``I``, but on a chain's first stage, whose W runs the whole
        backward), or computes them while its exchanges fly (any backward of an in-flight stage: a
        ``B``, and a chain's first stage's backward as two sub-batches, so that each weight's gradient
        reaches autograd once, whole). The others' forwards are plain autograd, and so is any whose
        backward or W a custom function (``custom``: the action types that have one) runs."""
        keys = set()
        for action in actions:
            pair = action.computation_type == OVERLAP_F_B
            if pair and OVERLAP_F_B in custom:
                continue
            for a in action.sub_actions if pair else (action,):
                key, kind = (a.stage_index, a.microbatch_index), a.computation_type
                if kind not in (B, I) or kind in custom or (kind == I and W in custom):
                    continue
                if key[0] not in self.deferred_stages:
                    continue
                flying = key[0] in self.in_flight_stages
                if kind == I and not place.is_first(key[0]):
                    keys.add(key)
                elif flying and (kind == B or key in two_batch):
                    keys.add(key)
        return keys

    def end_step(self) -> None:
        """Autocast's weight casts live for one step, as under autocast."""
        self.queue.forget_casts()

