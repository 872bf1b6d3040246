"""``python -m npnorm.learn ...``: the same command as ``python -m npnorm learn ...``."""

from __future__ import annotations

import sys

from ..__main__ import _exit, _run_to_a_pipe

if __name__ == "__main__":
    _exit(_run_to_a_pipe(["learn", *sys.argv[1:]]))
