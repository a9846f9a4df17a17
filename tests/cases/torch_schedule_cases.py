"""Cases run on every rank of a WorkerPool: the scenarios of torch's own schedule tests
(``test/distributed/pipelining/test_schedule.py`` and ``test_schedule_multiproc.py``) on our
``ScheduleDualPipeV`` and ``ScheduleDualPipe`` (tests/test_torch_schedule_tests.py says which).

The model is the one torch's tests use: a chain of MLP blocks (``Linear(512, 512)``, ReLU,
``Linear(512, 512)``), one block per model part, a batch of 64 rows, ``MSELoss(reduction="sum")``
and ``scale_grads=False``, so the sum of the microbatch losses is the full-batch loss and every
gradient is the full-batch gradient. Each case compares with the unpipelined model (two
iterations, gradients zeroed between, as torch's tests do): outputs, the summed loss and every
gradient of every stage within ``RTOL``/``ATOL``. A case checks only after its last collective,
so a mismatch on one rank cannot leave the others waiting.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from cases.layout import pipeline_ranks
from cases.pipeline_cases import _garbage_tensors, _torch_test_callbacks
from titan_dualpipe import PipelineConfigError, ScheduleDualPipe, ScheduleDualPipeV, placement
from titan_dualpipe.check.numerics import ATOL, RTOL

SCHEDULES: dict[str, type] = {"DualPipeV": ScheduleDualPipeV, "DualPipe": ScheduleDualPipe}
D_HID, BATCH = 512, 64  # torch's test_schedule_multiproc.py
ITERATIONS = 2  # torch's tests run the reference and the pipeline twice, gradients zeroed before each


class MLPBlock(nn.Module):
    """One model part: two square linear layers around a ReLU."""

    def __init__(self, d_hid: int) -> None:
        super().__init__()
        self.net1 = nn.Linear(d_hid, d_hid)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(d_hid, d_hid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class MLPChain(nn.Module):
    """``n_layers`` blocks in a row, ``layers.<i>``; ``split_spec`` cuts it before every block but
    the first (for torch's tracer)."""

    def __init__(self, d_hid: int, n_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(d_hid) for _ in range(n_layers))

    @property
    def split_spec(self) -> dict:
        from torch.distributed.pipelining import SplitPoint

        return {f"layers.{i}": SplitPoint.BEGINNING for i in range(1, len(self.layers))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class KwargBlock(MLPBlock):
    """An MLP block whose forward takes a keyword tensor it does not use (torch's
    ``MLPKWargModule``: a stage input with no gradient path)."""

    def forward(self, x: torch.Tensor, unused_kwarg: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x)


class KwargChain(MLPChain):
    def __init__(self, d_hid: int, n_layers: int) -> None:
        super().__init__(d_hid, n_layers)
        self.layers = nn.ModuleList(KwargBlock(d_hid) for _ in range(n_layers))

    def forward(self, x: torch.Tensor, unused_kwarg: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, unused_kwarg)
        return x


class Setup:
    """One rank's share of a case: the reference model, the batch, this rank's stage modules
    (``{stage: module}``) and the placement."""

    def __init__(self, schedule: str, pp: int, n: int, *, model: Callable[[int, int], nn.Module] = MLPChain,
                 batch: int = BATCH, d_hid: int = D_HID, seed: int = 0) -> None:
        self.schedule, self.pp, self.n = schedule, pp, n
        ranks = pipeline_ranks(pp)
        self.in_pipeline, self.rank = ranks is not None, dist.get_rank()
        self.group = ranks.group if ranks else None
        self.place = placement(schedule, pp, n)
        n_parts = self.place.num_stages if schedule == "DualPipeV" else pp
        torch.manual_seed(seed)
        self.full = model(d_hid, n_parts)
        self.reference = copy.deepcopy(self.full)
        self.x = torch.randn(batch, d_hid)
        with torch.no_grad():
            self.target = self.reference(self.x) + torch.randn(batch, d_hid)
        self.loss_fn = nn.MSELoss(reduction="sum")
        # DualPipeV: each stage is a part of the model (torch's tests take submodules of the full
        # model); DualPipe holds every part twice, on two modules
        self.modules = {s: self._part(s) for s in self.place.stages_of(self.rank)} if self.in_pipeline else {}

    def _part(self, stage: int) -> nn.Module:
        part = self.full.layers[self.place.model_part(stage)]
        return part if self.schedule == "DualPipeV" else copy.deepcopy(part)

    @property
    def feeds(self) -> bool:
        return self.place.feeds_batch(self.rank)

    @property
    def holds_last(self) -> bool:
        return any(self.place.is_last(s) for s in self.modules)

    def stages(self, per_stage: dict[int, dict] | None = None) -> list[PipelineStage]:
        """This rank's ``PipelineStage``s; ``per_stage[s]``: more keyword arguments for stage ``s``."""
        per_stage = per_stage or {}
        return [PipelineStage(self.modules[s], s, self.place.num_stages, torch.device("cpu"), group=self.group,
                              **per_stage.get(s, {}))
                for s in self.place.stages_of(self.rank)]

    def build(self, stages: list | None = None, **kwargs: Any):
        kwargs.setdefault("scale_grads", False)
        return SCHEDULES[self.schedule](stages if stages is not None else self.stages(), self.n,
                                        loss_fn=self.loss_fn, **kwargs)

    def run_reference(self, iterations: int = ITERATIONS, zero_grad: bool = True, **kwargs: Any):
        """The unpipelined model, ``iterations`` times on the whole batch: its last output and loss."""
        out = loss = None
        for _ in range(iterations):
            if zero_grad:
                self.reference.zero_grad()
            out = self.reference(self.x, **kwargs)
            loss = self.loss_fn(out, self.target)
            loss.backward()
        return out.detach(), loss.detach()

    def step(self, sched, losses: list | None = None, **kwargs: Any):
        """One ``step()``: the ranks holding a first or last stage pass the batch and ``kwargs``."""
        if self.feeds:
            return sched.step(self.x, target=self.target, losses=losses, **kwargs)
        return sched.step()

    def train(self, sched, iterations: int = ITERATIONS, zero_grad: bool = True, **kwargs: Any):
        """``iterations`` steps (gradients zeroed before each): the last step's output and losses."""
        out, losses = None, []
        for _ in range(iterations):
            if zero_grad:
                for module in self.modules.values():
                    module.zero_grad()
            losses = []
            out = self.step(sched, losses, **kwargs)
        return out, losses

    def expected_output(self, ref_out: torch.Tensor) -> torch.Tensor:
        """The rows of the reference output that this rank's last stages return (DualPipe: the
        microbatches of the chain that ends here)."""
        rows = self.x.shape[0] // self.n
        mbs = [mb for s in self.modules if self.place.is_last(s) for mb in self.place.microbatches(s)]
        return torch.cat([ref_out[mb * rows:(mb + 1) * rows] for mb in mbs])

    def check(self, out, losses: list, ref_out: torch.Tensor, ref_loss: torch.Tensor) -> dict:
        """Outputs and the summed loss (ranks with a last stage) and every gradient against the
        reference; the counts checked and the largest gradient difference."""
        rtol, atol = RTOL, ATOL
        result = {"outputs": 0, "losses": 0, "grads": 0, "grad_err": 0.0, "rank": self.rank}
        if self.holds_last:
            if out is not None:
                torch.testing.assert_close(out, self.expected_output(ref_out), rtol=rtol, atol=atol)
                result["outputs"] = out.shape[0]
            assert len(losses) == self.n, f"rank {self.rank}: {len(losses)} losses, expected {self.n}"
            torch.testing.assert_close(torch.stack([l.detach() for l in losses]).sum(), ref_loss, rtol=rtol, atol=atol)
            result["losses"] = len(losses)
        result.update(self.check_grads())
        return result

    def check_grads(self) -> dict:
        """Every gradient of this rank's stages against the reference's part: the count and the
        largest difference."""
        grads, worst = 0, 0.0
        for s, module in self.modules.items():
            want = dict(self.reference.layers[self.place.model_part(s)].named_parameters())
            for name, p in module.named_parameters():
                assert p.grad is not None, f"stage {s} {name}: no gradient"
                torch.testing.assert_close(p.grad, want[name].grad, rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"stage {s} {name}: {m}")
                worst = max(worst, (p.grad - want[name].grad).abs().max().item())
                grads += 1
        return {"grads": grads, "grad_err": worst}


# -- test_schedule.py: one rank (torch's single-stage tests; ours: a V of two stages, pp = 1) ----

def single_rank_training() -> dict | None:
    """``test_schedule_with_single_stage``: one rank, a model of 512-wide MLP blocks, a batch of
    256, cross-entropy (mean) on each of 2 microbatches, default ``scale_grads`` (mean over
    microbatches). Two steps: the output, the mean of the losses and every gradient match."""
    setup = Setup("DualPipeV", 1, 2, batch=256)
    if not setup.in_pipeline:
        return None

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, target)

    setup.loss_fn = loss_fn
    ref_out, ref_loss = setup.run_reference()
    out, losses = setup.train(setup.build(scale_grads=True))
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.stack(losses).mean(), ref_loss, rtol=RTOL, atol=ATOL)
    return {**setup.check_grads(), "outputs": out.shape[0], "losses": len(losses)}


class _KwargPart(nn.Module):
    """torch's pre-split test module, ``linear(relu(x + y))`` with ``y`` a keyword input. Every part
    takes it: torch's runtime (and ours) hands a rank's keyword inputs to every forward on the
    rank, and a V puts the first and the last stage on one rank."""

    def __init__(self, d_hid: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_hid, d_hid)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.linear(torch.relu(x if y is None else x + y))


def pre_split_inputs(schedule: str, pp: int, n: int) -> dict | None:
    """``test_schedule_with_pre_split_inputs``: two schedules over copies of one pipeline, one fed
    the whole batch (``x``, keyword ``y``, ``target``), one its ``tensor_split`` microbatches
    (``arg_mbs``, ``kwarg_mbs``, ``target_mbs``): the same outputs, losses and gradients, exactly."""
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    d_hid, rows = 16, 8 * n // 2
    place = placement(schedule, pp, n)
    torch.manual_seed(0)
    n_parts = place.num_stages if schedule == "DualPipeV" else pp
    parts = [_KwargPart(d_hid) for _ in range(n_parts)]
    x, y, target = (torch.randn(rows, d_hid) for _ in range(3))

    def pipeline() -> tuple[Any, dict]:
        modules = {s: copy.deepcopy(parts[place.model_part(s)]) for s in place.stages_of(rank)}
        stages = [PipelineStage(modules[s], s, place.num_stages, torch.device("cpu"), group=group)
                  for s in place.stages_of(rank)]
        return SCHEDULES[schedule](stages, n, loss_fn=nn.MSELoss(reduction="sum"), scale_grads=False), modules

    whole, whole_modules = pipeline()
    split, split_modules = pipeline()
    feeds = place.feeds_batch(rank)
    whole_losses: list = []
    whole_out = whole.step(x, y=y, target=target, losses=whole_losses) if feeds else whole.step()
    split_losses: list = []
    if feeds:
        split_out = split.step(arg_mbs=[(xm,) for xm in torch.tensor_split(x, n)],
                               kwarg_mbs=[{"y": ym} for ym in torch.tensor_split(y, n)],
                               target_mbs=list(torch.tensor_split(target, n)), losses=split_losses)
    else:
        split_out = split.step()
    assert (whole_out is None) == (split_out is None), (whole_out, split_out)
    if whole_out is not None:
        assert torch.equal(whole_out, split_out), (whole_out - split_out).abs().max()
    assert len(whole_losses) == len(split_losses), (whole_losses, split_losses)
    if whole_losses:
        assert torch.equal(torch.stack(whole_losses), torch.stack(split_losses))
    grads = 0
    for s in whole_modules:
        for (name, a), (other, b) in zip(whole_modules[s].named_parameters(), split_modules[s].named_parameters(),
                                         strict=True):
            assert name == other and torch.equal(a.grad, b.grad), f"stage {s} {name}"
            grads += 1
    return {"grads": grads, "losses": len(whole_losses), "outputs": 0 if whole_out is None else whole_out.shape[0]}


def eval_then_train() -> dict | None:
    """``test_schedule_eval_then_train``: one rank; ``eval()`` on the whole batch and on its
    pre-split microbatches gives the same outputs and losses and no gradient; a training
    ``step()`` on the pre-split microbatches then returns the same outputs and losses and
    fills every gradient."""
    setup = Setup("DualPipeV", 1, 2, batch=256)
    if not setup.in_pipeline:
        return None
    setup.loss_fn = lambda out, target: nn.functional.cross_entropy(out, target)
    sched = setup.build(scale_grads=True)
    n = setup.n
    arg_mbs = [(xm,) for xm in torch.tensor_split(setup.x, n)]
    target_mbs = list(torch.tensor_split(setup.target, n))
    full_losses: list = []
    full_out = sched.eval(setup.x, target=setup.target, losses=full_losses)
    split_losses: list = []
    split_out = sched.eval(arg_mbs=arg_mbs, target_mbs=target_mbs, losses=split_losses)
    torch.testing.assert_close(split_out, full_out, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(split_losses), torch.stack(full_losses), rtol=0, atol=0)
    params = [(s, name, p) for s, m in setup.modules.items() for name, p in m.named_parameters()]
    assert all(p.grad is None for _, _, p in params), [f"{s} {name}" for s, name, p in params if p.grad is not None]
    train_losses: list = []
    train_out = sched.step(arg_mbs=arg_mbs, target_mbs=target_mbs, losses=train_losses)
    torch.testing.assert_close(train_out, full_out, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack([l.detach() for l in train_losses]), torch.stack(full_losses), rtol=0, atol=0)
    assert all(p.grad is not None for _, _, p in params), [f"{s} {name}" for s, name, p in params if p.grad is None]
    return {"grads": len(params), "losses": len(train_losses)}


# -- test_schedule_multiproc.py -------------------------------------------------------------------

def forward_only(iterations: int = 20) -> dict | None:
    """``test_forward_only``: ``eval()`` without a loss, ``iterations`` times, each output the next
    input (DualPipeV: rank 0 holds the first and the last stage, so no message carries it
    back); the result equals the unpipelined model applied as often."""
    pp = 4
    n = 2 * pp
    setup = Setup("DualPipeV", pp, n)
    if not setup.in_pipeline:
        return None
    sched = SCHEDULES["DualPipeV"](setup.stages(), n, scale_grads=False)
    x = setup.x.clone()
    for _ in range(iterations):
        out = sched.eval(x) if setup.feeds else sched.eval()
        if setup.feeds:
            x = out
    if not setup.feeds:
        return {"outputs": 0}
    want = setup.x.clone()
    with torch.no_grad():
        for _ in range(iterations):
            want = setup.reference(want)
    torch.testing.assert_close(x, want, rtol=RTOL, atol=ATOL)
    return {"outputs": x.shape[0]}


def eval_inference_mode(schedule: str, pp: int, n: int) -> dict | None:
    """``test_eval_inference_mode``: ``eval()`` (under ``torch.no_grad()`` on the ranks that feed
    the batch, as torch's test does on its first rank; with gradients enabled elsewhere) leaves
    every gradient None and fills the losses, which equal the reference forward's."""
    setup = Setup(schedule, pp, n)
    if not setup.in_pipeline:
        return None
    sched = setup.build()
    for module in setup.modules.values():
        module.zero_grad()
    losses: list = []
    if setup.feeds:
        with torch.no_grad():
            out = sched.eval(setup.x, target=setup.target, losses=losses)
    else:
        out = sched.eval()
    grads = [name for m in setup.modules.values() for name, p in m.named_parameters() if p.grad is not None]
    assert not grads, f"eval() computed gradients for {grads}"
    result = {"losses": len(losses), "outputs": 0}
    if setup.holds_last:
        rows = setup.x.shape[0] // n
        with torch.no_grad():
            want = [setup.loss_fn(setup.reference(xm), ym) for xm, ym in
                    zip(setup.x.split(rows), setup.target.split(rows))]
        torch.testing.assert_close(torch.stack(losses), torch.stack(want), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(out, setup.expected_output(setup.reference(setup.x).detach()), rtol=RTOL, atol=ATOL)
        result["outputs"] = out.shape[0]
    return result


def return_output(schedule: str, pp: int, n: int) -> dict | None:
    """``test_return_output``: ``step(..., return_outputs=False)`` returns None on the ranks that
    hold a last stage (and still fills the losses)."""
    setup = Setup(schedule, pp, n)
    if not setup.in_pipeline:
        return None
    sched = setup.build()
    losses: list = []
    out = setup.step(sched, losses, return_outputs=False) if setup.feeds else sched.step(return_outputs=False)
    assert out is None, f"rank {setup.rank}: step(return_outputs=False) returned {type(out).__name__}"
    return {"holds_last": setup.holds_last, "losses": len(losses)}


def multi_iter(schedule: str, pp: int, n: int, iterations: int = 20) -> dict | None:
    """``test_multi_iter``: ``iterations`` steps in a row on the same schedule, then a barrier;
    every step gives every loss."""
    setup = Setup(schedule, pp, n)
    if not setup.in_pipeline:
        return None
    sched = setup.build()
    counts = []
    for _ in range(iterations):
        losses: list = []
        setup.step(sched, losses)
        counts.append(len(losses))
    dist.barrier(group=setup.group)
    assert all(c == (n if setup.holds_last else 0) for c in counts), counts
    return {"steps": len(counts), "losses": sum(counts)}


def grad_with_tracer(pp: int, n: int) -> dict | None:
    """``test_grad_with_tracer``: the MLP chain traced by torch's frontend (its ``split_spec``) into
    ``2 * pp`` stages, rank ``r`` building stages ``r`` and ``2pp-1-r``; two steps: output,
    loss and every gradient (traced stage modules keep the model's parameter names)."""
    from torch.distributed.pipelining import pipeline

    setup = Setup("DualPipeV", pp, n)
    if not setup.in_pipeline:
        return None
    ref_out, ref_loss = setup.run_reference()
    pipe = pipeline(setup.full, mb_args=(setup.x.chunk(n)[0],), split_spec=setup.full.split_spec)
    stages = [pipe.build_stage(s, torch.device("cpu"), group=setup.group) for s in setup.place.stages_of(setup.rank)]
    traced = {s: pipe.get_stage_module(s) for s in setup.place.stages_of(setup.rank)}
    setup.modules = traced
    out, losses = setup.train(setup.build(stages))
    dist.barrier(group=setup.group)
    result: dict = {"outputs": 0, "losses": 0}
    # traced stage modules name their parameters as the whole model does: compare by those names
    reference = dict(setup.reference.named_parameters())
    grads, worst = 0, 0.0
    for s, module in traced.items():
        for name, p in module.named_parameters():
            torch.testing.assert_close(p.grad, reference[name].grad, rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"stage {s} {name}: {m}")
            worst = max(worst, (p.grad - reference[name].grad).abs().max().item())
            grads += 1
    if setup.holds_last:
        torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(torch.stack([l.detach() for l in losses]).sum(), ref_loss, rtol=RTOL, atol=ATOL)
        result.update(outputs=out.shape[0], losses=len(losses))
    return {**result, "grads": grads, "grad_err": worst}


def grad_with_manual(schedule: str, pp: int, n: int, shape_inference: bool) -> dict | None:
    """``test_grad_with_manual``: hand-built ``PipelineStage``s, with shape inference or with static
    metadata (``input_args``/``output_args``: one microbatch's example input and the stage's
    output for it); two steps against the reference."""
    setup = Setup(schedule, pp, n)
    if not setup.in_pipeline:
        return None
    ref_out, ref_loss = setup.run_reference()
    stage_kwargs: dict = {}
    if not shape_inference:
        example = setup.x.chunk(n)[0]
        for s, module in setup.modules.items():
            hidden = example  # every block maps (rows, d_hid) to (rows, d_hid)
            with torch.no_grad():
                stage_kwargs[s] = {"input_args": (hidden,), "output_args": (module(hidden),)}
    out, losses = setup.train(setup.build(setup.stages(stage_kwargs)))
    dist.barrier(group=setup.group)
    return setup.check(out, losses, ref_out, ref_loss)


def grad_with_manual_interleaved(schedule: str, pp: int, n: int) -> dict | None:
    """``test_grad_with_manual_interleaved``: two stages per rank, two steps inside the check that
    no tensor is left for the cycle collector (torch's ``check_leaked_tensors``); output, loss
    and every gradient at our tolerance (torch's test relaxes it to 5e-3 for its interleaved
    schedules)."""
    setup = Setup(schedule, pp, n)
    if not setup.in_pipeline:
        return None
    ref_out, ref_loss = setup.run_reference()
    sched = setup.build()
    ran: dict = {}

    def run() -> None:
        ran["out"], ran["losses"] = setup.train(sched)

    garbage = _garbage_tensors(run)
    dist.barrier(group=setup.group)
    assert not garbage, f"rank {setup.rank}: {len(garbage)} tensors left for the cycle collector: " \
                        f"{[tuple(t.shape) for t in garbage[:8]]}"
    return setup.check(ran["out"], ran["losses"], ref_out, ref_loss)


class _InputGradOnly(torch.autograd.Function):
    """``x @ weight.T + bias`` whose backward returns the input gradient only and keeps
    ``(grad_output, input)`` in the owning block's cache for its ``compute_dw`` (torch's
    ``CustomLinearDx``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, cache):  # noqa: ANN001, ANN205 - autograd's signature
        ctx.save_for_backward(x, weight)
        ctx.cache = cache
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        x, weight = ctx.saved_tensors
        ctx.cache.append((grad_output.clone(), x.clone()))
        return grad_output @ weight, None, None, None


class DwBlock(nn.Module):
    """torch's ``MLPModuleWithDw``: two linear layers around a ReLU, weights near zero. With
    ``custom`` set, the layers' backward leaves their weight gradients to :meth:`compute_dw`
    (one microbatch per call, first in first out), as a ``dw_builder``'s runner calls it."""

    def __init__(self, d_hid: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.empty(d_hid, d_hid).uniform_(-1e-3, 1e-3)) for _ in range(2))
        self.biases = nn.ParameterList(nn.Parameter(torch.empty(d_hid).uniform_(-1e-3, 1e-3)) for _ in range(2))
        self.custom = False
        self.caches: list[list] = [[], []]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, (weight, bias) in enumerate(zip(self.weights, self.biases)):
            if k:
                x = torch.relu(x)
            x = _InputGradOnly.apply(x, weight, bias, self.caches[k]) if self.custom else x @ weight.t() + bias
        return x

    def compute_dw(self) -> None:
        for cache, weight, bias in zip(self.caches, self.weights, self.biases):
            grad_output, x = cache.pop(0)
            for p, grad in ((weight, grad_output.t() @ x), (bias, grad_output.sum(0))):
                p.grad = grad if p.grad is None else p.grad + grad


class DwChain(MLPChain):
    def __init__(self, d_hid: int, n_layers: int) -> None:
        super().__init__(d_hid, n_layers)
        self.layers = nn.ModuleList(DwBlock(d_hid) for _ in range(n_layers))


def weight_update_mlp_e2e(schedule: str, pp: int, n: int) -> dict | None:
    """``test_schedule_with_weight_update_mlp_e2e``: stages built with a ``dw_builder`` whose runner
    computes the weight gradients that the blocks' custom autograd Functions left out; mean-reduced
    MSE and the default ``scale_grads``. After two steps (gradients zeroed before each; torch's
    test checks only then: with this first-in first-out cache the first step's gradients differ
    from the reference under torch's ``ScheduleDualPipeV`` and ours alike) the output, the mean of
    the losses and every gradient equal the reference's, and each runner ran once per microbatch
    of its stage."""
    setup = Setup(schedule, pp, n, model=DwChain)
    if not setup.in_pipeline:
        return None
    setup.loss_fn = nn.MSELoss()
    ref_out, ref_loss = setup.run_reference()
    runs: Counter = Counter()

    def dw_builder(stage: int, module: DwBlock) -> Callable[[], Callable[[], None]]:
        def build() -> Callable[[], None]:
            def run() -> None:
                runs[stage] += 1
                module.compute_dw()

            return run

        return build

    for module in setup.modules.values():
        module.custom = True
    stages = setup.stages({s: {"dw_builder": dw_builder(s, m)} for s, m in setup.modules.items()})
    sched = setup.build(stages, scale_grads=True)
    out, losses = None, []
    for _ in range(ITERATIONS):
        for module in setup.modules.values():
            module.zero_grad()
        runs.clear()
        losses = []
        out = setup.step(sched, losses)
    dist.barrier(group=setup.group)
    result = {"outputs": 0, "losses": 0, **setup.check_grads()}
    if setup.holds_last:
        torch.testing.assert_close(out, setup.expected_output(ref_out), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(torch.stack([l.detach() for l in losses]).mean(), ref_loss, rtol=RTOL, atol=ATOL)
        result.update(outputs=out.shape[0], losses=len(losses))
    per_stage = {s: len(setup.place.microbatches(s)) for s in setup.modules}
    assert dict(runs) == per_stage, (dict(runs), per_stage)
    return {**result, "dw_runs": dict(runs)}


def v_shape_schedules(schedule: str, pp: int, n: int) -> dict | None:
    """``test_v_shape_schedules``: rank ``r`` holds stages ``r`` and ``2pp-1-r`` (torch's
    ``{0: [0, 7], 1: [1, 6], 2: [2, 5], 3: [3, 4]}`` at pp 4); the rank(s) with the first and
    last stage pass ``x``, ``target`` and ``losses``; two steps against the reference."""
    setup = Setup(schedule, pp, n)
    if not setup.in_pipeline:
        return None
    ref_out, ref_loss = setup.run_reference()
    out, losses = setup.train(setup.build())
    return setup.check(out, losses, ref_out, ref_loss)


def custom_function_callback(pp: int, n: int, iterations: int = ITERATIONS) -> dict | None:
    """``test_custom_function_callback``: torch's test functions for FORWARD and OVERLAP_F_B
    (written for torch's ``_PipelineScheduleRuntime``) registered on our DualPipeV after
    ``_prepare_schedule_with_comms(pipeline_order)``: every forward of this rank's two stages
    runs through them (``n * 2`` per step), pairs reach the OVERLAP_F_B function, and the
    outputs, loss and gradients equal the reference's."""
    from torch.distributed.pipelining.schedules import _ComputationType

    setup = Setup("DualPipeV", pp, n)
    if not setup.in_pipeline:
        return None
    ref_out, ref_loss = setup.run_reference()
    sched = setup.build()
    sched._prepare_schedule_with_comms(sched.pipeline_order)
    calls: Counter = Counter()
    forward, overlap = _torch_test_callbacks(calls)
    sched.register_custom_function(_ComputationType.FORWARD, forward)
    sched.register_custom_function(_ComputationType.OVERLAP_F_B, overlap)
    out, losses = setup.train(sched, iterations)
    dist.barrier(group=setup.group)
    result = setup.check(out, losses, ref_out, ref_loss)
    assert calls["F"] == n * 2 * iterations, calls
    assert calls["OVERLAP_F_B"] > 0, calls
    return {**result, "calls": dict(calls)}


def zero_bubble_with_model_kwargs(schedule: str, pp: int, n: int) -> dict | None:
    """``test_zero_bubble_with_model_kwargs``: a chain whose blocks take an unused keyword tensor;
    the ranks with a first stage pass it with one row per microbatch (``(n, 1)``, split like the
    batch); two steps against the reference called with the tensor as given to it."""
    setup = Setup(schedule, pp, n, model=KwargChain)
    if not setup.in_pipeline:
        return None
    unused = torch.tensor([1.0])
    ref_out, ref_loss = setup.run_reference(unused_kwarg=unused)
    sched = setup.build()
    out, losses = None, []
    for _ in range(ITERATIONS):
        for module in setup.modules.values():
            module.zero_grad()
        losses = []
        if setup.feeds:
            out = sched.step(setup.x, unused_kwarg=unused.clone().unsqueeze(0).expand(n, -1), target=setup.target,
                             losses=losses)
        else:
            out = sched.step()
    dist.barrier(group=setup.group)
    return setup.check(out, losses, ref_out, ref_loss)


# -- CustomSchedulesTest (world size 2) ----------------------------------------------------------

def non_symmetric_stage_ids(layout: str) -> dict | None:
    """``test_non_symmetric_stage_ids``. ``"v_shaped"``: torch's V of 4 stages on 2 ranks
    (``{0: [0, 3], 1: [1, 2]}``), first and last stage on rank 0: our DualPipeV, 4 microbatches
    (torch's test runs 1: ours needs ``n >= 2 * pp``), two steps against the reference.
    ``"unbalanced"``: torch's ``{0: [0, 1, 4], 1: [2, 3]}`` (5 stages): refused with the same
    PipelineConfigError on both ranks before any pipeline traffic."""
    pp = 2
    if layout == "v_shaped":
        return v_shape_schedules("DualPipeV", pp, 2 * pp)
    if (ranks := pipeline_ranks(pp)) is None:
        return None
    group, rank = ranks
    rank_stages = {0: [0, 1, 4], 1: [2, 3]}
    torch.manual_seed(0)
    full = MLPChain(D_HID, 5)
    stages = [PipelineStage(full.layers[s], s, 5, torch.device("cpu"), group=group) for s in rank_stages[rank]]
    try:
        ScheduleDualPipeV(stages, 4, loss_fn=nn.MSELoss(reduction="sum"))
    except PipelineConfigError as err:
        return {"refused": str(err)}
    raise AssertionError(f"rank {rank}: stages {rank_stages[rank]} of 5 were accepted")


def _reordered_backwards(pp: int, n: int) -> dict:
    """A DualPipeV compute order of our own making for ``pp`` = 2: each stage runs all its
    forwards first (GPipe along the V), then its backwards in reverse microbatch order."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    F, B = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    assert pp == 2
    last_down, turn = range(n - 1, -1, -1), range(n)
    rank0 = [_Action(0, F, mb) for mb in turn]
    rank1 = [a for mb in turn for a in (_Action(1, F, mb), _Action(2, F, mb))]
    rank0 += [_Action(3, F, mb) for mb in turn] + [_Action(3, B, mb) for mb in last_down]
    rank1 += [a for mb in last_down for a in (_Action(2, B, mb), _Action(1, B, mb))]
    rank0 += [_Action(0, B, mb) for mb in last_down]
    return {0: rank0, 1: rank1}


def runtime_custom_sched(n: int = 4) -> dict | None:
    """``test_pipeline_schedule_runtime_custom_sched``: our runtime runs an order it did not
    compute, loaded from a compute-only CSV (``_load_csv``): forwards first, backwards in
    reverse microbatch order. Two steps inside the check that no tensor is left for the cycle
    collector; output, loss and every gradient against the reference."""
    import csv
    import os
    import tempfile

    pp = 2
    setup = Setup("DualPipeV", pp, n)
    if not setup.in_pipeline:
        return None
    ref_out, ref_loss = setup.run_reference()
    sched = setup.build()
    order = _reordered_backwards(pp, n)
    path = os.path.join(tempfile.mkdtemp(), f"reordered_rank{setup.rank}.csv")
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([[str(a) for a in order[r]] for r in range(pp)])
    sched._load_csv(path)
    assert sched.pipeline_order == order, sched.pipeline_order
    ran: dict = {}

    def run() -> None:
        ran["out"], ran["losses"] = setup.train(sched)

    garbage = _garbage_tensors(run)
    dist.barrier(group=setup.group)
    assert not garbage, f"rank {setup.rank}: {len(garbage)} tensors left for the cycle collector"
    return setup.check(ran["out"], ran["losses"], ref_out, ref_loss)


def native_zero_bubble(schedule: str, pp: int, n: int, steps: int = 4) -> dict | None:
    """``test_schedule_with_native_zero_bubble``: an order with split backwards (I then W, which our
    orders have), ``steps`` steps without zeroing gradients inside the check that no tensor is
    left for the cycle collector: every gradient equals the reference's accumulated over as
    many full-batch backwards. A gradient mismatch is returned (``mismatch``), not raised, so the
    pool goes on."""
    from torch.distributed.pipelining.schedules import _ComputationType

    setup = Setup(schedule, pp, n)
    if not setup.in_pipeline:
        return None
    setup.run_reference(iterations=steps, zero_grad=False)
    sched = setup.build()
    splits = sum(1 for a in sched.pipeline_order[setup.rank] if a is not None
                 and a.computation_type == _ComputationType.BACKWARD_WEIGHT)
    garbage = _garbage_tensors(lambda: setup.train(sched, steps, zero_grad=False))
    dist.barrier(group=setup.group)
    assert not garbage, f"rank {setup.rank}: {len(garbage)} tensors left for the cycle collector"
    try:
        checked = setup.check_grads()
    except AssertionError as err:
        return {"grads": 0, "mismatch": str(err).splitlines()[0], "weight_actions": splits}
    return {**checked, "mismatch": "", "weight_actions": splits}
