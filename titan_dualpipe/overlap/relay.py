"""Overlap for stage modules without the protocol: the pair's halves as a two-thread relay.

A pair's forward action runs on the calling thread, its backward action on a long-lived helper
thread, never both at once. A half that has just posted an exchange calls :func:`hand_over`
before waiting on it, and the other half computes until it hands over in turn (or ends), so the
exchange flies behind the partner's compute. One half runs first (the forward unless told
otherwise: :mod:`.pair_first`) and the other starts at its first hand-over; a plan may keep a half
computing at some of its hand-overs. The forward's pipeline send is posted as it ends. Only
hand-overs switch halves, so given the first half and the plan the interleaving is the same on
every rank, and each half computes exactly what it computes alone.
The helper thread runs in the caller's thread-local state, each half draws random numbers from a
stream of its own, and a recording benchmark is told when each half runs, stops and ends. Who
hands over, thread state, random numbers, failures: docs/overlap.md#the-relay; what is recorded:
docs/overlap.md#the-floor.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import queue
import threading
from types import ModuleType
from typing import Any, Callable, ContextManager, Iterator, Protocol, Sequence

import torch

from .._compat.autograd import (
    PrivateThreadState,
    private_thread_state,
    private_thread_state_entered,
    torch_function_bypassed,
)
from ..exposure.floor import HandOverPlan
from ..exposure.record import ExposureRecorder, recorder
from ..weights import in_flight
from ..weights.in_flight import run_work_in_flight

_RngStates = list[tuple[torch.Generator, torch.Tensor]]


class HalfLocal(Protocol):
    """Process-wide state that each half of a relayed pair keeps as its own: parked when the half
    stops, resumed when it runs again (a half that has not run starts from the state at the pair's
    start). The weight queue's forward/backward marks are (:meth:`WeightGradQueue.parked`)."""

    def parked(self) -> Any: ...

    def resume(self, state: Any) -> None: ...


FORWARD, BACKWARD = 0, 1
_HALF_NAMES = ("forward", "backward")


class PartnerFailed(RuntimeError):
    """Raised in one half of a pair at a hand-over after the other half raised."""


class Relay:
    """The baton of one pair: which half may compute, passed at each hand-over."""

    def __init__(self, start_backward: Callable[[], None], first: int = FORWARD,
                 kind: tuple[int, ...] | None = None, plan: HandOverPlan | None = None,
                 half_locals: Sequence[HalfLocal] = ()) -> None:
        self._cond = threading.Condition()
        self._forward_thread = threading.get_ident()
        self._start_backward = start_backward
        self.backward_started = False
        self.first = first  # the half that runs first
        self.kind = kind  # what the runtime filed the pair under (a relayed pair's stages)
        self._turn = first
        self._ended = [False, False]
        self._errors: list[BaseException] = []  # in the order they were raised
        self.hand_overs = 0  # switches to a running partner, for tests and tracing
        self.offers = [0, 0]  # each half's hand-over calls, switching or not
        self.plan = plan  # per half, at each of its hand-overs in turn: switch? (None, or past its end: yes)
        self._accelerator = _accelerator_module()
        self._rng: list[_RngStates | None] = [None, None]  # each half's parked generator states
        self._rng_at_start = _rng_states(self._accelerator)  # the backward half's stream is seeded from these
        # the slot of work in flight (every pair) and what the caller names: each half's own
        self._locals: tuple[HalfLocal, ...] = (in_flight, *half_locals)
        self._locals_at_start = [h.parked() for h in self._locals]
        self._parked: list[list | None] = [None, None]
        self.record: ExposureRecorder | None = None  # a benchmark's recorder of this pair's segments
        # when the exchange each half handed over at arrives (time.perf_counter(); None: unknown)
        self.awaited: list[float | None] = [None, None]

    def _half(self) -> int:
        return FORWARD if threading.get_ident() == self._forward_thread else BACKWARD

    def partner_arrival(self) -> float | None:
        """When the exchange the partner half waits on arrives (None: unknown, or no partner waits)."""
        other = 1 - self._half()
        return None if self._ended[other] or not self.backward_started else self.awaited[other]

    def hand_over(self, ready_at: float | None = None) -> None:
        me = self._half()
        other = 1 - me
        offer = self.offers[me]
        self.offers[me] += 1
        if self.plan is not None and offer < len(self.plan[me]) and not self.plan[me][offer]:
            return  # the plan keeps this half computing: it waits for its own exchange
        self.awaited[me] = ready_at
        with self._cond:
            self._raise_if_partner_failed(me)
            if self._ended[other]:
                return
            if not self.backward_started:  # the forward's first hand-over starts the backward half
                self.backward_started = True
                self._start_backward()
            self._switch_halves(me, other)
            if self.record is not None:
                self.record.stop(me)
            self._turn = other
            self.hand_overs += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == me)
            self.awaited[me] = None
            if self.record is not None:
                self.record.run(me)
            self._raise_if_partner_failed(me)

    def _raise_if_partner_failed(self, me: int) -> None:
        if self._errors:  # only a half that ended records an error: the partner
            raise PartnerFailed(f"the {_HALF_NAMES[1 - me]} half of this pair raised; the {_HALF_NAMES[me]} half stops")

    def _switch_halves(self, me: int, other: int) -> None:
        """Park this half's generator states and half-local state, and resume the partner's (a
        half that has not run yet starts its stream)."""
        self._park(me)
        self._resume_half(other)

    def _park(self, half: int) -> None:
        self._rng[half] = _rng_states(self._accelerator)
        self._parked[half] = [h.parked() for h in self._locals]

    def _resume_half(self, half: int) -> None:
        """Set ``half``'s generator states: where it stopped, or where its stream starts (the
        forward's: the caller's at the pair's start; the backward's: a stream of its own, seeded
        from those), whichever half runs first; and its half-local state (where it stopped, or the
        pair's start)."""
        parked = self._rng[half]
        if parked is None and half == FORWARD:
            parked = self._rng_at_start
        elif parked is None:
            parked = _forked(_rng_states(self._accelerator), self._rng_at_start)
        _set_rng_states(parked)
        self._resume_locals(self._parked[half] or self._locals_at_start)

    def _resume_locals(self, states: list) -> None:
        for half_local, state in zip(self._locals, states, strict=True):
            half_local.resume(state)

    def _leave_half(self, half: int) -> None:
        """Leave the generators (and half-local state) to the half that goes on, or where the
        forward ended."""
        self._park(half)
        other = 1 - half
        if not self._ended[other]:
            self._resume_half(other)
        elif half == BACKWARD:
            _set_rng_states(self._rng[FORWARD])
            self._resume_locals(self._parked[FORWARD])

    def start_backward_first(self) -> None:
        """On the forward's thread: start the backward half on its stream and wait until it hands
        over (or ends); raises :class:`PartnerFailed` where it raised."""
        self.backward_started = True
        self._resume_half(BACKWARD)
        self._start_backward()
        self.wait_turn(FORWARD)

    def wait_turn(self, half: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == half)
            if self.record is not None:
                self.record.run(half)
            self._raise_if_partner_failed(half)

    def end(self, half: int, error: BaseException | None) -> None:
        with self._cond:
            if self.record is not None:
                self.record.end(half)
            if self.backward_started:  # else one stream, as sequential: nothing to switch
                self._leave_half(half)
            self._ended[half] = True
            if error is not None and not isinstance(error, PartnerFailed):
                self._errors.append(error)
            self._turn = 1 - half
            self._cond.notify_all()

    def first_error(self) -> BaseException | None:
        return self._errors[0] if self._errors else None

    def close(self) -> None:
        """Drop the backward half's starter once the pair is over: it refers back to this relay,
        a reference cycle that would keep the pair's step (its microbatches, its losses) alive
        until the cycle collector runs."""
        self._start_backward = _pair_over


_active: Relay | None = None  # the pair running in this process (pairs never nest)


def _pair_over() -> None:
    raise RuntimeError("this relayed pair has ended: its backward half cannot start")


def hand_over(*, backward: bool = False, ready_at: float | None = None) -> None:
    """Let the partner half of the running pair compute (call right after posting an
    exchange, before waiting on it); does nothing outside a pair. ``backward``: the exchange is
    a backward's (posted by an autograd node's backward): first the work that backward set aside
    for its exchanges' flight runs (:mod:`titan_dualpipe.weights.in_flight`: its queued weight
    GEMMs; as fillers, what fits before the partner's exchange arrives). A forward's exchange
    never runs it, also when a checkpointed region's recomputation posts it inside a backward.
    ``ready_at``: when the exchange arrives (``time.perf_counter()``), where known."""
    record = recorder()
    if record is not None:
        record.switch()  # the exchange just posted is one the partner may compute behind
    relay = _active
    if backward:
        run_work_in_flight(until=relay.partner_arrival() if relay is not None else None)
    if relay is not None:
        relay.hand_over(ready_at)


def running_half() -> str | None:
    """Which half of the running relayed pair this thread runs: "forward" (the calling thread) or
    "backward" (the helper thread); None outside a pair."""
    relay = _active
    return None if relay is None else _HALF_NAMES[relay._half()]


def run_relayed(forward_half: Callable[[], None], backward_half: Callable[[], None], first: int = FORWARD,
                kind: tuple[int, ...] | None = None, plan: HandOverPlan | None = None,
                half_locals: Sequence[HalfLocal] = ()) -> Relay:
    """Run both halves as a relay (see the module docstring), ``first`` (:data:`FORWARD` or
    :data:`BACKWARD`) until its first hand-over; returns the finished relay. ``kind``: what a
    recording benchmark files the pair under (:mod:`.pair_first` measures by it). ``plan``: per
    half, whether it switches at each of its hand-overs in turn (:func:`~titan_dualpipe.exposure.floor.hand_over_plan`);
    None, and every hand-over past a half's plan, switches. ``half_locals``: process-wide state each
    half keeps as its own (:class:`HalfLocal`; the slot of work in flight always is)."""
    global _active
    if _active is not None:
        raise RuntimeError("a relayed pair is already running in this process: pairs do not nest")
    if first not in (FORWARD, BACKWARD):
        raise ValueError(f"first must be FORWARD ({FORWARD}) or BACKWARD ({BACKWARD}), got {first!r}")
    caller_state = _thread_state()  # before anything runs: it refuses what cannot be carried
    backward_ended = threading.Event()

    def backward_job() -> None:
        error = None
        try:
            with caller_state():
                relay.wait_turn(BACKWARD)
                backward_half()
        except BaseException as err:  # noqa: BLE001 - re-raised by the calling thread
            error = err
        relay.end(BACKWARD, error)
        backward_ended.set()

    relay = Relay(start_backward=lambda: _helper_thread().submit(backward_job), first=first, kind=kind, plan=plan,
                  half_locals=half_locals)
    record = recorder()
    if record is not None and record.open_pair(kind):
        relay.record = record
        if first == FORWARD:
            record.run(FORWARD)
    _active = relay
    try:
        error = None
        try:
            if first == BACKWARD:
                relay.start_backward_first()
            forward_half()
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the partner ended
            error = err
        relay.end(FORWARD, error)
        if relay.backward_started:
            backward_ended.wait()
    finally:
        _active = None
        relay.close()
        if relay.record is not None and (relay.backward_started or relay.first_error() is not None):
            relay.record.close_pair()
    failure = relay.first_error()
    if failure is not None:
        raise failure
    if not relay.backward_started:
        # The forward never handed over: nothing to switch to, so the backward runs here,
        # after it, as it would have on the helper thread (its hand-overs would find the
        # forward ended). This spares modules without exchanges any thread switch.
        _run_backward_after(backward_half, relay.record)
    return relay


def _run_backward_after(backward_half: Callable[[], None], record: ExposureRecorder | None) -> None:
    """The backward half, run after its forward on the calling thread (recorded as the pair's
    second half where a benchmark records)."""
    if record is None:
        backward_half()
        return
    record.run(BACKWARD)
    try:
        backward_half()
    finally:
        record.end(BACKWARD)
        record.close_pair()


class _HelperThread:
    """The long-lived thread that runs backward halves. A fresh thread per pair would pay
    its start and a cold memory arena every time."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="titan_dualpipe-backward-half", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            self._jobs.get()()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)


_helper: _HelperThread | None = None


def _helper_thread() -> _HelperThread:
    global _helper
    if _helper is None or not _helper.thread.is_alive():  # none yet, or lost in a fork
        _helper = _HelperThread()
    return _helper


def _thread_state() -> Callable[[], ContextManager[None]]:
    """Capture this thread's state (docs/overlap.md#thread-local-state); the result enters it on
    another thread, for a block. ValueError for a state that cannot be carried."""
    private = private_thread_state()
    _refuse_what_cannot_be_carried(private)
    grad_enabled, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    cache_enabled = torch.is_autocast_cache_enabled()
    autocast = [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in _autocast_devices()]
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    stream = None
    if accelerator is not None and accelerator.type != "cpu" and _initialized(getattr(torch, accelerator.type, None)):
        stream = torch.accelerator.current_stream()

    @contextlib.contextmanager
    def entered() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if stream is not None:
                stack.enter_context(_on_stream(stream))
            if inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(grad_enabled))
            stack.enter_context(_autocast_entered(autocast, cache_enabled))
            stack.enter_context(private_thread_state_entered(private))  # last: forces the dispatch key sets
            yield

    return entered


@contextlib.contextmanager
def _on_stream(stream: torch.Stream) -> Iterator[None]:
    """``stream`` (and its device) current on this thread within the block; the thread's own after it."""
    device = torch.accelerator.current_device_index()
    torch.accelerator.set_device_index(stream.device.index)
    previous = torch.accelerator.current_stream()
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)
        torch.accelerator.set_device_index(device)


@contextlib.contextmanager
def _autocast_entered(states: list[tuple[str, bool, torch.dtype]], cache_enabled: bool) -> Iterator[None]:
    """The caller's autocast state on this thread within the block, as torch's autograd threads
    take it: the flags and one level of nesting, but no ``torch.autocast`` of its own, whose exit
    would clear autocast's cast cache, which is process-wide (the caller's forward would then cast
    its weights again, and a selective-AC region's recomputation would meet casts its forward never
    saved)."""
    before = [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind, _, _ in states]
    cache_before = torch.is_autocast_cache_enabled()
    for kind, enabled, dtype in states:
        torch.set_autocast_enabled(kind, enabled)
        torch.set_autocast_dtype(kind, dtype)
    torch.set_autocast_cache_enabled(cache_enabled)
    torch.autocast_increment_nesting()  # an inner autocast's exit (a recomputation's) leaves the cache alone
    try:
        yield
    finally:
        torch.autocast_decrement_nesting()
        torch.set_autocast_cache_enabled(cache_before)
        for kind, enabled, dtype in before:
            torch.set_autocast_enabled(kind, enabled)
            torch.set_autocast_dtype(kind, dtype)


def _refuse_what_cannot_be_carried(private: PrivateThreadState) -> None:
    if private.functorch_transform:
        raise ValueError(
            "a relayed pair (or two-batch sub-batches run as a relay) cannot start inside a torch.func transform "
            "(vmap, grad, jacrev, ...): the transform's state stays on the calling thread, and the other half "
            "runs on a helper thread. Run the schedule outside the transform, or pass overlap=False "
            "(and two_batch_overlap=False) to the schedule")


def _autocast_devices() -> list[str]:
    """The device types whose autocast state a relay carries: CPU's and the accelerator's."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    kinds = ["cpu"]
    if accelerator is not None and accelerator.type != "cpu" and torch.amp.is_autocast_available(accelerator.type):
        kinds.append(accelerator.type)
    return kinds


def _accelerator_module() -> ModuleType | None:
    """torch's module for the accelerator (``torch.cuda``), None on a CPU-only machine."""
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None or accelerator.type == "cpu":
        return None
    return getattr(torch, accelerator.type, None)


def _rng_states(accelerator: ModuleType | None) -> _RngStates:
    """The process-wide generators' states: CPU's, and each of the accelerator's devices'
    once it is initialized (a CPU-only run never initializes it here)."""
    generators = [torch.default_generator]
    if _initialized(accelerator):
        generators += getattr(accelerator, "default_generators", ())
    return [(generator, generator.get_state()) for generator in generators]


def _set_rng_states(states: _RngStates) -> None:
    for generator, state in states:
        generator.set_state(state)


def _forked(current: _RngStates, at_start: _RngStates) -> _RngStates:
    """States for a stream of its own: each generator seeded from a hash of its state at the pair's
    start (or of its current one, for a generator initialized since)."""
    start = {id(generator): state for generator, state in at_start}
    return [(generator, _seeded(generator, start.get(id(generator), state))) for generator, state in current]


def _seeded(generator: torch.Generator, state: torch.Tensor) -> torch.Tensor:
    """The state of a fresh generator like ``generator``, seeded from a hash of ``state`` (a contiguous
    CPU byte tensor, as ``get_state`` returns). Read through its pointer, out of the modes' sight: a
    hand-over inside a user's mode or checkpoint region adds no operation to what they see."""
    with torch_function_bypassed():
        raw = ctypes.string_at(state.data_ptr(), state.numel() * state.element_size())
    digest = hashlib.blake2b(raw, digest_size=8).digest()
    fresh = torch.Generator(device=generator.device)
    fresh.manual_seed(int.from_bytes(digest, "little"))
    return fresh.get_state()


def _initialized(module: ModuleType | None) -> bool:
    is_initialized = getattr(module, "is_initialized", None)
    return bool(is_initialized()) if callable(is_initialized) else False
