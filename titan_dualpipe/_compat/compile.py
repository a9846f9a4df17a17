"""``torch.compile`` internals: the compiler a backend name stands for, and the functorch switch
that lets torch's split backward run a compiled graph twice. Read against torch 2.11.0, 2.13.0,
2.14.1.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def donated_buffers_off() -> Iterator[None]:
    """``torch._functorch.config.donated_buffer = False`` inside, restored after: the only way
    torch's split backward (I, then W) can run a compiled graph twice (pytorch#161904). Our
    schedules never need it (a compiled stage's backward runs whole); ``bench compile`` uses
    it to time the rejected alternative."""
    from torch._functorch import config as functorch_config

    with functorch_config.patch(donated_buffer=False):
        yield


def compiler_fn(backend: str) -> Callable[..., Any]:
    """What ``torch.compile(backend=backend)`` compiles each graph with
    (``torch._dynamo.lookup_backend``): a backend that calls it compiles the same graphs."""
    from torch._dynamo import lookup_backend

    return lookup_backend(backend)


__all__ = ["compiler_fn", "donated_buffers_off"]
