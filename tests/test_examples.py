"""The scripts in ``examples/`` run as the pages say (``torchrun --nproc-per-node 2``, CPU, gloo)
and train what the same model trains without pipelining."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
COMPARISON = re.compile(r"^max abs difference to the model trained without pipelining: "
                        r"losses (\S+), parameters (\S+)$", re.M)


def test_every_example_is_linked_from_the_pages() -> None:
    assert [p.name for p in EXAMPLES] == ["dualpipe.py", "dualpipev.py"]
    pages = (ROOT / "README.md").read_text() + (ROOT / "docs" / "schedules.md").read_text()
    assert all(f"examples/{p.name})" in pages for p in EXAMPLES)


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_trains_like_the_model_without_pipelining(script: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script.relative_to(ROOT))], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    found = COMPARISON.search(done.stdout)
    assert found, done.stdout
    assert max(float(found.group(1)), float(found.group(2))) < 4e-5
