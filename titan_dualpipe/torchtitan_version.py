"""Which torchtitan is installed and whether this package was tested with it.

Reads package metadata only (no torchtitan or torch import), so the ``titan-dualpipe``
command line can choose its path, or explain what is missing, before anything heavy loads.

The two tested releases are two generations of torchtitan's configuration:

- 0.2.2: TOML files (``--job.config_file``) and ``[experimental] custom_import``;
- 0.3.0: Python config functions in a ``config_registry`` module
  (``--module M --config NAME``), no TOML and no ``custom_import``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# torchtitan release -> the torch minor versions it is tested with (both ends included)
TESTED_TORCHTITAN: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "0.2.2": ((2, 11), (2, 14)),
    "0.3.0": ((2, 14), (2, 15)),
}
REGISTRY_RELEASES = ("0.3.0",)  # configs are config_registry functions, not TOMLs
INSTALL_HINT = "pip install 'titan_dualpipe[titan]' (torchtitan 0.2.2) or 'titan_dualpipe[titan030]' (torchtitan 0.3.0)"


def installed(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _minor(found: str) -> tuple[int, int]:
    major, minor = found.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torchtitan_version(found: str | None = None, torch: str | None = None) -> str:
    """``found`` (default: the installed torchtitan), or ImportError naming the tested releases.

    ``torch`` (default: the installed torch) must be one the release was tested with.
    """
    found = found or installed("torchtitan")
    if found is None:
        raise ImportError(f"titan_dualpipe.titan needs torchtitan: {INSTALL_HINT}")
    if found not in TESTED_TORCHTITAN:
        raise ImportError(
            f"titan_dualpipe.titan supports torchtitan {' and '.join(TESTED_TORCHTITAN)}; found torchtitan {found}. "
            f"Install a tested release: {INSTALL_HINT}."
        )
    torch = torch or installed("torch")
    low, high = TESTED_TORCHTITAN[found]
    if torch is not None and not low <= _minor(torch) <= high:
        span = f"{low[0]}.{low[1]}" if low == high else f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
        raise ImportError(
            f"titan_dualpipe.titan is tested with torchtitan {found} on torch {span}; found torch {torch}. "
            f"Install a tested pair (python3 titan_dualpipe/bootstrap.py --torchtitan {found} ... sets one up)."
        )
    return found


def uses_config_registry(release: str) -> bool:
    """True where configs are ``config_registry`` functions (0.3.0), False for TOMLs (0.2.2)."""
    return release in REGISTRY_RELEASES
