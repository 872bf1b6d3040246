"""``python -m npnorm``: check every layer on every backend (see ``npnorm._selfcheck``).

``python -m npnorm bench [--quick] [--json FILE] [--reps N]``: time every layer (see
``npnorm._bench``).

``python -m npnorm profile [LAYER ...]``: the fast kernels' time per NumPy call site (see
``npnorm._profile``).

``python -m npnorm warmup [--json FILE]``: compile every numba kernel once (see
``npnorm._warmup``).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m npnorm", description=__doc__)
    parser.add_argument("--quiet", action="store_true", help="print nothing; exit status only")
    sub = parser.add_subparsers(dest="command")
    bench = sub.add_parser("bench", help="time every layer against textbook NumPy and PyTorch")
    bench.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    bench.add_argument("--json", metavar="FILE", help="save the figures as JSON")
    bench.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed rounds per shape, at least (default 3 quick, 5 full; full runs add rounds up to 10 s)",
    )
    prof = sub.add_parser("profile", help="the fast kernels' time per NumPy call, one thread")
    prof.add_argument("layers", nargs="*", help="LayerNorm, RMSNorm, BatchNorm2d, GroupNorm, InstanceNorm2d")
    prof.add_argument("--reps", type=int, default=5, help="forward+backward runs to average")
    warm = sub.add_parser("warmup", help="compile every numba kernel (float32, float64) into numba's cache")
    warm.add_argument("--json", metavar="FILE", help="save the times as JSON")
    args = parser.parse_args(argv)
    if args.command == "warmup":
        from ._warmup import run as run_warmup

        run_warmup(verbose=not args.quiet, json_path=args.json)
        return 0
    if args.command == "profile":
        from ._profile import run as run_profile

        run_profile(args.layers or None, reps=args.reps)
        return 0
    if args.command == "bench":
        from ._bench import run as run_bench

        run_bench(quick=args.quick, reps=args.reps, json_path=args.json)
        return 0
    from ._selfcheck import run

    return 0 if run(verbose=not args.quiet) else 1


if __name__ == "__main__":
    sys.exit(main())
