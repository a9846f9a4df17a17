"""Swap tensors with one peer rank: the exchange DualPipe's twins, its losses and its MoE
expert counts are built on."""

from __future__ import annotations

import torch
import torch.distributed as dist


def swap(send: list[torch.Tensor], recv_like: list[torch.Tensor], peer: int,
         group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Send ``send`` to global rank ``peer`` and receive tensors shaped like ``recv_like`` from it.

    The peer calls it with the roles mirrored (its ``send`` laid out like our ``recv_like``).
    Sends and receives go in one ``batch_isend_irecv``, which progresses them together: safe
    without buffering (NCCL), whichever rank posts first.
    """
    received = [torch.empty_like(t) for t in recv_like]
    swap_into(send, received, peer, group)
    return received


def swap_into(send: list[torch.Tensor], received: list[torch.Tensor], peer: int,
              group: dist.ProcessGroup | None) -> None:
    """:func:`swap`, receiving into the caller's ``received`` buffers."""
    ops = [dist.P2POp(dist.isend, t, peer, group) for t in send]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t in received]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
