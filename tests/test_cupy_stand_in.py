"""The CuPy launchers of npnorm/kernels/cupy_fused.py on the CPU, through the NumPy stand-in
for CuPy in tools/cupy_stand_in (emulations of the CUDA kernels; see its README).

check.py runs each fused op against the generic kernels over random cases; mutants.py
checks that check.py catches launch bugs (and passes harmless variants). Both run in a
subprocess with the stand-in first on sys.path (check.py asserts that it imported the
stand-in, not a real CuPy), so that they run the same on a GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "cupy_stand_in")


def _run(script: str, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, os.path.join(TOOL, script), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return r, time.perf_counter() - t0


def test_fused_launchers_match_the_generic_kernels() -> None:
    r, secs = _run("check.py", "--cases", "120", "--seed", "7")
    out = f"{r.stdout}\n{r.stderr}\n({secs:.1f}s)"
    assert r.returncode == 0, out
    assert "PASSED" in r.stdout, out


def test_check_catches_launch_bugs() -> None:
    r, secs = _run("mutants.py", "--cases", "80")
    out = f"{r.stdout}\n{r.stderr}\n({secs:.1f}s)"
    assert r.returncode == 0, out
    assert "every mutant caught, every harmless variant passed" in r.stdout, out
    assert "caught" in r.stdout and "harmless" in r.stdout, out
