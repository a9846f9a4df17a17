"""Draw the schedule pictures of the README with ``titan-dualpipe draw``.

    python3 docs/make_pictures.py            # writes docs/dualpipe.png and docs/dualpipev.png
    python3 docs/make_pictures.py OUT_DIR    # the same pictures, into OUT_DIR

Run it with the project's venv (``.venv/bin/python docs/make_pictures.py``): drawing needs
matplotlib, the package's ``plot`` extra. Each picture is exactly the output of the command
printed before it; ``tests/test_docs.py`` runs this script and compares what it writes with
the committed pictures.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

# DeepSeek's own examples: DualPipe on 8 ranks with 20 microbatches (10 per direction),
# DualPipeV on 4 ranks (8 stages) with 10 microbatches; an overlapped pair costs less than F + B.
COSTS = "F=1,B=2,W=1,FB=2.5"
PICTURES = {
    "dualpipe.png": ["--schedule", "DualPipe", "--pp", "8", "--microbatches", "20", "--cost", COSTS],
    "dualpipev.png": ["--schedule", "DualPipeV", "--pp", "4", "--microbatches", "10", "--cost", COSTS],
}


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0]) if argv else Path(__file__).resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    from titan_dualpipe.cli import main as titan_dualpipe

    for name, args in PICTURES.items():
        command = ["draw", *args, "-o", str(out_dir / name)]
        print("titan-dualpipe " + shlex.join(command), flush=True)
        if titan_dualpipe(command) != 0:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
