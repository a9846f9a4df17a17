"""torchtitan 0.3.0 configs with DualPipe / DualPipeV (the 0.2.2 TOMLs in ``train_configs/``, as functions).

    torchrun --standalone --nproc-per-node 2 -m torchtitan.train \\
        --module titan_dualpipe.titan --config debug_dualpipev
    titan-dualpipe train debug_dualpipev --nproc 2                 # the same, any override after it

torchtitan imports this module for ``--module titan_dualpipe.titan``; importing it (through the
package) registers our schedules. Each function starts from torchtitan's own config for the
model and changes what the 0.2.2 TOML of the same name sets. The debug configs read only files
shipped with the package (tokenizer and ``titan_dualpipe_tiny`` corpus).
"""

from __future__ import annotations

from torchtitan.components.validate import Validator
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3
from torchtitan.models.llama3 import config_registry as llama3

from . import data
from .trainer_config import DualPipeTrainer, with_dualpipe


def _pipeline(config: DualPipeTrainer.Config, schedule: str, pp: int, batch: int, seq_len: int,
              steps: int) -> DualPipeTrainer.Config:
    """``batch`` microbatches of one sample each on ``pp`` pipeline ranks."""
    config.parallelism.pipeline_parallel_degree = pp
    config.parallelism.pipeline_parallel_schedule = schedule
    config.parallelism.pipeline_parallel_microbatch_size = 1
    config.training.local_batch_size = batch
    config.training.seq_len = seq_len
    config.training.steps = steps
    config.training.max_norm = 1.0
    config.training.disable_cuda_graphs = True  # torchtitan: CUDA graphs do not support PP
    config.checkpoint.last_save_model_only = False  # the last checkpoint can be resumed from
    return config


def _debug(config: DualPipeTrainer.Config, name: str) -> DualPipeTrainer.Config:
    """Shipped tokenizer and corpus, no activation checkpointing, fixed seed; validation off."""
    config.dump_folder = f"./outputs/{name}"
    config.hf_assets_path = str(data.TOKENIZER_DIR)
    config.dataloader = HuggingFaceTextDataLoader.Config(dataset=data.DATASET_NAME)
    config.validator = Validator.Config(
        enable=False, freq=5, steps=2, dataloader=HuggingFaceTextDataLoader.Config(dataset=data.DATASET_NAME)
    )
    config.activation_checkpoint = None
    config.metrics.log_freq = 1
    config.lr_scheduler.warmup_steps = 2
    config.checkpoint.interval = 5
    config.debug.seed = 42
    return config


def debug_dualpipev() -> DualPipeTrainer.Config:
    """llama3 debugmodel, DualPipeV pp=2 (4 stages), 8 microbatches of 128 tokens, 10 steps."""
    config = with_dualpipe(llama3.llama3_debugmodel())
    return _debug(_pipeline(config, "DualPipeV", pp=2, batch=8, seq_len=128, steps=10), "debug_dualpipev")


def debug_dualpipe() -> DualPipeTrainer.Config:
    """llama3 debugmodel, DualPipe pp=2 (2 parts, each held twice), 8 microbatches of 128 tokens."""
    config = with_dualpipe(llama3.llama3_debugmodel())
    return _debug(_pipeline(config, "DualPipe", pp=2, batch=8, seq_len=128, steps=10), "debug_dualpipe")


def debug_moe_dualpipe() -> DualPipeTrainer.Config:
    """deepseek_v3 debugmodel (MoE), DualPipe pp=2 x expert parallel 2 on 4 processes."""
    config = with_dualpipe(deepseek_v3.deepseek_v3_debugmodel())
    config = _debug(_pipeline(config, "DualPipe", pp=2, batch=4, seq_len=64, steps=10), "debug_moe_dualpipe")
    config.parallelism.data_parallel_shard_degree = -1  # the rest of the processes: 4 / 2 = 2
    config.parallelism.expert_parallel_degree = 2  # within the data-parallel group
    return config


def llama3_8b_dualpipev() -> DualPipeTrainer.Config:
    """Llama 3 8B on one node of 8 GPUs: DualPipeV pp=4 (8 stages) x FSDP 2, 16 microbatches of 8192 tokens.

    Needs the Llama 3.1 tokenizer in ``hf_assets_path`` and the ``c4`` dataset (network)."""
    config = with_dualpipe(llama3.llama3_8b())
    config.dump_folder = "./outputs/llama3_8b_dualpipev"
    return _pipeline(config, "DualPipeV", pp=4, batch=16, seq_len=8192, steps=1000)


def deepseek_v3_16b_dualpipe() -> DualPipeTrainer.Config:
    """DeepSeek-V3 16B MoE on two nodes of 8 GPUs: DualPipe pp=4 x FSDP 4, expert parallel 4, full AC.

    Needs the deepseek-moe-16b-base tokenizer in ``hf_assets_path`` and the ``c4`` dataset."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    config = with_dualpipe(deepseek_v3.deepseek_v3_16b())
    config.dump_folder = "./outputs/deepseek_v3_16b_dualpipe"
    config = _pipeline(config, "DualPipe", pp=4, batch=16, seq_len=4096, steps=1000)
    config.parallelism.data_parallel_shard_degree = -1  # 16 / 4 = 4
    config.parallelism.expert_parallel_degree = 4
    config.activation_checkpoint = FullAC.Config()
    config.checkpoint.interval = 500
    return config
