"""Deferrable expert GEMMs: the weight GEMMs of mixture-of-experts layers, queued at ``I`` for ``W``.

An expert layer's second GEMM operand is computed from a parameter (a per-expert slice, a cast
and transpose, a DTensor's ``to_local()``). While an installed expert module runs its forward,
:class:`DeferringExpertGemms` routes each ``mm`` / ``matmul`` (2-D weight), ``bmm``,
``_grouped_mm`` and CPU mode's float32 grouped GEMM whose second operand needs a gradient
through :class:`_DeferrableGemm`. The operand is no input of that node: its gradient enters
autograd at the operand's edge (:func:`~.queue.root_of`), so at ``I`` nothing reaches the
parameter, and at ``W`` the queued GEMM's result flows back through the operand's own small graph.
A queued GEMM holds the output gradient and the tokens only.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from .queue import WeightGradQueue, autocast_dtype, defer_or_accumulate, root_of


def _float32_grouped_mm() -> Any:
    """CPU mode's float32 grouped GEMM op, if it is registered (importing the torchtitan adapter registers it)."""
    try:
        return torch.ops.titan_dualpipe.grouped_mm_float32.default
    except (AttributeError, RuntimeError):
        return None


class _Gemm:
    """One GEMM kind: its forward and the two gradient GEMMs autograd would run for it.
    ``autocast``: whether autocast casts its operands (``mm``, ``bmm``, ``matmul``)."""

    autocast = False

    def __init__(self, forward: Callable[..., torch.Tensor], offs: torch.Tensor | None = None) -> None:
        self.forward, self.offs = forward, offs
        self.root: Any = None  # where the weight operand's gradient enters autograd

    def input_grad(self, grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight_grad(self, grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _MatmulGemm(_Gemm):
    """``a @ b``: ``a`` of any rank >= 2 (flattened to rows), ``b`` 2-D; autograd's ``mm`` backward."""

    autocast = True

    def __init__(self, forward: Callable[..., torch.Tensor], b: torch.Tensor) -> None:
        super().__init__(forward)
        # a transposed weight gets its gradient in the same layout; read now, so W need not hold b
        self.transposed = b.stride(0) == 1 and b.stride(1) == b.shape[0]

    def input_grad(self, grad, a, b):
        return grad.reshape(-1, grad.shape[-1]).mm(b.t()).view(a.shape)

    def weight_grad(self, grad, a, b):
        grad_2d, a_2d = grad.reshape(-1, grad.shape[-1]), a.reshape(-1, a.shape[-1])
        if self.transposed:
            return grad_2d.t().mm(a_2d).t()
        return a_2d.t().mm(grad_2d)


class _BatchedGemm(_Gemm):
    """``torch.bmm(a, b)`` over experts."""

    autocast = True

    def input_grad(self, grad, a, b):
        return grad.bmm(b.transpose(1, 2))

    def weight_grad(self, grad, a, b):
        return a.transpose(1, 2).bmm(grad)


class _GroupedGemm(_Gemm):
    """Tokens ``a`` [T, K] x experts ``b`` [E, K, N], token groups ending at ``offs``."""

    def input_grad(self, grad, a, b):
        return self.forward(grad, b.transpose(-2, -1), self.offs)

    def weight_grad(self, grad, a, b):
        return self.forward(a.transpose(0, 1), grad, self.offs)


class _DeferrableGemm(torch.autograd.Function):
    """One expert GEMM ``gemm(a, b)``; ``b`` comes in out of the graph, its gradient goes to ``root``
    (see the module docstring). ``anchor`` keeps the node in the graph when ``a`` needs no gradient."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, anchor: torch.Tensor | None, gemm: _Gemm,
                queue: WeightGradQueue) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.gemm, ctx.queue = gemm, queue
        return gemm.forward(a, b) if gemm.offs is None else gemm.forward(a, b, gemm.offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        gemm = ctx.gemm
        grad_a = gemm.input_grad(grad, a, b) if ctx.needs_input_grad[0] else None
        # the GEMM reads the output gradient and the tokens: b (a cast copy of the weights) is not held
        defer_or_accumulate(ctx.queue, gemm.root, lambda: gemm.weight_grad(grad, a, None), "experts", (grad, a))
        return grad_a, None, None, None, None


def _deferrable_gemm(gemm: _Gemm, a: torch.Tensor, b: torch.Tensor, queue: WeightGradQueue) -> torch.Tensor:
    dtype = autocast_dtype(a) if gemm.autocast else None
    b = b.detach()
    if dtype is not None:  # cast as autocast would (see deferrable_linear)
        a, b = a.to(dtype), b.to(dtype)
    return _DeferrableGemm.apply(a, b, _anchor_for(a, queue), gemm, queue)


def _anchor_for(a: torch.Tensor, queue: WeightGradQueue) -> torch.Tensor | None:
    return None if a.requires_grad else queue.anchor(a.device)


class DeferringExpertGemms(TorchFunctionMode):
    """Routes the expert GEMMs of one forward through :class:`_DeferrableGemm` (see the module docstring)."""

    def __init__(self, queue: WeightGradQueue) -> None:
        super().__init__()
        self.queue = queue
        self.float32_grouped_mm = _float32_grouped_mm()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        gemm, a, b = self._gemm(func, args, kwargs)
        if gemm is None:
            return func(*args, **kwargs)
        gemm.root = root_of(b)  # not an input of the node: a parameter would be one of its edges
        # every kind's weight GEMM multiplies each element of ``a`` with a column of ``b``
        if not self.queue.worth_deferring(gemm.root, 2 * a.numel() * b.shape[-1], a.device):
            return func(*args, **kwargs)
        return _deferrable_gemm(gemm, a, b, self.queue)

    def _gemm(self, func: Any, args: tuple, kwargs: dict) -> tuple[_Gemm | None, Any, Any]:
        operands = [*args, *kwargs.values()]
        if len(operands) < 2 or not all(isinstance(t, torch.Tensor) for t in operands[:2]):
            return None, None, None
        a, b = operands[:2]
        if not b.requires_grad or not torch.is_grad_enabled():
            return None, None, None
        if func in (torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm) and b.dim() == 2 and a.dim() >= 2 \
                and len(operands) == 2:
            return _MatmulGemm(torch.mm if a.dim() == 2 else torch.matmul, b), a, b
        if func in (torch.bmm, torch.Tensor.bmm) and len(operands) == 2:
            return _BatchedGemm(torch.bmm), a, b
        grouped = func is torch._grouped_mm or (self.float32_grouped_mm is not None and func is self.float32_grouped_mm)
        if grouped and a.dim() == 2 and b.dim() == 3:
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            extra = {k: v for k, v in kwargs.items() if k != "offs" and v is not None}
            if offs is not None and not extra and len(args) <= 3:
                forward = func if func is not torch._grouped_mm else (lambda x, y, o: torch._grouped_mm(x, y, offs=o))
                return _GroupedGemm(forward, offs), a, b
        return None, None, None
