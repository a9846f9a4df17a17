"""The queue of weight GEMMs an ``I`` leaves for ``W`` (:class:`WeightGradQueue`), and how a weight
gradient reaches autograd (:func:`root_of`, :func:`accumulate`).

What both deferrable GEMMs build on: ``nn.Linear``'s (:mod:`.linear`) and the experts'
(:mod:`.experts`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import weakref
from collections import Counter
from typing import Any, Callable, Iterator, Union

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .._compat.autograd import inside_backward

Key = tuple[int, int]  # (stage index, microbatch)
ACCUMULATE_BYTES = 64 << 20  # most weight-gradient bytes a W hands to autograd in one call
Root = Union[torch.Tensor, GradientEdge]  # where a weight gradient enters autograd: a parameter, or an operand's edge
# The least FLOPs of a weight GEMM worth deferring, by device type, where a schedule names none
# (``min_weight_gemm_flops``): deferral's two Python autograd nodes cost about 50 us a call on a
# CPU, what a GEMM of some 5-8 MFLOP takes there (docs/weight_gradients.md#small-gemms). A GPU
# runs its GEMMs behind the host's Python, so every one defers there.
DEFAULT_MIN_FLOPS = {"cpu": 8_000_000}


def root_of(operand: torch.Tensor) -> Root:
    """Where ``operand``'s gradient enters autograd: the parameter itself, or the edge into the small
    graph that computed it (a slice, a cast, ``to_local``), which holds none of its tensors."""
    return operand if operand.is_leaf else get_gradient_edge(operand)


@dataclasses.dataclass
class _Deferred:
    """One queued weight GEMM: its root, the GEMM (None once computed), its result."""

    root: Root
    gemm: Callable[[], torch.Tensor] | None
    kind: str
    handle: Any  # a memory meter's hold on the GEMM's operands, dropped with them
    size: tuple = ()  # its kind and operand shapes: GEMMs of one size cost alike
    grad: torch.Tensor | None = None

    def compute(self) -> None:
        if self.gemm is not None:
            self.grad, self.gemm, self.handle = self.gemm(), None, None


class WeightGradQueue:
    """One schedule's queued weight GEMMs, by (stage, microbatch).

    :meth:`deferring` marks the forwards running now as deferrable; :meth:`collecting` marks the
    backward running now as an ``I`` whose weight GEMMs wait for :meth:`run`. Both are
    attributes, not thread-local state: autograd runs a CUDA backward on its own device thread,
    and a relay runs two halves on two threads; a relay parks them with each half (:meth:`parked`).
    A forward and a recomputation inside a backward tell themselves apart by whether a backward
    runs on their thread (:meth:`routes_now`).
    """

    def __init__(self, min_flops: int | None = 0) -> None:
        self.min_flops = min_flops  # None: by device type (DEFAULT_MIN_FLOPS)
        self.target: Key | None = None
        self.defers_forwards = False
        self._pending: dict[Key, list[_Deferred]] = {}
        self._casts: dict[tuple[int, torch.dtype], tuple[Any, int, torch.Tensor]] = {}  # autocast's weight casts
        self._anchors: dict[torch.device, torch.Tensor] = {}
        # a memory meter's ``hold``: counts a queued GEMM's operands as live until its W drops the handle
        self.on_hold: Callable[[tuple[torch.Tensor, ...]], Any] | None = None
        self.ran: Counter[int] = Counter()  # weight GEMMs run at W this step, by stage
        self.ran_kinds: Counter[str] = Counter()  # ... by kind ("linear", "experts")
        self.ran_microbatches: Counter[Key] = Counter()  # ... by (stage, microbatch)
        self.ran_in_flight = 0  # full backwards' weight GEMMs computed while their exchanges flew, this step
        self._seconds: dict[tuple, float] = {}  # the last time a GEMM of each size took to compute in flight
        self._worth: dict[int, bool] = {}  # by parameter id: whether its GEMMs defer this step
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> "WeightGradQueue":
        return self  # a copied stage module defers into its schedule's queue until installed again

    def __getstate__(self) -> dict:
        return {"min_flops": self.min_flops, "target": None, "defers_forwards": False, "_pending": {}, "_casts": {},
                "_anchors": {}, "ran": Counter(), "ran_kinds": Counter(), "ran_microbatches": Counter(),
                "ran_in_flight": 0, "_seconds": {}, "_worth": {}, "on_hold": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def deferring(self, defer: bool = True) -> Iterator[None]:
        """Forwards in the block build deferrable weight GEMMs (``defer=False``: plain autograd)."""
        previous, self.defers_forwards = self.defers_forwards, defer
        try:
            yield
        finally:
            self.defers_forwards = previous

    @contextlib.contextmanager
    def collecting(self, key: Key) -> Iterator[None]:
        """The backward in the block is ``key``'s ``I``: its deferrable weight GEMMs wait for :meth:`run`."""
        self.target = key
        try:
            yield
        finally:
            self.target = None

    def parked(self) -> tuple[bool, Key | None]:
        """What :meth:`deferring` and :meth:`collecting` set, as the running half of a relayed pair
        sees it: parked while its partner runs (two forwards, or two backwards, of one relay each
        enter and leave their own)."""
        return self.defers_forwards, self.target

    def resume(self, state: tuple[bool, Key | None]) -> None:
        """Set what a half's :meth:`parked` state says."""
        self.defers_forwards, self.target = state

    def routes_now(self) -> bool:
        """Whether a GEMM called now builds a deferrable weight gradient: a forward inside
        :meth:`deferring`, or a checkpointed region's recomputation inside a backward that collects
        (the backward of a forward that deferred: the recomputation takes the forward's path)."""
        return self.target is not None if inside_backward() else self.defers_forwards

    def least_flops(self, device: torch.device) -> int:
        """The least FLOPs of a weight GEMM on ``device`` that defers."""
        return DEFAULT_MIN_FLOPS.get(device.type, 0) if self.min_flops is None else self.min_flops

    def worth_deferring(self, root: Root, flops: int, device: torch.device) -> bool:
        """Whether the weight GEMMs into ``root``'s parameter defer this step: whether its first, of
        ``flops`` on ``device``, was large enough. A smaller one is computed by autograd in its
        backward (its nodes would cost more than moving it can save); one answer per step and
        parameter keeps its accumulation whole (sub-batches and experts see other token counts)."""
        least = self.least_flops(device)
        if least <= 0:
            return True
        parameter = id(_parameter_of(root))
        decided = self._worth.get(parameter)
        return self._worth.setdefault(parameter, flops >= least) if decided is None else decided

    def left_to_autograd(self) -> int:
        """How many parameters' weight GEMMs this step left to autograd as too small."""
        return sum(not worth for worth in self._worth.values())

    def defer(self, root: Root, gemm: Callable[[], torch.Tensor], kind: str = "linear",
              holds: tuple[torch.Tensor, ...] = ()) -> bool:
        """Queue ``gemm`` (the gradient of ``root``) for the backward running now; False when it is not
        an ``I`` (accumulate it now). ``holds``: the tensors ``gemm`` keeps alive until it runs."""
        key = self.target
        if key is None:
            return False
        handle = self.on_hold(holds) if self.on_hold is not None else None
        size = (kind, *(tuple(t.shape) for t in holds))
        with self._lock:
            self._pending.setdefault(key, []).append(_Deferred(root, gemm, kind, handle, size))
        return True

    def compute_in_flight(self, key: Key, until: float | None = None) -> int:
        """Compute ``key``'s queued GEMMs now (a full backward's, while its exchanges fly); :meth:`run`
        gives them to autograd with the rest, in the order they were queued. ``until`` (a
        ``time.perf_counter()`` time): as fillers, in queue order, stopping at the first that the last
        GEMM of its size says would end after it. How many ran."""
        with self._lock:
            waiting = [d for d in self._pending.get(key, []) if d.gemm is not None]
        ran = 0
        for deferred in waiting:
            start = time.perf_counter()
            if until is not None and start + self._seconds.get(deferred.size, 0.0) > until:
                break
            deferred.compute()
            self._seconds[deferred.size] = time.perf_counter() - start
            ran += 1
        self.ran_in_flight += ran
        return ran

    def run(self, key: Key, at_weight: bool = True) -> int:
        """Compute ``key``'s queued GEMMs and accumulate them (its ``W``; ``at_weight=False``: the end of
        a full backward that computed some in flight); how many there were."""
        with self._lock:
            deferred = self._pending.pop(key, [])
        if at_weight:
            self.ran_kinds.update(d.kind for d in deferred)
            self.ran[key[0]] += len(deferred)
            self.ran_microbatches[key] += len(deferred)
        # whole parameters per autograd call, each accumulated once (its hooks run once, on its whole
        # gradient), up to ACCUMULATE_BYTES of results alive at a time (a stage's weights' worth
        # could be large): a call per parameter costs more than the GEMMs of a small one
        batch: list[_Deferred] = []
        held = 0
        for group in _by_parameter(deferred):
            for d in group:
                d.compute()
                held += d.grad.numel() * d.grad.element_size() if d.grad is not None else 0
            batch += group
            if held >= ACCUMULATE_BYTES:
                accumulate([(d.root, d.grad) for d in batch])
                batch, held = [], 0  # their results go with the entries
        if batch:
            accumulate([(d.root, d.grad) for d in batch])
        return len(deferred)

    def pending(self) -> dict[Key, int]:
        return {key: len(gemms) for key, gemms in self._pending.items()}

    def compute_weight(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight`` for a deferrable GEMM, out of the graph: as is, or cast to autocast's ``dtype``
        once per step (autocast caches its weight casts the same way)."""
        if weight.dtype == dtype:
            return weight.detach()
        if not torch.is_autocast_cache_enabled():
            return weight.detach().to(dtype)
        key = (id(weight), dtype)
        hit = self._casts.get(key)
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return hit[2]
        cast = weight.detach().to(dtype)
        self._casts[key] = (weakref.ref(weight), weight._version, cast)
        return cast

    def anchor(self, device: torch.device) -> torch.Tensor:
        """A tensor that needs a gradient, for deferrable nodes whose other inputs need none (a first
        layer on data): it keeps them in the graph. Its gradient is always None."""
        anchor = self._anchors.get(device)
        if anchor is None:
            anchor = self._anchors[device] = torch.zeros((), device=device, requires_grad=True)
        return anchor

    def forget_casts(self) -> None:
        self._casts.clear()

    def clear(self) -> None:
        """Forget what an earlier step queued or ran."""
        with self._lock:
            self._pending.clear()
        self._casts.clear()
        self._worth.clear()
        self.ran.clear()
        self.ran_kinds.clear()
        self.ran_microbatches.clear()
        self.ran_in_flight = 0
        self.target = None
        self.defers_forwards = False


def _by_parameter(deferred: list[_Deferred]) -> list[list[_Deferred]]:
    """``deferred`` grouped by the parameter its gradient reaches (an operand's edge: through the
    operand's graph), groups in the order of their first entry, entries in queue order."""
    groups: dict[int, list[_Deferred]] = {}
    for d in deferred:
        groups.setdefault(id(_parameter_of(d.root)), []).append(d)
    return list(groups.values())


def _parameter_of(root: Root) -> Any:
    """The leaf a root's gradient accumulates into: the parameter, or the end of an operand's chain of
    single-input nodes (slice, cast, transpose, ``to_local``); the edge's node where it branches."""
    if not isinstance(root, GradientEdge):
        return root
    node = root.node
    while True:
        if hasattr(node, "variable"):  # AccumulateGrad
            return node.variable
        edges = [fn for fn, _ in node.next_functions if fn is not None]
        if len(edges) != 1:
            return node
        node = edges[0]


def accumulate(gradients: list[tuple[Root, torch.Tensor]]) -> None:
    """Give weight gradients to autograd, one call: each parameter's accumulation runs once, with its
    hooks, whatever path led there. Gradients of one root are summed first, in the order given (in
    their own dtype, as autocast's cast node sums them), so the result does not depend on when each
    was computed."""
    summed: dict[Any, list] = {}
    for root, grad in gradients:
        key = (id(root.node), root.output_nr) if isinstance(root, GradientEdge) else id(root)
        if key in summed:
            summed[key][1] = summed[key][1] + grad
        else:
            summed[key] = [root, grad]
    if not summed:
        return
    roots = [root for root, _ in summed.values()]
    grads = [_in_layout_of(root, grad) for root, grad in summed.values()]
    torch.autograd.backward(roots, grads)


def _in_layout_of(root: Root, grad: torch.Tensor) -> torch.Tensor:
    """A DTensor parameter's gradient with the parameter's placements (what its optimizer expects)."""
    from torch.distributed.tensor import DTensor

    if isinstance(root, DTensor) and isinstance(grad, DTensor) and grad.placements != root.placements:
        return grad.redistribute(root.device_mesh, root.placements)
    return grad


def defer_or_accumulate(queue: WeightGradQueue, root: Root, gemm: Callable[[], torch.Tensor], kind: str,
                        holds: tuple[torch.Tensor, ...]) -> None:
    """Queue ``gemm`` for ``W`` inside an ``I``; anywhere else compute it and accumulate it now."""
    if not queue.defer(root, gemm, kind, holds):
        accumulate([(root, gemm())])


def autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a GEMM on ``tensor`` in (its device's autocast is on and it is a
    floating-point tensor other than float64), or None."""
    device_type = tensor.device.type
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    if not tensor.is_floating_point() or tensor.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(device_type)
