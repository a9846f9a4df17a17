"""Worker entry point: torchtitan's trainer with titan_dualpipe loaded.

    torchrun --nproc-per-node 2 -m titan_dualpipe.titan.train --job.config_file CONFIG.toml    # 0.2.2
    torchrun --nproc-per-node 2 -m titan_dualpipe.titan.train --module M --config NAME         # 0.3.0

Same as ``-m torchtitan.train`` except that the extension is imported first: on 0.2.2 even
when the TOML does not name it in ``[experimental] custom_import`` (which stays free for the
user's own), on 0.3.0 whichever ``--module`` holds the config.
"""

from __future__ import annotations


def main() -> None:
    import torchtitan.train as titan_train

    from titan_dualpipe.titan import GEN  # registers the schedules, CPU mode, dataset

    if GEN.registry:
        titan_train.main()
    else:
        titan_train.main(titan_train.Trainer)


if __name__ == "__main__":
    main()
