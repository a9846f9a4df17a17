"""c10d internals: torch's functional collective ops (an all-to-all started now, waited on later),
the default process group's store, and C++ stacks printed on a fatal signal (a communication
thread's ``std::terminate`` has no Python stack). Read against torch 2.11.0, 2.13.0, 2.14.1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def default_store() -> dist.Store:
    """The default process group's key-value store."""
    return dist.distributed_c10d._get_default_store()


def post_all_to_all_single(
    x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group: Any
) -> torch.Tensor:
    """Start an all-to-all with torch's functional collective op (not differentiated here);
    the result may be read only after :func:`wait_collective`. Activation checkpointing
    policies see the same op as for ``all_to_all_single_autograd``."""
    return torch.ops._c10d_functional.all_to_all_single(x, output_split_sizes, input_split_sizes, group.group_name)


def wait_collective(t: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(t)


def native_stacks_on_fatal_signal() -> None:
    """On a fatal signal (SIGABRT, SIGSEGV, SIGBUS, SIGILL, SIGFPE), print every thread's C++
    stack to stderr, then hand the signal on to the handler installed before (``faulthandler``'s,
    which adds the Python stacks). A ``std::terminate`` in a communication thread has no Python
    stack to show: this is where it shows. For the package's own worker processes (tests,
    ``check``, benchmarks), not for a user's training run."""
    torch._C._set_print_stack_traces_on_fatal_signal(True)


__all__ = ["default_store", "native_stacks_on_fatal_signal", "post_all_to_all_single", "wait_collective"]
