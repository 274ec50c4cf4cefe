"""The book's Python code samples run: every script in ``docs/samples/`` (the pages include them
with ``{{#include ../../samples/NAME.py}}``) is run as its own process, from the repository
root, with this interpreter, and must exit with status 0. Each sample asserts what its page
claims, so a sample whose claim stops holding fails here."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = sorted((ROOT / "docs" / "samples").glob("*.py"))
TIMEOUT_S = 300  # a sample takes seconds; a hung one fails rather than stalls the suite


def test_there_are_samples():
    assert SAMPLES, f"no samples in {ROOT / 'docs' / 'samples'}"


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
def test_sample_runs(sample):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    done = subprocess.run([sys.executable, str(sample.relative_to(ROOT))], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, (
        f"{sample.relative_to(ROOT)} exited with {done.returncode}\n"
        f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    )
