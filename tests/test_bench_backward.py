"""``bench backward`` at a tiny size: every path runs or says why not, and what it counts holds."""

from __future__ import annotations

import pytest

from titan_dualpipe.bench import backward


def test_bench_backward_counts_recomputations_and_held_bytes():
    cfg = {"model": "tinylm", "ac": ["none", "full", "selective"], "blocks": 2, "dim": 32, "tokens": 64, "seq": 32,
           "microbatches": 2, "rounds": 1, "threads": 1}
    rows = {(r["ac"], r["path"]): r for r in backward.measure(cfg)["rows"]}
    assert set(rows) == {(ac, path) for ac in cfg["ac"] for path in backward.PATHS}
    assert "backward an extra time" in rows[("selective", "torch split")]["error"]
    for ac in ("full", "selective"):  # recomputed once, at I; deferral leaves a W and holds operands to it
        deferred = rows[(ac, "deferred")]
        assert (deferred["recomputes_at_I"], deferred["recomputes_at_W"]) == (1, 0)
        assert deferred["W_s"] > 0 and deferred["held_bytes"] > 0
        whole = rows[(ac, "whole")]
        assert whole["W_s"] < 1e-3 and whole["held_bytes"] <= 0 and whole["peak_bytes"] < deferred["peak_bytes"]
    assert rows[("full", "torch split")]["recomputes_at_W"] >= 1  # torch's W recomputes the region again
    assert all(rows[("none", path)]["recomputes_at_I"] == 0 for path in backward.PATHS)
    assert all(row["page_faults"] >= 0 and row["full_page_faults"] >= 0 for row in rows.values() if "error" not in row)


def test_page_faults_count_first_touches_of_fresh_memory():
    """The fault counter bench backward prints moves when memory new to the process is written
    (64 MiB: above glibc's largest mmap threshold, so fresh pages from the OS)."""
    import torch

    before = backward._minor_faults()
    fresh = torch.ones(2**24)
    assert backward._minor_faults() - before >= 16, "no page faults counted for 64 MiB first touched"
    del fresh


def test_bench_backward_names_bad_options():
    cfg = {"model": "tinylm", "ac": ["full"], "blocks": 1, "dim": 32, "tokens": 64, "seq": 32, "microbatches": 1,
           "rounds": 1, "threads": 1}
    with pytest.raises(ValueError, match=r"--ac 'later': give AC modes from none, full, selective"):
        backward.check_config({**cfg, "ac": ["later"]})
    with pytest.raises(ValueError, match=r"--model 'gpt': give one of tinylm, titan"):
        backward.check_config({**cfg, "model": "gpt"})
