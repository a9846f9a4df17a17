"""The shipped configs and our config check, in this process: every config loads and passes; the
GPU configs fit the world they are written for; a config our schedules cannot run is refused naming
its keys, before any collective; an untested torchtitan is refused by name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cases.titan_runs import COMPILE, CONFIGS, MEMORY_BUDGET_AC, REGISTRY, ROOT, TORCHTITAN, job_config, key

REGISTRY_FILE = ROOT / "titan_dualpipe" / "titan" / "config_registry.py"
SHIPPED = ("debug_dualpipe", "debug_dualpipev", "debug_moe_dualpipe", "deepseek_v3_16b_dualpipe", "llama3_8b_dualpipev")


def test_both_torchtitan_generations_ship_the_same_configs() -> None:
    """0.2.2 TOMLs and 0.3.0 config functions, one of each per name (read without importing either)."""
    tree = ast.parse(REGISTRY_FILE.read_text())
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}
    assert {p.stem for p in CONFIGS.glob("*.toml")} == functions == set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_train_configs_load_and_validate(name: str) -> None:
    import titan_dualpipe.titan as adapter
    from titan_dualpipe.titan.data import DATASET_NAME, TOKENIZER_DIR, resolve_asset_path

    job = job_config(name)
    plan = adapter.check_job_config(job, adapter.GEN.n_layers(job))
    assert plan is not None and plan.schedule == adapter.our_schedule(job.parallelism.pipeline_parallel_schedule)
    assert job.checkpoint.last_save_model_only is False  # the last checkpoint can be resumed from
    if REGISTRY:
        assert job.dualpipe.overlap is True and job.training.disable_cuda_graphs
        dataset, tokenizer = job.dataloader.dataset, job.hf_assets_path
    else:
        assert job.experimental.custom_import == "titan_dualpipe.titan"
        dataset, tokenizer = job.training.dataset, resolve_asset_path(job.model.hf_assets_path)
    if name.startswith("debug_"):  # shipped data only
        assert dataset == DATASET_NAME and Path(tokenizer).resolve() == TOKENIZER_DIR


GPU_CONFIGS = {  # config -> the world it is written for (docs/torchtitan.md's launch commands)
    "llama3_8b_dualpipev": {"world": 8, "pp": 4, "dp_shard": 2, "ep": 1, "stages": 8,
                            "compile": (False, ["model", "loss"])},  # torchtitan's compile settings, kept
    "deepseek_v3_16b_dualpipe": {"world": 16, "pp": 4, "dp_shard": 4, "ep": 4, "stages": 8,
                                 "compile": (True, ["loss"])},
}


def _parallel_dims_and_experts(job, world: int) -> tuple:
    """torchtitan's parallel dims of ``job`` on ``world`` processes, and the model's expert count (or None)."""
    from torchtitan.distributed import ParallelDims

    par = job.parallelism
    if REGISTRY:
        from torchtitan.models.common.moe import GroupedExperts

        experts = [cfg.num_experts for _, cfg, _, _ in job.model_spec.model.traverse(GroupedExperts.Config)]
        return ParallelDims.from_config(par, world), (experts[0] if experts else None)
    from torchtitan.protocols.train_spec import get_train_spec

    dims = ParallelDims(dp_shard=par.data_parallel_shard_degree, dp_replicate=par.data_parallel_replicate_degree,
                        cp=par.context_parallel_degree, tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
                        ep=par.expert_parallel_degree, etp=par.expert_tensor_parallel_degree, world_size=world)
    moe = getattr(get_train_spec(job.model.name).model_args[job.model.flavor], "moe_args", None)
    return dims, (moe.num_experts if moe is not None else None)


@pytest.mark.parametrize("name", sorted(GPU_CONFIGS))
def test_gpu_configs_fit_the_world_they_declare(name: str) -> None:
    """The GPU starting points, through torchtitan's parser, its parallel-dims validation for
    their world size, the model flavour's layers and experts, and our config checks."""
    import titan_dualpipe.titan as adapter

    expected = GPU_CONFIGS[name]
    job = job_config(name)
    dims, experts = _parallel_dims_and_experts(job, expected["world"])
    assert (dims.pp, dims.dp_shard, dims.ep) == (expected["pp"], expected["dp_shard"], expected["ep"])
    plan = adapter.check_job_config(job, adapter.GEN.n_layers(job))
    assert plan is not None and 2 * plan.pp == expected["stages"] and plan.n_microbatches >= 2 * plan.pp
    if dims.ep > 1:
        assert experts is not None and experts % dims.ep == 0
        assert (dims.dp_shard * dims.cp) % dims.ep == 0, "torchtitan shards experts inside the FSDP x CP group"
    assert (job.compile.enable, list(job.compile.components)) == expected["compile"]
    ac = job.activation_checkpoint
    assert ac is not None if REGISTRY else ac.mode in ("selective", "full")


@pytest.mark.parametrize(
    "overrides, keys",
    [
        (["--parallelism.pipeline_parallel_degree", "3"], [key("parallelism.pipeline_parallel_degree"), "got 3", "2 or 4"]),
        (["--training.local_batch_size", "6", "--parallelism.pipeline_parallel_microbatch_size", "2"],
         ["microbatches", key("training.local_batch_size"), "pipeline_parallel_microbatch_size"]),
        pytest.param(
            ["--training.local_batch_size", "7", "--parallelism.pipeline_parallel_microbatch_size", "2"],
            [key("training.local_batch_size") + " = 7", key("parallelism.pipeline_parallel_microbatch_size") + " = 2"],
            marks=pytest.mark.skipif(REGISTRY, reason="0.3.0's own config check refuses it first, naming both"),
        ),
        (["--parallelism.pipeline_parallel_layers_per_stage", "2"],
         [key("parallelism.pipeline_parallel_layers_per_stage") + " = 2", "remove it"]),
        (["--parallelism.pipeline_parallel_degree", "10", "--training.local_batch_size", "20"],
         [key("parallelism.pipeline_parallel_degree") + " = 10", "pipeline_parallel_first_stage_less_layers"]),
        pytest.param(
            ["--validation.enable", "--validation.local_batch_size", "12"],
            [key("validation.local_batch_size") + " = 12", "8 microbatches", "Set it to 8"],
            marks=pytest.mark.skipif(REGISTRY, reason="0.3.0 validates with the training batch"),
        ),
        pytest.param(
            ["--compile.components", "model,loss", *MEMORY_BUDGET_AC[0]],
            [MEMORY_BUDGET_AC[1], "needs the model compiled", key("compile.enable") + " = true",
             '"model" in ' + key("compile.components"), *MEMORY_BUDGET_AC[2]],
            marks=pytest.mark.skipif(REGISTRY, reason="0.3.0's own config refuses it first, naming --compile.enable"),
        ),
    ],
    ids=["odd-pp", "too-few-microbatches", "batch-not-multiple", "layers-per-stage", "too-many-parts", "validation-batch",
         "memory-budget-ac-uncompiled"],
)
def test_bad_dualpipe_configs_name_the_keys(overrides: list[str], keys: list[str]) -> None:
    from titan_dualpipe.titan import check_job_config

    with pytest.raises(ValueError) as err:
        check_job_config(job_config("debug_dualpipe", *overrides), n_layers=6)
    for expected in keys:
        assert expected in str(err.value)


@pytest.mark.parametrize("name", ["debug_dualpipev", "debug_dualpipe"])
def test_compiled_model_and_memory_budget_ac_pass_the_config_check(name: str) -> None:
    """Compiled blocks run under both schedules (their backward whole at I), memory-budget AC with them."""
    from titan_dualpipe.titan import check_job_config

    for overrides in (COMPILE, (*COMPILE, *MEMORY_BUDGET_AC[0])):
        job = job_config(name, *overrides)
        assert job.compile.enable and "model" in job.compile.components
        assert check_job_config(job, n_layers=6) is not None


@pytest.mark.skipif(REGISTRY, reason="0.3.0: CPU mode computes flex attention with plain tensor ops")
def test_flex_attention_on_cpu_is_refused_naming_the_flavour_and_torch() -> None:
    """torch's flex attention has no backward on CPU, compiled or not: refused before any collective."""
    import torch

    from titan_dualpipe.titan.config_check import check_cpu_attention, check_job_config

    job = job_config("debug_dualpipev", "--model.flavor", "debugmodel_flex_attn", *COMPILE)
    plan = check_job_config(job, n_layers=6)
    with pytest.raises(ValueError) as err:
        check_cpu_attention(plan, job)
    for expected in ("'debugmodel_flex_attn'", "no backward on CPU", torch.__version__.split("+")[0], '"debugmodel"'):
        assert expected in str(err.value)
    check_cpu_attention(plan, job_config("debug_dualpipev", *COMPILE))  # sdpa: passes


def test_0_3_0_refuses_a_batch_that_is_no_multiple_of_the_microbatch(capfd: pytest.CaptureFixture) -> None:
    """0.3.0's own config check names both fields; its parser then exits like any parse error."""
    if not REGISTRY:
        pytest.skip("0.2.2: our check names it (test_bad_dualpipe_configs_name_the_keys)")
    with pytest.raises(SystemExit):
        job_config("debug_dualpipe", "--training.local_batch_size", "7", "--parallelism.pipeline_parallel_microbatch_size", "2")
    printed = " ".join(capfd.readouterr().err.split())
    assert "training.local_batch_size (7)" in printed and "microbatch_size (2)" in printed, printed


def test_bad_dualpipev_stage_counts_name_the_keys(tmp_path: Path) -> None:
    from titan_dualpipe.titan import check_job_config

    job = job_config("debug_dualpipev", "--parallelism.pipeline_parallel_layers_per_stage", "4")
    with pytest.raises(ValueError, match=r"pipeline_parallel_layers_per_stage = 4 .* into 2: .*set it to 2"):
        check_job_config(job, n_layers=6)  # (6 layers + 2) / 4 = 2 stages; DualPipeV needs 4
    job = job_config("debug_dualpipev")
    job.parallelism.module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    with pytest.raises(ValueError, match=r"needs 4 model parts .*module_fqns_per_model_part lists 2"):
        check_job_config(job, n_layers=6)
    csv = tmp_path / "pp4.csv"
    from titan_dualpipe import compute_order
    from titan_dualpipe.orders.csv_io import write_csv

    with csv.open("w", newline="") as f:
        write_csv(compute_order("DualPipeV", 4, 8), f)
    with pytest.raises(ValueError, match=r"4 rows .*pipeline_parallel_degree = 2.*titan-dualpipe csv"):
        check_job_config(job_config("debug_dualpipev", f"--parallelism.pipeline_parallel_schedule_csv={csv}"), n_layers=6)


def test_untested_torchtitan_is_refused_by_name() -> None:
    from titan_dualpipe.titan import TORCHTITAN_VERSION, check_torchtitan_version

    assert TORCHTITAN_VERSION == TORCHTITAN in ("0.2.2", "0.3.0")
    with pytest.raises(ImportError, match=r"supports torchtitan 0.2.2 and 0.3.0; found torchtitan 0.1.0"):
        check_torchtitan_version("0.1.0")
    with pytest.raises(ImportError, match=r"tested with torchtitan 0.3.0 on torch 2.14 to 2.15; found torch 2.13.0"):
        check_torchtitan_version("0.3.0", torch="2.13.0+cpu")
    with pytest.raises(ImportError, match=r"tested with torchtitan 0.2.2 on torch 2.11 to 2.14; found torch 2.15.0"):
        check_torchtitan_version("0.2.2", torch="2.15.0")
    assert check_torchtitan_version("0.2.2", torch="2.11.0") == "0.2.2"
    assert check_torchtitan_version("0.3.0", torch="2.15.0+cu132") == "0.3.0"
