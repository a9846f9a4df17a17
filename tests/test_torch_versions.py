"""The supported torch range, and the torch problems we work around, on the installed torch.

Each workaround test shows whether torch's own path is still wrong on this version and that
the flag in ``titan_dualpipe._compat.pipelining`` (which decides whether our workaround runs)
says the same, so a torch release that fixes one of them fails here until the flag follows.
"""

from __future__ import annotations

import os

import pytest
import torch

from cases import pipeline_cases as cases
from titan_dualpipe import _compat, bootstrap, compute_order, placement
from titan_dualpipe._compat import pipelining
from titan_dualpipe.orders.dryrun import dry_run
from titan_dualpipe.orders.lowering import lower

WORLD = 4  # the module's pool (tests/conftest.py)


def test_one_supported_range_everywhere():
    """pyproject's requirement, the import check and the setup script agree: 2.11 to 2.15."""
    assert _compat.SUPPORTED_TORCH == (">=2.11", "<2.16")
    assert bootstrap.range_text() == "torch" + ",".join(_compat.SUPPORTED_TORCH)
    for version in ("2.11.0", "2.12.1", "2.13.0+cpu", "2.14.1+cu130", "2.15.0+cu132"):
        assert bootstrap.in_range(version)
        _compat.check_torch_version(version)
    for version in ("2.10.0", "2.16.0", "3.0.0"):
        assert not bootstrap.in_range(version)
        with pytest.raises(ImportError, match=r"supports torch >=2.11,<2.16 .* found torch " + version):
            _compat.check_torch_version(version)


def test_setup_refuses_an_unsupported_torch_before_installing():
    with pytest.raises(SystemExit, match=r"--torch 2.10.0 is outside the supported range torch>=2.11,<2.16"):
        bootstrap.ensure_venv("2.10.0")


def test_an_exact_torch_installs_past_a_machine_wide_cap(monkeypatch):
    """``--torch X`` installs exactly X even where pip's configuration caps torch lower (a
    constraints file): bootstrap empties ``PIP_CONSTRAINT`` for both its installs."""
    monkeypatch.setenv("PIP_CONSTRAINT", "/etc/xdg/pip/constraints.txt")
    assert bootstrap._exact_torch_env()["PIP_CONSTRAINT"] == os.devnull


def test_the_reduce_grad_wait_follows_this_torch():
    """2.15 gave each REDUCE_GRAD a WAIT_REDUCE_GRAD; our lowering writes them as torch's pass
    does (right after, or deferred: before the next reduction, the last at the end), none before 2.15."""
    assert (pipelining.WAIT_REDUCE_GRAD is None) == (not hasattr(pipelining._ComputationType, "WAIT_REDUCE_GRAD"))
    place = placement("DualPipeV", 2, 4)
    for deferred in (False, True):
        for lowered in lower(compute_order("DualPipeV", 2, 4), place, defer_reduce_grad_wait=deferred).values():
            actions = [a for a in lowered if a.is_compute_op or "REDUCE_GRAD" in str(a)]  # communication aside
            kinds = [str(a) for a in actions]
            reduced = [i for i, a in enumerate(actions) if a.computation_type == pipelining.REDUCE_GRAD]
            waits = [i for i, a in enumerate(actions) if a.computation_type == pipelining.WAIT_REDUCE_GRAD]
            assert len(reduced) == 2, kinds
            if pipelining.WAIT_REDUCE_GRAD is None:
                assert waits == [], kinds
            elif deferred:
                assert [actions[i].stage_index for i in waits] == [actions[i].stage_index for i in reduced], kinds
                assert waits == [reduced[1] - 1, len(actions) - 1], kinds
            else:
                assert waits == [i + 1 for i in reduced], kinds


def test_our_start_up_runs_on_this_torch(pool):
    """torch's stage initialisation calls our start-up under this torch's name for it (2.15:
    ``_initialize_pipeline_distributed_state``, 2.12-2.14: ``_warmup_p2p``): the pair communicators
    are created once, before the first action, over two steps and an eval (whose mode switch
    runs it again, without connecting, on 2.15)."""
    for schedule, pp, n in (("DualPipeV", 2, 4), ("DualPipe", 4, 8)):
        calls = [c for c in pool.run(cases.start_up_calls, schedule=schedule, pp=pp, n=n) if c is not None]
        assert len(calls) == pp
        # 2.11 has no start-up exchange (shapes flow by a p2p exchange; its batches use the group's
        # communicator, so no pair communicators to create)
        assert all(c["connect"] == (1 if pipelining.HAS_METADATA_VOTE else 0) for c in calls), calls


def test_torch_deferred_recvs_mismatch_v_messages_ours_do_not():
    """torch's ``_defer_recv_ops`` (2.13+) reorders recvs from one peer, and V neighbours
    exchange activations and gradients of one shape over one channel: data would land in
    the wrong buffer. Our ``defer_pp_recv`` keeps per-peer order on every version."""
    place = placement("DualPipeV", 4, 8)
    dry_run(lower(compute_order("DualPipeV", 4, 8), place, defer_recv=True), place)
    if pipelining.TORCH_DEFER_RECV_OPS is None:
        pytest.skip(f"torch {torch.__version__} has no receive deferral of its own (added in 2.13)")
    lowered = lower(compute_order("DualPipeV", 4, 8), place)
    with pytest.raises(ValueError, match="would receive the data meant for"):
        dry_run(pipelining.TORCH_DEFER_RECV_OPS(lowered, place.rank_of), place)


def test_torch_lowering_still_rejects_two_chains():
    """torch's ``_add_send_recv`` assumes one chain ``0..N-1``: DualPipe needs ours."""
    place = placement("DualPipe", 4, 8)
    order = compute_order("DualPipe", 4, 8)
    per_rank = {r: pipelining._add_reduce_grad(pipelining._add_unshard_reshard(list(a)), 4) for r, a in order.items()}
    with pytest.raises(Exception):
        pipelining._add_send_recv(per_rank, place.rank_of, place.num_stages)
    dry_run(lower(order, place), place)


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "torch DualPipeV"])
def test_split_backward_under_nested_fsdp2_matches_the_flag(pool, name):
    """With nested FSDP2 (4 x 1 mesh: split backwards run before full ones on most ranks),
    torch's own V schedule loses weight gradients exactly when ``SPLIT_BACKWARD_NEEDS_UNSHARD``
    says so; without FSDP the same schedule is right (so the difference is FSDP's)."""
    plain = max(e for e in pool.run(cases.torch_schedule_grad_error, name=name, pp=4, n=8, fsdp=False) if e is not None)
    assert plain <= cases.ATOL, f"torch's {name} is wrong even without FSDP: {plain}"
    nested = max(pool.run(cases.torch_schedule_grad_error, name=name, pp=4, n=8, fsdp=True))
    torch_is_wrong = nested > cases.ATOL
    assert torch_is_wrong == pipelining.SPLIT_BACKWARD_NEEDS_UNSHARD, (
        f"torch {torch.__version__}: {name} with nested FSDP2 has gradient error {nested}, but "
        f"SPLIT_BACKWARD_NEEDS_UNSHARD={pipelining.SPLIT_BACKWARD_NEEDS_UNSHARD}")


def _split_backward_grads(block: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """torch's split backward of one stage: input grads (I), then weight grads (W)."""
    x = x.detach().requires_grad_()
    out = block(x)
    _, param_groups = pipelining.stage_backward_input([out], [grad], [x], block.parameters())
    pipelining.stage_backward_weight(block.parameters(), param_groups)
    return [p.grad for p in block.parameters()]


def test_torchs_split_backward_still_refuses_compiled_blocks():
    """torch.compile'd blocks in torch's split backward (pytorch#161904) still fail or give other
    gradients than plain autograd on this torch: why our schedules run a compiled stage's
    backward whole at I (weights/plan.py). Should a torch split them, measure with
    ``titan-dualpipe bench compile`` whether the split pays before using it."""
    import copy

    from titan_dualpipe.testing.model import Block

    torch.manual_seed(0)
    plain = Block(dim=16, heads=2)
    compiled = copy.deepcopy(plain)
    compiled.compile(backend="aot_eager")  # in place, as torchtitan compiles each block
    x, grad = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    compiled(x.clone().requires_grad_()).backward(grad)  # a full backward first, as a schedule runs
    compiled.zero_grad()
    out = plain(x.requires_grad_())
    out.backward(grad)
    try:
        got = _split_backward_grads(compiled, x, grad)
        works = all(g is not None and torch.equal(g, p.grad) for g, p in zip(got, plain.parameters(), strict=True))
    except RuntimeError as err:
        assert any(m in str(err) for m in ("donated buffers", "stage backward input", "not used in the graph")), err
        works = False
    assert not works, f"torch {torch.__version__} splits a compiled backward: see this test's docstring"


def test_static_metadata_matches_the_flag(pool):
    """torch's own ScheduleDualPipeV on stages with static metadata (input_args=/output_args=, one
    rank, so its V's turn hands off in memory) fails or gives wrong gradients exactly when
    ``STATIC_METADATA_DROPS_INPUT_GRADS`` says so; ours train correctly either way
    (tests/test_runtime.py::test_static_stage_metadata)."""
    outcome = pool.run(cases.torch_dualpipev_static_metadata, pp=1, n=2)[0]
    torch_is_wrong = "raised" in outcome or outcome["grad_err"] > cases.ATOL
    if "raised" in outcome:
        assert "Output gradient" in outcome["raised"] or "grad can be implicitly created" in outcome["raised"], outcome
    assert torch_is_wrong == pipelining.STATIC_METADATA_DROPS_INPUT_GRADS, (
        f"torch {torch.__version__}: its ScheduleDualPipeV with static metadata gives {outcome}, but "
        f"STATIC_METADATA_DROPS_INPUT_GRADS={pipelining.STATIC_METADATA_DROPS_INPUT_GRADS}")
