"""``python -m npnorm.demo ...``: the same command as ``python -m npnorm demo ...``."""

from __future__ import annotations

import sys

from ..__main__ import _exit, _run_to_a_pipe

if __name__ == "__main__":
    _exit(_run_to_a_pipe(["demo", *sys.argv[1:]]))
