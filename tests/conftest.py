"""The ``torch_agnostic`` marker: tests whose outcome does not depend on the torch release.

CI runs the whole suite on the default torch, and on the lowest and highest supported torch
only what can differ between releases (``-m "not torch_agnostic"``): our runtime on torch's
pipelining, autograd, FSDP2, DTensor, compile and dispatch internals, which ``_compat`` adapts.
What is marked here computes with our own code only (orders, the simulator, the NCCL-order
model's logic, command-line parsing, reports, docs, the test pool), or repeats on more ranks a
mechanism that an unmarked test already runs on every torch (named below with its twin).

The tests' models are tiny: :func:`pytest_configure` has every weight GEMM deferred
(``TITAN_DUALPIPE_MIN_WEIGHT_GEMM_FLOPS=0``, inherited by every spawned rank), so each test runs
the mechanism it names; tests/test_deferred_weights.py checks the device default itself.
"""

from __future__ import annotations

import os

import pytest

# whole modules: no torch internals on their path
AGNOSTIC_MODULES = {
    "test_sim.py",  # the simulator and its pictures: pure Python over our orders
    "test_docs.py",  # docs, command-line parsers, links, pictures
    "test_cli.py",  # the command line's messages for missing files and pictures
    "test_dist_pool.py",  # the test pool's own failure reporting
    "test_gpu_kit.py",  # the kit's parts, parsers and report (subprocesses stubbed)
    "test_device_timing.py",  # timing with stub clocks
    "test_comm_accounting.py",  # the emulated network's bookkeeping
}

# single tests (every parametrization), with the unmarked test that keeps the mechanism covered
AGNOSTIC_TESTS = {
    "test_imports.py": {
        # the import graph, read from the source: test_importing_changes_no_other_modules_globals imports on every torch
        "test_import_graph_sees_imports",
        "test_no_import_circle",
    },
    "test_nccl_order.py": {
        "test_recorded_posting_at_pp8_completes_without_buffering",  # the recorder: pp 2 and 4 cases
        "test_an_order_gloo_runs_but_nccl_would_not_fails_here",  # the model's logic, on a hand-made order
        "test_planned_orders_complete_without_buffering",  # planned orders: no torch involved
    },
    "test_overlap.py": {
        # failure propagation is our agreement protocol over gloo:
        # test_runtime's killed rank and test_a_mistake_on_one_rank_raises_on_every_rank run everywhere
        "test_failure_in_a_pair_surfaces_on_every_rank",
        "test_failure_in_a_relayed_pair_surfaces_on_every_rank",
        "test_bench_rejects_bad_settings_before_spawning",  # option checks
    },
    "test_check.py": {
        # the CLI's report of a failing rank: test_a_case_failing_on_one_rank_fails_on_every_rank_... runs everywhere
        "test_a_case_failing_on_one_rank_is_a_fail_row_and_the_exit_code",
        "test_layouts_cover_every_pp_that_fits",
    },
    "test_profile.py": {
        "test_profile_command_measures_a_real_run",  # the CLI around the memory and compile cases
        "test_costs_are_medians_per_kind_and_first_stage_weight_parts_count_as_full_backwards",
        "test_weight_share_comes_from_split_samples_when_only_first_stages_split",
        "test_backward_derived_from_split_parts_when_no_full_backward_ran",
        "test_profile_compile_options_are_checked_before_spawning",
    },
    "test_autograd_contract.py": {
        # the DualPipeV table's mechanisms at pp 4 with twins: test_a_feature_trains_as_under_plain_autograd
        # runs them everywhere, and test_runtime's DualPipe numerics the twins
        "test_dualpipe_trains_each_feature_as_under_plain_autograd",
    },
    "test_bench_and_matrix.py": {  # tests/titan/
        "test_matrix_covers_every_layout_and_flags_a_differing_rank",  # the matrix's table logic
        "test_bench_titan_checks_its_options_and_summarizes_ranks",
    },
    "test_parallelisms.py": {"test_folded_rank_map_puts_twins_side_by_side"},  # tests/titan/
}

# one parametrization of a test stands for the others on every torch
AGNOSTIC_IDS = {
    # a failure in the order is named by our agreement protocol: [first_backward] runs, inside torch's collectives
    "test_autograd_contract.py::test_a_failure_is_named_on_every_rank[in_the_order]",
    "test_runtime.py::test_a_killed_rank_is_named_by_every_other_rank[DualPipe-4-8]",  # [DualPipeV-4-8] runs
    "test_profile.py::test_profile_measures_activation_memory_as_the_simulator_predicts[DualPipe-2-8]",
    "test_profile.py::test_profile_measures_activation_memory_as_the_simulator_predicts[DualPipeV-4-8]",
}


def pytest_configure(config: pytest.Config) -> None:
    from titan_dualpipe.switches import MIN_FLOPS_ENV

    os.environ.setdefault(MIN_FLOPS_ENV, "0")


@pytest.fixture(scope="module")
def pool(request: pytest.FixtureRequest):
    """The module's process pool (tests/cases/dist_pool.py), spawned at its first case and killed
    after its last: the module's ``WORLD`` ranks, whose process groups give up on a silent peer
    after the module's ``POOL_TIMEOUT_S`` seconds where it sets one (else the pool's default)."""
    from cases.dist_pool import WorkerPool

    module = request.module
    timeout = {"pg_timeout_s": module.POOL_TIMEOUT_S} if hasattr(module, "POOL_TIMEOUT_S") else {}
    with WorkerPool(module.WORLD, **timeout) as p:
        yield p


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marker = pytest.mark.torch_agnostic
    named = {(module, name) for module, names in AGNOSTIC_TESTS.items() for name in names}
    for item in items:
        module = item.path.name
        node = f"{module}::{item.name}"
        function = getattr(item, "originalname", item.name)
        if module in AGNOSTIC_MODULES or (module, function) in named or node in AGNOSTIC_IDS:
            item.add_marker(marker)
    modules = {item.path.name: item.module for item in items if hasattr(item, "module")}
    wanted = named | {(node.split("::")[0], node.split("::")[1].split("[")[0]) for node in AGNOSTIC_IDS}
    stale = sorted(f"{m}::{n}" for m, n in wanted if m in modules and not hasattr(modules[m], n))
    if stale:  # a renamed test would silently run on every torch again: name it
        raise pytest.UsageError(f"tests/conftest.py names tests that do not exist: {stale}")
