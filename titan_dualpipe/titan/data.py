"""The shipped dataset, and shipped-asset paths that work from any directory.

- The dataset name ``titan_dualpipe_tiny`` (0.2.2: ``[training] dataset``; 0.3.0:
  ``dataloader.dataset``) reads the generated corpus in ``titan_dualpipe/titan/assets/tiny_corpus``
  (found wherever the package is installed).
- A relative path in a config is relative to the working directory (torchtitan's rule). So that
  the debug configs also run from outside the repository, a relative path that does not exist
  there but starts with ``titan_dualpipe/`` is taken from the installed package instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .generation import GEN

ASSETS_DIR = Path(__file__).resolve().parent / "assets"  # written by make_assets.py
TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
DATASET_FILE = ASSETS_DIR / "tiny_corpus" / "train.jsonl"
DATASET_NAME = "titan_dualpipe_tiny"
PACKAGE_PARENT = ASSETS_DIR.parent.parent.parent


def _load_jsonl(path: str) -> Any:
    """A map-style ``datasets.Dataset`` (resumable by sample index) from a JSONL file or folder."""
    from datasets import Dataset

    file = Path(path)
    if file.is_dir():
        file = file / DATASET_FILE.name
    with file.open() as f:
        return Dataset.from_list([json.loads(line) for line in f if line.strip()])


def register_dataset() -> None:
    """Make ``titan_dualpipe_tiny`` a torchtitan dataset name (idempotent)."""
    from torchtitan.hf_datasets import DatasetConfig, text_datasets

    text_datasets.DATASETS.setdefault(
        DATASET_NAME,
        DatasetConfig(path=str(DATASET_FILE.parent), loader=_load_jsonl, sample_processor=lambda s: s["text"]),
    )


def resolve_asset_path(path: str | None) -> str | None:
    """``path`` itself, or the installed package's copy of a missing ``titan_dualpipe/...`` path."""
    if not path or os.path.isabs(path) or os.path.exists(path):
        return path
    parts = Path(path).parts  # "./x/y" -> ("x", "y")
    if parts and parts[0] == "titan_dualpipe":
        candidate = PACKAGE_PARENT.joinpath(*parts)
        if candidate.exists():
            return str(candidate)
    return path


def resolve_asset_paths(job_config: Any) -> None:
    """Resolve every path field of the installed torchtitan's config that may name shipped assets."""
    for dotted in GEN.asset_paths:
        *sections, key = dotted.split(".")
        options = job_config
        for section in sections:
            options = getattr(options, section, None)
        if options is not None and hasattr(options, key):
            setattr(options, key, resolve_asset_path(getattr(options, key)))
