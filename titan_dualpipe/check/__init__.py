"""The numerics suite: every schedule and layout against a non-pipelined reference.

- :mod:`.numerics`: one case on the calling ranks (any device and backend).
- :mod:`.cli`: ``titan-dualpipe check --nproc N``, every case that fits N processes, as a table.
"""
