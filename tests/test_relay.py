"""The relay that overlaps a pair's halves for modules without the protocol (one process, threads)."""

from __future__ import annotations

import threading

import pytest
import torch

from titan_dualpipe.overlap import relay
from titan_dualpipe.overlap.relay import PartnerFailed, hand_over, run_relayed


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
