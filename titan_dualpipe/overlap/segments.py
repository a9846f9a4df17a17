"""Building blocks for an overlapped pair: step generators and segment-wise backward.

A *step* is a generator that computes up to a communication point, yields the in-flight handle
(anything with ``wait()``) and is resumed once it was waited; its return value is the result.
:func:`run_to_completion` waits each handle at once (the plain path); :func:`interleave`
alternates two steps on one thread, so that one's communication flies while the other computes,
in the same order on every rank. The backward is split the same way: a module's forward marks
each segment's inputs with :func:`boundary`, and :func:`segment_backward` runs autograd from a
segment's outputs down to those marks only, returning their gradients for the next segment. Why
the result stays bitwise equal to a plain backward: docs/overlap.md#the-ready-moe-module.
"""

from __future__ import annotations

from typing import Any, Generator, Protocol, Sequence, TypeVar, Union

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from ..exposure.record import recorder
from ..weights.in_flight import fill_before_wait, run_work_in_flight
from .relay import hand_over

T = TypeVar("T")


class Waitable(Protocol):
    def wait(self) -> Any: ...


Step = Generator[Waitable, None, T]
# A segment's output: the tensor, or only its place in the graph (``root_of``) where nothing
# but a segment backward would keep the tensor's memory alive.
Root = Union[torch.Tensor, GradientEdge]


def root_of(output: torch.Tensor) -> Root:
    """``output`` as a segment backward root that holds none of its memory (its gradient edge),
    or ``output`` itself when it is not part of an autograd graph."""
    return get_gradient_edge(output) if output.grad_fn is not None else output


def run_to_completion(step: Step[T]) -> T:
    """Run a step, waiting each communication handle as soon as it is yielded (after
    handing over to the partner half when a pair runs as a relay)."""
    try:
        pending = next(step)
        while True:
            hand_over(ready_at=getattr(pending, "ready_at", None))
            pending.wait()
            pending = step.send(None)
    except StopIteration as done:
        return done.value


def interleave(first: Step[Any], second: Step[Any], backwards: tuple[int, ...] = ()) -> tuple[Any, Any]:
    """Run two steps alternately, switching at every communication point.

    ``first`` runs until it posts its first exchange, then ``second`` runs until it posts
    one, then ``first`` resumes after waiting its handle, and so on; when one finishes,
    the other runs on alone. Returns both results. ``backwards``: the steps (0: ``first``) that
    are segment-wise backwards: each exchange they post runs the work their backward set aside
    for it (:mod:`titan_dualpipe.weights.in_flight`: queued weight GEMMs), as an autograd node's
    exchange does. While a benchmark records, the two steps are reported as the halves of a pair
    (``first``: half 0; :mod:`titan_dualpipe.exposure.record`).
    """
    steps = (first, second)
    pending: list[Waitable | None] = [None, None]
    results: list[Any] = [None, None]
    running = [True, True]
    turn = 0
    record = recorder()  # a benchmark's recorder of the halves' segments (first: half 0)
    if record is not None and not record.open_pair():
        record = None
    try:
        while running[0] or running[1]:
            if not running[turn]:
                turn = 1 - turn
            if record is not None:
                record.run(turn)
            if pending[turn] is not None:
                if turn in backwards:
                    fill_before_wait(getattr(pending[turn], "ready_at", None), segment_backward=True)
                pending[turn].wait()  # type: ignore[union-attr]
                pending[turn] = None
            try:
                pending[turn] = steps[turn].send(None)
                if record is not None:
                    record.switch()
                if turn in backwards:  # as fillers: what fits before the partner's exchange arrives
                    partner = pending[1 - turn] if running[1 - turn] else None
                    run_work_in_flight(until=getattr(partner, "ready_at", None), segment_backward=True)
                if record is not None:
                    record.stop(turn)
            except StopIteration as done:
                results[turn], running[turn] = done.value, False
                if record is not None:
                    record.end(turn)
            turn = 1 - turn
    finally:
        for step in steps:
            step.close()
        if record is not None:
            record.close_pair()
    return results[0], results[1]


def boundary(t: torch.Tensor) -> torch.Tensor:
    """A fresh alias of ``t`` for one consuming segment.

    Its grad_fn is a view node that saves no tensors: the segment backward that
    captures its gradient runs that node (``backward(inputs=...)`` does) without
    running, or freeing, the producer behind it.
    """
    return t.view_as(t) if t.requires_grad else t


class SegmentLeaves:
    """The leaves (parameters, stage inputs) each segment backward of one pass accumulates into.

    A leaf reached from two segments (e.g. tied weights) would be accumulated once per
    segment, in another order than the plain backward: that is refused.
    """

    def __init__(self) -> None:
        self._seen: dict[int, torch.Tensor] = {}

    def claim(self, leaves: list[torch.Tensor]) -> None:
        for leaf in leaves:
            if id(leaf) in self._seen:
                raise ValueError(
                    f"a tensor of shape {tuple(leaf.shape)} gets gradients from two segments of one backward "
                    "(tied or shared parameters?): each parameter must be used by one segment only"
                )
            self._seen[id(leaf)] = leaf


def _reachable_leaves(roots: Sequence[Root], captures: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Leaves requiring grad behind ``roots``, not looking past the ``captures``."""
    edges = [get_gradient_edge(c) for c in captures]
    # Node ids are compared below, so every node object seen stays referenced: a freed
    # wrapper's id can be reused by another node's (torch 2.11 frees them eagerly).
    alive: list[Node] = [edge.node for edge in edges]
    stops = {(id(edge.node), edge.output_nr) for edge in edges}
    tensors = [r for r in roots if isinstance(r, torch.Tensor)]
    leaves: list[torch.Tensor] = [r for r in tensors if r.is_leaf and r.requires_grad]
    stack = [r.grad_fn for r in tensors if r.grad_fn is not None] + [r.node for r in roots if isinstance(r, GradientEdge)]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        alive.append(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if variable is not None:
            leaves.append(variable)
            continue
        for child, output_nr in node.next_functions:
            if child is not None and (id(child), output_nr) not in stops:
                stack.append(child)
    return leaves


def segment_backward(
    roots: Sequence[Root],
    grads: Sequence[torch.Tensor | None],
    captures: Sequence[torch.Tensor],
    leaves_claimed: SegmentLeaves | None = None,
) -> list[torch.Tensor | None]:
    """Backpropagate ``grads`` from ``roots`` (tensors or :func:`root_of` edges) down to ``captures`` (aliases made by
    :func:`boundary`); accumulate the gradients of the leaves in between into their
    ``.grad`` and return the captures' gradients (None where nothing reached one)."""
    kept = [(r, g) for r, g in zip(roots, grads, strict=True) if _backpropagates(r, g)]
    wanted = [c for c in captures if c.requires_grad]
    for c in wanted:
        if c.is_leaf:
            raise ValueError("segment_backward captures must be boundary() aliases, got a leaf tensor")
    leaves = _reachable_leaves([r for r, _ in kept], wanted)
    if leaves_claimed is not None:
        leaves_claimed.claim(leaves)
    if kept and (wanted or leaves):
        torch.autograd.backward([r for r, _ in kept], [g for _, g in kept], inputs=wanted + leaves)
    result: list[torch.Tensor | None] = []
    for c in captures:
        result.append(c.grad if c.requires_grad else None)
        if c.requires_grad:
            c.grad = None
    for r, _ in kept:
        if isinstance(r, torch.Tensor) and r.retains_grad:  # a former capture used as a root: drop autograd's copy
            r.grad = None
    return result


def _backpropagates(root: Root, grad: torch.Tensor | None) -> bool:
    """Whether a root takes part: an edge with a gradient, a tensor in the graph with one (or a scalar)."""
    if isinstance(root, GradientEdge):
        return grad is not None
    return root.requires_grad and (grad is not None or root.numel() == 1)
