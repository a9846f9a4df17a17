"""Worker entry point: torchtitan's trainer with titan_dualpipe loaded.

    torchrun --nproc-per-node 2 -m titan_dualpipe.titan.train --job.config_file CONFIG.toml

Same as ``-m torchtitan.train`` except that the extension is imported even when the TOML
does not name it in ``[experimental] custom_import`` (which stays free for the user's own).
"""

from __future__ import annotations


def main() -> None:
    from torchtitan.train import Trainer, main as titan_main

    import titan_dualpipe.titan  # noqa: F401 - registers the schedules, CPU mode, dataset

    titan_main(Trainer)


if __name__ == "__main__":
    main()
