"""Hooks on torchtitan's trainer and metrics for our schedules.

- ``Trainer.init_distributed``: before it creates the process group, resolve shipped-asset
  paths, check the config (:mod:`.config_check`), record the plan and, for our schedules,
  make torchtitan's expert-parallel exchanges hand-over points of overlapped pairs
  (:mod:`.expert_overlap`). ``custom_import`` runs
  inside ``Trainer.__init__`` just before ``self.init_distributed()``, so replacing the class
  attribute still catches this very trainer. With ``python -m torchtitan.train`` the class
  lives in ``__main__``; both that and ``torchtitan.train.Trainer`` are hooked.
- Loss: both our schedules have the losses on pipeline rank 0 (DualPipeV's last stage
  ``2pp-1`` lives there; DualPipe computes them on ranks 0 and ``pp-1``), while torchtitan
  assumes the last PP rank for every schedule but "ZBVZeroBubble" and logs ``loss: -1``
  elsewhere (validation: ``-1 / tokens``, its validator builds no schedule of its own and runs
  ``pp_schedule.eval()``, which ours support). ``MetricsProcessor.log`` and ``log_validation``
  take the loss from pipeline rank 0 on every rank, so every console shows it; ``_get_metrics_rank`` (TensorBoard / W&B) is rank 0 and the
  ``ensure_pp_loss_visible`` warning about LOG_RANK is moot.
- ``get_train_spec``: loading a spec imports the model's ``parallelize`` module, whose bound
  ``get_dual_pipe_v_flag`` is then patched (:func:`.pipeline.patch_dual_pipe_v_flag`). Under
  DualPipe the spec's optimizer builder also registers the MoE twin expert-count sum
  (:mod:`.moe_twins`).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable

from . import data, expert_overlap
from .config_check import check_job_config, our_schedule
from .moe_twins import with_twin_expert_counts
from .pipeline import ACTIVE, patch_dual_pipe_v_flag

LOSS_RANK = 0  # pipeline rank holding a last stage for both schedules; global rank 0 too


def _n_layers(job_config: Any) -> int | None:
    from torchtitan.protocols.train_spec import get_train_spec

    args = get_train_spec(job_config.model.name).model_args.get(job_config.model.flavor)
    return getattr(args, "n_layers", None)


def prepare(job_config: Any) -> None:
    """Resolve asset paths, check the config, record the plan (raises ValueError on every rank)."""
    data.resolve_asset_paths(job_config)
    n_layers = _n_layers(job_config) if our_schedule(job_config.parallelism.pipeline_parallel_schedule) else None
    ACTIVE.plan = check_job_config(job_config, n_layers)
    if ACTIVE.plan is not None:
        expert_overlap.install()


def _hook_init_distributed(cls: type) -> None:
    original = cls.init_distributed
    if getattr(original, "_titan_dualpipe", False):
        return

    @functools.wraps(original)
    def init_distributed(self: Any) -> Any:
        prepare(self.job_config)
        return original(self)

    init_distributed._titan_dualpipe = True  # type: ignore[attr-defined]
    cls.init_distributed = init_distributed


def _trainer_modules() -> list[Any]:
    """Loaded modules that hold torchtitan's ``Trainer``: the package module and ``__main__``."""
    main = sys.modules.get("__main__")
    is_train_main = getattr(getattr(main, "__spec__", None), "name", None) == "torchtitan.train"
    return [m for m in (sys.modules.get("torchtitan.train"), main if is_train_main else None) if m is not None]


def _make_metrics_rank(original: Callable[[Any, Any], int]) -> Callable[[Any, Any], int]:
    def _get_metrics_rank(parallel_dims: Any, job_config: Any) -> int:
        if parallel_dims.pp_enabled and our_schedule(job_config.parallelism.pipeline_parallel_schedule):
            return LOSS_RANK
        return original(parallel_dims, job_config)

    return _get_metrics_rank


def _make_loss_visible(original: Callable[..., None]) -> Callable[..., None]:
    def ensure_pp_loss_visible(parallel_dims: Any, job_config: Any, color: Any) -> None:
        if not our_schedule(job_config.parallelism.pipeline_parallel_schedule):
            original(parallel_dims, job_config, color)  # ours: every rank logs the loss

    return ensure_pp_loss_visible


def _make_metrics_log(original: Callable[..., None]) -> Callable[..., None]:
    def log(self: Any, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        dims = self.parallel_dims
        if dims.pp_enabled and our_schedule(self.job_config.parallelism.pipeline_parallel_schedule):
            global_avg_loss, global_max_loss = _losses_from_loss_rank(dims, global_avg_loss, global_max_loss)
        original(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    return log


def _make_metrics_log_validation(original: Callable[..., None]) -> Callable[..., None]:
    def log_validation(self: Any, loss: float, step: int, extra_metrics: dict[str, Any] | None = None) -> None:
        dims = self.parallel_dims
        if dims.pp_enabled and our_schedule(self.job_config.parallelism.pipeline_parallel_schedule):
            loss, _ = _losses_from_loss_rank(dims, loss, loss)
        original(self, loss, step, extra_metrics)

    return log_validation


def _losses_from_loss_rank(parallel_dims: Any, avg: float, peak: float) -> tuple[float, float]:
    """Every PP rank takes pipeline rank 0's loss instead of logging -1.

    MetricsProcessor.log and log_validation run on every rank at the same steps (torchtitan
    already runs its loss collectives there), so this two-float broadcast is safe and costs
    one tiny message per logged step.
    """
    import torch
    import torch.distributed as dist
    from torchtitan.tools import utils

    values = torch.tensor([avg, peak], dtype=torch.float64, device=utils.device_type)
    dist.broadcast(values, group=parallel_dims.get_mesh("pp").get_group(), group_src=LOSS_RANK)
    return values[0].item(), values[1].item()


def _make_get_train_spec(original: Callable[[str], Any]) -> Callable[[str], Any]:
    """The model's DualPipeV flag patched; DualPipe: the optimizer builder keeps MoE twins' counts equal."""

    def get_train_spec(name: str) -> Any:
        spec = original(name)
        patch_dual_pipe_v_flag(sys.modules.get(getattr(spec.parallelize_fn, "__module__", None) or ""))
        plan = ACTIVE.plan
        if plan is None or plan.schedule != "DualPipe":
            return spec
        return dataclasses.replace(spec, build_optimizers_fn=with_twin_expert_counts(spec.build_optimizers_fn))

    return get_train_spec


def install() -> None:
    from torchtitan.components import metrics
    from torchtitan.protocols import train_spec

    if getattr(metrics, "_titan_dualpipe_installed", False):
        return
    original_visible = metrics.ensure_pp_loss_visible
    metrics._get_metrics_rank = _make_metrics_rank(metrics._get_metrics_rank)
    metrics.ensure_pp_loss_visible = _make_loss_visible(original_visible)
    metrics.MetricsProcessor.log = _make_metrics_log(metrics.MetricsProcessor.log)
    metrics.MetricsProcessor.log_validation = _make_metrics_log_validation(metrics.MetricsProcessor.log_validation)
    metrics._titan_dualpipe_installed = True
    train_spec.get_train_spec = _make_get_train_spec(train_spec.get_train_spec)
    if not _trainer_modules():
        import torchtitan.train  # noqa: F401 - imported here only when nothing loaded it yet
    for module in _trainer_modules():
        _hook_init_distributed(module.Trainer)
        if getattr(module, "ensure_pp_loss_visible", None) is original_visible:
            module.ensure_pp_loss_visible = metrics.ensure_pp_loss_visible
