"""What the numerics suite, the simulator's real-run profile, the benchmarks and the tests share:
a small decoder-only model cut into pipeline parts (:mod:`.model`), a spawner of local
process groups (:mod:`.spawn`), a counter of compiled backward calls by profiler range
(:mod:`.compiled_calls`) and of live tensor bytes (:mod:`.memory`). Nothing here is imported by
the schedules or the torchtitan adapter.
"""
