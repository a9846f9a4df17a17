"""Create or update the project's virtual environment and run a command in it (standard library only).

    python3 titan_dualpipe/bootstrap.py train train_configs/debug_dualpipev.toml --nproc 2
    python3 titan_dualpipe/bootstrap.py test [pytest args...]
    python3 titan_dualpipe/bootstrap.py --torch 2.11.0 test -m "not titan_e2e"
    python3 titan_dualpipe/bootstrap.py --torchtitan 0.3.0 train debug_dualpipev --nproc 2

Without options the environment is ``.venv`` with torchtitan 0.2.2: a torch already in it is kept
if it is in the supported range (``pyproject.toml``), a venv without torch gets ``torch==2.13.0``
(the CPU build), and a torch outside the range stops with a message naming the range. ``--torch X``
uses ``.venv-torchX`` with exactly ``torch==X``; ``--torchtitan 0.3.0`` uses
``.venv-torch2.15.0-torchtitan0.3.0`` (torchtitan 0.3.0 with torch 2.15.0). Everything else comes
from ``pyproject.toml``; more in docs/development.md#bootstrap.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TORCH = "2.13.0"
EXTRAS = ("test", "plot")  # besides the torchtitan extra
# torchtitan release -> (pyproject extra that installs it, the torch it is tested with)
TORCHTITAN = {"0.2.2": ("titan", DEFAULT_TORCH), "0.3.0": ("titan030", "2.15.0")}
_TORCH_REQUIREMENT = re.compile(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"')


def supported_range() -> tuple[tuple[int, int], tuple[int, int]]:
    """``((low major, minor), (high major, minor))``, high exclusive, from pyproject.toml."""
    match = _TORCH_REQUIREMENT.search((ROOT / "pyproject.toml").read_text())
    if match is None:
        raise SystemExit("bootstrap: pyproject.toml has no torch>=X.Y,<X.Y requirement")
    low_major, low_minor, high_major, high_minor = map(int, match.groups())
    return (low_major, low_minor), (high_major, high_minor)


def range_text() -> str:
    (a, b), (c, d) = supported_range()
    return f"torch>={a}.{b},<{c}.{d}"


def in_range(version: str) -> bool:
    major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    low, high = supported_range()
    return low <= (major, minor) < high


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _run(*cmd: str | os.PathLike, env: dict[str, str] | None = None) -> None:
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT, env=env)


def _exact_torch_env() -> dict[str, str]:
    """pip's environment for a venv whose torch was asked for exactly (``--torch X``): without a
    machine-wide constraints file (``PIP_CONSTRAINT`` empties it), which may cap torch below X and
    would otherwise make the package's own install replace the torch just installed."""
    return {**os.environ, "PIP_CONSTRAINT": os.devnull}


def _torch_version(python: Path) -> str | None:
    probe = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def venv_name(torch: str | None, torchtitan: str | None) -> str:
    """``.venv``, ``.venv-torchX`` or ``.venv-torchX-torchtitanY``."""
    if torchtitan is None or torchtitan == "0.2.2":
        return ".venv" if torch is None else f".venv-torch{torch}"
    return f".venv-torch{torch or TORCHTITAN[torchtitan][1]}-torchtitan{torchtitan}"


def ensure_venv(torch: str | None = None, torchtitan: str | None = None) -> Path:
    """The environment's python, with the package, its extras and a supported torch installed.

    ``torch=None``: ``.venv``, keeping a supported torch already there. ``torch="X"``:
    ``.venv-torchX`` with ``torch==X``. ``torchtitan="0.3.0"``: torchtitan 0.3.0 with its
    tested torch (or ``torch``). Reinstalls only when pyproject.toml or torch changed.
    """
    if torch is not None and not in_range(torch):
        raise SystemExit(f"bootstrap: --torch {torch} is outside the supported range {range_text()}")
    if torchtitan is not None and torchtitan not in TORCHTITAN:
        raise SystemExit(f"bootstrap: --torchtitan {torchtitan}: tested releases are {', '.join(TORCHTITAN)}")
    extra, titan_torch = TORCHTITAN[torchtitan or "0.2.2"]
    if torchtitan is not None and torch is None:
        torch = titan_torch
    venv = ROOT / venv_name(torch, torchtitan)
    python = _venv_python(venv)
    if not python.exists():
        _run(sys.executable, "-m", "venv", venv)
    installed = _torch_version(python)
    if installed is not None and not in_range(installed) and torch is None:
        raise SystemExit(
            f"bootstrap: {venv.name} has torch {installed}, outside the supported range {range_text()}: "
            f"install a supported torch into it (e.g. {python} -m pip install 'torch=={DEFAULT_TORCH}') or remove it"
        )
    wanted = torch or installed or DEFAULT_TORCH
    stamp = venv / ".titan_dualpipe-installed"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + str(ROOT).encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest and installed is not None and _same(installed, wanted):
        return python
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    env = _exact_torch_env() if torch is not None else None
    if installed is None or not _same(installed, wanted):
        _run(*pip, f"torch=={wanted}", env=env)
    _run(*pip, "-e", f".[{','.join((extra, *EXTRAS))}]", env=env)
    stamp.write_text(digest)
    return python


def _same(installed: str, wanted: str) -> bool:
    """``2.13.0+cpu`` is ``2.13.0``."""
    return installed.split("+")[0] == wanted.split("+")[0]


def main(argv: list[str]) -> int:
    options: dict[str, str] = {}
    while argv[:1] in (["--torch"], ["--torchtitan"]) and len(argv) > 1:
        options[argv[0][2:]], argv = argv[1], argv[2:]
    if not argv or argv[0] not in ("train", "test", "run"):
        print(__doc__)
        return 2
    python = ensure_venv(options.get("torch"), options.get("torchtitan"))
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
