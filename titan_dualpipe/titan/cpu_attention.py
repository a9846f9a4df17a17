"""CPU mode for torchtitan 0.3.0's attention (llama3, deepseek_v3 and the other decoders).

0.3.0's language models attend with ``FlexAttention`` only (or varlen, CUDA-only), and torch's
flex attention has no backward on CPU ("FlexAttention does not support backward on CPU").
Applied by :func:`titan_dualpipe.titan.cpu.enable`, so only without an accelerator:

1. ``FlexAttention.compiled_flex_attn`` becomes :func:`masked_attention`: the same attention
   (same block mask, scale, GQA, log-sum-exp) computed with plain tensor ops, which have a
   backward on CPU. The dense token mask comes from the block mask's own ``mask_mod``, so
   packed-document causal masking is exactly flex attention's.
2. ``decoder.create_attention_mask`` builds the block mask without ``torch.compile`` (a
   compiled ``create_block_mask`` would start an inductor C++ build in every process).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.nn.attention.flex_attention import AuxOutput, create_block_mask, create_mask


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, score_mod: Any, block_mask: Any, scale: float | None,
    enable_gqa: bool, return_aux: Any, kernel_options: dict,
) -> tuple[torch.Tensor, AuxOutput]:
    """``flex_attention(q, k, v, block_mask=..., scale=..., enable_gqa=...)`` on (B, N, L, H) tensors.

    Returns flex attention's own ``AuxOutput`` (a NamedTuple): inside a block torchtitan compiles
    with ``fullgraph=True`` Dynamo builds it, where it cannot build a ``SimpleNamespace``."""
    if score_mod is not None:
        raise NotImplementedError("CPU mode computes flex attention without score_mod; this model uses one")
    if enable_gqa and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    allowed = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = scores.float().masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype) @ v
    return out, AuxOutput(lse=lse)


def enable() -> None:
    """Patch torchtitan's flex attention for CPU (idempotent)."""
    attention = importlib.import_module("torchtitan.models.common.attention")
    attention.FlexAttention.compiled_flex_attn = staticmethod(masked_attention)
    importlib.import_module("torchtitan.models.common.decoder").create_attention_mask = create_block_mask
