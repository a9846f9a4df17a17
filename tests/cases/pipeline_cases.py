"""Cases run on every rank of a WorkerPool: pipelined training vs a single-process reference."""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from titan_dualpipe import placement
from titan_dualpipe._compat.pipelining import forward_states
from titan_dualpipe.testing.memory import LiveTensorBytes
from titan_dualpipe.check.numerics import (  # noqa: F401 - shared with the test modules
    ATOL, MB_SIZE, RTOL, SCHEDULES, SEQ, VOCAB, batch, full as _full, grad_error as _check_grads, reference_step,
    train_and_compare,
)
from titan_dualpipe.check import numerics as _numerics
from titan_dualpipe.testing.model import TinyLM, lm_loss

from cases.layout import pipeline_layout, pipeline_ranks


def _from_csv(cls, csv_format: str):
    """A schedule factory that replaces the computed order with one loaded from our CLI's CSV."""

    def build(stages, n, **kwargs):
        from titan_dualpipe.cli import main as cli_main

        sched = cls(stages, n, **kwargs)
        place = placement(cls.schedule_name, stages[0].group_size, n)
        path = os.path.join(tempfile.mkdtemp(), f"order_rank{dist.get_rank()}.csv")
        cli_main(["csv", "--schedule", place.schedule, "--pp", str(place.pp_size), "--microbatches", str(n),
                  "--format", csv_format, "-o", path])
        sched._load_csv(path, format=csv_format)
        return sched

    return build


def _torch_runtime_from_csv(stages, n, **kwargs):
    """torch's own ``_PipelineScheduleRuntime`` running our DualPipeV compute_only CSV."""
    from titan_dualpipe._compat.pipelining import _PipelineScheduleRuntime
    from titan_dualpipe._compat.stage_init import runnable_on_gloo
    from titan_dualpipe.cli import main as cli_main

    pp = stages[0].group_size
    path = os.path.join(tempfile.mkdtemp(), f"order_rank{dist.get_rank()}.csv")
    cli_main(["csv", "--schedule", "DualPipeV", "--pp", str(pp), "--microbatches", str(n), "-o", path])
    sched = runnable_on_gloo(_PipelineScheduleRuntime(stages, n, **kwargs))
    sched._load_csv(path)
    return sched


RUNTIMES = {
    "ours": lambda schedule: SCHEDULES[schedule],
    "ours_csv_compute_only": lambda schedule: _from_csv(SCHEDULES[schedule], "compute_only"),
    "ours_csv_compute_comms": lambda schedule: _from_csv(SCHEDULES[schedule], "compute_comms"),
    "torch_csv": lambda schedule: _torch_runtime_from_csv,
}


def build_pipeline(schedule: str, pp: int, n: int, group, pp_rank: int, *, runtime: str = "ours", **kwargs):
    """Reference model, this rank's two stage modules, and the schedule (built by ``runtime``)."""
    return _numerics.build_pipeline(schedule, pp, n, group, pp_rank, factory=RUNTIMES[runtime](schedule), **kwargs)


def numerics(schedule: str, pp: int, n: int, *, defer_pp_recv: bool = False, fsdp: bool = False,
             runtime: str = "ours", **kwargs) -> dict | None:
    """Two training steps with an optimizer step between, checked against a reference.

    ``fsdp``: a pp x (world / pp) mesh with FSDP2 over the second dimension; otherwise the
    first ``pp`` ranks (the others return None)."""
    if (layout := pipeline_layout(pp, fsdp)) is None:
        return None
    group, pp_rank, dp_mesh, dp_index = layout
    if dp_mesh is not None:
        kwargs.update(fsdp_mesh=dp_mesh, dp_index=dp_index, dp_size=dp_mesh.size())
    if defer_pp_recv:
        kwargs["defer_pp_recv"] = True
    kwargs.setdefault("factory", RUNTIMES[runtime](schedule))
    return train_and_compare(schedule, pp, n, group, pp_rank, **kwargs)


def schedules_over_shared_modules(schedule: str, pp: int, n: int) -> dict | None:
    """Three schedules over the same stage modules: deferring (the first built and the last),
    and torch's split. Each one's step, in the order A, split, A, B, defers its weight GEMMs (or
    not) and matches the reference. By stepped schedule: the worst gradient error and the GEMMs
    its W ran from its own queue."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    reference, modules, first = build_pipeline(schedule, pp, n, group, rank)
    place = first.placement

    def built(**kwargs):
        stages = [PipelineStage(modules[s], s, place.num_stages, "cpu", group=group) for s in place.stages_of(rank)]
        return SCHEDULES[schedule](stages, n, loss_fn=lm_loss, **kwargs)

    schedules = {"A": first, "split": built(weight_gradients="split"), "B": built()}
    x, y = batch(0, n)
    out: dict[str, list] = {"grad_err": [], "deferred_gemms": []}
    for name in ("A", "split", "A", "B"):
        for model in (reference, *modules.values()):
            model.zero_grad(set_to_none=True)
        sched = schedules[name]
        sched.step(x, target=y) if place.feeds_batch(rank) else sched.step()
        reference_step(reference, x, y, n, scale_grads=True)
        out["grad_err"].append((name, _check_grads(modules, reference, f"{name} over shared modules")))
        out["deferred_gemms"].append((name, sum(sched.weight_policy.queue.ran.values())))
    return out


def eval_matches_reference(schedule: str, pp: int, n: int, **schedule_kwargs) -> dict | None:
    """eval(): forward only, outputs and losses equal the reference forward."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    reference, modules, sched = build_pipeline(schedule, pp, n, group, rank, **schedule_kwargs)
    place = sched.placement
    x, y = batch(0, n)
    losses: list = []
    out = sched.eval(x, target=y, losses=losses) if place.feeds_batch(rank) else sched.eval()  # torch's default
    return {"outputs_checked": _check_eval(reference, place, modules, x, y, n, out, losses)}


def _check_eval(reference, place, modules: dict, x, y, n: int, out, losses: list) -> int:
    """eval()'s outputs and losses against the reference forward; how many microbatches' outputs
    this rank checked (those whose last stage it holds). eval() leaves no gradients."""
    grads = [p.grad for m in modules.values() for p in m.parameters() if p.grad is not None]
    assert not grads, "eval() must not produce gradients"
    with torch.no_grad():
        ref_out = torch.cat([reference(xm) for xm in x.chunk(n)])
        ref_losses = [lm_loss(reference(xm), ym).item() for xm, ym in zip(x.chunk(n), y.chunk(n))]
    if not any(place.is_last(s) for s in modules):
        return 0
    torch.testing.assert_close(torch.tensor([l.item() for l in losses]), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    mbs = [mb for s in modules if place.is_last(s) for mb in place.microbatches(s)]
    want = torch.cat([ref_out[mb * MB_SIZE:(mb + 1) * MB_SIZE] for mb in mbs])
    torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)
    return len(mbs)


def eval_held_outputs(schedule: str, pp: int, n: int, *, two_batch: bool = False, grad: bool = False) -> dict | None:
    """eval(losses=..., return_outputs=False) on pipelines of ``n`` and ``2n`` microbatches (under
    ``torch.no_grad()`` as torchtitan's validator, or with gradients enabled): the peak bytes of a
    measured eval after a warm-up one, how many outputs every stage's ``fwd_cache`` and the step's
    two-batch halves held at its end; then eval's default (the outputs returned, as torch's), its
    peak, outputs and losses checked against the reference."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    result: dict = {"rank": rank, "logits_bytes": MB_SIZE * SEQ * VOCAB * 4}
    for key in ("peak", "peak_with_outputs", "fwd_cache", "halves", "outputs_checked", "last_microbatches"):
        result[key] = {}
    for count in (n, 2 * n):
        with contextlib.nullcontext() if grad else torch.no_grad():
            _measured_eval(schedule, pp, count, group, rank, two_batch, result)
    return result


def _measured_eval(schedule: str, pp: int, n: int, group, rank: int, two_batch: bool, result: dict) -> None:
    """One pipeline's part of :func:`eval_held_outputs`, into ``result`` by microbatch count."""
    options = {"two_batch_overlap": "all"} if two_batch else {}
    reference, modules, sched = build_pipeline(schedule, pp, n, group, rank, **options)
    place = sched.placement
    sub_batches_at_end: list[int] = []
    after_step = sched._after_step

    def watched(executor) -> None:
        sub_batches_at_end.append(len(executor.sub_batches))
        after_step(executor)

    sched._after_step = watched
    x, y = batch(0, n)

    def run(**kwargs) -> tuple:
        losses: list = []
        out = sched.eval(x, target=y, losses=losses, **kwargs) if place.feeds_batch(rank) else sched.eval()
        return out, losses

    run(return_outputs=False)  # stage shapes and receive buffers
    with LiveTensorBytes() as meter:
        out, losses = run(return_outputs=False)
    assert out is None
    result["peak"][n] = meter.peak
    result["fwd_cache"][n] = {stage.stage_index: len(forward_states(stage)) for stage in sched._stages}
    with LiveTensorBytes() as meter:
        out, kept_losses = run()
    result["peak_with_outputs"][n] = meter.peak
    result["halves"][n] = sub_batches_at_end
    result["last_microbatches"][n] = sum(len(place.microbatches(s)) for s in modules if place.is_last(s))
    result["outputs_checked"][n] = _check_eval(reference, place, modules, x, y, n, out, kept_losses)
    if result["outputs_checked"][n]:
        assert [l.item() for l in losses] == [l.item() for l in kept_losses]


def agreement_collectives(schedule: str, pp: int, n: int) -> dict | None:
    """Collectives each of two steps and two evals posts (recorded), then a step whose inputs
    changed shape: it must raise on the ranks that feed them. All-gathers per call."""
    from titan_dualpipe.runtime.comm_record import CommRecorder
    from titan_dualpipe.orders.nccl_model import Collective, Post

    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    _, modules, sched = build_pipeline(schedule, pp, n, group, rank)
    feeds = sched.placement.feeds_batch(rank)
    counts = []
    for call in ("step", "step", "eval", "eval"):
        x, y = batch(len(counts), n)
        with CommRecorder() as recorder:
            if call == "eval":
                sched.eval(x, target=y, losses=[]) if feeds else sched.eval()
            else:
                sched.step(x, target=y, losses=[]) if feeds else sched.step()
        counts.append(sum(isinstance(op, Collective) and op.name.startswith("all_gather")
                          for e in recorder.events if isinstance(e, Post) for op in e.ops))
    error = ""
    if pp == 1:  # no peer waits for this rank's traffic
        x, y = batch(9, n)
        try:
            sched.step(x[:, :-1], target=y[:, :-1])  # one token shorter
        except ValueError as err:
            error = str(err)
    return {"rank": rank, "all_gathers": counts, "changed_inputs_error": error}


def _call(sched, kind: str, form: str, x, y, n: int, feeds: bool) -> list[float]:
    """``sched.step``/``sched.eval`` with the whole batch (``form="whole"``) or its microbatches
    (``"split"``: ``arg_mbs``/``target_mbs``); the losses this rank received."""
    losses: list = []
    if not feeds:
        getattr(sched, kind)()
    elif form == "whole":
        getattr(sched, kind)(x, target=y, losses=losses)
    else:
        getattr(sched, kind)(arg_mbs=[(xm,) for xm in x.chunk(n)], target_mbs=list(y.chunk(n)), losses=losses)
    return [l.item() for l in losses]


def microbatch_forms(schedule: str, pp: int, n: int) -> dict | None:
    """Whole-batch and pre-split calls of the same microbatches, alternated in eval() and in step()
    (each form starting once): every eval gives the same losses, every step the reference's
    losses and gradients."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    reference, modules, sched = build_pipeline(schedule, pp, n, group, rank)
    place = sched.placement
    feeds, holds_last = place.feeds_batch(rank), any(place.is_last(s) for s in modules)
    x, y = batch(0, n)
    evals = [_call(sched, "eval", form, x, y, n, feeds) for form in ("whole", "split", "whole")]
    assert evals[1] == evals[0] and evals[2] == evals[0], evals
    grad_err = 0.0
    for form in ("split", "whole", "split"):
        for model in (reference, *modules.values()):
            model.zero_grad()
        losses = _call(sched, "step", form, x, y, n, feeds)
        want = reference_step(reference, x, y, n, True)
        if holds_last:
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=RTOL, atol=ATOL)
        grad_err = max(grad_err, _check_grads(modules, reference, f"step({form})"))
    return {"rank": rank, "eval_losses": len(evals[0]), "grad_err": grad_err}


def changed_microbatches(schedule: str, pp: int, n: int, group_timeout_s: float) -> dict | None:
    """An eval() with the whole batch, then one with pre-split microbatches one token shorter: what
    each rank raised (the ranks passing them at once; the others when their pipeline traffic
    fails, within the group timeout)."""
    if (ranks := pipeline_ranks(pp, timeout_s=group_timeout_s)) is None:
        return None
    group, rank = ranks
    _, _, sched = build_pipeline(schedule, pp, n, group, rank)
    feeds = sched.placement.feeds_batch(rank)
    x, y = batch(0, n)
    _call(sched, "eval", "whole", x, y, n, feeds)
    try:
        _call(sched, "eval", "split", x[:, :-1], y[:, :-1], n, feeds)
    except Exception as err:  # noqa: BLE001 - the test inspects what each rank raised
        return {"rank": rank, "feeds": feeds, "raised": f"{type(err).__name__}: {err}"}
    return {"rank": rank, "feeds": feeds, "raised": ""}


def bad_step_inputs(schedule: str, pp: int, n: int, mistake: str = "no_target") -> str | None:
    """A rank passes bad step() inputs: every rank must raise the same ValueError.

    ``no_target``: the last-stage ranks forget target=; ``batch``: the batch (and target) is not
    a multiple of n; ``halves``: DualPipe's rank pp-1 passes a smaller batch than rank 0;
    ``mixed``: whole-batch inputs together with pre-split ones; ``unsplittable``: rank 0 adds a
    keyword input with fewer rows than microbatches; ``entries``: rank 0 passes each microbatch's
    tensor as an ``arg_mbs`` entry, not in a tuple."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    _, modules, sched = build_pipeline(schedule, pp, n, group, rank)
    x, y = batch(0, n)
    place = sched.placement
    if mistake == "batch":
        x, y = x[: len(x) - MB_SIZE - 1], y[: len(y) - MB_SIZE - 1]
    elif mistake == "halves" and rank == pp - 1:
        x, y = x[: len(x) // 2], y[: len(y) // 2]
    kwargs = {} if mistake == "no_target" else {"target": y}
    if mistake == "mixed" and rank == 0:
        kwargs["arg_mbs"] = [(xm,) for xm in x.chunk(n)]
    if mistake == "unsplittable" and rank == 0:
        kwargs["mask"] = torch.ones(n - 1)
    args = (x,)
    if mistake == "entries" and rank == 0:
        args, kwargs = (), {"arg_mbs": list(x.chunk(n)), "target_mbs": list(y.chunk(n))}
    try:
        sched.step(*args, **kwargs) if place.feeds_batch(rank) else sched.step()
    except ValueError as err:
        return str(err)
    raise AssertionError(f"step() with mistake {mistake!r} did not raise")


def bad_stage_list(schedule: str, pp: int, n: int, mistake: str, only_rank: int | None = None,
                   error_kind: bool = False) -> str | None:
    """Constructor errors: raised on every rank before any pipeline traffic (``only_rank``:
    the mistake is made on that rank alone). ``error_kind``: caught as torch-style code catches
    its schedules' errors (``RuntimeError``); the class name instead of the message."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    place = placement(schedule, pp, max(n, 2 * pp + 2))
    torch.manual_seed(0)
    module = TinyLM(vocab=VOCAB, dim=16, layers=2, heads=2)
    ids = list(place.stages_of(rank))
    num_stages = place.num_stages
    if only_rank is not None and rank != only_rank:
        mistake = "none"
    if mistake == "one_stage":
        ids = ids[:1]
    elif mistake == "wrong_ids":
        ids = [rank, rank + pp] if pp > 1 else [0, 0]
    elif mistake == "same_id_twice":
        ids = [ids[1], ids[1]]
    elif mistake == "num_stages":
        num_stages = place.num_stages + 2
        ids = [rank, num_stages - 1 - rank]
    stages = [PipelineStage(copy.deepcopy(module), s, num_stages, torch.device("cpu"), group=group) for s in ids]
    try:
        SCHEDULES[schedule](stages, n, loss_fn=lm_loss)
    except (RuntimeError if error_kind else ValueError) as err:
        return type(err).__name__ if error_kind else str(err)
    raise AssertionError(f"{mistake}: constructor did not raise")


def overlap_matches_sequential(schedule: str, pp: int, n: int) -> dict | None:
    """overlap=True and overlap=False give bitwise equal losses and gradients, step after step."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    runs = {}
    for overlap in (True, False):
        _, modules, sched = build_pipeline(schedule, pp, n, group, rank, overlap=overlap, record_timeline=True)
        place = sched.placement
        opt = torch.optim.Adam([p for m in modules.values() for p in m.parameters()], lr=1e-2)
        losses_per_step, grads_per_step = [], []
        for step in range(2):
            x, y = batch(step, n)
            losses: list = []
            sched.step(x, target=y, losses=losses) if place.feeds_batch(rank) else sched.step()
            losses_per_step.append([l.detach().clone() for l in losses])
            grads_per_step.append([p.grad.clone() for m in modules.values() for p in m.parameters()])
            opt.step()
            opt.zero_grad()
        gathered = sched.collect_timeline()
        assert sorted({t.rank for t in gathered}) == list(range(pp))
        assert [t for t in gathered if t.rank == rank] == sched.timeline
        runs[overlap] = (losses_per_step, grads_per_step, sched.timeline)
    (l_on, g_on, timeline), (l_off, g_off, _) = runs[True], runs[False]
    for a, b in zip(l_on + g_on, l_off + g_off):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"overlap changed a value by {(x - y).abs().max().item()}"
    compute = [a for a in sched.pipeline_order[rank]]
    recorded = [t.action for t in timeline]
    assert recorded == compute, f"timeline {recorded} != order {compute}"
    assert all(0 <= t.start <= t.end for t in timeline) and all(t.rank == rank for t in timeline)
    return {"values_compared": sum(len(x) for x in l_on + g_on), "timed_actions": len(timeline)}


def torch_schedule_grad_error(name: str, pp: int, n: int, fsdp: bool) -> float | None:
    """One step of torch's own V schedule ``name`` (nested FSDP2 when ``fsdp``): the largest
    gradient error against the reference (no assertion: the caller decides what is expected)."""
    from torch.distributed.pipelining import ScheduleDualPipeV as TorchDualPipeV
    from torch.distributed.pipelining import ScheduleZBVZeroBubble

    from titan_dualpipe._compat.stage_init import runnable_on_gloo

    cls = {"torch DualPipeV": TorchDualPipeV, "ZBVZeroBubble": ScheduleZBVZeroBubble}[name]
    if (layout := pipeline_layout(pp, fsdp)) is None:
        return None
    group, pp_rank, dp_mesh, _ = layout
    if dp_mesh is not None and dp_mesh.size() != 1:
        raise ValueError("torch_schedule_grad_error compares against a single replica: use pp == world size")
    RUNTIMES["torch:" + name] = lambda schedule: lambda stages, n, **kw: runnable_on_gloo(cls(stages, n, **kw))
    reference, modules, sched = build_pipeline("DualPipeV", pp, n, group, pp_rank, fsdp_mesh=dp_mesh,
                                               runtime="torch:" + name)
    x, y = batch(0, n)
    sched.step(x, target=y, losses=[]) if pp_rank == 0 else sched.step()
    reference_step(reference, x, y, n, scale_grads=True)
    ref = dict(reference.named_parameters())
    worst = 0.0
    for module in modules.values():
        for pname, p in module.named_parameters():
            got = _full(p.grad) if p.grad is not None else torch.zeros_like(ref[pname])
            worst = max(worst, (got - ref[pname].grad).abs().max().item())
    return worst


def compiled_stages_numerics(schedule: str, pp: int, n: int, *, backend: str = "aot_eager", fsdp: bool = False,
                             compile_reference: bool = True, weight_gradients: str = "deferred",
                             **kwargs) -> dict | None:
    """Stages whose blocks are torch.compile'd in place before FSDP (as torchtitan compiles them):
    two steps against the reference compiled the same way (``compile_reference=False``: the
    eager reference), every rank. Each compiled graph runs one backward per microbatch, at I:
    whole (``weight_gradients="deferred"``, the default, or ``"split"``: torch's split would run
    a compiled graph twice), or with the blocks' weight GEMMs queued for W
    (``"deferred_compiled"``). ``gemms_at_w``: the last step's weight GEMMs run at W, by stage."""
    built = []

    def checked_schedule(stages, n_mbs, **schedule_kwargs):
        sched = SCHEDULES[schedule](stages, n_mbs, weight_gradients=weight_gradients, **schedule_kwargs)
        every = {s.stage_index for s in stages}
        if weight_gradients != "deferred_compiled":
            assert sched.weight_policy.whole_stages == every, sched.weight_policy.whole_stages
        else:  # the compiled blocks' linear layers defer like eager ones
            assert not sched.weight_policy.whole_stages and sched.weight_policy.deferred_stages == every, sched.deferred_weights
            assert all(any(name.endswith(".w1") for name in names) for names in sched.deferred_weights.values())
        built.append(sched)
        return sched

    result = numerics(schedule, pp, n, fsdp=fsdp, factory=checked_schedule, compile_backend=backend,
                      compile_reference=compile_reference, **kwargs)
    if result is not None:
        result["gemms_at_w"] = dict(built[-1].weight_policy.queue.ran)
    return result


def recorded_step_trace(schedule: str, pp: int, n: int, *, fsdp: bool = False, **schedule_kwargs) -> dict | None:
    """Two training steps under a :class:`CommRecorder`: this rank's posted communication."""
    from titan_dualpipe.runtime.comm_record import CommRecorder

    rank = dist.get_rank()
    if (layout := pipeline_layout(pp, fsdp)) is None:
        return None
    group, pp_rank, dp_mesh, dp_index = layout
    _, modules, sched = build_pipeline(schedule, pp, n, group, pp_rank, fsdp_mesh=dp_mesh, **schedule_kwargs)
    with CommRecorder() as recorder:
        for step in range(2):
            x, y = batch(step, n, dp_index)
            sched.step(x, target=y, losses=[]) if sched.placement.feeds_batch(pp_rank) else sched.step()
    return {"rank": rank, "events": recorder.events}


def recorded_trace_of_hand_made_order(pp: int, n: int, move: str, after: str) -> dict | None:
    """DualPipeV with one RECV moved after a SEND on rank 1 (``move`` after ``after``): gloo
    runs it (it buffers sends); the recorded trace is returned for the NCCL model to judge."""
    from titan_dualpipe.runtime.comm_record import CommRecorder

    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    reference, modules, sched = build_pipeline("DualPipeV", pp, n, group, rank)
    order = {r: list(actions) for r, actions in sched.pipeline_order_with_comms.items()}
    moved = next(a for a in order[1] if str(a) == move)
    order[1].remove(moved)
    order[1].insert(order[1].index(next(a for a in order[1] if str(a) == after)) + 1, moved)
    sched._prepare_schedule_with_comms(order, format="compute_comms")
    x, y = batch(0, n)
    with CommRecorder() as recorder:
        sched.step(x, target=y, losses=[]) if rank == 0 else sched.step()
    reference_step(reference, x, y, n, scale_grads=True)
    _check_grads(modules, reference, "hand-made order")
    return {"rank": rank, "events": recorder.events}


def steps_with_collectives_on_stage_device(schedule: str, pp: int, n: int, *, fsdp: bool = False,
                                           **schedule_kwargs) -> dict | None:
    """Two training steps and an eval where factory functions default to ``meta`` (as a GPU
    run's default is the CPU, not the stages' device) and every tensor handed to a collective
    must be on the stages' device; then the numerics against the reference."""
    from titan_dualpipe.runtime.comm_record import CommRecorder

    if (layout := pipeline_layout(pp, fsdp)) is None:
        return None
    group, pp_rank, dp_mesh, _ = layout
    if dp_mesh is not None and dp_mesh.size() != 1:
        raise ValueError("use pp == world size with fsdp here (one replica to compare with)")
    reference, modules, sched = build_pipeline(schedule, pp, n, group, pp_rank, fsdp_mesh=dp_mesh, **schedule_kwargs)
    feeds = sched.placement.feeds_batch(pp_rank)
    opt = torch.optim.Adam([p for m in modules.values() for p in m.parameters()], lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    with CommRecorder(device=torch.device("cpu")) as recorder:
        for step in range(2):
            x, y = batch(step, n)
            with torch.device("meta"):
                sched.step(x, target=y, losses=[]) if feeds else sched.step()
            reference_step(reference, x, y, n, scale_grads=True)
            _check_grads(modules, reference, f"step {step}")
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        with torch.no_grad(), torch.device("meta"):
            sched.eval(x, target=y, losses=[]) if feeds else sched.eval()
    return {"collectives": len(recorder.events)}


def killed_mid_step(schedule: str, pp: int, n: int, victim: int, group_timeout_s: float) -> dict | None:
    """Pipeline rank ``victim`` is killed (SIGKILL) in its third forward of the first step;
    the others report what they raised and after how long."""
    import os
    import signal
    import time

    if (ranks := pipeline_ranks(pp, timeout_s=group_timeout_s)) is None:
        return None
    group, rank = ranks
    _, modules, sched = build_pipeline(schedule, pp, n, group, rank)
    forwards = [0]

    def die_on_third_forward(module, args):
        forwards[0] += 1
        if rank == victim and forwards[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    for module in modules.values():
        module.register_forward_pre_hook(die_on_third_forward)
    x, y = batch(0, n)
    start = time.monotonic()
    try:
        sched.step(x, target=y, losses=[]) if sched.placement.feeds_batch(rank) else sched.step()
    except Exception as err:  # noqa: BLE001 - the test inspects what each rank raised
        return {"raised": f"{type(err).__name__}: {err}", "elapsed_s": time.monotonic() - start}
    return {"raised": "", "elapsed_s": time.monotonic() - start}


def folded_twins(pp: int, n: int, steps: int = 2) -> dict:
    """DualPipe with FSDP2 over twins x replicas (the two copies of a part are one sharded
    parameter): numerics against the reference, and this rank's posted communication."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from titan_dualpipe.runtime.comm_record import CommRecorder

    world, rank = dist.get_world_size(), dist.get_rank()
    dp = world // pp
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_index = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    fold = None
    for r in range(pp // 2):  # every rank creates every group, in the same order
        ranks = sorted(p * dp + d for p in (r, pp - 1 - r) for d in range(dp))
        group = dist.new_group(ranks)
        if rank in ranks:
            fold = DeviceMesh.from_group(group, "cpu")
    seen: list = []

    def factory(stages, n, **kwargs):
        for module in (m for s in stages for m in s.submod.modules() if isinstance(m, FSDPModule)):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        sched = SCHEDULES["DualPipe"](stages, n, **kwargs)
        seen.append(sched.fsdp_at_step_edges)
        return sched

    with CommRecorder(device=torch.device("cpu")) as recorder:
        result = train_and_compare("DualPipe", pp, n, mesh["pp"].get_group(), pp_rank, fsdp_mesh=fold,
                                   dp_index=dp_index, dp_size=dp, steps=steps, factory=factory,
                                   perturb_twins=False)  # folded twins are one parameter: nothing to make equal
    return {**result, "folded": seen == [True], "rank": rank, "events": recorder.events}


_block_recomputes: dict[str, int] = {}  # block name -> forwards of its MLP run inside a backward (recomputations)


def _count_block_forwards(layer, name: str) -> None:
    def count(*_):
        if torch._C._current_graph_task_id() != -1:
            _block_recomputes[name] = _block_recomputes.get(name, 0) + 1

    layer.w1.register_forward_pre_hook(count)


def _checkpoint_layers(module, style: str) -> None:
    """Wrap the blocks' forwards in torch's non-reentrant checkpoint, as user code does it.

    ``selective``: every block under selective AC (saving matmuls and attention);
    ``mixed``: blocks in turn selective AC, full AC, no AC (torchtitan's every-k-th layer mode);
    ``none``: no block (only the recomputation counter).
    """
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    save = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    selective = functools.partial(create_selective_checkpoint_contexts, policy)
    for name, layer in module.layers.items():
        _count_block_forwards(layer, name)
        kind = style if style in ("selective", "none") else ("selective", "full", "none")[int(name) % 3]
        if kind != "none":
            context = {"context_fn": selective} if kind == "selective" else {}
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False, **context)


def checkpointed_numerics(schedule: str, pp: int, n: int, style: str, **kwargs) -> dict | None:
    """User stages whose blocks run under torch's checkpoint (``style``, see :func:`_checkpoint_layers`):
    losses and every gradient against the reference without AC, two steps with Adam between;
    also which (stage, microbatch) backwards ran whole at I in the last step."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    built = []

    def factory(stages, n, **schedule_kwargs):
        for stage in stages:
            _checkpoint_layers(stage.submod, style)
        sched = SCHEDULES[schedule](stages, n, **schedule_kwargs)
        step = sched.step

        def counted_step(*args, **step_kwargs):  # recomputations of the last step only (not stage initialisation's)
            _block_recomputes.clear()
            return step(*args, **step_kwargs)

        sched.step = counted_step
        built.append(sched)
        return sched

    result = train_and_compare(schedule, pp, n, group, rank, factory=factory, **kwargs)
    sched = built[0]
    layers = {s.stage_index: sorted(s.submod.layers) for s in sched._stages}
    return {**result, "whole_at_input": sorted(sched.whole_backwards), "layers": layers,
            "deferred_gemms": dict(sched.weight_policy.queue.ran), "in_flight_gemms": sched.weight_policy.queue.ran_in_flight,
            "in_flight_stages": sorted(sched.weight_policy.in_flight_stages), "recomputes": dict(_block_recomputes),
            "linears": {s.stage_index: len(sched.deferred_weights.get(s.stage_index, [])) for s in sched._stages},
            "deferred_names": dict(sched.deferred_weights),
            "linear_modules": {s.stage_index: sum(isinstance(m, torch.nn.Linear) for m in s.submod.modules())
                               for s in sched._stages}}


# -- torch's schedule contract: cycle-free steps, custom functions, static metadata, traced stages --

def _garbage_tensors(run) -> list[torch.Tensor]:
    """Tensors that ``run()`` leaves only the cycle collector could free (torch's tests call this
    check ``check_leaked_tensors``): collector off during ``run``, then everything unreachable kept."""
    import gc

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        run()
        gc.collect()
        return [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()


def tensors_left_for_gc(schedule: str, pp: int, n: int, overlap: bool) -> dict | None:
    """A second training step (the first initialises the stages) leaves no tensor in a reference cycle."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    _, modules, sched = build_pipeline(schedule, pp, n, group, rank, overlap=overlap)
    feeds = sched.placement.feeds_batch(rank)

    def step(i: int) -> None:
        x, y = batch(i, n)
        sched.step(x, target=y, losses=[]) if feeds else sched.step()

    step(0)
    garbage = _garbage_tensors(lambda: step(1))
    return {"tensors": len(garbage), "shapes": [tuple(t.shape) for t in garbage[:8]]}


def _torch_test_callbacks(calls: dict):
    """The FORWARD and OVERLAP_F_B functions torch's own test (``test_custom_function_callback``)
    registers on a runtime schedule: they redo its bookkeeping through ``fwd_recv_ops``,
    ``bwd_recv_ops``, ``backward_counter``, ``_maybe_compute_loss``/``_maybe_get_loss`` and
    same-rank hand-offs between stages ``s`` and ``s+1``."""
    from titan_dualpipe._compat.pipelining import _PipelineScheduleRuntime, _wait_batch_p2p

    def forward(action, ctx) -> None:
        schedule = ctx.schedule_ref
        assert isinstance(schedule, _PipelineScheduleRuntime)
        stages = {stage.stage_index: stage for stage in schedule._stages}
        s, mb = action.stage_index, action.microbatch_index
        stage = stages[s]
        calls["F"] += 1
        if not stage.is_first and s - 1 not in stages:
            assert (s, mb) in schedule.fwd_recv_ops, f"Computing {action=} before receiving input"
            _wait_batch_p2p(schedule.fwd_recv_ops.pop((s, mb)))
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
        schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if s + 1 in stages:
            stages[s + 1].set_local_fwd_input(output, mb)

    def overlap(action, ctx) -> None:
        schedule = ctx.schedule_ref
        stages = {stage.stage_index: stage for stage in schedule._stages}
        fwd, bwd = action.sub_actions
        forward(fwd, ctx)
        calls["OVERLAP_F_B"] += 1
        s, mb = bwd.stage_index, bwd.microbatch_index
        stage = stages[s]
        if not stage.is_last and s + 1 not in stages:
            assert (s, mb) in schedule.bwd_recv_ops, f"Attempted to run compute {action=} before receiving input"
            _wait_batch_p2p(schedule.bwd_recv_ops.pop((s, mb)))
        loss = schedule._maybe_get_loss(stage, mb)
        schedule.backward_counter[s] += 1
        last = schedule.backward_counter[s] == schedule._n_microbatches
        stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
        if last:
            stage.scale_grads(schedule._n_microbatches if schedule.scale_grads else 1)
        if s - 1 in stages:
            stages[s - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)

    return forward, overlap


@contextlib.contextmanager
def _cpu_streams_for(module):
    """torchtitan's overlap callback sets the backward thread's stream to the forward's; a CPU has
    no streams (``torch.accelerator`` raises), so both calls do nothing here."""
    import types

    saved = module.device_module, torch.accelerator.current_stream
    module.device_module = types.SimpleNamespace(set_stream=lambda stream: None)
    torch.accelerator.current_stream = lambda *args, **kwargs: None
    try:
        yield
    finally:
        module.device_module, torch.accelerator.current_stream = saved


def custom_functions_numerics(schedule: str, pp: int, n: int, callbacks: str) -> dict | None:
    """Two training steps with custom functions written for torch's runtime registered, against
    the reference. ``callbacks``: ``"torchtitan"`` (0.2.2's ``dual_pipe_v.overlap_callback`` for
    OVERLAP_F_B) or ``"torch_tests"`` (torch's test functions for FORWARD and OVERLAP_F_B)."""
    from collections import Counter

    from titan_dualpipe._compat.pipelining import F, OVERLAP_F_B

    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    calls: Counter = Counter()
    built: list = []
    streams = contextlib.nullcontext()
    if callbacks == "torchtitan":
        from torchtitan.distributed import dual_pipe_v

        def titan_overlap(action, ctx) -> None:
            calls["OVERLAP_F_B"] += 1
            dual_pipe_v.overlap_callback(action, ctx)

        functions = {OVERLAP_F_B: titan_overlap}
        streams = _cpu_streams_for(dual_pipe_v)
    else:
        forward, overlap = _torch_test_callbacks(calls)
        functions = {F: forward, OVERLAP_F_B: overlap}

    def factory(stages, n, **kwargs):
        sched = SCHEDULES[schedule](stages, n, **kwargs)
        for kind, fn in functions.items():
            sched.register_custom_function(kind, fn)
        built.append(sched)
        return sched

    with streams:
        result = train_and_compare(schedule, pp, n, group, rank, factory=factory, scale_grads=False)
    order = built[0].pipeline_order[rank]
    in_order = Counter(str(a.computation_type) for a in order)
    return {**result, "calls": dict(calls), "pairs": in_order[str(OVERLAP_F_B)], "forwards": in_order[str(F)]}


def _static_stage(stage) -> PipelineStage:
    """``stage`` rebuilt with static metadata (no shape inference): example tensors of one
    microbatch, made without requires_grad as user code makes them."""
    module = stage.submod
    _, example_ids = batch(0, 1)
    hidden = torch.zeros(MB_SIZE, example_ids.shape[1], 16)  # build_pipeline's TinyLM(dim=16)
    example_in = example_ids if module.tok_embeddings is not None else hidden
    with torch.no_grad():
        example_out = module(example_in)
    return PipelineStage(module, stage.stage_index, stage.num_stages, stage.device, group=stage.group,
                         input_args=(example_in,), output_args=(example_out,))


def static_metadata_numerics(schedule: str, pp: int, n: int) -> dict | None:
    """Stages built with ``input_args=``/``output_args=`` train like the reference."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    modes: list = []

    def factory(stages, n, **kwargs):
        sched = SCHEDULES[schedule]([_static_stage(s) for s in stages], n, **kwargs)
        modes.append(sched)
        return sched

    result = train_and_compare(schedule, pp, n, group, rank, factory=factory)
    return {**result, "modes": sorted({str(getattr(s, "_inference_mode", None)) for s in modes[0]._stages})}


def torch_dualpipev_static_metadata(pp: int, n: int) -> dict | None:
    """One step of torch's own ScheduleDualPipeV on stages with static metadata (no workaround of
    ours): the largest gradient error, or the error it raised (no assertion: the caller decides)."""
    from torch.distributed.pipelining import ScheduleDualPipeV as TorchDualPipeV

    from titan_dualpipe._compat.stage_init import runnable_on_gloo

    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    RUNTIMES["torch:static DualPipeV"] = lambda schedule: (
        lambda stages, n, **kw: runnable_on_gloo(TorchDualPipeV([_static_stage(s) for s in stages], n, **kw)))
    reference, modules, sched = build_pipeline("DualPipeV", pp, n, group, rank, runtime="torch:static DualPipeV")
    x, y = batch(0, n)
    try:
        sched.step(x, target=y, losses=[]) if rank == 0 else sched.step()
    except Exception as err:  # noqa: BLE001 - the test compares the outcome with the flag
        return {"raised": f"{type(err).__name__}: {err}"}
    reference_step(reference, x, y, n, scale_grads=True)
    ref = dict(reference.named_parameters())
    worst = max((p.grad - ref[name].grad).abs().max().item() if p.grad is not None else float("inf")
                for m in modules.values() for name, p in m.named_parameters())
    return {"grad_err": worst}


TRACED_DIM = 16


class _TwoChains(torch.nn.Module):
    """DualPipe's two directions as one traceable model: ``parts`` and a copy of them, each chain
    fed the input, each chain's end a model output."""

    def __init__(self, parts: list) -> None:
        super().__init__()
        self.first = torch.nn.Sequential(*parts)
        self.second = torch.nn.Sequential(*copy.deepcopy(parts))

    def stage_names(self) -> list[str]:
        return [f"{chain}.{k}" for chain in ("first", "second") for k in range(len(self.first))]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first(x), self.second(x)


def traced_numerics(schedule: str, pp: int, n: int, steps: int = 2) -> dict | None:
    """Stages from torch's tracer frontend (``pipeline(...)``, ``build_stage``) on gloo: losses and
    every gradient against a non-pipelined reference, two steps with Adam between.

    The model is a chain of ``Linear + Tanh`` parts, one per stage. DualPipe: ``pp`` parts, traced
    as two chains from the same input (:class:`_TwoChains`), so stage ``pp + k`` holds part ``k``
    again (the direction-1 copy) and both chain ends are the model's outputs."""
    from torch import nn
    from torch.distributed.pipelining import SplitPoint, pipeline

    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    place = placement(schedule, pp, n)
    torch.manual_seed(0)
    parts = [nn.Sequential(nn.Linear(TRACED_DIM, TRACED_DIM), nn.Tanh())
             for _ in range(place.num_stages if schedule == "DualPipeV" else pp)]
    reference = nn.Sequential(*copy.deepcopy(parts))
    chain = nn.Sequential(*parts) if schedule == "DualPipeV" else _TwoChains(parts)
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(n * MB_SIZE, TRACED_DIM, generator=g) for _ in range(steps)]
    ys = [torch.randn(n * MB_SIZE, TRACED_DIM, generator=g) for _ in range(steps)]
    names = [str(k) for k in range(len(parts))] if schedule == "DualPipeV" else chain.stage_names()
    pipe = pipeline(chain, mb_args=(xs[0][:MB_SIZE],), split_spec={name: SplitPoint.BEGINNING for name in names[1:]})
    stages = [pipe.build_stage(s, torch.device("cpu"), group=group) for s in place.stages_of(rank)]
    modules = {s: pipe.get_stage_module(s) for s in place.stages_of(rank)}

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    sched = SCHEDULES[schedule](stages, n, loss_fn=loss_fn)
    opt = torch.optim.Adam([p for m in modules.values() for p in m.parameters()], lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    result = {"grad_err": 0.0, "losses_checked": 0}
    for step in range(steps):
        losses: list = []
        x, y = xs[step], ys[step]
        sched.step(x, target=y, losses=losses) if place.feeds_batch(rank) else sched.step()
        ref_losses = [loss_fn(reference(xm), ym) for xm, ym in zip(x.chunk(n), y.chunk(n))]
        (torch.stack(ref_losses).sum() / n).backward()
        if losses:
            torch.testing.assert_close(torch.stack([l.detach() for l in losses]), torch.stack(ref_losses).detach(),
                                       rtol=RTOL, atol=ATOL)
            result["losses_checked"] += len(losses)
        for s, module in modules.items():
            want = list(reference[place.model_part(s)].parameters())
            got = list(module.parameters())
            assert len(got) == len(want) == 2, (s, len(got))
            for p, r in zip(got, want):
                torch.testing.assert_close(p.grad, r.grad, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} stage {s}: {m}")
                result["grad_err"] = max(result["grad_err"], (p.grad - r.grad).abs().max().item())
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return result


def _marked_whole(module) -> str:
    return "marked by the test" if getattr(module, "whole_backward_for_test", False) else ""


def whole_backward_by_rule(schedule: str, pp: int, n: int) -> dict | None:
    """A static rule (``register_whole_backward_rule``) keeps every backward of this rank's
    second stage whole at I: numerics against the reference, and which backwards ran whole."""
    from titan_dualpipe.weights import register_whole_backward_rule

    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    register_whole_backward_rule(_marked_whole)
    built = []

    def factory(stages, n, **schedule_kwargs):
        stages[1].submod.whole_backward_for_test = True
        built.append(SCHEDULES[schedule](stages, n, **schedule_kwargs))
        return built[-1]

    result = train_and_compare(schedule, pp, n, group, rank, factory=factory)
    marked = [s.stage_index for s in built[0]._stages if _marked_whole(s.submod)]
    return {**result, "marked": marked, "whole_at_input": sorted(built[0].whole_backwards)}


def _with_checkpointed_blocks(style: str):
    """A schedule factory for :func:`numerics`: our schedule on stages whose blocks run under
    torch's checkpoint (``style`` as in :func:`_checkpoint_layers`)."""

    def factory_for(schedule: str):
        def build(stages, n, **kwargs):
            for stage in stages:
                _checkpoint_layers(stage.submod, style)
            _BUILT_WITH_CHECKPOINTS[:] = [SCHEDULES[schedule](stages, n, **kwargs)]
            return _BUILT_WITH_CHECKPOINTS[0]

        return build

    return factory_for


_BUILT_WITH_CHECKPOINTS: list = []
RUNTIMES["ours_selective_ac"] = _with_checkpointed_blocks("selective")
RUNTIMES["ours_mixed_ac"] = _with_checkpointed_blocks("mixed")


def checkpointed_fsdp_numerics(schedule: str, pp: int, n: int, runtime: str, **kwargs) -> dict | None:
    """:func:`numerics` with FSDP2 on checkpointed blocks; also how many backwards ran whole at I
    and how many weight GEMMs waited for W (last step)."""
    result = numerics(schedule, pp, n, fsdp=True, runtime=runtime, **kwargs)
    sched = _BUILT_WITH_CHECKPOINTS[0]
    return {**result, "whole_at_input": len(sched.whole_backwards), "deferred_gemms": sum(sched.weight_policy.queue.ran.values())}


def two_batch_numerics(schedule: str, pp: int, n: int, **kwargs) -> dict | None:
    """:func:`numerics` with ``two_batch_overlap="all"`` (TinyLM has no exchanges);
    counts the microbatches that ran in halves."""
    from titan_dualpipe.overlap import sub_batches

    joins: list = []
    real = sub_batches.join_sub_batches

    def counted(outputs, sizes):
        joins.append(sizes)
        return real(outputs, sizes)

    sub_batches.join_sub_batches = counted
    try:
        result = numerics(schedule, pp, n, two_batch_overlap="all", **kwargs)
    finally:
        sub_batches.join_sub_batches = real
    if result is not None:
        result["split"] = len(joins)
    return result


def start_up_calls(schedule: str, pp: int, n: int) -> dict | None:
    """How often the schedule's start-up connected its pairs (``connect``) and ran again without
    connecting, over two training steps and an eval (first ``pp`` ranks)."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    _, modules, sched = build_pipeline(schedule, pp, n, group, rank)
    calls = {"connect": 0, "again": 0}
    start_up = sched._start_up

    def counted(stages, has_backward, connect):
        calls["connect" if connect else "again"] += 1
        start_up(stages, has_backward, connect)

    sched._start_up = counted
    place = placement(schedule, pp, n)
    for step in range(2):
        x, y = _numerics.batch(step, n, 0, "cpu")
        sched.step(x, target=y) if place.feeds_batch(rank) else sched.step()
    x, y = _numerics.batch(2, n, 0, "cpu")
    sched.eval(x, target=y) if place.feeds_batch(rank) else sched.eval()
    return calls


def bad_schedule_options(schedule: str, pp: int, n: int, **options) -> str | None:
    """The constructor's error for ``options`` (first ``pp`` ranks), raised before any traffic."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    place = placement(schedule, pp, n)
    module = TinyLM(vocab=VOCAB, dim=16, layers=2, heads=2)
    stages = [PipelineStage(copy.deepcopy(module), s, place.num_stages, torch.device("cpu"), group=group)
              for s in place.stages_of(rank)]
    try:
        SCHEDULES[schedule](stages, n, loss_fn=lm_loss, **options)
    except ValueError as err:
        return str(err)
    raise AssertionError(f"{options}: constructor did not raise")


def forward_contexts_seen(schedule: str, pp: int, n: int, **schedule_kwargs) -> list | None:
    """torch 2.15's ``stage.register_forward_context``: the (stage, microbatch) of every context
    entered in a second training step (the first also runs metadata inference), first ``pp`` ranks."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    _, _, sched = build_pipeline(schedule, pp, n, group, rank, **schedule_kwargs)
    seen: list = []

    @contextlib.contextmanager
    def recorded(info):
        seen.append((info.stage_index, info.microbatch_index))
        yield

    for stage in sched._stages:
        stage.register_forward_context(recorded)
    place = placement(schedule, pp, n)
    for step in range(2):
        seen.clear()
        x, y = _numerics.batch(step, n, 0, "cpu")
        sched.step(x, target=y) if place.feeds_batch(rank) else sched.step()
    return sorted(seen)


def released_after_send(schedule: str, pp: int, n: int, **schedule_kwargs) -> dict | None:
    """torch 2.15's ``release_fwd_send_outputs``: the microbatches each stage was told to release
    in a training step, and how many forward sends the rank's order has per stage."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    _, _, sched = build_pipeline(schedule, pp, n, group, rank, **schedule_kwargs)
    released: dict[int, list[int]] = {stage.stage_index: [] for stage in sched._stages}
    for stage in sched._stages:
        original = stage.release_fwd_send_outputs

        def counted(mb, stage_index=stage.stage_index, original=original):
            released[stage_index].append(mb)
            original(mb)

        stage.release_fwd_send_outputs = counted
    place = placement(schedule, pp, n)
    x, y = _numerics.batch(0, n, 0, "cpu")
    sched.step(x, target=y) if place.feeds_batch(rank) else sched.step()
    sends = {s: sorted(a.microbatch_index for a in sched.pipeline_order_with_comms[rank]
                       if a.stage_index == s and str(a.computation_type).endswith("SEND_F")) for s in released}
    return {"released": {s: sorted(mbs) for s, mbs in released.items()}, "sends": sends}
