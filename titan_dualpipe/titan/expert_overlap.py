"""torchtitan's expert-parallel all-to-all as hand-over points of our overlapped pairs.

torchtitan 0.2.2's ``ExpertParallel`` (:mod:`torchtitan.distributed.expert_parallel`)
dispatches and combines tokens with ``all_to_all_single_autograd``, a name that module
looks up at call time. Under our schedules it becomes
:func:`~titan_dualpipe.overlap.comm.relayed_all_to_all_single`: the same exchange with the
same functional collective op (so activation-checkpointing policies treat it alike) and
the same bits, which hands over to the partner half of a relayed pair between posting and
waiting, forward and backward. torchtitan's MoE blocks then overlap their dispatch and
combine with the other half's compute in every DualPipe / DualPipeV pair, the model
unchanged (:mod:`titan_dualpipe.overlap.relay`). DeepEP's dispatch (``moe_impl = "deepep"``)
has its own communication and is left as it is.
"""

from __future__ import annotations


def install() -> None:
    """Route torchtitan's expert-parallel all-to-all through the relay (idempotent)."""
    from torchtitan.distributed import expert_parallel

    from ..overlap.comm import relayed_all_to_all_single

    expert_parallel.all_to_all_single_autograd = relayed_all_to_all_single
