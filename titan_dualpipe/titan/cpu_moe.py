"""CPU mode for torchtitan's MoE layers (0.2.2: deepseek_v3, llama4, qwen3, gpt_oss; 0.3.0).

Applied by :func:`titan_dualpipe.titan.cpu.enable`, so only when there is no accelerator. The
experts multiply in float32, since CPUs without bfloat16 units run bfloat16 matmuls many times
slower (benchmarks/2026-11-25-cpu-xeon-2core.md#cpu-mode-in-float32): on 0.2.2 through its own
switch, ``moe_args.use_grouped_mm = False`` (:func:`use_float32_experts_022`); on 0.3.0 through
``GroupedExperts``' ``_grouped_mm`` seam (:func:`float32_grouped_mm`: the operands keep
torchtitan's bfloat16 rounding, products and sums are float32). On 0.2.2 two calls also stop the
MoE forward on CPU, each fixed in the one torchtitan module that makes it: ``torch.histc`` of the
int64 expert indices in ``torchtitan.models.moe.moe`` (:class:`TorchWithIntegerHistc`), and the
Triton kernel ``generate_permute_indices`` in ``torchtitan.models.moe.utils`` (given
``use_cpu=True``, torchtitan's own CPU implementation).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from .generation import GEN


def integer_histc(values: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """``torch.histc`` for an integer tensor, exact, returned in the input's dtype.

    Same rules as histc: values outside ``[min, max]`` are ignored and ``max`` falls in the
    last bin; ``min == max`` takes the range from the data.
    """
    flat = values.reshape(-1)
    if min == max:
        if flat.numel() == 0:
            return torch.zeros(bins, dtype=values.dtype, device=values.device)
        min, max = flat.min().item(), flat.max().item()
        if min == max:
            min, max = min - 1, max + 1  # histc's rule for a constant input
    if max - min == bins and float(min).is_integer():  # unit bins, as torchtitan's MoE uses
        kept = flat[(flat >= min) & (flat <= max)] - int(min)
        return torch.bincount(kept.clamp(max=bins - 1), minlength=bins).to(values.dtype)
    return torch.histc(flat.double(), bins, min, max).to(values.dtype)  # exact below 2**53


class TorchWithIntegerHistc:
    """``torch`` for one module's global name ``torch``, with integer ``histc`` supported (the CPU
    kernel has none: "histogram_cpu" not implemented for 'Long'), exact and in the dtype CUDA
    returns (the input's)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def histc(values: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0, **kwargs: Any) -> torch.Tensor:
        if values.is_floating_point() or values.is_complex() or kwargs:
            return torch.histc(values, bins, min, max, **kwargs)
        return integer_histc(values, bins, min, max)


@torch.library.custom_op("titan_dualpipe::grouped_mm_float32", mutates_args=())
def grouped_mm_float32(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` in float32, as an op torch.compile can trace.

    torch's own op runs float32 on CPU, but its fake (meta) kernel accepts only bfloat16 and
    float16 (torch 2.14.1, ``_meta_registrations.py``): a block torchtitan compiles around the
    experts fails to trace it. Here the fake kernel gives the shape and the same kernels run,
    forward and backward, bit for bit what eager autograd computes."""
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm_float32.register_fake
def _grouped_mm_float32_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:  # tokens (M, K) x experts (E, K, N): (M, N)
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])  # (K, M) x (M, N) per group: (E, K, N)


def _save_operands(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_float32_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    a, b, offs = ctx.saved_tensors
    grad_a = grouped_mm_float32(grad, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = grouped_mm_float32(a.transpose(0, 1), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


grouped_mm_float32.register_autograd(_grouped_mm_float32_backward, setup_context=_save_operands)


def float32_grouped_mm(self: Any, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """0.3.0's ``GroupedExperts._grouped_mm`` in float32 (its output dtype follows; torchtitan
    casts the experts' result back to the input's dtype), compiled blocks included."""
    return grouped_mm_float32(A.float(), B_t.float(), offs)


def use_float32_experts_022(model_name: str, flavor: str) -> None:
    """0.2.2: turn ``use_grouped_mm`` off in the model args the trainer is about to build from."""
    from torchtitan.protocols.train_spec import get_train_spec

    moe_args = getattr(get_train_spec(model_name).model_args.get(flavor), "moe_args", None)
    if moe_args is not None:
        moe_args.use_grouped_mm = False


def _enable_030() -> None:
    experts = importlib.import_module("torchtitan.models.common.moe").GroupedExperts
    if experts.__dict__.get("_grouped_mm") is not float32_grouped_mm:
        experts._grouped_mm = float32_grouped_mm


def enable() -> None:
    """Patch torchtitan's MoE modules for CPU (idempotent)."""
    if GEN.registry:
        _enable_030()
        return
    moe = importlib.import_module("torchtitan.models.moe.moe")
    if not isinstance(moe.torch, TorchWithIntegerHistc):
        moe.torch = TorchWithIntegerHistc()
    utils = importlib.import_module("torchtitan.models.moe.utils")
    if not isinstance(utils.generate_permute_indices, functools.partial):
        utils.generate_permute_indices = functools.partial(utils.generate_permute_indices, use_cpu=True)
