"""Worker entry point: torchtitan's trainer with titan_dualpipe loaded.

    torchrun --nproc-per-node 2 -m titan_dualpipe.titan.train --job.config_file CONFIG.toml    # 0.2.2
    torchrun --nproc-per-node 2 -m titan_dualpipe.titan.train --module M --config NAME         # 0.3.0

Same as ``-m torchtitan.train`` except that the extension is imported first: on 0.2.2 even
when the TOML does not name it in ``[experimental] custom_import`` (which stays free for the
user's own), on 0.3.0 whichever ``--module`` holds the config. In the runs
``titan-dualpipe bench titan`` starts (it names their folder in the environment), the bench's
probe is installed too (:mod:`.bench_probe`).
"""

from __future__ import annotations

import atexit
import os
import sys


def main() -> None:
    import torchtitan.train as titan_train

    from titan_dualpipe.titan import GEN  # registers the schedules, CPU mode, dataset
    from titan_dualpipe.titan import bench_probe

    bench_probe.install_from_env()  # only in runs `titan-dualpipe bench titan` starts
    if GEN.registry:
        titan_train.main()
    else:
        titan_train.main(titan_train.Trainer)
    _leave_finished_run()


def _leave_finished_run() -> None:
    """End a run that trained, saved and destroyed its process groups, skipping interpreter
    teardown. Tearing down with torch's communication threads still alive has aborted
    finished runs ("terminate called without an active exception" after torchtitan's
    "Process group destroyed", torch 2.14.1 with gloo), which torchrun reports as a failed
    job. Exit handlers (logging's flush among them) still run; an error raised by training
    never gets here and exits as usual."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
