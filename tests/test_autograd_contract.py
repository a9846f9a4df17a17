"""The autograd contract: what works under plain autograd and torch's ``ScheduleDualPipeV`` works
under ours (the differential harness, tests/cases/contract_cases.py: CPU, gloo, 4 spawned ranks).

Every autograd feature of :data:`contract_cases.FEATURES`, under both schedules, every backward
path (weight GEMMs in flight as fillers too) and activation-checkpointing mode, trains two steps as
plain autograd does: losses, every gradient on every rank, what the hooks saw; a MoE block with
chunked exchanges also as its whole exchanges do, bit for bit. torch's ``ScheduleDualPipeV`` gives
the same gradients where it trains the feature; a combination the schedules cannot run is refused
before the first step, on every rank.
"""

from __future__ import annotations

import pytest

from cases import contract_cases as cases
from cases.dist_pool import WorkerPool, ran as _ran

WORLD = cases.WORLD  # the module's pool (tests/conftest.py)
# the paths whose Ws run queued weight GEMMs, and those whose full backwards compute them in flight
DEFERRING_PATHS = ("I+W", "relay", "relay_fill", "relay_backward_first", "relay_lone_pairs", "protocol", "small_gemms")
FLYING_PATHS = ("relay", "relay_backward_first", "relay_lone_pairs", "protocol", "two_batch", "small_gemms")


def _table(schedule: str) -> list[str]:
    return [feature for feature, spec in cases.FEATURES.items()
            if any(spec.runs(schedule, path, ac) for path in cases.PATHS for ac in cases.AC_MODES)]


@pytest.mark.parametrize("feature", _table("DualPipeV"))
def test_a_feature_trains_as_under_plain_autograd(pool, feature):
    """DualPipeV, per path and AC mode: the losses and every gradient of every rank within the
    feature's tolerance of plain autograd's; hooks saw each microbatch's whole gradient, once;
    deferred paths deferred, weights flew where they should, and fillers held back; a bitwise twin
    matched. Refused combinations: the same PipelineConfigError on every rank."""
    _check_table(pool, feature, "DualPipeV")


@pytest.mark.parametrize("feature", _table("DualPipe"))
def test_dualpipe_trains_each_feature_as_under_plain_autograd(pool, feature):
    """The same table under DualPipe, at pp 4 (its I actions with weight GEMMs to leave start there),
    its twins summed."""
    _check_table(pool, feature, "DualPipe")


def _check_table(pool, feature: str, schedule: str) -> None:
    spec = cases.FEATURES[feature]
    ran = _ran(pool.run(cases.contract_table, timeout_s=600, feature_name=feature, schedule=schedule))
    combos = set(ran[0])
    assert combos and all(set(r) == combos for r in ran), ran
    for combo in combos:
        results = [r[combo] for r in ran]
        if spec.refused:
            assert len({r["refused"] for r in results}) == 1, results
            continue
        path = combo.split("/")[0]
        assert sum(r["losses"] for r in results) > 0, (combo, results)  # some rank holds the losses
        assert max(r["grad_err"] for r in results) <= max(spec.tolerance), (combo, results)
        if spec.records:
            assert all(r["records"] > 0 for r in results), (combo, results)
        small_only = path == "small_gemms" and feature in cases.ALL_SMALL
        if path in DEFERRING_PATHS and not small_only \
                and cases.LAYOUT[schedule][0] == spec.layout(schedule)[0]:
            assert sum(r["deferred"] for r in results) > 0, (combo, results)  # Ws ran queued GEMMs
        if path in FLYING_PATHS and not small_only:
            assert sum(r["in_flight"] for r in results) > 0, (combo, results)  # full backwards' GEMMs flew
        if path == "small_gemms" and feature not in cases.NONE_SMALL:  # the small ones stayed with autograd
            assert all(r["left_to_autograd"] > 0 for r in results), (combo, results)
        if spec.bitwise_twin:
            assert all(r["bitwise"] > 0 for r in results), (combo, results)
    for ac in cases.AC_MODES:
        _check_fillers(ran, ac)


def _check_fillers(ran: list[dict], ac: str) -> None:
    """As fillers, on exchanges that arrive as soon as posted, a backward computes in flight only what fits
    before its partner half's exchange arrives: nothing while the partner waits on one (the rest at its
    end), all where no partner waits (a backward outside a pair, or one whose partner ended first, as a
    recomputation's exchange under AC lets it). So no more fly than on the relay path, and without AC,
    where paired backwards' partners wait, fewer."""
    fill, relay = f"relay_fill/{ac}", f"relay/{ac}"
    if fill not in ran[0] or relay not in ran[0]:
        return
    flew = {path: sum(r[path]["in_flight"] for r in ran) for path in (fill, relay)}
    assert flew[fill] < flew[relay] if ac == "none" else flew[fill] <= flew[relay], flew


AGREED = [feature for feature, spec in cases.FEATURES.items()
          if spec.torch_trains() and not spec.refused and "DualPipeV" in spec.schedules
          and set(spec.ac_modes) & set(cases.TORCH_AC_MODES)]


@pytest.mark.parametrize("feature", AGREED)
def test_ours_and_torchs_dualpipev_agree(pool, feature):
    """Our DualPipeV and torch's on the same model and feature, every AC mode it runs: the same
    gradients on every rank (autocast: within bfloat16's tolerance)."""
    spec = cases.FEATURES[feature]
    for ac in [ac for ac in spec.ac_modes if ac in cases.TORCH_AC_MODES]:
        ran = _ran(pool.run(cases.torch_agrees, timeout_s=300, feature_name=feature, ac=ac))
        assert max(r["grad_diff"] for r in ran) <= max(spec.tolerance), (ac, ran)


@pytest.mark.parametrize("fail_at", [1, 3], ids=["first_backward", "in_the_order"])
def test_a_failure_is_named_on_every_rank(fail_at):
    """Rank 0 raises in a backward (its own pool: the failure leaves unmatched messages behind):
    rank 0 raises that error, rank 1 a PeerFailed naming it, also when it happens inside torch's
    stage initialisation (whose own collectives the other rank waits in)."""
    timeout = 10.0
    with WorkerPool(2, pg_timeout_s=timeout) as own:
        results = own.run(cases.failure_named_on_every_rank, timeout_s=120, fail_at=fail_at, group_timeout_s=timeout)
    first, second = sorted(_ran(results), key=lambda r: r["rank"])
    assert first["cause"].startswith("ValueError: boom in backward call"), first
    assert second["raised"].startswith("PeerFailed: "), second
    assert "First failure in the pipeline: pipeline rank 0" in second["raised"], second
    assert "raised ValueError" in second["raised"] and "boom in backward call" in second["raised"], second
