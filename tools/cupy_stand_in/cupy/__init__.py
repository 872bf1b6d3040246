"""A CPU stand-in for the parts of CuPy that npnorm.kernels.cupy_fused uses, backed by NumPy.

Arrays are NumPy arrays (``cupy.ndarray is numpy.ndarray``). ``RawModule`` parses the CUDA
source it is given (the typedefs, #defines and each ``extern "C" __global__`` kernel's
parameter list) and its ``get_function(name)`` returns a launcher that checks a call as
a GPU would need it (grid and block limits, argument count, each scalar's exact type)
and runs the NumPy emulation registered in ``RAW`` (``cupy._raw``; the emulations of
npnorm's kernels are in ``cupy._npnorm_kernels``). Pointer arguments are checked where the
emulation reads or writes them: dtype of the declared pointee, C-contiguous (a kernel
reads raw memory), large enough for the elements touched.

``ElementwiseKernel`` looks up its NumPy emulation by name in ``ELEMENTWISE``.

``empty`` fills float arrays with NaN, so that an element no kernel writes shows up.
Settings: ``STANDIN_SMS`` (multiprocessors, default 132 as an H200), ``STANDIN_OCCUPANCY``
(resident blocks per multiprocessor the occupancy query answers, default 2), or
``set_sms(n)`` / ``set_occupancy(n)`` at run time (npnorm caches the answers: clear
``cupy_fused._sm_count_of`` and ``_resident_blocks`` after changing them).
"""

from __future__ import annotations

import numpy as _np

from . import _npnorm_kernels, cuda  # the first registers the emulations of npnorm's kernels
from ._elementwise import CALLS as ELEMENTWISE_CALLS
from ._elementwise import ELEMENTWISE, ELEMENTWISE_BODIES, ElementwiseKernel
from ._raw import FINGERPRINTS, LAUNCHES, RAW, STALE, RawKernel, RawModule, StandinError
from .cuda import set_occupancy, set_sms

__all__ = [
    "ELEMENTWISE", "ELEMENTWISE_BODIES", "ELEMENTWISE_CALLS", "FINGERPRINTS", "LAUNCHES", "RAW", "STALE",
    "ElementwiseKernel", "RawKernel", "RawModule", "StandinError", "_npnorm_kernels", "cuda", "set_occupancy",
    "set_sms",
]  # fmt: skip

__version__ = "0.0-standin"
STANDIN = True

ndarray = _np.ndarray
float16 = _np.float16
float32 = _np.float32
float64 = _np.float64
int32 = _np.int32
int64 = _np.int64
dtype = _np.dtype

zeros = _np.zeros
ones = _np.ones
full = _np.full
ascontiguousarray = _np.ascontiguousarray
repeat = _np.repeat
stack = _np.stack
asarray = _np.asarray
concatenate = _np.concatenate
arange = _np.arange
zeros_like = _np.zeros_like
where = _np.where
isfinite = _np.isfinite
ones_like = _np.ones_like


def _poison(a: _np.ndarray) -> _np.ndarray:
    if a.dtype.kind in "fc":
        a.fill(_np.nan)
    elif a.dtype.kind in "iu":
        a.fill(_np.iinfo(a.dtype).max // 3)
    return a


def empty(shape, dtype=float, order="C"):
    """``numpy.empty``, float arrays filled with NaN (unwritten elements show)."""
    return _poison(_np.empty(shape, dtype=dtype, order=order))


def empty_like(a, dtype=None, order="K", subok=True, shape=None):
    return _poison(_np.empty_like(a, dtype=dtype, order=order, subok=subok, shape=shape))


def __getattr__(name: str):
    raise AttributeError(
        f"the CPU stand-in cupy (tools/cupy_stand_in/cupy) has no {name!r}: add it to "
        "cupy/__init__.py (with CuPy's semantics) if the code under test needs it"
    )
