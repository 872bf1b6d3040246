"""The examples in examples/ run and print what they promise."""

import pathlib
import subprocess
import sys

import pytest
from helpers import needs_extra

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))
NEEDS = {"train_digits.py": "demo"}  # the extra an example needs beyond the base install


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, id=p.name, marks=[needs_extra(NEEDS[p.name])] if p.name in NEEDS else [])
        for p in EXAMPLES
    ],
)
def test_example_runs(path):
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "False" not in out.stdout, out.stdout


def test_there_are_examples():
    assert len(EXAMPLES) >= 2
