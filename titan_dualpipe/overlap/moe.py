"""A MoE transformer stage module that overlaps expert-parallel all-to-all with compute.

:class:`MoETransformer` is a decoder-only model (or one pipeline part of it) with torchtitan's
names (``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``). Each :class:`TransformerBlock`
runs attention -> top-k router -> dispatch all-to-all -> local experts -> combine all-to-all ->
gate-weighted sum + residual, its experts split over an expert-parallel group
(:func:`expert_parallel`), with a fixed capacity per (sequence, expert) so that every exchange has
a static size. A block is cut into three segments at its two exchanges, forward and backward
(:meth:`MoETransformer.forward_steps`, :meth:`MoETransformer.backward_steps`);
:meth:`MoETransformer.overlapped_forward_backward` interleaves a pair's two halves at them, bitwise
equal to the plain ``module(x)`` and ``loss.backward()``. Usage, memory and limits:
docs/overlap.md#the-ready-moe-module.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import GradientEdge, Node
from torch.utils.checkpoint import checkpoint

from ..weights.install import register_expert_class
from ..runtime.sub_batch_runner import register_exchange_rule
from .comm import ExpertParallelComm, PendingAllToAll, all_to_all
from ..cut import cut_layers
from .segments import Root, SegmentLeaves, Step, boundary, interleave, root_of, run_to_completion, segment_backward

_RECORD_KEY = "titan_dualpipe.moe_boundaries"
SEGMENTS = ("attention", "experts", "combine")


@dataclass(frozen=True)
class MoEArgs:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 2
    num_experts: int = 4
    top_k: int = 2
    moe_inter_dim: int = 64
    capacity_factor: float = 1.25
    norm_eps: float = 1e-5
    # Each block's dispatch and combine cut into this many exchanges, by local experts, pipelined
    # with the experts' compute (docs/overlap.md#chunked-exchanges); 1: one exchange each.
    exchange_chunks: int = 1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "num_experts", "top_k", "moe_inter_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEArgs.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"MoEArgs.dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEArgs.top_k={self.top_k} must be <= num_experts={self.num_experts}")
        if not self.capacity_factor > 0:
            raise ValueError(f"MoEArgs.capacity_factor must be > 0, got {self.capacity_factor}")
        _check_exchange_chunks(self.exchange_chunks, self.num_experts, "num_experts")

    def capacity(self, tokens: int) -> int:
        """Slots per expert for ``tokens`` tokens of one source rank."""
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts))


def expert_groups(local_experts: int, chunks: int) -> list[range]:
    """The local experts of each exchange chunk: consecutive groups, their sizes differing by at most one."""
    base, extra = divmod(local_experts, chunks)
    starts = [c * base + min(c, extra) for c in range(chunks + 1)]
    return [range(starts[c], starts[c + 1]) for c in range(chunks)]


def _check_exchange_chunks(chunks: Any, experts: int, what: str) -> None:
    """A chunk holds whole experts, so there are at most as many chunks as (local) experts."""
    if not isinstance(chunks, int) or isinstance(chunks, bool) or not 1 <= chunks <= experts:
        raise ValueError(f"exchange_chunks={chunks!r}: use an int from 1 (one exchange each) to {experts} "
                         f"({what}; a chunk holds whole experts)")


class Attention(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        heads = [w(x).view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv)]
        out = F.scaled_dot_product_attention(*heads, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.top_k = args.top_k
        self.gate = nn.Linear(args.dim, args.num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised gate weights and expert ids, both ``[tokens, top_k]``."""
        probs = F.softmax(self.gate(x), dim=-1)
        top_w, top_e = probs.topk(self.top_k, dim=-1)
        return top_w / top_w.sum(dim=-1, keepdim=True), top_e


class GroupedExperts(nn.Module):
    """SwiGLU experts; ``w1``/``w3``: ``[experts, dim, hidden]``, ``w2``: ``[experts, hidden, dim]``
    (so their gradients come out contiguous)."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        register_expert_class(GroupedExperts)  # its bmm weight GEMMs wait for W in a split backward
        e, d, h = args.num_experts, args.dim, args.moe_inter_dim
        self.w1 = nn.Parameter(torch.empty(e, d, h))
        self.w2 = nn.Parameter(torch.empty(e, h, d))
        self.w3 = nn.Parameter(torch.empty(e, d, h))
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, experts: slice | None = None) -> torch.Tensor:
        """``x``: ``[local experts, tokens, dim]``; ``experts``: those of an exchange chunk (all: None).
        Each expert's GEMMs see all its tokens whatever the chunk, so its weight gradient is one
        GEMM, as unchunked."""
        w1, w2, w3 = (self.w1, self.w2, self.w3) if experts is None else (self.w1[experts], self.w2[experts],
                                                                          self.w3[experts])
        return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)


@dataclass
class Routing:
    """Where each (token, choice) went: ``slot`` indexes ``[experts * capacity]`` (a
    dropped choice points at the extra zero row), ``token_of_slot`` the reverse."""

    slot: torch.Tensor
    token_of_slot: torch.Tensor
    capacity: int


class MoE(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        register_exchange_rule(_has_expert_parallel_moe)  # two-batch overlap splits its stages
        self.args = args
        self.router = TokenChoiceTopKRouter(args)
        self.experts = GroupedExperts(args)
        self.comm = ExpertParallelComm()
        self.exchange_chunks = args.exchange_chunks

    @property
    def num_local_experts(self) -> int:
        return self.experts.w1.shape[0]

    def use_expert_parallel(self, comm: ExpertParallelComm) -> None:
        """Keep only this rank's experts (``num_experts / ep`` consecutive ones)."""
        ep, e = comm.size, self.args.num_experts
        if self.num_local_experts != e:
            raise ValueError(f"experts are already split ({self.num_local_experts} of {e} kept): split them once")
        if e % ep:
            raise ValueError(f"num_experts={e} is not divisible by the expert-parallel size {ep}: pick a divisor")
        _check_exchange_chunks(self.exchange_chunks, e // ep, f"the {e // ep} local experts of {e} over {ep} ranks")
        local = slice(comm.rank * (e // ep), (comm.rank + 1) * (e // ep))
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                setattr(self.experts, name, nn.Parameter(getattr(self.experts, name)[local].clone()))
        self.comm = comm

    def set_exchange_chunks(self, chunks: int) -> None:
        """Cut each dispatch and combine into ``chunks`` exchanges (1: whole); see :attr:`MoEArgs.exchange_chunks`."""
        _check_exchange_chunks(chunks, self.num_local_experts, "the local experts of this rank")
        self.exchange_chunks = chunks

    def chunks(self) -> list[int | None]:
        """Chunk indices for :meth:`run_experts` (``[None]``: one exchange, all local experts)."""
        return [None] if self.exchange_chunks == 1 else list(range(self.exchange_chunks))

    def _chunk_sizes(self) -> list[int]:
        return [len(g) for g in expert_groups(self.num_local_experts, self.exchange_chunks)]

    def _chunk_experts(self, chunk: int | None) -> slice | None:
        if chunk is None:
            return None
        g = expert_groups(self.num_local_experts, self.exchange_chunks)[chunk]
        return slice(g.start, g.stop)

    def split_dispatch(self, send: torch.Tensor) -> list[torch.Tensor]:
        """The dispatch buffer ``[ep, local experts, capacity, dim]`` cut by local experts, one piece per
        chunk (still ``[ep, ...]``: each piece is an all-to-all of its own)."""
        return [send] if self.exchange_chunks == 1 else list(send.split(self._chunk_sizes(), dim=1))

    def route(self, x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, Routing]:
        """Tokens ``[T, dim]`` (routing groups of ``group_size`` consecutive tokens: one sequence
        each) -> dispatch buffer ``[ep, local experts, capacity, dim]``, gate weights
        ``[T, top_k]``, routing. Each group has ``args.capacity(group_size)`` slots per expert,
        earlier tokens of a group winning them, so a token's slot depends on its own sequence
        only: a microbatch split along the batch routes as it does whole."""
        weights, experts = self.router(x)
        tokens, k, e = x.shape[0], self.args.top_k, self.args.num_experts
        groups, per_group = tokens // group_size, self.args.capacity(group_size)
        capacity = groups * per_group
        with torch.no_grad():
            flat = experts.reshape(groups, group_size * k)  # token-major within each group
            position = (F.one_hot(flat, e).cumsum(1) - 1).gather(2, flat[..., None]).squeeze(2)
            group = torch.arange(groups, device=x.device)[:, None]
            slot = torch.where(position < per_group, flat * capacity + group * per_group + position, e * capacity)
            slot = slot.reshape(-1)
            token_of_slot = torch.full((e * capacity + 1,), tokens, dtype=torch.long, device=x.device)
            token_of_slot[slot] = torch.arange(tokens * k, device=x.device) // k
        padded = torch.cat([x, x.new_zeros(1, x.shape[1])])  # row `tokens`: empty slot
        send = padded[token_of_slot[:-1].view(self.comm.size, self.num_local_experts, capacity)]
        return send, weights, Routing(slot, token_of_slot, capacity)

    def run_experts(self, received: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        """``[ep sources, local experts, capacity, dim]`` -> the same layout, ready to send back;
        ``chunk``: the received piece of that exchange chunk (its experts only)."""
        ep, local, capacity, dim = received.shape
        x = received.transpose(0, 1).reshape(local, ep * capacity, dim)
        y = self.experts(x) if chunk is None else self.experts(x, self._chunk_experts(chunk))
        return y.view(local, ep, capacity, dim).transpose(0, 1).contiguous()

    def combine(self, combined: Sequence[torch.Tensor], weights: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Expert outputs back at their source ``[ep, local, capacity, dim]`` (in chunks, by local
        experts) -> ``[T, dim]``."""
        combined = combined[0] if len(combined) == 1 else torch.cat(list(combined), dim=1)
        dim = combined.shape[-1]
        rows = torch.cat([combined.reshape(-1, dim), combined.new_zeros(1, dim)])
        picked = rows.index_select(0, routing.slot).view(*weights.shape, dim)
        return (picked * weights.unsqueeze(-1)).sum(dim=1)


@dataclass
class LayerBoundaries:
    """One block's segment boundaries for one microbatch: raw producer outputs (the
    roots of a segment backward) and the aliases their consumers read (its captures).
    The exchanged ones come one per exchange chunk."""

    h_in: torch.Tensor  # alias of the block input
    h_attn: torch.Tensor  # residual stream after attention (raw)
    h_attn_in: torch.Tensor  # its alias read by the combine segment
    weights: torch.Tensor  # gate weights (raw)
    weights_in: torch.Tensor  # their alias read by the combine segment
    send: list[Root]  # dispatch buffer (its edges: only the dispatch exchanges read it, and keep nothing)
    received: list[torch.Tensor]  # aliases of the dispatch exchanges' outputs
    expert_out: list[Root]  # experts' outputs (their edges, as send's)
    combined: list[torch.Tensor]  # aliases of the combine exchanges' outputs


def _save_matmuls(ctx, op, *args, **kwargs):
    """Selective AC's policy for the checkpointed segments: keep GEMM outputs, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class TransformerBlock(nn.Module):
    """Pre-norm attention + MoE. ``block(h)`` runs it whole; the stage module calls one
    segment at a time: ``block(h, segment="attention")``, then ``"experts"``, then ``"combine"``.
    ``activation_checkpoint``: False, True (full) or ``"selective"`` (the attention and expert
    segments, not the exchanges between them)."""

    def __init__(self, args: MoEArgs, activation_checkpoint: bool | str = False) -> None:
        super().__init__()
        if activation_checkpoint not in (False, True, "selective"):
            raise ValueError(f"activation_checkpoint={activation_checkpoint!r}: use False, True (full) or 'selective'")
        self.activation_checkpoint = activation_checkpoint
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(args)

    def forward(self, *inputs: Any, segment: str | None = None) -> Any:
        if segment is None:
            return run_to_completion(self.forward_steps(inputs[0], [], via_call=False))
        return self._segment(segment)(*inputs)

    def _segment(self, name: str):
        if name not in SEGMENTS:
            raise ValueError(f"unknown segment {name!r}: use one of {SEGMENTS}")
        return getattr(self, f"_{name}_segment")

    def _maybe_checkpoint(self, fn, *args: torch.Tensor) -> torch.Tensor:
        if not self.activation_checkpoint or not torch.is_grad_enabled():
            return fn(*args)
        if self.activation_checkpoint == "selective":
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            return checkpoint(fn, *args, use_reentrant=False,
                              context_fn=lambda: create_selective_checkpoint_contexts(_save_matmuls))
        return checkpoint(fn, *args, use_reentrant=False)

    def _attend(self, h: torch.Tensor) -> torch.Tensor:
        return self.attention(self.attention_norm(h))

    def _attention_segment(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Routing]:
        h_attn = h + self._maybe_checkpoint(self._attend, h)
        send, weights, routing = self.moe.route(self.ffn_norm(h_attn).flatten(0, 1), group_size=h.shape[1])
        return h_attn, send, weights, routing

    def _experts_segment(self, received: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
        run = self.moe.run_experts if chunk is None else functools.partial(self.moe.run_experts, chunk=chunk)
        return self._maybe_checkpoint(run, received)

    def _combine_segment(
        self, combined: list[torch.Tensor], weights: torch.Tensor, h_attn: torch.Tensor, routing: Routing
    ) -> torch.Tensor:
        return h_attn + self.moe.combine(combined, weights, routing).view_as(h_attn)

    def forward_steps(
        self, h: torch.Tensor, record: list[LayerBoundaries], via_call: bool = True
    ) -> Step[torch.Tensor]:
        """The block's forward, yielding at each exchange; appends its boundaries to ``record``."""

        def run(name: str, *args: Any) -> Any:
            return self(*args, segment=name) if via_call else self._segment(name)(*args)

        h_in = boundary(h)
        h_attn, send, weights, routing = run("attention", h_in)
        sends, comm = self.moe.split_dispatch(send), self.moe.comm
        # All dispatch chunks are posted at once; each chunk's experts run as soon as it arrived,
        # while the next one flies, and send their outputs back at once.
        dispatches = _post_chunks(sends, comm)
        received, expert_out, combines = [], [], []
        for chunk, dispatch in zip(self.moe.chunks(), dispatches, strict=True):
            yield dispatch
            received.append(boundary(dispatch.output))
            expert_out.append(run("experts", received[-1], chunk))
            combines.append(all_to_all(expert_out[-1], comm, after=combines[-1] if combines else dispatches[-1]))
        for combine in combines:
            yield combine
        combined, h_attn_in, weights_in = [boundary(c.output) for c in combines], boundary(h_attn), boundary(weights)
        out = run("combine", combined, weights_in, h_attn_in, routing)
        record.append(
            LayerBoundaries(h_in, h_attn, h_attn_in, weights, weights_in, [root_of(s) for s in sends], received,
                            [root_of(e) for e in expert_out], combined))
        return out

    def backward_steps(
        self, b: LayerBoundaries, out: torch.Tensor, grad: torch.Tensor | None, leaves: SegmentLeaves
    ) -> Step[torch.Tensor | None]:
        """Backward of the block output ``out`` with gradient ``grad``, yielding at each
        reverse exchange; returns the gradient of the block input."""
        chunks, comm = len(b.combined), self.moe.comm
        *g_combined, g_weights, g_attn = segment_backward([out], [grad], [*b.combined, b.weights_in, b.h_attn_in],
                                                          leaves)
        reverse = _post_chunks([_grad_or_zeros(g, c) for g, c in zip(g_combined, b.combined, strict=True)], comm,
                               backward=True)
        to_source: list[PendingAllToAll] = []
        for i in range(chunks):
            yield reverse[i]
            # Every chunk reaches the same expert weights (a slice each): claimed once, by the first.
            (g_received,) = segment_backward([b.expert_out[i]], [reverse[i].output], [b.received[i]],
                                             leaves if i == 0 else None)
            to_source.append(comm.post(_grad_or_zeros(g_received, b.received[i]), backward=True,
                                       after=to_source[-1] if to_source else reverse[-1]))
        for pending in to_source:
            yield pending
        (g_in,) = segment_backward([b.h_attn, *b.send, b.weights], [g_attn, *(p.output for p in to_source), g_weights],
                                   [b.h_in], leaves)
        return g_in


def _post_chunks(chunks: Sequence[torch.Tensor], comm: ExpertParallelComm, backward: bool = False
                 ) -> list[PendingAllToAll]:
    """Post the exchanges of one cut exchange, each queued behind the one before (one link: an
    emulated network charges every chunk its latency, and no chunk flies beside another). A
    forward's are autograd-aware; a segment backward posts its reverse exchanges directly."""
    posted: list[PendingAllToAll] = []
    for chunk in chunks:
        after = posted[-1] if posted else None
        posted.append(comm.post(chunk, backward=True, after=after) if backward else all_to_all(chunk, comm, after=after))
    return posted


def _grad_or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Both ranks must still exchange when no gradient reached this rank's buffer."""
    return torch.zeros_like(like) if grad is None else grad


@dataclass
class StageRecord:
    """What one forward saved for its backward half: its segment boundaries, kept in the autograd
    metadata of its output's node (:func:`_attach`) until a backward has passed them."""

    entry: torch.Tensor | None  # embedding output, or the stage input as the layers read it
    layers: list[LayerBoundaries] = field(default_factory=list)
    outs: list[torch.Tensor] = field(default_factory=list)  # block outputs, but not the stage output
    exit: torch.Tensor | None = None  # alias of the last block output read by norm + head

    def release(self) -> None:
        self.entry, self.layers, self.outs, self.exit = None, [], [], None


class MoETransformer(nn.Module):
    """Token embedding -> MoE blocks -> norm -> vocab head; a pipeline part may lack the
    embedding (not first) or the norm and head (not last)."""

    def __init__(self, args: MoEArgs, activation_checkpoint: bool | str = False) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Module | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(args, activation_checkpoint) for i in range(args.n_layers)})
        self.norm: nn.Module | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Module | None = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_to_completion(self.forward_steps(x))

    # -- forward -----------------------------------------------------------------------------
    def forward_steps(self, x: torch.Tensor) -> Step[torch.Tensor]:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        record = StageRecord(entry=h)
        for i, block in enumerate(self.layers.values()):
            if i:
                record.outs.append(h)
            h = yield from block.forward_steps(h, record.layers)
        if self.output is not None:
            record.outs.append(h)
            record.exit = boundary(h)
            h = self.output(self.norm(record.exit))
        _attach(h, record)
        return h

    # -- backward ----------------------------------------------------------------------------
    def backward_steps(
        self, outputs: Sequence[Root], grads: Sequence[torch.Tensor | None] | None
    ) -> Step[None]:
        """``torch.autograd.backward(outputs, grads)`` for outputs of this module's forward
        (the stage output, or a loss computed from it), one segment at a time."""
        grads = list(grads) if grads is not None else [None] * len(outputs)
        node, record = _find_record(outputs)
        entry, layers, outs, exit_ = record.entry, record.layers, record.outs, record.exit
        record.release()
        del node.metadata[_RECORD_KEY]
        leaves = SegmentLeaves()
        if exit_ is not None:  # norm + head (+ loss): down to the last block's output
            (grad,) = segment_backward(outputs, grads, [exit_], leaves)
            out = outs.pop()
        else:
            (out,), (grad,) = outputs, grads
        for i, block in reversed(list(enumerate(self.layers.values()))):
            grad = yield from block.backward_steps(layers[i], out, grad, leaves)
            out = outs.pop() if i else entry
        segment_backward([out], [grad], [], leaves)  # embedding, or the stage input's .grad

    # -- overlap -----------------------------------------------------------------------------
    @classmethod
    def overlapped_forward_backward(
        cls,
        forward_module: nn.Module,
        forward_args: tuple[Any, ...],
        forward_kwargs: dict[str, Any],
        backward_module: nn.Module,
        backward_inputs: list[Any],
        backward_outputs: list[torch.Tensor],
        backward_output_grads: list[torch.Tensor | None] | None,
    ) -> Any:
        """The runtime's overlapped pair: the two halves' segments interleaved at their exchanges, so
        each half's exchange flies while the other computes; returns the forward's output."""
        forward = forward_module.forward_steps(*forward_args, **forward_kwargs)
        backward = backward_module.backward_steps(backward_outputs, backward_output_grads)
        # The backward half computes about twice as much between its exchanges: starting it
        # first keeps the longer chain off the forward's compute.
        _, output = interleave(backward, forward, backwards=(0,))
        return output

    @classmethod
    def overlapped_sub_batches_forward(cls, module: nn.Module, halves: Sequence[tuple[tuple, dict]]) -> list[Any]:
        """Two-batch overlap (:class:`~titan_dualpipe.overlap.protocol.OverlappedSubBatches`): both
        halves' forwards, interleaved at their exchanges; returns their outputs."""
        first, second = (module.forward_steps(*args, **kwargs) for args, kwargs in halves)
        return list(interleave(first, second))

    @classmethod
    def overlapped_sub_batches_backward(
        cls, module: nn.Module, halves: Sequence[tuple[list[torch.Tensor], list[torch.Tensor | None] | None]]
    ) -> None:
        """Both halves' backwards, interleaved at their reverse exchanges."""
        first, second = (module.backward_steps(outputs, grads) for outputs, grads in halves)
        interleave(first, second, backwards=(0, 1))


def _attach(output: torch.Tensor, record: StageRecord) -> None:
    """Keep ``record`` with the output's autograd node; drop it once a backward passed the entry."""
    if output.grad_fn is None or record.entry is None or not record.entry.requires_grad:
        return
    output.grad_fn.metadata[_RECORD_KEY] = record
    # The entry is `tok_embeddings(x)` or the stage input, whose gradient every backward
    # (plain, split input/weight, or ours) computes last: free the boundaries then.
    ref = weakref.ref(record)
    hook_on = record.layers[0].h_in if record.layers else record.entry
    if not hook_on.is_leaf:
        hook_on.register_hook(lambda grad: _release(ref))


def _release(ref: weakref.ref) -> None:
    record = ref()
    if record is not None:
        record.release()


def _find_record(outputs: Sequence[Root], limit: int = 10_000) -> tuple[Node, StageRecord]:
    """The record of the forward these outputs (or a loss computed from them, or their
    :func:`~titan_dualpipe.overlap.segments.root_of` edges) come from."""
    queue = [t.node if isinstance(t, GradientEdge) else t.grad_fn for t in outputs]
    queue = [node for node in queue if node is not None]
    seen: dict[int, Node] = {}  # holds the nodes too: a freed node object's id may be reused
    while queue and len(seen) < limit:
        node = queue.pop(0)
        if id(node) in seen:
            continue
        seen[id(node)] = node
        record = node.metadata.get(_RECORD_KEY)
        if record is not None:
            if record.entry is None:
                raise RuntimeError("this microbatch's backward already ran (its segment boundaries were released)")
            return node, record
        queue.extend(child for child, _ in node.next_functions if child is not None)
    raise ValueError(
        "backward_outputs do not come from a MoETransformer forward with gradients enabled: pass the "
        "stage outputs, or a loss computed from them only"
    )


def split_parts(model: MoETransformer, n_parts: int) -> list[MoETransformer]:
    """Deprecated name of :func:`titan_dualpipe.cut.cut_layers` (``titan_dualpipe.overlap.cut_layers``)."""
    warnings.warn("titan_dualpipe.overlap.split_parts is deprecated: use titan_dualpipe.overlap.cut_layers",
                  DeprecationWarning, stacklevel=2)
    return cut_layers(model, n_parts)


def expert_parallel(module: nn.Module, comm: ExpertParallelComm) -> None:
    """Split every MoE layer of ``module`` over ``comm``'s group (call before FSDP wrapping);
    give all stage modules of a rank the same ``comm``."""
    moes = [m for m in module.modules() if isinstance(m, MoE)]
    if not moes:
        raise ValueError(f"{type(module).__name__} has no MoE layers to split")
    for moe in moes:
        moe.use_expert_parallel(comm)


def set_exchange_chunks(module: nn.Module, chunks: int) -> None:
    """Cut every MoE layer's dispatch and combine of ``module`` into ``chunks`` exchanges (after
    :func:`expert_parallel`, which keeps the experts a chunk divides)."""
    moes = [m for m in module.modules() if isinstance(m, MoE)]
    if not moes:
        raise ValueError(f"{type(module).__name__} has no MoE layers to cut the exchanges of")
    for moe in moes:
        moe.set_exchange_chunks(chunks)


def _has_expert_parallel_moe(module: nn.Module) -> bool:
    return any(isinstance(m, MoE) and m.comm.size > 1 for m in module.modules())
