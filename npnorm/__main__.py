"""``python -m npnorm``: check every layer on NumPy and on the backends found of
array_api_strict, torch and cupy (see ``npnorm._selfcheck``).

``python -m npnorm bench [--quick] [--cold] [--reuse-memory] [--json FILE] [--reps N]``: time
every layer (see ``npnorm._bench``).

``python -m npnorm profile [LAYER ...]``: the fast kernels' time per NumPy call site (see
``npnorm._profile``).

``python -m npnorm gpu-check OUT_DIR``: on a GPU machine, the cupy tests, the main job and a GPU
benchmark, with a report written into OUT_DIR (see ``npnorm._gpu_check``).

``python -m npnorm learn [LAYER | bessel | sync_batch_norm | check EXERCISE] [...]``: every backward derived
node by node and checked step by step (see ``npnorm.learn``; ``learn --help`` for the options).

``python -m npnorm demo [--quick] [--out DIR] [--norms ...] [--seed N]``: train on digits with
every norm, print a table and write figures (see ``npnorm.demo``; needs the ``demo`` extra).

``python -m npnorm warmup [--json FILE]``: compile every numba kernel once (see
``npnorm._warmup``).

``--quiet``, before or after the command: nothing on standard output; the exit status tells.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

PROFILED = ("LayerNorm", "RMSNorm", "BatchNorm2d", "GroupNorm", "InstanceNorm2d")  # _bench.FULL's layers


def _int_at_least(least: int, what: str) -> Callable[[str], int]:
    """argparse type: an integer of at least ``least``, called ``what`` in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")  # a count
_non_negative_int = _int_at_least(0, "a non-negative integer")  # a seed, a count that may be 0


def _output_file(path: str) -> str:
    """argparse type: a file that can be written, checked before the command's work (a
    bad ``--json`` path failed with a traceback after it, 36 s into a cold warmup)."""
    folder = os.path.dirname(path) or "."
    if not path:  # (nothing was written, and nothing said)
        raise argparse.ArgumentTypeError("an empty file name")
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a folder, not a file")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {path}: no folder {folder}")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {path}: the folder {folder} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):  # (found after the work, before)
        raise argparse.ArgumentTypeError(f"cannot write {path}: the file is not writable")
    return path


def _output_folder(path: str) -> str:
    """argparse type: a folder that exists or can be made, checked before the command's
    work (an impossible one failed with a traceback after it). A trial makes the missing
    folders and removes them again: the command makes them when it writes."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a file, not a folder")
    missing = []
    head = os.path.abspath(path)
    while not os.path.exists(head):
        missing.append(head)
        head = os.path.dirname(head)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot make the folder {path}: {err.strerror}") from None
    writable = os.access(path, os.W_OK)
    for folder in missing:  # the deepest first
        os.rmdir(folder)
    if not writable:
        raise argparse.ArgumentTypeError(f"cannot write in the folder {path}")
    return path


def _seconds(text: str) -> float:
    """argparse type: a positive number of seconds (-5 was taken, and 0 meant the default)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):  # (inf was taken: "limit inf s")
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text}")
    return value


def _stages(text: str) -> list[str]:
    """argparse type: gpu-check's stages, a non-empty subset of tests,main,bench (an error
    printed the top-level usage)."""
    from ._gpu_check import STAGES

    stages = [s.strip() for s in text.split(",") if s.strip()]
    if not stages or any(s not in STAGES for s in stages):
        raise argparse.ArgumentTypeError(f"expected a subset of {','.join(STAGES)}, got {text!r}")
    return list(dict.fromkeys(stages))  # each once, in the order given (tests,main,tests ran tests twice)


def _profiled(name: str) -> str:
    """argparse type: one of the layers ``profile`` times (argparse's ``choices`` refuses
    an empty list of them in Python 3.11)."""
    if name not in PROFILED:
        raise argparse.ArgumentTypeError(f"unknown layer {name!r} (choose from {', '.join(PROFILED)})")
    return name


def _silenced(quiet: bool) -> contextlib.AbstractContextManager[Any]:
    """``--quiet``: standard output discarded (errors still reach standard error)."""
    return contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext()


class _Command(argparse.ArgumentParser):
    """A command's parser, which takes ``--quiet`` after the command too (``bench --quiet``),
    set only where given (before the command, the main parser's sets it)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_argument(
            "--quiet", action="store_true", default=argparse.SUPPRESS, help="as --quiet before the command"
        )

    def parse_known_args(  # type: ignore[override]  # (typeshed overloads it on namespace)
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """An argument the command does not take is refused with the command's usage (the
        main parser's, which argparse printed, does not show the command's options)."""
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from ._threads import ENV_VAR as THREADS_VAR
    from ._threads import get_num_threads
    from .functional._dispatch import ENV_VAR, get_kernels

    # a wrong value of either variable is a usage error, said in one line (not a traceback);
    # --help prints the help all the same
    asks_help = any(a == "-h" or (len(a) >= 3 and "--help".startswith(a)) for a in argv)  # (argparse: --he)
    for name, read in ((ENV_VAR, get_kernels), (THREADS_VAR, get_num_threads)):
        if os.environ.get(name) and not asks_help:
            try:
                read()
            except ValueError as err:
                print(f"python -m npnorm: {err}", file=sys.stderr)
                return 2
    skip = 0  # leading --quiet, as argparse takes it (--qui, and more than once)
    while skip < len(argv) and len(argv[skip]) >= 3 and "--quiet".startswith(argv[skip]):
        skip += 1
    if argv[skip : skip + 1] == ["learn"]:  # its own options (python -m npnorm learn --help)
        from .learn._cli import main as run_learn

        with _silenced(skip > 0 and not asks_help):  # (help is printed, as other commands' is)
            return run_learn(argv[skip + 1 :])
    parser = argparse.ArgumentParser(
        prog="python -m npnorm",
        description=(__doc__ or "").replace("``", ""),  # its paragraphs as written, without markup
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="print nothing on standard output, whatever the command; the exit status tells "
        "(errors still go to standard error)",
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Command)
    bench = sub.add_parser("bench", help="time every layer against textbook NumPy and PyTorch")
    bench.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    bench.add_argument("--json", metavar="FILE", type=_output_file, help="save the figures as JSON")
    bench.add_argument(
        "--reps",
        type=_positive_int,
        default=None,
        help="timed rounds per shape, at least (default 3 quick, 5 full; full runs add rounds up to 10 s)",
    )
    bench.add_argument(
        "--cold",
        action="store_true",
        help="time every call from a cold cache (a read of twice the last-level cache before each) "
        "instead of right after an untimed call of the same implementation",
    )
    bench.add_argument(
        "--reuse-memory",
        action="store_true",
        help="keep freed memory in the process for reuse (glibc's mallopt), so that no implementation's "
        "fresh outputs pay page faults: the kernels without the allocator",
    )
    prof = sub.add_parser("profile", help="the fast kernels' time per NumPy call, one thread")
    prof.add_argument("layers", nargs="*", type=_profiled, metavar="LAYER", help=", ".join(PROFILED))
    prof.add_argument("--reps", type=_positive_int, default=5, help="forward+backward runs to average")
    gpu = sub.add_parser("gpu-check", help="cupy tests, main job and GPU benchmark, with a report")
    gpu.add_argument(
        "out_dir", metavar="OUT_DIR", type=_output_folder, help="folder for the report and logs (created)"
    )
    gpu.add_argument(
        "--stages",
        type=_stages,
        default="tests,main,bench",
        help="comma-separated, of tests,main,bench (default all)",
    )
    gpu.add_argument("--quick", action="store_true", help="benchmark the small shapes of bench --quick")
    gpu.add_argument(
        "--workers",
        type=_non_negative_int,
        default=None,
        help="pytest-xdist workers for the tests stage (default: up to 8 where xdist is installed "
        "and there are 4 cores or more; 0: one process)",
    )
    gpu.add_argument(
        "--rounds", type=_positive_int, default=10, help="timed benchmark rounds per shape (default 10)"
    )
    for stage in ("tests", "main", "bench"):
        gpu.add_argument(f"--{stage}-timeout", type=_seconds, help=f"seconds the {stage} stage may take")
    gpu.add_argument(
        "--stand-in", action="store_true", help="run on the CPU (a test of the script; no GPU figures)"
    )
    sub.add_parser("learn", help="every backward derived node by node, each step checked (learn --help)")
    demo = sub.add_parser("demo", help="train on digits with every norm: a table and figures (demo extra)")
    demo.add_argument("--quick", action="store_true", help="short runs (well under a minute)")
    demo.add_argument(
        "--out", metavar="DIR", type=_output_folder, help="folder for the figures (default ./npnorm-demo)"
    )
    demo.add_argument(
        "--norms",
        nargs="+",
        choices=("none", "batch", "layer", "rms", "group", "instance"),
        help=(
            "norms to train (default all; the sweeps always include none, and the full run's "
            "batch-size sweep, made with batch, a LayerNorm reference too)"
        ),
    )
    demo.add_argument(
        "--seed", type=_non_negative_int, default=0, help="all random state comes from it (default 0)"
    )
    warm = sub.add_parser("warmup", help="compile every numba kernel (float32, float64) into numba's cache")
    warm.add_argument("--json", metavar="FILE", type=_output_file, help="save the times as JSON")
    args = parser.parse_args(argv)
    with _silenced(args.quiet):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """The command ``args`` names (the main job without one)."""
    if args.command == "warmup":
        from ._files import CannotWrite
        from ._warmup import NumbaBroken
        from ._warmup import run as run_warmup

        try:
            result = run_warmup(verbose=not args.quiet, json_path=args.json)
        except (CannotWrite, NumbaBroken) as err:
            print(f"python -m npnorm warmup: {err}", file=sys.stderr)
            return 1
        return 1 if result.get("cached") is False else 0  # compiled, but nothing kept
    if args.command == "gpu-check":
        from ._gpu_check import STAGES
        from ._gpu_check import run as run_gpu_check

        stages = args.stages  # (_stages: a string default goes through it too)
        timeouts = {s: getattr(args, f"{s}_timeout") for s in STAGES}
        return run_gpu_check(
            args.out_dir,
            stages=stages,
            timeouts=timeouts,
            quick=args.quick,
            rounds=args.rounds,
            stand_in=args.stand_in,
            workers=args.workers,
        )
    if args.command == "demo":
        from .demo.cli import run as run_demo

        return run_demo(quick=args.quick, out=args.out, norms=args.norms, seed=args.seed, quiet=args.quiet)
    if args.command == "profile":
        from ._profile import run as run_profile

        run_profile(args.layers or None, reps=args.reps)
        return 0
    if args.command == "bench":
        from ._bench import NoMallopt
        from ._bench import run as run_bench
        from ._files import CannotWrite

        try:
            run_bench(
                quick=args.quick,
                reps=args.reps,
                json_path=args.json,
                cold=args.cold,
                reuse_memory=args.reuse_memory,
            )
        except NoMallopt as err:  # --reuse-memory where the C library is not glibc
            print(f"python -m npnorm bench: {err}", file=sys.stderr)
            return 2
        except CannotWrite as err:  # (the figures are printed above it)
            print(f"python -m npnorm bench: {err}", file=sys.stderr)
            return 1
        return 0
    from ._selfcheck import run

    return 0 if run(verbose=not args.quiet) else 1


def _run_to_a_pipe(argv: list[str] | None = None) -> int:
    """``main(argv)``, and quietly done where the reader of standard output stops reading
    (``python -m npnorm learn layer_norm | head``: a BrokenPipeError traceback before),
    as the shell's own tools do (the status 141 of a process that SIGPIPE ended); and
    Ctrl-C ends it with one line (not a traceback) and ``INTERRUPTED``, on which ``_exit``
    ends the process by SIGINT, as Python itself does, so that a shell loop stops too."""
    try:
        status = main(argv)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # the interpreter's last flush writes nowhere
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:  # Ctrl-C: one line (a traceback before)
        print("python -m npnorm: interrupted", file=sys.stderr)
        return INTERRUPTED


INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a process SIGINT ended


def _exit(status: int) -> None:
    """End the process with ``status``; an interrupted command as Python ends on an uncaught
    KeyboardInterrupt, with no second report of it: its output flushed, its exit handlers
    run, then by SIGINT where the platform has it (an exit with 130 let a shell loop around
    ``python -m npnorm`` go on; a kill of its own lost the output still buffered)."""
    if status == INTERRUPTED:
        shown = sys.excepthook

        def quiet(kind: type[BaseException], value: BaseException, tb: Any) -> None:
            if not issubclass(kind, KeyboardInterrupt):  # (its one line is printed)
                shown(kind, value, tb)

        sys.excepthook = quiet
        raise KeyboardInterrupt
    sys.exit(status)


if __name__ == "__main__":
    _exit(_run_to_a_pipe())
