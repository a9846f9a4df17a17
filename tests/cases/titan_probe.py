"""Loaded inside torchtitan's trainer processes by the end-to-end tests (tests/titan/).

torchtitan 0.2.2 loads it with ``--experimental.custom_import cases.titan_probe``; on 0.3.0 it is the
``--module`` of the run: a user's own config registry that imports ours (the pattern
docs/torchtitan.md documents), so ``--module cases.titan_probe --config debug_dualpipe`` runs our
config with the probe.

With ``PROBE_ENV`` set it records, at ``Trainer.close``, each rank's schedule class, its
``overlap`` setting, whether DualPipe's twins were folded into FSDP, how many pairs ran as a
relay and how often their halves switched, how many MoE layers exchanged in chunks, and a hash of every parameter (and MoE expert
bias) of every stage (this rank's shard of it).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from pathlib import Path

from titan_dualpipe.switches import TEST_KILL_ENV as KILL_ENV
from titan_dualpipe.switches import TEST_PROBE_ENV as PROBE_ENV
from titan_dualpipe.titan import GEN

if GEN.registry:  # a config registry of one's own: our configs, imported from ours
    from titan_dualpipe.titan.config_registry import debug_dualpipe, debug_dualpipev, debug_moe_dualpipe  # noqa: F401

def _param_hashes(module) -> dict[str, str]:
    """Parameters and MoE expert biases (routing state), this rank's shard of each, bit for bit."""
    import torch

    tensors = [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if "expert_bias" in n)]
    local = {name: getattr(t, "to_local", t.detach)().detach().contiguous().cpu().reshape(-1) for name, t in tensors}
    return {name: hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest() for name, t in local.items()}


def _install_probe(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining.schedules import OVERLAP_F_B

    from titan_dualpipe.overlap import pair, sub_batches
    from titan_dualpipe.titan import expert_chunks

    trainer_class = importlib.import_module(GEN.trainer_module).Trainer
    original_close = trainer_class.close
    relayed = {"pairs": 0, "hand_overs": 0}
    run_relayed = pair.run_relayed

    def counted_run_relayed(forward_half, backward_half, *args, **kwargs):
        done = run_relayed(forward_half, backward_half, *args, **kwargs)
        relayed["pairs"] += 1
        relayed["hand_overs"] += done.hand_overs
        return done

    pair.run_relayed = counted_run_relayed
    split = {"microbatches": 0, "relays": 0, "hand_overs": 0}  # two-batch overlap's sub-batches
    join_sub_batches, sub_batches_relayed = sub_batches.join_sub_batches, sub_batches.run_relayed

    def counted_join(outputs, sizes):
        split["microbatches"] += 1
        return join_sub_batches(outputs, sizes)

    def counted_sub_batches_relayed(first, second):
        done = sub_batches_relayed(first, second)
        split["relays"] += 1
        split["hand_overs"] += done.hand_overs
        return done

    sub_batches.join_sub_batches, sub_batches.run_relayed = counted_join, counted_sub_batches_relayed
    chunked = {"layers": 0, "exchanges": 0}  # MoE layer forwards that exchanged in chunks, and their exchanges
    run_chunked = expert_chunks.run_chunked

    def counted_run_chunked(routed, plan, experts):
        chunked["layers"] += 1
        chunked["exchanges"] += 2 * len(plan.experts)
        return run_chunked(routed, plan, experts)

    expert_chunks.run_chunked = counted_run_chunked

    def close(self) -> None:
        schedule = getattr(self, "pp_schedule", None)
        if schedule is not None:
            record = {
                "schedule_mro": [c.__module__ + "." + c.__name__ for c in type(schedule).__mro__],
                "overlap_callback": OVERLAP_F_B in schedule._comp_type_to_function_map,
                "overlap": getattr(schedule, "overlap", None),
                "folded": getattr(schedule, "fsdp_at_step_edges", None),
                "relayed": relayed,
                "halves": split,
                "chunked": chunked,
                "two_batch_stages": sorted(getattr(schedule, "two_batch_stages", ())),
                "stages": {str(s.stage_index): _param_hashes(s.submod) for s in schedule._stages},
                "deferred_weights": {str(s): names for s, names in getattr(schedule, "deferred_weights", {}).items()},
                "deferred_last_step": dict(schedule.weight_policy.queue.ran_kinds) if hasattr(schedule, "weight_policy") else {},
                "deferred_in_flight": schedule.weight_policy.queue.ran_in_flight if hasattr(schedule, "weight_policy") else 0,
            }
            path = Path(out_dir) / f"probe_rank{dist.get_rank()}.json"
            path.write_text(json.dumps(record))
        original_close(self)

    trainer_class.close = close


if os.environ.get(PROBE_ENV):
    _install_probe(os.environ[PROBE_ENV])


def _install_killer(spec: str) -> None:
    import signal

    import torch.distributed as dist

    from titan_dualpipe.runtime.executor import StepExecutor

    rank, nth = (int(x) for x in spec.split(":"))
    run_forward = StepExecutor.run_forward
    calls = [0]

    def run_forward_or_die(self, action):
        calls[0] += 1
        if dist.get_rank() == rank and calls[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
        return run_forward(self, action)

    StepExecutor.run_forward = run_forward_or_die


if os.environ.get(KILL_ENV):
    _install_killer(os.environ[KILL_ENV])
