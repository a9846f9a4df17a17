"""Run on spawned gloo ranks by tests/titan/test_parallelisms.py (``run_on_processes`` of
``titan_dualpipe.testing.spawn``, which starts the process group): torchtitan's pieces and ours that
need a group of their own size. Each returns every rank's result, gathered (``run_on_processes``
hands back rank 0's)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def _every_rank(result: Any) -> list:
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return gathered


def twin_expert_counts() -> list[list[list[float]]]:
    """2 ranks, both holding parts 0 and 1 (pp=2): each part's MoE expert counts after the twins
    summed theirs."""
    import torch
    from torch import nn

    from titan_dualpipe.titan import GEN
    from titan_dualpipe.titan.moe_twins import sum_twin_counts

    rank = dist.get_rank()
    parts = {}
    for part in (0, 1):  # both ranks hold parts 0 and 1 (pp=2), each saw other microbatches
        module = nn.Module()
        module.register_buffer(GEN.expert_count_buffer, torch.full((4,), float(10 * rank + part)))
        parts[part] = nn.ModuleDict({"moe": module})
    sum_twin_counts(parts, peer=1 - rank, group=None)
    return _every_rank([getattr(parts[p].moe, GEN.expert_count_buffer).tolist() for p in (0, 1)])


def count_exchange_posts() -> list[dict[str, dict[bool, list[str]]]]:
    """torchtitan's own token dispatch (0.2.2: ``ExpertParallel._token_dispatch``; 0.3.0:
    ``AllToAllTokenDispatcher.dispatch``, under each SPMD backend that keeps its collectives
    functional) as the forward half of a relayed pair on 2 EP ranks, with its collectives logged in
    order next to the partner half's turns: once as our schedules run it, once with the bench's
    comparison hand-over at the count exchange. By backend ("-" on 0.2.2), then hand-over."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_dualpipe.overlap.comm import emulate_relayed_exchanges
    from titan_dualpipe.overlap.count_groups import count_group, make_count_groups
    from titan_dualpipe.overlap.relay import hand_over, run_relayed
    from titan_dualpipe.titan import GEN, expert_overlap

    rank = dist.get_rank()
    expert_overlap.install()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    make_count_groups([mesh])  # as build_schedule does before the first step
    names = {mesh.get_group().group_name: "post tokens", count_group(mesh).group_name: "post counts"}
    log: list[str] = []

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and func.overloadpacket.__name__ == "all_to_all_single":
                log.append(names[args[3]])
            elif func.namespace == "_c10d_functional" and func.overloadpacket.__name__ == "wait_tensor":
                log.append("wait")
            return func(*args, **(kwargs or {}))

    experts, dim, tokens = 4, 3, 6
    expert_ids = torch.tensor([[0], [1], [2], [3], [1], [2]]) if rank == 0 else torch.tensor([[3], [3], [0], [1], [2], [0]])
    counts = torch.bincount(expert_ids.view(-1), minlength=experts)
    x = torch.randn(tokens, dim)

    def forward() -> None:
        with Collectives():
            if GEN.registry:
                from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

                dispatcher = AllToAllTokenDispatcher(AllToAllTokenDispatcher.Config(num_experts=experts, top_k=1))
                dispatcher.wire_meshes(ep_mesh=mesh)
                dispatcher.dispatch(x, torch.ones(tokens, 1), expert_ids, counts)
            else:
                from torchtitan.distributed.expert_parallel import ExpertParallel

                routed = x[expert_ids.view(-1).argsort(stable=True)]
                ExpertParallel()._token_dispatch(None, (routed, counts), mesh)

    def backward() -> None:
        for turn in range(3):
            log.append(f"B{turn}")
            hand_over()

    posts: dict[str, dict[bool, list[str]]] = {}
    for backend in ("spmd_types", "partial_dtensor") if GEN.registry else ("-",):
        if GEN.registry:  # spmd_types: 0.3.0's default, its expert-parallel group from the sparse mesh
            from torchtitan.distributed import spmd_types, utils as titan_utils

            titan_utils.set_spmd_backend(backend)
            spmd_types.set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)
        posts[backend] = {}
        for hand_over_counts in (False, True):
            emulate_relayed_exchanges(0.0).count_hand_over = hand_over_counts
            run_relayed(forward, backward)
            posts[backend][hand_over_counts] = log[:]
            log.clear()
    emulate_relayed_exchanges(None)
    return _every_rank(posts)


def count_twins_released() -> dict[str, object]:
    """The count communicator's twin of a group, made, then the process group destroyed: does
    anything of ours still hold the twin or the default group? (Held to interpreter exit, gloo's
    worker threads abort while they free the last collective's tensors.) This rank's answer."""
    import weakref

    from titan_dualpipe.overlap.count_groups import count_group, make_count_groups

    make_count_groups([dist.group.WORLD])
    twin = count_group(dist.group.WORLD)
    made = twin is not dist.group.WORLD
    held = {"twin": weakref.ref(twin), "default group": weakref.ref(dist.group.WORLD)}
    del twin
    dist.barrier()
    dist.destroy_process_group()  # no gc.collect(): what only the collector frees, exit frees too
    return {"made": made, "still held": sorted(name for name, ref in held.items() if ref() is not None)}


def folded_meshes() -> list[dict]:
    """4 processes = pp 2 x fsdp 2 with EP 2 over the fsdp ranks, torchtitan's layout: each rank's
    groups, fold checks, gradient sums and model-part initialisation."""
    from types import SimpleNamespace

    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_dualpipe.runtime.twins import folded_into_fsdp
    from titan_dualpipe.titan.cpu import AllReduceScatter
    from titan_dualpipe.titan.fold import build_folded_meshes

    rank = dist.get_rank()
    dims = SimpleNamespace(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2, etp=1, world_size=4)
    meshes = build_folded_meshes(dims, "cpu")
    mesh = {name: meshes.lookup([name]) for name in ("fsdp", "efsdp", "ep")}
    twin = (rank + 2) % 4  # pipeline rank 1 - p, same fsdp index

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(distribute_tensor(torch.ones(4, 8, 8), mesh["ep"], [Shard(0)]))

        def forward(self, scale: torch.Tensor) -> torch.Tensor:
            return self.w.to_local().sum() * scale

    def model(dense_mesh):  # a dense layer and 4 experts split over EP, FSDP-sharded as torchtitan does
        m = nn.Module()
        m.dense, m.experts = nn.Linear(8, 8), Experts()
        fully_shard(m.experts, mesh=mesh["efsdp"])
        fully_shard(m.dense, mesh=dense_mesh)
        return m

    def grads(m, comm=None):
        for fsdp_module in (m.dense, m.experts):  # sums, as torchtitan's CPU runs reduce them
            fsdp_module.set_gradient_divide_factor(1.0)
            fsdp_module.set_force_sum_reduction_for_comms(True)
            if comm is not None:
                fsdp_module.set_custom_reduce_scatter(comm)
        (m.dense(torch.full((2, 8), float(rank + 1))).sum() + m.experts(torch.tensor(float(rank + 1)))).backward()
        return [p.grad.to_local().clone() for p in (m.dense.weight, m.dense.bias, m.experts.w)]

    folded = model(mesh["fsdp"])
    default, all_reduced = grads(folded), grads(model(mesh["fsdp"]), AllReduceScatter())
    init_order, init_sums = _init_parts_folded(rank, mesh["fsdp"])
    return _every_rank({
        "groups": {name: dist.get_process_group_ranks(m.get_group()) for name, m in mesh.items()},
        "folded": folded_into_fsdp([folded], twin),
        "not_twin": folded_into_fsdp([folded], (rank + 1) % 4)[0],
        "half_folded": folded_into_fsdp([model(mesh["ep"])], twin),  # dense over a group without the twin
        "outside_fsdp": folded_into_fsdp([folded, nn.Linear(2, 2)], twin),
        "same_sums": all(torch.equal(a, b) for a, b in zip(default, all_reduced)),
        "grad_sums": [float(g.sum()) for g in default],
        "init_order": init_order,
        "init_sums": init_sums,
    })


def _init_parts_folded(rank: int, fsdp_mesh) -> tuple[list[int], list[float]]:
    """Two model parts of different sizes sharded over the folded mesh, held in opposite order
    by twins (pipeline rank 0: parts 0, 1; pipeline rank 1: parts 1, 0) and initialized as
    torchtitan does, each in the rank's own order. Each init gathers its part's full weight (as
    torch 2.14's trunc_normal_ gathers its mask), so parts reached in different orders on
    twins would mismatch the gathers."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from titan_dualpipe.titan.fold import init_parts_in_order

    order: list[int] = []
    sums: dict[int, float] = {}

    class Part(nn.Linear):
        def init_weights(self, buffer_device=None) -> None:
            nn.init.trunc_normal_(self.weight, std=0.02)
            order.append(self.part)
            sums[self.part] = float(self.weight.full_tensor().sum())

    with torch.device("meta"):
        parts = {part: Part(8, 8 * (part + 1)) for part in (0, 1)}
    for part, module in parts.items():
        module.part = part
        fully_shard(module, mesh=fsdp_mesh)
    init_parts_in_order(parts)
    for part in (0, 1) if rank // 2 == 0 else (1, 0):
        parts[part].to_empty(device="cpu")
        with torch.no_grad():
            parts[part].init_weights(buffer_device=None)
    return order, [sums[0], sums[1]]


def chunked_against_whole() -> list[dict[str, Any]]:
    """2 ranks x 3 local experts, uneven routed counts: :func:`run_chunked` in 2 chunks against one
    relayed exchange each way, each expert a weight of its own applied to its rows; the outputs,
    the routed rows' gradient and every expert weight's gradient, bit for bit; and the collectives
    in the order each rank posts and waits them."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_dualpipe.overlap.comm import relayed_all_to_all_single
    from titan_dualpipe.titan.expert_chunks import plan_chunks, run_chunked

    rank, ep, local, dim = dist.get_rank(), 2, 3, 4
    group = dist.group.WORLD
    counts = torch.tensor([[3, 0, 2, 1, 4, 2], [1, 2, 0, 3, 1, 1]])  # rows per global expert, per rank
    received = counts[:, rank * local:(rank + 1) * local].reshape(-1).tolist()  # peer-major
    gen = torch.Generator().manual_seed(rank)
    routed = torch.randn(int(counts[rank].sum()), dim, generator=gen)
    weights = torch.randn(local, dim, dim, generator=torch.Generator().manual_seed(7))
    grad_out = torch.randn(routed.shape, generator=gen)

    def expert_rows(x: torch.Tensor, w: torch.Tensor, per_peer_expert: list[int], experts: range) -> torch.Tensor:
        """Rows arrive peer-major; each goes through its expert's weight."""
        pieces, start = [], 0
        for i, n in enumerate(per_peer_expert):
            pieces.append(x[start:start + n] @ w[experts[i % len(experts)]])
            start += n
        return torch.cat(pieces)

    def run(chunks: int) -> tuple[torch.Tensor, ...]:
        x, w = routed.clone().requires_grad_(), weights.clone().requires_grad_()
        if chunks == 1:
            local_counts = counts[rank].tolist()
            sends = [sum(local_counts[p * local:(p + 1) * local]) for p in range(ep)]
            receives = [sum(received[p * local:(p + 1) * local]) for p in range(ep)]
            arrived = relayed_all_to_all_single(x, receives, sends, group)
            out = relayed_all_to_all_single(expert_rows(arrived, w, received, range(local)), sends, receives, group)
        else:
            plan = plan_chunks(counts[rank].tolist(), received, ep, chunks, group, x.device)
            out = run_chunked(x, plan, lambda c, arrived: expert_rows(arrived, w, plan.received_counts[c],
                                                                       plan.experts[c]))
        out.backward(grad_out)
        return out.detach(), x.grad, w.grad

    log: list[str] = []

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional":
                log.append({"all_to_all_single": "post", "wait_tensor": "wait"}.get(func.overloadpacket.__name__, "?"))
            return func(*args, **(kwargs or {}))

    whole = run(1)
    with Collectives():
        chunked = run(2)
    return _every_rank({"equal": [torch.equal(a, b) for a, b in zip(whole, chunked)], "log": log})
