"""Cutting a torchtitan-style decoder (``tok_embeddings``, ``layers``, ``norm``, ``output``)
into pipeline parts that keep the full model's parameter names."""

from __future__ import annotations

import copy
from typing import TypeVar

from torch import nn

M = TypeVar("M", bound=nn.Module)


def cut_layers(model: M, n_parts: int) -> list[M]:
    """``n_parts`` deep copies of ``model``, each keeping a contiguous run of ``layers``
    (a ModuleDict, names unchanged); part 0 keeps the embedding, the last part the norm
    and the head."""
    n_layers = len(model.layers)
    if not 1 <= n_parts <= n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {n_parts} parts: use 1..{n_layers} parts")
    bounds = [round(i * n_layers / n_parts) for i in range(n_parts + 1)]
    parts = []
    for i in range(n_parts):
        part = copy.deepcopy(model)
        keep = {str(j) for j in range(bounds[i], bounds[i + 1])}
        for name in [n for n in part.layers if n not in keep]:
            del part.layers[name]
        if i:
            part.tok_embeddings = None
        if i != n_parts - 1:
            part.norm = part.output = None
        parts.append(part)
    return parts
