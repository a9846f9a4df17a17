"""The ``titan-dualpipe`` entry point's own messages: a file it cannot read or write, and what
``profile`` drew (the sub-commands' results are tested with their modules)."""

from __future__ import annotations

from titan_dualpipe.cli import main


def test_a_file_it_cannot_read_or_write_is_named_in_one_line(tmp_path, capsys):
    missing = tmp_path / "missing.csv"
    assert main(["simulate", "--csv", str(missing)]) == 2
    assert capsys.readouterr().err == f"titan-dualpipe simulate: error: {missing}: No such file or directory\n"
    out = tmp_path / "no_such_dir" / "order.csv"
    assert main(["csv", "--schedule", "DualPipeV", "--pp", "2", "--microbatches", "4", "-o", str(out)]) == 2
    assert capsys.readouterr().err == f"titan-dualpipe csv: error: {out}: No such file or directory\n"


def test_profile_without_output_says_how_to_draw(capsys):
    argv = ["profile", "--schedule", "DualPipeV", "--pp", "2", "--microbatches", "4", "--steps", "1",
            "--dim", "16", "--layers", "4", "--seq", "8"]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "no picture drawn: -o FILE (.png, .svg, .pdf) draws the measured timeline")
