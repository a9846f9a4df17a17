"""Activation memory: measured on a real run, and predicted from a schedule's order.

:class:`ActivationMeter` counts the bytes autograd keeps for backward (saved tensors, each
storage once, parameters excluded) and what deferred weight GEMMs hold from I to W
(:meth:`ActivationMeter.hold`). :func:`peak_activation_bytes` predicts the peak from an order by
the simulator's live-activation rule, weighted by each stage's measured bytes per microbatch;
:func:`activation_counts` sets the rule's count next to torch's own liveness analysis of the same
order. Both feed ``titan-dualpipe profile``: docs/simulate.md#profile.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import Any, Iterable

import torch

from .._compat.pipelining import B, F, I, W, _Action, torch_activation_slots
from ..orders import Placement, compute_order, placement
from ..orders.lowering import leaf_actions


class _Saved:
    """A saved tensor under the meter; the graph dropping it releases its storage's count."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: "ActivationMeter") -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Live and peak bytes of tensors saved for backward while active (``with meter:``; the
    forwards must run on the entering thread, backwards may run on any)."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self._held: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self._lock = threading.Lock()
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._excluded or storage.nbytes() == 0:
            return tensor
        with self._lock:
            held = self._held.setdefault(key, [0, storage.nbytes()])
            held[0] += 1
            if held[0] == 1:
                self.live += held[1]
                self.peak = max(self.peak, self.live)
        # detached: holding a saved output (whose grad_fn holds this object) would be a cycle
        # through autograd's C++ graph that no garbage collector breaks
        return _Saved(tensor.detach(), key, self)

    def hold(self, tensors: Iterable[torch.Tensor]) -> list[_Saved]:
        """Count ``tensors`` as live (each storage once, with the saved ones) until the returned
        handles are dropped: a deferred weight GEMM's operands, held from its I to its W
        (``WeightGradQueue.on_hold``)."""
        return [handle for handle in map(self._pack, tensors) if isinstance(handle, _Saved)]

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int) -> None:
        with self._lock:
            held = self._held[key]
            held[0] -= 1
            if held[0] == 0:
                self.live -= held[1]
                del self._held[key]

    def __enter__(self) -> "ActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def peak_activation_bytes(actions: list[_Action | None], bytes_per_stage: dict[int, float],
                          freed_at_input: Collection[tuple[int, int]] = (),
                          held_per_stage: dict[int, float] | None = None) -> float:
    """Most activation bytes alive at once on a rank running ``actions`` in order (comm
    actions ignored), each stage-microbatch weighing ``bytes_per_stage[stage]``. The
    ``(stage, microbatch)`` in ``freed_at_input`` run their backward whole at ``I``: freed there.

    ``held_per_stage``: on the stages it names, an ``I`` that defers its weight GEMMs frees the
    saved bytes and holds these (the GEMMs' operands) until its ``W``."""
    held = held_per_stage or {}
    live = peak = 0.0
    for action in actions:
        if action is None:
            continue
        for leaf in sorted(leaf_actions(action), key=lambda a: a.computation_type != F):
            stage, kind = leaf.stage_index, leaf.computation_type
            deferring = stage in held and (stage, leaf.microbatch_index) not in freed_at_input
            if kind == F:
                live += bytes_per_stage[stage]
                peak = max(peak, live)
            elif deferring and kind == I:  # autograd frees the saved tensors as the operands queue
                live += held[stage] - bytes_per_stage[stage]
                peak = max(peak, live)
            elif deferring and kind == W:
                live -= held[stage]
            elif _frees(leaf, freed_at_input):
                live -= bytes_per_stage[stage]
    return peak


def _frees(leaf: _Action, freed_at_input: Collection[tuple[int, int]]) -> bool:
    kind = leaf.computation_type
    at_input = (leaf.stage_index, leaf.microbatch_index) in freed_at_input
    return kind == B or (kind == I if at_input else kind == W)


def activation_counts(schedule: str, pp: int, n: int) -> dict[int, tuple[int, int | None]]:
    """Per rank of ``schedule``'s order at ``pp`` ranks and ``n`` microbatches: (the most
    stage-microbatch activations live at once by :func:`peak_activation_bytes`, torch's
    ``num_slots`` for the same order, or None before torch 2.15)."""
    return order_activation_counts(compute_order(schedule, pp, n), placement(schedule, pp, n))


def order_activation_counts(order: dict[int, list[_Action | None]],
                            place: Placement) -> dict[int, tuple[int, int | None]]:
    """:func:`activation_counts` of a given ``order`` of ``place``'s stages.

    torch's analysis expects each stage to run microbatches ``0 .. m-1``; DualPipe's stages run
    ``n/2`` microbatches each (direction 1 the ids ``n/2 .. n-1``), so each stage's ids are
    shifted to start at 0 and torch is given ``m = n/2``; DualPipeV passes unchanged."""
    counts = {}
    for rank, actions in sorted(order.items()):
        stages = place.stages_of(rank)
        ours = int(peak_activation_bytes(actions, dict.fromkeys(stages, 1.0)))
        first = {stage: place.microbatches(stage).start for stage in stages}
        renumbered = [None if a is None else _renumbered(a, first) for a in actions]
        counts[rank] = (ours, torch_activation_slots(renumbered, place.microbatches_per_stage(), rank, stages))
    return counts


def _renumbered(action: _Action, first: dict[int, int]) -> _Action:
    """``action`` (an overlapped pair's parts too) with each stage's microbatch ids counted
    from ``first[stage]``."""
    if action.sub_actions is not None:
        return action._replace(sub_actions=tuple(_renumbered(a, first) for a in action.sub_actions))
    if action.microbatch_index is None:
        return action
    return action._replace(microbatch_index=action.microbatch_index - first[action.stage_index])
