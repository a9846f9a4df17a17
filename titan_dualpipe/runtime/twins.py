"""DualPipe twins: every model part lives on two ranks (``r`` and ``pp-1-r``).

Rank ``r`` holds parts ``r`` and ``pp-1-r``; its twin rank ``pp-1-r`` holds the same two
parts, so one exchange between the pair covers both twins. Tensors are packed in
model-part order, which is the same on both ranks, so element ``i`` of the two buffers
belongs to the same parameter. Sums are ``mine + theirs`` on one side and ``theirs + mine``
on the other: floating-point addition is commutative, so both copies end bit-identical.
"""

from __future__ import annotations

from collections import defaultdict
import torch
import torch.distributed as dist
from torch import nn

from .._compat.fsdp import fsdp_data_parallel_sizes, fsdp_gradient_divide_factors, fsdp_shard_group_ranks
from .errors import PipelineConfigError
from .fsdp import fsdp_modules
from .p2p import local_tensor, swap_into, with_layout_of


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype, in order of first appearance."""
    by_dtype: dict[torch.dtype, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        by_dtype[t.dtype].append(i)
    return list(by_dtype.values())


def _packed(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One flat buffer per dtype group of :func:`_by_dtype`."""
    return [torch.cat([tensors[i].reshape(-1) for i in idx]) for idx in _by_dtype(tensors)]


def _exchange(
    send: list[torch.Tensor], recv_like: list[torch.Tensor], peer: int, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Send ``send`` to global rank ``peer``; receive tensors shaped like ``recv_like`` from it.

    The peer calls this with the roles mirrored, so its ``send`` is laid out like our
    ``recv_like`` (same module part, same parameter order and dtypes).
    """
    layout = _by_dtype(recv_like)
    buffers = [torch.empty(sum(recv_like[i].numel() for i in idx), dtype=recv_like[idx[0]].dtype,
                           device=recv_like[idx[0]].device) for idx in layout]
    swap_into(_packed(send), buffers, peer, group)
    received: list[torch.Tensor] = list(recv_like)
    for idx, buf in zip(layout, buffers, strict=True):
        for i, chunk in zip(idx, buf.split([recv_like[i].numel() for i in idx])):
            received[i] = chunk.view_as(recv_like[i])
    return received


def folded_into_fsdp(modules: list[nn.Module], twin_rank: int) -> tuple[bool, str]:
    """``(folded, problem)``: whether FSDP2 shards every module over a group that holds global
    rank ``twin_rank`` (HSDP: its shard group). The two copies of each part are then one sharded
    parameter (twins folded into data parallelism) and FSDP's reduction sums them.

    ``problem`` is non-empty when a rank is folded only in part: some FSDP modules (or
    parameters outside FSDP) would then miss the twin sum, whichever way it were done."""
    verdicts = [twin_rank in ranks for module in modules for fsdp_module in fsdp_modules(module)
                for ranks in fsdp_shard_group_ranks(fsdp_module)]
    if not verdicts or not any(verdicts):
        return False, ""
    unsharded = [name for module in modules for name, p in module.named_parameters() if not hasattr(p, "device_mesh")]
    if all(verdicts) and not unsharded:
        return True, ""
    return False, (
        f"DualPipe: on global rank {dist.get_rank()} {verdicts.count(True)} of {len(verdicts)} FSDP parameter groups "
        f"shard over a group holding the twin rank {twin_rank}, the rest do not"
        + (f", and parameters {unsharded[:3]} are outside FSDP" if unsharded else "")
        + "; fold the twins (each part sharded over twins x replicas) for every module of both stages, or for none"
    )


def prepare_folded(modules: list[nn.Module]) -> None:
    """Folded twins: parameters stay gathered from the step's start to its end (the twins use a
    part at different times, so FSDP's collectives cannot follow the compute), and the
    reduction sums the twins: FSDP's default mean over its mesh (twins x replicas) becomes a
    mean over the replicas. An explicit divide factor (torchtitan's, say) is kept."""
    for module in modules:
        for fsdp_module in fsdp_modules(module):
            fsdp_module.set_reshard_after_forward(False, recurse=False)
            factors, sizes = fsdp_gradient_divide_factors(fsdp_module), fsdp_data_parallel_sizes(fsdp_module)
            if any(f is None for f in factors):
                fsdp_module.set_gradient_divide_factor(max(sizes) / 2)


def _params_by_part(modules_by_part: dict[int, nn.Module]) -> list[nn.Parameter]:
    """Every parameter once, in part order (a weight tied across the two parts counts in the first)."""
    unique = {id(p): p for part in sorted(modules_by_part) for p in modules_by_part[part].parameters()}
    return list(unique.values())


def grads_before_step(modules_by_part: dict[int, nn.Module]) -> dict[int, torch.Tensor]:
    """Copies of the gradients the parameters hold before a step (accumulated over earlier steps
    without zeroing, by parameter id): :func:`sum_twin_grads` then exchanges only the step's own."""
    return {id(p): local_tensor(p.grad).clone() for p in _params_by_part(modules_by_part)
            if p.requires_grad and p.grad is not None}


def sum_twin_grads(
    modules_by_part: dict[int, nn.Module], peer: int, group: dist.ProcessGroup | None,
    before: dict[int, torch.Tensor] | None = None,
) -> None:
    """Add the twin rank's gradients of this step to ours (missing grads count as zero); ``before``
    (:func:`grads_before_step`): what each gradient held before the step, which the twin has too."""
    before = before or {}
    params = [p for p in _params_by_part(modules_by_part) if p.requires_grad]
    grads = [
        local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p.detach()))
        for p in params
    ]
    this_step = [grad - before[id(p)] if id(p) in before else grad for p, grad in zip(params, grads)]
    for p, grad, theirs in zip(params, grads, _exchange(this_step, grads, peer, group)):
        grad.add_(theirs)
        if p.grad is None:
            p.grad = with_layout_of(p, grad)  # a DTensor parameter's grad has its layout


@torch.no_grad()
def copy_to_twin(
    source: nn.Module, target: nn.Module, peer: int, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Send ``source``'s parameters to ``peer`` and overwrite ``target``'s with the peer's.

    Called symmetrically: each rank sends its direction-0 copy and receives into its
    direction-1 copy, which holds the same model part on the twin rank.
    """
    for module in (source, target):  # FSDP2: copy between shards; a gathered copy would go stale
        _reshard(module)
    mine = [local_tensor(p) for p in source.parameters()]
    dest = [local_tensor(p) for p in target.parameters()]
    _check_same_part(mine, dest, peer, group, device)
    for t, theirs in zip(dest, _exchange(mine, dest, peer, group)):
        t.copy_(theirs)


def _reshard(module: nn.Module) -> None:
    """Free the gathered parameters of every FSDP2 module in ``module`` (no-op when sharded)."""
    for m in fsdp_modules(module):
        m.reshard()


def _fingerprint(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([len(tensors), sum(t.numel() for t in tensors)], dtype=torch.int64, device=device)


def _check_same_part(
    mine: list[torch.Tensor], dest: list[torch.Tensor], peer: int, group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Both twins of each part must have the same parameters. Both ranks compare both
    parts, so they agree on the outcome and neither is left waiting in the bulk copy."""
    ours = torch.cat([_fingerprint(mine, device), _fingerprint(dest, device)])
    (theirs,) = _exchange([ours], [ours], peer, group)
    expected = torch.cat([_fingerprint(dest, device), _fingerprint(mine, device)])
    if not torch.equal(theirs, expected):
        raise PipelineConfigError(
            f"DualPipe twin mismatch with rank {peer}: (params, elements) of its two stages are "
            f"{theirs.tolist()}, ours {ours.tolist()} (each rank lists its direction-0 stage first; "
            "twins must match crosswise). Rank r must build its stages from model parts r and "
            "pp-1-r of one pp-way split."
        )
