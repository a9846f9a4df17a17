"""How a stage module provides its own overlapped forward + backward.

A pair ``(F; B)`` runs the forward of one microbatch on one stage and the full backward
of another microbatch on another stage of the same rank. When both stage modules are of
one class that defines :meth:`OverlappedForwardBackward.overlapped_forward_backward`, the
runtime hands the whole pair to it, so it can interleave the two halves at a finer grain
than the pipeline can: e.g. a MoE layer's attention of the forward microbatch runs while
the backward microbatch's combine all-to-all is in flight, and so on (DeepSeek-V3's
``overlapped_forward_backward``). Modules without it run as a relay
(:mod:`~titan_dualpipe.overlap.relay`): the halves switch wherever the module's exchanges
call ``hand_over()``, and the forward half's pipeline send is in flight while the backward
half computes.

The runtime keeps every bit of torch's stage bookkeeping (receiving inputs, caching
activations, FSDP hooks and flags, sending results); the method only computes.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class OverlappedForwardBackward(Protocol):
    @classmethod
    def overlapped_forward_backward(
        cls,
        forward_module: nn.Module,
        forward_args: tuple[Any, ...],
        forward_kwargs: dict[str, Any],
        backward_module: nn.Module,
        backward_inputs: list[Any],
        backward_outputs: list[torch.Tensor],
        backward_output_grads: list[torch.Tensor | None] | None,
    ) -> Any:
        """Run both halves, interleaved, and return the forward half's output.

        Forward half: exactly ``forward_module(*forward_args, **forward_kwargs)`` (call the
        module's own forward; the runtime already runs its hooks around this method).

        Backward half: exactly ``torch.autograd.backward(backward_outputs,
        backward_output_grads)`` - the loss with ``None`` grads on a last stage, otherwise
        the stage outputs of the backward microbatch and their gradients.
        ``backward_inputs`` are that microbatch's stage inputs, as passed to
        ``backward_module``'s forward (use them to find what the forward saved); their
        ``.grad`` and the parameters' ``.grad`` must end as the plain backward leaves them.
        """
        ...


def overlap_implementation(forward_module: nn.Module, backward_module: nn.Module):
    """The class method to run a pair with, or None when the modules do not provide one."""
    cls = type(forward_module)
    if cls is not type(backward_module):
        return None
    return getattr(cls, "overlapped_forward_backward", None)


class OverlappedHalves(Protocol):
    """Two-batch overlap provided by the stage module (:mod:`~titan_dualpipe.overlap.two_batch`):
    one lone microbatch's two halves, interleaved at the module's exchanges. Modules without it
    run the halves as a relay."""

    @classmethod
    def overlapped_halves_forward(cls, module: nn.Module, halves: Any) -> list[Any]:
        """Exactly ``[module.forward(*args, **kwargs) for args, kwargs in halves]``."""
        ...

    @classmethod
    def overlapped_halves_backward(cls, module: nn.Module, halves: Any) -> None:
        """Exactly ``torch.autograd.backward(outputs, grads)`` for each ``(outputs, grads)`` of
        ``halves`` (the halves' outputs of one forward of ``module``, or losses computed from them)."""
        ...


def halves_implementation(module: nn.Module) -> type | None:
    """The class providing :class:`OverlappedHalves` for ``module``, or None."""
    cls = type(module)
    provided = all(callable(getattr(cls, name, None))
                   for name in ("overlapped_halves_forward", "overlapped_halves_backward"))
    return cls if provided else None
