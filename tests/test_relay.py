"""The relay that overlaps a pair's halves for modules without the protocol (one process, threads)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from titan_dualpipe._compat.autograd import private_thread_state
from titan_dualpipe.overlap import relay
from titan_dualpipe.exposure.record import start_recording, stop_recording
from titan_dualpipe.overlap.relay import BACKWARD, FORWARD, PartnerFailed, hand_over, run_relayed


def _half(name: str, parts: int, log: list, fail_at: int | None = None):
    def run() -> None:
        for i in range(parts):
            if i:
                hand_over()
            if i == fail_at:
                raise KeyError(f"{name} broke at part {i}")
            log.append(f"{name}{i}")

    return run


def test_halves_take_turns_at_hand_overs_forward_first():
    log: list = []
    done = run_relayed(_half("F", 3, log), _half("B", 2, log))
    assert log == ["F0", "B0", "F1", "B1", "F2"]
    assert done.hand_overs == 3  # the last one found the backward half ended: no switch


def test_halves_take_turns_at_hand_overs_backward_first():
    log: list = []
    done = run_relayed(_half("F", 3, log), _half("B", 2, log), first=BACKWARD)
    assert log == ["B0", "F0", "B1", "F1", "F2"]
    assert done.hand_overs == 2 and done.backward_started  # the forward's second found the backward ended


def test_a_plan_keeps_a_half_running_at_the_hand_overs_it_names():
    """A plan (``pair_first="measured"``'s) switches only where it says; a recorder counts every
    hand-over a half offered, switching or not."""
    log: list = []
    record = start_recording()
    try:
        done = run_relayed(_half("F", 3, log), _half("B", 2, log), plan=((False, True), (True,)), kind=(0, 3))
        (pair,) = record.take().pairs
    finally:
        stop_recording()
    assert log == ["F0", "F1", "B0", "F2", "B1"]
    assert done.hand_overs == 2 and done.offers == [2, 1] and pair.offers == (2, 1)
    log.clear()
    done = run_relayed(_half("F", 3, log), _half("B", 2, log), first=BACKWARD, plan=((), (False,)))
    assert log == ["B0", "B1", "F0", "F1", "F2"] and done.hand_overs == 0  # past its plan, F finds B ended


def test_a_backward_first_that_never_hands_over_is_followed_by_its_forward():
    log: list = []
    done = run_relayed(_half("F", 2, log), lambda: log.append(threading.get_ident()), first=BACKWARD)
    assert log[1:] == ["F0", "F1"] and log[0] != threading.get_ident() and done.hand_overs == 0


def test_first_must_name_a_half():
    with pytest.raises(ValueError, match="first must be FORWARD"):
        run_relayed(lambda: None, lambda: None, first=2)
    assert relay._active is None


@pytest.mark.parametrize("first", [FORWARD, BACKWARD], ids=["forward_first", "backward_first"])
def test_a_recorder_files_the_pair_under_its_kind_in_the_order_it_ran(first):
    record = start_recording()
    try:
        run_relayed(_half("F", 2, []), _half("B", 2, []), first=first, kind=(3, 0))
        (pair,) = record.take().pairs
    finally:
        stop_recording()
    assert pair.kind == (3, 0)
    assert pair.order == (first, 1 - first)  # no exchange posted: one segment per half


def test_backward_half_runs_on_its_own_thread_with_the_callers_grad_mode():
    seen: dict = {}

    def backward() -> None:
        seen["thread"] = threading.get_ident()
        seen["grad"] = torch.is_grad_enabled()

    with torch.no_grad():
        run_relayed(hand_over, backward)
    assert seen["thread"] != threading.get_ident() and seen["grad"] is False
    run_relayed(hand_over, backward)
    assert seen["grad"] is True


def test_a_forward_that_never_hands_over_is_followed_by_its_backward_on_the_calling_thread():
    log: list = []

    def backward() -> None:
        log.append(threading.get_ident())
        hand_over()  # the forward ended: nothing to switch to
        log.append("B done")

    done = run_relayed(lambda: log.append("F"), backward)
    assert log == ["F", threading.get_ident(), "B done"] and done.hand_overs == 0 and not done.backward_started


def test_hand_over_outside_a_pair_does_nothing():
    hand_over()
    assert relay._active is None


@pytest.mark.parametrize("failing", ["F", "B"])
def test_a_failing_half_stops_the_partner_at_its_next_hand_over_and_is_raised(failing):
    log: list = []
    forward = _half("F", 4, log, fail_at=2 if failing == "F" else None)
    backward = _half("B", 4, log, fail_at=1 if failing == "B" else None)
    with pytest.raises(KeyError, match=f"{failing} broke at part"):
        run_relayed(forward, backward)
    # the partner computes nothing after the failure
    assert log == (["F0", "B0", "F1", "B1"] if failing == "F" else ["F0", "B0", "F1"])
    assert relay._active is None


@pytest.mark.parametrize("fail_at", [0, 1])
def test_a_backward_first_that_fails_stops_the_forward_even_before_it_began(fail_at):
    log: list = []
    with pytest.raises(KeyError, match="B broke at part"):
        run_relayed(_half("F", 3, log), _half("B", 3, log, fail_at=fail_at), first=BACKWARD)
    assert log == ([] if fail_at == 0 else ["B0", "F0"])
    assert relay._active is None


def test_partner_failed_names_the_half_that_raised():
    caught: list = []

    def forward() -> None:
        hand_over()
        raise ValueError("forward half broke")

    def backward() -> None:
        try:
            hand_over()
        except PartnerFailed as err:
            caught.append(str(err))
            raise

    with pytest.raises(ValueError, match="forward half broke"):
        run_relayed(forward, backward)
    assert caught == ["the forward half of this pair raised; the backward half stops"]


def test_pairs_do_not_nest():
    with pytest.raises(RuntimeError, match="pairs do not nest"):
        run_relayed(lambda: run_relayed(lambda: None, lambda: None), lambda: None)
    assert relay._active is None


def test_autograd_backward_pauses_at_a_hand_over_inside_a_node():
    """A hand-over inside an autograd node's backward lets the forward half compute, and
    the gradients equal a backward run without the relay."""

    class HandOverInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            log.append("B: node reached")
            hand_over()
            log.append("B: node resumed")
            return grad * 2

    log: list = []
    w = torch.randn(4, requires_grad=True)
    loss = (HandOverInBackward.apply(w * 3) ** 2).sum()
    want = torch.autograd.grad((HandOverInBackward.apply(w * 3) ** 2).sum(), w)[0]
    log.clear()

    def forward() -> None:
        log.append("F: before")
        hand_over()
        log.append("F: after")

    run_relayed(forward, lambda: loss.backward())
    assert log == ["F: before", "B: node reached", "F: after", "B: node resumed"]
    assert torch.equal(w.grad, want)


class _HandOver(torch.nn.Module):
    """Hands over mid-block: mid-forward in the forward half, mid-recompute in the backward half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hand_over()
        return x


class _CheckpointedDropoutBlocks(torch.nn.Module):
    def __init__(self, width: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), _HandOver(), torch.nn.Dropout(0.5), torch.nn.Tanh())
            for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)  # preserve_rng_state by default
        return x


def _dropout_pair(relayed: bool, first: int = FORWARD) -> dict:
    """One pair: the forward of one stage module, the backward of another's earlier microbatch
    (as in DualPipe); then the forward half's own backward, whose recompute checks its masks."""
    torch.manual_seed(0)
    forward_stage, backward_stage = _CheckpointedDropoutBlocks(), _CheckpointedDropoutBlocks()
    backward_loss = backward_stage(torch.randn(8, 16)).square().mean()  # before the pair
    x = torch.randn(8, 16)
    got: dict = {}

    def forward_half() -> None:
        got["output"] = forward_stage(x)

    def backward_half() -> None:
        backward_loss.backward()

    if relayed:
        got["hand_overs"] = run_relayed(forward_half, backward_half, first).hand_overs
    else:
        forward_half()
        backward_half()
    got["rng_after_pair"] = torch.get_rng_state()
    got["output"].square().mean().backward()
    got["grads"] = [p.grad for p in [*forward_stage.parameters(), *backward_stage.parameters()]]
    return got


@pytest.mark.parametrize("first", [FORWARD, BACKWARD], ids=["forward_first", "backward_first"])
def test_checkpointed_dropout_under_the_relay_is_bitwise_equal_to_sequential_halves(first):
    """Each half draws from its own generator stream: a hand-over mid-recompute neither feeds the
    forward half the recompute's state nor lets the recompute's restore undo the forward's draws;
    which half runs first changes nothing."""
    sequential, relayed = _dropout_pair(relayed=False), _dropout_pair(relayed=True, first=first)
    assert relayed["hand_overs"] == 6  # every block of both halves hands over
    assert torch.equal(relayed["output"], sequential["output"])
    assert torch.equal(relayed["rng_after_pair"], sequential["rng_after_pair"])
    assert all(torch.equal(r, s) for r, s in zip(relayed["grads"], sequential["grads"], strict=True))


def test_an_initialized_accelerators_generators_are_switched_per_half_too(monkeypatch):
    """The per-device generators (CUDA's, here a stand-in module) follow the halves like CPU's: the
    forward half draws what it draws alone, the backward half from a stream of its own."""
    device_generator = torch.Generator()

    class Accelerator:
        default_generators = (device_generator,)

        @staticmethod
        def is_initialized() -> bool:
            return True

    monkeypatch.setattr(relay, "_accelerator_module", lambda: Accelerator)
    draws: dict = {}

    def forward() -> None:
        draws["F"] = [torch.rand(4, generator=device_generator)]
        hand_over()
        draws["F"].append(torch.rand(4, generator=device_generator))

    def backward() -> None:
        draws["B start"] = device_generator.get_state()
        draws["B"] = torch.rand(4, generator=device_generator)
        hand_over()

    device_generator.manual_seed(1)
    want = [torch.rand(4, generator=device_generator) for _ in range(2)]
    want_end = device_generator.get_state()
    device_generator.manual_seed(1)
    assert run_relayed(forward, backward).hand_overs == 2
    assert all(torch.equal(got, w) for got, w in zip(draws["F"], want, strict=True))
    assert not any(torch.equal(draws["B"], w) for w in want)  # before: it repeated the forward's second draw
    assert torch.equal(device_generator.get_state(), want_end)  # the pair ends where the forward ended
    alone = torch.Generator()
    alone.set_state(draws["B start"])
    assert torch.equal(draws["B"], torch.rand(4, generator=alone))


def _backward_draws(seed: int, forward_draws: int) -> torch.Tensor:
    """What a pair's backward half draws when the pair starts at ``seed`` and its forward draws
    ``forward_draws`` numbers before handing over."""
    got: list = []

    def forward() -> None:
        torch.rand(forward_draws)
        hand_over()

    torch.manual_seed(seed)
    run_relayed(forward, lambda: got.append(torch.rand(8)))
    return got[0]


def test_each_half_draws_the_same_whichever_runs_first():
    def pair(first: int) -> tuple:
        draws: dict = {}

        def forward() -> None:
            draws["F"] = [torch.rand(3)]
            hand_over()
            draws["F"].append(torch.rand(3))

        def backward() -> None:
            draws["B"] = [torch.rand(3)]
            hand_over()
            draws["B"].append(torch.rand(3))

        torch.manual_seed(7)
        run_relayed(forward, backward, first)
        return torch.cat(draws["F"]), torch.cat(draws["B"]), torch.get_rng_state()

    forward_first, backward_first = pair(FORWARD), pair(BACKWARD)
    assert all(torch.equal(a, b) for a, b in zip(forward_first, backward_first, strict=True))
    torch.manual_seed(7)
    assert torch.equal(forward_first[0], torch.rand(6))  # the forward draws the caller's stream


def test_the_backward_halfs_stream_is_seeded_by_the_state_the_pair_starts_from():
    """Its stream depends on the generators' state at the pair's start only: not on what the forward
    drew before handing over (the first half's first exchange may come anywhere), and it differs
    between pairs that start from different states."""
    first = _backward_draws(seed=0, forward_draws=3)
    assert torch.equal(first, _backward_draws(seed=0, forward_draws=5))
    assert not torch.equal(first, _backward_draws(seed=1, forward_draws=3))
    torch.manual_seed(0)
    assert not torch.equal(first, torch.rand(11)[3:])  # none of the forward's stream


@pytest.mark.parametrize("first", [FORWARD, BACKWARD], ids=["forward_first", "backward_first"])
def test_each_half_keeps_its_own_weight_queue_marks_and_work_in_flight(first):
    """Two halves that each enter and leave the weight queue's deferring and collecting, and set
    work in flight, at different times (two forwards or two backwards of one relay): each sees its
    own marks and work throughout, and the pair leaves the state it started from. Shared, the
    first to leave its blocks would reset the marks under the other."""
    from titan_dualpipe.weights import in_flight
    from titan_dualpipe.weights.queue import WeightGradQueue

    queue = WeightGradQueue()
    seen: dict[int, list] = {FORWARD: [], BACKWARD: []}

    def half(h: int):
        def work() -> None:
            pass

        def run() -> None:
            with queue.deferring(), queue.collecting((h, 0)), in_flight.work_while_exchanges_fly(work):
                hand_over()
                seen[h].append((queue.parked(), in_flight.parked()[0] is work))
            hand_over()
            seen[h].append((queue.parked(), in_flight.parked()[0] is None))
        return run

    run_relayed(half(FORWARD), half(BACKWARD), first, half_locals=(queue,))
    for h in (FORWARD, BACKWARD):
        assert seen[h] == [((True, (h, 0)), True), ((False, None), True)], (h, seen)
    assert queue.parked() == (False, None) and in_flight.parked() == (None, False)


def test_backward_half_runs_in_the_callers_autocast_and_inference_mode():
    seen: list = []
    a = torch.ones(2, 2)

    def backward() -> None:
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), (a @ a).dtype,
                     torch.is_inference_mode_enabled(), torch.is_grad_enabled()))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        run_relayed(hand_over, backward)
    with torch.inference_mode():
        run_relayed(hand_over, backward)
    run_relayed(hand_over, backward)  # the helper thread's own state is back
    assert seen == [(True, torch.bfloat16, torch.bfloat16, False, True),
                    (False, torch.bfloat16, torch.float32, True, False),
                    (False, torch.bfloat16, torch.float32, False, True)]


def test_backward_half_runs_under_the_callers_torch_function_and_dispatch_modes():
    """The mode stacks as they are on the calling thread (innermost last), entered on the helper
    thread for the pair only."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    log: list = []

    class FunctionLog(TorchFunctionMode):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.mul:
                log.append((self.name, threading.get_ident()))
            return func(*args, **(kwargs or {}))

    class DispatchLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.mul.Tensor:
                log.append(("dispatch", threading.get_ident()))
            return func(*args, **(kwargs or {}))

    a = torch.ones(2)
    with FunctionLog("outer"), DispatchLog(), FunctionLog("inner"):
        run_relayed(hand_over, lambda: torch.mul(a, a))
    helper = relay._helper.thread.ident
    assert log == [("inner", helper), ("outer", helper), ("dispatch", helper)]
    log.clear()
    run_relayed(hand_over, lambda: torch.mul(a, a))
    assert log == []


def test_backward_half_saves_through_the_callers_saved_tensor_hooks_or_their_disabling():
    packed: list = []
    w = torch.ones(3, requires_grad=True)

    def backward() -> None:
        (w * 2).sin().sum().backward()

    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(threading.get_ident()) or t, lambda t: t):
        run_relayed(hand_over, backward)
    assert packed and set(packed) == {relay._helper.thread.ident}
    def enter_hooks() -> None:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            pass

    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in this region"):
        with pytest.raises(RuntimeError, match="no hooks in this region"):
            run_relayed(hand_over, enter_hooks)
    run_relayed(hand_over, backward)  # neither is left on the helper thread
    assert set(packed) == {relay._helper.thread.ident} and w.grad is not None


def test_a_pair_inside_a_torch_func_transform_is_refused_before_either_half_runs():
    ran: list = []

    def pair(x: torch.Tensor) -> torch.Tensor:
        run_relayed(lambda: ran.append("F"), lambda: ran.append("B"))
        return x

    with pytest.raises(ValueError, match=r"inside a torch\.func transform.*overlap=False"):
        torch.func.vmap(pair)(torch.ones(2))
    assert ran == [] and relay._active is None


def test_backward_half_runs_in_the_whole_of_the_callers_private_thread_state():
    """Every part torch keeps behind private names, as the calling thread had it when the pair
    started: hooks, mode stacks, torch-function disabling, autograd's flags, the dispatcher's key sets."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    seen: list = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        stack.enter_context(torch.autograd._force_original_view_tracking(True))
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        stack.enter_context(Functions())
        stack.enter_context(Dispatch())
        caller = private_thread_state()
        run_relayed(hand_over, lambda: seen.append(private_thread_state()))
    assert seen == [caller]
    assert caller.function_modes and caller.dispatch_modes and caller.saved_tensors_hooks is not None
    run_relayed(hand_over, lambda: seen.append(private_thread_state()))
    assert seen[1] == private_thread_state() != caller  # and none of it stays on the helper thread


def test_the_relays_own_bookkeeping_is_out_of_the_modes_sight():
    """Switching halves (generator states, the backward half's stream, the thread state) runs no
    tensor call a user's mode sees: one inside a selective-checkpoint region would otherwise
    record operations its recompute does not repeat."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list = []

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Functions(), Dispatch():
        assert run_relayed(hand_over, hand_over).hand_overs == 2
    assert seen == []


@pytest.mark.parametrize("fill", [True, False], ids=["fillers", "all"])
def test_a_relayed_backward_fills_until_its_partners_exchange_arrives(fill):
    """As fillers, the work a backward half set aside runs at each of its exchanges until the forward
    half's awaited exchange arrives (its ``ready_at``); else with no limit."""
    from titan_dualpipe.weights.in_flight import work_while_exchanges_fly

    seen: list = []

    def forward_half() -> None:
        for arrival in (100.0, 200.0):  # time.perf_counter() times, as posted exchanges' arrivals
            relay.hand_over(ready_at=arrival)

    def backward_half() -> None:
        with work_while_exchanges_fly(lambda until="all": seen.append(until), fill=fill), torch.no_grad():
            for arrival in (300.0, 400.0):
                relay.hand_over(backward=True, ready_at=arrival)

    relay.run_relayed(forward_half, backward_half)
    assert seen == ([100.0, 200.0] if fill else ["all", "all"])
