"""Cases run on every rank of a 4-rank WorkerPool: the communication an expert-parallel x pipeline
MoE step posts, recorded for the NCCL model (:mod:`titan_dualpipe.orders.nccl_model`).

Mesh ``pp=2 x ep=2`` as in :mod:`overlap_cases`. Three MoE modules, each run with overlap on:

- ``ours``: our MoE module with its overlap protocol (exchanges: ``dist.all_to_all_single``);
- ``relay``: the same module without the protocol, its pairs run as a relay (the backward half
  on a helper thread);
- ``titan``: torchtitan's own MoE layer (0.2.2 ``models.moe.MoE``, float32 experts, its
  ``ExpertParallel`` token dispatch and combine) with :mod:`titan_dualpipe.titan.expert_overlap`
  installed: a functional count exchange on its own communicator, read at once, then token
  exchanges with uneven splits through ``relayed_all_to_all_single``, forward on the calling
  thread and backward on the relay's helper thread.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from cases import overlap_cases
from cases.pipeline_cases import SCHEDULES, VOCAB, batch
from titan_dualpipe import placement
from titan_dualpipe.bench.overlap import RelayedMoETransformer
from titan_dualpipe.overlap.moe import MoETransformer
from titan_dualpipe.testing.model import lm_loss

TITAN_DIM, TITAN_EXPERTS, TITAN_BLOCKS_PER_PART = 16, 4, 2


def titan_moe_available() -> str:
    """Why the ``titan`` module cannot run here ('' when it can): it needs torchtitan 0.2.2's MoE."""
    try:
        from titan_dualpipe.titan import GEN
    except ImportError as err:
        return f"torchtitan is not importable: {err}"
    return "torchtitan 0.2.2's MoE layer (models.moe.MoE) is needed" if GEN.registry else ""


class TitanMoEPart(nn.Module):
    """One pipeline part: embedding (first part), pre-norm blocks ``x + MoE(norm(x))`` with
    torchtitan's MoE layer, output head (last part)."""

    def __init__(self, first: bool, last: bool) -> None:
        from torchtitan.models.moe import MoE, MoEArgs

        super().__init__()
        args = MoEArgs(num_experts=TITAN_EXPERTS, num_shared_experts=1, top_k=2, use_grouped_mm=False,
                       score_func="softmax")
        self.embed = nn.Embedding(VOCAB, TITAN_DIM) if first else None
        self.norms = nn.ModuleList(nn.RMSNorm(TITAN_DIM) for _ in range(TITAN_BLOCKS_PER_PART))
        self.moes = nn.ModuleList(MoE(args, dim=TITAN_DIM, hidden_dim=2 * TITAN_DIM)
                                  for _ in range(TITAN_BLOCKS_PER_PART))
        self.head = nn.Linear(TITAN_DIM, VOCAB) if last else None
        with torch.no_grad():  # torchtitan initialises under its trainer's no_grad
            for moe in self.moes:
                moe.init_weights(0.02, torch.device("cpu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(x) if self.head is not None else x


def _titan_modules(schedule: str, n: int) -> dict[int, nn.Module]:
    """This rank's stage modules, torchtitan's MoE experts split over the expert-parallel mesh."""
    from torchtitan.distributed.expert_parallel import ExpertParallel

    from titan_dualpipe.titan import cpu_moe, expert_overlap

    cpu_moe.enable()
    expert_overlap.install()
    topo, place = overlap_cases.topology(), placement(schedule, overlap_cases.PP, n)
    n_parts = place.num_stages if schedule == "DualPipeV" else overlap_cases.PP
    torch.manual_seed(0)  # every rank builds the same parts (twins start equal)
    parts = [TitanMoEPart(first=p == 0, last=p == n_parts - 1) for p in range(n_parts)]
    modules = {s: parts[place.model_part(s)] for s in place.stages_of(topo.pp_rank)}
    for module in modules.values():
        for moe in module.moes:
            ExpertParallel()._apply(moe.experts, topo.ep_mesh)
    expert_overlap.count_communicators(modules.values())  # as our torchtitan adapter does: before step 1
    return modules


def _build(schedule: str, n: int, module: str, pair_first: str = "forward") -> tuple[Any, dict[int, nn.Module]]:
    """The overlapped schedule of this rank and its stage modules."""
    if module != "titan":
        cls = {"ours": MoETransformer, "relay": RelayedMoETransformer}[module]
        _, modules, sched, _ = overlap_cases.build(schedule, n, overlap=True, checkpoint=False, fsdp=False,
                                                   module_cls=cls, pair_first=pair_first)
        return sched, modules
    topo, place = overlap_cases.topology(), placement(schedule, overlap_cases.PP, n)
    modules = _titan_modules(schedule, n)
    stages = [PipelineStage(modules[s], s, place.num_stages, torch.device("cpu"), group=topo.pp_group)
              for s in place.stages_of(topo.pp_rank)]
    return SCHEDULES[schedule](stages, n, loss_fn=lm_loss, overlap=True, pair_first=pair_first), modules


def recorded_moe_step(schedule: str, n: int, module: str, pair_first: str = "forward") -> dict:
    """The first training step of an EP x PP MoE pipeline under a CommRecorder: this rank's
    events, the relay's hand-overs and the functional all-to-alls it recorded; ``pair_first``: the
    schedule's (which half of a relayed pair starts)."""
    from titan_dualpipe.orders.nccl_model import Collective, Post
    from titan_dualpipe.runtime.comm_record import CommRecorder

    topo, place = overlap_cases.topology(), placement(schedule, overlap_cases.PP, n)
    sched, modules = _build(schedule, n, module, pair_first)
    x, y = batch(0, n, topo.ep_index)
    with overlap_cases._counting_hand_overs() as relays, CommRecorder() as recorder:
        losses: list = []
        sched.step(x, target=y, losses=losses) if place.feeds_batch(topo.pp_rank) else sched.step()
    all_to_alls = sum(isinstance(op, Collective) and op.name == "all_to_all_single"
                      for e in recorder.events if isinstance(e, Post) for op in e.ops)
    return {"rank": dist.get_rank(), "events": recorder.events, "hand_overs": sum(r.hand_overs for r in relays),
            "all_to_alls": all_to_alls, "moe_layer_microbatches": _moe_layer_microbatches(sched, modules),
            "ep_comm": ("group", topo.ep_group.group_name), "count_comm": _count_comm(topo.ep_group),
            "losses_finite": all(torch.isfinite(v).item() for v in losses)}


def _count_comm(ep_group: Any) -> tuple[str, str]:
    """The communicator of the token-count exchange of ``ep_group`` (its own, once made)."""
    from titan_dualpipe.overlap.count_groups import count_group

    return ("group", count_group(ep_group).group_name)


def _moe_layer_microbatches(sched: Any, modules: dict[int, nn.Module]) -> int:
    """Sum over this rank's stages of (MoE layers in the stage) x (forwards the stage runs)."""
    from titan_dualpipe.orders.lowering import leaf_actions

    forwards = [leaf.stage_index for a in sched.pipeline_order_with_comms[sched.rank]
                for leaf in leaf_actions(a) if leaf.computation_type.name == "FORWARD"]
    layers = {s: sum(type(m).__name__ == "MoE" for m in module.modules()) for s, module in modules.items()}
    return sum(layers[s] for s in forwards)


def functional_collectives_recorded() -> dict:
    """Functional collectives on the expert-parallel group under a CommRecorder: one from
    this thread (posted, waited through funcol's AsyncCollectiveTensor), a relayed exchange
    with uneven splits on another thread, and torch's autograd all-to-all (called from C++),
    forward and backward. This rank's recorded events."""
    import threading

    from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

    from titan_dualpipe.overlap.comm import relayed_all_to_all_single
    from titan_dualpipe.runtime.comm_record import CommRecorder

    group, me = overlap_cases.topology().ep_group, overlap_cases.topology().ep_index
    x = torch.arange(4.0) + dist.get_rank()
    splits = [1, 3] if me == 0 else [3, 1]  # uneven: rows sent to (and received from) EP index 0 and 1
    with CommRecorder() as recorder:
        all_to_all_single(x, None, None, group=group).wait()
        other = threading.Thread(target=lambda: relayed_all_to_all_single(x, splits, splits, group))
        other.start()
        other.join()
        out = all_to_all_single_autograd(x.clone().requires_grad_(), [2, 2], [2, 2], group)
        out = out.wait() if hasattr(out, "wait") else out
        out.sum().backward()
    return {"rank": dist.get_rank(), "events": recorder.events, "ep_comm": ("group", group.group_name),
            "ep_members": tuple(dist.get_process_group_ranks(group))}
