"""What a schedule checks before any pipeline traffic: its stages at construction, the inputs of
every ``step()``. Each check returns this rank's problem as text ('' for none); the schedule
then agrees on them across ranks (:mod:`.agreement`), so every rank raises the same error."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .._compat.fsdp import replicated_by_ddp
from .._compat.pipelining import ASYNC_REDUCE_GRAD, UNSHARD_LOOKAHEAD
from ..orders.lowering import unshard_lookaheads
from ..orders.placement import Placement, check_requirements


def stage_problem(name: str, stages: Any) -> str:
    """Stage lists that cannot form this rank's part of the schedule."""
    if not isinstance(stages, (list, tuple)) or len(stages) != 2:
        count = len(stages) if isinstance(stages, (list, tuple)) else type(stages).__name__
        return (f"{name} needs exactly two stages per rank, got {count}: pass "
                "[PipelineStage(stage_index=r), PipelineStage(stage_index=2*pp-1-r)] on rank r")
    pp, rank = stages[0].group_size, stages[0].group_rank
    expected = [rank, 2 * pp - 1 - rank]
    ids = [s.stage_index for s in stages]
    totals = [s.num_stages for s in stages]
    if sorted(ids) != expected or any(t != 2 * pp for t in totals):
        return (f"{name} on rank {rank} of {pp} needs stages {expected} with num_stages={2 * pp}; got stage ids "
                f"{ids} with num_stages {totals}. Rank r holds stages r and 2*pp-1-r (V placement)")
    return ""


def data_parallel_problem(name: str, stages: Any) -> str:
    """Stage modules under a data parallelism the pipeline cannot drive: composable ``replicate``
    (DDP's reducer) reduces inside every microbatch's backward and gives wrong gradients under
    pipelining (torch's ``ScheduleDualPipeV`` too, tests/cases/contract_cases.py)."""
    for stage in stages:
        names = replicated_by_ddp(stage.submod)
        if names:
            shown = ", ".join(repr(n or "<stage module>") for n in names[:3])
            return (f"{name}: stage {stage.stage_index}'s modules {shown} are under torch.distributed._composable."
                    "replicate, whose DDP reducer runs in every microbatch's backward and gives wrong gradients under "
                    "pipelining; use torch.distributed._composable.replicate_with_fsdp.replicate (or fully_shard), "
                    "which the pipeline reduces once per step")
    return ""


def runtime_options_problem(name: str, pp: int, max_active_stages: Any, unshard_lookahead: Any,
                            defer_reduce_grad_wait: Any, max_outstanding_sends: Any) -> str:
    """torch 2.15's runtime options, as torch checks them, and those this torch cannot run."""
    try:
        lookaheads = unshard_lookaheads(unshard_lookahead, pp, max_active_stages)
    except ValueError as err:
        return f"{name}: {err}"
    if max_active_stages < 2:
        return (f"{name}: max_active_stages={max_active_stages}: an overlapped pair computes on both of a rank's two "
                "stages at once, so both must be unsharded together; pass 2 or more (default 3)")
    if not UNSHARD_LOOKAHEAD and lookaheads != (max_active_stages,) * pp:
        return (f"{name}: unshard_lookahead={unshard_lookahead!r} needs torch 2.15 or later (torch {torch.__version__}'s "
                "FSDP lowering issues every unshard max_active_stages stages ahead); leave it 'full'")
    if not isinstance(defer_reduce_grad_wait, bool):
        return f"{name}: defer_reduce_grad_wait={defer_reduce_grad_wait!r}: pass True or False"
    if defer_reduce_grad_wait and not ASYNC_REDUCE_GRAD:
        return (f"{name}: defer_reduce_grad_wait=True needs torch 2.15 or later (FSDP2 reduces asynchronously from "
                f"2.15, finalize_backward(async_op=True)); torch {torch.__version__} reduces at REDUCE_GRAD. Leave it False")
    if max_outstanding_sends is not None and (isinstance(max_outstanding_sends, bool)
                                              or not isinstance(max_outstanding_sends, int) or max_outstanding_sends < 0):
        return f"{name}: max_outstanding_sends={max_outstanding_sends!r}: pass None (no cap) or an integer >= 0"
    return ""


def requirements_problem(name: str, pp: int, n_microbatches: int) -> str:
    try:
        check_requirements(name, pp, n_microbatches)
    except ValueError as err:
        return str(err)
    return ""


def batch_size(args: tuple, kwargs: dict, args_chunk_spec: Any = None) -> int | None:
    """Size of the whole batch along the split dimension (the first tensor input's), or None."""
    for i, value in enumerate(args):
        leaves = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        if leaves:
            dim = args_chunk_spec[i].split_dim if args_chunk_spec is not None and i < len(args_chunk_spec) else 0
            return leaves[0].shape[dim]
    leaves = [t for t in tree_flatten(kwargs)[0] if isinstance(t, torch.Tensor)]
    return leaves[0].shape[0] if leaves else None


def _divisors_at_least(size: int, low: int) -> list[int]:
    return [d for d in range(low, size + 1) if size % d == 0]


def step_inputs_problem(schedule: Any, args: tuple, kwargs: dict, target: Any, arg_mbs: Any, kwarg_mbs: Any,
                        target_mbs: Any) -> tuple[str, int]:
    """This rank's problem with its ``step()`` inputs, and its whole-batch size (-1: none, or pre-split)."""
    place: Placement = schedule.placement
    name, rank, n = place.schedule, schedule.rank, schedule._n_microbatches
    local = [s.stage_index for s in schedule._stages]
    firsts = [s for s in local if place.is_first(s)]
    lasts = [s for s in local if place.is_last(s)]
    pre_split = any(m is not None for m in (arg_mbs, kwarg_mbs, target_mbs))
    if pre_split:
        if args or kwargs or target is not None:
            return (f"rank {rank} passed whole-batch inputs together with arg_mbs/kwarg_mbs/target_mbs: pass one "
                    "or the other"), -1
        for label, mbs in (("arg_mbs", arg_mbs), ("kwarg_mbs", kwarg_mbs), ("target_mbs", target_mbs)):
            if mbs is not None and (not isinstance(mbs, list) or len(mbs) != n):
                got = len(mbs) if isinstance(mbs, list) else type(mbs).__name__
                return f"rank {rank}: {label} needs one entry per microbatch, a list of {n}; got {got}", -1
        problem = _entries_problem(rank, arg_mbs, kwarg_mbs)
        if problem:
            return problem, -1
    feeds = bool(args or kwargs or arg_mbs is not None or kwarg_mbs is not None)
    if firsts and not feeds:
        return (f"rank {rank} holds first stage {firsts[0]} of {name} and must pass the whole-batch inputs: "
                "schedule.step(x, target=y)"), -1
    if lasts and schedule._has_backward and schedule._loss_fn is not None and target is None and target_mbs is None:
        return (f"rank {rank} holds last stage {lasts[0]} of {name} and computes the loss: pass target= to "
                "step()"), -1
    if pre_split:
        return "", -1
    size = batch_size(args, kwargs, schedule._args_chunk_spec) if feeds else None
    for label, value in (("inputs", size), ("target", target.shape[0] if isinstance(target, torch.Tensor) else None)):
        if value is not None and value % n:
            low = 2 * place.pp_size
            return (f"rank {rank}: the batch has {value} samples (dim 0 of the {label}), not a multiple of "
                    f"n_microbatches={n}: pass a batch of a multiple of {n} samples (e.g. {n * max(1, value // n)}),"
                    f" or use a microbatch count >= {low} that divides {value} "
                    f"({_divisors_at_least(value, low)[:6] or 'none'})"), -1
    if size is not None and isinstance(target, torch.Tensor) and target.shape[0] != size:
        return (f"rank {rank}: the inputs have {size} samples but the target {target.shape[0]}: pass the target "
                "of the same batch"), -1
    return "", -1 if size is None else size


def _entries_problem(rank: int, arg_mbs: list | None, kwarg_mbs: list | None) -> str:
    """Pre-split entries of the wrong kind: a microbatch's positional inputs are a tuple (as the
    whole batch's ``args``), its keyword inputs a dict."""
    for label, mbs, kinds, example in (("arg_mbs", arg_mbs, (tuple, list), "[(x0,), (x1,), ...]"),
                                       ("kwarg_mbs", kwarg_mbs, (dict,), "[{'mask': m0}, {'mask': m1}, ...]")):
        for i, entry in enumerate(mbs or ()):
            if not isinstance(entry, kinds):
                return (f"rank {rank}: {label}[{i}] is a {type(entry).__name__}; each entry holds one microbatch's "
                        f"{'positional inputs as a tuple' if label == 'arg_mbs' else 'keyword inputs as a dict'}: "
                        f"pass {label}={example}")
    return ""


def split_problem(rank: int, n: int, microbatches: tuple) -> str:
    """A whole batch that torch's split made fewer than ``n`` microbatches of: a tensor input with
    fewer rows than microbatches along its split dimension gives fewer chunks, silently."""
    counts = [len(mbs) for mbs in microbatches if mbs is not None]
    if all(count == n for count in counts):
        return ""
    return (f"rank {rank}: the whole-batch inputs split into {min(counts)} microbatches, not n_microbatches={n}: "
            f"a tensor input has fewer than {n} rows along its split dimension; give every tensor input the "
            "batch's rows, or pass the microbatches (arg_mbs=, kwarg_mbs=, target_mbs=)")


def cross_rank_problem(place: Placement, table: torch.Tensor) -> str:
    """Problems only visible across ranks, from every rank's ``[problem, holds_last, passes_target,
    batch size]`` row (the same on every rank, so every rank finds the same)."""
    holds_last = [r for r in range(place.pp_size) if table[r, 1]]
    with_target = [r for r in holds_last if table[r, 2]]
    if with_target and len(with_target) != len(holds_last):
        return (f"{place.schedule}: {len(with_target)} of the {len(holds_last)} ranks holding a last stage passed "
                f"target=; pass it on all of them (ranks {holds_last}) or on none")
    sizes = {r: int(table[r, 3]) for r in range(place.pp_size) if table[r, 3] >= 0}
    if len(set(sizes.values())) > 1:
        shown = ", ".join(f"rank {r}: {s} samples" for r, s in sizes.items())
        return (f"{place.schedule}: the ranks that pass the batch pass different ones ({shown}); "
                + ("each direction takes half of the microbatches from its end, and both ends pass the whole batch: "
                   "pass the same batch on ranks 0 and pp-1" if place.bidirectional else "pass one batch"))
    return ""


def input_signature(*values: Any) -> tuple:
    """What of a step's inputs the pipeline depends on: each tensor's shape and dtype, the place of
    every other value (``None`` included) in its structure."""
    leaves, spec = tree_flatten(values)
    return str(spec), tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__
                            for v in leaves)


def microbatch_signature(arg_mbs: list, kwarg_mbs: list, target_mbs: list | None) -> tuple:
    """Each microbatch's :func:`input_signature` (positional inputs, keyword inputs, target): the
    same whether the step split the whole batch or was given the microbatches, as the pipeline
    sees only microbatches."""
    targets = target_mbs if target_mbs is not None else [None] * len(arg_mbs)
    return tuple(input_signature(tuple(args), dict(sorted(kwargs.items())), target)  # keywords in any order
                 for args, kwargs, target in zip(arg_mbs, kwarg_mbs, targets, strict=True))


def changed_inputs_problem(rank: int, first: tuple, now: tuple) -> str:
    """Microbatches unlike the first step's (:func:`microbatch_signature`): ranks agree on their inputs
    at a mode's first step only. Names the first microbatch that changed."""
    mb = next((i for i, (a, b) in enumerate(zip(first, now)) if a != b), None)
    if mb is None:
        return ""
    then, later = first[mb], now[mb]
    if then[1] == later[1]:  # the same tensors, in another structure
        shown = f"input structure {then[0]} then, {later[0]} now"
    else:
        shown = f"tensor shapes and dtypes {_shown(then)} then, {_shown(later)} now"
    return (f"rank {rank}: this step's inputs differ from the first step's (microbatch {mb}: {shown}); a "
            "schedule's stages take the shapes of its first step (and eval()'s of its first eval), and its ranks "
            "check their inputs together only then: "
            "pass inputs of the same shapes every step, or build new stages and a new schedule for new shapes")


def _shown(signature: tuple) -> str:
    return "[" + ", ".join(f"{tuple(v[0])} {str(v[1]).removeprefix('torch.')}" if isinstance(v, tuple) else v
                           for v in signature[1]) + "]"
