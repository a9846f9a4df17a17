"""CPU mode: what the adapter changes so that torchtitan trains on a machine without an accelerator
(float32 MoE compute, an integer histogram, attention with a backward on 0.3.0, shipped assets
found from any directory), in this process."""

from __future__ import annotations

from pathlib import Path

import pytest

from cases.titan_runs import REGISTRY, ROOT, job_config


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_cpu_attention_equals_flex_attention_and_has_a_backward() -> None:
    """0.3.0's CPU mode attends with plain tensor ops: flex attention's outputs and log-sum-exp for
    packed documents, causal, grouped-query heads; and a backward that flex attention lacks on CPU."""
    if not REGISTRY:
        pytest.skip("0.2.2's models attend with SDPA")
    import torch
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    from titan_dualpipe.titan.cpu_attention import masked_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 64, 16, generator=gen) for h in (4, 2, 2))
    starts = torch.zeros(2, 64, dtype=torch.long)
    starts[0, 20:], starts[1, 50:] = 1, 1  # document ids: a boundary inside each sample

    def document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (starts[b, q_idx] == starts[b, kv_idx])

    mask = create_block_mask(document_causal, 2, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    want, aux = flex_attention(q, k, v, block_mask=mask, scale=0.3, enable_gqa=True, return_aux=AuxRequest(lse=True))
    got, lse = masked_attention(q, k, v, score_mod=None, block_mask=mask, scale=0.3, enable_gqa=True,
                                return_aux=AuxRequest(lse=True), kernel_options={})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.lse, aux.lse, rtol=1e-5, atol=1e-5)
    q.requires_grad_(True)
    out, _ = masked_attention(q, k, v, score_mod=None, block_mask=mask, scale=0.3, enable_gqa=True,
                              return_aux=AuxRequest(lse=False), kernel_options={})
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all() and q.grad.abs().sum() > 0


def test_cpu_integer_histc_is_exact() -> None:
    import torch

    from titan_dualpipe.titan.cpu_moe import TorchWithIntegerHistc

    histc = TorchWithIntegerHistc().histc
    values = torch.randint(-3, 12, (1000,), generator=torch.Generator().manual_seed(0))
    for bins, low, high in ((8, 0, 8), (5, 0, 10), (4, -2, 2), (3, 0, 0)):
        counts = histc(values, bins=bins, min=low, max=high)
        assert counts.dtype == torch.int64
        assert torch.equal(counts, torch.histc(values.double(), bins, low, high).long())
    floats = torch.rand(100)
    assert torch.equal(histc(floats, bins=4, min=0, max=1), torch.histc(floats, 4, 0, 1))


def _built_model(job):
    """The model ``job`` names, built and initialized as torchtitan's trainer builds it (no parallelism)."""
    import torch

    if REGISTRY:
        model_config = job.model_spec.model
        model_config.update_from_config(config=job)
        model = model_config.build()
        init = model.init_states
    else:
        from torchtitan.protocols.train_spec import get_train_spec

        spec = get_train_spec(job.model.name)
        args = spec.model_args[job.model.flavor]
        args.update_from_config(job)
        model = spec.model_cls(args)
        init = model.init_weights
    with torch.no_grad():
        init()
    return model


def test_cpu_float32_grouped_mm_traces_and_equals_torchs() -> None:
    """CPU mode's float32 expert multiply: torch's ``_grouped_mm`` bit for bit, forward and both
    gradients, eager and traced by torch.compile (whose fake kernel for torch's op takes no float32)."""
    import torch

    from titan_dualpipe.titan.cpu_moe import grouped_mm_float32

    torch.manual_seed(0)
    tokens, experts = torch.randn(40, 16, requires_grad=True), torch.randn(4, 16, 24, requires_grad=True)
    offs = torch.tensor([8, 8, 25, 40], dtype=torch.int32)  # an expert without tokens included
    grad = torch.randn(40, 24)

    def run(mm) -> list[torch.Tensor]:
        out = mm(tokens, experts, offs)
        return [out, *torch.autograd.grad(out, (tokens, experts), grad)]

    expected = run(lambda a, b, o: torch._grouped_mm(a, b, offs=o))
    compiled = torch.compile(grouped_mm_float32, backend="aot_eager", fullgraph=True)
    for got in (run(grouped_mm_float32), run(compiled)):
        assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_cpu_mode_computes_moe_models_in_float32() -> None:
    """CPU mode: FSDP gathers parameters in float32 and the MoE experts multiply in float32
    (CPUs without bfloat16 units run bfloat16 matmuls ~50x slower). Every matmul of a forward
    and backward of the MoE debug model's MoE layers, experts included, has float32 operands."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import titan_dualpipe.titan  # noqa: F401 - CPU mode
    from titan_dualpipe.titan import cpu

    job = job_config("debug_moe_dualpipe")
    assert job.training.mixed_precision_param == "bfloat16"  # torchtitan's default, in the shipped config
    cpu.prepare_config(job)
    assert job.training.mixed_precision_param == "float32"

    matmuls = {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.aten.baddbmm,
               torch.ops.aten._grouped_mm}
    seen: list[tuple[str, set]] = []

    class MatmulDtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in matmuls:
                seen.append((str(func), {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = _built_model(job)
    moes = [m for m in model.modules() if type(m).__name__ == "MoE"]
    experts = [m for m in model.modules() if type(m).__name__ == "GroupedExperts"]
    calls = []
    for module in experts:
        module.register_forward_hook(lambda *_: calls.append(1))
    hidden = torch.randn(2, 16, model.tok_embeddings.weight.shape[1], requires_grad=True)
    with MatmulDtypes():
        sum(moe(hidden).square().mean() for moe in moes).backward()
    assert moes and len(calls) == len(experts) == len(moes), (len(moes), len(experts), len(calls))
    assert seen and all(dtypes == {torch.float32} for _, dtypes in seen), sorted({(f, tuple(d)) for f, d in seen} - {
        (f, (torch.float32,)) for f, _ in seen})


def test_cpu_mode_only_without_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torchtitan.components import metrics
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    from titan_dualpipe.titan import cpu

    assert cpu.enable() and utils.device_type == "cpu" and dist_utils.device_type == "cpu"
    assert metrics.device_module.current_device() == 0
    assert metrics.device_module.get_device_properties().total_memory > 0
    monkeypatch.setattr(torch._utils, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(utils, "device_type", "cuda")
    assert not cpu.enable() and utils.device_type == "cuda"


def test_shipped_assets_found_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_dualpipe.titan.data import resolve_asset_path

    monkeypatch.chdir(tmp_path)
    resolved = resolve_asset_path("./titan_dualpipe/titan/assets/tokenizer")
    assert resolved is not None and (Path(resolved) / "tokenizer.json").is_file()
    assert resolve_asset_path("assets/missing") == "assets/missing"
    size = sum(f.stat().st_size for f in (ROOT / "titan_dualpipe/titan/assets").rglob("*") if f.is_file())
    assert size < 1_000_000
