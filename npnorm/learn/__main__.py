"""``python -m npnorm.learn ...``: the same command as ``python -m npnorm learn ...``."""

from __future__ import annotations

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
