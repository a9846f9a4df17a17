"""Cases run on every rank of a 4-rank WorkerPool: the MoE stage module in DualPipe(V).

Mesh ``pp=2 x ep=2``: the two ranks of a pipeline rank form an expert-parallel pair
(each keeps half of the experts) and feed different data shards, so they are also data
parallel for everything but the experts. The reference is one process running the full
model (all experts) on both shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from datetime import timedelta
from functools import lru_cache
from typing import Any, Iterator, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from cases.pipeline_cases import ATOL, RTOL, SCHEDULES, _full, batch, reference_step
from titan_dualpipe import placement
from titan_dualpipe._compat.stage_init import runnable_on_gloo
from titan_dualpipe.bench.overlap import RelayedMoETransformer
from titan_dualpipe.overlap import moe as moe_module
from titan_dualpipe.overlap import pair as pair_module
from titan_dualpipe.overlap import relay as relay_module
from titan_dualpipe.overlap.comm import EmulatedNetwork, ExpertParallelComm
from titan_dualpipe.cut import cut_layers
from titan_dualpipe.overlap.moe import MoEArgs, MoETransformer, expert_parallel
from titan_dualpipe.overlap.pair_first import FORWARD_BACKWARD
from titan_dualpipe.testing.model import compile_blocks
from titan_dualpipe.testing.model import lm_loss

PP, EP = 2, 2
# Process-group timeout of the pool and of the groups below: how long ranks wait for a
# peer that died (a device mesh's groups would get gloo's default of 30 minutes).
GROUP_TIMEOUT_S = 20
# Compiled blocks compile at the first step's shape exchange, a few seconds each, while the peer
# waits: on a loaded 2-core machine that took more than 20 s. Their pipelines get groups of their own.
COMPILE_GROUP_TIMEOUT_S = 120
ARGS = MoEArgs(vocab_size=64, dim=16, n_layers=4, n_heads=2, num_experts=4, top_k=2, moe_inter_dim=32,
               capacity_factor=1.0)


class Topology(NamedTuple):
    pp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    ep_mesh: Any  # 1-D DeviceMesh over ep_group, for FSDP
    pp_rank: int
    ep_index: int


@lru_cache(maxsize=None)
def topology(timeout_s: float = GROUP_TIMEOUT_S) -> Topology:
    """Rank ``r`` is pipeline rank ``r // EP`` and expert-parallel index ``r % EP``; groups that
    give up on a silent peer after ``timeout_s`` (made once per timeout, on every rank)."""
    from torch.distributed.device_mesh import DeviceMesh

    rank, timeout = dist.get_rank(), timedelta(seconds=timeout_s)
    ep_groups = [dist.new_group([p * EP + e for e in range(EP)], timeout=timeout) for p in range(PP)]
    pp_groups = [dist.new_group([p * EP + e for p in range(PP)], timeout=timeout) for e in range(EP)]
    pp_rank, ep_index = divmod(rank, EP)
    ep_mesh = DeviceMesh.from_group(ep_groups[pp_rank], "cpu", mesh_dim_names=("ep",))
    return Topology(pp_groups[ep_index], ep_groups[pp_rank], ep_mesh, pp_rank, ep_index)


def _is_expert(name: str) -> bool:
    return ".moe.experts." in name


def build(schedule: str, n: int, *, overlap: bool, checkpoint: bool | str, fsdp: bool, module_cls: type = MoETransformer,
          schedule_cls: Any = None, compile_backend: str | None = None, two_batch: bool = False,
          reshard_after_forward: bool | None = None, weight_gemms_in_flight: bool = True, exchange_chunks: int = 1,
          pair_first: str = "forward", lone_pairs: bool = False) -> tuple[nn.Module, dict[int, nn.Module], Any, ExpertParallelComm]:
    """Reference model, this rank's stage modules and schedule (same init on every call);
    ``compile_backend``: the blocks of both compiled in place; ``exchange_chunks``: both models'."""
    topo = topology(COMPILE_GROUP_TIMEOUT_S) if compile_backend else topology()  # topology() is the others' key
    place = placement(schedule, PP, n)
    torch.manual_seed(0)
    reference = module_cls(dataclasses.replace(ARGS, exchange_chunks=exchange_chunks), activation_checkpoint=checkpoint)
    n_parts = place.num_stages if schedule == "DualPipeV" else PP
    parts = cut_layers(reference, n_parts)
    comm = ExpertParallelComm(topo.ep_group)
    modules = {s: parts[place.model_part(s)] for s in place.stages_of(topo.pp_rank)}
    for module in modules.values():
        expert_parallel(module, comm)
    for module in [*modules.values(), reference] if compile_backend else ():
        compile_blocks(module.layers.values(), compile_backend)  # before FSDP, as torchtitan
    if fsdp:
        _shard_all_but_experts(modules.values(), topo.ep_mesh, reshard_after_forward)
    stages = [PipelineStage(modules[s], s, place.num_stages, torch.device("cpu"), group=topo.pp_group)
              for s in place.stages_of(topo.pp_rank)]
    if schedule_cls is not None:
        sched = runnable_on_gloo(schedule_cls(stages, n, loss_fn=lm_loss))
    else:
        sched = SCHEDULES[schedule](stages, n, loss_fn=lm_loss, overlap=overlap, two_batch_overlap=two_batch,
                                    weight_gemms_in_flight=weight_gemms_in_flight, pair_first=pair_first,
                                    lone_pairs=lone_pairs)
    return reference, modules, sched, comm


def _shard_all_but_experts(modules, dp_mesh, reshard_after_forward: bool | None = None) -> None:
    """FSDP2 per block and per stage over the expert-parallel ranks; experts stay local."""
    from torch.distributed.fsdp import fully_shard

    for module in modules:
        experts = {p for n, p in module.named_parameters() if _is_expert(n)}
        for block in module.layers.values():
            fully_shard(block, mesh=dp_mesh, ignored_params=experts, reshard_after_forward=reshard_after_forward)
        fully_shard(module, mesh=dp_mesh, ignored_params=experts)


def _average_over_data_shards(modules: dict[int, nn.Module], fsdp: bool) -> None:
    """What a data-parallel trainer does: average the replicated weights' gradients over
    the shards (FSDP does that itself); expert gradients already sum over both shards."""
    group = topology().ep_group
    for module in modules.values():
        for name, p in module.named_parameters():
            if _is_expert(name):
                p.grad /= EP
            elif not fsdp:
                dist.all_reduce(p.grad, group=group)
                p.grad /= EP


def _reference_grad(reference: nn.Module, name: str) -> torch.Tensor:
    grad = dict(reference.named_parameters())[name].grad
    if _is_expert(name):
        local = ARGS.num_experts // EP
        e = topology().ep_index
        grad = grad[e * local:(e + 1) * local]
    return grad


def _step(sched, modules, place, x, y) -> list[float]:
    losses: list = []
    if place.feeds_batch(place.rank_of(next(iter(modules)))):
        sched.step(x, target=y, losses=losses)
    else:
        sched.step()
    return [loss.item() for loss in losses]


def moe_numerics(schedule: str, n: int, checkpoint: bool = False, fsdp: bool = False, steps: int = 2,
                 relay: bool = False, compile_backend: str | None = None, lone_pairs: bool = False) -> dict:
    """overlap=True and overlap=False: each matches the reference (losses, every gradient,
    two steps with Adam between) and the two agree bit for bit. ``relay``: the module
    without its protocol; ``compile_backend``: blocks compiled in place (the reference's too)."""
    ep_index = topology().ep_index
    place = placement(schedule, PP, n)
    module_cls = RelayedMoETransformer if relay else MoETransformer
    runs = {}
    for overlap in (True, False):
        runs[overlap] = build(schedule, n, overlap=overlap, checkpoint=checkpoint, fsdp=fsdp, module_cls=module_cls,
                              compile_backend=compile_backend, lone_pairs=lone_pairs and overlap)
    reference = runs[True][0]
    if compile_backend:  # compiled stages keep their backward whole (the default)
        from torch._dynamo.utils import counters

        assert all(r[2].weight_policy.whole_stages == set(r[1]) for r in runs.values())
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    opts = {o: torch.optim.Adam([p for mod in r[1].values() for p in mod.parameters()], lr=1e-2)
            for o, r in runs.items()}
    result = {"grad_err": 0.0, "losses_checked": 0, "bitwise_tensors": 0, "fused_pairs": 0,
              "fused_pairs_without_overlap": 0, "hand_overs": 0, "hand_overs_without_overlap": 0,
              "deferred_expert_gemms": 0, "deferred_linear_gemms": 0, "weight_gemms_in_flight": 0,
              "lone_pair_hand_overs": 0}
    for step in range(steps):
        want = _reference_losses(reference, step, n, ep_index)
        x, y = batch(step, n, ep_index)
        got: dict[bool, tuple[list[float], list[torch.Tensor]]] = {}
        for overlap, (_, modules, sched, _) in runs.items():
            with _counting_pairs() as pairs, _counting_hand_overs() as relays:
                losses = _step(sched, modules, place, x, y)
            result["fused_pairs" if overlap else "fused_pairs_without_overlap"] += len(pairs)
            result["hand_overs" if overlap else "hand_overs_without_overlap"] += sum(r.hand_overs for r in relays)
            result["lone_pair_hand_overs"] += sum(r.hand_overs for r in relays if r.kind[2] != FORWARD_BACKWARD) if overlap else 0
            result["deferred_expert_gemms"] += sched.weight_policy.queue.ran_kinds["experts"]
            result["deferred_linear_gemms"] += sched.weight_policy.queue.ran_kinds["linear"]
            result["weight_gemms_in_flight"] += sched.weight_policy.queue.ran_in_flight if overlap else 0
            got[overlap] = _checked_against_reference(modules, reference, losses, want, fsdp, overlap, step, result)
        result["bitwise_tensors"] += _bitwise_equal(got, f"step {step}: overlap")
        for opt in (*opts.values(), ref_opt):
            opt.step()
            opt.zero_grad()
    if compile_backend:
        result["compiled_frames"] = counters["frames"]["ok"]
    return result


def _checked_against_reference(modules: dict[int, nn.Module], reference: nn.Module, losses: list[float],
                               want: list[float], fsdp: bool, label: Any, step: int,
                               result: dict) -> tuple[list[float], list[torch.Tensor]]:
    """A step's losses and every gradient (averaged over the data shards) against the reference's,
    noted in ``result``; returns the losses and the raw gradients, for a bitwise comparison."""
    raw = [_full(p.grad).clone() for mod in modules.values() for p in mod.parameters()]
    _average_over_data_shards(modules, fsdp)
    result["grad_err"] = max(result["grad_err"], _check_grads(modules, reference, label, step))
    if losses:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=RTOL, atol=ATOL)
        result["losses_checked"] += len(losses)
    return losses, raw


def _bitwise_equal(got: dict[bool, tuple[list[float], list[torch.Tensor]]], label: str) -> int:
    """The runs with a switch on and off gave the same losses and gradients, bit for bit; how many tensors."""
    assert got[True][0] == got[False][0], f"{label} changed the losses"
    for a, b in zip(got[True][1], got[False][1], strict=True):
        assert torch.equal(a, b), f"{label} changed a gradient by {(a - b).abs().max().item()}"
    return len(got[True][1])


def _reference_losses(reference: nn.Module, step: int, n: int, ep_index: int) -> list[float]:
    """The reference step over every expert-parallel rank's batch (gradients averaged over them);
    this rank's losses."""
    want: list[float] = []
    for d in range(EP):
        losses_d = reference_step(reference, *batch(step, n, d), n, scale_grads=True)
        want = losses_d if d == ep_index else want
    for p in reference.parameters():
        p.grad /= EP
    return want


def _runs_on_and_off(option: str, schedule: str, n: int, on: Any = True, **kwargs) -> tuple[dict, torch.nn.Module, Any, dict]:
    """The overlapped pipeline built twice, with ``option`` ``on`` (key True) and False (the other
    ``build`` arguments as given), the reference model (the first build's), and an Adam per model."""
    runs = {k: build(schedule, n, overlap=True, **kwargs, **{option: on if k else False}) for k in (True, False)}
    reference = runs[True][0]
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    opts = {k: torch.optim.Adam([p for mod in r[1].values() for p in mod.parameters()], lr=1e-2)
            for k, r in runs.items()}
    return runs, reference, ref_opt, opts


def weight_gemms_in_flight_on_and_off(schedule: str, n: int, checkpoint: bool | str, steps: int = 2,
                                      mode: bool | str = True, latency_s: float = 0.0) -> dict:
    """The relayed MoE pipeline with weight GEMMs in flight (``mode``: True, or "fill") and without: the
    reference's losses and gradients, and bit for bit each other's (the same GEMMs, accumulated in the
    same order); ``latency_s``: every exchange takes that long (an emulated network: arrival times
    known, as fillers need)."""
    ep_index = topology().ep_index
    place = placement(schedule, PP, n)
    runs, reference, ref_opt, opts = _runs_on_and_off("weight_gemms_in_flight", schedule, n, on=mode,
                                                      checkpoint=checkpoint, fsdp=False,
                                                      module_cls=RelayedMoETransformer)
    for _, _, _, comm in runs.values() if latency_s else ():
        comm.network = EmulatedNetwork(latency_s)
    result = {"grad_err": 0.0, "bitwise_tensors": 0, "in_flight": 0, "losses_checked": 0}
    for step in range(steps):
        want = _reference_losses(reference, step, n, ep_index)
        x, y = batch(step, n, ep_index)
        got = {}
        for flying, (_, modules, sched, _) in runs.items():
            losses = _step(sched, modules, place, x, y)
            got[flying] = _checked_against_reference(modules, reference, losses, want, False, flying, step, result)
            result["in_flight"] += sched.weight_policy.queue.ran_in_flight if flying else 0
        result["bitwise_tensors"] += _bitwise_equal(got, f"step {step}: weight GEMMs in flight")
        for opt in (*opts.values(), ref_opt):
            opt.step()
            opt.zero_grad()
    return result


def chunked_exchanges_numerics(schedule: str, n: int, checkpoint: bool | str = False, fsdp: bool = False,
                               relay: bool = False, two_batch: bool = False, steps: int = 2) -> dict:
    """Overlapped pipelines with ``exchange_chunks=2`` and 1: each matches the reference, and they agree bit for
    bit (losses, every gradient, two steps with Adam between); counts the exchanges each posted, the pairs the
    module ran itself and the relays' hand-overs."""
    ep_index = topology().ep_index
    place = placement(schedule, PP, n)
    module_cls = RelayedMoETransformer if relay else MoETransformer
    runs = {chunked: build(schedule, n, overlap=True, checkpoint=checkpoint, fsdp=fsdp, module_cls=module_cls,
                           two_batch=two_batch, exchange_chunks=2 if chunked else 1) for chunked in (True, False)}
    reference = runs[True][0]
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    opts = {k: torch.optim.Adam([p for mod in r[1].values() for p in mod.parameters()], lr=1e-2)
            for k, r in runs.items()}
    result: dict[str, Any] = {"grad_err": 0.0, "bitwise_tensors": 0, "losses_checked": 0,
                              "posted": {1: 0, 2: 0}, "fused_pairs": {1: 0, 2: 0}, "hand_overs": {1: 0, 2: 0}}
    for step in range(steps):
        want = _reference_losses(reference, step, n, ep_index)
        x, y = batch(step, n, ep_index)
        got = {}
        for chunked, (_, modules, sched, comm) in runs.items():
            k = 2 if chunked else 1
            comm.stats.reset()
            with _counting_pairs() as pairs, _counting_hand_overs() as relays:
                losses = _step(sched, modules, place, x, y)
            result["posted"][k] += comm.stats.posted
            result["fused_pairs"][k] += len(pairs)
            result["hand_overs"][k] += sum(r.hand_overs for r in relays)
            got[chunked] = _checked_against_reference(modules, reference, losses, want, fsdp, chunked, step, result)
        result["bitwise_tensors"] += _bitwise_equal(got, f"step {step}: exchange_chunks=2")
        for opt in (*opts.values(), ref_opt):
            opt.step()
            opt.zero_grad()
    return result


def two_batch_numerics(schedule: str, n: int, checkpoint: bool = False, fsdp: bool = False, relay: bool = False,
                       steps: int = 2) -> dict:
    """Two-batch overlap on (``True``: the stages with exchanges, here all) against the reference and against the
    same pipeline with it off: losses and every gradient, two steps with Adam between; counts
    the microbatches split, the halves the module interleaved itself and the relays' hand-overs."""
    from titan_dualpipe.overlap import sub_batches as sub_batches_module

    ep_index = topology().ep_index
    place = placement(schedule, PP, n)
    module_cls = RelayedMoETransformer if relay else MoETransformer
    runs, reference, ref_opt, opts = _runs_on_and_off("two_batch", schedule, n, checkpoint=checkpoint, fsdp=fsdp,
                                                      module_cls=module_cls)
    result = {"grad_err": 0.0, "split_vs_whole": 0.0, "losses_checked": 0, "split": 0, "fused_halves": 0,
              "halves_hand_overs": 0, "two_batch_stages": sorted(runs[True][2].two_batch_stages)}
    joins, relays, fused = [], [], []
    real_join, real_relay = sub_batches_module.join_sub_batches, sub_batches_module.run_relayed
    real_fused = MoETransformer.overlapped_sub_batches_forward.__func__, MoETransformer.overlapped_sub_batches_backward.__func__

    def counted_join(outputs, sizes):
        joins.append(sizes)
        return real_join(outputs, sizes)

    def counted_relay(first, second):
        relays.append(real_relay(first, second))
        return relays[-1]

    sub_batches_module.join_sub_batches, sub_batches_module.run_relayed = counted_join, counted_relay
    MoETransformer.overlapped_sub_batches_forward = classmethod(lambda c, m, h: fused.append(1) or real_fused[0](c, m, h))
    MoETransformer.overlapped_sub_batches_backward = classmethod(lambda c, m, h: fused.append(1) or real_fused[1](c, m, h))
    try:
        for step in range(steps):
            want = _reference_losses(reference, step, n, ep_index)
            x, y = batch(step, n, ep_index)
            grads = {}
            for split, (_, modules, sched, _) in runs.items():
                losses = _step(sched, modules, place, x, y)
                _average_over_data_shards(modules, fsdp)
                result["grad_err"] = max(result["grad_err"], _check_grads(modules, reference, split, step))
                if losses:
                    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=RTOL, atol=ATOL)
                    result["losses_checked"] += len(losses)
                grads[split] = [_full(p.grad).clone() for mod in modules.values() for p in mod.parameters()]
                if split:
                    result["deferred"] = sorted(sched.weight_policy.queue.ran_microbatches)  # (stage, mb) whose W ran GEMMs
            for a, b in zip(grads[True], grads[False], strict=True):
                result["split_vs_whole"] = max(result["split_vs_whole"], (a - b).abs().max().item())
            for opt in (*opts.values(), ref_opt):
                opt.step()
                opt.zero_grad()
    finally:
        sub_batches_module.join_sub_batches, sub_batches_module.run_relayed = real_join, real_relay
        MoETransformer.overlapped_sub_batches_forward = classmethod(real_fused[0])
        MoETransformer.overlapped_sub_batches_backward = classmethod(real_fused[1])
    result.update(split=len(joins), fused_halves=len(fused), halves_hand_overs=sum(r.hand_overs for r in relays),
                  relayed_halves=len(relays))
    return result


def two_batch_measured(schedule: str, n: int, relay: bool = False, bias: dict[int, float] | None = None,
                       steps: int = 7) -> dict:
    """``two_batch_overlap="measured"`` on the MoE pipeline (every stage posts exchanges) against the
    reference, ``steps`` steps with Adam between: losses and gradients at RTOL/ATOL each step; per
    step, the stages the schedule split and the microbatches joined from sub-batches; the choice and
    its savings. ``bias``: seconds added per stage to what the split steps' lone actions took (so a
    test can make splitting lose, or win, on chosen stages)."""
    from titan_dualpipe.overlap import sub_batches as sub_batches_module
    from titan_dualpipe.runtime.two_batch_choice import MeasuredTwoBatch

    ep_index = topology().ep_index
    place = placement(schedule, PP, n)
    module_cls = RelayedMoETransformer if relay else MoETransformer
    reference, modules, sched, _ = build(schedule, n, overlap=True, checkpoint=False, fsdp=False,
                                         module_cls=module_cls, two_batch="measured")
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    opt = torch.optim.Adam([p for mod in modules.values() for p in mod.parameters()], lr=1e-2)
    choice = sched.two_batch_choice
    result = {"grad_err": 0.0, "losses_checked": 0, "split_stages": [], "joins": [],
              "candidates": sorted(choice.candidates)}
    joins: list = []
    real_join, real_decide = sub_batches_module.join_sub_batches, MeasuredTwoBatch._decide

    def counted_join(outputs, sizes):
        joins.append(sizes)
        return real_join(outputs, sizes)

    def biased_decide(self, seconds, splits):
        biased = [{s: step.get(s, 0.0) + (bias or {}).get(s, 0.0) * (i % 2) for s in self.candidates}
                  for i, step in enumerate(seconds)]  # the split steps' only
        return real_decide(self, biased, splits)

    sub_batches_module.join_sub_batches, MeasuredTwoBatch._decide = counted_join, biased_decide
    try:
        for step in range(steps):
            want = _reference_losses(reference, step, n, ep_index)
            x, y = batch(step, n, ep_index)
            result["split_stages"].append(sorted(choice.stages(True)))
            before = len(joins)
            losses = _step(sched, modules, place, x, y)
            result["joins"].append(len(joins) - before)
            _average_over_data_shards(modules, False)
            result["grad_err"] = max(result["grad_err"], _check_grads(modules, reference, True, step))
            if losses:
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=RTOL, atol=ATOL)
                result["losses_checked"] += len(losses)
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
    finally:
        sub_batches_module.join_sub_batches, MeasuredTwoBatch._decide = real_join, real_decide
    result.update(chosen=sorted(choice.chosen), chosen_everywhere=sorted(choice.chosen_everywhere),
                  savings=choice.savings, two_batch_stages=sorted(sched.two_batch_stages))
    return result


@contextlib.contextmanager
def _counting_pairs() -> Iterator[list]:
    """Count the pairs the MoE module ran itself (each interleaves one forward and one backward)."""
    calls: list = []
    real = moe_module.interleave

    def counted(first, second, **kwargs):
        calls.append(1)
        return real(first, second, **kwargs)

    moe_module.interleave = counted
    try:
        yield calls
    finally:
        moe_module.interleave = real


@contextlib.contextmanager
def _counting_hand_overs() -> Iterator[list]:
    """Collect the relays of the pairs run as relays (each counts its switches of half)."""
    relays: list = []
    real = pair_module.run_relayed

    def recorded(forward_half, backward_half, *args, **kwargs):
        done = real(forward_half, backward_half, *args, **kwargs)
        relays.append(done)
        return done

    pair_module.run_relayed = recorded
    try:
        yield relays
    finally:
        pair_module.run_relayed = real


def pair_first_numerics(schedule: str, n: int, mode: str, latency_s: float = 0.0, steps: int = 3,
                        keep_first_turns: bool = False, checkpoint: bool = False, lone_pairs: bool = False) -> dict:
    """The relayed MoE pipeline with ``pair_first=mode`` and with the forward first: each the
    reference's losses and gradients, and each other's bit for bit, over ``steps`` steps with Adam
    between; ``latency_s``: every exchange takes that long (an emulated network: times known, as
    "measured" needs). Returns, per step, how many relays ran backward first and how many hand-overs
    kept the turn, and under "measured" the order chosen per kind after the second step (its first
    half and plan, compared across ranks by the test). ``keep_first_turns``: each plan "measured"
    decides is then made to keep every half's turn at its first hand-over; ``checkpoint``: every
    block under activation checkpointing, the reference's too; ``lone_pairs``: both runs pair their
    lone actions (``lone_relays`` counts the relays of those pairs)."""
    ep_index = topology().ep_index
    place = placement(schedule, PP, n)
    runs = {first: build(schedule, n, overlap=True, checkpoint=checkpoint, fsdp=False, module_cls=RelayedMoETransformer,
                         pair_first=first, lone_pairs=lone_pairs) for first in (mode, "forward")}
    reference = runs[mode][0]
    for _, _, _, comm in runs.values() if latency_s else ():
        comm.network = EmulatedNetwork(latency_s)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    opts = [torch.optim.Adam([p for mod in r[1].values() for p in mod.parameters()], lr=1e-2) for r in runs.values()]
    result: dict[str, Any] = {"grad_err": 0.0, "bitwise_tensors": 0, "losses_checked": 0, "first": [], "chosen": None,
                              "mismatched_relays": 0, "kept_turns": [], "lone_relays": 0}
    order = runs[mode][2].pair_order
    if keep_first_turns:
        decide = order._decide

        def decide_then_keep_first_turns(pairs: list) -> None:
            decide(pairs)
            order.orders = {kind: dataclasses.replace(o, plan=tuple((False, *half[1:]) if half else half
                                                                    for half in o.plan or ((True,), (True,))))
                            for kind, o in order.orders.items()}

        order._decide = decide_then_keep_first_turns
    for step in range(steps):
        want = _reference_losses(reference, step, n, ep_index)
        x, y = batch(step, n, ep_index)
        got = {}
        for first, (_, modules, sched, _) in runs.items():
            chosen = dict(order.orders or {}) if first == mode else {}
            with _counting_hand_overs() as relays:
                losses = _step(sched, modules, place, x, y)
            got[first == mode] = _checked_against_reference(modules, reference, losses, want, False, first, step,
                                                             result)
            if first == mode:
                result["first"].append(sum(r.first for r in relays))  # relays that ran backward first
                result["kept_turns"].append(sum(not switch for r in relays for half in r.plan or () for switch in half))
                for r in relays:
                    kind = chosen.get(r.kind)
                    lone = r.kind[2] != FORWARD_BACKWARD
                    expected = ((1, None) if mode == "backward" and not lone else (0, None) if kind is None
                                else (kind.first, kind.plan))
                    result["mismatched_relays"] += (r.first, r.plan) != expected
                    result["lone_relays"] += lone
        result["bitwise_tensors"] += _bitwise_equal(got, f"step {step}: pair_first={mode}")
        for opt in (*opts, ref_opt):
            opt.step()
            opt.zero_grad()
    if order.orders is not None:
        result["chosen"] = sorted((kind, o.first, o.plan) for kind, o in order.orders.items())
        result["savings"] = sorted(order.savings.items())
    return result


def _check_grads(modules, reference, overlap: bool, step: int) -> float:
    worst = 0.0
    for s, module in modules.items():
        for name, p in module.named_parameters():
            assert p.grad is not None, f"overlap={overlap} step {step}: stage {s} {name} has no gradient"
            got, want = _full(p.grad), _reference_grad(reference, name)
            where = f"overlap={overlap} step {step} stage {s} {name}"
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda msg, where=where: f"{where}: {msg}")
            worst = max(worst, (got - want).abs().max().item())
    return worst


def torch_schedule_numerics(name: str, n: int) -> dict:
    """The module under torch's own V schedules (split input/weight backward) matches the reference."""
    from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleZBVZeroBubble

    cls = {"torch DualPipeV": ScheduleDualPipeV, "ZBVZeroBubble": ScheduleZBVZeroBubble}[name]
    ep_index = topology().ep_index
    reference, modules, sched, _ = build("DualPipeV", n, overlap=False, checkpoint=True, fsdp=False, schedule_cls=cls)
    for d in range(EP):
        reference_step(reference, *batch(0, n, d), n, scale_grads=True)
    for p in reference.parameters():
        p.grad /= EP
    losses: list = []
    if 0 in modules:
        sched.step(*batch(0, n, ep_index)[:1], target=batch(0, n, ep_index)[1], losses=losses)
    else:
        sched.step()
    _average_over_data_shards(modules, fsdp=False)
    return {"grad_err": _check_grads(modules, reference, overlap=False, step=0), "losses": len(losses)}


class InjectedFailure(RuntimeError):
    pass


class FailingMoETransformer(MoETransformer):
    """Raises in the forward half of its first overlapped pair, after that half's first
    dispatch exchange was posted and waited (so the peer is mid-pair too)."""

    inject = False
    _armed = False

    @classmethod
    def overlapped_forward_backward(cls, forward_module, *args):
        forward_module._armed = forward_module.inject
        return super().overlapped_forward_backward(forward_module, *args)

    def forward_steps(self, x):
        steps = super().forward_steps(x)
        if not self._armed:
            return (yield from steps)
        yield next(steps)
        raise InjectedFailure(f"injected failure in the forward half of a pair on rank {dist.get_rank()}")


class FailingRelayedMoETransformer(RelayedMoETransformer):
    """Raises in the backward half of its first relayed pair, when the gradient of the
    stage input is computed: after that half's exchanges were posted and waited."""

    inject = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inject and x.requires_grad:
            x.register_hook(self._fail_once)
        return super().forward(x)

    def _fail_once(self, grad: torch.Tensor) -> None:
        if self.inject and relay_module._active is not None:
            self.inject = False
            raise InjectedFailure(f"injected failure in the backward half of a pair on rank {dist.get_rank()}")


def failure_in_pair(n: int = 4, relay: bool = False) -> dict:
    """Rank 0 raises inside a pair; report what each rank raised and after how long."""
    place = placement("DualPipeV", PP, n)
    module_cls = FailingRelayedMoETransformer if relay else FailingMoETransformer
    _, modules, sched, _ = build("DualPipeV", n, overlap=True, checkpoint=False, fsdp=False, module_cls=module_cls)
    for module in modules.values():
        module.inject = dist.get_rank() == 0
    x, y = batch(0, n, topology().ep_index)
    start = time.monotonic()
    try:
        _step(sched, modules, place, x, y)
    except Exception as err:  # noqa: BLE001 - the test inspects what each rank raised
        chain, cause = [], err
        while cause is not None:
            chain.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__ or cause.__context__
        return {"raised": True, "chain": chain, "elapsed_s": time.monotonic() - start}
    return {"raised": False, "elapsed_s": time.monotonic() - start}


@contextlib.contextmanager
def _logged_messages(name: str) -> Iterator[list[str]]:
    """Messages logged to logger ``name`` inside the block."""
    import logging

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def relayed_all_to_all_matches_torch() -> dict:
    """relayed_all_to_all_single == torch's all_to_all_single_autograd, forward and backward,
    with uneven splits, bit for bit; also when traced into a compiled graph (twice: said once)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    from titan_dualpipe.overlap.comm import relayed_all_to_all_single, warn_once_if_exchange_traced

    group, me = topology().ep_group, topology().ep_index
    send = [1 + me, 3 - me]  # rows this rank sends to EP index 0 and 1
    recv = [[1, 2], [3, 2]][me]  # what EP index 0 and 1 send here
    torch.manual_seed(10 + dist.get_rank())
    x = torch.randn(sum(send), 5, requires_grad=True)
    weight = torch.randn(sum(recv), 5)
    traced = torch.compile(relayed_all_to_all_single, backend="aot_eager", fullgraph=True)
    results = []
    with _logged_messages("titan_dualpipe") as warnings:
        told = [warn_once_if_exchange_traced()]  # nothing traced yet
        for fn in (relayed_all_to_all_single, all_to_all_single_autograd, traced, traced):
            out = fn(x, recv, send, group)
            out = out.wait() if hasattr(out, "wait") else out
            (grad,) = torch.autograd.grad((out * weight).sum(), x)
            results.append((out.detach().clone(), grad))
            told.append(warn_once_if_exchange_traced())
    (a, ga), *others = results  # ours; then torch's, and ours traced into a compiled graph (twice)
    return {"forward_equal": all(torch.equal(a, b) for b, _ in others),
            "backward_equal": all(torch.equal(ga, gb) for _, gb in others), "rows": a.shape[0],
            "told": told, "warnings": [m for m in warnings if "inside a torch.compile'd graph" in m]}


def relayed_exchange_emulated_cost(seconds: float = 0.2) -> dict:
    """An emulated network cost on relayed exchanges: alone, each exchange takes ``seconds`` and
    all of it is exposed; as the forward half of a relayed pair whose backward half computes
    meanwhile, the cost hides behind that compute. Same bits either way."""
    from titan_dualpipe.overlap.comm import emulate_relayed_exchanges, relayed_all_to_all_single
    from titan_dualpipe.overlap.relay import run_relayed

    group = topology().ep_group
    x = torch.arange(8.0).reshape(4, 2) + dist.get_rank()
    plain = relayed_all_to_all_single(x, None, None, group)
    cost = emulate_relayed_exchanges(seconds)
    try:
        start = time.perf_counter()
        alone = relayed_all_to_all_single(x, None, None, group)
        alone_s, alone_exposed = time.perf_counter() - start, cost.stats.waited_s
        got: list = []

        def busy() -> None:  # the partner half: compute for most of the exchange's cost
            end = time.perf_counter() + 0.75 * seconds
            while time.perf_counter() < end:
                torch.ones(64, 64) @ torch.ones(64, 64)

        start = time.perf_counter()
        run_relayed(lambda: got.append(relayed_all_to_all_single(x, None, None, group)), busy)
        paired_s, paired_exposed = time.perf_counter() - start, cost.stats.waited_s - alone_exposed
    finally:
        emulate_relayed_exchanges(None)
    return {"alone_s": alone_s, "alone_exposed": alone_exposed, "paired_s": paired_s,
            "paired_exposed": paired_exposed, "posted": cost.stats.posted,
            "same_bits": torch.equal(plain, alone) and torch.equal(plain, got[0])}



class WholeBlocksMoETransformer(RelayedMoETransformer):
    """Calls each block whole (as torchtitan's blocks run): a relayed half hands over inside a
    block's call, at its exchanges, so both halves are inside one FSDP2 module at once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h)) if self.output is not None else h


def two_batch_all_gathers(schedule: str, n: int, relay: bool = False, checkpoint: bool = False, steps: int = 2,
                          whole_blocks: bool = False, reshard_after_forward: bool | None = None) -> dict:
    """FSDP2's all-gathers per step with two-batch overlap on and off (each run with overlapped
    pairs), and the largest difference of their gradients; a split microbatch should gather
    each block once per call, as the whole one does. ``whole_blocks``: relayed, blocks called
    whole (:class:`WholeBlocksMoETransformer`); ``reshard_after_forward``: the blocks' setting."""
    from titan_dualpipe.orders.nccl_model import Collective, Post
    from titan_dualpipe.runtime.comm_record import CommRecorder

    ep_index = topology().ep_index
    place = placement(schedule, PP, n)
    module_cls = WholeBlocksMoETransformer if whole_blocks else RelayedMoETransformer if relay else MoETransformer
    counts: dict[str, list[int]] = {}
    grads: dict[str, list[torch.Tensor]] = {}
    for split in (True, False):
        _, modules, sched, _ = build(schedule, n, overlap=True, checkpoint=checkpoint, fsdp=True,
                                     module_cls=module_cls, two_batch=split,
                                     reshard_after_forward=reshard_after_forward)
        counts["split" if split else "whole"] = per_step = []
        grads["split" if split else "whole"] = kept = []
        for step in range(steps):
            x, y = batch(step, n, ep_index)
            with CommRecorder() as recorder:
                _step(sched, modules, place, x, y)
            per_step.append(sum(1 for e in recorder.events if isinstance(e, Post)
                                for op in e.ops if isinstance(op, Collective) and "all_gather" in op.name))
            kept += [_full(p.grad).clone() for mod in modules.values() for p in mod.parameters()]
            for module in modules.values():
                module.zero_grad()
    diff = max((a - b).abs().max().item() for a, b in zip(grads["split"], grads["whole"], strict=True))
    return {**counts, "split_vs_whole": diff}
