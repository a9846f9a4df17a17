"""torchtitan 0.2.2 adapter: importing this module registers DualPipeV and DualPipe.

In a torchtitan TOML::

    [experimental]
    custom_import = "titan_dualpipe.titan"

    [parallelism]
    pipeline_parallel_schedule = "DualPipeV"   # or "DualPipe" (any case)

Every other schedule name keeps torchtitan's own behaviour. For ours,
``[parallelism] pipeline_parallel_expert_parallel_overlap`` (default true) is the schedules'
``overlap`` switch, and torchtitan's own DualPipeV expert-parallel hooks are not applied
(:mod:`.pipeline`): instead, torchtitan's expert-parallel dispatch and combine overlap with
the partner half of each pair (:mod:`.expert_overlap`). Importing also

- switches torchtitan to CPU / gloo when the machine has no accelerator, MoE models and FSDP
  included (:mod:`.cpu`, :mod:`.cpu_moe`);
- registers the shipped dataset ``titan_dualpipe_tiny`` (:mod:`.data`);
- checks configs naming our schedules before the process group exists
  (:mod:`.config_check`, via :mod:`.trainer_hooks`);
- counts each DualPipe twin once in gradient-norm clipping (:mod:`.grad_clip`);
- logs the training and validation loss on every pipeline rank (:mod:`.trainer_hooks`).

``custom_import`` runs after torchtitan's own modules are imported and before the trainer
reads the device type or creates the process group, which is what every patch here relies on.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# torchtitan releases this adapter was tested with (each with every supported torch, 2.11-2.14).
TESTED_TORCHTITAN = ("0.2.2",)


def check_torchtitan_version(found: str | None = None) -> str:
    """ImportError naming the tested releases unless torchtitan ``found`` (default: installed) is one."""
    if found is None:
        try:
            found = version("torchtitan")
        except PackageNotFoundError:
            raise ImportError(
                "titan_dualpipe.titan needs torchtitan: pip install 'titan_dualpipe[titan]' (torchtitan==0.2.2)"
            ) from None
    if found not in TESTED_TORCHTITAN:
        raise ImportError(
            f"titan_dualpipe.titan supports torchtitan {' and '.join(TESTED_TORCHTITAN)}; found torchtitan {found}. "
            "Install a tested release (pip install torchtitan==0.2.2)."
        )
    return found


TORCHTITAN_VERSION = check_torchtitan_version()

from . import cpu, data, grad_clip, pipeline, trainer_hooks  # noqa: E402 - after the version check
from .config_check import Plan, check_job_config, our_schedule

CPU_MODE = cpu.enable()
data.register_dataset()
pipeline.install()
grad_clip.install()
trainer_hooks.install()

__all__ = ["CPU_MODE", "Plan", "TORCHTITAN_VERSION", "check_job_config", "check_torchtitan_version", "our_schedule"]
