"""Deferred weight GEMMs (``titan_dualpipe/weights/``) in one process: the same gradients as
autograd's, bit for bit, under every AC mode; what is installed and what is left out; option checks."""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titan_dualpipe import ScheduleDualPipeV
from titan_dualpipe.weights.install import deferrable_modules, install, uninstall
from titan_dualpipe.weights.policy import weight_gradients_problem
from titan_dualpipe.weights.queue import WeightGradQueue
from titan_dualpipe.runtime.errors import PipelineConfigError


class _Block(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.w1 = nn.Linear(16, 32, bias=bias)
        self.w2 = nn.Linear(32, 16, bias=bias)
        self.norm = nn.LayerNorm(16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + self.w2(torch.nn.functional.gelu(self.w1(h))))


def _model(bias: bool, ac: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(bias), _Block(bias))
    if ac != "none":
        context = _selective_context() if ac == "selective" else {}
        for block in model:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, **context)
    return model


def _save_matmuls(ctx, op, *args, **kwargs):
    """Selective AC's policy: keep the matmul outputs, recompute the rest."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> dict:
    # a partial of module-level functions: what dynamo can trace as a checkpoint's context_fn
    return {"context_fn": functools.partial(create_selective_checkpoint_contexts, _save_matmuls)}


class _CheckpointedBlock(_Block):
    """A block whose forward checkpoints itself: compiled in place, the checkpoint is inside the
    compiled graph (as torchtitan compiles its checkpoint-wrapped blocks)."""

    def __init__(self, ac: str) -> None:
        super().__init__(bias=False)
        self.ac = ac

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.ac == "none":
            return super().forward(h)
        context = _selective_context() if self.ac == "selective" else {}
        return checkpoint(super().forward, h, use_reentrant=False, **context)


def _grads(model: nn.Module, x: torch.Tensor, queue: WeightGradQueue | None,
           compiled: bool = False, collect: bool = True) -> dict[str, torch.Tensor]:
    """Gradients of a forward and backward; with ``queue``, a deferring forward and a backward
    that collects into it (or, ``collect=False``, one outside an I: the GEMMs run at once)."""
    x = x.detach().requires_grad_()
    with queue.deferring() if queue is not None else contextlib.nullcontext():
        loss = model(x).square().sum()
    if queue is None or not collect:
        loss.backward()
    else:
        with queue.collecting((1, 0)):
            loss.backward()
        weights = {name for name, _ in model.named_parameters() if name.endswith((".w1.weight", ".w2.weight"))}
        assert len(weights) == 4
        waiting = [p.grad for name, p in model.named_parameters() if name in weights]
        if compiled:  # the compiled graph's weight gradient output: zeros until W adds the GEMM
            assert all(g is not None and not g.any() for g in waiting)
        else:
            assert all(g is None for g in waiting)
        assert queue.pending() == {(1, 0): 4}
        assert queue.run((1, 0)) == 4 and queue.ran == {1: 4} and not queue.pending()
    return {"input": x.grad, **{name: p.grad for name, p in model.named_parameters()}}


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(6, 16), (3, 5, 16)], ids=["2d", "3d"])
def test_deferred_gradients_equal_autograds_bitwise(ac, bias, shape):
    """Input, weight, bias and norm gradients, a weight GEMM run at W vs autograd's F.linear backward:
    equal bit for bit (the same GEMMs on the same operands), with or without AC. A deferring forward
    backpropagated outside an I computes its weight gradients at once, also bit for bit (without
    AC: a checkpointed region recomputes along the path its backward collects for, so the runtime
    backpropagates every deferring forward inside ``collecting``)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    want = _grads(_model(bias, ac), x, None)
    deferred = _model(bias, ac)
    queue = WeightGradQueue()
    assert install(deferred, queue) == ["0.w1", "0.w2", "1.w1", "1.w2"]
    got = _grads(deferred, x, queue)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    if ac != "none":
        return
    deferred.zero_grad(set_to_none=True)
    at_once = _grads(deferred, x, queue, collect=False)
    assert not queue.pending()
    for name in want:
        assert torch.equal(at_once[name], want[name]), name


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_compiled_blocks_defer_their_weight_gemms_through_one_graph(ac):
    """Blocks compiled in place (``fullgraph``, aot_eager): inside an I their linear layers' weight
    GEMMs wait for W, outside one they run at once, and one compiled graph per block serves both
    (the custom operator decides at run time). Deferred and at-once gradients are equal bit for
    bit (the same GEMM on the same operands), and equal the eager model's to rounding."""
    from titan_dualpipe.check.numerics import GraphCounter

    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    want = _grads(_model(False, ac), x, None)
    torch.manual_seed(0)  # _model's weights
    model, queue, counter = nn.Sequential(_CheckpointedBlock(ac), _CheckpointedBlock(ac)), WeightGradQueue(), \
        GraphCounter("aot_eager")
    assert install(model, queue, compiled=True) == ["0.w1", "0.w2", "1.w1", "1.w2"]
    for block in model:
        block.compile(backend=counter, fullgraph=True)
    at_once = _grads(model, x, None)
    graphs = counter.graphs
    model.zero_grad(set_to_none=True)
    deferred = _grads(model, x, queue, compiled=True)
    assert graphs == 2 and counter.graphs == graphs  # no recompilation for the deferring backward
    for name in want:
        assert torch.equal(deferred[name], at_once[name]), name
        torch.testing.assert_close(deferred[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


class _ResidualMLP(nn.Module):
    """``h + w2(gelu(w1(h)))``, checkpointed: the region's last saved tensor is ``w2``'s input."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda x: x + self.w2(torch.nn.functional.gelu(self.w1(x))), h, use_reentrant=False)


class _CountGemms(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.forward = self.backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.addmm.default:
            self.forward += 1
        elif func is torch.ops.aten.mm.default:
            self.backward += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("deferring", [False, True], ids=["at_once", "in_an_I"])
def test_a_recomputation_stops_before_a_last_linear_layers_gemm_as_under_autograd(deferring):
    """torch ends a checkpointed region's recomputation at its last saved tensor (early stop): a
    region ending in a linear layer (an MLP's down projection) skips that layer's forward GEMM.
    An installed layer saves its input before its GEMM runs, so its backward recomputes the same
    forward GEMMs as autograd's (one here, not two) and runs the same backward GEMMs (two at I
    and two at W when deferring)."""
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    counts = []
    for installed in (False, True):
        torch.manual_seed(0)
        model, queue = _ResidualMLP(), WeightGradQueue()
        if installed:
            install(model, queue)
        with queue.deferring(deferring):
            loss = model(x.clone().requires_grad_()).square().sum()
        with _CountGemms() as counted, queue.collecting((0, 0)) if installed and deferring else contextlib.nullcontext():
            loss.backward()
        with _CountGemms() as at_w:
            queue.run((0, 0))
        counts.append((counted.forward, counted.backward, at_w.backward))
    assert counts[0] == (1, 4, 0)
    assert counts[1] == ((1, 2, 2) if deferring else (1, 4, 0))


def test_gradients_accumulate_over_microbatches_like_autograds():
    """Two microbatches: the second W adds to the first's gradient (a first one is taken as is)."""
    reference, deferred, queue = _model(True, "none"), _model(True, "none"), WeightGradQueue()
    install(deferred, queue)
    xs = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(2))
    for mb, x in enumerate(xs):
        reference(x).square().sum().backward()
        with queue.deferring():
            loss = deferred(x).square().sum()
        with queue.collecting((0, mb)):
            loss.backward()
    queue.run((0, 1))
    queue.run((0, 0))  # W in another order than I
    for (name, p), q in zip(deferred.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_what_is_installed_and_what_is_left_out():
    """Left out: excluded names (pattern or module path), subclasses with a forward of their own,
    compiled regions (their ``nn.Linear`` modules are in with ``compiled=True``: they defer through
    the compiled path); a parametrized (computed) weight still gets its gradient through autograd."""

    class OwnForward(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
                           "own": OwnForward(4, 4), "compiled": nn.Linear(4, 4), "param": nn.Linear(4, 4)})
    model["compiled"].compile(backend="eager")
    nn.utils.parametrize.register_parametrization(model["param"], "weight", _Doubled())
    assert sorted(deferrable_modules(model)) == ["a", "b.0", "b.1", "param"]
    assert sorted(deferrable_modules(model, compiled=True)) == ["a", "b.0", "b.1", "compiled", "param"]
    assert sorted(deferrable_modules(model, ["b"])) == ["a", "param"]
    assert sorted(deferrable_modules(model, ["b.*", "a"])) == ["param"]
    queue = WeightGradQueue()
    install(model, queue)
    x = torch.randn(3, 4)
    with queue.deferring(), queue.collecting((0, 0)):
        model["param"](x).sum().backward()
    assert not queue.pending()  # computed weight: autograd took it at once
    assert model["param"].parametrizations.weight.original.grad is not None
    uninstall(model)
    assert type(model["a"]) is nn.Linear and not deferrable_modules(model["own"])


class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


def test_options_are_checked_before_anything_runs():
    """A bad ``weight_gradients`` or ``not_deferred`` raises a PipelineConfigError (a ValueError) naming
    the value and the choices, before the schedule looks at its stages."""
    with pytest.raises(PipelineConfigError, match=r"weight_gradients='later': use one of 'deferred', 'deferred_compiled', 'split', 'whole'"):
        ScheduleDualPipeV([], 4, weight_gradients="later")
    with pytest.raises(ValueError, match=r"not_deferred='output': pass a list of module names"):
        weight_gradients_problem("deferred", "output")
    with pytest.raises(ValueError, match=r"not_deferred=\[3\]"):
        weight_gradients_problem("split", [3])
    with pytest.raises(PipelineConfigError, match=r"weight_gemms_in_flight='fil': use True .*, False .* or 'fill'"):
        ScheduleDualPipeV([], 4, weight_gemms_in_flight="fil")


# -- expert GEMMs ---------------------------------------------------------------------------

def _titan_experts() -> tuple[nn.Module, Callable]:
    """The installed torchtitan's GroupedExperts (CPU: 0.2.2's per-expert loop; 0.3.0's grouped GEMM
    through CPU mode's float32 seam), 4 experts, and how to call it on tokens."""
    from titan_dualpipe.titan import cpu_moe
    from titan_dualpipe.titan.generation import GEN

    module = importlib.import_module(GEN.experts_module)
    torch.manual_seed(0)
    if GEN.registry:
        experts = module.GroupedExperts(module.GroupedExperts.Config(dim=16, hidden_dim=32, num_experts=4))
        experts._grouped_mm = types.MethodType(cpu_moe.float32_grouped_mm, experts)
    else:
        experts = module.GroupedExperts(dim=16, hidden_dim=32, num_experts=4, use_grouped_mm=False)
    for w in experts.parameters():
        nn.init.normal_(w, std=0.1)
    counts = torch.tensor([3, 0, 5, 4])
    return experts, lambda m, x: m(x, counts)


def _moe_experts() -> tuple[nn.Module, Callable]:
    """This package's MoE experts (bmm over [experts, tokens, dim])."""
    from titan_dualpipe.overlap.moe import GroupedExperts, MoEArgs

    torch.manual_seed(0)
    return GroupedExperts(MoEArgs(dim=16, moe_inter_dim=32, num_experts=4)), lambda m, x: m(x.view(4, 3, 16))


@pytest.mark.parametrize("make", [_titan_experts, _moe_experts], ids=["torchtitan", "ours"])
@pytest.mark.parametrize("ac", ["none", "full"])
def test_expert_weight_gemms_wait_for_w(make, ac):
    """Expert weights (3-D, reshaped per expert, cast or sliced before their GEMMs): at I the input
    gradient only and one queued GEMM per expert GEMM; at W the weight gradients, equal to autograd's."""
    reference, call = make()
    deferred, _ = make()
    queue = WeightGradQueue()
    from titan_dualpipe.weights import register_expert_class

    register_expert_class(type(reference))
    assert install(deferred, queue) == [""]
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(3))

    def run(module, queue=None):
        h = x.clone().requires_grad_()
        with queue.deferring() if queue is not None else contextlib.nullcontext():
            out = checkpoint(call, module, h, use_reentrant=False) if ac == "full" else call(module, h)
        with queue.collecting((0, 0)) if queue is not None else contextlib.nullcontext():
            out.square().sum().backward()
        return h.grad

    want = run(reference)
    got = run(deferred, queue)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in deferred.parameters()) and sum(queue.pending().values()) >= 3
    queue.run((0, 0))
    for (name, p), q in zip(deferred.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


# -- small GEMMs ----------------------------------------------------------------------------

def _deferred_after_input(model: nn.Module, queue: WeightGradQueue, *inputs: torch.Tensor) -> dict[str, bool]:
    """By parameter: whether its gradient waited for W (None after a deferring forward's I); then
    runs the W. ``inputs``: one call of ``model`` each, the outputs summed."""
    with queue.deferring():
        loss = sum(model(x).square().sum() for x in inputs)
    with queue.collecting((0, 0)):
        loss.backward()
    waited = {name: p.grad is None for name, p in model.named_parameters() if name.endswith("weight")}
    queue.run((0, 0))
    return waited


def _plain_grads(model: nn.Module, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    sum(model(x).square().sum() for x in inputs).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_weight_gemms_under_the_least_flops_stay_with_autograd():
    """The CPU's default (8 MFLOP): a 64-token 256x256 layer's weight GEMM (8.4 MFLOP) waits for W,
    a 256x8 layer's (0.26 MFLOP) is computed by autograd at I; ``min_flops=0`` defers both, a
    larger least neither. The gradients equal autograd's bit for bit every time."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))

    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8))

    want = _plain_grads(make(), x)
    for least, waits in [(None, {"0.weight": True, "1.weight": False}), (0, {"0.weight": True, "1.weight": True}),
                         (10**8, {"0.weight": False, "1.weight": False})]:
        model, queue = make(), WeightGradQueue(least)
        install(model, queue)
        assert _deferred_after_input(model, queue, x) == waits, least
        assert sum(queue.ran.values()) == sum(waits.values()), least
        for name, p in model.named_parameters():
            assert torch.equal(p.grad, want[name]), (least, name)


def test_a_weight_defers_every_gemm_of_a_step_or_none():
    """A layer called on 64 tokens and then on 1: its first call of the step decides for both
    (deferred, the small call too), so its accumulation runs once per backward, one post-accumulate
    hook call; the next step decides again (the 1-token call first: neither defers)."""
    torch.manual_seed(0)
    layer, queue = nn.Linear(256, 256), WeightGradQueue(None)
    big, small = torch.randn(64, 256), torch.randn(1, 256)
    calls = []
    layer.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    install(layer, queue)
    assert _deferred_after_input(layer, queue, big, small) == {"weight": True}
    assert queue.ran == {0: 2} and len(calls) == 1
    queue.clear()
    layer.zero_grad(set_to_none=True)
    assert _deferred_after_input(layer, queue, small, big) == {"weight": False}
    assert sum(queue.ran.values()) == 0 and len(calls) == 2
    torch.testing.assert_close(calls[0], calls[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make", [_titan_experts, _moe_experts], ids=["torchtitan", "ours"])
def test_small_expert_gemms_stay_with_autograd(make):
    """Expert GEMMs of 12 tokens on 16x32 experts (a few KFLOP) under the CPU's default: nothing
    queued, the weight gradients computed at I, equal to autograd's."""
    from titan_dualpipe.weights import register_expert_class

    reference, call = make()
    deferred, _ = make()
    register_expert_class(type(reference))
    queue = WeightGradQueue(None)
    install(deferred, queue)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(3))
    call(reference, x).square().sum().backward()
    with queue.deferring():
        out = call(deferred, x)
    with queue.collecting((0, 0)):
        out.square().sum().backward()
    assert not queue.pending() and all(p.grad is not None for p in deferred.parameters())
    for (name, p), q in zip(deferred.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_the_least_flops_option_and_its_environment_are_checked(monkeypatch):
    """A bad ``min_weight_gemm_flops`` or ``TITAN_DUALPIPE_MIN_WEIGHT_GEMM_FLOPS`` raises a
    PipelineConfigError naming the value and the fix, before the schedule looks at its stages; the
    option wins over the environment, which wins over the device's default."""
    from titan_dualpipe.switches import MIN_FLOPS_ENV
    from titan_dualpipe.weights.policy import min_flops_option

    for bad in (-1, 1.5, True, "8M"):
        with pytest.raises(PipelineConfigError, match=rf"min_weight_gemm_flops={bad!r}: pass a count of FLOPs >= 0"):
            ScheduleDualPipeV([], 4, min_weight_gemm_flops=bad)
    monkeypatch.setenv(MIN_FLOPS_ENV, "8M")
    with pytest.raises(PipelineConfigError, match=rf"{MIN_FLOPS_ENV}='8M': set a count of FLOPs >= 0"):
        ScheduleDualPipeV([], 4)
    monkeypatch.setenv(MIN_FLOPS_ENV, "1000")
    assert min_flops_option(None) == 1000 and min_flops_option(0) == 0
    monkeypatch.delenv(MIN_FLOPS_ENV)
    assert min_flops_option(None) is None


def test_installed_modules_copy_and_keep_their_state_dict():
    """A stage module with deferred GEMMs installed deep-copies (the copy defers into the same queue
    until installed again) and keeps its parameter names."""
    import copy

    model, queue = _model(True, "none"), WeightGradQueue()
    names = list(model.state_dict())
    install(model, queue)
    twin = copy.deepcopy(model)
    assert twin[0].w1._weight_grad_queue is queue and list(twin.state_dict()) == names
    other = WeightGradQueue()
    install(twin, other)
    assert twin[0].w1._weight_grad_queue is other and model[0].w1._weight_grad_queue is queue


def _wrap_forward(module: nn.Module) -> Callable:
    """An instance-level forward around the one the class has now, as torchtitan 0.3.0's
    ``Module.parallelize`` sets (input and output redistribution around it)."""
    inner = module.forward

    def forward_with_redistribution(*args, **kwargs):
        return inner(*args, **kwargs)

    module.forward = forward_with_redistribution
    return forward_with_redistribution


@pytest.mark.parametrize("wrapped", ["before-install", "after-install"])
@pytest.mark.parametrize("make", [_titan_experts, _moe_experts, None], ids=["torchtitan-experts", "our-experts", "linear"])
def test_a_forward_wrapped_on_the_instance_defers_too(make, wrapped):
    """A module whose forward an instance attribute wraps (bound to the class's forward before or
    after install) queues its weight GEMMs all the same, with autograd's gradients; uninstall gives
    the wrapper back."""
    from titan_dualpipe.weights import register_expert_class

    if make is None:
        def make():
            torch.manual_seed(0)
            return nn.Linear(16, 24), lambda m, x: m(x)
    reference, call = make()
    deferred, _ = make()
    register_expert_class(type(reference)) if not isinstance(reference, nn.Linear) else None
    queue = WeightGradQueue()
    wrapper = _wrap_forward(deferred) if wrapped == "before-install" else None
    assert install(deferred, queue) == [""]
    wrapper = wrapper or _wrap_forward(deferred)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(3))

    def input_grad(module, queue=None):
        h = x.clone().requires_grad_()
        with queue.deferring() if queue is not None else contextlib.nullcontext():
            loss = call(module, h).square().sum()
        with queue.collecting((0, 0)) if queue is not None else contextlib.nullcontext():
            loss.backward()
        return h.grad

    torch.testing.assert_close(input_grad(deferred, queue), input_grad(reference), rtol=1e-6, atol=1e-7)
    weights = [p for p in deferred.parameters() if p.dim() > 1]
    assert weights and all(p.grad is None for p in weights) and sum(queue.pending().values()) >= 1
    queue.run((0, 0))
    for (name, p), q in zip(deferred.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)
    uninstall(deferred)
    assert type(deferred) is type(reference)
    assert deferred.forward is wrapper
    for module in (deferred, reference):
        module.zero_grad()
    torch.testing.assert_close(input_grad(deferred), input_grad(reference), rtol=1e-6, atol=1e-7)
    for (name, p), q in zip(deferred.named_parameters(), reference.parameters()):  # autograd's again
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


class _PostedExchange(torch.autograd.Function):
    """Identity whose backward posts an "exchange" (logged) and hands over, as the expert
    all-to-all's backward does between posting and waiting."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, log: list) -> torch.Tensor:  # type: ignore[override]
        ctx.log = log
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        from titan_dualpipe.overlap.relay import hand_over

        ctx.log.append("posted")
        hand_over(backward=True)
        ctx.log.append("waited")
        return grad, None


def test_a_full_backward_computes_its_weight_gemms_while_its_exchange_flies():
    """``work_while_exchanges_fly``: the weight GEMMs queued before an exchange is posted (the
    layer after it, backpropagated first) are computed between posting and waiting; the rest at
    the end, where all go to autograd together. Gradients equal autograd's bit for bit; nothing
    runs outside the block."""
    from titan_dualpipe.weights.in_flight import run_work_in_flight, work_while_exchanges_fly

    log: list[str] = []
    first, second = nn.Linear(16, 32), nn.Linear(32, 16)
    reference = [nn.Linear(16, 32), nn.Linear(32, 16)]
    for ref, mod in zip(reference, (first, second)):
        ref.load_state_dict(mod.state_dict())
    queue = WeightGradQueue()
    for mod in (first, second):
        install(mod, queue)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    key = (0, 0)

    def in_flight() -> None:
        log.append(f"W x{queue.compute_in_flight(key)}")

    with queue.deferring():
        loss = second(_PostedExchange.apply(first(x), log)).square().sum()
    with queue.collecting(key), work_while_exchanges_fly(in_flight):
        loss.backward()
    assert log == ["posted", "W x1", "waited"]  # second's GEMM in flight
    assert all(p.grad is None for p in (first.weight, second.weight)) and queue.pending() == {key: 2}
    assert queue.run(key, at_weight=False) == 2  # first's computed now, both accumulated
    assert (queue.ran_in_flight, sum(queue.ran.values()), queue.pending()) == (1, 0, {})
    reference[1](reference[0](x)).square().sum().backward()
    for mod, ref in zip((first, second), reference):
        for p, q in zip(mod.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    with torch.no_grad():
        run_work_in_flight()  # outside the block: nothing set aside
    assert log[-1] == "waited"


def test_a_segment_wise_backward_runs_the_work_in_flight_at_its_own_exchanges():
    """``interleave(backward, forward, backwards=(0,))`` (a module's overlapped pair): each exchange the
    backward step posts runs the work set aside, though its caller has grad mode on, and builds no
    graph; the forward step's exchanges run none of it."""
    from titan_dualpipe.overlap.segments import interleave
    from titan_dualpipe.weights.in_flight import work_while_exchanges_fly

    class Posted:
        def wait(self) -> None:
            return None

    log: list[str] = []

    def step(name: str, exchanges: int):
        for i in range(exchanges):
            log.append(f"{name} posts {i}")
            yield Posted()
        return name

    def work() -> None:
        log.append(f"work, grad mode {torch.is_grad_enabled()}")

    with work_while_exchanges_fly(work):
        assert interleave(step("B", 2), step("F", 2), backwards=(0,)) == ("B", "F")
    assert log == ["B posts 0", "work, grad mode False", "F posts 0", "B posts 1", "work, grad mode False",
                   "F posts 1"]
    log.clear()
    with work_while_exchanges_fly(work):
        interleave(step("B", 1), step("F", 1))  # no step named a backward: nothing runs
    assert log == ["B posts 0", "F posts 0"]


def test_fillers_compute_only_what_fits_before_the_partners_exchange_arrives():
    """``compute_in_flight(key, until)``: GEMMs in queue order while the last GEMM of each size says
    the next ends before ``until``; the rest stay queued for a later exchange or the backward's end,
    where all accumulate in queue order: gradients equal to computing all at once, bit for bit."""
    import time

    from titan_dualpipe.weights.in_flight import fill_before_wait, run_work_in_flight, work_while_exchanges_fly

    layers = [nn.Linear(64, 64) for _ in range(3)]
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    grads = {}
    for fill in (False, True):
        queue, key = WeightGradQueue(), (0, 0)
        for layer in layers:
            install(layer, queue)
            layer.zero_grad(set_to_none=True)
        with queue.deferring():
            loss = layers[2](layers[1](layers[0](x))).square().sum()
        with queue.collecting(key):
            loss.backward()
        assert queue.pending() == {key: 3}
        if fill:
            assert queue.compute_in_flight(key, until=time.perf_counter() - 1.0) == 0  # arrived already
            queue._seconds[("linear", (32, 64), (32, 64))] = 30.0  # as if the last GEMM of this size took 30 s
            assert queue.compute_in_flight(key, until=time.perf_counter() + 10.0) == 0
            queue._seconds.clear()
            with work_while_exchanges_fly(functools.partial(queue.compute_in_flight, key), fill=True), torch.no_grad():
                run_work_in_flight(until=time.perf_counter() - 1.0)
                assert queue.ran_in_flight == 0
                fill_before_wait(None)  # arrival unknown: nothing before the wait
                assert queue.ran_in_flight == 0
                fill_before_wait(time.perf_counter() + 60.0)
                assert queue.ran_in_flight == 3
        else:
            with work_while_exchanges_fly(functools.partial(queue.compute_in_flight, key)), torch.no_grad():
                run_work_in_flight(until=time.perf_counter() - 1.0)  # not as fillers: every GEMM queued
                fill_before_wait(time.perf_counter() + 60.0)  # and nothing before waits
            assert queue.ran_in_flight == 3
        queue.run(key, at_weight=False)
        grads[fill] = [p.grad.clone() for layer in layers for p in layer.parameters()]
        for layer in layers:
            uninstall(layer)
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True], strict=True))


def test_only_a_backwards_exchanges_run_the_work_in_flight():
    """A forward's exchange (``hand_over()``: a pair's forward half, a forward outside any pair, a
    checkpointed region's recomputation inside the backward) leaves the backward's queued GEMMs
    alone; a backward's exchange (``hand_over(backward=True)``, from an autograd node, grad mode
    off) runs them, in a pair's either half or outside any pair."""
    import threading

    from titan_dualpipe.overlap.relay import hand_over, run_relayed
    from titan_dualpipe.weights.in_flight import work_while_exchanges_fly

    ran: list[str] = []
    backward = functools.partial(hand_over, backward=True)
    with work_while_exchanges_fly(lambda: ran.append(threading.current_thread().name)), torch.no_grad():
        run_relayed(lambda: (hand_over(), hand_over()), hand_over)
        hand_over()
        assert ran == []
        run_relayed(lambda: (hand_over(), hand_over()), backward)
        assert ran == ["titan_dualpipe-backward-half"]
        backward()
        with torch.enable_grad():
            backward()
    with torch.no_grad():
        backward()
    assert ran == ["titan_dualpipe-backward-half", threading.current_thread().name]


class _Exchanged(nn.Module):
    """A block that posts an exchange in its forward and its backward (a relayed expert all-to-all),
    its region checkpointed as ``ac`` says, after a linear layer outside the region."""

    def __init__(self, ac: str) -> None:
        super().__init__()
        self.outside = nn.Linear(16, 16)
        self.w1, self.w2, self.inner = nn.Linear(16, 32), nn.Linear(32, 16), nn.Linear(16, 16)
        self.ac = ac

    def region(self, h: torch.Tensor) -> torch.Tensor:
        if self.ac == "nested":
            h = checkpoint(self.inner, h, use_reentrant=False)
        x = _TwoWayExchange.apply(torch.nn.functional.gelu(self.w1(h)))
        return h + self.w2(x)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.outside(h)
        if self.ac == "none":
            return self.region(h)
        context = _selective_context() if self.ac == "selective" else {}
        return checkpoint(self.region, h, use_reentrant=False, **context)


class _TwoWayExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        from titan_dualpipe.overlap.relay import hand_over

        hand_over()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        from titan_dualpipe.overlap.relay import hand_over

        hand_over(backward=True)
        return grad


@pytest.mark.parametrize("ac", ["none", "full", "selective", "nested"])
def test_weight_gemms_in_flight_never_run_inside_a_recomputation(ac):
    """A full backward with weight GEMMs in flight through a checkpointed block that posts an exchange
    (its recomputation posts it again, inside the backward) and a deferrable layer outside the
    block: the GEMMs run at the backward's own exchange, never in the recomputation, and every
    gradient equals plain autograd's bit for bit."""
    from titan_dualpipe.weights.in_flight import work_while_exchanges_fly

    torch.manual_seed(0)
    reference = _Exchanged(ac)
    model, queue = _Exchanged(ac), WeightGradQueue()
    model.load_state_dict(reference.state_dict())
    install(model, queue)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(4))
    recomputing = []

    def in_flight() -> None:
        recomputing.append(torch.is_grad_enabled())
        queue.compute_in_flight((0, 0))

    reference(x).square().sum().backward()
    with queue.deferring():
        loss = model(x).square().sum()
    with queue.collecting((0, 0)), work_while_exchanges_fly(in_flight):
        loss.backward()
    assert recomputing == [False] and queue.ran_in_flight >= 1
    queue.run((0, 0), at_weight=False)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None and q.grad is None) if ac != "nested" and name.startswith("inner") \
            else torch.equal(p.grad, q.grad), name


def test_a_queued_expert_gemm_holds_only_what_it_reads():
    """An expert GEMM on a copy of the expert weights (torchtitan casts them to bfloat16 first): after
    I, its queued weight GEMM holds the output gradient and the tokens, not the copy, which is freed;
    W gives the gradient back through the copy's graph, as autograd does."""
    import gc
    import weakref

    from titan_dualpipe.weights.experts import DeferringExpertGemms

    torch.manual_seed(0)
    experts = nn.Parameter(torch.randn(4, 16, 32))
    tokens = torch.randn(4, 3, 16, requires_grad=True)
    queue = WeightGradQueue()
    with DeferringExpertGemms(queue):
        copy = experts * 1.0
        out = torch.bmm(tokens, copy)
    held = weakref.ref(copy)
    del copy
    with queue.collecting((0, 0)):
        out.square().sum().backward()
    gc.collect()
    assert held() is None and experts.grad is None and queue.pending() == {(0, 0): 1}
    queue.run((0, 0))
    reference = experts.detach().clone().requires_grad_()
    torch.bmm(tokens.detach(), reference * 1.0).square().sum().backward()
    torch.testing.assert_close(experts.grad, reference.grad, rtol=1e-6, atol=1e-6)


def test_the_compiled_weight_gemm_is_unsafe_for_cuda_graphs():
    """Whether it queues is decided at run time, and a queued GEMM outlives the call: a CUDA graph
    (``mode="reduce-overhead"``) must not capture it."""
    import titan_dualpipe.weights.linear  # noqa: F401 - registers the operator

    assert torch.Tag.cudagraph_unsafe in torch.ops.titan_dualpipe.linear_weight_gemm.default.tags
