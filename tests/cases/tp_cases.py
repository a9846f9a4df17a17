"""Pipelining x tensor parallelism against a non-pipelined, non-parallel reference (run on every
rank of a WorkerPool of 4: a pp 2 x tp 2 mesh).

Each stage module's MLPs are tensor-parallel (``w1`` column-wise, ``w2`` row-wise) and so is the
vocabulary head (column-wise); attention, norms and embeddings stay replicated. With loss
parallel the head's logits stay sharded over the vocabulary and every microbatch's loss is a
DTensor (torchtitan's default when TP > 1); without it the logits are gathered.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from titan_dualpipe.check.numerics import (batch, build_pipeline, grad_error, loss_error, reference_step,
                                           twins_identical)
from titan_dualpipe.testing.model import TinyLM


def _tensor_parallel(module: TinyLM, tp_mesh, with_loss_parallel: bool) -> None:
    plan = {}
    for name in module.layers:
        plan[f"layers.{name}.w1"] = ColwiseParallel()
        plan[f"layers.{name}.w2"] = RowwiseParallel()
    if module.output is not None:
        plan["output"] = (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if with_loss_parallel
                          else ColwiseParallel(output_layouts=Replicate()))
    parallelize_module(module, tp_mesh, plan)


def tp_numerics(schedule: str, n: int, with_loss_parallel: bool, fsdp: bool = False, steps: int = 2,
                **kwargs) -> dict:
    """``steps`` training steps with Adam between on a pp 2 x tp 2 mesh (``fsdp``: pp 2 x dp 1 x
    tp 2, FSDP2 over dp): every microbatch loss and every gradient (sharded ones gathered) equal
    the reference's on every rank."""
    shape, names = ((2, 1, 2), ("pp", "dp", "tp")) if fsdp else ((2, 2), ("pp", "tp"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    pp_group, pp_rank = mesh["pp"].get_group(), mesh["pp"].get_local_rank()
    reference, modules, sched = build_pipeline(
        schedule, 2, n, pp_group, pp_rank, fsdp_mesh=mesh["dp"] if fsdp else None,
        parallelize=lambda module: _tensor_parallel(module, mesh["tp"], with_loss_parallel), **kwargs)
    place = sched.placement
    opt = torch.optim.Adam([p for m in modules.values() for p in m.parameters()], lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    result = {"rank": dist.get_rank(), "losses_checked": 0, "grads_checked": 0, "sharded_grads": 0,
              "dtensor_losses": 0, "grad_err": 0.0}
    for step in range(steps):
        x, y = batch(step, n)
        losses: list = []
        with loss_parallel() if with_loss_parallel else contextlib.nullcontext():
            sched.step(x, target=y, losses=losses) if place.feeds_batch(pp_rank) else sched.step()
        want = reference_step(reference, x, y, n, scale_grads=True)
        if losses:
            result["dtensor_losses"] += sum(isinstance(loss, DTensor) for loss in losses)
            loss_error(losses, want, n)
            result["losses_checked"] += n
        grads = [p.grad for m in modules.values() for p in m.parameters()]
        result["sharded_grads"] += sum(isinstance(g, DTensor) for g in grads)
        result["grads_checked"] += len(grads)
        result["grad_err"] = max(result["grad_err"], grad_error(modules, reference, f"step {step}"))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    if place.bidirectional:
        result["twin_parts"] = twins_identical(modules, place, pp_group)
    result["deferred_gemms"] = sum(sched.weight_policy.queue.ran.values())  # the last step's, DTensor weights among them
    result["deferred_dtensor_weights"] = sum(
        isinstance(modules[s].get_submodule(name).weight, DTensor) for s, names in sched.deferred_weights.items()
        for name in names)
    return result
