"""``python -m npnorm profile``: where the NumPy kernels spend their time, call by call.

For each layer at a standard shape (float32, one thread, the ``"numpy"`` kernel family)
it runs forward+backward of the
module a few times with every NumPy function the fast kernels call wrapped in a timer,
and prints the time charged to each call site: the kernel's source line, its calls per
forward+backward, milliseconds, and nanoseconds per input element. What the kernels do
between NumPy calls (slicing, Python) is the difference between the total and the sum.

It is a developer's tool: the wrappers replace the ``np`` name inside the kernel modules
while it runs (and restore it after), which slows each call by a little under a
microsecond; read the figures as shares, not as the kernels' speed.
"""

from __future__ import annotations

import collections
import linecache
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import numpy as np

from ._bench import FULL, Spec, _ours
from ._threads import get_num_threads, set_num_threads
from .functional._dispatch import use_kernels
from .kernels import _blocks, numpy_fast, numpy_fast_channels

KERNEL_MODULES: tuple[ModuleType, ...] = (_blocks, numpy_fast, numpy_fast_channels)


Where = tuple[str, str, int]  # NumPy function, file, line


class _Totals:
    def __init__(self) -> None:
        self.seconds: collections.defaultdict[Where, float] = collections.defaultdict(float)
        self.calls: collections.Counter[Where] = collections.Counter()


@dataclass(frozen=True)
class Site:
    """One call site's share of a forward+backward."""

    function: str
    file: str
    line: int
    source: str
    calls: int
    ms: float


class _TimedFunction:
    """A NumPy function whose calls are timed and charged to the caller's source line
    (the line in the kernel modules that called it, through ``_blocks`` helpers)."""

    def __init__(self, f: Any, name: str, totals: _Totals) -> None:
        self._f, self._name, self._totals = f, name, totals

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        while frame.f_code.co_filename == _blocks.__file__ and frame.f_back is not None:
            frame = frame.f_back  # a _blocks helper: charge the kernel line that called it
        site = (self._name, frame.f_code.co_filename, frame.f_lineno)
        t0 = time.perf_counter()
        out = self._f(*args, **kwargs)
        self._totals.seconds[site] += time.perf_counter() - t0
        self._totals.calls[site] += 1
        return out

    def __getattr__(self, attr: str) -> Any:  # np.add.reduce and the like: not timed
        return getattr(self._f, attr)


class _TimedNumpy:
    """Stands in for the ``numpy`` module: its functions come back timed."""

    def __init__(self, totals: _Totals) -> None:
        self._totals = totals

    def __getattr__(self, name: str) -> Any:
        obj = getattr(np, name)
        if isinstance(obj, type) or not callable(obj):
            return obj  # dtypes, classes (errstate), constants
        return _TimedFunction(obj, name, self._totals)


@contextmanager
def timed_kernels(totals: _Totals) -> Iterator[None]:
    """The kernel modules call timed NumPy functions inside the block."""
    proxy = _TimedNumpy(totals)
    saved = [m.np for m in KERNEL_MODULES]
    for m in KERNEL_MODULES:
        m.np = proxy  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for m, old in zip(KERNEL_MODULES, saved, strict=True):
            m.np = old  # type: ignore[attr-defined]


def profile(spec: Spec, reps: int = 5, top: int = 14) -> dict[str, Any]:
    """Per call site totals of ``reps`` forward+backward runs of ``spec``'s layer, one thread."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(spec.shape, dtype=np.float32)
    dy = rng.standard_normal(spec.shape, dtype=np.float32)
    m = _ours(spec)
    totals = _Totals()
    threads = get_num_threads()
    set_num_threads(1)
    try:
        with use_kernels("numpy"):
            m(x)
            m.backward(dy)  # warm-up, untimed
            with timed_kernels(totals):
                t0 = time.perf_counter()
                for _ in range(reps):
                    m(x)
                    m.backward(dy)
                total = (time.perf_counter() - t0) / reps
    finally:
        set_num_threads(threads)
    sites = [
        Site(
            name,
            filename.rsplit("/", 1)[-1],
            line,
            linecache.getline(filename, line).strip(),
            totals.calls[(name, filename, line)] // reps,
            1e3 * seconds / reps,
        )
        for (name, filename, line), seconds in sorted(totals.seconds.items(), key=lambda kv: -kv[1])
    ]
    in_numpy = sum(s.ms for s in sites)
    print(f"\n{spec.layer} {tuple(spec.shape)} float32, one thread: forward+backward {1e3 * total:.1f} ms,")
    print(f"  of which {in_numpy:.1f} ms in NumPy calls ({x.size / 1e6:.1f} M elements)")
    print(f"  {'ms':>7} {'ns/elem':>7} {'calls':>6}  site")
    for s in sites[:top]:
        print(f"  {s.ms:7.2f} {1e6 * s.ms / x.size:7.3f} {s.calls:6d}  {s.file}:{s.line}  {s.source[:80]}")
    rest = sites[top:]
    if rest:
        print(f"  {sum(s.ms for s in rest):7.2f} {'':7} {'':6}  {len(rest)} more sites")
    return {
        "layer": spec.layer,
        "shape": list(spec.shape),
        "total_ms": 1e3 * total,
        "sites": [asdict(s) for s in sites],
    }


def run(layers: list[str] | None = None, reps: int = 5) -> list[dict[str, Any]]:
    seen: set[str] = set()
    out = []
    for spec in FULL:  # the first standard shape of each layer
        if spec.layer in seen or (layers and spec.layer not in layers):
            continue
        seen.add(spec.layer)
        out.append(profile(spec, reps))
    return out
