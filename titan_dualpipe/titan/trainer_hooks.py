"""Hooks on torchtitan's trainer and metrics for our schedules.

- ``Trainer.init_distributed``: before it creates the process group, resolve shipped-asset paths,
  check the config (:mod:`.config_check`), record the plan and the switches (:mod:`.active`) and,
  for our schedules, make torchtitan's expert-parallel exchanges hand-over points
  (:mod:`.expert_overlap`). Both ways torchtitan loads us run before the trainer is constructed, so
  replacing the class attribute catches this very trainer (on 0.2.2 under ``python -m
  torchtitan.train`` its ``__main__`` copy too).
- Loss: our schedules compute the losses on pipeline rank 0, where torchtitan logs them from the
  last PP rank only (``loss: -1`` elsewhere): ``MetricsProcessor.log`` and ``log_validation`` take
  them from pipeline rank 0 on every rank, ``_get_metrics_rank`` (TensorBoard / W&B) is rank 0 and
  ``ensure_pp_loss_visible`` stays silent.
- MoE under DualPipe: the optimizer builder also registers the twins' expert-count sum (:mod:`.moe_twins`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from typing import Any, Callable

from . import cpu, data, expert_overlap
from .config_check import check_cpu_attention, check_job_config, our_schedule
from .expert_chunks import exchange_chunks_option
from .generation import GEN
from .moe_twins import with_twin_expert_counts, with_twin_expert_counts_030
from .active import ACTIVE
from .pipeline import patch_dual_pipe_v_flag

LOSS_RANK = 0  # pipeline rank holding a last stage for both schedules; global rank 0 too


def prepare(job_config: Any) -> None:
    """Resolve asset paths, check the config, record the plan (raises ValueError on every rank);
    on a CPU-only machine, compute in float32 (:func:`.cpu.prepare_config`)."""
    data.resolve_asset_paths(job_config)
    if not cpu.accelerator_present():
        cpu.prepare_config(job_config)
    n_layers = GEN.n_layers(job_config) if our_schedule(job_config.parallelism.pipeline_parallel_schedule) else None
    ACTIVE.plan = check_job_config(job_config, n_layers)
    ACTIVE.overlap = GEN.overlap(job_config)
    ACTIVE.two_batch = GEN.two_batch_overlap(job_config)
    ACTIVE.weight_gradients, ACTIVE.not_deferred = GEN.weight_gradients(job_config)
    ACTIVE.pair_first = GEN.pair_first(job_config)
    if ACTIVE.plan is None:
        return
    if not cpu.accelerator_present():
        check_cpu_attention(ACTIVE.plan, job_config)
    ACTIVE.expert_parallel = job_config.parallelism.expert_parallel_degree > 1
    ACTIVE.exchange_chunks = exchange_chunks_option()
    expert_overlap.install()
    if GEN.registry and ACTIVE.plan.schedule == "DualPipe":
        _adapt_dualpipe_030(job_config)


def _adapt_dualpipe_030(config: Any) -> None:
    """0.3.0 + DualPipe: twin expert counts, and a loss that does not look for the LM head in the last part.

    torchtitan's chunked loss takes the LM head from the last model part of a rank with a last
    stage. Under DualPipe rank ``pp-1`` holds the head in its first part (the last part of
    direction 0), so the chunked wrapper gives way to the loss it wraps: the same loss, computed
    from the full logits.
    """
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.tools.logging import logger

    spec = config.model_spec  # changed in place: the trainer holds it from before init_distributed
    if spec.post_optimizer_build_fn is not None and not getattr(spec.post_optimizer_build_fn, "_titan_dualpipe", False):
        spec.post_optimizer_build_fn = with_twin_expert_counts_030(spec.post_optimizer_build_fn)
    if isinstance(config.loss, ChunkedLossWrapper.Config):
        config.loss = config.loss.loss_fn
        logger.info("DualPipe: the chunked loss is computed unchunked (the LM head is not in every rank's last part)")


def _hook_init_distributed(cls: type) -> None:
    original = cls.init_distributed
    if getattr(original, "_titan_dualpipe", False):
        return

    @functools.wraps(original)
    def init_distributed(self: Any) -> Any:
        prepare(GEN.trainer_config(self))
        return original(self)

    init_distributed._titan_dualpipe = True  # type: ignore[attr-defined]
    cls.init_distributed = init_distributed


def _trainer_modules() -> list[Any]:
    """Loaded modules that define torchtitan's ``Trainer`` (0.2.2: also ``__main__``)."""
    main = sys.modules.get("__main__")
    is_train_main = not GEN.registry and getattr(getattr(main, "__spec__", None), "name", None) == "torchtitan.train"
    return [m for m in (sys.modules.get(GEN.trainer_module), main if is_train_main else None) if m is not None]


def trainer_classes() -> list[type]:
    """torchtitan's ``Trainer`` class(es) as the running trainer will find them."""
    if not _trainer_modules():
        importlib.import_module(GEN.trainer_module)
    return list({id(m.Trainer): m.Trainer for m in _trainer_modules()}.values())


def _make_metrics_rank(original: Callable[..., int]) -> Callable[..., int]:
    def _get_metrics_rank(*args: Any, **kwargs: Any) -> int:
        return LOSS_RANK if ACTIVE.plan is not None else original(*args, **kwargs)

    return _get_metrics_rank


def _make_loss_visible(original: Callable[..., None]) -> Callable[..., None]:
    def ensure_pp_loss_visible(*args: Any, **kwargs: Any) -> None:
        if ACTIVE.plan is None:
            original(*args, **kwargs)  # ours: every rank logs the loss

    return ensure_pp_loss_visible


def _make_metrics_log(original: Callable[..., None]) -> Callable[..., None]:
    def log(self: Any, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        if ACTIVE.plan is not None:
            global_avg_loss, global_max_loss = _losses_from_loss_rank(self.parallel_dims, global_avg_loss, global_max_loss)
        original(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    return log


def _make_metrics_log_validation(original: Callable[..., None]) -> Callable[..., None]:
    def log_validation(self: Any, loss: float, step: int, extra_metrics: dict[str, Any] | None = None) -> None:
        if ACTIVE.plan is not None:
            loss, _ = _losses_from_loss_rank(self.parallel_dims, loss, loss)
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
    """0.2.2: the model's DualPipeV flag patched; DualPipe: the optimizer builder keeps MoE twins' counts equal."""

    def get_train_spec(name: str) -> Any:
        spec = original(name)
        patch_dual_pipe_v_flag(sys.modules.get(getattr(spec.parallelize_fn, "__module__", None) or ""))
        plan = ACTIVE.plan
        if plan is None or plan.schedule != "DualPipe":
            return spec
        return dataclasses.replace(spec, build_optimizers_fn=with_twin_expert_counts(spec.build_optimizers_fn))

    return get_train_spec


def _install_metrics() -> Callable[..., None]:
    """Patch the metrics module; returns torchtitan's own ``ensure_pp_loss_visible``."""
    from torchtitan.components import metrics

    original_visible = metrics.ensure_pp_loss_visible
    if getattr(metrics, "_titan_dualpipe_installed", False):
        return original_visible
    metrics._get_metrics_rank = _make_metrics_rank(metrics._get_metrics_rank)
    metrics.ensure_pp_loss_visible = _make_loss_visible(original_visible)
    metrics.MetricsProcessor.log = _make_metrics_log(metrics.MetricsProcessor.log)
    metrics.MetricsProcessor.log_validation = _make_metrics_log_validation(metrics.MetricsProcessor.log_validation)
    metrics._titan_dualpipe_installed = True
    if not GEN.registry:
        from torchtitan.protocols import train_spec

        train_spec.get_train_spec = _make_get_train_spec(train_spec.get_train_spec)
    return original_visible


def install() -> None:
    from torchtitan.components import metrics

    original_visible = _install_metrics()
    if not _trainer_modules():
        importlib.import_module(GEN.trainer_module)  # imported here only when nothing loaded it yet
    for module in _trainer_modules():
        _hook_init_distributed(module.Trainer)
        if getattr(module, "ensure_pp_loss_visible", None) is original_visible:
            module.ensure_pp_loss_visible = metrics.ensure_pp_loss_visible
