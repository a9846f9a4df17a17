"""FSDP2 helpers of the runtime: a stage module's FSDP modules, gathered together, and kept
gathered across the two sub-batches of a split microbatch."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule

from .._compat.fsdp import fsdp_post_forward_decided, fsdp_reshard_after_forward


def fsdp_modules(module: nn.Module) -> list[FSDPModule]:
    """``module`` and its submodules that FSDP2 manages, in module order."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def unshard_all(module: nn.Module) -> None:
    """Gather the parameters of every FSDP2 module in ``module`` (waits for them)."""
    for m in fsdp_modules(module):
        m.unshard()


@contextlib.contextmanager
def gathered_for_both_sub_batches(module: nn.Module) -> Iterator[None]:
    """Two forwards through ``module`` inside the block (a microbatch's sub-batches, interleaved) that
    call its FSDP2 modules alike, each as often: the k-th call of either gathers a module's
    parameters once for both.

    FSDP2 alone reshards at every post-forward, so the partner sub-batch's matching call would
    gather again (an all-gather per call more than the whole microbatch posts), and a sub-batch that
    hands over inside a module's call (torchtitan's blocks) would find its parameters freed by
    the partner's post-forward when it resumes. Here a group's odd post-forwards
    keep its parameters gathered and its even ones (both sub-batches past the call) reshard them by
    its ``reshard_after_forward``, as the whole microbatch's post-forward would, even where the
    partner's post-forward left the group idle (FSDP2 then reshards whatever the setting: a
    group kept gathered, ``reshard_after_forward=False`` or folded twins, would be gathered again). A module one
    sub-batch calls more often than the other may gather again; a call left unmatched at the end is
    resharded as a post-forward would. Memory: a module stays gathered from the first sub-batch's
    call to the second's (the sub-batches interleave at their exchanges, so usually one module).
    """
    calls: Counter = Counter()

    def reshard(group: object) -> bool:
        calls[group] += 1
        return calls[group] % 2 == 0

    with fsdp_post_forward_decided(fsdp_modules(module), reshard) as groups:
        yield
    for group in groups:
        if calls[group] % 2:
            fsdp_reshard_after_forward(group)
