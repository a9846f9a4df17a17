"""Deferrable ``nn.Linear`` GEMMs: inside an ``I`` the weight GEMM ``dW = dY^T X`` is queued for ``W``.

A forward run under :meth:`~.queue.WeightGradQueue.deferring` builds two nodes per linear call
that keep the weight out of the graph; their backward computes ``dX`` and queues ``dW`` with its
two operands, so at ``I`` nothing reaches the weight's accumulation. Under autocast they cast as
autocast does. In a compiled region the weight GEMM is a custom operator that queues or computes
at run time (one graph for both). docs/weight_gradients.md tells the whole story.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .queue import WeightGradQueue, autocast_dtype, defer_or_accumulate


class _LinearCall:
    """One deferrable ``F.linear`` call's weight, out of the graph (not an input of its nodes), and
    ``dY``, handed from its GEMM's backward to its operands' node."""

    __slots__ = ("weight", "grad_2d")

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.grad_2d: torch.Tensor | None = None


class _LinearOperands(torch.autograd.Function):
    """The input of one deferrable ``F.linear`` call, passed on unchanged and saved for its
    weight GEMM, which this node queues for ``W`` (or accumulates at once, outside an ``I``).

    It runs before the GEMM and saves its operand then, while the GEMM's node saves nothing: in
    a checkpointed region's recomputation, torch stops at the last saved tensor (early stop), so
    a region ending in a linear layer skips that layer's forward GEMM, as under plain autograd.
    One node that computes and saves would save after its GEMM, which then always reruns (a
    third of a Transformer block's recomputed GEMM work when the block ends in its MLP).
    ``anchor`` keeps the node in the graph when the input needs no gradient.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, anchor: torch.Tensor | None, queue: WeightGradQueue,
                call: _LinearCall) -> torch.Tensor:
        ctx.save_for_backward(input)
        # The gradient goes to the parameter itself: a checkpointed region's saved tensors come
        # back from its recomputation as detached aliases.
        ctx.queue, ctx.call = queue, call
        ctx.set_materialize_grads(False)
        return input.view_as(input)

    @staticmethod
    def backward(ctx, grad_input: torch.Tensor | None):
        (input,) = ctx.saved_tensors
        grad_2d, ctx.call.grad_2d = ctx.call.grad_2d, None
        if grad_2d is not None:
            input_2d = input.reshape(-1, input.shape[-1])
            defer_or_accumulate(ctx.queue, ctx.call.weight, lambda: grad_2d.t().mm(input_2d), "linear",
                                (grad_2d, input_2d))
        return grad_input, None, None, None


class _DeferrableLinear(torch.autograd.Function):
    """``F.linear`` whose weight GEMM is left to its input's :class:`_LinearOperands` node:
    this node computes ``dX = dY W`` and the bias gradient and hands ``dY`` on.

    The GEMMs are those autograd runs for ``F.linear`` (``dX = dY W``, ``dW = dY^T X`` on the
    inputs flattened to 2-D), so a gradient computed at once equals autograd's. Nothing is saved
    here (the weight is a parameter, or autocast's cast of one, held as is), so a recomputation
    may stop before the GEMM.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                input_needs_grad: bool, call: _LinearCall) -> torch.Tensor:
        ctx.weight, ctx.input_needs_grad, ctx.call = weight, input_needs_grad, call
        ctx.input_shape = input.shape
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_2d = grad.reshape(-1, grad.shape[-1])
        ctx.call.grad_2d = grad_2d
        grad_input, grad_bias = _input_and_bias_grads(grad_2d, ctx.weight, ctx.input_shape, ctx.input_needs_grad,
                                                      ctx.needs_input_grad[2])
        return grad_input, None, grad_bias, None, None


def deferrable_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      queue: WeightGradQueue) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` whose weight GEMM waits for ``W`` when its backward runs
    inside an ``I`` (``weight``: a parameter that needs a gradient), under autocast as autocast runs it;
    plain ``F.linear`` where the GEMM is too small (:meth:`~.queue.WeightGradQueue.worth_deferring`)."""
    if not queue.worth_deferring(weight, 2 * input.numel() * weight.shape[0], input.device):
        return F.linear(input, weight, bias)
    dtype = autocast_dtype(input)
    if dtype is None:
        return _linear_nodes(input, weight, bias, queue, queue.compute_weight(weight, weight.dtype))
    # cast here as autocast would (its own casts of these operands are then no-ops); no autocast
    # context is entered: its exit could clear autocast's process-wide cast cache
    bias = bias.to(dtype) if bias is not None else None
    return _linear_nodes(input.to(dtype), weight, bias, queue, queue.compute_weight(weight, dtype))


def _linear_nodes(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, queue: WeightGradQueue,
                  compute_weight: torch.Tensor) -> torch.Tensor:
    call = _LinearCall(weight)
    anchor = None if input.requires_grad else queue.anchor(input.device)
    operand = _LinearOperands.apply(input, anchor, queue, call)
    return _DeferrableLinear.apply(operand, compute_weight, bias, input.requires_grad, call)


def _input_and_bias_grads(grad_2d: torch.Tensor, weight: torch.Tensor, input_shape: torch.Size, input_needs_grad: bool,
                          bias_needs_grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``F.linear``'s input gradient (``dX = dY W``, the GEMM autograd runs) and bias gradient from
    the output gradient ``dY`` flattened to 2-D; None where not needed."""
    grad_input = grad_2d.mm(weight).view(input_shape) if input_needs_grad else None
    return grad_input, grad_2d.sum(0) if bias_needs_grad else None


def _linear_grads(ctx: Any, grad: torch.Tensor,
                  weight_grad: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> tuple:
    """``F.linear``'s gradients (input, weight, bias, and None for the extra argument) from the
    saved input and weight, with the GEMMs autograd runs (``dX = dY W``; ``dW = dY^T X`` on the
    inputs flattened to 2-D, left to ``weight_grad(dY, X, W)``)."""
    input, weight = ctx.saved_tensors
    grad_2d = grad.reshape(-1, grad.shape[-1])
    grad_input, grad_bias = _input_and_bias_grads(grad_2d, weight, input.shape, ctx.needs_input_grad[0],
                                                  ctx.needs_input_grad[2])
    grad_weight = weight_grad(grad_2d, input.reshape(-1, input.shape[-1]), weight) if ctx.needs_input_grad[1] else None
    return grad_input, grad_weight, grad_bias, None


def _compiled_weight_gemm(queue: WeightGradQueue, parameter: torch.Tensor, grad_2d: torch.Tensor,
                          input_2d: torch.Tensor) -> torch.Tensor | None:
    """``dW = dY^T X`` at once, or None when it is queued for ``W`` (inside an ``I``, when large
    enough), on copies of the operands (a compiled graph may reuse their buffers once the call
    returns)."""
    flops = 2 * grad_2d.shape[0] * grad_2d.shape[1] * input_2d.shape[1]
    if queue.target is not None and queue.worth_deferring(parameter, flops, grad_2d.device):
        grad_2d, input_2d = grad_2d.clone(), input_2d.clone()
        if queue.defer(parameter, lambda: grad_2d.t().mm(input_2d), holds=(grad_2d, input_2d)):
            return None
    return grad_2d.t().mm(input_2d)


_linears_by_key: dict[int, "weakref.ref[nn.Module]"] = {}  # installed nn.Linear modules, for compiled graphs
_linear_keys = itertools.count()


def _linear_of(key: int) -> nn.Module | None:
    ref = _linears_by_key.get(key)
    return ref() if ref is not None else None


def key_linear(module: nn.Module) -> None:
    """Give an installed ``nn.Linear`` the key its compiled graphs name it by (a copy gets its own)."""
    if _linear_of(getattr(module, "_deferral_key", -1)) is not module:
        key = module._deferral_key = next(_linear_keys)
        _linears_by_key[key] = weakref.ref(module, lambda _, key=key: _linears_by_key.pop(key, None))


def forget_linear(module: nn.Module) -> None:
    """Drop an uninstalled ``nn.Linear``'s key."""
    if "_deferral_key" in vars(module):
        _linears_by_key.pop(module.__dict__.pop("_deferral_key"), None)


# Marked unsafe for CUDA graphs: whether it queues is decided at run time, and a queued GEMM holds
# its operands past the call, neither of which a captured graph can replay.
@torch.library.custom_op("titan_dualpipe::linear_weight_gemm", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def _linear_weight_gemm(grad_2d: torch.Tensor, input_2d: torch.Tensor, weight: torch.Tensor, key: int) -> torch.Tensor:
    """``dW = dY^T X`` of installed ``nn.Linear`` ``key`` in a compiled backward; inside an ``I``,
    queued for ``W`` (zeros returned: autograd adds them to the gradient, ``W`` adds the GEMM)."""
    module = _linear_of(key)
    queue = getattr(module, "_weight_grad_queue", None)
    parameter = getattr(module, "weight", None)  # the tensor autograd accumulates into (FSDP2: the gathered one)
    if queue is None or parameter.data_ptr() != weight.data_ptr() or parameter.shape != weight.shape:
        return grad_2d.t().mm(input_2d)
    grad_weight = _compiled_weight_gemm(queue, parameter, grad_2d, input_2d)
    return torch.zeros_like(weight) if grad_weight is None else grad_weight


@_linear_weight_gemm.register_fake
def _(grad_2d: torch.Tensor, input_2d: torch.Tensor, weight: torch.Tensor, key: int) -> torch.Tensor:
    return weight.new_empty(weight.shape)


class _CompiledDeferrableLinear(torch.autograd.Function):
    """``F.linear`` for a compiled region: the input GEMM is traced as usual, the weight GEMM is
    :func:`_linear_weight_gemm`, which decides at run time whether it waits for ``W``."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.key = key
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _linear_grads(ctx, grad, lambda grad_2d, input_2d, weight: torch.ops.titan_dualpipe.linear_weight_gemm(
            grad_2d, input_2d, weight, ctx.key))


class _DeferrableLinearForward:
    """The forward of an installed ``nn.Linear`` (mixed in ahead of its class)."""

    _weight_grad_queue: WeightGradQueue
    _deferral_key: int

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        # A weight computed from others (a parametrization) gets its gradient through autograd;
        # an uninstalled module reaches here through a wrapper bound while it was installed.
        if (not torch.is_grad_enabled() or not weight.requires_grad or not weight.is_leaf
                or not isinstance(self, _DeferrableLinearForward)):
            return F.linear(input, self.weight, self.bias)
        if torch.compiler.is_compiling():
            if _is_dtensor(weight):  # no sharding rule for the operator: the GEMM stays in the graph
                return F.linear(input, self.weight, self.bias)
            return _CompiledDeferrableLinear.apply(input, self.weight, self.bias, self._deferral_key)
        if not self._weight_grad_queue.routes_now():  # a forward whose backward computes its weight gradient
            return F.linear(input, self.weight, self.bias)
        return deferrable_linear(input, self.weight, self.bias, self._weight_grad_queue)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class _DeferringLinearCalls(TorchFunctionMode):
    """Routes the ``F.linear`` calls of one forward whose weight needs a gradient through
    :func:`deferrable_linear`: an installed ``nn.Linear`` whose forward an instance attribute
    replaced (torchtitan 0.3.0's ``Module.parallelize`` wraps it with input and output
    redistribution, around the forward the class had then)."""

    def __init__(self, queue: WeightGradQueue) -> None:
        super().__init__()
        self.queue = queue

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            named = {**dict(zip(("input", "weight", "bias"), args)), **kwargs}
            input, weight, bias = named["input"], named["weight"], named.get("bias")
            if isinstance(weight, torch.Tensor) and weight.requires_grad and weight.is_leaf:
                return deferrable_linear(input, weight, bias, self.queue)
        return func(*args, **kwargs)
