"""Row kernels on inputs whose batch axes lie in another order in memory.

LayerNorm and RMSNorm normalize each row (the trailing ``normalized_shape`` axes) on its
own, so the rows may be visited in any order. The fast kernels see their input as ``(R,
L)`` rows, a view where its batch axes are in C order, else copied sample by sample.
A Fortran-ordered ``(B, T, D)`` array (``x.T`` of a C-ordered ``(D, T, B)`` one, a
Fortran-ordered frame) is a view of rows only in ``(t, b)`` order: the column-major
``(T*B, D)`` matrix that the staging copies block by block at about memory speed
(``_staging``, ``_blocks.cast_into``). Walked in its own order, every value of a sample's
rows came from its own cache line: LayerNorm forward+backward at (32, 512, 768) float32
took 120-133 ms against 14-17 ms for the C-ordered input.

``memory_order`` finds the order, and ``forward`` and ``backward`` run a family's kernel on the
transposed views (``np.transpose``, no copy) and return its results for the input:

* the output (or dx) is the kernel's output transposed back: its rows C-ordered, its
  batch axes in the input's order in memory (the kernel's own output for that order,
  written once); an ``out`` laid out so is written through its transposed view and
  returned as it is, one of another layout is given the kernel's fresh output, copied
  (``_out``), but a C-ordered ``out`` for an input whose samples are views of rows,
  which keeps the input's own order (``memory_order``);
* the per-row statistics are returned C-ordered in the input's batch shape, as from every
  kernel, and taken in the rows' order by the backward;
* the parameter gradients (sums over rows) are the same sums in another order: equal to
  rounding, not bitwise, to the C-ordered input's. Each row's output, mean, rstd and dx
  are bitwise those of the C-ordered input with the compiled kernels (a row's loop does
  not depend on its neighbours), to rounding with the ``"numpy"`` family's (its row sums,
  BLAS dot products over a block, round differently in blocks of other rows).

In a backward the input's order is taken, else the gradient's where the input cannot
be seen as rows in any order (``rows_order``): an input of C-ordered rows with a
Fortran-ordered gradient keeps its own order, the gradient staged sample by sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._backend import Namespace
from .._checks import Shape, prod
from ._blocks import finish, row_layout, view

Order = tuple[int, ...]


def memory_order(a: np.ndarray, k: int, out: np.ndarray | None = None) -> Order | None:
    """The axes of ``a`` (normalized over its last ``k``) with its batch axes sorted by
    stride, largest first, and the ``k`` row axes after them, where ``a`` cannot be seen
    as ``(R, L)`` rows in its own order and can in that one; None otherwise (C-ordered
    rows, fewer than two batch axes, or no order that helps: a strided slice of the
    batch axes, rows not contiguous in any order). Also None where an ``out`` is given
    that is not C-ordered in that order but C-ordered itself, and ``a``'s samples are
    views of rows (``Rows`` copies them one by one, not whole: a Fortran-ordered (B, T,
    D)): the call keeps the input's own order and writes ``out`` directly (0.04x the
    input's bytes at peak, against 1.04x for a temporary output in that order and its
    copy), its parameters' gradients summed in another order (equal to rounding). Any
    other ``out`` is filled from the kernel's fresh output (``_out``): the results are
    then bitwise those of a call without ``out``, at about the same peak memory as the
    input's own order would take (which copies the whole input where a sample is no
    view of rows: 2.0-2.4x the input's bytes for a Fortran-ordered (8, 64, 32, 64))."""
    nb = a.ndim - k
    if nb < 2 or a.flags.c_contiguous:
        return None
    R, L = prod(a.shape[:nb]), prod(a.shape[nb:])
    if view(a, (R, L)) is not None:
        return None
    order = (*sorted(range(nb), key=lambda i: -a.strides[i]), *range(nb, a.ndim))
    if order == tuple(range(a.ndim)) or view(np.transpose(a, order), (R, L)) is None:
        return None
    if out is not None and not np.transpose(out, order).flags.c_contiguous and out.flags.c_contiguous:
        N, P, tail = row_layout(a, k)
        if view(a, (N, P, *tail)) is not None:
            return None
    return order


def rows_order(k: int, input: np.ndarray, grad_output: np.ndarray, out: np.ndarray | None) -> Order | None:
    """A backward's order (``memory_order``): the input's; the gradient's only where the
    input has none and cannot be seen as rows in its own order either. (So the backward
    on the transposed views finds no order again: the input's rows are then a view, or
    the input sorts to the same order, which did not help it.)"""
    if input.flags.c_contiguous or input.ndim - k < 2:  # (the common call: 0.1 against 2 us)
        return None
    order = memory_order(input, k, out)
    if order is not None:
        return order
    nb = input.ndim - k
    if view(input, (prod(input.shape[:nb]), prod(input.shape[nb:]))) is not None:
        return None
    return memory_order(grad_output, k, out)


def _out(out: np.ndarray | None, order: Order) -> np.ndarray | None:
    """``out``'s view in the rows' ``order``, for the kernel to write, where it is
    C-ordered there; else None, and the kernel's fresh output is copied into ``out``
    (``_restored``): the kernels would write a column-major view through a full-size
    temporary array anyway (the compiled ones), or in place in column-major blocks, 2-4x
    slower where their columns alias (the ``"numpy"`` family's)."""
    if out is None:
        return None
    view = np.transpose(out, order)
    return view if view.flags.c_contiguous else None


def _stats(s: np.ndarray, batch: Shape, order: Order) -> np.ndarray:
    """A saved per-row statistic (``batch``'s values, any shape) in the rows' ``order``;
    one of another size is passed on as it is, for the kernel's own check to reject."""
    if s.size != prod(batch):
        return s
    return np.transpose(np.reshape(s, batch), order[: len(batch)])


def _restored(
    result: np.ndarray, out: np.ndarray | None, given: np.ndarray | None, order: Order
) -> np.ndarray:
    """The kernel's output for the transposed input as the output for the input: ``out``
    itself when given (written through its transposed view ``given``, or the result
    copied into it), else the result transposed back."""
    back = np.transpose(result, np.argsort(order))
    return finish(back, out) if out is None or given is None else out


def _restored_stats(s: np.ndarray, order: Order) -> np.ndarray:
    """Per-row statistics in the rows' order (shaped as its batch axes) as the C-ordered
    array of the input's batch shape."""
    return np.ascontiguousarray(np.transpose(s, np.argsort(order[: s.ndim])))


def forward(
    kernel: Callable[..., tuple[np.ndarray, ...]],
    order: Order,
    xp: Namespace,
    input: np.ndarray,
    rest: tuple[Any, ...],
    out: np.ndarray | None,
) -> Any:
    """``kernel(xp, input, *rest, out)`` (a family's ``layer_norm_forward`` or
    ``rms_norm_forward``: the output, then per-row statistics) with the rows walked in
    ``order``."""
    given = _out(out, order)
    y, *stats = kernel(xp, np.transpose(input, order), *rest, given)
    return (_restored(y, out, given, order), *(_restored_stats(s, order) for s in stats))


def backward(
    kernel: Callable[..., tuple[Any, ...]],
    order: Order,
    xp: Namespace,
    grad_output: np.ndarray,
    input: np.ndarray,
    shape: Shape,
    stats: tuple[np.ndarray, ...],
    params: tuple[np.ndarray | None, ...],
    out: np.ndarray | None,
) -> Any:
    """``kernel(xp, grad_output, input, shape, *stats, *params, out)`` (a family's
    ``layer_norm_backward`` or ``rms_norm_backward``: dx, then the parameters'
    gradients) with the rows walked in ``order``."""
    batch = tuple(input.shape[: input.ndim - len(shape)])
    dy, x = np.transpose(grad_output, order), np.transpose(input, order)
    saved = (_stats(s, batch, order) for s in stats)
    given = _out(out, order)
    dx, *grads = kernel(xp, dy, x, shape, *saved, *params, given)
    return (_restored(dx, out, given, order), *grads)
