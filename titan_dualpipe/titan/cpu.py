"""CPU mode: let torchtitan train with gloo on a machine without an accelerator.

torchtitan assumes an accelerator. :func:`enable` (a no-op when one is present, so GPU runs are
unchanged) fixes what breaks without one: the ``device_type`` / ``device_module`` its modules copy
at import (``"cpu"``: gloo, CPU mesh, CPU tensors; which modules, per release: :mod:`.generation`),
the CUDA-only device-module calls of its memory monitor and ``set_pg_timeouts``
(:class:`CpuDeviceModule`), FSDP's ``PREMUL_SUM`` reduce-scatter, which gloo lacks
(:func:`with_sum_only_reductions`), the MoE layers (:mod:`.cpu_moe`) and flex attention's missing
CPU backward (:mod:`.cpu_attention`). :func:`prepare_config` makes it compute in float32: a CPU
without bfloat16 units runs bfloat16 matmuls many times slower, so a CPU figure would measure the
host's bfloat16 support, not the schedules (benchmarks/2026-11-25-cpu-xeon-2core.md#cpu-mode-in-float32).
What a user sees: docs/torchtitan.md#cpu-mode.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
import resource
import sys
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from . import cpu_attention, cpu_moe
from .generation import GEN


class CpuDeviceModule:
    """``torch.cpu`` plus the device-module functions torchtitan's memory monitor calls, from the
    OS: the reported peak memory is the process's peak resident set size."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        """A device index for ``set_pg_timeouts``' ``barrier(device_ids=[...])``, where
        ``torch.cpu.current_device()`` returns the string ``"cpu"``."""
        return 0

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return platform.processor() or platform.machine() or "CPU"

    @staticmethod
    def get_device_properties(device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        """Peak RSS cannot be reset; the reported figure is the process peak."""

    @staticmethod
    def empty_cache() -> None:
        """The CPU allocator keeps no cache to release."""


class AllReduceScatter:
    """FSDP2's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) as an all-reduce of the
    whole buffer, of which this rank keeps its slice: the same sum in every slice. gloo's
    reduce-scatter is slower than its all-reduce of the same buffer
    (benchmarks/2026-11-24-cpu-xeon-2core.md#gloos-reduce-scatter). FSDP calls it synchronously
    with the SUM that CPU mode forces."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        torch.distributed.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()].view_as(output_tensor))


def with_sum_only_reductions(disable_division: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    """torchtitan's ``disable_fsdp_gradient_division`` (a divide factor of 1, which FSDP2 turns
    into a ``PREMUL_SUM(1.0)`` reduce-scatter that gloo lacks) that also asks for SUM-only
    collectives, reduce-scatters run as :class:`AllReduceScatter`: the same gradients."""

    def disable_fsdp_gradient_division(model: nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
                with contextlib.suppress(ValueError):  # several parameter groups (per-parameter meshes): keep FSDP's
                    module.set_custom_reduce_scatter(AllReduceScatter())

    disable_fsdp_gradient_division._titan_dualpipe = True  # type: ignore[attr-defined]
    return disable_fsdp_gradient_division


def _patch_fsdp_division() -> None:
    for name in GEN.fsdp_division_modules:
        module = importlib.import_module(name)
        if not getattr(module.disable_fsdp_gradient_division, "_titan_dualpipe", False):
            module.disable_fsdp_gradient_division = with_sum_only_reductions(module.disable_fsdp_gradient_division)


def prepare_config(config: Any) -> None:
    """Compute in float32: FSDP gathers parameters in float32 (torchtitan's
    ``training.mixed_precision_param``), and 0.2.2 MoE models run their experts as plain
    float32 matmuls (``moe_args.use_grouped_mm = False``, as torchtitan itself does for
    deepseek_v3, llama4 and gpt_oss without SM90; qwen3 lacks that check). Called before the
    model is built; logs what it changed."""
    from torchtitan.tools.logging import logger

    training = config.training
    if training.mixed_precision_param != "float32":
        logger.info(f"CPU mode: FSDP computes in float32 (training.mixed_precision_param was "
                    f"{training.mixed_precision_param!r})")
        training.mixed_precision_param = "float32"
    if not GEN.registry:
        cpu_moe.use_float32_experts_022(config.model.name, config.model.flavor)


def accelerator_present() -> bool:
    return torch._utils._get_available_device_type() is not None


def enable() -> bool:
    """Switch torchtitan to CPU when no accelerator is present; return whether it did."""
    if accelerator_present():
        return False
    device_module = CpuDeviceModule()
    for name in GEN.device_type_modules:
        importlib.import_module(name).device_type = "cpu"
    for name in GEN.device_module_modules:
        importlib.import_module(name).device_module = device_module
    utils = importlib.import_module("torchtitan.tools.utils")
    utils.get_device_info = lambda: ("cpu", device_module)
    _patch_fsdp_division()
    cpu_moe.enable()
    if GEN.registry:
        cpu_attention.enable()
    return True
