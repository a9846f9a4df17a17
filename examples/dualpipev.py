"""DualPipeV from your own training script: a small MLP trained on CPU processes, then checked
against the same model trained without pipelining.

    torchrun --nproc-per-node 2 examples/dualpipev.py

Any number of processes works (pp = the number of processes). DualPipeV cuts the model into
2*pp parts and places them in a "V": rank r holds parts r and 2*pp-1-r, so rank 0 holds the
first and the last part.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from titan_dualpipe import ScheduleDualPipeV

DIM, BATCH, N_MICROBATCHES, STEPS, LR = 16, 32, 8, 5, 0.2  # DualPipeV needs n_microbatches >= 2*pp


def make_model(n_parts: int) -> nn.Sequential:
    """One Linear+Tanh block per part; the same seed on every rank gives the same weights everywhere."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(n_parts)])


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # called as loss_fn(output, target)
    return nn.functional.mse_loss(output, target)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same data on every rank (and for the reference): a seeded generator per step."""
    x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(1000 + step))
    return x, torch.sin(x).flip(1)  # a target the model can learn


def main() -> None:
    dist.init_process_group("gloo")  # torchrun's environment: rank, world size, rendezvous
    rank, pp = dist.get_rank(), dist.get_world_size()
    model = make_model(2 * pp)
    reference = copy.deepcopy(model)  # rank 0 trains it without pipelining below

    # This rank's two stages; the pipeline group is the default group (all processes).
    stages = [PipelineStage(model[s], s, 2 * pp, torch.device("cpu"))
              for s in (rank, 2 * pp - 1 - rank)]
    # scale_grads=True (the default): the gradients are those of the mean of the microbatch losses
    schedule = ScheduleDualPipeV(stages, n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)
    params = [p for stage in stages for p in stage.submod.parameters()]
    optimizer = torch.optim.SGD(params, lr=LR)

    pipelined_losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(step)
        losses = []  # filled with the n microbatch losses on the rank holding the last stage (rank 0)
        if rank == 0:  # holds the first stage (takes x) and the last (takes the target)
            schedule.step(x, target=y, losses=losses)
        else:
            schedule.step()  # activations and gradients arrive from the neighbours
        optimizer.step()
        if rank == 0:
            pipelined_losses.append(torch.stack(losses).detach())
            print(f"step {step}: mean loss {pipelined_losses[-1].mean().item():.6f}")

    # Every rank's trained parts, by their names in the whole model ("<part>.<module>.<param>").
    mine = {f"{s.stage_index}.{name}": p.detach() for s in stages for name, p in s.submod.named_parameters()}
    everyone = [None] * pp if rank == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    dist.destroy_process_group()

    if rank == 0:
        check(reference, pipelined_losses, {k: v for part in everyone for k, v in part.items()})


def check(reference: nn.Module, pipelined_losses: list, pipelined_params: dict) -> None:
    """The same steps without pipelining: each microbatch's loss, backward of their mean."""
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    ref_losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(step)
        pairs = zip(x.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES))  # the schedule's microbatches
        losses = torch.stack([loss_fn(reference(xm), ym) for xm, ym in pairs])
        losses.mean().backward()  # what scale_grads=True computes
        optimizer.step()
        ref_losses.append(losses.detach())
    ref_params = {k: p.detach() for k, p in reference.named_parameters()}
    loss_diff = max((a - b).abs().max().item() for a, b in zip(pipelined_losses, ref_losses))
    param_diff = max((pipelined_params[k] - p).abs().max().item() for k, p in ref_params.items())
    print(f"max abs difference to the model trained without pipelining: "
          f"losses {loss_diff:.3g}, parameters {param_diff:.3g}")
    torch.testing.assert_close(pipelined_losses, ref_losses, rtol=1e-5, atol=4e-5)  # raises: non-zero exit
    torch.testing.assert_close(pipelined_params, ref_params, rtol=1e-5, atol=4e-5)


if __name__ == "__main__":
    main()
