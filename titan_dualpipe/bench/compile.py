"""``titan-dualpipe bench compile``: what a torch.compile'd stage's backward costs split into I and W.

Our schedules run a compiled stage's backward whole at its I by default (its W does nothing);
``weight_gradients="deferred_compiled"`` runs it once at I with the blocks' weight GEMMs queued for
W; torch's split (``stage_backward_input``, then ``stage_backward_weight``, possible only with
``donated_buffer = False``) runs the compiled backward twice. Per microbatch of one stage of
``--blocks`` blocks: ``full`` (a plain backward), ``runtime`` (I and W as our runtime runs them, read
from a one-process ``ScheduleDualPipeV``'s timeline), ``deferred_compiled`` and ``torch split``,
each compiled and eager (the control), in paired, interleaved rounds (medians of per-round ratios).
``--device cuda`` times on the GPU with CUDA events. More: benchmarks/README.md#bench-compile and
docs/compile.md.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from .._compat.compile import donated_buffers_off
from ..cli import HelpFormatter
from .stage_options import check_stage_sizes, emit
from ..runtime.timeline import clock_for, span_seconds
from ..testing.compiled_calls import compiled_backwards_by_range
from ..testing.model import Block, compile_blocks

MODELS = ("mlp", "tinylm")
DEVICES = ("cpu", "cuda")
BACKENDS = ("inductor", "aot_eager")
KINDS = ("compiled", "eager")
VARIANTS = ("full", "runtime", "deferred_compiled", "torch split")
Key = tuple[str, str]  # (kind, variant)
Sample = tuple[float, float, float]  # seconds per microbatch: (I + W, or the full backward; I; W)


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("compile", help="a compiled stage's backward: whole at I (ours), its weight GEMMs deferred, torch's I/W split",
                         description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default="mlp", help=f"block kind: {' or '.join(MODELS)} (TinyLM's attention + MLP)")
    p.add_argument("--blocks", type=int, default=4, help="blocks in the measured stage")
    p.add_argument("--dim", type=int, default=256, help="model width")
    p.add_argument("--tokens", type=int, default=512, help="tokens per microbatch (rows x --seq)")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per round and variant")
    p.add_argument("--rounds", type=int, default=7, help="paired rounds")
    p.add_argument("--backend", default="inductor", help=f"torch.compile backend: {' or '.join(BACKENDS)}")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help=f"{' or '.join(DEVICES)}: where the stage computes")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.set_defaults(func=run)


class MLPBlock(nn.Module):
    """Residual MLP: ``h + w2(gelu(w1(h)))``, hidden width 4 x dim."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.w2(F.gelu(self.w1(h)))


def check_config(cfg: dict) -> None:
    """ValueError naming the offending option and its fix."""
    if cfg["model"] not in MODELS:
        raise ValueError(f"--model {cfg['model']!r}: give one of {', '.join(MODELS)}")
    if cfg["backend"] not in BACKENDS:
        raise ValueError(f"--backend {cfg['backend']!r}: give one of {', '.join(BACKENDS)}")
    check_stage_sizes(cfg)
    device = cfg.get("device", "cpu")
    if device not in DEVICES:
        raise ValueError(f"--device {device!r}: give one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; give --device cpu")


def _blocks(cfg: dict) -> nn.Sequential:
    """The measured stage: ``cfg['blocks']`` blocks, seeded so every kind starts from the same weights."""
    torch.manual_seed(0)
    make: Callable[[], nn.Module] = ((lambda: MLPBlock(cfg["dim"])) if cfg["model"] == "mlp"
                                     else (lambda: Block(cfg["dim"], heads=4)))
    return nn.Sequential(*[make() for _ in range(cfg["blocks"])])



@contextlib.contextmanager
def one_rank_group(device: torch.device = torch.device("cpu")) -> Iterator[None]:
    """This process as a group of one rank (gloo; NCCL for a CUDA device), unless it already has a group."""
    if dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        if device.index is None:  # init_process_group's device_id needs an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _io_order(n: int) -> dict[int, list]:
    """A one-rank DualPipeV order whose stage 1 runs I then W for every microbatch."""
    from .._compat.pipelining import F as FWD, I, W, _Action

    actions = []
    for mb in range(n):
        actions += [_Action(0, FWD, mb), _Action(1, FWD, mb), _Action(1, I, mb), _Action(1, W, mb),
                    _Action(0, I, mb), _Action(0, W, mb)]
    return {0: actions}


def _io_pipeline(head: nn.Module, stage: nn.Module, n: int, device: torch.device = torch.device("cpu"),
                 weight_gradients: str = "deferred") -> Any:
    """Our one-rank ``ScheduleDualPipeV`` over ``head`` (stage 0) and ``stage`` (stage 1), recording
    its timeline and running :func:`_io_order`: every microbatch's I and W of stage 1 are actions."""
    from torch.distributed.pipelining import PipelineStage

    from .. import ScheduleDualPipeV

    stages = [PipelineStage(head, 0, 2, device), PipelineStage(stage, 1, 2, device)]
    pipeline = ScheduleDualPipeV(stages, n, loss_fn=_loss, record_timeline=True, overlap=False,
                                 weight_gradients=weight_gradients)
    pipeline.pipeline_order = _io_order(n)
    pipeline._prepare_schedule_with_comms(pipeline.pipeline_order)  # our own lowering of an order
    return pipeline


class _Kind:
    """One kind (compiled or eager): the stage, its torch-split copy and its one-rank pipeline."""

    def __init__(self, kind: str, cfg: dict, batch: torch.Tensor, target: torch.Tensor) -> None:
        self.kind, self.cfg, self.n = kind, cfg, cfg["microbatches"]
        self.device = torch.device(cfg.get("device", "cpu"))
        self.batch, self.target = batch.to(self.device), target.to(self.device)
        compiled = kind == "compiled"
        self.stage = _blocks(cfg).to(self.device)
        self.split_copy, self.deferring_copy = copy.deepcopy(self.stage), copy.deepcopy(self.stage)
        self.split_scope = donated_buffers_off if compiled else contextlib.nullcontext
        if compiled:
            compile_blocks(self.stage, cfg["backend"])
            compile_blocks(self.deferring_copy, cfg["backend"])
            with self.split_scope():
                compile_blocks(self.split_copy, cfg["backend"])
        torch.manual_seed(1)
        head = nn.Linear(cfg["dim"], cfg["dim"]).to(self.device)  # stage 0: eager, so stage 1's input needs a gradient
        # by weight_gradients mode: the pipeline's two stage modules and the pipeline
        self.pipelines: dict[str, tuple[tuple[nn.Module, nn.Module], Any]] = {}
        for mode, stage, first in (("deferred", self.stage, head), ("deferred_compiled", self.deferring_copy,
                                                                     copy.deepcopy(head))):
            self.pipelines[mode] = (stage, first), _io_pipeline(first, stage, self.n, self.device, weight_gradients=mode)

    def _microbatches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        rows = self.batch.shape[0] // self.n
        for mb in range(self.n):
            h = self.batch[mb * rows:(mb + 1) * rows].detach().clone().requires_grad_()
            yield h, self.target[mb * rows:(mb + 1) * rows]

    def full(self) -> Sample:
        """Mean seconds per microbatch of a plain full backward: (full, 0, 0)."""
        self.stage.zero_grad(set_to_none=True)
        clock, spans = clock_for(self.device), []
        for h, y in self._microbatches():
            loss = _loss(self.stage(h), y)
            start = clock.mark()
            loss.backward()
            spans.append((start, clock.mark()))
        return sum(end - start for start, end in span_seconds(clock, spans)) / self.n, 0.0, 0.0

    def runtime(self, mode: str = "deferred") -> Sample:
        """Mean seconds per microbatch of stage 1's I and W actions in one pipeline step under
        ``weight_gradients=mode``: (I + W, I, W)."""
        from .._compat.pipelining import I, W

        modules, pipeline = self.pipelines[mode]
        for module in modules:
            module.zero_grad(set_to_none=True)
        batch = self.batch.detach()  # stage 0 takes it; stage 1's input gets its gradient from stage 0
        pipeline.step(batch, target=self.target)
        spent = {I: 0.0, W: 0.0}
        for event in pipeline.collect_timeline():
            if event.action.stage_index == 1 and event.action.computation_type in spent:
                spent[event.action.computation_type] += event.end - event.start
        i, w = spent[I] / self.n, spent[W] / self.n
        return i + w, i, w

    def torch_split(self) -> Sample:
        """Mean seconds per microbatch of torch's split backward: (I + W, I, W)."""
        from .._compat.pipelining import stage_backward_input, stage_backward_weight

        module = self.split_copy
        module.zero_grad(set_to_none=True)
        clock, spans = clock_for(self.device), []
        with self.split_scope():
            for h, y in self._microbatches():
                loss = _loss(module(h), y)
                start = clock.mark()
                with record_function(SPLIT_RANGES["I"]):
                    _, groups = stage_backward_input([loss], None, [h], module.parameters())
                middle = clock.mark()
                with record_function(SPLIT_RANGES["W"]):
                    stage_backward_weight(module.parameters(), groups)
                spans += [(start, middle), (middle, clock.mark())]
        seconds = [end - start for start, end in span_seconds(clock, spans)]
        i, w = sum(seconds[0::2]), sum(seconds[1::2])
        return (i + w) / self.n, i / self.n, w / self.n

    def variant(self, name: str) -> Callable[[], Sample]:
        return {"full": self.full, "runtime": self.runtime, "deferred_compiled": lambda: self.runtime("deferred_compiled"),
                "torch split": self.torch_split}[name]


SPLIT_RANGES = {"I": "split:I", "W": "split:W"}  # profiler ranges around the two parts of torch's split backward


def backward_calls_at(counts: dict[str, int], stage_index: int = 1) -> dict[str, int]:
    """``{'I': n, 'W': n, 'all': n}`` from :func:`compiled_backwards_by_range`: the calls inside
    ``stage_index``'s I and W actions (or the ``split:`` ranges), and all of them."""
    def at(kind: str) -> int:
        return sum(n for name, n in counts.items()
                   if name == SPLIT_RANGES[kind] or name.startswith(f"PP:{stage_index}{kind}"))
    return {"I": at("I"), "W": at("W"), "all": sum(counts.values())}


def _warm_up(kinds: dict[str, _Kind]) -> tuple[list[Key], dict[Key, str]]:
    """Run every (kind, variant) once (compilation, shape inference, allocator). Returns the
    keys that ran and, for a compiled torch split this torch cannot run (2.11: its split of a
    compiled graph fails in ``stage_backward_input`` even without donated buffers), why not."""
    keys, failed = [], {}
    for kind in kinds:
        for variant in VARIANTS:
            try:
                kinds[kind].variant(variant)()
            except RuntimeError as err:
                if (kind, variant) != ("compiled", "torch split"):
                    raise
                failed[(kind, variant)] = f"{type(err).__name__}: {_first_line(err)}"
                continue
            keys.append((kind, variant))
    return keys, failed


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _rounds(kinds: dict[str, _Kind], keys: list[Key], rounds: int) -> dict[Key, list[Sample]]:
    """Paired rounds: each times every (kind, variant) of ``keys`` once, in an order rotated round by round."""
    times: dict[Key, list[Sample]] = {key: [] for key in keys}
    for r in range(rounds):
        for kind, variant in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[(kind, variant)].append(kinds[kind].variant(variant)())
    return times


def _summary(times: dict[Key, list[Sample]], calls: dict[Key, dict[str, int]], failed: dict[Key, str],
             cfg: dict) -> list[dict]:
    """Per (kind, variant): medians over rounds, the median of the per-round ratio to the same
    kind's full backward, and the compiled backward calls per microbatch and block (at I, at W,
    in all) from one more untimed run; a variant that could not run gives its error instead."""
    rows = []
    per = cfg["microbatches"] * cfg["blocks"]
    for kind in KINDS:
        full = [f for f, _, _ in times[(kind, "full")]]
        for variant in VARIANTS:
            if (kind, variant) in failed:
                rows.append({"kind": kind, "variant": variant, "full_s": statistics.median(full),
                             "error": failed[(kind, variant)]})
                continue
            samples = times[(kind, variant)]
            ratios = [total / base for (total, _, _), base in zip(samples, full)]
            rows.append({"kind": kind, "variant": variant, "full_s": statistics.median(full),
                         "total_s": statistics.median(t for t, _, _ in samples),
                         "I_s": statistics.median(i for _, i, _ in samples) if variant != "full" else None,
                         "W_s": statistics.median(w for _, _, w in samples) if variant != "full" else None,
                         "ratio_to_full": statistics.median(ratios),
                         "compiled_backwards_per_microbatch_and_block": {
                             key: n / per for key, n in calls[(kind, variant)].items()}})
    return rows


def measure(cfg: dict) -> dict:
    """Warm up (compiles), time the paired rounds, count compiled backward calls; returns the
    rows of :func:`_summary`, the torch version and the config."""
    check_config(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg["threads"])
    try:
        with one_rank_group(torch.device(cfg.get("device", "cpu"))):
            g = torch.Generator().manual_seed(2)
            rows = cfg["tokens"] // cfg["seq"]
            shape = (rows * cfg["microbatches"], cfg["seq"], cfg["dim"])
            batch, target = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
            kinds = {kind: _Kind(kind, cfg, batch, target) for kind in KINDS}
            keys, failed = _warm_up(kinds)
            times = _rounds(kinds, keys, cfg["rounds"])
            calls = {(kind, variant): backward_calls_at(compiled_backwards_by_range(kinds[kind].variant(variant)))
                     for kind, variant in keys}
    finally:
        torch.set_num_threads(threads)
    return {"rows": _summary(times, calls, failed, cfg), "torch": torch.__version__, "config": cfg}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def run(args: argparse.Namespace) -> int:
    cfg = {k: getattr(args, k) for k in ("model", "blocks", "dim", "tokens", "seq", "microbatches", "rounds",
                                         "backend", "threads", "device")}
    return emit(measure(cfg), args.json, print_table)


def print_table(result: dict) -> None:
    """The rows of :func:`measure` as a table, one line per (kind, variant) besides the full backwards."""
    cfg = result["config"]
    print(f"torch {result['torch']} on {cfg.get('device', 'cpu')}, backend {cfg['backend']}, {cfg['blocks']} {cfg['model']} blocks, "
          f"dim {cfg['dim']}, "
          f"{cfg['tokens']} tokens (seq {cfg['seq']}) per microbatch, {cfg['threads']} thread(s); per microbatch, "
          f"medians of {cfg['rounds']} paired rounds x {cfg['microbatches']} microbatches")
    print(f"{'variant':<28}{'full s':>9}{'I s':>9}{'W s':>9}{'(I+W)/full':>12}{'compiled bwd at I/W':>21}")
    for row in result["rows"]:
        if row["variant"] == "full":
            continue
        name = f"{row['kind']} {row['variant']}"
        if "error" in row:
            print(f"{name:<28}{_fmt(row['full_s']):>9}  cannot run here: {row['error'][:100]}")
            continue
        calls = row["compiled_backwards_per_microbatch_and_block"]
        print(f"{name:<28}{_fmt(row['full_s']):>9}{_fmt(row['I_s']):>9}"
              f"{_fmt(row['W_s']):>9}{row['ratio_to_full']:>11.3f}x{calls['I']:>17g} / {calls['W']:g}")
    print("full s: the same kind's plain full backward. runtime: stage 1's I and W actions in our runtime's "
          "timeline (a compiled stage: whole backward at I, W a no-op; an eager one: weight GEMMs deferred to W); "
          "deferred_compiled: the same with weight_gradients=\"deferred_compiled\" (compiled: one compiled backward "
          "at I, the weight GEMMs at W). torch split: "
          "stage_backward_input + stage_backward_weight (compiled: donated_buffer=False). (I+W)/full: median of "
          "per-round ratios. compiled bwd at I/W: compiled backward calls per microbatch and block.")
