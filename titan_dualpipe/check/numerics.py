"""Pipelined training against a single-process reference, on any device and backend.

Each rank builds the reference model (the whole TinyLM) and its own pipeline stages from the
same seed, trains ``steps`` steps with an Adam step between, and compares every microbatch
loss and every parameter gradient of its stages with the reference (``RTOL``, ``ATOL``);
DualPipe's twin copies must end bit-identical. Used by the test suite, by ``titan-dualpipe
check`` on a user's machine, and by the GPU tests.

A mismatch never stops a rank early: it runs every step (and the twins' gather) like its
peers and raises the first mismatch at the end, so a mismatch seen on one rank only cannot
leave the others blocked in the next step's communication.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from .. import ScheduleDualPipe, ScheduleDualPipeV, placement
from .._compat.compile import compiler_fn
from .._compat.pipelining import _format_pipeline_order
from ..orders import Placement
from ..cut import cut_layers
from ..testing.model import TinyLM, compile_blocks, lm_loss

SCHEDULES: dict[str, type] = {"DualPipeV": ScheduleDualPipeV, "DualPipe": ScheduleDualPipe}
RTOL, ATOL = 1e-5, 4e-5
VOCAB, SEQ, MB_SIZE = 64, 8, 2


def batch(step: int, n: int, dp_index: int = 0, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch of ``n`` microbatches for data-parallel replica ``dp_index``."""
    g = torch.Generator().manual_seed(1000 * step + dp_index)
    x = torch.randint(0, VOCAB, (n * MB_SIZE, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (n * MB_SIZE, SEQ), generator=g)
    return x.to(device), y.to(device)


def reference_step(model: TinyLM, x: torch.Tensor, y: torch.Tensor, n: int, scale_grads: bool) -> list[float]:
    """Per-microbatch losses; accumulates the gradient of their mean (or sum) into model."""
    losses = [lm_loss(model(xm), ym) for xm, ym in zip(x.chunk(n), y.chunk(n))]
    total = torch.stack(losses).sum()
    (total / n if scale_grads else total).backward()
    return [loss.item() for loss in losses]


def replicas_reference_step(model: TinyLM, step: int, n: int, dp_index: int, dp_size: int,
                            device: torch.device | str, scale_grads: bool) -> list[float]:
    """The reference step over every data-parallel replica's batch (gradients averaged over
    replicas); replica ``dp_index``'s losses."""
    mine: list[float] = []
    for d in range(dp_size):
        losses = reference_step(model, *batch(step, n, d, device), n, scale_grads)
        mine = losses if d == dp_index else mine
    if dp_size > 1:
        for p in model.parameters():
            p.grad /= dp_size
    return mine


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2) gathered, any other tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


ScheduleFactory = Callable[..., Any]


class GraphCounter:
    """A torch.compile backend that compiles each graph as ``backend`` does and counts them: a
    stage whose blocks run compiled builds at least one graph (none: they ran eagerly). Each
    counter is a backend of its own, so dynamo compiles anew for it: a process gets at most
    ``torch._dynamo.config.recompile_limit`` (8) of them per compiled code before it falls back
    to eager, so use them in short-lived processes (``check`` runs two compiled cases each)."""

    def __init__(self, backend: str) -> None:
        self.backend, self.graphs, self._compile = backend, 0, compiler_fn(backend)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable[..., Any]:
        self.graphs += 1
        return self._compile(graph, example_inputs, **kwargs)


def build_pipeline(schedule: str, pp: int, n: int, group: dist.ProcessGroup | None, pp_rank: int, *,
                   device: torch.device | str = "cpu", perturb_twins: bool = True, fsdp_mesh: Any = None,
                   parallelize: Callable[[torch.nn.Module], None] | None = None,
                   compile_backend: str | None = None, compile_reference: bool = True,
                   graphs: dict[int, GraphCounter] | None = None, factory: ScheduleFactory | None = None,
                   **schedule_kwargs: Any):
    """Reference model, this rank's two stage modules ``{stage: module}``, and the schedule.

    ``factory(stages, n, **kwargs)`` builds the schedule (default: our class for ``schedule``).
    DualPipe's direction-1 copies start perturbed, so the first step must make twins equal.
    ``parallelize(module)`` runs on each stage module before FSDP (tensor parallelism, say).
    ``compile_backend`` compiles the stages' blocks in place before FSDP (torchtitan's order),
    and the reference's the same way unless ``compile_reference`` is False. With ``graphs``, each
    stage's blocks compile with a :class:`GraphCounter` of their own, put in ``graphs``.
    """
    device = torch.device(device)
    torch.manual_seed(0)
    place = placement(schedule, pp, n)
    n_parts = place.num_stages if schedule == "DualPipeV" else pp
    full_model = TinyLM(vocab=VOCAB, dim=16, layers=max(n_parts, 2), heads=2)
    parts = cut_layers(full_model, n_parts)
    # in model-part order: full-tensor gathers of folded twins then run in the same order on every rank
    modules = {s: copy.deepcopy(parts[place.model_part(s)]).to(device)
               for s in sorted(place.stages_of(pp_rank), key=place.model_part)}
    if perturb_twins and place.bidirectional:
        with torch.no_grad():
            for p in modules[place.stages_of(pp_rank)[1]].parameters():
                p.add_(0.5)
    for module in modules.values() if parallelize is not None else ():
        parallelize(module)
    if compile_backend:
        counters = {s: GraphCounter(compile_backend) for s in modules} if graphs is not None else {}
        for s, module in modules.items():
            compile_blocks(module.layers.values(), counters.get(s, compile_backend))  # type: ignore[arg-type]
        if compile_reference:
            compile_blocks(full_model.layers.values(), compile_backend)
        if graphs is not None:
            graphs.update(counters)
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for module in modules.values():
            for layer in module.layers.values():
                fully_shard(layer, mesh=fsdp_mesh)
            fully_shard(module, mesh=fsdp_mesh)
    stages = [PipelineStage(modules[s], s, place.num_stages, device, group=group) for s in place.stages_of(pp_rank)]
    build = factory or SCHEDULES[schedule]
    return full_model.to(device), modules, build(stages, n, loss_fn=lm_loss, **schedule_kwargs)


Tolerance = tuple[float, float]  # (rtol, atol)


def grad_error(modules: dict[int, torch.nn.Module], reference: TinyLM, label: str,
               tolerance: Tolerance = (RTOL, ATOL)) -> float:
    """Largest gradient difference to the reference; AssertionError beyond ``tolerance``."""
    ref = dict(reference.named_parameters())
    # gather every gradient (a collective under FSDP) before comparing any: a mismatch on this
    # rank must not leave its data-parallel peers in a gather it skipped
    grads = [(s, name, None if p.grad is None else full(p.grad))
             for s, module in modules.items() for name, p in module.named_parameters()]
    worst = 0.0
    for s, name, got in grads:
        assert got is not None, f"{label}: stage {s} {name} has no gradient"
        want = ref[name].grad
        torch.testing.assert_close(got, want, rtol=tolerance[0], atol=tolerance[1],
                                   msg=lambda m: f"{label}: stage {s} {name}: {m}")
        worst = max(worst, (got - want).abs().max().item())
    return worst


def twins_identical(modules: dict[int, torch.nn.Module], place: Placement, group: dist.ProcessGroup | None) -> int:
    """Gather both copies of every DualPipe part and require bitwise equality; the part count."""
    mine = {s: [full(p).detach().cpu() for p in m.parameters()] for s, m in modules.items()}
    everyone: list = [None] * place.pp_size
    dist.all_gather_object(everyone, mine, group=group)
    copies: dict[int, list] = {}
    for stages in everyone:
        for s, tensors in stages.items():
            copies.setdefault(place.model_part(s), []).append(tensors)
    for part, (a, b) in copies.items():
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"twins of part {part} differ by {(x - y).abs().max().item()}"
    return len(copies)


def loss_error(got: list[torch.Tensor], want: list[float], n: int, tolerance: Tolerance = (RTOL, ATOL)) -> float:
    """Largest microbatch-loss difference to the reference; AssertionError beyond ``tolerance``."""
    values = [loss.item() for loss in got]
    assert len(values) == n, f"expected {n} losses, got {len(values)}"
    torch.testing.assert_close(torch.tensor(values), torch.tensor(want), rtol=tolerance[0], atol=tolerance[1])
    return max(abs(a - b) for a, b in zip(values, want))


def _compared(mismatches: list[str], compare: Callable[[], float]) -> float:
    """``compare()``, or 0.0 with its AssertionError kept in ``mismatches``: this rank goes on."""
    try:
        return compare()
    except AssertionError as err:
        mismatches.append(str(err))
        return 0.0


@contextmanager
def _grad_off(modules: dict[int, torch.nn.Module], amount: float) -> Iterator[None]:
    """This rank's first gradient off by ``amount`` inside the block, restored bit for bit
    after it: a mismatch this rank alone sees (tests of the failure path)."""
    grad = next(p for m in modules.values() for p in m.parameters()).grad if amount else None
    saved = grad.clone() if grad is not None else None
    with torch.no_grad():
        if grad is not None:
            grad.add_(amount)
        try:
            yield
        finally:
            if grad is not None:
                grad.copy_(saved)


def train_and_compare(schedule: str, pp: int, n: int, group: dist.ProcessGroup | None, pp_rank: int, *,
                      dp_index: int = 0, dp_size: int = 1, device: torch.device | str = "cpu", fsdp_mesh: Any = None,
                      scale_grads: bool = True, steps: int = 2, factory: ScheduleFactory | None = None,
                      perturb_twins: bool = True, grad_fault: float = 0.0, tolerance: Tolerance = (RTOL, ATOL),
                      count_graphs: bool = False, **schedule_kwargs: Any) -> dict[str, Any]:
    """``steps`` training steps with Adam between, checked against the reference on every rank.

    Data-parallel replicas (``dp_size`` > 1, FSDP over ``fsdp_mesh``) see different batches; the
    reference averages their gradients. Returns ``grad_err``, ``loss_err``, ``losses_checked``,
    for DualPipe ``twin_parts`` and, with ``compile_backend`` and ``count_graphs``,
    ``compiled_graphs`` (the graphs each stage built, see :class:`GraphCounter`; none, a stage
    that ran eagerly, is a mismatch); raises AssertionError (the first mismatch, with the
    order) after the last step. ``grad_fault`` is added to this rank's first gradient for the
    comparison only, every step (tests of the failure path).
    """
    graphs: dict[int, GraphCounter] | None = {} if count_graphs else None
    reference, modules, sched = build_pipeline(schedule, pp, n, group, pp_rank, device=device, fsdp_mesh=fsdp_mesh,
                                               perturb_twins=perturb_twins, factory=factory, scale_grads=scale_grads,
                                               graphs=graphs, **schedule_kwargs)
    place = placement(schedule, pp, n)
    opt = torch.optim.Adam([p for m in modules.values() for p in m.parameters()], lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    holds_loss = any(place.is_last(s) for s in modules)
    result: dict[str, Any] = {"grad_err": 0.0, "loss_err": 0.0, "losses_checked": 0}
    mismatches: list[str] = []
    try:
        for step in range(steps):
            x, y = batch(step, n, dp_index, device)
            losses: list = []
            sched.step(x, target=y, losses=losses) if place.feeds_batch(pp_rank) else sched.step()
            want_losses = replicas_reference_step(reference, step, n, dp_index, dp_size, device, scale_grads)
            if holds_loss:
                err = _compared(mismatches, lambda: loss_error(losses, want_losses, n, tolerance))
                result["loss_err"] = max(result["loss_err"], err)
                result["losses_checked"] += n
            with _grad_off(modules, grad_fault):
                err = _compared(mismatches, lambda: grad_error(modules, reference, f"step {step}", tolerance))
            result["grad_err"] = max(result["grad_err"], err)
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
        if place.bidirectional:
            result["twin_parts"] = _compared(mismatches, lambda: twins_identical(modules, place, group))
        if graphs:
            result["compiled_graphs"] = {s: counter.graphs for s, counter in graphs.items()}
            mismatches += [f"stage {s}: its blocks ran eagerly, torch.compile ({counter.backend}) built no graph "
                           "(dynamo skipped their frames: under a dispatch mode that does not ignore compile "
                           "internals, or past the recompile limit)"
                           for s, counter in graphs.items() if counter.graphs == 0]
        assert not mismatches, mismatches[0]
    except AssertionError as err:
        raise AssertionError(f"{err}\n{schedule} pp={pp} n={n}, pipeline rank {pp_rank}; order:\n"
                             f"{_format_pipeline_order(sched.pipeline_order)}") from None
    return result
