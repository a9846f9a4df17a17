"""Pipelining x tensor parallelism against a non-pipelined, non-parallel reference (run on every
rank of a WorkerPool of 4: a pp 2 x tp 2 mesh).

Each stage module's MLPs are tensor-parallel (``w1`` column-wise, ``w2`` row-wise) and so is the
vocabulary head (column-wise); attention, norms and embeddings stay replicated. With loss
parallel the head's logits stay sharded over the vocabulary and every microbatch's loss is a
DTensor (torchtitan's default when TP > 1); without it the logits are gathered.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from titan_dualpipe import placement
from titan_dualpipe.bench.model import TinyLM, lm_loss, split_model
from titan_dualpipe.check.numerics import ATOL, RTOL, SCHEDULES, VOCAB, batch, full, reference_step, twins_identical


def _tensor_parallel(module: TinyLM, tp_mesh, with_loss_parallel: bool) -> None:
    plan = {}
    for name in module.layers:
        plan[f"layers.{name}.w1"] = ColwiseParallel()
        plan[f"layers.{name}.w2"] = RowwiseParallel()
    if module.output is not None:
        plan["output"] = (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if with_loss_parallel
                          else ColwiseParallel(output_layouts=Replicate()))
    parallelize_module(module, tp_mesh, plan)


def _build(schedule: str, pp: int, n: int, pp_group, pp_rank: int, tp_mesh, with_loss_parallel: bool, dp_mesh=None,
           **kwargs):
    torch.manual_seed(0)
    place = placement(schedule, pp, n)
    n_parts = place.num_stages if schedule == "DualPipeV" else pp
    reference = TinyLM(vocab=VOCAB, dim=16, layers=max(n_parts, 2), heads=2)
    parts = split_model(reference, n_parts)
    modules = {s: copy.deepcopy(parts[place.model_part(s)]) for s in sorted(place.stages_of(pp_rank), key=place.model_part)}
    if place.bidirectional:  # the direction-1 copies start different: the first step must make twins equal
        with torch.no_grad():
            for p in modules[place.stages_of(pp_rank)[1]].parameters():
                p.add_(0.5)
    for module in modules.values():
        _tensor_parallel(module, tp_mesh, with_loss_parallel)
        if dp_mesh is not None:  # FSDP2 over TP: parameters sharded on both mesh dimensions
            from torch.distributed.fsdp import fully_shard

            for layer in module.layers.values():
                fully_shard(layer, mesh=dp_mesh)
            fully_shard(module, mesh=dp_mesh)
    stages = [PipelineStage(modules[s], s, place.num_stages, torch.device("cpu"), group=pp_group)
              for s in place.stages_of(pp_rank)]
    return reference, modules, SCHEDULES[schedule](stages, n, loss_fn=lm_loss, **kwargs), place


def tp_numerics(schedule: str, n: int, with_loss_parallel: bool, fsdp: bool = False, steps: int = 2,
                **kwargs) -> dict:
    """``steps`` training steps with Adam between on a pp 2 x tp 2 mesh (``fsdp``: pp 2 x dp 1 x
    tp 2, FSDP2 over dp): every microbatch loss and every gradient (sharded ones gathered) equal
    the reference's on every rank."""
    shape, names = ((2, 1, 2), ("pp", "dp", "tp")) if fsdp else ((2, 2), ("pp", "tp"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    pp_group, pp_rank, tp_mesh = mesh["pp"].get_group(), mesh["pp"].get_local_rank(), mesh["tp"]
    reference, modules, sched, place = _build(schedule, 2, n, pp_group, pp_rank, tp_mesh, with_loss_parallel,
                                              dp_mesh=mesh["dp"] if fsdp else None, **kwargs)
    opt = torch.optim.Adam([p for m in modules.values() for p in m.parameters()], lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    ref_names = dict(reference.named_parameters())
    result = {"rank": dist.get_rank(), "losses_checked": 0, "grads_checked": 0, "sharded_grads": 0,
              "dtensor_losses": 0, "grad_err": 0.0}
    for step in range(steps):
        x, y = batch(step, n)
        losses: list = []
        with loss_parallel() if with_loss_parallel else contextlib.nullcontext():
            sched.step(x, target=y, losses=losses) if place.feeds_batch(pp_rank) else sched.step()
        want = reference_step(reference, x, y, n, scale_grads=True)
        if losses:
            result["dtensor_losses"] += sum(type(l).__name__ == "DTensor" for l in losses)
            got = [full(l).item() for l in losses]
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=ATOL)
            result["losses_checked"] += len(got)
        for s, module in modules.items():
            for name, p in module.named_parameters():
                assert p.grad is not None, f"step {step}: stage {s} {name} has no gradient"
                got = full(p.grad)
                result["sharded_grads"] += got is not p.grad
                torch.testing.assert_close(got, ref_names[name].grad, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"step {step}: stage {s} {name}: {m}")
                result["grad_err"] = max(result["grad_err"], (got - ref_names[name].grad).abs().max().item())
                result["grads_checked"] += 1
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    if place.bidirectional:
        result["twin_parts"] = twins_identical(modules, place, pp_group)
    return result
