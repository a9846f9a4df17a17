"""What the numerics suite, the simulator's real-run profile, the benchmarks and the tests share:
a small decoder-only model split into pipeline parts (:mod:`.model`), a spawner of local
process groups (:mod:`.spawn`) and a counter of compiled backward calls by profiler range
(:mod:`.compiled_calls`). Nothing here is imported by the schedules or the torchtitan adapter.
"""
