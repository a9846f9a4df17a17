"""Check a torchtitan job config that names one of our schedules, before any collective.

Every rank reads the same config and overrides, so every rank reaches the same verdict and
raises the same ``ValueError`` before ``init_process_group``: a bad config stops the whole
job at once instead of leaving some ranks waiting in a collective. Messages name the fields
the way the installed torchtitan spells them: ``[parallelism] pipeline_parallel_degree`` in a
0.2.2 TOML, ``parallelism.pipeline_parallel_degree`` (``--parallelism.pipeline_parallel_degree``)
in 0.3.0.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from ..orders.placement import canonical_name, check_requirements
from .generation import GEN

SCHEDULE_KEY = GEN.key("parallelism.pipeline_parallel_schedule")
DEGREE_KEY = GEN.key("parallelism.pipeline_parallel_degree")
BATCH_KEY = GEN.key("training.local_batch_size")
MICROBATCH_KEY = GEN.key("parallelism.pipeline_parallel_microbatch_size")
LAYERS_PER_STAGE_KEY = GEN.key("parallelism.pipeline_parallel_layers_per_stage")
FQNS_KEY = GEN.key("parallelism.module_fqns_per_model_part")
CSV_KEY = GEN.key("parallelism.pipeline_parallel_schedule_csv")
FIRST_LESS_KEY = GEN.key("parallelism.pipeline_parallel_first_stage_less_layers")
LAST_LESS_KEY = GEN.key("parallelism.pipeline_parallel_last_stage_less_layers")
VALIDATION_BATCH_KEY = GEN.key("validation.local_batch_size")  # 0.2.2; 0.3.0 validates with the training batch
COMPILE_KEY = GEN.key("compile.enable")
COMPONENTS_KEY = GEN.key("compile.components")
AC_MODE_KEY = GEN.key("activation_checkpoint.mode")


@dataclass(frozen=True)
class Plan:
    """What a valid config asks of our schedule."""

    schedule: str  # "DualPipeV" or "DualPipe"
    pp: int
    n_microbatches: int

    @property
    def model_parts(self) -> int:
        """DualPipeV splits the model into 2*pp parts; DualPipe into pp parts, each held twice."""
        return self.pp if self.schedule == "DualPipe" else 2 * self.pp


def our_schedule(name: str | None) -> str | None:
    """Canonical name if ``name`` (any case) is one of ours, else None."""
    try:
        return canonical_name(name) if name else None
    except ValueError:
        return None


def check_job_config(job_config: Any, n_layers: int | None = None) -> Plan | None:
    """The plan for our schedule, None for any other schedule (and for DualPipe at
    ``pipeline_parallel_degree`` 1, which torchtitan runs without a pipeline); ValueError for a bad
    config. DualPipeV at degree 1 gets a plan: its two stages on one rank.

    ``n_layers``: the model's layer count, for the stage-split checks (skipped when None).
    """
    par = job_config.parallelism
    schedule = our_schedule(par.pipeline_parallel_schedule)
    if schedule is None or (par.pipeline_parallel_degree <= 1 and schedule != "DualPipeV"):
        return None  # torchtitan does not pipeline; DualPipeV at degree 1 is a V on one rank (titan.pipeline)
    pp = par.pipeline_parallel_degree
    plan = Plan(schedule, pp, _microbatches(job_config, schedule))
    _check_schedule_requirements(plan, job_config)
    _check_validation_batch(plan, job_config)
    _check_split(plan, par, n_layers)
    _check_activation_checkpoint(plan, job_config)
    if par.pipeline_parallel_schedule_csv:
        _check_csv(plan, par.pipeline_parallel_schedule_csv)
    return plan


def model_compiled(job_config: Any) -> bool:
    """torchtitan compiles the model (each transformer block, ``apply_compile``) when compile is
    on with ``"model"`` among its components; the loss alone is compiled outside the stages."""
    compile_cfg = getattr(job_config, "compile", None)
    return bool(compile_cfg is not None and compile_cfg.enable and "model" in compile_cfg.components)


def check_cpu_attention(plan: Plan, job_config: Any) -> None:
    """For CPU mode (no accelerator): torch's flex attention has no backward on CPU
    ("FlexAttention does not support backward on CPU"; seen on torch 2.13 and 2.14), compiled or not, so a
    0.2.2 model flavour that attends with it would stop in its first backward, after the
    pipeline's first exchanges; refused before them. CPU mode computes 0.3.0's flex attention
    with plain tensor ops instead (``cpu_attention``)."""
    if GEN.registry:
        return
    from torchtitan.protocols.train_spec import get_train_spec

    model = job_config.model
    args = get_train_spec(model.name).model_args.get(model.flavor)
    if getattr(args, "attn_type", None) != "flex" and not getattr(args, "use_flex_attn", False):
        return
    raise ValueError(
        f"{plan.schedule}: [model] flavor = {model.flavor!r} of {model.name!r} attends with torch's flex attention, "
        f"which has no backward on CPU (torch {_torch_version()}, torchtitan {GEN.release}; compiled or not): "
        "on a machine without an accelerator pick a flavour with sdpa attention (such as \"debugmodel\"), "
        "or train on GPUs."
    )


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def _check_activation_checkpoint(plan: Plan, job_config: Any) -> None:
    """Every AC mode runs (weight GEMMs deferred to W; compiled stages run their backward whole
    at I, see ``weights/plan.py``). Memory-budget AC is torch.compile's partitioner
    choosing what to recompute inside the compiled blocks, so it needs the model compiled: 0.3.0's
    config refuses it otherwise, 0.2.2 asserts while building the model; here it stops first, naming the fix."""
    ac = getattr(job_config, "activation_checkpoint", None)
    if getattr(ac, "mode", None) != "memory_budget" and type(ac).__qualname__ != "MemoryBudgetAC.Config":
        return
    if model_compiled(job_config):
        return
    if GEN.registry:  # 0.3.0: a config class, picked on the command line by a subcommand
        chosen, fix = ("activation_checkpoint = MemoryBudgetAC.Config() (activation-checkpoint:memory-budget)",
                       "use SelectiveAC.Config() or FullAC.Config() (activation-checkpoint:selective or "
                       "activation-checkpoint:full)")
    else:
        chosen, fix = (f'{AC_MODE_KEY} = "memory_budget"',
                       f'set {AC_MODE_KEY} = "selective" (selective_ac_option = "op", or a layer frequency such '
                       'as "2") or "full"')
    raise ValueError(
        f"{plan.schedule}: {chosen} lets torch.compile choose what to recompute inside the compiled blocks, so it "
        f'needs the model compiled: set {COMPILE_KEY} = true with "model" in {COMPONENTS_KEY}, or {fix}.'
    )


def _microbatches(job_config: Any, schedule: str) -> int:
    batch = job_config.training.local_batch_size
    micro = job_config.parallelism.pipeline_parallel_microbatch_size
    if micro < 1 or batch % micro:
        raise ValueError(
            f"{schedule}: {BATCH_KEY} = {batch} is not a multiple of {MICROBATCH_KEY} = {micro}; "
            "set local_batch_size to a multiple of pipeline_parallel_microbatch_size."
        )
    return batch // micro


def _check_schedule_requirements(plan: Plan, job_config: Any) -> None:
    pp, n, name = plan.pp, plan.n_microbatches, plan.schedule
    batch = job_config.training.local_batch_size
    micro = job_config.parallelism.pipeline_parallel_microbatch_size
    microbatch_keys = f"(microbatches = {BATCH_KEY} / {MICROBATCH_KEY} = {batch} / {micro})"
    if name == "DualPipe" and pp % 2:
        raise ValueError(
            f"DualPipe needs an even {DEGREE_KEY}, got {pp}: set it to {max(pp - 1, 2)} or {pp + 1}, "
            f'or set {SCHEDULE_KEY} = "DualPipeV", which runs on any pipeline degree.'
        )
    if name == "DualPipe" and n % 2:
        raise ValueError(
            f"DualPipe needs an even number of microbatches (half enter at each end), got {n} "
            f"{microbatch_keys}: set local_batch_size to {(n + 1) * micro}."
        )
    if n < 2 * pp:
        raise ValueError(
            f"{name} needs at least 2 * {DEGREE_KEY} = {2 * pp} microbatches, got {n} {microbatch_keys}: "
            f"raise local_batch_size to {2 * pp * micro} or more, lower pipeline_parallel_microbatch_size, "
            "or lower pipeline_parallel_degree."
        )
    check_requirements(name, pp, n)  # the schedule's own rules; the checks above name the keys


def _check_validation_batch(plan: Plan, job_config: Any) -> None:
    """Validation runs the same schedule (``eval()``), so its batch splits into the same microbatch count."""
    validation = getattr(job_config, "validation", None)
    if validation is None or not validation.enable:
        return
    batch, n = validation.local_batch_size, plan.n_microbatches
    if batch < n or batch % n:
        raise ValueError(
            f"{plan.schedule}: {VALIDATION_BATCH_KEY} = {batch} must be a multiple of the {n} microbatches "
            f"({BATCH_KEY} / {MICROBATCH_KEY}): validation runs the same pipeline schedule. "
            f"Set it to {max(n, batch // n * n)}."
        )


def _check_split(plan: Plan, par: Any, n_layers: int | None) -> None:
    parts, name = plan.model_parts, plan.schedule
    what = f"{parts} model parts ({'pipeline_parallel_degree' if name == 'DualPipe' else '2 * pipeline_parallel_degree'})"
    fqns = par.module_fqns_per_model_part
    if fqns is not None:
        if len(fqns) != parts:
            raise ValueError(
                f"{name} with {DEGREE_KEY} = {plan.pp} needs {what}, but {FQNS_KEY} lists {len(fqns)}: "
                f"give exactly {parts} lists of module names."
            )
        return
    lps = par.pipeline_parallel_layers_per_stage
    if lps is not None and name == "DualPipe":
        raise ValueError(
            f"DualPipe splits the model into {DEGREE_KEY} = {plan.pp} parts, each held by two ranks; "
            f"{LAYERS_PER_STAGE_KEY} = {lps} does not apply: remove it (or list the parts in {FQNS_KEY})."
        )
    if n_layers is None:
        return
    first, last = par.pipeline_parallel_first_stage_less_layers, par.pipeline_parallel_last_stage_less_layers
    if lps is not None:
        effective = n_layers + first + last
        stages = math.ceil(effective / lps)
        if stages != parts:
            fitting = [v for v in range(1, effective + 1) if math.ceil(effective / v) == parts]
            fix = f"remove it or set it to {fitting[0]}" if fitting else "remove it"
            raise ValueError(
                f"{name} needs {what}, but {LAYERS_PER_STAGE_KEY} = {lps} cuts the {n_layers}-layer model "
                f"(+{first}+{last} for embeddings and output) into {stages}: {fix}."
            )
        return
    _check_generated_split(plan, n_layers, first, last, what)


def _check_generated_split(plan: Plan, n_layers: int, first: int, last: int, what: str) -> None:
    from torchtitan.distributed import pipeline_parallel

    try:
        getattr(pipeline_parallel, GEN.fqn_fn)(plan.model_parts, n_layers, first, last)
    except ValueError as err:
        raise ValueError(
            f"{plan.schedule} with {DEGREE_KEY} = {plan.pp} needs {what} of a {n_layers}-layer model: "
            f"{str(err).rstrip('.')}. Lower pipeline_parallel_degree, lower {FIRST_LESS_KEY} / {LAST_LESS_KEY}, "
            f"or list the parts in {FQNS_KEY}."
        ) from None


def _check_csv(plan: Plan, path: str) -> None:
    """The CSV must be an order for this schedule, pipeline degree and microbatch count."""
    from ..orders.csv_io import load_csv

    if not os.path.isfile(path):
        raise ValueError(f"{CSV_KEY} = {path!r} is not a file (relative paths start at the working directory).")
    try:
        order = load_csv(path)
    except Exception as err:  # noqa: BLE001 - any parse failure is a bad file
        raise ValueError(f"{CSV_KEY} = {path!r} is not a torch pipelining CSV: {err}") from None
    ranks = len(order)
    compute = [a for acts in order.values() for a in acts if a is not None]
    leaves = [sub for a in compute for sub in (a.sub_actions or (a,))]
    stages = {a.stage_index for a in leaves}
    mbs = {a.microbatch_index for a in leaves if a.microbatch_index is not None}
    misplaced = sorted(
        {(rank, sub.stage_index) for rank, acts in order.items() for a in acts if a is not None
         for sub in (a.sub_actions or (a,)) if sub.stage_index not in (rank, 2 * plan.pp - 1 - rank)}
    )
    problem = ""
    if ranks != plan.pp:
        problem = f"it has {ranks} rows (ranks), {DEGREE_KEY} = {plan.pp}"
    elif mbs and max(mbs) + 1 != plan.n_microbatches:
        problem = f"it covers {max(mbs) + 1} microbatches, the config has {plan.n_microbatches} ({BATCH_KEY} / {MICROBATCH_KEY})"
    elif stages - set(range(2 * plan.pp)):
        problem = f"it uses stage ids {sorted(stages)}, {plan.schedule} with pp={plan.pp} has 0..{2 * plan.pp - 1}"
    elif misplaced:
        problem = f"(rank, stage) pairs {misplaced[:4]} break the V placement (rank r runs stages r and 2*pp-1-r)"
    if problem:
        raise ValueError(
            f"{CSV_KEY} = {path!r} does not fit this config: {problem}. Write a matching one with "
            f"`titan-dualpipe csv --schedule {plan.schedule} --pp {plan.pp} --microbatches {plan.n_microbatches} -o FILE`."
        )
