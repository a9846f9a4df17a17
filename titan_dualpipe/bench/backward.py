"""``titan-dualpipe bench backward``: three ways to leave a stage's weight gradient to W, per AC mode.

Per microbatch of one stage of ``--blocks`` blocks (TinyLM attention + MLP, or torchtitan's Llama 3
debug blocks with ``--model titan``), under each activation-checkpointing mode (``none``, ``full``,
``selective``): ``deferred`` (one autograd pass at I, each ``nn.Linear``'s weight GEMM queued and
run at W: the schedules' default), ``torch split`` (``stage_backward_input`` at I,
``stage_backward_weight`` at W) and ``whole`` (the full backward at I, W nothing), each against a
plain ``loss.backward()`` of the same stage timed beside it in paired rounds. Printed per path:
times and ratios, checkpointed-region recomputations, live tensor bytes, the bytes held from I to
W and minor page faults. The columns: benchmarks/README.md#bench-backward.
"""

from __future__ import annotations

import contextlib

import argparse
import statistics
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..cli import HelpFormatter
from .stage_options import check_stage_sizes, emit
from ..weights.install import install
from ..weights.queue import WeightGradQueue
from ..runtime.timeline import clock_for, span_seconds
from ..testing.memory import LiveTensorBytes
from ..testing.model import AC_MODES, Block, checkpoint_block

PATHS = ("deferred", "torch split", "whole")
MODELS = ("tinylm", "titan")


def add_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("backward", help="deferred weight GEMMs vs torch's split vs whole at I, per AC mode",
                         description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", default="tinylm", help=f"block kind: {' or '.join(MODELS)} (torchtitan's Llama 3 debug blocks)")
    p.add_argument("--ac", default=",".join(AC_MODES), help="AC modes, comma-separated")
    p.add_argument("--blocks", type=int, default=4, help="blocks in the measured stage")
    p.add_argument("--dim", type=int, default=256, help="model width (tinylm)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per microbatch (rows x --seq)")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per round and path")
    p.add_argument("--rounds", type=int, default=5, help="paired rounds")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print only the JSON result")
    p.set_defaults(func=run)


def check_config(cfg: dict) -> None:
    """ValueError naming the offending option and its fix."""
    if cfg["model"] not in MODELS:
        raise ValueError(f"--model {cfg['model']!r}: give one of {', '.join(MODELS)}")
    unknown = [mode for mode in cfg["ac"] if mode not in AC_MODES]
    if unknown or not cfg["ac"]:
        raise ValueError(f"--ac {','.join(cfg['ac'])!r}: give AC modes from {', '.join(AC_MODES)}, comma-separated")
    check_stage_sizes(cfg)


# -- the stage ------------------------------------------------------------------------------

def _titan_blocks(n: int) -> tuple[list[nn.Module], int, Callable[[torch.Tensor], tuple]]:
    """The first ``n`` blocks of torchtitan 0.2.2's Llama 3 ``debugmodel`` (sdpa attention), its width,
    and what each block's forward takes after its input (rotary frequencies, no mask)."""
    try:
        from torchtitan.models.llama3 import Transformer, llama3_args
    except ImportError as err:
        raise ValueError(f"--model titan builds torchtitan 0.2.2's Llama 3 debug blocks ({err}); "
                         "install torchtitan 0.2.2, or give --model tinylm") from err
    args = llama3_args["debugmodel"]
    with torch.no_grad():
        model = Transformer(args)
    blocks = list(model.layers.values())[:n]
    if len(blocks) < n:
        raise ValueError(f"--blocks {n}: the debug model has {len(model.layers)} blocks; give at most that")
    freqs = model.freqs_cis
    return blocks, args.dim, lambda h: (freqs[: h.shape[1]], None)


class _Stage(nn.Module):
    def __init__(self, blocks: list[nn.Module], extra: Callable[[torch.Tensor], tuple]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.extra = extra

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h, *self.extra(h))
        return h


class _Recomputes:
    """Forwards of the stage's blocks run inside a backward (checkpoint recomputations)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.count = 0
        for block in blocks:  # a module inside the block: a recomputation calls the block's forward, not the block
            next(m for m in block.modules() if isinstance(m, nn.Linear)).register_forward_pre_hook(self._seen)

    def _seen(self, *_: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            self.count += 1


def _stage(cfg: dict, mode: str, path: str) -> tuple[nn.Module, int, _Recomputes, WeightGradQueue | None]:
    torch.manual_seed(0)
    if cfg["model"] == "titan":
        blocks, dim, extra = _titan_blocks(cfg["blocks"])
    else:
        dim = cfg["dim"]
        blocks, extra = [Block(dim, heads=4) for _ in range(cfg["blocks"])], (lambda h: ())
    recomputes = _Recomputes(blocks)
    stage = _Stage([checkpoint_block(b, mode) for b in blocks], extra)
    queue = None
    if path == "deferred":
        queue = WeightGradQueue()
        install(stage, queue)
    return stage, dim, recomputes, queue


# -- one microbatch, three paths -------------------------------------------------------------

class _Path:
    """One (AC mode, path): the stage and how its I and W run."""

    def __init__(self, cfg: dict, mode: str, path: str) -> None:
        self.path = path
        self.stage, self.dim, self.recomputes, self.queue = _stage(cfg, mode, path)
        self.plain = _stage(cfg, mode, "whole")[0]  # the same weights, no path installed: the full backward
        self.params = [p for p in self.stage.parameters() if p.requires_grad]
        rows = cfg["tokens"] // cfg["seq"]
        g = torch.Generator().manual_seed(2)
        self.inputs = [torch.randn(rows, cfg["seq"], self.dim, generator=g) for _ in range(cfg["microbatches"])]

    def _loss(self, h: torch.Tensor, stage: nn.Module | None = None) -> torch.Tensor:
        return F.mse_loss((stage or self.stage)(h), torch.zeros_like(h))

    def full(self, h: torch.Tensor) -> Callable[[], None]:
        loss = self._loss(h, self.plain)
        return loss.backward

    def split(self, h: torch.Tensor) -> tuple[Callable[[], Any], Callable[[], None]]:
        """I and W of ``h``'s backward (run in turn)."""
        with self.queue.deferring() if self.queue is not None else contextlib.nullcontext():
            loss = self._loss(h)
        if self.path == "whole":
            return loss.backward, lambda: None
        if self.path == "deferred":
            key = (0, 0)

            def backward_input() -> None:
                with self.queue.collecting(key):
                    loss.backward()

            return backward_input, lambda: self.queue.run(key)
        from .._compat.pipelining import stage_backward_input, stage_backward_weight

        groups: list = []
        return (lambda: groups.extend(stage_backward_input([loss], None, [h], iter(self.params))[1]),
                lambda: stage_backward_weight(iter(self.params), groups))

    def _input(self, mb: int) -> torch.Tensor:
        return self.inputs[mb].detach().clone().requires_grad_()

    def time(self) -> tuple[float, float, float, float, float]:
        """Per microbatch, means: seconds of the full backward, I and W; the process's minor page
        faults (first touches of memory the allocator got from the OS) in the full backward and in I + W."""
        clock, full_spans, spans = clock_for("cpu"), [], []
        full_faults = path_faults = 0
        for mb in range(len(self.inputs)):
            backward = self.full(self._input(mb))
            faults = _minor_faults()
            start = clock.mark()
            backward()
            full_spans.append((start, clock.mark()))
            full_faults += _minor_faults() - faults
            backward_input, backward_weight = self.split(self._input(mb))
            faults = _minor_faults()
            start = clock.mark()
            backward_input()
            middle = clock.mark()
            backward_weight()
            spans += [(start, middle), (middle, clock.mark())]
            path_faults += _minor_faults() - faults
        self.stage.zero_grad(set_to_none=True)
        self.plain.zero_grad(set_to_none=True)
        n = len(self.inputs)
        full = sum(end - start for start, end in span_seconds(clock, full_spans)) / n
        seconds = [end - start for start, end in span_seconds(clock, spans)]
        return full, sum(seconds[0::2]) / n, sum(seconds[1::2]) / n, full_faults / n, path_faults / n

    def memory_and_recomputes(self, blocks: int) -> dict:
        """One microbatch: peak live bytes over forward, I and W; bytes W frees; recomputations per block at I and W."""
        meter = LiveTensorBytes()
        with meter:
            backward_input, backward_weight = self.split(self._input(0))
            self.recomputes.count = 0
            backward_input()
            at_input, held = self.recomputes.count, meter.live
            backward_weight()
            at_weight, freed = self.recomputes.count - at_input, held - meter.live
        self.stage.zero_grad(set_to_none=True)
        return {"peak_bytes": meter.peak, "held_bytes": freed,
                "recomputes_at_I": at_input / blocks, "recomputes_at_W": at_weight / blocks}


def _minor_faults() -> int:
    """This process's minor page faults so far (0 where the OS does not count them)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _rounds(paths: dict[str, _Path], rounds: int) -> dict[str, list[tuple[float, float, float, float, float]]]:
    times: dict[str, list] = {name: [] for name in paths}
    names = list(paths)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(paths[name].time())
    return times


def _mode_rows(cfg: dict, mode: str) -> list[dict]:
    paths: dict[str, _Path] = {}
    rows = []
    for path in PATHS:
        candidate = _Path(cfg, mode, path)
        try:
            candidate.time()  # warm up; selective AC cannot run torch's split
        except RuntimeError as err:
            rows.append({"ac": mode, "path": path, "error": str(err).strip().splitlines()[0]})
            continue
        paths[path] = candidate
    times = _rounds(paths, cfg["rounds"])
    for path, samples in times.items():
        full = statistics.median(f for f, *_ in samples)
        rows.append({"ac": mode, "path": path, "full_s": full,
                     "I_s": statistics.median(i for _, i, *_ in samples),
                     "W_s": statistics.median(w for _, _, w, *_ in samples),
                     "ratio_to_full": statistics.median((i + w) / f for f, i, w, *_ in samples),
                     "W_over_I": statistics.median(w / i for _, i, w, *_ in samples),
                     "full_page_faults": statistics.median(s[3] for s in samples),
                     "page_faults": statistics.median(s[4] for s in samples),
                     **paths[path].memory_and_recomputes(cfg["blocks"])})
    return sorted(rows, key=lambda row: PATHS.index(row["path"]))


def measure(cfg: dict) -> dict:
    check_config(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg["threads"])
    try:
        rows = [row for mode in cfg["ac"] for row in _mode_rows(cfg, mode)]
    finally:
        torch.set_num_threads(threads)
    return {"rows": rows, "torch": torch.__version__, "config": cfg}


def run(args: argparse.Namespace) -> int:
    cfg = {k: getattr(args, k) for k in ("model", "blocks", "dim", "tokens", "seq", "microbatches", "rounds", "threads")}
    cfg["ac"] = [mode.strip() for mode in args.ac.split(",") if mode.strip()]
    return emit(measure(cfg), args.json, print_table)


def print_table(result: dict) -> None:
    cfg = result["config"]
    print(f"torch {result['torch']} on cpu, {cfg['blocks']} {cfg['model']} blocks, {cfg['tokens']} tokens (seq "
          f"{cfg['seq']}) per microbatch, {cfg['threads']} thread(s); per microbatch, medians of {cfg['rounds']} "
          f"paired rounds x {cfg['microbatches']} microbatches")
    print(f"{'AC':<10}{'path':<13}{'full s':>9}{'I s':>9}{'W s':>9}{'(I+W)/full':>11}{'W/I':>7}"
          f"{'recomp I/W':>12}{'peak MiB':>10}{'I->W MiB':>10}{'faults':>15}")
    for row in result["rows"]:
        if "error" in row:
            print(f"{row['ac']:<10}{row['path']:<13}  cannot run: {row['error'][:90]}")
            continue
        recomputes = f"{row['recomputes_at_I']:g} / {row['recomputes_at_W']:g}"
        print(f"{row['ac']:<10}{row['path']:<13}{row['full_s']:>9.4f}{row['I_s']:>9.4f}{row['W_s']:>9.4f}"
              f"{row['ratio_to_full']:>10.3f}x{row['W_over_I']:>7.2f}{recomputes:>12}"
              f"{row['peak_bytes'] / 2**20:>10.1f}{row['held_bytes'] / 2**20:>10.1f}"
              f"{row['page_faults']:>8.0f} / {row['full_page_faults']:<4.0f}")
    print("full s: the same stage's plain loss.backward() (same AC mode, nothing installed), timed beside each path. recomp I/W: checkpointed "
          "block forwards run inside the I and the W backward, per microbatch and block. peak MiB: live tensor "
          "bytes over one microbatch's forward, I and W; I->W MiB: what W frees (held from I to W). faults: the "
          "process's minor page faults in I + W / in the full backward (memory first touched: on the CPU a "
          "path that holds more pays them).")
