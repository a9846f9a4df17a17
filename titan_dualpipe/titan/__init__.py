"""torchtitan adapter: importing this package registers DualPipeV and DualPipe (torchtitan 0.2.2 or 0.3.0).

torchtitan 0.2.2 loads it through a TOML's ``[experimental] custom_import = "titan_dualpipe.titan"``;
0.3.0 through ``--module titan_dualpipe.titan --config NAME`` (our configs, :mod:`.config_registry`)
or a user's own ``config_registry`` that imports it (or :mod:`.trainer_config`). Then
``pipeline_parallel_schedule = "DualPipeV"`` or ``"DualPipe"`` (any case) builds our schedules
(:mod:`.pipeline`), whose pairs overlap torchtitan's expert-parallel exchanges
(:mod:`.expert_overlap`); every other name keeps torchtitan's own behaviour. Importing also switches
torchtitan to CPU / gloo without an accelerator (:mod:`.cpu`), registers the shipped dataset
(:mod:`.data`), counts each DualPipe twin once in gradient clipping (:mod:`.grad_clip`) and hooks
the trainer (:mod:`.trainer_hooks`). Both loading paths run before the trainer reads the device
type or creates the process group, which every patch relies on. Usage: docs/torchtitan.md.
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
