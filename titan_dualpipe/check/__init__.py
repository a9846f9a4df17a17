"""The numerics suite: every schedule and layout against a non-pipelined reference.

- :mod:`.numerics`: one case on the calling ranks (any device and backend).
- :mod:`.cli`: ``titan-dualpipe check --nproc N``, every case that fits N processes, as a table.
- :mod:`.matrix`: ``titan-dualpipe matrix``, torchtitan runs of each schedule against 1F1B.
- :mod:`.gpu_kit`: ``titan-dualpipe gpu-kit``, everything one GPU can prove, as a Markdown report.
"""
