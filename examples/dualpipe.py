"""DualPipe from your own training script: a small MLP trained on CPU processes, then checked
against the same model trained without pipelining.

    torchrun --nproc-per-node 2 examples/dualpipe.py

pp = the number of processes, even. DualPipe cuts the model into pp parts and runs two chains
in opposite directions, so every part is held twice (its "twins"): rank r holds part r as stage
r (direction 0, microbatches 0..n/2-1) and part pp-1-r as stage 2*pp-1-r (direction 1,
microbatches n/2..n-1). Ranks 0 and pp-1 each hold a first and a last stage.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from titan_dualpipe import ScheduleDualPipe, placement

DIM, BATCH, N_MICROBATCHES, STEPS, LR = 16, 32, 8, 5, 0.2  # DualPipe needs an even n_microbatches >= 2*pp


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
    model = make_model(pp)
    reference = copy.deepcopy(model)  # rank 0 trains it without pipelining below

    # placement() says where everything lives: this rank's stage ids, the part each holds, who
    # feeds the batch. Its third argument is the microbatch count per step (the schedule's).
    place = placement("DualPipe", pp, N_MICROBATCHES)
    # The two stages of a rank hold different parts (r and pp-1-r); the twin copy of each part is on
    # another rank. The schedule copies direction 0's weights onto the twins at the first step.
    stages = [PipelineStage(model[place.model_part(s)], s, 2 * pp, torch.device("cpu"))
              for s in place.stages_of(rank)]
    # scale_grads=True (the default): the gradients are those of the mean of the microbatch losses
    schedule = ScheduleDualPipe(stages, n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)
    params = [p for stage in stages for p in stage.submod.parameters()]
    optimizer = torch.optim.SGD(params, lr=LR)

    pipelined_losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(step)
        losses = []  # ranks 0 and pp-1 both receive all n microbatch losses, in microbatch order
        if place.feeds_batch(rank):  # ranks 0 and pp-1 pass the same whole batch and target
            schedule.step(x, target=y, losses=losses)
        else:
            schedule.step()
        # Each step summed the twins' gradients: both copies of a part hold the full-batch
        # gradient, so one optimizer step on every rank keeps them identical.
        optimizer.step()
        if rank == 0:
            pipelined_losses.append(torch.stack(losses).detach())
            print(f"step {step}: mean loss {pipelined_losses[-1].mean().item():.6f}")

    # Every rank's trained parts, by their names in the whole model ("<part>.<module>.<param>");
    # both copies of each part are checked.
    mine = [(f"{place.model_part(s.stage_index)}.{name}", p.detach())
            for s in stages for name, p in s.submod.named_parameters()]
    everyone = [None] * pp if rank == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    dist.destroy_process_group()

    if rank == 0:
        check(reference, pipelined_losses, [named for part in everyone for named in part])


def check(reference: nn.Module, pipelined_losses: list, pipelined_params: list) -> None:
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
    assert sorted(k for k, _ in pipelined_params) == sorted(2 * list(ref_params))  # every part twice
    loss_diff = max((a - b).abs().max().item() for a, b in zip(pipelined_losses, ref_losses))
    param_diff = max((p - ref_params[k]).abs().max().item() for k, p in pipelined_params)
    print(f"max abs difference to the model trained without pipelining: "
          f"losses {loss_diff:.3g}, parameters {param_diff:.3g}")
    torch.testing.assert_close(pipelined_losses, ref_losses, rtol=1e-5, atol=4e-5)  # raises: non-zero exit
    for k, p in pipelined_params:
        torch.testing.assert_close(p, ref_params[k], rtol=1e-5, atol=4e-5, msg=lambda m, k=k: f"{k}: {m}")


if __name__ == "__main__":
    main()
