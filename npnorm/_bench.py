"""``python -m npnorm bench``: time every layer and kernel family against PyTorch and the memory roofline.

All figures come from one process, float32, in interleaved rounds (see ``_interleaved``);
every ratio is the median of per-round ratios. What ran just before a timed call is the
same for every implementation: a pause (``SETTLE_S``: the threads of the implementation
before, PyTorch's spinning OpenMP threads, go idle), then by default an untimed call of
the same implementation on the same data (a loop's steady state: the cache holds what
that implementation's last call left there and, for outputs under glibc's mmap
threshold, the memory of its freed output that the allocator hands back); with
``--cold``, a read of twice the last-level cache (``_cold_cache``), so that every call
finds nothing of its own in the cache. With ``--reuse-memory`` the process keeps the
memory it frees (``reuse_freed_memory``), so that fresh outputs, npnorm's and PyTorch's
alike, reuse pages instead of faulting in new ones: with glibc's defaults every output
over 32 MiB is a new ``mmap`` whose pages the kernel zeroes on first touch, a cost of the
allocator that the ratios otherwise include.
(Before, each implementation ran right after a fixed neighbour in the rotation, and
inherited that neighbour's cache and threads: at the inference shape, 12.6 MB in and out
with a 48 MB cache, that moved a ratio by up to 2x.) Timings are figures to read, not
assertions. Five parts:

1. **Training**, per layer at standard shapes: the median forward, backward and
   forward+backward times of the module API with fresh outputs, for each npnorm kernel
   family available (``numba``, ``numpy``, ``reference``: see ``npnorm.kernels_available``),
   the functional API writing into preallocated outputs (``<default> out=``), the
   textbook NumPy formulas and, when installed, PyTorch on the CPU; the ratio to PyTorch;
   the fraction of the memory roofline given by the machine's copy bandwidth
   (``np.copyto`` of the same array: forward reads x and writes y, one copy's traffic;
   forward+backward 2.5 copies); and the peak traced memory (tracemalloc) of
   forward+backward beyond the returned arrays, as a multiple of the input.
2. **Inference**: ``F.layer_norm`` forward at (64, 128, 384) against PyTorch's under
   ``torch.no_grad()``.
3. **Tiny call**: ``F.layer_norm`` forward at (4, 8), time per call.
4. **Tiny training step**: each layer's module forward+backward at a small shape
   (``TINY_STEPS``), time per call, with the default kernels and PyTorch's (figures
   only: what a call costs beyond its arithmetic).
5. **Compile**: ``python -m npnorm warmup`` in a fresh process with an empty numba
   cache (cold) and again with the cache it filled (warm).

Then the figures of the default kernels against the targets of the compiled-kernels
issue (standard shapes only; ``--quick`` shows them without verdicts): each verdict is
the median's, followed by the middle half of the rounds' ratios (first to third
quartile), which says where a verdict is within the machine's noise, and a ratio target
that PyTorch's time puts below the copy roofline is said to be unreachable there.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from . import functional as F
from ._files import write_json
from ._threads import get_num_threads
from .functional._dispatch import get_kernels, kernels_available, use_kernels
from .learn import _baseline as textbook
from .modules import BatchNorm2d, GroupNorm, InstanceNorm2d, LayerNorm, Module, RMSNorm

EPS = 1e-5

# Targets of the compiled-kernels issue: forward+backward time as a multiple of PyTorch's
# (module API, fresh outputs), per standard shape; None: figures only.
TARGET_VS_TORCH = {
    ("LayerNorm", (32, 512, 768)): 0.6,
    ("LayerNorm", (8, 2048, 4096)): 0.6,
    ("RMSNorm", (32, 512, 768)): 0.15,
    ("RMSNorm", (8, 2048, 4096)): None,
    ("BatchNorm2d", (32, 64, 56, 56)): 0.5,
    ("GroupNorm", (32, 64, 56, 56)): 0.8,
    ("InstanceNorm2d", (32, 64, 56, 56)): 0.5,
}
TARGET_ROOFLINE = 0.50
TARGET_EXTRA_MEMORY = 0.25
TARGET_INFERENCE = 1.0  # F.layer_norm forward at INFERENCE_SHAPE, x torch under no_grad
TARGET_TINY = 2.0  # F.layer_norm forward at TINY_SHAPE, x torch's per-call time
# A ratio verdict also gives PyTorch's own forward+backward times (the middle half of its
# rounds) where their third quartile is at least this multiple of their first: on a 2-vCPU
# AMD EPYC VM (a kernel ticking at 250 Hz) PyTorch's two-thread calls at the (32, 64, 56,
# 56) shapes fell into steps about 4 ms apart in a share of the rounds that changed from run
# to run, and the ratios with them: GroupNorm's forward+backward took 3.7-5.3 ms in 16 rounds
# of 36, 8.1-9.1 in 14 and 10.9-13.7 in 6 (npnorm's 3.9-4.7 ms in all 36); alone in a
# process it stepped too, in some runs on one thread and with OMP_WAIT_POLICY=PASSIVE as well.
BASELINE_SPREAD = 1.5
INFERENCE_SHAPE = (64, 128, 384)
TINY_SHAPE = (4, 8)
TINY_CALLS = 200  # calls per timed round of the tiny-call figure
# Rounds per shape: at least ``reps``, and more, up to MAX_ROUNDS, until the shape has had
# SECONDS of rounds (the full run; the quick one stops at ``reps``): medians of fast
# layers then rest on a few dozen rounds, those of slow ones on ``reps``.
SECONDS = 10.0
MAX_ROUNDS = 50
# Pause before each implementation's untimed call (warm runs), so that no implementation
# inherits the busy threads of the one before it: PyTorch's OpenMP threads keep spinning
# for a while after a call, on the same 2 vCPUs. At the inference shape npnorm's forward
# took 1.3-10.6 ms (median 2.1) right after PyTorch's and 1.3-2.0 ms (median 1.6) after a
# 10 ms pause, whose own call was unchanged (2.5 and 2.9 ms medians).
SETTLE_S = 0.01


@dataclass(frozen=True)
class Spec:
    layer: str
    shape: tuple[int, ...]


FULL = [
    Spec("LayerNorm", (32, 512, 768)),
    Spec("LayerNorm", (8, 2048, 4096)),
    Spec("RMSNorm", (32, 512, 768)),
    Spec("RMSNorm", (8, 2048, 4096)),
    Spec("BatchNorm2d", (32, 64, 56, 56)),
    Spec("GroupNorm", (32, 64, 56, 56)),
    Spec("InstanceNorm2d", (32, 64, 56, 56)),
]
QUICK = [
    Spec("LayerNorm", (8, 128, 768)),
    Spec("RMSNorm", (8, 128, 768)),
    Spec("BatchNorm2d", (8, 64, 28, 28)),
    Spec("GroupNorm", (8, 64, 28, 28)),
    Spec("InstanceNorm2d", (8, 64, 28, 28)),
]

# The tiny training step: each layer's module forward+backward at a small shape, per call,
# where the time is the per-call costs (checks, dispatch, the module's bookkeeping) more
# than the arithmetic; figures only (the issue set no target for them).
TINY_STEPS = [
    Spec("LayerNorm", (4, 8)),
    Spec("RMSNorm", (4, 8)),
    Spec("BatchNorm2d", (2, 4, 3, 3)),
    Spec("GroupNorm", (2, 32, 2, 2)),  # (the layer's 32 groups)
    Spec("InstanceNorm2d", (2, 4, 3, 3)),
]
TINY_STEP_CALLS = 50  # calls per timed round of each step


def _ours(spec: Spec) -> Module:
    c = spec.shape[-1] if spec.layer in ("LayerNorm", "RMSNorm") else spec.shape[1]
    return {
        "LayerNorm": lambda: LayerNorm(c),
        "RMSNorm": lambda: RMSNorm(c),
        "BatchNorm2d": lambda: BatchNorm2d(c),
        "GroupNorm": lambda: GroupNorm(32, c),
        "InstanceNorm2d": lambda: InstanceNorm2d(c),
    }[spec.layer]()


def _torch_module(torch: Any, spec: Spec) -> Any:
    c = spec.shape[-1] if spec.layer in ("LayerNorm", "RMSNorm") else spec.shape[1]
    return {
        "LayerNorm": lambda: torch.nn.LayerNorm(c),
        "RMSNorm": lambda: torch.nn.RMSNorm(c),
        "BatchNorm2d": lambda: torch.nn.BatchNorm2d(c),
        "GroupNorm": lambda: torch.nn.GroupNorm(32, c),
        "InstanceNorm2d": lambda: torch.nn.InstanceNorm2d(c),
    }[spec.layer]()


def _textbook_pair(spec: Spec) -> tuple[Callable[[np.ndarray], Any], Callable[[np.ndarray, Any], Any]]:
    """(forward, backward) written as the textbook formulas, with the layer's parameters."""
    shape = spec.shape
    if spec.layer in ("LayerNorm", "RMSNorm"):
        d, center = shape[-1], spec.layer == "LayerNorm"
        gamma = np.ones(d, np.float32)
        beta = np.zeros(d, np.float32) if center else None
        axes, paxes = (len(shape) - 1,), tuple(range(len(shape) - 1))
        return (
            lambda x: textbook.forward(x, axes, gamma, beta, EPS, center),
            lambda dy, cache: textbook.backward(dy, cache[1], axes, gamma, paxes, center),
        )
    c = shape[1]
    gamma4 = np.ones((1, c, 1, 1), np.float32)
    beta4 = np.zeros((1, c, 1, 1), np.float32)
    if spec.layer == "BatchNorm2d":
        return (
            lambda x: textbook.forward(x, (0, 2, 3), gamma4, beta4, EPS),
            lambda dy, cache: textbook.backward(dy, cache[1], (0, 2, 3), gamma4, (0, 2, 3)),
        )
    if spec.layer == "InstanceNorm2d":  # affine=False by default, as in PyTorch
        return (
            lambda x: textbook.forward(x, (2, 3), None, None, EPS),
            lambda dy, cache: textbook.backward(dy, cache[1], (2, 3), None, (0, 2, 3)),
        )
    groups = 32

    def gn_forward(x: np.ndarray) -> Any:
        xg = x.reshape(x.shape[0], groups, -1)
        yg, cache = textbook.forward(xg, (2,), None, None, EPS)
        return yg.reshape(x.shape) * gamma4 + beta4, cache

    def gn_backward(dy: np.ndarray, out: Any) -> Any:
        cache = out[1]
        xhat = cache["xhat"].reshape(dy.shape)
        dgamma, dbeta = (dy * xhat).sum(axis=(0, 2, 3)), dy.sum(axis=(0, 2, 3))
        dxhat = (dy * gamma4).reshape(dy.shape[0], groups, -1)
        dx, _, _ = textbook.backward(dxhat, cache, (2,), None, (0,))
        return dx.reshape(dy.shape), dgamma, dbeta

    return gn_forward, gn_backward


@dataclass(frozen=True)
class _Impl:
    """One implementation of a layer: ``forward()`` returns what ``backward`` needs (its
    output is dropped otherwise), ``both()`` runs forward then backward; with
    ``measure_memory``, ``both()`` returns the arrays it produced (for the memory figure)."""

    forward: Callable[[], Any]
    backward: Callable[[Any], Any]
    both: Callable[[], Any]
    measure_memory: bool = True
    # (y, dx, dweight, dbias: those the layer has) of one forward and backward, as NumPy
    # arrays, for the check before timing
    results: Callable[[], tuple[np.ndarray, ...]] | None = None


def _last_level_cache_bytes() -> int:
    """The largest CPU cache's size as the system reports it (sysconf, else Linux's sysfs;
    0 if neither does)."""
    sizes = [0]
    for name in ("SC_LEVEL4_CACHE_SIZE", "SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            sizes.append(int(os.sysconf(name)))
        except (ValueError, OSError, AttributeError):
            pass
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for index in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size", encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        try:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (ValueError, IndexError):
            pass
    return max(sizes)


@functools.cache
def _flush_bytes() -> int:
    """What the cold mode reads before every timed call: twice the last-level cache, at
    least 64 MiB (asked of the system on first use, not at import)."""
    return max(2 * _last_level_cache_bytes(), 64 << 20)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BLOCKS_UNDER = 1 << 30  # bytes: blocks below this come from the heap, not mmap


class NoMallopt(RuntimeError):
    """The C library cannot keep freed memory for reuse as ``--reuse-memory`` asks."""


def reuse_freed_memory() -> None:
    """Make this process keep the memory it frees and hand it out again (glibc's
    ``mallopt``: blocks under 1 GiB come from the heap instead of their own ``mmap``,
    and the heap is never trimmed), so that a fresh output lands in pages the process
    already touched instead of new ones the kernel must fault in and zero. It changes
    every later allocation of the process: NumPy's, PyTorch's, anyone's.

    Raises
    ------
    NoMallopt
        Where the C library has no ``mallopt`` (not glibc), or refuses the values.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        raise NoMallopt("--reuse-memory needs glibc's mallopt (Linux); this C library has none") from None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, _KEEP_BLOCKS_UNDER) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        raise NoMallopt("mallopt refused the thresholds --reuse-memory sets")


_flush_buffer: np.ndarray | None = None


def _cold_cache() -> None:
    """Read a buffer twice the size of the last-level cache, evicting whatever the last
    call left there."""
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = np.ones(_flush_bytes() // 8, dtype=np.int64)
    np.add.reduce(_flush_buffer)


def _timed(fn: Callable[[], Any], cold: bool = False) -> tuple[float, Any]:
    """Milliseconds of one call of ``fn`` (with ``cold``: after a pause of SETTLE_S and
    from a cold cache), and what it returned."""
    if cold:
        _settle()
        _cold_cache()
    t0 = time.perf_counter()
    out = fn()
    return 1e3 * (time.perf_counter() - t0), out


def _settle() -> None:
    """Wait SETTLE_S, for the threads of whatever ran before to go idle."""
    time.sleep(SETTLE_S)


def _settled(fn: Callable[[], Any], cold: bool) -> float:
    """Milliseconds of one call of ``fn`` right after a pause of SETTLE_S and an untimed
    call of ``fn`` itself (warm) or after a pause and ``_cold_cache`` (``cold``)."""
    if not cold:
        _settle()
        fn()
    return _timed(fn, cold)[0]


def _round(impl: _Impl, cold: bool) -> dict[str, float]:
    """One forward, one backward (of that forward) and one forward+backward, in ms. Warm
    (``cold`` False): after a pause of SETTLE_S and one untimed forward+backward of the
    same implementation; cold: each timed call after a pause and ``_cold_cache``."""
    if not cold:
        _settle()
        impl.both()
    fwd, saved = _timed(impl.forward, cold)
    bwd, _ = _timed(partial(impl.backward, saved), cold)
    del saved
    fb, _ = _timed(impl.both, cold)
    return {"fwd": fwd, "bwd": bwd, "fb": fb}


Times = dict[str, dict[str, list[float]]]  # implementation -> figure -> ms per round


def _round_robin(
    rounds: dict[str, Callable[[], dict[str, float]]], reps: int, seconds: float, first: str | None = None
) -> Times:
    """Call every ``rounds[name]`` once a round (each returns the milliseconds of its
    figures) for at least ``reps`` rounds after one warm-up round, and more while the timed
    calls have taken less than ``seconds`` in all (at most ``MAX_ROUNDS`` rounds). The
    order is rotated from round to round (``first``, if given, always leads), so that a
    slow spell of a shared machine falls on all of them alike; ratios are then taken round
    by round."""
    names = [n for n in rounds if n != first]
    times: Times = {n: {} for n in rounds}
    spent = 0.0
    i = 0
    while i <= reps or (spent < 1e3 * seconds and i <= MAX_ROUNDS):
        k = i % len(names)
        gc.collect()  # once a round (with torch loaded a collection takes tens of ms), then
        gc.disable()  # no collection inside a timed call
        try:
            for name in [*([first] if first is not None else []), *names[k:], *names[:k]]:
                t = rounds[name]()
                if i > 0:
                    for key, v in t.items():
                        times[name].setdefault(key, []).append(v)
                    spent += sum(t.values())
        finally:
            gc.enable()
        i += 1
    return times


def _interleaved(
    impls: dict[str, _Impl], copy: Callable[[], Any], reps: int, seconds: float, cold: bool = False
) -> Times:
    """Forward, backward and forward+backward times of every implementation, and the
    copy's, in the rounds of ``_round_robin`` (the copy first in each). What ran before a
    timed call is the same for all of them (see ``_round``, ``_settled``): the same
    implementation (warm) or a cache flush (``cold``)."""
    rounds: dict[str, Callable[[], dict[str, float]]] = {"copy": lambda: {"copy": _settled(copy, cold)}}
    rounds.update({name: partial(_round, impl, cold) for name, impl in impls.items()})
    return _round_robin(rounds, reps, seconds, first="copy")


def _peak_extra(fb: Callable[[], tuple[np.ndarray, ...]], input_bytes: int) -> float:
    """Peak traced memory of one forward+backward beyond the arrays it returns, x input size."""
    gc.collect()
    tracemalloc.start()
    try:
        returned = fb()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    kept = sum(a.nbytes for a in returned if isinstance(a, np.ndarray))
    return (peak - kept) / input_bytes


def _npnorm_impl(spec: Spec, x: np.ndarray, dy: np.ndarray, kernels: str) -> _Impl:
    """npnorm's module (fresh outputs every call), every call with the kernel family ``kernels``."""
    m = _ours(spec)

    def forward() -> None:
        with use_kernels(kernels):
            m(x)  # the module keeps what its backward needs

    def backward(_: None) -> None:
        with use_kernels(kernels):
            m.backward(dy)

    def fb() -> tuple[np.ndarray, ...]:
        with use_kernels(kernels):
            y = m(x)
            dx = m.backward(dy)
        grads = tuple(m.grads.values())
        m.zero_grad()  # fresh gradients each time, as the memory figure needs
        return y, dx, *grads

    return _Impl(forward, backward, fb, results=fb)


def _functional_out_impl(spec: Spec, x: np.ndarray, dy: np.ndarray, kernels: str) -> _Impl:
    """The functional API writing y and dx into buffers allocated once (``out=``), with the
    module's default parameters; the memory figure counts the buffers as returned arrays."""
    y_buf, dx_buf = np.empty_like(x), np.empty_like(x)
    if spec.layer in ("LayerNorm", "RMSNorm"):
        d = spec.shape[-1]
        w = np.ones(d, np.float32)
        if spec.layer == "LayerNorm":
            b = np.zeros(d, np.float32)

            def fwd() -> Any:
                return F.layer_norm_forward(x, d, w, b, out=y_buf)

            def bwd(saved: Any) -> Any:
                return F.layer_norm_backward(dy, x, d, saved[1], saved[2], w, b, out=dx_buf)
        else:

            def fwd() -> Any:
                return F.rms_norm_forward(x, d, w, out=y_buf)

            def bwd(saved: Any) -> Any:
                return F.rms_norm_backward(dy, x, d, saved[1], w, out=dx_buf)
    else:
        c = spec.shape[1]
        w, b = np.ones(c, np.float32), np.zeros(c, np.float32)
        rm, rv = np.zeros(c, np.float32), np.ones(c, np.float32)
        if spec.layer == "BatchNorm2d":

            def fwd() -> Any:
                return F.batch_norm_forward(x, rm, rv, w, b, training=True, out=y_buf)

            def bwd(saved: Any) -> Any:
                return F.batch_norm_backward(dy, x, saved[1], saved[2], w, b, training=True, out=dx_buf)
        elif spec.layer == "GroupNorm":

            def fwd() -> Any:
                return F.group_norm_forward(x, 32, w, b, out=y_buf)

            def bwd(saved: Any) -> Any:
                return F.group_norm_backward(dy, x, 32, saved[1], saved[2], w, b, out=dx_buf)
        else:  # InstanceNorm2d: no affine map, no buffers (the module's defaults)

            def fwd() -> Any:
                return F.instance_norm_forward(x, out=y_buf)

            def bwd(saved: Any) -> Any:
                return F.instance_norm_backward(dy, x, saved[1], saved[2], out=dx_buf)

    def forward() -> Any:
        with use_kernels(kernels):
            return fwd()

    def backward(saved: Any) -> Any:
        with use_kernels(kernels):
            return bwd(saved)

    def fb() -> tuple[np.ndarray, ...]:
        with use_kernels(kernels):
            saved = fwd()
            grads = bwd(saved)
        return tuple(g for g in grads[1:] if g is not None)  # y and dx are the preallocated buffers

    def results() -> tuple[np.ndarray, ...]:
        grads = fb()
        return y_buf.copy(), dx_buf.copy(), *grads

    return _Impl(forward, backward, fb, results=results)


def _textbook_impl(spec: Spec, x: np.ndarray, dy: np.ndarray) -> _Impl:
    fwd, bwd = _textbook_pair(spec)

    def fb() -> tuple[np.ndarray, ...]:
        y = fwd(x)
        return (y[0], *bwd(dy, y))

    def results() -> tuple[np.ndarray, ...]:
        return tuple(a for a in fb() if a is not None)

    return _Impl(lambda: fwd(x), lambda saved: bwd(dy, saved), fb, results=results)


def _torch_impl(torch: Any, spec: Spec, x: np.ndarray, dy: np.ndarray) -> _Impl:
    m = _torch_module(torch, spec)
    xt = torch.from_numpy(x).requires_grad_(True)
    dyt = torch.from_numpy(dy)

    def backward(y: Any) -> None:
        xt.grad = None
        y.backward(dyt)

    def fb() -> None:
        xt.grad = None
        m(xt).backward(dyt)

    def results() -> tuple[np.ndarray, ...]:
        xt.grad = None
        m.zero_grad()
        y = m(xt)
        y.backward(dyt)
        params = (getattr(m, "weight", None), getattr(m, "bias", None))
        grads = [p.grad.numpy().copy() for p in params if p is not None and p.grad is not None]
        return y.detach().numpy().copy(), xt.grad.numpy().copy(), *grads

    return _Impl(lambda: m(xt), backward, fb, measure_memory=False, results=results)


# the check before timing: y and dx of every implementation within this of the reference
# kernels', relative to the largest value (float32, and the textbook RMSNorm's eps=1e-5)
CHECK_TOLERANCE = 1e-3


def _check_results(spec: Spec, x: np.ndarray, dy: np.ndarray, impls: dict[str, _Impl]) -> None:
    """A RuntimeError unless every implementation's y, dx, dweight and dbias agree with the
    reference kernels' (untimed, once per shape): a fast wrong kernel would otherwise time
    well."""
    reference = _npnorm_impl(spec, x, dy, "reference").results
    assert reference is not None
    truth = reference()
    names = ("y", "dx", "dweight", "dbias")[: len(truth)]
    for name, impl in impls.items():
        if impl.results is None:
            continue
        got = impl.results()
        if len(got) != len(truth):
            raise RuntimeError(
                f"bench: {name} gives {len(got)} results for {spec.layer} {spec.shape}, "
                f"the reference kernels {len(truth)} ({', '.join(names)})"
            )
        for what, a, want in zip(names, got, truth, strict=True):
            _check_close(
                f"{name} gives a wrong {what} for {spec.layer} {spec.shape}", a.reshape(want.shape), want
            )


def _check_close(wrong: str, got: np.ndarray, want: np.ndarray) -> None:
    """A RuntimeError (``wrong`` says what) unless ``got`` is within ``CHECK_TOLERANCE`` of
    ``want`` (the reference kernels'), relative to 1 + its largest value."""
    scale = 1.0 + float(np.max(np.abs(want)))
    err = float(np.max(np.abs(got.astype(np.float64) - want))) / scale
    if not err <= CHECK_TOLERANCE:  # (NaN fails)
        raise RuntimeError(
            f"bench: {wrong}: {err:.2e} of its scale off the reference kernels' (allowed {CHECK_TOLERANCE})"
        )


def _median_ratio(num: list[float], den: list[float], scale: float = 1.0) -> float:
    """Median over rounds of ``scale * num[i] / den[i]``."""
    return statistics.median(scale * a / b for a, b in zip(num, den, strict=True))


def _quartiles(values: list[float]) -> list[float] | None:
    """The first and third quartiles of ``values`` (None with fewer than 2)."""
    if len(values) < 2:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [q1, q3]


def _ratio_quartiles(num: list[float], den: list[float], scale: float = 1.0) -> list[float] | None:
    """The first and third quartiles over rounds of ``scale * num[i] / den[i]``: the
    middle half of the rounds' ratios (None with fewer than 2 rounds). On a shared or
    virtual machine one run's median can land on either side of a target; where this
    range spans the target, a quarter of the rounds at least fell on each side."""
    return _quartiles([scale * a / b for a, b in zip(num, den, strict=True)])


def machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cores": cpus, "numpy": np.__version__, "python": platform.python_version()}


def _families() -> list[str]:
    """The kernel families to time, the default first."""
    default = get_kernels()
    return [
        default,
        *(k for k in ("numba", "numpy", "reference") if k != default and k in kernels_available()),
    ]


def _training(
    specs: list[Spec], torch: Any, reps: int, seconds: float, cold: bool = False
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    rng = np.random.default_rng(0)
    default = get_kernels()
    for spec in specs:
        x = rng.standard_normal(spec.shape, dtype=np.float32)
        dy = rng.standard_normal(spec.shape, dtype=np.float32)
        scratch = np.empty_like(x)
        impls = {f"npnorm {k}": _npnorm_impl(spec, x, dy, k) for k in _families()}
        impls[f"npnorm {default} out="] = _functional_out_impl(spec, x, dy, default)
        impls["textbook"] = _textbook_impl(spec, x, dy)
        if torch is not None:
            impls["torch"] = _torch_impl(torch, spec, x, dy)
        _check_results(spec, x, dy, impls)
        times = _interleaved(impls, partial(np.copyto, scratch, x), reps, seconds, cold)
        memory = {n: _peak_extra(i.both, x.nbytes) for n, i in impls.items() if i.measure_memory}
        copy = times["copy"]["copy"]
        copy_ms = statistics.median(copy)
        fresh = times[f"npnorm {default}"]["fb"]
        for impl in impls:
            t = times[impl]
            rows.append(
                {
                    "rounds": len(copy),
                    "layer": spec.layer,
                    "shape": list(spec.shape),
                    "impl": impl,
                    "default": impl == f"npnorm {default}",
                    "fwd_ms": statistics.median(t["fwd"]),
                    "bwd_ms": statistics.median(t["bwd"]),
                    "fb_ms": statistics.median(t["fb"]),
                    "copy_ms": copy_ms,
                    "copy_GBps": 2 * x.nbytes / copy_ms / 1e6,
                    "roofline_fwd": _median_ratio(copy, t["fwd"]),
                    "roofline_fb": _median_ratio(copy, t["fb"], 2.5),
                    "roofline_fb_quartiles": _ratio_quartiles(copy, t["fb"], 2.5),
                    "extra_memory_x_input": memory.get(impl),
                    "fb_vs_torch": _median_ratio(t["fb"], times["torch"]["fb"])
                    if torch is not None
                    else None,
                    "fb_vs_torch_quartiles": _ratio_quartiles(t["fb"], times["torch"]["fb"])
                    if torch is not None
                    else None,
                    "torch_fb_ms": statistics.median(times["torch"]["fb"]) if torch is not None else None,
                    "torch_fb_quartiles": _quartiles(times["torch"]["fb"]) if torch is not None else None,
                    "fb_vs_default_fresh": _median_ratio(t["fb"], fresh),
                    "times_ms": t,
                }
            )
        _print_rows(rows[-len(impls) :], spec)
    return rows


def _rounds(
    calls: dict[str, Callable[[], Any]], reps: int, seconds: float, cold: bool = False
) -> dict[str, list[float]]:
    """Milliseconds of each call per round, in the rounds of ``_round_robin``: each timed
    call right after an untimed one of the same call (warm) or after ``_cold_cache``."""

    def one(f: Callable[[], Any]) -> Callable[[], dict[str, float]]:
        return lambda: {"ms": _settled(f, cold)}

    rounds = {name: one(f) for name, f in calls.items()}
    return {name: t.get("ms", []) for name, t in _round_robin(rounds, reps, seconds).items()}


def _forward_calls(shape: tuple[int, ...], torch: Any, repeat: int) -> dict[str, Callable[[], Any]]:
    """``F.layer_norm`` forward (``repeat`` calls per round) for each kernel family, the
    default with ``out=``, and torch's under ``no_grad``."""
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    d = shape[-1]
    y_buf = np.empty_like(x)
    calls: dict[str, Callable[[], Any]] = {}
    for k in _families():

        def call(k: str = k) -> None:
            with use_kernels(k):
                for _ in range(repeat):
                    F.layer_norm(x, d)

        calls[f"npnorm {k}"] = call
    default = get_kernels()

    def with_out() -> None:
        with use_kernels(default):
            for _ in range(repeat):
                F.layer_norm_forward(x, d, out=y_buf)

    calls[f"npnorm {default} out="] = with_out
    if torch is not None:
        xt = torch.from_numpy(x)

        def torch_call() -> None:
            with torch.no_grad():
                for _ in range(repeat):
                    torch.nn.functional.layer_norm(xt, (d,))

        calls["torch"] = torch_call
    # the check before timing: each call's output against the reference kernels'
    with use_kernels("reference"):
        truth = F.layer_norm(x, d)
    outputs = {}
    for k in _families():
        with use_kernels(k):
            outputs[f"npnorm {k}"] = F.layer_norm(x, d)
    with use_kernels(default):
        outputs[f"npnorm {default} out="] = F.layer_norm_forward(x, d, out=y_buf)[0].copy()
    if torch is not None:
        outputs["torch"] = torch.nn.functional.layer_norm(torch.from_numpy(x), (d,)).numpy()
    for name, y in outputs.items():
        _check_close(f"{name} gives a wrong F.layer_norm output at {shape}", y, truth)
    return calls


def _forward_rows(
    what: str, shape: tuple[int, ...], torch: Any, repeat: int, reps: int, seconds: float, cold: bool = False
) -> list[dict[str, Any]]:
    times = _rounds(_forward_calls(shape, torch, repeat), reps, seconds, cold)
    rows = []
    print(
        f"\n{what}: F.layer_norm forward {shape} float32, per call; "
        f"medians of {len(next(iter(times.values())))} rounds"
    )
    print(f"  {'impl':24} {'us/call':>10} {'x torch':>8}")
    for name, t in times.items():
        row = {"part": what, "shape": list(shape), **_per_call(name, t, times, repeat)}
        rows.append(row)
        print(f"  {name:24} {row['us_per_call']:10.1f} {_fmt(row['vs_torch'], '8.2f')}")
    return rows


def _per_call(name: str, t: list[float], times: dict[str, list[float]], repeat: int) -> dict[str, Any]:
    """Implementation ``name``'s per-call figures from its rounds' ms ``t`` (``repeat``
    calls a round): us per call, and the median and quartiles of its per-round ratios to
    torch's rounds in ``times`` (None where torch was not timed)."""
    return {
        "impl": name,
        "us_per_call": 1e3 * statistics.median(t) / repeat,
        "vs_torch": _median_ratio(t, times["torch"]) if "torch" in times else None,
        "vs_torch_quartiles": _ratio_quartiles(t, times["torch"]) if "torch" in times else None,
        "times_ms": t,
    }


def _step_calls(spec: Spec, torch: Any, repeat: int) -> dict[str, Callable[[], Any]]:
    """The module's forward+backward (``repeat`` per round) with the default kernels, and
    torch's; both accumulate their parameters' gradients, as a training loop between two
    ``zero_grad`` calls does. Their results are checked against the reference kernels'
    first."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(spec.shape, dtype=np.float32)
    dy = rng.standard_normal(spec.shape, dtype=np.float32)
    default = get_kernels()
    impls = {f"npnorm {default}": _npnorm_impl(spec, x, dy, default)}
    if torch is not None:
        impls["torch"] = _torch_impl(torch, spec, x, dy)
    _check_results(spec, x, dy, impls)
    m = _ours(spec)

    def step() -> None:
        with use_kernels(default):
            for _ in range(repeat):
                m(x)
                m.backward(dy)

    calls: dict[str, Callable[[], Any]] = {f"npnorm {default}": step}
    if torch is not None:
        tm = _torch_module(torch, spec)
        xt = torch.from_numpy(x).requires_grad_(True)
        dyt = torch.from_numpy(dy)

        def torch_step() -> None:
            for _ in range(repeat):
                xt.grad = None
                tm(xt).backward(dyt)

        calls["torch"] = torch_step
    return calls


def _step_rows(
    specs: list[Spec], torch: Any, repeat: int, reps: int, seconds: float, cold: bool = False
) -> list[dict[str, Any]]:
    """The tiny training step's figures: us per module forward+backward, and x torch."""
    rows = []
    print("\ntiny training step: module forward+backward, float32, per call; medians of per-round figures")
    print(f"  {'layer':15} {'shape':18} {'impl':16} {'us/call':>8} {'x torch':>8}")
    for spec in specs:
        times = _rounds(_step_calls(spec, torch, repeat), reps, seconds, cold)
        for name, t in times.items():
            row = {"layer": spec.layer, "shape": list(spec.shape), **_per_call(name, t, times, repeat)}
            rows.append(row)
            print(
                f"  {spec.layer:15} {spec.shape!s:18} {name:16} {row['us_per_call']:8.1f} "
                f"{_fmt(row['vs_torch'], '8.2f')}"
            )
    return rows


def compile_times() -> dict[str, Any]:
    """``python -m npnorm warmup`` twice in fresh processes sharing an empty numba cache
    directory: the first compiles every kernel (cold), the second loads them (warm)."""
    if "numba" not in kernels_available():
        return {}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        for label in ("cold", "warm"):
            report = os.path.join(cache, f"{label}.json")
            t0 = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "npnorm", "--quiet", "warmup", "--json", report], env=env, check=True
            )
            wall = time.perf_counter() - t0
            with open(report, encoding="utf-8") as f:
                data = json.load(f)
            if "total_s" not in data:  # NUMBA_DISABLE_JIT: nothing compiles (a KeyError before)
                print("\ncompile: NUMBA_DISABLE_JIT is set, so numba compiles nothing: no compile times")
                return {"jit": False}
            out[label] = {"process_s": wall, "compile_s": data["total_s"], "per_layer_s": data["seconds"]}
    print(
        f"\ncompile (python -m npnorm warmup, every numba kernel for float32 and float64, fresh process): "
        f"cold {out['cold']['compile_s']:.1f} s ({out['cold']['process_s']:.1f} s with interpreter start), "
        f"warm cache {out['warm']['compile_s']:.2f} s ({out['warm']['process_s']:.1f} s)"
    )
    return out


def run(
    quick: bool = False,
    reps: int | None = None,
    json_path: str | None = None,
    cold: bool = False,
    reuse_memory: bool = False,
) -> list[dict[str, Any]]:
    if reuse_memory:
        reuse_freed_memory()  # before the arrays are allocated
    specs = QUICK if quick else FULL
    reps = reps or (3 if quick else 5)
    seconds = 0.0 if quick else SECONDS
    torch: Any = None
    if importlib.util.find_spec("torch") is not None:
        torch = importlib.import_module("torch")
    info = machine()
    info["npnorm_threads"] = get_num_threads()
    info["kernels"] = get_kernels()
    info["kernels_available"] = kernels_available()
    info["cache"] = f"cold (a {_flush_bytes() >> 20} MiB read before every timed call)" if cold else "warm"
    info["freed memory"] = "kept for reuse (--reuse-memory)" if reuse_memory else "the C library's default"
    if importlib.util.find_spec("numba") is not None:
        info["numba"] = importlib.import_module("numba").__version__
    if "numba" in info["kernels_available"]:  # the loops this host takes (see _numba_loops; long_rows:
        # the forwards' long rows and GroupNorm's backward rows)
        from .kernels import _numba_loops as loops

        info["long_rows"] = "one at a time" if loops.LONG_ROWS_ALONE else "pipelined"
        info["batch_norm_training"] = "memory order" if loops.CHANNELS_IN_MEMORY_ORDER else "pipelined"
    torch_threads = None
    if torch is not None:
        info["torch"] = torch.__version__
        # torch runs on as many threads as npnorm (their defaults come from different
        # places: OMP_NUM_THREADS, NPNORM_NUM_THREADS), restored after the bench
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(info["npnorm_threads"])
        info["torch_threads"] = torch.get_num_threads()
    print("machine:", ", ".join(f"{k}={v}" for k, v in info.items()))
    try:
        rows = _training(specs, torch, reps, seconds, cold)
        inference = _forward_rows("inference", INFERENCE_SHAPE, torch, 1, reps, seconds, cold)
        tiny = _forward_rows("tiny call", TINY_SHAPE, torch, TINY_CALLS, reps, seconds, cold)
        steps = _step_rows(TINY_STEPS, torch, TINY_STEP_CALLS, reps, seconds, cold)
    finally:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
    compiled = compile_times()
    _print_targets(rows, inference, tiny, judge=not quick)
    if json_path:
        write_json(
            json_path,
            {
                "machine": info,
                "quick": quick,
                "cold": cold,
                "reuse_memory": reuse_memory,
                "reps": reps,
                "rows": rows,
                "inference": inference,
                "tiny": tiny,
                "tiny_steps": steps,
                "compile": compiled,
            },
        )
        print(f"figures saved to {json_path}")
    return rows


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _print_rows(rows: list[dict[str, Any]], spec: Spec) -> None:
    first = rows[0]
    print(
        f"\n{spec.layer} {tuple(spec.shape)} float32   copy {first['copy_ms']:.2f} ms "
        f"({first['copy_GBps']:.1f} GB/s read+write); medians of {first['rounds']} rounds"
    )
    header = f"  {'impl':22} {'fwd ms':>8} {'bwd ms':>8} {'f+b ms':>8} {'f+b/torch':>9} "
    header += f"{'roof fwd':>8} {'roof f+b':>8} {'extra mem':>9}"
    print(header)
    for r in rows:
        mem = r["extra_memory_x_input"]
        print(
            f"  {r['impl']:22} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} {r['fb_ms']:8.2f} "
            f"{_fmt(r['fb_vs_torch'], '9.2f')} {r['roofline_fwd']:8.0%} {r['roofline_fb']:8.0%} "
            f"{'-' if mem is None else format(mem, '8.2f') + 'x'}"
        )


def _near(value: float, target: float, decimals: int, percent: bool = False) -> str:
    """``value`` with ``decimals`` places, or more where fewer would print the target
    itself (a ratio of 0.6008 against a target of 0.6 prints as 0.601, not 0.60, so that
    the figure shows why it missed)."""
    scale = 100 if percent else 1
    while decimals < 4 and value != target:
        if round(value * scale, decimals) != round(target * scale, decimals):
            break
        decimals += 1
    return f"{value * scale:.{decimals}f}" + ("%" if percent else "")


def _spread(quartiles: list[float] | None, target: float, decimals: int, percent: bool = False) -> str:
    """The middle half of the rounds' ratios (``_ratio_quartiles``), said after a verdict,
    and whether it spans the target (a run's median may then fall on either side)."""
    if not quartiles:
        return ""
    scale, unit = (100, "%") if percent else (1, "")
    q1, q3 = (f"{q * scale:.{decimals}f}{unit}" for q in quartiles)
    spans = quartiles[0] <= target <= quartiles[1]
    return f" (rounds' middle half {q1}-{q3}{', on both sides of the target' if spans else ''})"


def _unreachable(row: dict[str, Any], target: float) -> str:
    """Where ``target`` times PyTorch's forward+backward is less time than the copy
    roofline allows (2.5 copies of the input), a note that no implementation can meet the
    target on this machine in this setting (PyTorch's time without page faults, with
    ``--reuse-memory``, can put it there)."""
    torch_ms, copy_ms = row.get("torch_fb_ms"), row.get("copy_ms")
    if not torch_ms or not copy_ms or target * torch_ms >= 2.5 * copy_ms:
        return ""
    return (
        f" (unreachable here: {target}x torch is {target * torch_ms:.1f} ms, below the copy "
        f"roofline's {2.5 * copy_ms:.1f} ms)"
    )


def _baseline_spread(row: dict[str, Any]) -> str:
    """PyTorch's own forward+backward times, the middle half of its rounds, where they
    spread by ``BASELINE_SPREAD`` or more (third quartile against first): a ratio's
    spread may then be PyTorch's (see ``BASELINE_SPREAD``)."""
    quartiles = row.get("torch_fb_quartiles")
    if not quartiles or quartiles[1] < BASELINE_SPREAD * quartiles[0]:
        return ""
    return f" (torch's own forward+backward: rounds' middle half {quartiles[0]:.1f}-{quartiles[1]:.1f} ms)"


def _print_targets(
    rows: list[dict[str, Any]],
    inference: list[dict[str, Any]],
    tiny: list[dict[str, Any]],
    judge: bool = True,
) -> None:
    """The default kernels' figures against the issue's targets; with ``judge`` False (the
    quick run's small shapes, where fixed costs and per-thread scratch weigh more) the
    figures and targets without a verdict."""
    default = get_kernels()
    print(
        f"\ntargets for npnorm {default} (the default kernels; forward+backward, module API, fresh outputs):"
    )
    if not judge:
        print("  (quick shapes: the targets apply to the standard shapes; run without --quick)")

    def verdict(ok: bool) -> str:
        return (" met" if ok else " MISSED") if judge else ""

    for r in rows:
        if not r["default"]:
            continue
        target = TARGET_VS_TORCH.get((r["layer"], tuple(r["shape"])))
        checks = []
        if r["fb_vs_torch"] is not None:
            if target is None:
                checks.append(f"{r['fb_vs_torch']:.2f}x torch (no target){_baseline_spread(r)}")
            else:
                spread = _spread(r.get("fb_vs_torch_quartiles"), target, 2)
                checks.append(
                    f"{_near(r['fb_vs_torch'], target, 2)}x torch (<= {target})"
                    f"{verdict(r['fb_vs_torch'] <= target)}{spread}{_baseline_spread(r)}"
                    f"{_unreachable(r, target)}"
                )
        ok = r["roofline_fb"] >= TARGET_ROOFLINE
        roofline = _near(r["roofline_fb"], TARGET_ROOFLINE, 0, percent=True)
        spread = _spread(r.get("roofline_fb_quartiles"), TARGET_ROOFLINE, 0, percent=True)
        checks.append(f"roofline {roofline} (>= {TARGET_ROOFLINE:.0%}){verdict(ok)}{spread}")
        ok = r["extra_memory_x_input"] <= TARGET_EXTRA_MEMORY
        checks.append(
            f"extra memory {_near(r['extra_memory_x_input'], TARGET_EXTRA_MEMORY, 2)}x "
            f"(<= {TARGET_EXTRA_MEMORY}){verdict(ok)}"
        )
        print(f"  {r['layer']:15} {tuple(r['shape'])!s:18} " + "; ".join(checks))
    for what, part, target in (("inference", inference, TARGET_INFERENCE), ("tiny call", tiny, TARGET_TINY)):
        for r in part:
            if r["impl"] == f"npnorm {default}" and r["vs_torch"] is not None:
                ok = r["vs_torch"] <= target
                print(
                    f"  {what:15} {tuple(r['shape'])!s:18} F.layer_norm forward {r['us_per_call']:.1f} us, "
                    f"{_near(r['vs_torch'], target, 2)}x torch (<= {target}){verdict(ok)}"
                    f"{_spread(r.get('vs_torch_quartiles'), target, 2)}"
                )
