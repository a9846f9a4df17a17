"""On one GPU: the schedules, the overlap paths and FSDP2 with NCCL (a group of one rank).

Skipped without CUDA. NCCL refuses two ranks on one GPU, so this is pp=1 (DualPipeV's two
stages on one rank, overlapped pairs included); the multi-rank paths are proven on CPU by the
rest of the suite with the same code. Run: ``python3 titan_dualpipe/bootstrap.py test tests/gpu``
(the venv keeps the machine's CUDA torch). ``TITAN_DUALPIPE_GPU_TESTS_ON_CPU=1`` runs the
same tests on the CPU with gloo, to work on them without a GPU.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from titan_dualpipe import ScheduleDualPipeV, compute_order, placement
from titan_dualpipe._compat.stage_init import runnable_on_gloo
from titan_dualpipe.check.numerics import ATOL, RTOL, batch, build_pipeline, reference_step, train_and_compare
from titan_dualpipe.orders.csv_io import write_csv
from titan_dualpipe.orders.lowering import lower
from titan_dualpipe.orders.lone_actions import lone_forwards
from titan_dualpipe.overlap import pair as pair_module
from titan_dualpipe.overlap import relay as relay_module
from titan_dualpipe.overlap.comm import EmulatedNetwork, ExpertParallelComm, PendingAllToAll
from titan_dualpipe.cut import cut_layers
from titan_dualpipe.overlap.moe import MoE, MoEArgs, MoETransformer, expert_parallel
from titan_dualpipe.runtime.comm_record import CommRecorder
from titan_dualpipe.runtime.sub_batch_runner import register_exchange_rule
from titan_dualpipe.switches import CPU_STAND_IN_ENV
from titan_dualpipe.testing.model import lm_loss
from titan_dualpipe.testing.spawn import free_port

ON_CPU = os.environ.get(CPU_STAND_IN_ENV) == "1"
pytestmark = pytest.mark.skipif(not (ON_CPU or torch.cuda.is_available()),
                                reason=f"needs a CUDA GPU (or {CPU_STAND_IN_ENV}=1)")
DEVICE = torch.device("cpu") if ON_CPU else torch.device("cuda", 0)
MOE = MoEArgs(vocab_size=64, dim=32, n_layers=2, n_heads=2, num_experts=4, top_k=2, moe_inter_dim=64)


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    """This process as a one-rank group (NCCL on the GPU)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=DEVICE,
                                timeout=timedelta(seconds=120))
    else:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=120))
    yield
    dist.destroy_process_group()


def _group() -> dist.ProcessGroup:
    return dist.distributed_c10d._get_default_group()


@pytest.mark.parametrize("n", [2, 3, 5])
def test_dualpipev_matches_the_reference(n):
    result = train_and_compare("DualPipeV", 1, n, _group(), 0, device=DEVICE)
    assert result["losses_checked"] == 2 * n and result["grad_err"] <= ATOL


def test_torchs_dualpipev_matches_the_reference_too():
    from torch.distributed.pipelining import ScheduleDualPipeV as TorchDualPipeV

    def factory(stages, n, **kwargs):
        return runnable_on_gloo(TorchDualPipeV(stages, n, **kwargs))

    assert train_and_compare("DualPipeV", 1, 4, _group(), 0, device=DEVICE, factory=factory)["grad_err"] <= ATOL


@pytest.mark.parametrize("defer", [False, True])
def test_every_collective_stays_on_the_gpu_and_deferred_receives_match(defer):
    with CommRecorder(device=DEVICE) as recorder:
        result = train_and_compare("DualPipeV", 1, 4, _group(), 0, device=DEVICE, defer_pp_recv=defer)
    assert result["grad_err"] <= ATOL and recorder.events


def test_fsdp2_on_a_mesh_of_one():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(DEVICE.type, (1,), mesh_dim_names=("dp",))
    assert train_and_compare("DualPipeV", 1, 4, _group(), 0, device=DEVICE, fsdp_mesh=mesh)["grad_err"] <= ATOL


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
def test_csv_loaded_orders(tmp_path, fmt):
    place = placement("DualPipeV", 1, 4)
    order = compute_order("DualPipeV", 1, 4)
    path = tmp_path / "order.csv"
    with open(path, "w", newline="") as f:
        write_csv(lower(order, place) if fmt == "compute_comms" else order, f)

    def factory(stages, n, **kwargs):
        sched = ScheduleDualPipeV(stages, n, **kwargs)
        sched._load_csv(str(path), format=fmt)
        return sched

    assert train_and_compare("DualPipeV", 1, 4, _group(), 0, device=DEVICE, factory=factory)["grad_err"] <= ATOL


def _two_steps(sched, modules, n: int, steps: int = 2) -> tuple[list, list]:
    losses, grads = [], []
    opt = torch.optim.Adam([p for m in modules.values() for p in m.parameters()], lr=1e-2)
    for step in range(steps):
        x, y = batch(step, n, device=DEVICE)
        step_losses: list = []
        sched.step(x, target=y, losses=step_losses)
        losses += [loss.detach().clone() for loss in step_losses]
        grads += [p.grad.detach().clone() for m in modules.values() for p in m.parameters()]
        opt.step()
        opt.zero_grad()
    return losses, grads


def test_overlap_on_and_off_are_bitwise_equal():
    runs = []
    for overlap in (True, False):
        _, modules, sched = build_pipeline("DualPipeV", 1, 6, _group(), 0, device=DEVICE, overlap=overlap)
        runs.append(_two_steps(sched, modules, 6))
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1], strict=True):
        assert torch.equal(a, b)


class _Relayed(MoETransformer):
    """The MoE module without its protocol: pairs and two-batch halves run as a relay."""

    overlapped_forward_backward = None
    overlapped_sub_batches_forward = None
    overlapped_sub_batches_backward = None


@dataclass(eq=False)
class _OneRankExchanges(ExpertParallelComm):
    """The MoE module's exchanges on one rank, each paying the emulated network: exchanges worth
    hiding, which two-batch overlap splits for (the package's own rule asks for a second expert-
    parallel rank). Records each posted exchange's slots per expert and direction."""

    posts: list = field(default_factory=list)

    def post(self, x: torch.Tensor, backward: bool = False, after: PendingAllToAll | None = None) -> PendingAllToAll:
        if not x.is_meta:
            self.posts.append((x.shape[2], backward))
        return super().post(x, backward, after)


def _emulated_on_one_rank(module: nn.Module) -> bool:
    return any(isinstance(m, MoE) and isinstance(m.comm, _OneRankExchanges) for m in module.modules())


register_exchange_rule(_emulated_on_one_rank)  # only this module's exchanges match it


def _moe_pipeline(module_cls: type, checkpoint: bool, overlap: bool, n: int, two_batch: bool = False,
                  pair_first: str = "forward"):
    """The MoE module on both stages of one rank; every exchange costs 0.5 ms of emulated network
    (on the GPU: a sleep kernel on a side stream), so pairs interleave at real waits."""
    torch.manual_seed(0)
    reference = module_cls(MOE, activation_checkpoint=checkpoint)
    parts = cut_layers(copy.deepcopy(reference), 2)
    comm = _OneRankExchanges(None, EmulatedNetwork(latency_s=5e-4))
    for part in parts:
        expert_parallel(part, comm)
        part.to(DEVICE)
    from torch.distributed.pipelining import PipelineStage

    stages = [PipelineStage(parts[s], s, 2, DEVICE, group=_group()) for s in (0, 1)]
    sched = ScheduleDualPipeV(stages, n, loss_fn=lm_loss, overlap=overlap, two_batch_overlap=two_batch,
                              pair_first=pair_first)
    return reference.to(DEVICE), {0: parts[0], 1: parts[1]}, sched, comm


@pytest.mark.parametrize("module_cls", [MoETransformer, _Relayed], ids=["protocol", "relay"])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["no_ac", "ac"])
def test_moe_overlap_matches_the_reference_and_is_bitwise_sequential(module_cls, checkpoint):
    n = 4
    runs = []
    for overlap in (True, False):
        reference, modules, sched, comm = _moe_pipeline(module_cls, checkpoint, overlap, n)
        runs.append(_two_steps(sched, modules, n))
        assert comm.stats.posted > 0
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1], strict=True):
        assert torch.equal(a, b)
    x, y = batch(0, n, device=DEVICE)
    x = x % MOE.vocab_size
    reference, modules, sched, _ = _moe_pipeline(module_cls, checkpoint, True, n)
    losses: list = []
    sched.step(x, target=y % MOE.vocab_size, losses=losses)
    want = reference_step(reference, x, y % MOE.vocab_size, n, scale_grads=True)
    torch.testing.assert_close(torch.tensor([loss.item() for loss in losses]), torch.tensor(want), rtol=RTOL, atol=ATOL)
    ref = dict(reference.named_parameters())
    for module in modules.values():
        for name, p in module.named_parameters():
            torch.testing.assert_close(p.grad, ref[name].grad, rtol=RTOL, atol=ATOL)


def test_the_measured_pair_order_decides_on_this_device_and_changes_no_bit():
    """``pair_first="measured"``: the second step's relayed pairs, timed on this device (CUDA events
    on a GPU), give every kind of pair an order; over three steps the same bits as the forward
    first."""
    n = 4
    runs, scheds = [], []
    for mode in ("measured", "forward"):
        _, modules, sched, _ = _moe_pipeline(_Relayed, False, True, n, pair_first=mode)
        runs.append(_two_steps(sched, modules, n, steps=3))
        scheds.append(sched)
    orders = scheds[0].pair_order.orders
    assert orders and set(orders) == {(0, 1, 0), (1, 0, 0)}, orders  # DualPipeV's two kinds of pair on one rank (F with B)
    # a plan for every hand-over: each recorded with its exchange's time (without, no plan fits)
    assert all(o.plan is not None and o.saved >= 0 for o in orders.values()), orders
    for a, b in zip(runs[0][0] + runs[0][1], runs[1][0] + runs[1][1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(ON_CPU, reason="CUDA events: an accelerator's")
def test_a_pair_on_the_gpu_is_timed_by_the_devices_clock():
    """Each half computes 5 ms (a sleep kernel) around two emulated exchanges of 20 ms, queued one
    after another on the emulator's side stream. The host launches it all at once, far ahead of the
    GPU, yet the recorder cuts the segments the GPU ran: 5 ms each, the exchanges' 20 ms, the
    stalls; the measured exposure is what the order costs in the floor's model."""
    from titan_dualpipe.exposure.record import pair_exposure, start_recording, stop_recording
    from titan_dualpipe.overlap.segments import interleave

    comm = ExpertParallelComm(None, EmulatedNetwork(latency_s=0.02))
    x = torch.zeros(1, 1, device=DEVICE)
    comm.post(x).wait()  # calibrates the sleep kernel
    cycles = int(0.005 * comm._gpu_delay.cycles_per_s)

    def half():
        for _ in range(2):
            torch.cuda._sleep(cycles)
            yield comm.post(x)
        torch.cuda._sleep(cycles)

    torch.cuda.synchronize()
    record = start_recording(device=DEVICE)
    try:
        record.take()
        launched = time.perf_counter()
        interleave(half(), half())
        launched = time.perf_counter() - launched
        (pair,) = record.take().pairs
    finally:
        stop_recording()
    assert launched < 0.02, f"the host waited for the GPU ({launched:.3f} s): nothing to prove"
    for segments in pair.halves:
        assert [s.exchange is not None for s in segments] == [True, True, False]
        assert all(s.exchange.seconds == pytest.approx(0.02) for s in segments[:2])
        assert all(0.004 < s.compute < 0.008 for s in segments), segments
    assert pair.order == (0, 1, 0, 1, 0, 1)
    exposure = pair_exposure(pair, queue="serial")
    # each exchange starts once the one before arrived: 15 ms stalls at each of the four waits
    assert exposure.serial == pytest.approx(0.08) and exposure.in_order == pytest.approx(0.06, abs=0.004)
    assert exposure.measured == pytest.approx(exposure.in_order, abs=0.004)
    assert exposure.floor <= exposure.in_order + 1e-9


@pytest.mark.parametrize("module_cls", [MoETransformer, _Relayed], ids=["protocol", "relay"])
def test_two_batch_overlap_splits_on_one_rank_and_matches_the_reference(module_cls):
    """``two_batch_overlap=True`` on one rank: the emulated exchanges make both stages split their
    lone forwards into halves (counted: each lone forward posts its two exchanges per layer at
    half the slots), and the step gives the reference's losses and gradients."""
    from titan_dualpipe.check.numerics import MB_SIZE, SEQ

    n = 4
    reference, modules, sched, comm = _moe_pipeline(module_cls, False, True, n, two_batch=True)
    assert sched.two_batch_stages == {0, 1}
    x, y = (t % MOE.vocab_size for t in batch(0, n, device=DEVICE))
    losses: list = []
    sched.step(x, target=y, losses=losses)
    want = reference_step(reference, x, y, n, scale_grads=True)
    torch.testing.assert_close(torch.tensor([loss.item() for loss in losses]), torch.tensor(want), rtol=RTOL, atol=ATOL)
    ref = dict(reference.named_parameters())
    for module in modules.values():
        for name, p in module.named_parameters():
            torch.testing.assert_close(p.grad, ref[name].grad, rtol=RTOL, atol=ATOL)
    comm.posts.clear()  # the first step also ran each stage once to infer its shapes
    sched.step(x, target=y)
    whole, half = MB_SIZE * MOE.capacity(SEQ), (MB_SIZE // 2) * MOE.capacity(SEQ)  # slots per expert
    layers = MOE.n_layers // 2  # MoE layers per stage
    lone = lone_forwards(sched.pipeline_order[0])
    forwards = [slots for slots, backward in comm.posts if not backward]
    # each lone forward: two halves, each a dispatch and a combine per layer; paired ones whole
    assert forwards.count(half) == 2 * 2 * layers * len(lone) > 0, (lone, forwards)
    assert forwards.count(whole) == 2 * layers * (2 * n - len(lone)), (lone, forwards)


class _Exchange(torch.autograd.Function):
    """An exchange that records where each half runs when it hands over, forward and backward."""

    seen: list = []

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _Exchange.record("forward")
        relay_module.hand_over()
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _Exchange.record("backward")
        relay_module.hand_over()
        return grad.clone()

    @staticmethod
    def record(where: str) -> None:
        stream = torch.cuda.current_stream() if DEVICE.type == "cuda" else None
        device = torch.cuda.current_device() if DEVICE.type == "cuda" else None
        _Exchange.seen.append((where, threading.current_thread().name, device, stream))


class _ProbeStage(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.b(_Exchange.apply(torch.tanh(self.a(h))))


def test_relay_halves_switch_on_the_right_device_and_stream():
    """A pair's forward half (this thread) and backward half (a helper thread; on CUDA the
    autograd device thread) both hand over, each on the device and stream the pair started
    on; results bitwise equal to sequential pairs."""
    from torch.distributed.pipelining import PipelineStage

    runs, hand_overs = [], []
    run_relayed = pair_module.run_relayed

    def counted(forward_half, backward_half, *args, **kwargs):
        relay = run_relayed(forward_half, backward_half, *args, **kwargs)
        hand_overs.append(relay.hand_overs)
        return relay

    pair_module.run_relayed = counted
    try:
        for overlap in (True, False):
            torch.manual_seed(0)
            stages_modules = {s: _ProbeStage(16).to(DEVICE) for s in (0, 1)}
            stages = [PipelineStage(m, s, 2, DEVICE, group=_group()) for s, m in stages_modules.items()]

            def loss_fn(out, target):
                return (out - target).pow(2).mean()

            sched = ScheduleDualPipeV(stages, 4, loss_fn=loss_fn, overlap=overlap)
            _Exchange.seen.clear()
            x = torch.randn(8, 16, device=DEVICE)
            losses: list = []
            sched.step(x, target=torch.zeros(8, 16, device=DEVICE), losses=losses)
            runs.append([loss.detach() for loss in losses] + [p.grad.clone() for m in stages_modules.values()
                                                                for p in m.parameters()])
            if overlap:
                seen = list(_Exchange.seen)
    finally:
        pair_module.run_relayed = run_relayed
    assert sum(hand_overs) > 0, "no pair switched halves"
    assert {s[1] for s in seen if s[0] == "backward"} - {threading.current_thread().name}, "backward never left this thread"
    main_stream = torch.cuda.current_stream() if DEVICE.type == "cuda" else None
    for where, thread, device, stream in seen:
        assert stream == main_stream and device == (DEVICE.index if DEVICE.type == "cuda" else None), (where, thread)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_bench_overlap_runs_on_this_device():
    """The one-GPU overlap benchmark (the GPU kit's ``bench overlap`` part is a longer run of it)."""
    from titan_dualpipe.bench.overlap import measure

    cfg = dict(pp=1, ep=1, device=DEVICE.type, rounds=1, steps=1, microbatches=4, layers=2, dim=32, seq=16,
               experts=4, comm_ratio=1.0, latency_ms=None, bandwidth_gbps=None, dualpipe=False, relay=True, compile=None)
    result = measure(cfg)
    for name in ("overlap", "overlap_relay", "sequential", "torch_dualpipev"):
        assert result[f"step_time_{name}"] > 0 and result[f"exposed_comm_{name}"] >= 0
        exposure = result["exposure"][name]  # the floor, from segments timed on this device
        assert exposure["measured"] == pytest.approx(result[f"exposed_comm_{name}"], rel=0.01, abs=1e-4), name
        assert 0 <= exposure["floor"] <= exposure["serial"] + 1e-9 and exposure["serial"] > 0, (name, exposure)
    assert result["pairs_last_step_rank0"]["overlap_relay"] and not result["pairs_last_step_rank0"]["sequential"]


def test_bench_compile_runs_on_this_device(capsys):
    """The backward split benchmark, (I+W)/full (the GPU kit's ``bench compile`` part is a larger run)."""
    from titan_dualpipe.cli import main

    assert main(["bench", "compile", "--device", DEVICE.type, "--backend", "aot_eager", "--blocks", "2", "--dim", "16",
                 "--tokens", "16", "--seq", "8", "--microbatches", "2", "--rounds", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert all(row["full_s"] > 0 for row in rows if row["variant"] == "full"), rows


def _queue_delay(seconds: float):
    """A forward pre-hook that queues ``seconds`` of work on the stages' device: on the GPU a sleep
    kernel on the current stream (the host returns at once), on the CPU a plain sleep."""
    if DEVICE.type != "cuda":
        return lambda module, args: time.sleep(seconds)
    from titan_dualpipe.overlap.comm import GpuDelay

    cycles = int(seconds * GpuDelay(DEVICE).cycles_per_s)
    return lambda module, args: torch.cuda._sleep(cycles)


def test_the_timeline_times_the_work_on_the_device():
    """Every forward queues 20 ms of device work that the host does not wait for: an action
    holding a forward lasts that long on the timeline only if it is timed on the device."""
    from titan_dualpipe._compat.pipelining import F, OVERLAP_F_B

    delay, n = 0.02, 4
    _, modules, sched = build_pipeline("DualPipeV", 1, n, _group(), 0, device=DEVICE, record_timeline=True)
    x, y = batch(0, n, device=DEVICE)
    sched.step(x, target=y)  # shapes inferred, before any delay
    for module in modules.values():
        module.register_forward_pre_hook(_queue_delay(delay))
    start = time.perf_counter()
    sched.step(x, target=y)
    wall = time.perf_counter() - start
    ran = sched.timeline
    assert [t.action for t in ran] == list(sched.pipeline_order[0])
    assert all(0 <= t.start <= t.end <= wall for t in ran)
    assert all(a.end <= b.start + 1e-6 for a, b in zip(ran, ran[1:]))
    forwards = [t for t in ran if t.action.computation_type in (F, OVERLAP_F_B)]
    assert len(forwards) == 2 * n
    assert all(t.end - t.start >= 0.9 * delay for t in forwards), [(str(t.action), t.end - t.start) for t in forwards]


def test_deferred_weight_gemms_on_the_device():
    """Deferred weight GEMMs where autograd runs a CUDA backward on its own device thread: an
    ``nn.Linear`` and grouped expert GEMMs (``torch._grouped_mm``; bfloat16 on the GPU) queue their
    weight gradient during the backward inside ``collecting`` and give autograd's at W."""
    from titan_dualpipe.weights.experts import DeferringExpertGemms
    from titan_dualpipe.weights.install import install
    from titan_dualpipe.weights.queue import WeightGradQueue

    dtype = torch.float32 if ON_CPU else torch.bfloat16
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(DEVICE)
    deferred, queue = copy.deepcopy(reference), WeightGradQueue()
    install(deferred, queue)
    x = torch.randn(4, 16, 64, device=DEVICE)
    reference(x).square().sum().backward()
    with queue.deferring():
        loss = deferred(x).square().sum()
    with queue.collecting((1, 0)):
        loss.backward()
    assert all(m.weight.grad is None for m in deferred if isinstance(m, nn.Linear)) and queue.pending() == {(1, 0): 2}
    queue.run((1, 0))
    for p, q in zip(deferred.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)

    experts = torch.randn(4, 64, 32, device=DEVICE, requires_grad=True)
    tokens = torch.randn(48, 64, device=DEVICE)
    offs = torch.tensor([16, 16, 32, 48], device=DEVICE, dtype=torch.int32)

    def grouped(queue: WeightGradQueue | None) -> torch.Tensor:
        a = tokens.to(dtype).requires_grad_()
        with DeferringExpertGemms(queue) if queue is not None else contextlib.nullcontext():
            out = torch._grouped_mm(a, experts.to(dtype), offs=offs)
        with queue.collecting((1, 1)) if queue is not None else contextlib.nullcontext():
            out.float().square().sum().backward()
        return a.grad

    want_input, want_weight = grouped(None), experts.grad.clone()
    experts.grad = None
    got_input = grouped(queue)
    assert experts.grad is None and queue.pending() == {(1, 1): 1}
    queue.run((1, 1))
    torch.testing.assert_close(got_input, want_input)
    torch.testing.assert_close(experts.grad, want_weight)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_deferred_weight_gemms_under_the_devices_autocast(dtype):
    """Deferred weight GEMMs under the device's autocast (CUDA's float16 default and bfloat16), with a
    tensor hook on each weight: the GEMMs run in autocast's dtype, each weight's gradient lands in
    its own dtype through autograd (the hook sees it once, whole), equal to plain autocast's."""
    from titan_dualpipe.weights.install import install
    from titan_dualpipe.weights.queue import WeightGradQueue

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(DEVICE)
    deferred, queue = copy.deepcopy(reference), WeightGradQueue()
    install(deferred, queue)
    seen: list[torch.dtype] = []
    for m in deferred:
        if isinstance(m, nn.Linear):
            m.weight.register_hook(lambda g: seen.append(g.dtype))
    x = torch.randn(4, 16, 64, device=DEVICE)
    with torch.autocast(DEVICE.type, dtype=dtype):
        reference(x).float().square().sum().backward()
        with queue.deferring():
            loss = deferred(x).float().square().sum()
    with queue.collecting((1, 0)):
        loss.backward()
    assert all(m.weight.grad is None for m in deferred if isinstance(m, nn.Linear)) and not seen
    queue.run((1, 0))
    assert seen == [torch.float32, torch.float32]
    for p, q in zip(deferred.parameters(), reference.parameters()):
        assert p.grad.dtype == p.dtype
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(ON_CPU, reason="streams: an accelerator's")
def test_the_relay_gives_its_helper_thread_its_own_stream_back():
    """A relayed pair runs its backward half on the helper thread in the caller's stream; after the
    pair the helper thread is on its own stream again."""
    side = torch.cuda.Stream()
    during, after = [], []
    helper = relay_module._helper_thread()
    done = threading.Event()
    helper.submit(lambda: (after.append(torch.cuda.current_stream()), done.set()))
    done.wait()
    own = after.pop()
    with torch.cuda.stream(side):
        relay_module.run_relayed(relay_module.hand_over, lambda: during.append(torch.cuda.current_stream()))
    done.clear()
    helper.submit(lambda: (after.append(torch.cuda.current_stream()), done.set()))
    done.wait()
    assert during == [side] and after == [own]
