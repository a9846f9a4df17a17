"""torchtitan adapter: importing this module registers DualPipeV and DualPipe (torchtitan 0.2.2 or 0.3.0).

torchtitan 0.2.2, in a TOML::

    [experimental]
    custom_import = "titan_dualpipe.titan"

    [parallelism]
    pipeline_parallel_schedule = "DualPipeV"   # or "DualPipe" (any case)

torchtitan 0.3.0: ``--module titan_dualpipe.titan --config debug_dualpipev`` picks a config of
ours (:mod:`.config_registry`); a user's own ``config_registry`` imports this package (or
:mod:`.trainer_config`) and sets ``parallelism.pipeline_parallel_schedule = "DualPipeV"``.

Every other schedule name keeps torchtitan's own behaviour. For ours, the overlap switch
(0.2.2: ``[parallelism] pipeline_parallel_expert_parallel_overlap``; 0.3.0: ``dualpipe.overlap``;
default true) is the schedules' ``overlap``, and torchtitan's own DualPipeV expert-parallel hooks
are not applied (:mod:`.pipeline`): instead, torchtitan's expert-parallel dispatch and combine
overlap with the partner half of each pair (:mod:`.expert_overlap`). Importing also

- switches torchtitan to CPU / gloo when the machine has no accelerator, MoE models and FSDP
  included (:mod:`.cpu`, :mod:`.cpu_moe`, :mod:`.cpu_attention`);
- registers the shipped dataset ``titan_dualpipe_tiny`` (:mod:`.data`);
- checks configs naming our schedules before the process group exists
  (:mod:`.config_check`, via :mod:`.trainer_hooks`);
- counts each DualPipe twin once in gradient-norm clipping (:mod:`.grad_clip`);
- logs the training and validation loss on every pipeline rank (:mod:`.trainer_hooks`).

Both loading paths run after torchtitan's own modules are imported and before the trainer
reads the device type or creates the process group, which is what every patch here relies on.
What differs between the two releases is in :mod:`.generation`.
"""

from __future__ import annotations

from ..torchtitan_version import TESTED_TORCHTITAN, check_torchtitan_version
from .generation import GEN

TORCHTITAN_VERSION = GEN.release

from . import cpu, data, grad_clip, pipeline, trainer_hooks  # noqa: E402 - after the version check
from .config_check import Plan, check_job_config, our_schedule  # noqa: E402

CPU_MODE = cpu.enable()
data.register_dataset()
pipeline.install()
grad_clip.install()
trainer_hooks.install()

__all__ = ["CPU_MODE", "GEN", "Plan", "TESTED_TORCHTITAN", "TORCHTITAN_VERSION", "check_job_config",
           "check_torchtitan_version", "our_schedule"]
