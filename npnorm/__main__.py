"""``python -m npnorm``: check every layer on every backend (see ``npnorm._selfcheck``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m npnorm", description=__doc__)
    parser.add_argument("--quiet", action="store_true", help="print nothing; exit status only")
    args = parser.parse_args(argv)
    from ._selfcheck import run

    return 0 if run(verbose=not args.quiet) else 1


if __name__ == "__main__":
    sys.exit(main())
