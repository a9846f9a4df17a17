"""``titan-dualpipe bench compile`` at a tiny size (aot_eager): its table's structure, and the
deterministic part of what it measures, the compiled backward calls per microbatch: one, at I,
for a compiled stage under our runtime (the whole backward at I, or with its weight GEMMs
deferred to W); two (one at I, one at W) under torch's split
(where this torch can split a compiled graph at all)."""

from __future__ import annotations

import json
import math

import pytest

from titan_dualpipe.bench.compile import KINDS, VARIANTS, check_config

TINY = ["--backend", "aot_eager", "--blocks", "2", "--dim", "16", "--tokens", "16", "--seq", "8",
        "--microbatches", "2", "--rounds", "1"]


def test_compiled_stage_runs_one_backward_at_input_and_torch_split_two(capsys):
    from titan_dualpipe.cli import main

    assert main(["bench", "compile", *TINY, "--json"]) == 0
    rows = {(row["kind"], row["variant"]): row for row in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {(kind, variant) for kind in KINDS for variant in VARIANTS}

    def calls(kind: str, variant: str) -> dict:
        return rows[(kind, variant)]["compiled_backwards_per_microbatch_and_block"]

    assert calls("compiled", "full") == {"I": 0, "W": 0, "all": 1}
    assert calls("compiled", "runtime") == {"I": 1, "W": 0, "all": 1}  # whole at I, W a no-op
    # deferred_compiled: one compiled backward at I; W runs the queued weight GEMMs outside the graph
    assert calls("compiled", "deferred_compiled") == {"I": 1, "W": 0, "all": 1}
    split = rows[("compiled", "torch split")]
    if "error" in split:  # torch 2.11: its split of a compiled graph fails outright
        assert split["error"].startswith("RuntimeError"), split
        del rows[("compiled", "torch split")]
    else:
        assert calls("compiled", "torch split") == {"I": 1, "W": 1, "all": 2}  # the compiled backward twice
    assert all(calls("eager", variant)["all"] == 0 for variant in VARIANTS)
    for (kind, variant), row in rows.items():
        assert row["full_s"] > 0 and math.isfinite(row["ratio_to_full"]) and row["ratio_to_full"] > 0, row
        if variant == "full":
            assert row["ratio_to_full"] == 1.0 and row["I_s"] is None and row["W_s"] is None
        else:
            assert row["I_s"] > 0 and row["W_s"] >= 0 and row["total_s"] == pytest.approx(row["I_s"] + row["W_s"])


@pytest.mark.parametrize("change,named", [({"backend": "eager"}, "--backend 'eager'"), ({"model": "moe"}, "--model"),
                                          ({"tokens": 20}, "--tokens 20"), ({"blocks": 0}, "--blocks 0"),
                                          ({"model": "tinylm", "dim": 18}, "--dim 18")])
def test_bad_options_are_named(change, named):
    cfg = {"model": "mlp", "blocks": 2, "dim": 16, "tokens": 16, "seq": 8, "microbatches": 2, "rounds": 1,
           "backend": "aot_eager", "threads": 1} | change
    with pytest.raises(ValueError, match=named):
        check_config(cfg)


def test_a_cuda_group_of_one_is_bound_to_an_indexed_device(monkeypatch):
    """NCCL's eager init (``device_id``) needs a device with an index; ``--device cuda`` gives none."""
    import torch
    import torch.distributed as dist

    from titan_dualpipe.bench.compile import one_rank_group

    calls: dict = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.update(set_device=device))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.update(destroyed=True))
    with one_rank_group(torch.device("cuda")):
        pass
    assert calls["backend"] == "nccl" and calls["device_id"] == torch.device("cuda", 3), calls
    assert calls["set_device"] == torch.device("cuda", 3) and calls["destroyed"], calls
