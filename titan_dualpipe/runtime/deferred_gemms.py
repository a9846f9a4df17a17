"""Deferrable expert GEMMs: the weight GEMMs of mixture-of-experts layers, queued at ``I`` for ``W``.

An expert layer multiplies tokens by expert weights that it first reshapes: sliced per expert
(``w1[e].transpose(-2, -1)``, torchtitan 0.2.2's loop), cast and transposed
(``w1.bfloat16().transpose(-2, -1)``, its grouped GEMM), taken from a DTensor (``to_local()``
under expert parallelism). So its second operand is not a parameter but a tensor computed from
one. While an installed expert module runs its forward, :class:`DeferringExpertGemms` (a
``TorchFunctionMode``) routes each GEMM whose second operand needs a gradient through
:class:`_DeferrableGemm`:

- ``torch.matmul`` / ``torch.mm`` of a 2-D weight operand, ``torch.bmm``, ``torch._grouped_mm``
  (tokens x experts with offsets), and this package's float32 grouped GEMM (CPU mode).

In a backward inside an ``I`` the input gradient is computed at once and the weight operand's
gradient GEMM is queued; at ``W`` it runs and its result flows back to the parameter through the
operand's own small graph (slice, cast, transpose, ``to_local``), one autograd call for all of a
microbatch's expert GEMMs. Outside an ``I`` it is computed at once and autograd takes it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode


def _float32_grouped_mm() -> Any:
    """CPU mode's float32 grouped GEMM op, if it is registered (importing the torchtitan adapter registers it)."""
    try:
        return torch.ops.titan_dualpipe.grouped_mm_float32.default
    except (AttributeError, RuntimeError):
        return None


class _Gemm:
    """One GEMM kind: its forward and the two gradient GEMMs autograd would run for it."""

    def __init__(self, forward: Callable[..., torch.Tensor], offs: torch.Tensor | None = None) -> None:
        self.forward, self.offs = forward, offs

    def input_grad(self, grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight_grad(self, grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _MatmulGemm(_Gemm):
    """``a @ b``: ``a`` of any rank >= 2 (flattened to rows), ``b`` 2-D; autograd's ``mm`` backward."""

    def input_grad(self, grad, a, b):
        return grad.reshape(-1, grad.shape[-1]).mm(b.t()).view(a.shape)

    def weight_grad(self, grad, a, b):
        grad_2d, a_2d = grad.reshape(-1, grad.shape[-1]), a.reshape(-1, a.shape[-1])
        if b.stride(0) == 1 and b.stride(1) == b.shape[0]:  # a transposed weight: its gradient in the same layout
            return grad_2d.t().mm(a_2d).t()
        return a_2d.t().mm(grad_2d)


class _BatchedGemm(_Gemm):
    """``torch.bmm(a, b)`` over experts."""

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
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, gemm: _Gemm, queue: Any) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        # the operand as the forward made it: at W its gradient flows back through its own graph
        # (a checkpointed region's saved tensors come back as detached recomputations)
        ctx.operand, ctx.gemm, ctx.queue = b, gemm, queue
        return gemm.forward(a, b) if gemm.offs is None else gemm.forward(a, b, gemm.offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        gemm, operand = ctx.gemm, ctx.operand
        grad_a = gemm.input_grad(grad, a, b) if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.needs_input_grad[1]:
            queued = ctx.queue.defer_to_operand(operand, lambda: gemm.weight_grad(grad, a, b), "experts", holds=(grad, a))
            if not queued:
                grad_b = gemm.weight_grad(grad, a, b)
        return grad_a, grad_b, None, None


class DeferringExpertGemms(TorchFunctionMode):
    """Routes the expert GEMMs of one forward through :class:`_DeferrableGemm` (see the module docstring)."""

    def __init__(self, queue: Any) -> None:
        super().__init__()
        self.queue = queue
        self.float32_grouped_mm = _float32_grouped_mm()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        gemm, a, b = self._gemm(func, args, kwargs)
        if gemm is None:
            return func(*args, **kwargs)
        return _DeferrableGemm.apply(a, b, gemm, self.queue)

    def _gemm(self, func: Any, args: tuple, kwargs: dict) -> tuple[_Gemm | None, Any, Any]:
        operands = [*args, *kwargs.values()]
        if len(operands) < 2 or not all(isinstance(t, torch.Tensor) for t in operands[:2]):
            return None, None, None
        a, b = operands[:2]
        if not b.requires_grad or not torch.is_grad_enabled():
            return None, None, None
        if func in (torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm) and b.dim() == 2 and a.dim() >= 2 \
                and len(operands) == 2:
            return _MatmulGemm(torch.mm if a.dim() == 2 else torch.matmul), a, b
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
