"""What the numerics suite, the simulator's real-run profile, the benchmarks and the tests share:
a small decoder-only model split into pipeline parts (:mod:`.model`) and a spawner of local
process groups (:mod:`.spawn`). Nothing here is imported by the schedules or the torchtitan adapter.
"""
