"""The autograd contract's differential harness: cases run on every rank of a WorkerPool.

One table of autograd features (:data:`FEATURES`). Each feature runs under both schedules, every
backward path (:data:`PATHS`: whole backwards; I + W with deferred weight GEMMs; relayed pairs and
protocol pairs, whose full backwards compute their weight GEMMs while their exchanges fly; relayed
pairs with those GEMMs as fillers, ``weight_gemms_in_flight="fill"``, or started with their
backward half, ``pair_first="backward"``, both AC none and full; relayed pairs whose small weight
GEMMs stay with autograd, ``min_weight_gemm_flops``; two-batch halves) and every activation-checkpointing mode, two training steps with an Adam step between,
against plain autograd: per-microbatch losses and every parameter's gradient on every rank, and
what the feature's hooks saw. DualPipeV also runs torch's ``ScheduleDualPipeV`` on the same model
where torch's trains it, and compares gradients with it.

The model: ``2 * pp`` parts (DualPipeV) or ``pp`` parts (DualPipe) of a small residual MLP. Each
part's block posts a stand-in expert-parallel exchange (a hand-over point, forward and backward)
on the paths that overlap, so relayed pairs switch halves there and full backwards run their
weight GEMMs in flight, inside checkpointed regions too; on the fillers' path it arrives as soon
as posted, and says so. One feature ends each block in a real MoE block
(:mod:`titan_dualpipe.overlap.moe`), its experts split over two expert-parallel ranks and its
exchanges cut in two, which a pipeline with whole exchanges must match bit for bit. Data-, tensor-
and expert-parallel features run pp 2 x 2; a combination the schedules refuse must raise the same
PipelineConfigError on every rank before the first step. :func:`failure_named_on_every_rank` is
the failure path.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time
from datetime import timedelta
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titan_dualpipe import ScheduleDualPipe, ScheduleDualPipeV, placement
from titan_dualpipe.overlap.comm import ExpertParallelComm
from titan_dualpipe.overlap.moe import MoEArgs, TransformerBlock, expert_parallel, set_exchange_chunks
from titan_dualpipe.overlap.relay import hand_over
from titan_dualpipe.runtime.sub_batch_runner import register_exchange_rule
from titan_dualpipe.weights.in_flight import fill_before_wait

from cases.layout import pipeline_ranks

DIM, ROWS, SEQ = 8, 2, 3  # ROWS: a microbatch's batch (two-batch halves need 2)
# (pp, microbatches) of each schedule: DualPipe's I actions start at pp 4 (at pp 2 its only I is a
# chain's first stage's, which has no weight GEMMs to leave)
LAYOUT = {"DualPipeV": (2, 4), "DualPipe": (4, 8)}
WORLD = 4
AC_MODES = ("none", "full", "selective")
# torch's ScheduleDualPipeV splits a backward into I and W, two autograd passes: a selective-AC
# region refuses the second ("Trying to backward an extra time")
TORCH_AC_MODES = ("none", "full")
SMALL_GEMM_FLOPS = 1000  # the small_gemms path's least FLOPs of a deferred weight GEMM
# features whose trained weight GEMMs are all under it (frozen layers' rank-2 adapters): none waits
ALL_SMALL = frozenset({"frozen_with_adapters"})
# ... and those whose small GEMM is no deferrable one (a parametrized weight goes through autograd anyway)
NONE_SMALL = frozenset({"parametrizations"})
FP32 = (1e-5, 4e-5)  # (rtol, atol): the project's tolerance
BF16 = (3e-2, 3e-2)  # autocast's bfloat16 GEMMs, summed over microbatches in another order


# -- the model --------------------------------------------------------------------------------------

class _Exchange(torch.autograd.Function):
    """Identity that hands over in its forward and its backward, as an expert all-to-all does
    between posting and waiting. ``known``: it says when it arrives, as the CPU's emulated network
    does (here as soon as posted: no latency), which fillers go by; else unknown, as on a GPU."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, known: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.known = known
        hand_over(ready_at=_arrival(known))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ready_at = _arrival(ctx.known)
        hand_over(backward=True, ready_at=ready_at)
        fill_before_wait(ready_at)
        return grad, None


def _arrival(known: bool) -> float | None:
    return time.perf_counter() if known else None


class Part(nn.Module):
    """A linear layer, then a residual MLP block (the activation-checkpointed region, holding the
    exchange, and a MoE block where a feature adds one). ``options`` switch the features that change
    the forward."""

    arrivals_known = False  # its stand-in exchanges say when they arrive

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.inp = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, 2 * DIM)
        self.w2 = nn.Linear(2 * DIM, DIM)
        self.ac = "none"
        self.posts_exchanges = False
        self.options: frozenset[str] = frozenset()
        self.moe: nn.Module | None = None

    def block(self, h: torch.Tensor) -> torch.Tensor:
        if "nested_checkpoint" in self.options:
            x = checkpoint(lambda t: F.gelu(self.w1(self.norm(t))), h, use_reentrant=False)
        else:
            x = F.gelu(self.w1(self.norm(h)))
        if self.posts_exchanges:
            x = _Exchange.apply(x, self.arrivals_known)
        h = h + self.w2(x)
        return h if self.moe is None else self.moe(h)

    def body(self, h: torch.Tensor) -> torch.Tensor:
        h = self.inp(h)
        if "reused_layer" in self.options:
            h = self.inp(F.gelu(h))
        if self.ac == "none":
            return self.block(h)
        if self.ac == "selective":
            return checkpoint(self.block, h, use_reentrant=False, context_fn=_selective_context)
        return checkpoint(self.block, h, use_reentrant="reentrant_checkpoint" in self.options)

    def forward(self, h: torch.Tensor, aux: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> Any:
        if aux is not None:  # an input that needs no gradient, from the previous part
            h = h * aux
        if scale is not None and self.index == 0:  # a keyword input of step()
            h = h * scale
        if "autocast_forward" in self.options:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.body(h).float()
        else:
            h = self.body(h)
        if "input_without_grad" in self.options and not self.last:
            return h, (h.detach().abs() + 1).reciprocal()
        return h

    @property
    def last(self) -> bool:
        return bool(getattr(self, "is_last_part", False))


class ProtocolPart(Part):
    """A part that runs its pairs itself (the overlap protocol): the backward half, then the forward half."""

    @classmethod
    def overlapped_forward_backward(cls, forward_module, forward_args, forward_kwargs, backward_module,
                                    backward_inputs, backward_outputs, backward_output_grads):
        torch.autograd.backward(backward_outputs, backward_output_grads)
        return Part.forward(forward_module, *forward_args, **forward_kwargs)  # the module's own forward


class ArrivingPart(Part):
    """A part whose exchanges arrive as soon as they are posted, and say so: as fillers, a relayed
    backward finds no time before its partner's exchange, and leaves its weight GEMMs to its end."""

    arrivals_known = True


register_exchange_rule(lambda module: isinstance(module, Part) and module.posts_exchanges)


def _save_matmuls(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_selective_context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).square().mean()


def _batch(step: int, n: int, replica: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + 10 * step + replica)
    x = torch.randn(n * ROWS, SEQ, DIM, generator=g)
    return x, torch.randn(n * ROWS, SEQ, DIM, generator=g), torch.rand(n * ROWS, 1, 1, generator=g) + 0.5


# -- the features -----------------------------------------------------------------------------------

class Records:
    """What a feature's hooks saw, by name (a parameter's or a part's)."""

    def __init__(self) -> None:
        self.seen: dict[str, list[torch.Tensor]] = {}
        self.post_none = 0  # post-accumulate-grad hook calls that found no .grad

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.seen.setdefault(name, []).append(tensor.detach().clone())

    def clear(self) -> None:
        self.seen.clear()


@dataclasses.dataclass(frozen=True)
class Feature:
    """One autograd feature: how it changes the parts (every copy: ours, the reference, torch's), the
    context around each step (and the reference's), the tolerance, and whether torch's
    ``ScheduleDualPipeV`` trains it (else why not)."""

    prepare: Callable[[list[Part], Records], None] = lambda parts, records: None  # before the stages' copies
    hooks: Callable[[list[Part], Records], None] = lambda parts, records: None  # on the modules that run
    context: Callable[[], ContextManager] = contextlib.nullcontext
    tolerance: tuple[float, float] = FP32
    torch_fails: str = ""  # why torch's ScheduleDualPipeV cannot train it; "" when it does
    torch_fails_on: frozenset = frozenset()  # ... only on these (major, minor) releases (checked), else everywhere

    def torch_trains(self) -> bool:
        from titan_dualpipe._compat import TORCH_VERSION

        return not self.torch_fails or bool(self.torch_fails_on) and TORCH_VERSION not in self.torch_fails_on
    records: str = ""  # what the hooks saw: "tensor" (a gradient each), "post" (.grad after each), "module"
    kwargs: bool = False  # step() gets a keyword input (the first part reads it)
    schedules: tuple[str, ...] = ("DualPipeV", "DualPipe")
    ac_modes: tuple[str, ...] = AC_MODES
    other_paths: tuple[str, str] = ("", "")  # (path, why plain autograd's records differ there by design)
    static_shapes: str = ""  # why the stages declare their shapes (input_args/output_args) instead of inferring them
    data_parallel: Callable[[nn.Module, Any], None] | None = None  # wraps each stage module over a dp group of 2
    tensor_parallel: Callable[[nn.Module, Any], None] | None = None  # shards each stage module over a tp group of 2
    # splits each stage module's experts over an expert-parallel group of 2, each rank its own batch
    expert_parallel: Callable[[nn.Module, Any], None] | None = None
    # changes the parts of a second pipeline, stepped beside the first, that must give its losses and
    # gradients bit for bit
    bitwise_twin: Callable[[list[Part]], None] | None = None
    options: dict = dataclasses.field(default_factory=dict)  # schedule options it needs
    refused: str = ""  # a combination the schedules refuse: words of the PipelineConfigError every rank raises

    def layout(self, schedule: str) -> tuple[int, int, int]:
        """(pp, microbatches, width) of its runs: data, tensor or expert parallelism takes pp 2 x 2."""
        pp, n = LAYOUT[schedule]
        return (2, 4, 2) if self.data_parallel or self.tensor_parallel or self.expert_parallel else (pp, n, 1)

    def own_batches(self) -> bool:
        """Whether the ranks of the second dimension feed batches of their own (tensor parallel ranks share one)."""
        return bool(self.data_parallel or self.expert_parallel)

    def parallelize(self, module: nn.Module, group: Any) -> None:
        for wrap in (self.data_parallel, self.tensor_parallel, self.expert_parallel):
            if wrap is not None:
                wrap(module, group)

    def runs(self, schedule: str, path: str, ac: str) -> bool:
        if self.refused:  # refused before the first step, whatever the path
            return schedule in self.schedules and path == "I+W" and ac == "none"
        return (schedule in self.schedules and ac in self.ac_modes and ac in PATH_AC_MODES.get(path, AC_MODES)
                and path != self.other_paths[0])


def _options(*names: str) -> Callable[[list[Part], Records], None]:
    def prepare(parts: list[Part], records: Records) -> None:
        for part in parts:
            part.options = part.options | set(names)
    return prepare


def _linear_weights(parts: list[Part]) -> Iterator[tuple[str, nn.Parameter]]:
    for part in parts:
        for name, module in part.named_modules():
            if isinstance(module, nn.Linear) and module.weight.requires_grad:
                yield f"{part.index}.{name}.weight", module.weight


def _tensor_hooks(parts: list[Part], records: Records) -> None:
    def hook(name: str, grad: torch.Tensor) -> torch.Tensor:
        records.add(name, grad)
        return grad * 2  # what the hook returns is what accumulates

    for name, weight in _linear_weights(parts):
        weight.register_hook(functools.partial(hook, name))


def _post_accumulate_hooks(parts: list[Part], records: Records) -> None:
    def hook(name: str, param: torch.Tensor) -> None:
        if param.grad is None:
            records.post_none += 1
        else:
            records.add(name, param.grad)

    for name, weight in _linear_weights(parts):
        weight.register_post_accumulate_grad_hook(functools.partial(hook, name))


def _module_backward_hooks(parts: list[Part], records: Records) -> None:
    for part in parts:
        part.w2.register_full_backward_hook(
            lambda module, grad_input, grad_output, name=f"{part.index}.w2": records.add(name, grad_output[0]))


class _Adapter(nn.Module):
    """A frozen base layer plus a low-rank adapter that trains."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, 2, bias=False)
        self.up = nn.Linear(2, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _frozen_with_adapters(parts: list[Part], records: Records) -> None:
    for part in parts:
        part.w1, part.w2 = _Adapter(part.w1), _Adapter(part.w2)


def _parametrized(parts: list[Part], records: Records) -> None:
    for part in parts:
        nn.utils.parametrizations.weight_norm(part.w1)
        nn.utils.parametrize.register_parametrization(part.inp, "weight", _Symmetric())


class _Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return (w + w.t()) / 2


def _tied_across_stages(parts: list[Part], records: Records) -> None:
    """The first part's input layer and the last part's share one weight (the first and last
    stages live on one rank under DualPipeV)."""
    parts[-1].inp.weight = parts[0].inp.weight


def _autocast_step() -> ContextManager:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _autocast_step_fp16() -> ContextManager:
    """CUDA's default autocast dtype, float16, on the CPU (CPU autocast takes it too): the stand-in
    for a GPU's autocast where no GPU is lent."""
    return torch.autocast("cpu", dtype=torch.float16)


def _replicate_ddp(module: nn.Module, group: Any) -> None:
    from torch.distributed._composable import replicate

    replicate(module, process_group=group)


def _replicate_fsdp(module: nn.Module, group: Any) -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import DeviceMesh

    replicate(module, mesh=DeviceMesh.from_group(group, "cpu"))


def _tensor_parallel(module: nn.Module, group: Any) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(module, DeviceMesh.from_group(group, "cpu"), {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


def _compiled_with_tensor_hooks(parts: list[Part], records: Records) -> None:
    """Linear layers compiled in place (after the stages' copies: a deep copy is not compiled), with hooks."""
    for part in parts:
        for linear in (part.w1, part.w2):
            linear.compile(backend="eager")
    _tensor_hooks(parts, records)


MOE = MoEArgs(dim=DIM, n_heads=2, num_experts=4, top_k=2, moe_inter_dim=2 * DIM, exchange_chunks=2)


def _moe_blocks(parts: list[Part], records: Records) -> None:
    """Each part ends in a MoE transformer block, its dispatch and combine cut into two exchanges each."""
    for part in parts:
        part.moe = TransformerBlock(MOE)


def _split_experts(module: nn.Module, group: Any) -> None:
    expert_parallel(module, _expert_comm(group))


@functools.lru_cache(maxsize=None)
def _expert_comm(group: Any) -> ExpertParallelComm:
    """One per group: a rank's stage modules share it."""
    return ExpertParallelComm(group)


def _whole_exchanges(parts: list[Part]) -> None:
    for part in parts:
        set_exchange_chunks(part, 1)


FEATURES: dict[str, Feature] = {
    "plain": Feature(),
    "autocast_around_step": Feature(context=_autocast_step, tolerance=BF16),
    "autocast_inside_forward": Feature(prepare=_options("autocast_forward"), tolerance=BF16),
    "autocast_float16_around_step": Feature(context=_autocast_step_fp16, tolerance=BF16),
    "tensor_hooks": Feature(hooks=_tensor_hooks, records="tensor"),
    "post_accumulate_hooks": Feature(hooks=_post_accumulate_hooks, records="post",
                                     torch_fails="its split W assigns .grad without autograd: the hooks miss it"),
    "module_backward_hooks": Feature(hooks=_module_backward_hooks, records="module", other_paths=(
        "two_batch", "two-batch halves call a module twice, on half batches: its hooks run per call")),
    "frozen_with_adapters": Feature(prepare=_frozen_with_adapters),
    "parametrizations": Feature(prepare=_parametrized),
    "reused_layer": Feature(prepare=_options("reused_layer"), torch_fails_on=frozenset({(2, 11)}), torch_fails=(
        "torch 2.11's gives the reused weight another gradient than autograd's (2.13's matches)")),
    "tied_across_stages": Feature(prepare=_tied_across_stages, torch_fails=(
        "its REDUCE_GRAD divides a weight two stages hold once per stage")),
    "nested_checkpoint": Feature(prepare=_options("nested_checkpoint"), ac_modes=("full", "selective")),
    "reentrant_checkpoint": Feature(prepare=_options("reentrant_checkpoint"), ac_modes=("full",), static_shapes=(
        "torch's shape inference backpropagates through torch.autograd.grad, which a reentrant checkpoint refuses"),
        torch_fails="its split backward fails in a reentrant checkpoint's own backward (\"grad can be implicitly "
                    "created only for scalar outputs\")"),
    "input_without_grad": Feature(prepare=_options("input_without_grad"), torch_fails_on=frozenset({(2, 11)}),
                                  torch_fails="torch 2.11's backpropagates the output that needs no gradient: "
                                              "\"element 1 of tensors does not require grad\""),
    "keyword_inputs": Feature(kwargs=True),
    "replicate_ddp": Feature(data_parallel=_replicate_ddp, refused="torch.distributed._composable.replicate"),
    "compiled_deferred_with_hooks": Feature(hooks=_compiled_with_tensor_hooks,
                                            options={"weight_gradients": "deferred_compiled"},
                                            refused="inside compiled blocks have gradient hooks"),
    "replicate_fsdp": Feature(data_parallel=_replicate_fsdp),
    "dtensor_weights": Feature(tensor_parallel=_tensor_parallel),
    # chunked exchanges change no bit: a pipeline with whole ones steps beside it. Two pipelines over real
    # exchanges take 10-20 times a plain combination's time: DualPipeV only (test_overlap runs chunks under
    # DualPipe), without selective AC
    "moe_chunked_exchanges": Feature(prepare=_moe_blocks, expert_parallel=_split_experts,
                                     bitwise_twin=_whole_exchanges, schedules=("DualPipeV",),
                                     ac_modes=("none", "full")),
}

# backward paths: the schedule options, the part class, whether parts post exchanges
PATHS: dict[str, tuple[dict, type, bool]] = {
    "whole": ({"weight_gradients": "whole", "overlap": False}, Part, False),
    "I+W": ({"overlap": False}, Part, False),
    "relay": ({"overlap": True}, Part, True),
    "relay_fill": ({"overlap": True, "weight_gemms_in_flight": "fill"}, ArrivingPart, True),
    # every relayed pair started with its backward half (docs/overlap.md#which-half-first)
    "relay_backward_first": ({"overlap": True, "pair_first": "backward"}, Part, True),
    # adjacent lone actions of one direction relayed as pairs (docs/overlap.md#lone-pairs)
    "relay_lone_pairs": ({"overlap": True, "lone_pairs": True}, Part, True),
    # the relay with the parts' first layer (2 x 6 tokens x 8 x 8 = 768 FLOPs) under the least FLOPs of
    # a deferred GEMM, its block's (1,536) over: at I and in flight, some GEMMs wait, some do not
    "small_gemms": ({"overlap": True, "min_weight_gemm_flops": SMALL_GEMM_FLOPS}, Part, True),
    "protocol": ({"overlap": True}, ProtocolPart, True),
    "two_batch": ({"overlap": True, "two_batch_overlap": "all"}, Part, True),
}
TORCH_PATH = ({}, Part, False)  # torch's ScheduleDualPipeV
# Under AC a relayed backward's recomputation lets its partner end first, and with no partner waiting
# fillers compute what the relay path does: selective AC would repeat full's case
PATH_AC_MODES = {"relay_fill": ("none", "full"), "relay_backward_first": ("none", "full"),
                 "relay_lone_pairs": ("none", "full")}


# -- one run --------------------------------------------------------------------------------------

def _schedule_class(schedule: str, path: str) -> type:
    if path == "torch":  # torch's own DualPipeV, against the same reference
        from torch.distributed.pipelining import ScheduleDualPipeV as TorchDualPipeV

        return TorchDualPipeV
    return ScheduleDualPipeV if schedule == "DualPipeV" else ScheduleDualPipe


def _parts(schedule: str, feature: Feature, ac: str, part_class: type, exchanges: bool, records: Records) -> list[Part]:
    torch.manual_seed(0)
    pp, _, _ = feature.layout(schedule)
    parts = [Part(i) for i in range(2 * pp if schedule == "DualPipeV" else pp)]
    for part in parts:
        part.__class__ = part_class
        part.ac, part.posts_exchanges = ac, exchanges
    parts[-1].is_last_part = True
    feature.prepare(parts, records)
    return parts


def _reference(parts: list[Part], step: int, feature: Feature, n: int, dp: int, replica: int
               ) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Plain autograd, one backward per microbatch (as every pipeline runs them), over every data-parallel
    replica's batch: ``replica``'s losses, and each of its microbatches' gradient of every parameter
    (taken from ``.grad`` after its backward). The parameters end with the gradient the pipeline
    gives: summed over microbatches, divided by ``n`` (``scale_grads``), averaged over replicas."""
    mine: tuple[list[float], list[dict[str, torch.Tensor]]] = ([], [])
    params = {f"{p.index}.{name}": w for p in parts for name, w in p.named_parameters()}
    for d in range(dp):
        x, y, scale = _batch(step, n, d)
        losses, per_microbatch = [], []
        before = {name: (p.grad.clone() if p.grad is not None else None) for name, p in params.items()}
        for mb in range(n):
            rows = slice(mb * ROWS, (mb + 1) * ROWS)
            with feature.context():
                h: Any = x[rows]
                aux = None
                kwargs = {"scale": scale[rows]} if feature.kwargs else {}
                for part in parts:
                    out = part(h, aux, **kwargs) if aux is not None else part(h, **kwargs)
                    h, aux = out if isinstance(out, tuple) else (out, None)
                loss = loss_fn(h, y[rows])
            loss.backward()
            losses.append(loss.item())
            grads = {}
            for name, p in params.items():
                g = p.grad.clone() if p.grad is not None else None
                grads[name] = g if before[name] is None or g is None else g - before[name]
                before[name] = g
            per_microbatch.append(grads)
        if d == replica:
            mine = (losses, per_microbatch)
    for p in {id(p): p for p in params.values()}.values():
        if p.grad is not None:
            p.grad /= n * dp
    return mine


def _stage_modules(parts: list[Part], schedule: str, place: Any, pp_rank: int) -> dict[int, Part]:
    """This rank's stage modules, copied together (a weight tied across them stays tied)."""
    stages = place.stages_of(pp_rank)
    copies = copy.deepcopy([parts[place.model_part(s)] for s in stages])
    return dict(zip(stages, copies))


def _build(cls: type, modules: dict[int, Part], group, place: Any, static_shapes: bool = False, **options: Any):
    from titan_dualpipe._compat.stage_init import runnable_on_gloo

    stages = [PipelineStage(module, s, place.num_stages, torch.device("cpu"), group=group,
                            **(_shapes(module) if static_shapes else {}))
              for s, module in modules.items()]
    schedule = cls(stages, place.n_microbatches, loss_fn=loss_fn, **options)
    return schedule if isinstance(schedule, (ScheduleDualPipeV, ScheduleDualPipe)) else runnable_on_gloo(schedule)


def _shapes(module: Part) -> dict:
    """A stage's declared metadata: one microbatch's example input and output."""
    example = torch.zeros(ROWS, SEQ, DIM)
    with torch.no_grad():
        return {"input_args": (example,), "output_args": (module(example),)}


def _step(sched: Any, place: Any, pp_rank: int, step: int, feature: Feature, replica: int = 0) -> list[torch.Tensor]:
    x, y, scale = _batch(step, place.n_microbatches, replica)
    losses: list = []
    with feature.context():
        if place.feeds_batch(pp_rank):
            sched.step(x, target=y, losses=losses, **({"scale": scale} if feature.kwargs else {}))
        else:
            sched.step()
    return losses


def _compare_grads(modules: dict[int, Part], reference: list[Part], tolerance: tuple[float, float],
                   label: str) -> float:
    worst = 0.0
    ref = {f"{p.index}.{n}": w for p in reference for n, w in p.named_parameters()}
    for s, module in modules.items():
        for name, p in module.named_parameters():
            want = _held(module, name, ref[f"{module.index}.{name}"].grad)
            got = p.grad
            if want is None:
                assert got is None or not got.any(), f"{label}: stage {s} {name} has a gradient, plain autograd none"
                continue
            assert got is not None, f"{label}: stage {s} {name} has no gradient"
            got = _full(got)
            torch.testing.assert_close(got, want, rtol=tolerance[0], atol=tolerance[1],
                                       msg=lambda m: f"{label}: stage {s} {name}: {m}")
            worst = max(worst, (got - want).abs().max().item())
    return worst


def _held(module: Part, name: str, grad: torch.Tensor | None) -> torch.Tensor | None:
    """What this rank holds of plain autograd's gradient: of an expert weight, its own experts'."""
    if grad is None or not _is_expert(name):
        return grad
    moe = module.get_submodule(name.rsplit(".experts.", 1)[0])
    first = moe.comm.rank * moe.num_local_experts
    return grad[first:first + moe.num_local_experts]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _compare_records(records: Records, per_microbatch: list[dict[str, torch.Tensor]], modules: dict[int, Part],
                     place: Any, feature: Feature, label: str) -> int:
    """Each tensor hook call saw one microbatch's whole gradient, each post-accumulate-grad hook call
    found ``.grad`` set and grown by one microbatch's, as often as the stage ran microbatches."""
    checked = 0
    assert records.post_none == 0, f"{label}: {records.post_none} post-accumulate-grad hook calls found .grad None"
    for s, module in modules.items():
        mbs = place.microbatches(s)
        names = [n for n in records.seen if n.startswith(f"{module.index}.")]
        assert names, f"{label}: stage {s}: no hook ran"
        for name in names:
            seen = records.seen[name]
            if feature.records == "post":  # .grad after each accumulation: the increments are the microbatches'
                seen = [b - a for a, b in zip([torch.zeros_like(seen[0])] + seen[:-1], seen)]
            assert len(seen) == len(mbs), f"{label}: {name} on stage {s}: {len(seen)} hook calls, {len(mbs)} microbatches"
            # plain autograd's per-microbatch increments; a tensor hook saw half of one (it doubles what accumulates)
            halved = 0.5 if feature.records == "tensor" else 1.0
            _match(seen, [per_microbatch[mb][name] * halved for mb in mbs], f"{label}: {name} on stage {s}")
            checked += len(seen)
    return checked


def _match(seen: list[torch.Tensor], wanted: list[torch.Tensor], label: str) -> None:
    """Every seen tensor equals a distinct wanted one (the pipeline's order of microbatches is its own)."""
    left = list(range(len(wanted)))
    for i, tensor in enumerate(seen):
        hit = next((j for j in left if torch.allclose(tensor, wanted[j], rtol=FP32[0], atol=FP32[1])), None)
        assert hit is not None, f"{label}: hook call {i} saw a tensor no microbatch of plain autograd gives"
        left.remove(hit)


def contract_run(feature_name: str, schedule: str, path: str, ac: str) -> dict | None:
    """Two steps of ``schedule`` on the ``path`` with ``ac``, against plain autograd (see the module
    docstring); on every rank. Returns the largest gradient difference and what was checked."""
    feature = FEATURES[feature_name]
    pp, n, dp = feature.layout(schedule)
    ranks = _layout(pp, dp)
    if ranks is None:
        return None
    pp_group, pp_rank = ranks.pp_group, ranks.pp_rank
    replicas, replica = (dp, ranks.replica) if feature.own_batches() else (1, 0)
    place = placement(schedule, pp, n)
    options, part_class, exchanges = PATHS[path] if path != "torch" else TORCH_PATH
    ours, ref_records = Records(), Records()
    reference = _parts(schedule, feature, ac, part_class, exchanges, ref_records)
    feature.hooks(reference, ref_records)
    modules = _our_modules(feature, schedule, ac, part_class, exchanges, place, ranks, dp, ours)
    cls = _schedule_class(schedule, path)
    if feature.refused:
        return _refused(feature, lambda: _step(_build(cls, modules, pp_group, place, **options, **feature.options),
                                               place, pp_rank, 0, feature, replica))
    build = functools.partial(_build, cls, group=pp_group, place=place, static_shapes=bool(feature.static_shapes),
                              **options, **feature.options)
    pipelines = [modules]
    if feature.bitwise_twin is not None:
        pipelines.append(_our_modules(feature, schedule, ac, part_class, exchanges, place, ranks, dp, Records(),
                                      twin=True))
    sched, *twin_scheds = [build(ms) for ms in pipelines]
    opts = [torch.optim.Adam([p for m in ms.values() for p in m.parameters()], lr=1e-2) for ms in pipelines]
    ref_opt = torch.optim.Adam([p for part in reference for p in part.parameters()], lr=1e-2)
    label = f"{feature_name} {schedule} {path} ac={ac} rank {dist.get_rank()}"
    result = {"grad_err": 0.0, "losses": 0, "records": 0, "deferred": 0, "in_flight": 0, "bitwise": 0,
              "left_to_autograd": 0}
    mismatches: list[str] = []  # a rank that finds one goes on with its peers, and raises at the end
    for step in range(2):
        ours.clear()
        ref_records.clear()
        losses = _step(sched, place, pp_rank, step, feature, replica)
        want, per_microbatch = _reference(reference, step, feature, n, replicas, replica)
        where = f"{label} step {step}"
        for twin, twin_sched in zip(pipelines[1:], twin_scheds):  # stepped whatever the comparisons find, as its peers
            twin_losses = _step(twin_sched, place, pp_rank, step, feature, replica)
            result["bitwise"] += _checked(mismatches, lambda: _same_bits(modules, losses, twin, twin_losses,
                                                                         where)) or 0
        for ms in pipelines if feature.expert_parallel else ():
            _average_over_expert_ranks(ms, ranks.dp_group)
        if losses:
            _checked(mismatches, lambda: torch.testing.assert_close(
                torch.tensor([float(l) for l in losses]), torch.tensor(want), rtol=feature.tolerance[0],
                atol=feature.tolerance[1], msg=lambda m: f"{where} losses: {m}"))
            result["losses"] += len(losses)
        err = _checked(mismatches, lambda: _compare_grads(modules, reference, feature.tolerance, where))
        result["grad_err"] = max(result["grad_err"], err or 0.0)
        if feature.records == "module":
            if step > 0:  # the first step's stage initialisation backpropagates once more (as torch's schedules)
                result["records"] += _checked(mismatches, lambda: _module_hook_records(ours, ref_records, modules,
                                                                                      place, where)) or 0
        elif feature.records:
            result["records"] += _checked(mismatches, lambda: _compare_records(ours, per_microbatch, modules, place,
                                                                              feature, where)) or 0
        if path != "torch":
            result["deferred"] += sum(sched.weight_policy.queue.ran.values())
            result["in_flight"] += sched.weight_policy.queue.ran_in_flight
            result["left_to_autograd"] += sched.weight_policy.queue.left_to_autograd()
        for o in (*opts, ref_opt):
            o.step()
            o.zero_grad()
    assert not mismatches, mismatches[0]
    return result


def _our_modules(feature: Feature, schedule: str, ac: str, part_class: type, exchanges: bool, place: Any,
                 ranks: "_Ranks", dp: int, records: Records, twin: bool = False) -> dict[int, Part]:
    """This rank's stage modules, hooked and parallelised; ``twin``: with the feature's bitwise twin's change."""
    parts = _parts(schedule, feature, ac, part_class, exchanges, records)
    if twin:
        feature.bitwise_twin(parts)
    modules = _stage_modules(parts, schedule, place, ranks.pp_rank)
    feature.hooks(list(modules.values()), records)
    for module in modules.values() if dp > 1 else ():
        feature.parallelize(module, ranks.dp_group)
    return modules


def _same_bits(modules: dict[int, Part], losses: list, twin: dict[int, Part], twin_losses: list, label: str) -> int:
    """The twin pipeline gave the same losses and raw gradients, bit for bit; how many gradients."""
    assert [float(l) for l in twin_losses] == [float(l) for l in losses], f"{label}: the twin's losses differ"
    compared = 0
    for s, module in modules.items():
        for (name, p), q in zip(module.named_parameters(), twin[s].parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), f"{label}: stage {s} {name}: a gradient in one pipeline only"
            if p.grad is not None:
                a, b = _full(p.grad), _full(q.grad)
                assert torch.equal(a, b), f"{label}: stage {s} {name}: the twin's differs by {(a - b).abs().max()}"
                compared += 1
    return compared


def _average_over_expert_ranks(modules: dict[int, Part], group: Any) -> None:
    """What a data-parallel trainer does over expert-parallel ranks fed their own batches: average the
    replicated weights' gradients; an expert's already sums over both ranks' tokens."""
    size = dist.get_world_size(group)
    named = [(name, p.grad) for module in modules.values() for name, p in module.named_parameters()
             if p.grad is not None]
    replicated = [grad for name, grad in named if not _is_expert(name)]
    flat = torch.cat([grad.flatten() for grad in replicated])  # one collective, not one per weight
    dist.all_reduce(flat, group=group)
    for grad, summed in zip(replicated, flat.split([grad.numel() for grad in replicated])):
        grad.copy_(summed.view_as(grad))
    for _, grad in named:
        grad /= size


def _is_expert(name: str) -> bool:
    return ".experts." in name


@dataclasses.dataclass(frozen=True)
class _Ranks:
    """This rank's place in a pp x dp layout of the first ``pp * dp`` ranks (rank = pp index * dp + replica)."""

    pp_group: Any
    pp_rank: int
    dp_group: Any
    replica: int


@functools.lru_cache(maxsize=None)
def _layout(pp: int, dp: int) -> _Ranks | None:
    """Every rank creates every group of the layout, in one order (``new_group`` is collective); None
    on the ranks outside it."""
    rank = dist.get_rank()
    # a minute: a case's steps take well under a second, and a rank that raised must not hold its peers long
    timeout = timedelta(seconds=60)
    pp_groups = [dist.new_group([i * dp + d for i in range(pp)], timeout=timeout) for d in range(dp)]
    dp_groups = [dist.new_group([i * dp + d for d in range(dp)], timeout=timeout) for i in range(pp)]
    if rank >= pp * dp:
        return None
    return _Ranks(pp_groups[rank % dp], rank // dp, dp_groups[rank // dp], rank % dp)


def _refused(feature: Feature, build_and_step: Callable[[], Any]) -> dict:
    """The schedule refuses the combination before its first step with a PipelineConfigError naming it."""
    from titan_dualpipe.runtime.errors import PipelineConfigError

    try:
        build_and_step()
    except PipelineConfigError as err:
        assert feature.refused in str(err), str(err)
        return {"refused": str(err)}
    raise AssertionError(f"expected a PipelineConfigError naming {feature.refused!r}; the step ran")


def _checked(mismatches: list[str], compare: Callable[[], Any]) -> Any:
    """``compare()``, or None with its AssertionError kept in ``mismatches``."""
    try:
        return compare()
    except AssertionError as err:
        mismatches.append(str(err))
        return None


def _module_hook_records(ours: Records, reference: Records, modules: dict[int, Part], place: Any,
                         label: str) -> int:
    """Module full-backward hooks: each call's output gradient is one of plain autograd's (one per microbatch)."""
    checked = 0
    for s, module in modules.items():
        name = f"{module.index}.w2"
        seen, wanted = ours.seen.get(name, []), reference.seen.get(name, [])
        mbs = place.microbatches(s)
        assert len(seen) == len(mbs), f"{label}: {name} on stage {s}: {len(seen)} module hook calls, {len(mbs)} microbatches"
        _match(seen, wanted, f"{label}: module hook of {name} on stage {s}")
        checked += len(seen)
    return checked


def torch_agrees(feature_name: str, ac: str) -> dict | None:
    """Our DualPipeV (I + W) and torch's ``ScheduleDualPipeV`` on the same model, two steps: the same
    gradients on every rank within the feature's tolerance."""
    feature = FEATURES[feature_name]
    pp, n, dp = feature.layout("DualPipeV")
    ranks = _layout(pp, dp)
    if ranks is None:
        return None
    from torch.distributed.pipelining import ScheduleDualPipeV as TorchDualPipeV

    pp_group, pp_rank, place = ranks.pp_group, ranks.pp_rank, placement("DualPipeV", pp, n)
    built = {}
    for name, cls in (("ours", ScheduleDualPipeV), ("torch", TorchDualPipeV)):
        parts = _parts("DualPipeV", feature, ac, Part, False, Records())
        modules = _stage_modules(parts, "DualPipeV", place, pp_rank)
        for module in modules.values() if dp > 1 else ():
            feature.parallelize(module, ranks.dp_group)
        built[name] = (modules, _build(cls, modules, pp_group, place, static_shapes=bool(feature.static_shapes)))
    worst = 0.0
    mismatches: list[str] = []  # raised after the last step: a rank that stopped early would leave its peers waiting
    for step in range(2):
        for modules, sched in built.values():
            _step(sched, place, pp_rank, step, feature, ranks.replica if feature.own_batches() else 0)
        (ours, _), (theirs, _) = built["ours"], built["torch"]
        for s in ours:
            for (name, p), q in zip(ours[s].named_parameters(), theirs[s].parameters()):
                if p.grad is None or q.grad is None:
                    if (p.grad is None) != (q.grad is None):
                        mismatches.append(f"{feature_name} ac={ac} step {step} stage {s} {name}: a gradient on one side only")
                    continue
                got, want = _full(p.grad), _full(q.grad)
                _checked(mismatches, lambda: torch.testing.assert_close(
                    got, want, rtol=feature.tolerance[0], atol=feature.tolerance[1],
                    msg=lambda m: f"{feature_name} ac={ac} step {step} stage {s} {name}: {m}"))
                worst = max(worst, (got - want).abs().max().item())
        for modules, _ in built.values():
            for m in modules.values():
                m.zero_grad()
    assert not mismatches, mismatches[0]
    return {"grad_diff": worst}




# -- the table, and a failure --------------------------------------------------------------------

def contract_table(feature_name: str, schedule: str) -> dict:
    """:func:`contract_run` over every path and AC mode the feature runs on; on every rank. A rank
    whose comparisons fail goes on (its peers run the same combinations) and names each failure."""
    feature = FEATURES[feature_name]
    results: dict[str, Any] = {}
    failures: list[str] = []
    for path in PATHS:
        for ac in AC_MODES:
            if not feature.runs(schedule, path, ac):
                continue
            try:
                results[f"{path}/{ac}"] = contract_run(feature_name, schedule, path, ac)
            except AssertionError as err:
                failures.append(f"{path}/{ac}: {err}")
    assert not failures, "\n".join(failures)
    return results if any(r is not None for r in results.values()) else None  # None: a rank outside the layout


class _Boom(torch.autograd.Function):
    """Identity whose backward raises on its ``fail_at``-th call (this rank's)."""

    calls = 0

    @staticmethod
    def forward(ctx, x: torch.Tensor, fail_at: int) -> torch.Tensor:  # type: ignore[override]
        ctx.fail_at = fail_at
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        _Boom.calls += 1
        if _Boom.calls == ctx.fail_at:
            raise ValueError(f"boom in backward call {_Boom.calls}")
        return grad, None


class _FailingPart(Part):
    fail_at = 0

    def forward(self, h: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return super().forward(_Boom.apply(h, self.fail_at) if self.fail_at else h, *args, **kwargs)


def failure_named_on_every_rank(fail_at: int, group_timeout_s: float) -> dict | None:
    """Pipeline rank 0's last part raises in its ``fail_at``-th backward (the first: inside torch's
    stage initialisation, on torch releases that backpropagate there; later: inside the order):
    what each rank raised."""
    if (ranks := pipeline_ranks(2, timeout_s=group_timeout_s)) is None:
        return None
    group, rank = ranks
    place = placement("DualPipeV", 2, 4)
    parts = _parts("DualPipeV", FEATURES["plain"], "none", _FailingPart, False, Records())
    if rank == 0:
        parts[-1].fail_at = fail_at
    _Boom.calls = 0
    sched = _build(ScheduleDualPipeV, _stage_modules(parts, "DualPipeV", place, rank), group, place)
    try:
        _step(sched, place, rank, 0, FEATURES["plain"])
    except Exception as err:  # noqa: BLE001 - the test inspects what each rank raised
        root = err
        while root.__cause__ is not None:  # torch's stage wraps a backward's error
            root = root.__cause__
        return {"rank": rank, "raised": f"{type(err).__name__}: {err}", "cause": f"{type(root).__name__}: {root}"}
    return {"rank": rank, "raised": "", "cause": ""}
