"""How a stage module provides its own overlapped forward + backward.

A pair ``(F; B)`` runs one microbatch's forward and another's full backward on the two stages of
one rank. When both stage modules are of one class that defines
:meth:`OverlappedForwardBackward.overlapped_forward_backward`, the runtime hands it the whole
pair, inside torch's stage bookkeeping, so it can interleave the halves at a finer grain than
the pipeline can (DeepSeek-V3's way); the method only computes. The second protocol does the
same for a lone microbatch's two sub-batches (two-batch overlap). Modules without them run as a
relay (:mod:`~titan_dualpipe.overlap.relay`). The contract: docs/overlap.md#the-protocol.
"""

from __future__ import annotations

import warnings

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


class OverlappedSubBatches(Protocol):
    """Two-batch overlap provided by the stage module (:mod:`~titan_dualpipe.overlap.sub_batches`):
    one lone microbatch's two sub-batches, interleaved at the module's exchanges. Modules without it
    run the sub-batches as a relay."""

    @classmethod
    def overlapped_sub_batches_forward(cls, module: nn.Module, sub_batches: Any) -> list[Any]:
        """Exactly ``[module.forward(*args, **kwargs) for args, kwargs in sub_batches]``."""
        ...

    @classmethod
    def overlapped_sub_batches_backward(cls, module: nn.Module, sub_batches: Any) -> None:
        """Exactly ``torch.autograd.backward(outputs, grads)`` for each ``(outputs, grads)`` of
        ``sub_batches`` (their outputs of one forward of ``module``, or losses computed from them)."""
        ...


_METHODS = ("overlapped_sub_batches_forward", "overlapped_sub_batches_backward")
_OLD_METHODS = ("overlapped_halves_forward", "overlapped_halves_backward")  # their names before sub-batches


class _OldMethodNames:
    """A class that provides the protocol under its old method names, called by the new ones."""

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def overlapped_sub_batches_forward(self, module: nn.Module, sub_batches: Any) -> list[Any]:
        return self.cls.overlapped_halves_forward(module, sub_batches)

    def overlapped_sub_batches_backward(self, module: nn.Module, sub_batches: Any) -> None:
        return self.cls.overlapped_halves_backward(module, sub_batches)


def sub_batches_implementation(module: nn.Module) -> Any:
    """What provides :class:`OverlappedSubBatches` for ``module`` (its class), or None. A class with
    the protocol's old method names (``overlapped_halves_*``) still provides it, with a warning."""
    cls = type(module)
    if all(callable(getattr(cls, name, None)) for name in _METHODS):
        return cls
    if all(callable(getattr(cls, name, None)) for name in _OLD_METHODS):
        warnings.warn(f"{cls.__name__}.overlapped_halves_forward/backward are deprecated names: define "
                      "overlapped_sub_batches_forward/backward", DeprecationWarning, stacklevel=2)
        return _OldMethodNames(cls)
    return None


def __getattr__(name: str) -> Any:
    if name == "OverlappedHalves":
        warnings.warn("titan_dualpipe.overlap.OverlappedHalves is deprecated: use OverlappedSubBatches",
                      DeprecationWarning, stacklevel=2)
        return OverlappedSubBatches
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
