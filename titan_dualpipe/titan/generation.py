"""What differs between the torchtitan releases this adapter supports, in one place.

0.2.2 reads TOML files and loads us through ``[experimental] custom_import``; 0.3.0 builds its
config with a ``config_registry`` function (``--module M --config NAME``) and loads us when
that module imports ours. Beyond that the adapter's patches are the same code on both; what
they need to know about the installed release (module paths, private names, config field
names) is :data:`GEN`, chosen at import from the installed torchtitan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..torchtitan_version import check_torchtitan_version


@dataclass(frozen=True)
class Generation:
    release: str
    registry: bool  # True: configs are config_registry functions (0.3.0); False: TOMLs (0.2.2)
    trainer_module: str  # where the Trainer class is defined
    # torchtitan.distributed.pipeline_parallel functions we wrap, by role
    split_fn: str
    fqn_fn: str
    build_fn: str
    # modules that copy tools.utils.device_type / device_module at import
    device_type_modules: tuple[str, ...]
    device_module_modules: tuple[str, ...]
    # modules whose FSDP setup calls their global disable_fsdp_gradient_division
    fsdp_division_modules: tuple[str, ...]
    expert_count_buffer: str  # MoE per-expert token count buffer
    experts_module: str  # where GroupedExperts (the routed experts' weights and GEMMs) is defined
    asset_paths: tuple[str, ...]  # dotted config fields that may point at shipped assets

    def key(self, dotted: str) -> str:
        """How errors name config field ``section.field``: TOML form on 0.2.2, CLI form on 0.3.0."""
        if self.registry:
            return dotted
        section, _, name = dotted.partition(".")
        return f"[{section}] {name}"

    def trainer_config(self, trainer: Any) -> Any:
        """The config a ``Trainer`` runs: ``job_config`` (0.2.2), ``config`` (0.3.0)."""
        return trainer.config if self.registry else trainer.job_config

    def overlap(self, config: Any) -> bool:
        """Our schedules' ``overlap`` switch: torchtitan's EP-overlap key (0.2.2), ours (0.3.0)."""
        if self.registry:
            return getattr(getattr(config, "dualpipe", None), "overlap", True)
        return config.parallelism.pipeline_parallel_expert_parallel_overlap

    def two_batch_overlap(self, config: Any) -> bool:
        """The config's two-batch overlap switch: ours, ``dualpipe.two_batch_overlap`` (0.3.0; false
        without the section); 0.2.2 has no key for it (false: the environment alone decides,
        :func:`.pipeline.two_batch_option`)."""
        if self.registry:
            return getattr(getattr(config, "dualpipe", None), "two_batch_overlap", False)
        return False

    def weight_gradients(self, config: Any) -> tuple[str, list[str]]:
        """The config's ``dualpipe.weight_gradients`` and ``dualpipe.not_deferred`` (0.3.0; 0.2.2
        has no keys: the defaults, which the environment may override, :func:`.pipeline.weight_gradient_options`)."""
        options = getattr(config, "dualpipe", None) if self.registry else None
        return getattr(options, "weight_gradients", "deferred"), list(getattr(options, "not_deferred", []))

    def pair_first(self, config: Any) -> str:
        """The config's ``dualpipe.pair_first`` (0.3.0; 0.2.2 has no key: the default, which the
        environment may override, :func:`.pipeline.pair_first_option`)."""
        options = getattr(config, "dualpipe", None) if self.registry else None
        return getattr(options, "pair_first", "forward")

    def n_layers(self, config: Any) -> int | None:
        """The model's transformer layer count, as torchtitan's pipeline split counts it."""
        if self.registry:
            layers = getattr(config.model_spec.model, "layers", None)
            return None if layers is None else len(layers)
        from torchtitan.protocols.train_spec import get_train_spec

        args = get_train_spec(config.model.name).model_args.get(config.model.flavor)
        return getattr(args, "n_layers", None)


_DEVICE_TYPE = ("torchtitan.tools.utils", "torchtitan.components.metrics", "torchtitan.distributed.parallel_dims",
                "torchtitan.distributed.utils")
_DEVICE_MODULE = ("torchtitan.tools.utils", "torchtitan.components.metrics", "torchtitan.distributed.utils")
_CSV_PATH = "parallelism.pipeline_parallel_schedule_csv"

GENERATIONS = {
    "0.2.2": Generation(
        release="0.2.2",
        registry=False,
        trainer_module="torchtitan.train",
        split_fn="pipeline_module_split",
        fqn_fn="generate_llm_fqn_per_model_part",
        build_fn="build_pipeline_schedule",
        device_type_modules=_DEVICE_TYPE,
        device_module_modules=(*_DEVICE_MODULE, "torchtitan.tools.profiling"),
        # llama3's own apply_fsdp; llama4's, which deepseek_v3, qwen3 and gpt_oss use
        fsdp_division_modules=("torchtitan.models.llama3.infra.parallelize",
                               "torchtitan.models.llama4.infra.parallelize"),
        expert_count_buffer="tokens_per_expert",
        experts_module="torchtitan.models.moe.moe",
        asset_paths=("model.hf_assets_path", "model.tokenizer_path", "training.dataset_path",
                     "validation.dataset_path", _CSV_PATH),
    ),
    "0.3.0": Generation(
        release="0.3.0",
        registry=True,
        trainer_module="torchtitan.trainer",
        split_fn="_pipeline_module_split",
        fqn_fn="_generate_llm_fqn_per_model_part",
        build_fn="_build_pipeline_schedule",
        device_type_modules=(*_DEVICE_TYPE, "torchtitan.models.common.token_dispatcher"),
        device_module_modules=(*_DEVICE_MODULE, "torchtitan.tools.profiler",
                               "torchtitan.models.common.token_dispatcher"),
        fsdp_division_modules=("torchtitan.distributed.fsdp",),
        expert_count_buffer="tokens_per_expert_E",
        experts_module="torchtitan.models.common.moe",
        asset_paths=("hf_assets_path", "dataloader.dataset_path", "validator.dataloader.dataset_path", _CSV_PATH),
    ),
}

GEN = GENERATIONS[check_torchtitan_version()]
