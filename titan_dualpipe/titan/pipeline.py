"""Our schedules inside torchtitan's pipeline builder (``torchtitan.distributed.pipeline_parallel``).

``pipeline_llm`` (every LLM's ``pipelining_fn``) looks its helpers up by module-level name at
call time, so replacing them (``get_schedule_class``, ``generate_llm_fqn_per_model_part``,
``pipeline_module_split``, ``build_pipeline_schedule``; :mod:`.generation` holds each release's
names) redirects it for our two schedule names and leaves every other name on torchtitan's own
code path. The schedule is built by our class itself, with the overlap, two-batch and
weight-gradient switches as its keywords (:func:`build_schedule`); :func:`install_one_rank_v` lets
DualPipeV train at ``pipeline_parallel_degree`` 1; on 0.2.2 :func:`patch_dual_pipe_v_flag` keeps
torchtitan's own DualPipeV expert-parallel hooks off our schedules. What each replacement does
and why: docs/torchtitan.md#how-it-works.
"""

from __future__ import annotations

import functools

import os
import warnings
from typing import Any, Callable

from ..switches import (COUNT_GROUPS_ENV, LONE_PAIRS_ENV, NOT_DEFERRED_ENV, OLD_WEIGHTS_IN_FLIGHT_ENV, PAIR_FIRST_ENV,
                        TWO_BATCH_ENV, WEIGHT_GEMMS_IN_FLIGHT_ENV, WEIGHT_GRADIENTS_ENV)
from . import fold
from .active import ACTIVE
from .config_check import our_schedule
from .expert_chunks import check_exchange_chunks
from .generation import GEN

V_STYLE_NAME = "ZBVZeroBubble"  # a torch schedule torchtitan places in a V


def pipelines_one_rank_v(parallel_dims: Any) -> bool:
    """Whether torchtitan's ``parallel_dims`` (pipeline degree 1) must pipeline anyway: a one-rank V."""
    return ACTIVE.one_rank_v and parallel_dims.pp == 1


def _make_pp_enabled(original: Callable[[Any], bool]) -> property:
    def pp_enabled(self: Any) -> bool:
        return original(self) or pipelines_one_rank_v(self)

    return property(pp_enabled)


def _make_mesh_exist(original: Callable[..., bool]) -> Callable[..., bool]:
    def _mesh_exist(self: Any, name: str, degree: int) -> bool:
        return original(self, name, degree) or (name == "pp" and pipelines_one_rank_v(self))

    return _mesh_exist


def install_one_rank_v() -> None:
    """torchtitan builds a pipeline only for ``pipeline_parallel_degree`` > 1 (``ParallelDims.pp_enabled``)
    and gives degree-1 dimensions a placeholder mesh without a process group. For a one-rank V
    (DualPipeV at degree 1: stages 0 and 1 on each rank) both say otherwise: the trainer takes its
    pipeline path (``pipeline_llm``, then our schedule), over a "pp" group of one rank. Every other
    config keeps torchtitan's answers. Idempotent."""
    from torchtitan.distributed.parallel_dims import ParallelDims

    if getattr(ParallelDims, "_titan_dualpipe_one_rank_v", False):
        return
    ParallelDims.pp_enabled = _make_pp_enabled(ParallelDims.pp_enabled.fget)
    ParallelDims._mesh_exist = _make_mesh_exist(ParallelDims._mesh_exist)
    ParallelDims._titan_dualpipe_one_rank_v = True


def schedule_class(name: str) -> type:
    from .. import ScheduleDualPipe, ScheduleDualPipeV

    return {"DualPipeV": ScheduleDualPipeV, "DualPipe": ScheduleDualPipe}[name]


TORCH_DUALPIPEV_NAME = "TorchDualPipeV"  # torch's own ScheduleDualPipeV, which "DualPipeV" no longer names


def make_get_schedule_class(original: Callable[[str], type]) -> Callable[[str], type]:
    def get_schedule_class(schedule_name: str) -> type:
        ours = our_schedule(schedule_name)
        if ours:
            return schedule_class(ours)
        if schedule_name.lower() == TORCH_DUALPIPEV_NAME.lower():
            return original("DualPipeV")
        return original(schedule_name)

    return get_schedule_class


def make_generate_fqns(original: Callable[..., list[list[str]]]) -> Callable[..., list[list[str]]]:
    def generate_llm_fqn_per_model_part(
        num_stages: int, num_layers: int, input_weight: int = 1, output_weight: int = 1
    ) -> list[list[str]]:
        plan = ACTIVE.plan
        if plan is not None and plan.schedule == "DualPipe" and num_stages == 2 * plan.pp:
            num_stages = plan.pp
        return original(num_stages, num_layers, input_weight, output_weight)

    return generate_llm_fqn_per_model_part


def make_module_split(original: Callable[..., tuple[list, list]]) -> Callable[..., tuple[list, list]]:
    def pipeline_module_split(
        whole_model: Any, pp_mesh: Any, pp_schedule: str, device: Any, module_names_per_stage: list[list[str]],
        **kwargs: Any,
    ) -> tuple[list, list]:
        ours = our_schedule(pp_schedule)
        if ours is None:
            return original(whole_model, pp_mesh, pp_schedule, device, module_names_per_stage, **kwargs)
        per_stage = stage_module_names(ours, pp_mesh.size(), module_names_per_stage)
        stages, models = original(whole_model, pp_mesh, V_STYLE_NAME, device, per_stage, **kwargs)
        ACTIVE.stages = stages
        # torchtitan parallelizes the parts next, then builds the schedule (which closes it)
        ACTIVE.fold_window.open = ours == "DualPipe"
        return stages, models

    return pipeline_module_split


def _twins_note(name: str, par: Any) -> str:
    """How DualPipe's twins are summed, for the schedule's log line ("" for other schedules)."""
    if name != "DualPipe":
        return ""
    if ACTIVE.folded:
        return ", twins folded into FSDP"
    backend = fold.exchange_backend(par)
    if fold.context_parallel(par) > 1:
        return ", twins summed by an exchange (context parallelism: folding them into FSDP is untested there)"
    if backend is None:
        return ", twins summed by an exchange"
    return (f", twins summed by an exchange (spmd_backend={backend}; with {fold.FOLDING_BACKEND} they are folded "
            "into FSDP)")


def stage_module_names(schedule: str, pp: int, parts: list[list[str]]) -> list[list[str]]:
    """Module names of stage ``0..2pp-1``, from the model parts of ``schedule``."""
    expected = pp if schedule == "DualPipe" else 2 * pp
    if len(parts) != expected:
        raise ValueError(
            f"{schedule} with pipeline_parallel_degree={pp} needs {expected} model parts, got {len(parts)} "
            "([parallelism] module_fqns_per_model_part)."
        )
    return [*parts, *parts] if schedule == "DualPipe" else list(parts)


def build_schedule(name: str, par: Any, local_batch_size: int, stages: list, loss_fn: Callable) -> Any:
    """Our class ``name`` for torchtitan's parallelism config, stages and loss."""
    from torchtitan.tools.logging import logger

    n = local_batch_size // par.pipeline_parallel_microbatch_size
    ACTIVE.fold_window.open = False
    # scale_grads=False: torchtitan divides the summed loss by the global token count itself.
    schedule = schedule_class(name)(stages, n_microbatches=n, loss_fn=loss_fn, scale_grads=False,
                                    overlap=ACTIVE.overlap, two_batch_overlap=two_batch_option(),
                                    pair_first=pair_first_option(), lone_pairs=lone_pairs_option(),
                                    **weight_gradient_options())
    # torchtitan's validator reads the losses only: no microbatch's logits outlive their loss
    schedule.eval = functools.partial(schedule.eval, return_outputs=False)
    ACTIVE.folded = bool(getattr(schedule, "fsdp_at_step_edges", False))
    if ACTIVE.fold_window.used and not ACTIVE.folded:
        raise RuntimeError("DualPipe: the model parts were sharded over twin pipeline ranks but the schedule does "
                           f"not see its twins folded into FSDP; set {fold.FOLD_ENV}=0 to sum them by an exchange")
    if ACTIVE.folded:  # stage s holds model part s % pp
        fold.init_parts_in_order({stage.stage_index % par.pipeline_parallel_degree: stage.submod for stage in stages})
    csv = par.pipeline_parallel_schedule_csv
    if csv:
        schedule._load_csv(csv)
    count_twins = _make_count_communicators(stages)
    check_exchange_chunks([stage.submod for stage in stages], ACTIVE.exchange_chunks, par.expert_parallel_degree)
    logger.info(
        f"Using titan_dualpipe {name} with {n} microbatches and {2 * par.pipeline_parallel_degree} stages"
        + (f" from {csv}" if csv else "") + ("" if ACTIVE.overlap else ", overlapped pairs run sequentially")
        + _twins_note(name, par) + _two_batch_note(schedule, par) + _pair_first_note(schedule)
        + _lone_pairs_note(schedule)
        + _weight_gradients_note(schedule)
        + _count_communicators_note(count_twins) + _exchange_chunks_note()
    )
    return schedule


def _make_count_communicators(stages: list) -> dict | None:
    """Under expert parallelism, the token-count exchange's own communicators, made here: every
    rank builds its schedule, before the first step (:mod:`titan_dualpipe.overlap.count_groups`).
    None where none are made: no expert parallelism, or ``TITAN_DUALPIPE_COUNT_GROUPS=0`` (the
    counts stay on the expert-parallel group's communicator)."""
    value = os.environ.get(COUNT_GROUPS_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{COUNT_GROUPS_ENV}={value!r}: use 1 (the default: the token counts on their own "
                         "communicator) or 0 (on the expert-parallel group's)")
    if not ACTIVE.expert_parallel or value == "0":
        return None
    from .expert_overlap import count_communicators

    return count_communicators([stage.submod for stage in stages])


def _count_communicators_note(twins: dict | None) -> str:
    if twins is None:
        return "; token counts exchanged on the expert-parallel group's communicator" if ACTIVE.expert_parallel else ""
    if not twins:
        return ""
    return f"; token counts exchanged on their own communicator (expert-parallel ranks {sorted(map(list, twins))})"


def _exchange_chunks_note() -> str:
    if ACTIVE.exchange_chunks == 1 or not ACTIVE.expert_parallel:
        return ""
    return f"; each MoE layer's token dispatch and combine run as {ACTIVE.exchange_chunks} exchanges (by groups of experts)"


def weight_gradient_options() -> dict[str, Any]:
    """Our schedules' ``weight_gradients`` and ``not_deferred``: the config's (0.3.0:
    ``--dualpipe.weight-gradients``, ``--dualpipe.not-deferred``; 0.2.2: the defaults), with
    ``TITAN_DUALPIPE_WEIGHT_GRADIENTS`` taking precedence and ``TITAN_DUALPIPE_NOT_DEFERRED``
    (comma-separated) adding names; ``TITAN_DUALPIPE_WEIGHT_GEMMS_IN_FLIGHT=0`` sets
    ``weight_gemms_in_flight=False``, ``=fill`` sets ``"fill"``."""
    from ..weights.policy import WEIGHT_GRADIENT_MODES

    mode = os.environ.get(WEIGHT_GRADIENTS_ENV, "") or ACTIVE.weight_gradients
    if mode not in WEIGHT_GRADIENT_MODES:
        where = f"{WEIGHT_GRADIENTS_ENV}={mode!r}" if os.environ.get(WEIGHT_GRADIENTS_ENV) else f"weight_gradients={mode!r}"
        raise ValueError(f"{where}: use one of {', '.join(WEIGHT_GRADIENT_MODES)} (deferred is the default)")
    extra = [name.strip() for name in os.environ.get(NOT_DEFERRED_ENV, "").split(",") if name.strip()]
    name = WEIGHT_GEMMS_IN_FLIGHT_ENV
    if not os.environ.get(name) and os.environ.get(OLD_WEIGHTS_IN_FLIGHT_ENV):
        warnings.warn(f"{OLD_WEIGHTS_IN_FLIGHT_ENV} is deprecated: set {WEIGHT_GEMMS_IN_FLIGHT_ENV}", DeprecationWarning,
                      stacklevel=2)
        name = OLD_WEIGHTS_IN_FLIGHT_ENV
    in_flight = os.environ.get(name, "") or "1"
    if in_flight not in ("0", "1", "fill"):
        raise ValueError(f"{name}={in_flight!r}: use 1 (a full backward's weight GEMMs run while "
                         "its exchanges fly, the default), fill (only those that fit before the awaited exchange "
                         "arrives) or 0 (inline)")
    return {"weight_gradients": mode, "not_deferred": [*ACTIVE.not_deferred, *extra],
            "weight_gemms_in_flight": {"0": False, "1": True}.get(in_flight, in_flight)}


def _weight_gradients_note(schedule: Any) -> str:
    from ..weights.policy import DEFERRING_MODES

    if schedule.weight_gradients not in DEFERRING_MODES:
        return f"; weight gradients: {schedule.weight_gradients}"
    # per rank: this rank's stages only (every rank logs its own line), each stage's count named
    per_stage = {stage: len(names) for stage, names in sorted(schedule.deferred_weights.items())}
    stages = ", ".join(f"stage {stage}: {count}" for stage, count in per_stage.items())
    least = schedule.least_weight_gemm_flops
    smaller = f", those under {least:,} FLOPs computed at I" if least else ""
    return (f"; on this rank {sum(per_stage.values())} weight GEMMs per microbatch wait for W "
            f"({stages}; deferred weight gradients{smaller})")


def two_batch_option() -> bool | str:
    """Our schedules' ``two_batch_overlap``: on when the config's switch is (0.3.0:
    ``--dualpipe.two-batch-overlap``, recorded in ``ACTIVE.two_batch``) or the environment has
    ``TITAN_DUALPIPE_TWO_BATCH=1`` (both releases; 0.2.2 has no config key): either turns it on,
    ``0`` does not turn the config's switch off. On, it splits the lone microbatches of the MoE stages;
    ``TITAN_DUALPIPE_TWO_BATCH=measured``, of those where the run's own times say it pays."""
    value = os.environ.get(TWO_BATCH_ENV, "")
    if value not in ("", "0", "1", "measured"):
        raise ValueError(f"{TWO_BATCH_ENV}={value!r}: use 1 (on), measured (on the stages where it pays, "
                         "timed on steps 2 to 5) or 0 (off, the default)")
    if value == "measured":
        return "measured"
    return ACTIVE.two_batch or value == "1"


def pair_first_option() -> str:
    """Our schedules' ``pair_first``: ``TITAN_DUALPIPE_PAIR_FIRST`` where set, else the config's
    (0.3.0: ``--dualpipe.pair-first``; 0.2.2: "forward")."""
    from ..runtime.pairs import PAIR_FIRST

    value = os.environ.get(PAIR_FIRST_ENV, "")
    if value and value not in PAIR_FIRST:
        raise ValueError(f"{PAIR_FIRST_ENV}={value!r}: use one of {', '.join(PAIR_FIRST)} (which half of a relayed "
                         "pair runs first; forward is the default)")
    return value or ACTIVE.pair_first


def lone_pairs_option() -> bool:
    """Our schedules' ``lone_pairs``: ``TITAN_DUALPIPE_LONE_PAIRS=1`` (both releases)."""
    value = os.environ.get(LONE_PAIRS_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{LONE_PAIRS_ENV}={value!r}: use 1 (adjacent lone actions of one direction run as "
                         "relayed pairs) or 0 (each alone, the default)")
    return value == "1"


def _lone_pairs_note(schedule: Any) -> str:
    return "; adjacent lone actions run as relayed pairs" if getattr(schedule, "lone_pairs", False) else ""


def _pair_first_note(schedule: Any) -> str:
    order = getattr(schedule, "pair_order", None)
    if order is None or order.mode == "forward":
        return ""
    if order.mode == "backward":
        return "; relayed pairs run their backward half first"
    if order.mode == "measured_first":
        return "; relayed pairs run first the half the second step measures to expose less, per kind of pair"
    return ("; relayed pairs run in the order the second step measures to expose least, per kind of pair "
            "(the half that starts, and where it hands over)")


def _two_batch_note(schedule: Any, par: Any) -> str:
    choice = getattr(schedule, "two_batch_choice", None)
    stages = sorted(choice.candidates if choice is not None else schedule.two_batch_stages)
    if not stages:
        return ""
    if par.pipeline_parallel_microbatch_size < 2:
        return (f"; two-batch overlap is on for stages {stages} but microbatches of 1 row run whole "
                "(pipeline_parallel_microbatch_size >= 2 splits them)")
    if choice is not None:
        return (f"; forwards without a pair partner on stages {stages} run whole on steps 2 and 4, as two "
                "sub-batches on steps 3 and 5, and from step 6 as two sub-batches where that was faster in both "
                "rounds (two-batch overlap, measured)")
    return f"; forwards without a pair partner run as two sub-batches (two-batch overlap) on stages {stages}"


def _scalar_loss(loss_fn: Callable) -> Callable:
    """0.3.0's loss functions return ``(loss, extra)``; schedules want the loss."""

    def loss(*args: Any, **kwargs: Any) -> Any:
        return loss_fn(*args, **kwargs)[0]

    return loss


def _startable_on_gloo(schedule: Any, stages: list) -> Any:
    """torch's own multi-stage schedules on gloo (CPU mode): torch 2.11 starts V schedules with
    messages from a rank to itself, which gloo rejects (see ``_compat.stage_init.runnable_on_gloo``)."""
    import torch.distributed as dist
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    from .._compat.stage_init import runnable_on_gloo

    if isinstance(schedule, PipelineScheduleMulti) and stages and dist.get_backend(stages[0].group) == "gloo":
        return runnable_on_gloo(schedule)
    return schedule


def make_build_schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    """0.2.2: ``build_pipeline_schedule(job_config, stages, loss_fn)``."""

    def build_pipeline_schedule(job_config: Any, stages: list, loss_fn: Callable) -> Any:
        par = job_config.parallelism
        ours = our_schedule(par.pipeline_parallel_schedule)
        if ours is None or (par.pipeline_parallel_degree <= 1 and not ACTIVE.one_rank_v):
            return _startable_on_gloo(original(job_config, stages, loss_fn), stages)
        return build_schedule(ours, par, job_config.training.local_batch_size, stages, loss_fn)

    return build_pipeline_schedule


def make_build_schedule_030(original: Callable[..., Any]) -> Callable[..., Any]:
    """0.3.0: ``_build_pipeline_schedule(*, parallelism, local_batch_size, stages, loss_fn, ...)``."""

    def _build_pipeline_schedule(*, parallelism: Any, local_batch_size: int, stages: list, loss_fn: Callable,
                                 **kwargs: Any) -> Any:
        ours = our_schedule(parallelism.pipeline_parallel_schedule)
        if ours is None or (parallelism.pipeline_parallel_degree <= 1 and not ACTIVE.one_rank_v):
            return _startable_on_gloo(original(parallelism=parallelism, local_batch_size=local_batch_size,
                                               stages=stages, loss_fn=loss_fn, **kwargs), stages)
        return build_schedule(ours, parallelism, local_batch_size, stages, _scalar_loss(loss_fn))

    return _build_pipeline_schedule


def make_dual_pipe_v_flag(original: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    def get_dual_pipe_v_flag(job_config: Any, parallel_dims: Any) -> bool:
        if our_schedule(job_config.parallelism.pipeline_parallel_schedule):
            return False
        return original(job_config, parallel_dims)

    get_dual_pipe_v_flag._titan_dualpipe = True  # type: ignore[attr-defined]
    return get_dual_pipe_v_flag


def patch_dual_pipe_v_flag(module: Any) -> None:
    """Replace ``module.get_dual_pipe_v_flag`` if it has one (idempotent)."""
    original = getattr(module, "get_dual_pipe_v_flag", None)
    if original is not None and not getattr(original, "_titan_dualpipe", False):
        module.get_dual_pipe_v_flag = make_dual_pipe_v_flag(original)


def install() -> None:
    """Replace the four names in torchtitan's pipeline module and the DualPipeV flag (idempotent)."""
    from torchtitan.distributed import pipeline_parallel as pp_mod

    fold.install(ACTIVE.fold_window)
    install_one_rank_v()
    if not GEN.registry:
        from torchtitan.distributed import dual_pipe_v

        patch_dual_pipe_v_flag(dual_pipe_v)
    if getattr(pp_mod, "_titan_dualpipe_installed", False):
        return
    build = make_build_schedule_030 if GEN.registry else make_build_schedule
    pp_mod.get_schedule_class = make_get_schedule_class(pp_mod.get_schedule_class)
    for name, make in ((GEN.fqn_fn, make_generate_fqns), (GEN.split_fn, make_module_split), (GEN.build_fn, build)):
        setattr(pp_mod, name, make(getattr(pp_mod, name)))
    pp_mod._titan_dualpipe_installed = True
