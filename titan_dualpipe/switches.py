"""Every ``TITAN_DUALPIPE_*`` environment variable, by name, in one place.

No imports and no side effects: the torchtitan adapter, the tools and the tests all read their
switches from here (``tests/test_docs.py`` checks that importing it imports no torch).
"""

# torchtitan training (:mod:`titan_dualpipe.titan`), both releases
FOLD_ENV = "TITAN_DUALPIPE_FOLD_TWINS"  # "0": DualPipe sums its twins by an exchange (titan.fold); unset or "1": folded into FSDP
TWO_BATCH_ENV = "TITAN_DUALPIPE_TWO_BATCH"  # "1": two-batch overlap on the MoE stages, "measured": where it pays (unset or "0": off)
WEIGHT_GRADIENTS_ENV = "TITAN_DUALPIPE_WEIGHT_GRADIENTS"  # "deferred" (unset: the config's, default), "deferred_compiled", "split" or "whole"
NOT_DEFERRED_ENV = "TITAN_DUALPIPE_NOT_DEFERRED"  # comma-separated module names / fnmatch patterns kept out of deferral
MIN_FLOPS_ENV = "TITAN_DUALPIPE_MIN_WEIGHT_GEMM_FLOPS"  # least FLOPs of a deferred weight GEMM where a schedule names none ("0": all; unset: the device's default)
COUNT_GROUPS_ENV = "TITAN_DUALPIPE_COUNT_GROUPS"  # "0": token counts on the expert-parallel group's communicator; unset or "1": their own
WEIGHT_GEMMS_IN_FLIGHT_ENV = "TITAN_DUALPIPE_WEIGHT_GEMMS_IN_FLIGHT"  # "0": a full backward computes its weight GEMMs inline; unset or "1": while its exchanges fly; "fill": as fillers
EXCHANGE_CHUNKS_ENV = "TITAN_DUALPIPE_EXCHANGE_CHUNKS"  # k: each MoE layer's dispatch and combine as k exchanges by groups of experts (unset or "1": one)
LONE_PAIRS_ENV = "TITAN_DUALPIPE_LONE_PAIRS"  # "1": adjacent lone actions of one direction run as relayed pairs (unset or "0": alone)
PAIR_FIRST_ENV = "TITAN_DUALPIPE_PAIR_FIRST"  # which half of a relayed pair runs first: "forward" (unset: the config's, default), "backward" or "measured"
OLD_WEIGHTS_IN_FLIGHT_ENV = "TITAN_DUALPIPE_WEIGHTS_IN_FLIGHT"  # the same, under its deprecated name

# what ``bench titan`` passes to its trainer processes (:mod:`titan_dualpipe.titan.bench_probe`)
BENCH_DIR_ENV = "TITAN_DUALPIPE_BENCH_DIR"  # where each rank writes its record; unset: no probe
EXCHANGE_S_ENV = "TITAN_DUALPIPE_BENCH_EXCHANGE_S"  # emulated seconds per expert all-to-all (CPU; "0": none)
CALIBRATE_ENV = "TITAN_DUALPIPE_BENCH_CALIBRATE"  # set: time every MoE block's forward and backward
COUNT_HAND_OVER_ENV = "TITAN_DUALPIPE_BENCH_COUNT_HAND_OVER"  # "1": hand over between posting token counts and reading them

# tests
CPU_STAND_IN_ENV = "TITAN_DUALPIPE_GPU_TESTS_ON_CPU"  # "1": tests/gpu run on CPU/gloo (the GPU kit never sets it)
TEST_PROBE_ENV = "TITAN_DUALPIPE_TEST_PROBE_DIR"  # folder: tests/cases/titan_probe.py records each rank's schedule there
TEST_KILL_ENV = "TITAN_DUALPIPE_TEST_KILL"  # "RANK:N": tests/cases/titan_probe.py makes that rank SIGKILL itself at its N-th forward
