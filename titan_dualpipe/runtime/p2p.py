"""Swap tensors with one peer rank: the exchange DualPipe's twins, its losses and its MoE
expert counts are built on. DTensors (FSDP2 and tensor-parallel parameters and grads, losses
under loss parallel) travel as their local shards: both peers hold the same layout, so shard
``k`` of one meets shard ``k`` of the other, and :func:`with_layout_of` rewraps what arrives."""

from __future__ import annotations

import torch
import torch.distributed as dist


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def with_layout_of(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor with ``template``'s mesh and placements where ``template`` is one."""
    if hasattr(template, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False)
    return local


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
