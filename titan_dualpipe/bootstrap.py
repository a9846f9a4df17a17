"""Create or update the project's ``.venv`` and run a command in it (standard library only).

    python3 titan_dualpipe/bootstrap.py train train_configs/debug_dualpipev.toml --nproc 2
    python3 titan_dualpipe/bootstrap.py test [pytest args...]

torch is installed as ``torch==2.13.0`` (the CPU build) only when the venv has none, so an
existing CUDA build of 2.13 is kept; everything else comes from ``pyproject.toml``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
EXTRAS = "titan,test,plot"


def _venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _run(*cmd: str | os.PathLike) -> None:
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def _has_torch(python: Path) -> bool:
    return subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode == 0


def ensure_venv() -> Path:
    """Make ``.venv`` hold the package and its extras; reinstall only when pyproject changes."""
    python = _venv_python()
    if not python.exists():
        _run(sys.executable, "-m", "venv", VENV)
    stamp = VENV / ".titan_dualpipe-installed"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest and _has_torch(python):
        return python
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if not _has_torch(python):
        _run(*pip, "torch==2.13.0")
    _run(*pip, "-e", f".[{EXTRAS}]")
    stamp.write_text(digest)
    return python


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("train", "test", "run"):
        print(__doc__)
        return 2
    python = ensure_venv()
    command, rest = argv[0], argv[1:]
    if command == "test":
        args = [python, "-m", "pytest", "-q", *rest]
    elif command == "run":
        args = [python, *rest]
    else:
        args = [python, "-m", "titan_dualpipe", "train", *rest]
    return subprocess.run([str(a) for a in args], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
