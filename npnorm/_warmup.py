"""``python -m npnorm warmup``: compile every numba kernel once, for float32 and float64
(float16 runs the float32 ones, through two compiled casts, compiled here too).

The ``"numba"`` kernels compile on first use, per operation and computation dtype: a
few seconds each on a cold start, about a second for all of them once numba's on-disk
cache holds them (``cache=True``: next to the kernels' source, or in
``NUMBA_CACHE_DIR``). Running this once after installing (in a Docker image build, a CI
step) moves that cost out of the first real call. It prints the time per layer and
dtype (about a second in all where the cache held them), and a NOT CACHED line where
numba could not keep them: it exits with status 1 where numba
has nowhere to write the cache (a read-only install without a writable
``NUMBA_CACHE_DIR`` or home directory), since then nothing was kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ._files import write_json
from .functional._dispatch import kernels_available, numba_import_error, use_kernels

DTYPES = ("float32", "float64")


def _layers(dtype: str) -> dict[str, Callable[[], Any]]:
    """A forward and backward of every layer and mode, on small inputs of ``dtype``."""
    import npnorm.functional as F

    rng = np.random.default_rng(0)
    rows = rng.standard_normal((3, 8)).astype(dtype)
    img = rng.standard_normal((2, 4, 3, 3)).astype(dtype)
    w8, w4 = np.ones(8, dtype), np.ones(4, dtype)
    b8, b4 = np.zeros(8, dtype), np.zeros(4, dtype)
    rm, rv = np.zeros(4, dtype), np.ones(4, dtype)

    from .kernels import _numba_loops as loops

    long_row = rng.standard_normal((2, loops.LONG_FORWARD_ROW)).astype(dtype)  # (its own forward loop)

    def layer_norm() -> None:  # short rows (pipelined) and long ones
        _, mean, rstd = F.layer_norm_forward(rows, 8, w8, b8)
        F.layer_norm_backward(rows, rows, 8, mean, rstd, w8, b8)
        with _loop_rule("LONG_ROWS_ALONE", True):
            F.layer_norm_forward(long_row, long_row.shape[1])

    def rms_norm() -> None:
        _, rstd = F.rms_norm_forward(rows, 8, w8)
        F.rms_norm_backward(rows, rows, 8, rstd, w8)

    long_rows = rng.standard_normal((2, 4, 16, 16)).astype(dtype)  # channels of 256 values per sample

    def batch_norm() -> None:  # short channel rows (in blocks of channels) and long ones
        for x in (img, long_rows):
            for training in (True, False):
                _, mean, rstd, _, _ = F.batch_norm_forward(x, rm, rv, w4, b4, training=training)
                F.batch_norm_backward(x, x, mean, rstd, w4, b4, training=training)
        for in_memory_order in (True, False):  # long channels' two training forwards
            with _loop_rule("CHANNELS_IN_MEMORY_ORDER", in_memory_order):
                F.batch_norm_forward(long_rows, rm, rv, w4, b4, training=True)
        from .kernels import numba_channels

        numba_channels.compile_span_loops(dtype)  # (only inputs of millions of values take them)

    wide = rng.standard_normal((1, 4, 24, 24)).astype(dtype)  # channels of 576 values
    last = np.moveaxis(rng.standard_normal((2, 3, 3, 16)).astype(dtype), -1, 1)  # channels-last, C = 16

    def group_norm() -> None:  # InstanceNorm with input statistics runs the same loops
        for x in (img, wide, last):  # short rows and long ones (each direction has a loop
            C = x.shape[1]  # for each), and a channels-last input's samples
            with _loop_rule("LONG_ROWS_ALONE", True):
                _, mean, rstd = F.group_norm_forward(x, 2, np.ones(C, dtype), np.zeros(C, dtype))
            with _loop_rule("LONG_ROWS_ALONE", False):  # (wide's rows pipelined, img's not)
                F.group_norm_backward(x, x, 2, mean, rstd, np.ones(C, dtype), np.zeros(C, dtype))
        from .kernels import numba_channels

        numba_channels.compile_split_loops(dtype)  # (samples fewer than the threads take them)

    return {"LayerNorm": layer_norm, "RMSNorm": rms_norm, "BatchNorm": batch_norm, "GroupNorm": group_norm}


@contextmanager
def _loop_rule(name: str, value: bool) -> Iterator[None]:
    """Inside the block, the host-dependent choice ``_numba_loops.<name>`` is ``value``, so
    that warmup compiles the loops of both choices whatever the host
    (``LONG_ROWS_ALONE``, ``CHANNELS_IN_MEMORY_ORDER``: a host takes one of each)."""
    from .kernels import _numba_loops as loops

    before = getattr(loops, name)
    setattr(loops, name, value)
    try:
        yield
    finally:
        setattr(loops, name, before)


# the loops that convert float16 data to float32 and back (float16 runs the float32 loops)
CASTS = ("half_columns_to_float", "float_to_half_columns")


def _float16_casts() -> None:
    """A float16 LayerNorm forward: its input and output go through both casts (the
    whole array as one row); and a read-only input (a second type to numba, the one array
    the loops read as given); and float16 BatchNorm forwards likewise (its blocks of
    channels: columns of the rows; the same signatures as the whole arrays)."""
    import npnorm.functional as F

    x = np.ones((2, 4), dtype=np.float16)
    F.layer_norm_forward(x, 4)
    x.flags.writeable = False
    F.layer_norm_forward(x, 4)
    channels = np.arange(2048, dtype=np.float16).reshape(2, 2, 512)  # channels of 1 KB a sample
    F.batch_norm_forward(channels, None, None, training=True)
    channels.flags.writeable = False
    F.batch_norm_forward(channels, None, None, training=True)


def _transposing_copies() -> None:
    """The copy that stages blocks of Fortran-ordered input (``loops.transpose_into``), per
    dtype (and for float16's bits), for the four kinds of block numba types apart: a whole
    array (C-ordered transposed) and a part of one, each writable and read-only (a pandas
    frame's ``.values`` under copy-on-write is read-only)."""
    from .kernels import _numba_loops as loops

    for dtype in (*DTYPES, "uint16"):
        whole = np.asfortranarray(np.ones((3, 16), dtype))
        for block in (whole, whole[:, ::2]):
            for writable in (True, False):
                src = block.view()
                src.flags.writeable = writable
                loops.transpose_into(src.T, np.empty(src.shape, dtype))


def _compiled_loops() -> int:
    """How many (loop, signature) pairs are compiled or loaded (the helpers they call
    not counted)."""
    from .kernels import _numba_loops as loops

    return sum(len(f.signatures) for n, f in vars(loops).items() if hasattr(f, "signatures") and n[0] != "_")


class NumbaBroken(RuntimeError):
    """numba is installed, but importing it raised: nothing can be compiled."""


def run(verbose: bool = True, json_path: str | None = None) -> dict[str, Any]:
    """Compile (or load from the cache) every numba kernel for float32 and float64."""
    t0 = time.perf_counter()
    if "numba" not in kernels_available():  # imports numba where it is installed
        broken = numba_import_error()
        if broken:  # (it said "not installed", and the command passed)
            raise NumbaBroken(f"numba is installed but importing it raised {broken}: nothing compiled")
        if verbose:
            print("numba is not installed: nothing to compile (pip install 'npnorm[fast]')")
        return _written({"numba": False}, json_path)

    from numba import config as numba_config

    if numba_config.DISABLE_JIT:  # type: ignore[attr-defined]  # (set at run time)
        if verbose:  # (it said "0 compiled loops ... ready", and wrote "cached": true)
            print("NUMBA_DISABLE_JIT is set: numba compiles nothing, so there is nothing to warm up")
        return _written({"numba": True, "jit": False}, json_path)

    result: dict[str, Any] = {"numba": True, "import_s": time.perf_counter() - t0, "seconds": {}}
    with use_kernels("numba"):
        for dtype in DTYPES:
            for name, call in _layers(dtype).items():
                t = time.perf_counter()
                call()
                result["seconds"][f"{name} {dtype}"] = time.perf_counter() - t
        t = time.perf_counter()
        _float16_casts()
        result["seconds"]["float16 casts"] = time.perf_counter() - t
        t = time.perf_counter()
        _transposing_copies()
        result["seconds"]["transposing copies"] = time.perf_counter() - t
    result["total_s"] = time.perf_counter() - t0
    result["compiled_loops"] = _compiled_loops()
    result["cached"] = _cached()
    if verbose:
        print(f"numba imported in {result['import_s']:.2f} s")
        for key, s in result["seconds"].items():
            print(f"  {key:20} {s:6.2f} s")
        kinds = f"{' and '.join(DTYPES)}, {len(CASTS)} float16 casts and the transposing copy"
        loops = f"{result['compiled_loops']} compiled loops ({kinds})"
        print(f"{loops} ready in {result['total_s']:.2f} s")
        if not result["cached"]:
            print(
                "NOT CACHED: numba has no writable place for its cache here (see the warning "
                "above), so every process compiles the loops again; set NUMBA_CACHE_DIR to a "
                "directory this user can write and run this again"
            )
    return _written(result, json_path)


def _cached() -> bool:
    """Whether the loops are kept in numba's on-disk cache (not in a read-only install
    without a writable ``NUMBA_CACHE_DIR`` or home directory)."""
    from .kernels import _numba_loops as loops

    return bool(loops.CACHED)


def _written(result: dict[str, Any], json_path: str | None) -> dict[str, Any]:
    """``result``, written to ``json_path`` too where one is given (also without numba:
    a script reading the file learns that nothing was compiled)."""
    if json_path:
        write_json(json_path, result)
    return result
