"""How the adapter plugs into torchtitan, in this process: our schedule names in its lookup, its
DualPipeV-specific hooks off for our schedules, and the config fields and environment switches
(overlap, two-batch overlap, weight gradients) reaching the schedule its builder builds."""

from __future__ import annotations

import sys

import pytest

from cases.titan_runs import REGISTRY, job_config
from titan_dualpipe.switches import (LONE_PAIRS_ENV, NOT_DEFERRED_ENV, OLD_WEIGHTS_IN_FLIGHT_ENV, PAIR_FIRST_ENV, TWO_BATCH_ENV,
                                     WEIGHT_GEMMS_IN_FLIGHT_ENV, WEIGHT_GRADIENTS_ENV)


def test_schedule_names_resolve_case_insensitively_and_others_unchanged() -> None:
    import titan_dualpipe.titan  # noqa: F401 - installs the registration
    from torch.distributed.pipelining import schedules as torch_schedules
    from torchtitan.distributed import pipeline_parallel

    from titan_dualpipe import ScheduleDualPipe, ScheduleDualPipeV

    lookup = pipeline_parallel.get_schedule_class
    for name in ("DualPipeV", "dualpipev", "DUALPIPEV"):
        assert lookup(name) is ScheduleDualPipeV
    for name in ("DualPipe", "dualpipe"):
        assert lookup(name) is ScheduleDualPipe
    assert not issubclass(ScheduleDualPipeV, torch_schedules.ScheduleDualPipeV)
    for name in ("TorchDualPipeV", "torchdualpipev"):  # torch's own, for comparisons
        assert lookup(name) is torch_schedules.ScheduleDualPipeV
    for name in ("1F1B", "interleaved1f1b", "GPipe", "ZBVZeroBubble", "PipelineScheduleMulti"):
        assert lookup(name) is torch_schedules.get_schedule_class(name)
    with pytest.raises(ValueError, match="Unknown schedule name 'DualPipeX'"):
        lookup("DualPipeX")


@pytest.mark.skipif(REGISTRY, reason="torchtitan 0.3.0 has no DualPipeV expert-parallel hooks")
def test_dual_pipe_v_flag_off_for_our_names_only() -> None:
    """torchtitan's EP SyncHooks / AC refusal keyed on "dualpipev": not for our schedules."""
    from types import SimpleNamespace

    import titan_dualpipe.titan  # noqa: F401 - installs the patches
    from torchtitan.distributed import dual_pipe_v
    from torchtitan.protocols.train_spec import get_train_spec

    from titan_dualpipe.titan.pipeline import make_dual_pipe_v_flag

    def job(name: str) -> SimpleNamespace:
        par = SimpleNamespace(pipeline_parallel_schedule=name, pipeline_parallel_expert_parallel_overlap=True)
        return SimpleNamespace(parallelism=par, activation_checkpoint=SimpleNamespace(mode="full"))

    dims = SimpleNamespace(ep_enabled=True, pp_enabled=True)
    parallelize = sys.modules[get_train_spec("deepseek_v3").parallelize_fn.__module__]
    for flag in (dual_pipe_v.get_dual_pipe_v_flag, parallelize.get_dual_pipe_v_flag):
        assert flag(job("DualPipeV"), dims) is False  # torchtitan's own raises NotImplementedError (AC)
    flag = make_dual_pipe_v_flag(lambda job, dims: "torchtitan's answer")
    assert flag(job("dualpipev"), dims) is False and flag(job("DualPipe"), dims) is False
    assert flag(job("1F1B"), dims) == flag(job("ZBVZeroBubble"), dims) == "torchtitan's answer"


def test_dualpipe_overlap_switch_and_with_dualpipe() -> None:
    if not REGISTRY:
        pytest.skip("0.2.2's switch is torchtitan's own [parallelism] pipeline_parallel_expert_parallel_overlap")
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from titan_dualpipe.titan import GEN
    from titan_dualpipe.titan.trainer_config import DualPipeTrainer, with_dualpipe

    assert GEN.overlap(job_config("debug_dualpipev")) is True
    assert GEN.overlap(job_config("debug_dualpipev", "--dualpipe.no-overlap")) is False
    plain = llama3_debugmodel()
    assert GEN.overlap(plain) is True  # a plain Trainer.Config: overlap on
    ours = with_dualpipe(plain, overlap=False)
    assert isinstance(ours, DualPipeTrainer.Config) and GEN.overlap(ours) is False
    assert ours.training == plain.training and ours.model_spec is plain.model_spec
    with pytest.raises(ValueError, match="with_dualpipe takes torchtitan's Trainer.Config"):
        with_dualpipe(plain.training)


def test_dualpipe_two_batch_overlap_field() -> None:
    """0.3.0: ``--dualpipe.two-batch-overlap`` (off by default, also through ``with_dualpipe``)."""
    if not REGISTRY:
        pytest.skip("0.2.2 has no config key for two-batch overlap: TITAN_DUALPIPE_TWO_BATCH=1 alone")
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from titan_dualpipe.titan import GEN
    from titan_dualpipe.titan.trainer_config import with_dualpipe

    default = job_config("debug_moe_dualpipe")
    assert default.dualpipe.two_batch_overlap is False and GEN.two_batch_overlap(default) is False
    on = job_config("debug_moe_dualpipe", "--dualpipe.two-batch-overlap")
    assert on.dualpipe.two_batch_overlap is True and GEN.two_batch_overlap(on) is True
    assert on.dualpipe.overlap is True
    assert GEN.two_batch_overlap(llama3_debugmodel()) is False  # a plain Trainer.Config: off
    assert GEN.two_batch_overlap(with_dualpipe(llama3_debugmodel(), two_batch_overlap=True)) is True


class _RecordedSchedule:
    """Stands in for our schedule class: keeps the keywords the builder passes."""

    fsdp_at_step_edges = False
    two_batch_stages: frozenset = frozenset()
    deferred_weights: dict = {}
    least_weight_gemm_flops = 0

    def __init__(self, stages: list, **kwargs) -> None:
        self.kwargs = kwargs
        self.weight_gradients = kwargs.get("weight_gradients")

    def eval(self, *args, return_outputs: bool = True, **kwargs) -> bool:
        return return_outputs


# (config switch given, TITAN_DUALPIPE_TWO_BATCH, two_batch_overlap the schedule gets): either turns it on
TWO_BATCH_CASES = [(False, None, False), (False, "0", False), (False, "1", True), (False, "measured", "measured"),
                   (True, None, True), (True, "0", True), (True, "1", True), (True, "measured", "measured")]


@pytest.fixture
def active_run_kept():
    """The adapter's record of this process's pipeline, restored after the test."""
    from titan_dualpipe.titan.active import ACTIVE

    saved = dict(vars(ACTIVE))
    yield ACTIVE
    vars(ACTIVE).clear()
    vars(ACTIVE).update(saved)


@pytest.mark.parametrize("field,env,expected", TWO_BATCH_CASES)
def test_two_batch_overlap_reaches_the_schedule_built(field: bool, env: str | None, expected: bool | str,
                                                      monkeypatch: pytest.MonkeyPatch, active_run_kept) -> None:
    """The config's switch (0.3.0) and the environment (both releases) as the trainer hooks
    record them, through torchtitan's pipeline-schedule builder as we replace it, to our class's
    ``two_batch_overlap``."""
    if field and not REGISTRY:
        pytest.skip("0.2.2 has no config key for two-batch overlap")
    from titan_dualpipe.titan import pipeline, trainer_hooks

    monkeypatch.setattr(trainer_hooks.expert_overlap, "install", lambda: None)
    monkeypatch.setattr(pipeline, "schedule_class", lambda name: _RecordedSchedule)
    if env is None:
        monkeypatch.delenv(TWO_BATCH_ENV, raising=False)
    else:
        monkeypatch.setenv(TWO_BATCH_ENV, env)
    job = job_config("debug_dualpipev", *(["--dualpipe.two-batch-overlap"] if field else []))
    trainer_hooks.prepare(job)

    def torchtitans(*args, **kwargs):
        raise AssertionError("torchtitan's own builder ran for our schedule")

    par, batch = job.parallelism, job.training.local_batch_size
    if REGISTRY:
        built = pipeline.make_build_schedule_030(torchtitans)(
            parallelism=par, local_batch_size=batch, stages=[], loss_fn=lambda *a: (a, None))
    else:
        built = pipeline.make_build_schedule(torchtitans)(job, [], lambda *a: a)
    assert isinstance(built, _RecordedSchedule)
    assert built.kwargs["two_batch_overlap"] == expected and built.kwargs["overlap"] is True
    assert type(built.kwargs["two_batch_overlap"]) is type(expected)


def _built_with(monkeypatch: pytest.MonkeyPatch, *args: str) -> _RecordedSchedule:
    """Our schedule as torchtitan's builder (as we replace it) builds it for ``debug_dualpipev`` and ``args``."""
    from titan_dualpipe.titan import pipeline, trainer_hooks

    monkeypatch.setattr(trainer_hooks.expert_overlap, "install", lambda: None)
    monkeypatch.setattr(pipeline, "schedule_class", lambda name: _RecordedSchedule)
    job = job_config("debug_dualpipev", *args)
    trainer_hooks.prepare(job)

    def torchtitans(*args, **kwargs):
        raise AssertionError("torchtitan's own builder ran for our schedule")

    par, batch = job.parallelism, job.training.local_batch_size
    if REGISTRY:
        return pipeline.make_build_schedule_030(torchtitans)(
            parallelism=par, local_batch_size=batch, stages=[], loss_fn=lambda *a: (a, None))
    return pipeline.make_build_schedule(torchtitans)(job, [], lambda *a: a)


def test_the_adapters_eval_keeps_no_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan's validator reads the losses only: the schedule the adapter builds evaluates with
    ``return_outputs=False`` (eval's default, torch's, returns every microbatch's logits)."""
    assert _built_with(monkeypatch).eval() is False


# (config field (0.3.0), TITAN_DUALPIPE_WEIGHT_GRADIENTS, TITAN_DUALPIPE_NOT_DEFERRED, what the schedule gets)
WEIGHT_GRADIENT_CASES = [
    (None, None, None, ("deferred", [])),
    (None, "split", "output, layers.*.moe.*", ("split", ["output", "layers.*.moe.*"])),
    ("whole", None, None, ("whole", [])),
    ("whole", "deferred", "output", ("deferred", ["output"])),
    (None, "deferred_compiled", None, ("deferred_compiled", [])),
]


@pytest.mark.parametrize("field,env,names,expected", WEIGHT_GRADIENT_CASES)
def test_weight_gradient_switches_reach_the_schedule_built(field, env, names, expected, monkeypatch, active_run_kept):
    """``dualpipe.weight_gradients`` (0.3.0) and the environment (both releases; the variable wins,
    ``TITAN_DUALPIPE_NOT_DEFERRED`` adds names) become our class's ``weight_gradients`` and
    ``not_deferred``; a bad value is named with the choices."""
    if field and not REGISTRY:
        pytest.skip("0.2.2 has no config key for weight gradients")
    for var, value in ((WEIGHT_GRADIENTS_ENV, env), (NOT_DEFERRED_ENV, names)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    built = _built_with(monkeypatch, *(["--dualpipe.weight-gradients", field] if field else []))
    assert (built.kwargs["weight_gradients"], built.kwargs["not_deferred"]) == expected
    assert built.kwargs["weight_gemms_in_flight"] is True
    monkeypatch.setenv(WEIGHT_GEMMS_IN_FLIGHT_ENV, "0")
    assert _built_with(monkeypatch).kwargs["weight_gemms_in_flight"] is False
    monkeypatch.setenv(WEIGHT_GEMMS_IN_FLIGHT_ENV, "fill")
    assert _built_with(monkeypatch).kwargs["weight_gemms_in_flight"] == "fill"
    monkeypatch.setenv(WEIGHT_GEMMS_IN_FLIGHT_ENV, "no")
    with pytest.raises(ValueError, match=r"TITAN_DUALPIPE_WEIGHT_GEMMS_IN_FLIGHT='no': use 1 .*, fill .* or 0 \(inline\)"):
        _built_with(monkeypatch)
    monkeypatch.delenv(WEIGHT_GEMMS_IN_FLIGHT_ENV)
    monkeypatch.setenv(OLD_WEIGHTS_IN_FLIGHT_ENV, "0")  # the deprecated name still switches, and says so
    with pytest.warns(DeprecationWarning, match=WEIGHT_GEMMS_IN_FLIGHT_ENV):
        assert _built_with(monkeypatch).kwargs["weight_gemms_in_flight"] is False
    monkeypatch.delenv(OLD_WEIGHTS_IN_FLIGHT_ENV)
    monkeypatch.setenv(WEIGHT_GRADIENTS_ENV, "later")
    with pytest.raises(ValueError, match=r"TITAN_DUALPIPE_WEIGHT_GRADIENTS='later': use one of deferred, deferred_compiled, split, whole"):
        _built_with(monkeypatch)


# (config field (0.3.0), TITAN_DUALPIPE_PAIR_FIRST, what the schedule gets): the variable wins
PAIR_FIRST_CASES = [(None, None, "forward"), (None, "measured", "measured"), ("backward", None, "backward"),
                    ("backward", "forward", "forward"), ("measured_first", None, "measured_first"),
                    (None, "measured_first", "measured_first")]


@pytest.mark.parametrize("field,env,expected", PAIR_FIRST_CASES)
def test_pair_first_reaches_the_schedule_built(field, env, expected, monkeypatch, active_run_kept):
    """``dualpipe.pair_first`` (0.3.0) and ``TITAN_DUALPIPE_PAIR_FIRST`` (both releases) become our
    class's ``pair_first``; a bad value is named with the choices."""
    if field and not REGISTRY:
        pytest.skip("0.2.2 has no config key for pair_first")
    if env is None:
        monkeypatch.delenv(PAIR_FIRST_ENV, raising=False)
    else:
        monkeypatch.setenv(PAIR_FIRST_ENV, env)
    built = _built_with(monkeypatch, *(["--dualpipe.pair-first", field] if field else []))
    assert built.kwargs["pair_first"] == expected
    monkeypatch.setenv(PAIR_FIRST_ENV, "sideways")
    with pytest.raises(ValueError, match=r"TITAN_DUALPIPE_PAIR_FIRST='sideways': use one of forward, backward, measured, measured_first"):
        _built_with(monkeypatch)


def test_a_bad_two_batch_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from titan_dualpipe.titan import pipeline

    monkeypatch.setenv(TWO_BATCH_ENV, "yes")
    with pytest.raises(ValueError, match=r"TITAN_DUALPIPE_TWO_BATCH='yes': use 1 \(on\), measured \(.*\) or 0"):
        pipeline.two_batch_option()


@pytest.mark.parametrize("env,expected", [(None, False), ("0", False), ("1", True)])
def test_lone_pairs_reach_the_schedule_built(env, expected, monkeypatch, active_run_kept):
    """``TITAN_DUALPIPE_LONE_PAIRS`` (both releases) becomes our class's ``lone_pairs``; a bad value
    is named with the choices."""
    if env is None:
        monkeypatch.delenv(LONE_PAIRS_ENV, raising=False)
    else:
        monkeypatch.setenv(LONE_PAIRS_ENV, env)
    assert _built_with(monkeypatch).kwargs["lone_pairs"] is expected
    monkeypatch.setenv(LONE_PAIRS_ENV, "yes")
    with pytest.raises(ValueError, match=r"TITAN_DUALPIPE_LONE_PAIRS='yes': use 1"):
        _built_with(monkeypatch)
