"""A small decoder-only transformer and its pipeline parts, shared by tests and benchmarks.

Layer names follow torchtitan (``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``), and
a model part keeps the full model's parameter names, so part gradients compare by name
with a non-pipelined reference.
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..cut import cut_layers

AC_MODES = ("none", "full", "selective")  # activation checkpointing of a block (checkpoint_block)


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.attention_norm(h)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        h = h + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return h + self.w2(F.gelu(self.w1(self.ffn_norm(h))))


class TinyLM(nn.Module):
    """Token embedding -> blocks -> norm -> vocab head; a part may lack any of these."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm: nn.Module | None = nn.LayerNorm(dim)
        self.output: nn.Module | None = nn.Linear(dim, vocab)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def compile_blocks(blocks: Iterable[nn.Module], backend: str) -> None:
    """torch.compile each block in place (``block.compile``), as torchtitan compiles a model's blocks."""
    for block in blocks:
        block.compile(backend=backend)


def _selective_policy():
    """torchtitan's op-level selective AC: keep attention and every second matmul, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    attention = {op for op in (getattr(torch.ops.aten, name, None) for name in (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention")) if op is not None}
    attention = {op.default for op in attention}
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    meta: dict[str, int] = {}  # one per checkpoint call: its forward and its recomputation count alike

    def policy(ctx, op, *args, **kwargs):
        if op in attention:
            return CheckpointPolicy.MUST_SAVE
        if op in matmuls:
            key = "recompute_mm_count" if ctx.is_recompute else "forward_mm_count"
            count = meta[key] = meta.get(key, 0) + 1
            return CheckpointPolicy.MUST_SAVE if count % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_block(block: nn.Module, mode: str) -> nn.Module:
    """``block`` (in place) under torch's non-reentrant checkpoint (``full``, ``selective``) or as is."""
    if mode == "none":
        return block
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    context = {}
    if mode == "selective":
        context = {"context_fn": lambda: create_selective_checkpoint_contexts(_selective_policy())}
    forward = block.forward
    block.forward = functools.partial(checkpoint, forward, use_reentrant=False, **context)
    return block
