"""Compiled kernels for BatchNorm, InstanceNorm and GroupNorm: the ``"numba"`` family.

Same signatures and results (to rounding) as the generic kernels in
``npnorm.functional.batch_norm`` / ``instance_norm`` / ``group_norm``; registered as the
``"numba"`` kernel family for NumPy arrays. An input of shape (N, C, *spatial) is seen
as (N, C, S), S = prod(spatial):

* BatchNorm's training forward reads the input in memory order, sample by sample
  (``loops.channel_forward``): once for the statistics, each row's pieces two-pass from
  cache and merged into their channel's (float64), and once for the output; except on
  processors other than AMD's, where the channels are pipelined as the backward's
  (``loops.channel_forward_pipelined``, see ``_channel_loop``): each host takes the one
  that measured faster there. With the running statistics (and InstanceNorm's
  running-statistics mode) the output is one pass in memory order, every channel in one
  block (``loops.channel_block_forward``). The training backward works one channel at a
  time (``loops.channel_backward``): the channel's N*S values are read from memory once
  and stay in cache for its two sums and ``dx``, the channels pipelined as the rows below
  (while channel c's dx is written, the next channel's sums are taken). With the running
  statistics ``dx`` needs no sum, and the backward of channels of ``RUNNING_ROW`` values
  a sample and more is one pass in memory order, each chunk's sums and dx together
  (``loops.channel_running_backward``). Channels of fewer than ``loops.CHUNK`` values per
  sample (BatchNorm1d's (N, C) input: one) are taken in blocks of channels instead
  (``loops.channel_block_forward`` / ``_backward``), whose rows are contiguous; with the
  running statistics, each thread's channels in one block (the backward: channels of
  fewer than ``RUNNING_ROW`` values a sample).
  The channels are split over the threads (with the running statistics, the forward's
  samples are), or, where short channels have more than ``loops.SPAN`` samples (in the
  forward, in training only), the spans of samples are (``_span_parts``; with the running
  statistics, the backward of channels of ``RUNNING_ROW`` values and more splits the
  channels instead where each thread's share of a sample's row is ``RUNNING_SHARE_BYTES``
  or more): each channel's
  sums are added in the same order by every loop, so a channel's results do not depend
  on the split, the blocks or the thread count. A channels-last input (and gradient) is
  taken as its (N*S, C) rows, BatchNorm1d's input, and a Fortran-ordered one as the (S, C,
  N) planes of its ``.T``, without a copy (``_channel_views``). A C-ordered input the loops
  cannot take as it is (float16, read-only, another dtype or byte order) is staged in
  blocks of channels (``_by_channel_blocks``), a block per staged array and thread, where
  its channels have 1 KB a sample or more, and in blocks of rows (``_staged_rows``) where
  they have one value a sample (BatchNorm1d's, channels-last rows) and the input more than
  a block per thread; other channels, small inputs and any other layout are first copied
  whole (one copy of the input).
* GroupNorm and InstanceNorm with input statistics work one (sample, group) row of
  ``(C/G)*S`` values at a time (``loops.group_forward`` / ``group_backward``), pipelined
  like LayerNorm's rows: while a row's output is written, the next rows' sums are taken,
  so that reading memory overlaps writing it; on AMD processors the forward takes rows of
  ``loops.LONG_FORWARD_ROW`` values and more one at a time instead (``group_forward_long``,
  see ``_numba_loops.one_row_at_a_time``), and the backward too, as it does rows of a few
  KB everywhere (``loops.group_backward_short``, see SHORT_ROW_BYTES). A channels-last input (with a
  channels-last gradient in the backward) is taken sample by sample instead
  (``loops.group_rows_forward`` / ``_backward``): a sample's S rows of C values, summed
  down the channels' columns in spans of rows, the sample kept in cache between its
  passes (float16, read-only and other-dtype samples staged in blocks of samples,
  ``_by_samples``); with fewer samples than threads, the threads split the samples' spans
  (``_split_samples``), for bitwise the same results; the output keeps the layout.
  Other dtypes and layouts are staged block by block (``_staging``).

dweight and dbias are reduced in float64 from per-channel or per-(sample, channel)
sums, in a fixed order: bitwise the same for any thread count. Empty inputs and
computation dtypes the loops do not compile for go to the ``"numpy"`` family.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from .._backend import Namespace, no_fp_warnings
from .._checks import cast, prod, work_dtype
from .._threads import get_num_threads
from ..functional._channels import running_update
from ..functional._dispatch import NUMPY, family_kernel, specialized
from . import _numba_loops as loops
from . import _staging
from ._blocks import (
    channels_last_rows,
    extreme_coefficients,
    finish,
    from_channel_rows,
    grad_as,
    output,
    spread_limits,
)
from ._staging import (
    Source,
    Target,
    block_size,
    cast_into,
    compiled,
    direct,
    param_or,
    plain,
    ranges,
    run,
    spans,
    vector,
)

Buffers = tuple[np.ndarray | None, np.ndarray | None]
_F64 = np.dtype(np.float64)
Params = tuple[np.ndarray, ...]  # per-channel arrays a channel loop reads or fills


def _fallback(op: str, *args: Any) -> Any:
    return family_kernel(op, "numpy")(*args)


def _source(a: np.ndarray, G: int, ct: np.dtype[Any]) -> Source:
    """(N, C, *spatial) as N*G rows of (C/G)*S values."""
    N, C = int(a.shape[0]), int(a.shape[1])
    return Source(a, N, G, (C // G, *(int(d) for d in a.shape[2:])), ct)


def _running(
    xp: Namespace,
    running_mean: np.ndarray | None,
    running_var: np.ndarray | None,
    mean: np.ndarray,
    var: np.ndarray,
    count: int,
    momentum: float,
) -> Buffers:
    """The buffers moved towards the batch's (C,) mean and variance (float64, biased over
    ``count`` values, unbiased here: by ``count/(count - 1)``, where there are buffers to
    move); a variance beyond the buffer dtype's range becomes inf (as in PyTorch)."""
    if running_mean is None or running_var is None:
        return running_mean, running_var
    unbias = count / (count - 1)
    if _compiled_buffers(running_mean, running_var, mean, var):  # the common buffers: one call
        new_mean, new_var = np.empty_like(running_mean), np.empty_like(running_var)  # C, C
        loops.running_moved(running_mean, running_var, mean, var, unbias, momentum, new_mean, new_var)
        return new_mean, new_var
    new_mean = running_update(xp, running_mean, mean, momentum)  # C
    return new_mean, running_update(xp, running_var, var * unbias, momentum)  # C, unbiased


def _coefficients_leave(rstd: np.ndarray, weight: np.ndarray | None, ct: np.dtype[Any]) -> bool:
    """``extreme_coefficients(rstd, weight, ct, tiny=False)``: whether the backward's
    coefficients would leave ``ct`` (the NumPy kernels take the call then), in one
    compiled call (``loops.coefficients_leave``) where rstd and the weight are C-ordered,
    writable arrays of ``ct`` (the saved statistics and parameters, as a rule)."""
    if plain(rstd, ct) and (weight is None or (plain(weight, ct) and weight.ndim == 1)):
        low, _, largest = spread_limits(ct)
        r = rstd.reshape(-1)  # (N, C) or (N, G) where per sample and group
        return bool(
            loops.coefficients_leave(
                r, r if weight is None else weight, weight is not None, float(low), largest
            )
        )
    return extreme_coefficients(rstd, weight, ct, tiny=False)


def _compiled_buffers(
    running_mean: np.ndarray, running_var: np.ndarray, mean: np.ndarray, var: np.ndarray
) -> bool:
    """Whether ``loops.running_moved`` takes these: ``plain`` (C,) buffers of one compiled
    dtype and ``plain`` float64 batch statistics (``running_update`` computes in the
    batch's dtype; the forwards' own arrays, as a rule)."""
    dtype = running_mean.dtype
    return (
        compiled(dtype)
        and plain(running_mean, dtype)
        and plain(running_var, dtype)
        and plain(mean, _F64)
        and plain(var, _F64)
        and running_mean.ndim == 1
        and running_mean.shape == running_var.shape == mean.shape == var.shape
    )


# --- per-channel statistics: BatchNorm, and running statistics --------------------------

# Channels of short rows (S < CHUNK values) go to ``loops.channel_block_forward`` /
# ``_backward`` in blocks of channels (with the running statistics, and the forward's
# output pass alone, in one block; the backward with running statistics only below
# RUNNING_ROW values: see the comments before ``_channel_forward`` and
# ``_channel_backward``): as many as keep BLOCK_BYTES of each array in cache
# between the passes, and enough for rows of ROW_BYTES at least, so that the passes stream
# through memory where the channels are long (BatchNorm1d's (N, C) input with many samples).
# Timed against one channel at a time on a 2-vCPU Xeon (forward+backward, float32): 6-12x
# faster at S = 1, 19% at (32, 512, 7, 7), 4-5% at S = 64 and 196; from S = 128 to 784
# within 2% either way, so channels of CHUNK values and more go to the channel loops.
BLOCK_BYTES = 256 * 1024
ROW_BYTES = 8 * 1024

# GroupNorm's and InstanceNorm's backward takes (sample, group) rows of at most
# SHORT_ROW_BYTES whose channels have at most SHORT_SPAN_BYTES each one row at a time,
# with no pipeline (``loops.group_backward_short``, bitwise the same results): the
# pipeline's steps alternate between two rows in spans of one channel, too short there
# for the hardware to stream them. Timed against the pipelined loop on a 2-vCPU Xeon
# (backward, (32, 512, H, W), 2 threads): 8-15% faster for InstanceNorm at 4x4 to 14x14 in
# float32 (4x4, 7x7 in float64), 2-9% for GroupNorm at 5x5 to 10x10 with 16-512 groups
# (rows of 400 B to 6 KB); 4-5% slower for InstanceNorm at 28x28 (channels of 3 KB), and
# the loops alone 18% slower for GroupNorm(32) at 14x14 (rows of 12 KB). Where the forward
# takes long rows one at a time (``loops.one_row_at_a_time``: AMD processors, rows of
# LONG_FORWARD_ROW values and more), so does the backward, whatever their channels: on a
# 2-vCPU AMD EPYC (``znver5``, 2026-12-06; float32, 2 threads, a module's backward
# interleaved with the pipelined one's) it took 0.79-0.84x the pipeline's time at (32,
# 64, 56, 56) with 32 and 64 groups, (8, 64, 128, 128) and (32, 64, 28, 28), 0.94x at
# (16, 32, 224, 224); on the earlier AMD host it measured 0.89-1.07x.
SHORT_ROW_BYTES = 8192
SHORT_SPAN_BYTES = 1024


def _short_rows(L: int, S: int, ct: np.dtype[Any]) -> bool:
    """Whether rows of L values, channels of S, go to ``loops.group_backward_short``."""
    return L * ct.itemsize <= SHORT_ROW_BYTES and S * ct.itemsize <= SHORT_SPAN_BYTES


def _channel_block(N: int, S: int, ct: np.dtype[Any]) -> int:
    """The channels per block of ``loops.channel_block_forward``/``_backward``, or 0 for
    channels of S values long enough for the channel loops (``loops.channel_forward``,
    ``channel_backward``)."""
    if S >= loops.CHUNK:
        return 0
    row = S * ct.itemsize  # bytes of one channel's row of a sample
    return max(BLOCK_BYTES // (N * row), -(-ROW_BYTES // row), 1)


# Short channels (in blocks) split their spans of samples over the threads from
# SPLIT_VALUES values per thread. The split takes three hand-offs to the pool in the
# forward and two in the backward, each 0.1-0.15 ms on a 2-vCPU VM; below this one thread
# takes them all. Timed with two threads against one: forward and backward, (256, 512)
# 0.34 and 0.28 ms against 0.08 and 0.09, (2048, 512) 0.72 and 0.82 against 0.53 and 0.79;
# (4096, 1024) 3 and 4 ms against 4 and 7 (the threads that split the channels before
# took 4-6 and 6-8 ms there, and up to 2x one thread's time at (16384, 256)).
SPLIT_VALUES = 1 << 21
# Below that, the threads split the channels (of inputs large enough to split at all:
# ``_staging.MIN_PARALLEL``) where each one's share of a sample's row is at least
# SHARE_BYTES (with two threads, forward+backward: (256, 2048) 0.7 ms against
# 1.0 in one thread, (128, 512, 7, 7) 6 against 10.4), else one thread takes them all
# (shares of 1 KB, at (256, 512): 0.35 ms split so, against 0.17).
SHARE_BYTES = 4096


def _span_parts(N: int, C: int, S: int, itemsize: int) -> list[tuple[int, int]] | None:
    """The threads' ranges of the spans of ``loops.SPAN`` samples, where the samples of
    short channels (taken in blocks) are split over the threads; below ``SPLIT_VALUES``
    values per thread, one range (the calling thread), or None (the threads split the
    channels, as ``ranges`` allows) where each thread's share of a sample's row is at
    least ``SHARE_BYTES`` (and where there are too few samples to split)."""
    spans = -(-N // loops.SPAN)
    threads = get_num_threads()
    n = max(1, min(threads, spans, N * C * S // SPLIT_VALUES))
    if spans < 2 or (n == 1 and C * S * itemsize >= SHARE_BYTES * threads):
        return None
    return [(k * spans // n, (k + 1) * spans // n) for k in range(n)]


def _span_statistics(
    x: np.ndarray, S: int, mean: np.ndarray, var: np.ndarray, parts: list[tuple[int, int]]
) -> None:
    """Each channel's mean and biased variance (float64 (C,), into ``mean``, ``var``) of
    x (N, C*S), the threads taking the spans of samples of ``parts`` (see _numba_loops)."""

    def fill(dev: bool, sums: np.ndarray) -> None:
        run(partial(loops.channel_span_sums, x, S, dev, mean, sums), parts)

    _moments_of_spans(fill, parts[-1][1], x.shape[0] * S, mean, var)


def _moments_of_spans(
    fill: Callable[[bool, np.ndarray], None], count: int, M: int, mean: np.ndarray, var: np.ndarray
) -> None:
    """``mean`` and the biased ``var`` (float64 (C,)) of M values per channel from the
    sums of ``count`` spans: ``fill(dev, sums)`` puts each span's sums (of the values, or
    with ``dev`` of their squared deviations from ``mean``) in ``sums`` (spans, C), added
    in span order (``loops.add_spans``), as every BatchNorm loop adds them."""
    sums = np.empty((count, mean.shape[0]))  # spans,C float64
    for dev, stat in ((False, mean), (True, var)):  # the mean, then the variance
        fill(dev, sums)
        loops.add_spans(sums, stat)
        stat /= M  # C


def _span_sum_arrays(spans: int, C: int, ct: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The backward's per-span partial sums, (spans, C) each: ``sum(dy)`` and ``sum(dy*(x -
    mean))`` in float64, ``sum(x - mean)`` in the data's dtype ``ct`` (see loops.SPAN)."""
    return np.empty((spans, C)), np.empty((spans, C)), np.empty((spans, C), dtype=ct)


def _span_grads(
    sums: tuple[np.ndarray, np.ndarray, np.ndarray],
    m: np.ndarray,
    r: np.ndarray,
    w: np.ndarray,
    M: int,
    training: bool,
    dw: np.ndarray,
    db: np.ndarray,
    ct: np.dtype[Any],
) -> tuple[np.ndarray, ...]:
    """From the spans' ``sum(dy)``, ``sum(dy*(x - mean))`` (float64), ``sum(x - mean)``
    (the data's dtype) ((spans, C) each, added in span order): dweight and dbias (into
    ``dw``, ``db``) and dx's coefficients per channel ``(a, k1, d_hi, d_lo)`` in ``ct``
    (``loops.channel_grads``; M values per channel)."""
    C = r.shape[0]
    totals = np.empty(C), np.empty(C), np.empty(C)  # C float64 each
    for part, total in zip(sums, totals, strict=True):
        loops.add_spans(part, total)
    av, k1v, dhv, dlv = (np.empty(C, dtype=ct) for _ in range(4))  # C each
    loops.channel_grads(m, r, w, *totals, M, training, dw, db, av, k1v, dhv, dlv)
    return av, k1v, dhv, dlv


def _span_backward(
    dy: np.ndarray,
    x: np.ndarray,
    dx: np.ndarray,
    S: int,
    m: np.ndarray,
    r: np.ndarray,
    w: np.ndarray,
    training: bool,
    dw: np.ndarray,
    db: np.ndarray,
    parts: list[tuple[int, int]],
) -> None:
    """BatchNorm's backward on dy, x, dx (N, C*S), the threads taking the spans of samples
    of ``parts`` for the sums, then their samples for dx (see _numba_loops)."""
    N, C = x.shape[0], m.shape[0]
    sums = _span_sum_arrays(parts[-1][1], C, dx.dtype)
    run(partial(loops.channel_span_dy_sums, dy, x, S, m, r, *sums), parts)
    av, k1v, dhv, dlv = _span_grads(sums, m, r, w, N * S, training, dw, db, dx.dtype)

    def samples(r0: int, r1: int) -> None:
        loops.channel_dx(dy[r0:r1], x[r0:r1], dx[r0:r1], 0, S, training, av, k1v, m, r, dhv, dlv)

    run(samples, ranges(N, C * S))


def compile_span_loops(dtype: str) -> None:
    """Compile (or load) the loops of the samples split over the threads, which only
    inputs of millions of values take: on two spans of samples (``python -m npnorm
    warmup``), whatever the thread count, and with no setting changed."""
    x = np.ones((2 * loops.SPAN, 4), dtype=dtype)  # N,C
    C, ct, parts = 4, x.dtype, [(0, 1), (1, 2)]
    mean, var = np.empty(C), np.empty(C)
    _span_statistics(x, 1, mean, var, parts)
    m, r, w = mean.astype(ct), np.ones(C, dtype=ct), np.ones(C, dtype=ct)
    _span_backward(x, x, np.empty_like(x), 1, m, r, w, True, np.empty(C), np.empty(C), parts)


# Staged BatchNorm (float16, read-only or other-dtype C-ordered input) with channels of
# STAGED_SPAN_BYTES or more per sample takes blocks of channels: a thread copies a block's
# (N, k*S) columns in the computation dtype into scratch, runs the channel loops there,
# and copies the output's columns back. Its scratch is one block per staged array (2 in
# the forward, 3 in the backward), a block holding STAGE_BYTES of channels or one channel
# (N*S values) where that is more, not a float32 copy of the whole input and output (5x a
# float16 input's bytes before). The loops see each channel's values as they would
# unstaged, so the results are bitwise the same. Shorter channels do not go so: read in
# blocks of channels, each sample's part of a block was a few bytes, and with few channels
# the threads split the channels instead of the samples' spans (float16 (262144, 4) took
# 46 ms, against 7-9 copied whole); those of one value a sample go by blocks of rows
# (below), the others are copied whole.
STAGED_SPAN_BYTES = 1024


def _channel_blocks(input: np.ndarray, S: int, *others: np.ndarray) -> bool:
    """Whether a staged input (and gradient) go by blocks of channels."""
    arrays = (input, *others)
    return all(a.flags.c_contiguous for a in arrays) and S * input.dtype.itemsize >= STAGED_SPAN_BYTES


def _staged_channels(N: int, C: int, S: int, ct: np.dtype[Any]) -> int:
    """Channels per block of ``_by_channel_blocks``."""
    return max(1, min(C, _staging.STAGE_BYTES // max(1, N * S * ct.itemsize)))


def _read_columns(a: np.ndarray, lo: int, hi: int, buf: np.ndarray) -> None:
    """Columns ``[lo, hi)`` of ``a`` (N, W), C-ordered, into ``buf`` (N, hi - lo) of the
    computation dtype (float16 by the compiled casts)."""
    if a.dtype == _staging.HALF and buf.dtype == _staging.SINGLE and loops.CASTS_COMPILED:
        loops.half_columns_to_float(a.view(np.uint16), lo, hi, buf)
    else:
        np.copyto(buf, a[:, lo:hi], casting="unsafe")


def _write_columns(buf: np.ndarray, a: np.ndarray, lo: int) -> None:
    """``buf`` (N, k) into columns ``[lo, lo + k)`` of ``a`` (N, W), converted to its dtype."""
    if a.dtype == _staging.HALF and buf.dtype == _staging.SINGLE and loops.CASTS_COMPILED:
        loops.float_to_half_columns(buf, lo, a.view(np.uint16))
    else:
        np.copyto(a[:, lo : lo + buf.shape[1]], buf, casting="unsafe")


def _by_channel_blocks(
    sources: list[np.ndarray],
    target: np.ndarray,
    N: int,
    C: int,
    S: int,
    ct: np.dtype[Any],
    block: Callable[[list[np.ndarray], np.ndarray, int, int], None],
) -> None:
    """``block(staged sources, staged output, a, e)`` for blocks of channels ``[a, e)``,
    each staged as (N, (e - a)*S) arrays of ``ct``; ``sources`` and ``target`` are
    C-ordered (N, C, *spatial) arrays. The threads take ranges of channels."""
    k = _staged_channels(N, C, S, ct)
    src2 = [a.reshape(N, C * S) for a in sources]  # N,C*S each
    dst2 = target.reshape(N, C * S)  # N,C*S

    def task(c0: int, c1: int) -> None:
        size = N * min(k, c1 - c0) * S  # a block's values
        bufs = [np.empty(size, dtype=ct) for _ in range(len(sources) + 1)]
        for a, e in spans(c0, c1, k):
            n = (e - a) * S
            staged = [buf[: N * n].reshape(N, n) for buf in bufs]  # N,n each
            for src, st in zip(src2, staged, strict=False):
                _read_columns(src, a * S, e * S, st)
            block(staged[:-1], staged[-1], a, e)
            _write_columns(staged[-1], dst2, a * S)

    run(task, ranges(C, N * S))


# Staged BatchNorm whose channels have one value a sample (BatchNorm1d's (N, C) input,
# channels-last input as its (N*S, C) rows) goes by blocks of rows: each thread converts
# blocks of about STAGE_BYTES (whole spans of ``loops.SPAN`` rows) into scratch of the
# computation dtype, for the spans' sums (the statistics' two passes, or dy's sums: the
# loops the threads take unstaged where they split the spans, ``_span_statistics``,
# ``_span_backward``), then again for the output or dx (three conversions in a training
# forward, two in a backward). The sums are those the unstaged
# loops take, span by span, added in the same order: bitwise the same results, with a
# few blocks of scratch per thread instead of float32 copies of the whole input and
# output (float16 (100352, 64) forward+backward, two threads: 0.49-0.53x the time of
# the whole copies, and 2.6x the input's bytes at peak, outputs included, against 8.1x).
# Inputs of one block per thread or less are copied whole still: at (256, 64) the blocks'
# conversions cost 1.18x the time, and with few rows of many channels (float16 (32,
# 65536), a span of 64 rows is one block larger than STAGE_BYTES) the spans' sums ran in
# one thread where the whole copy's channel loops split the channels (a review: 1.6x the
# time, and more memory).


def _by_rows(input: np.ndarray, ct: np.dtype[Any], *others: np.ndarray) -> bool:
    """Whether a staged input (and gradient) of one value per channel and sample, (M, C)
    rows, go by blocks of rows: C-ordered, more than a block (``_row_block``) per thread."""
    arrays = (input, *others)
    M, C = int(input.shape[0]), int(input.shape[1])
    return all(a.flags.c_contiguous for a in arrays) and M > get_num_threads() * _row_block(C, ct)


def _row_block(C: int, ct: np.dtype[Any]) -> int:
    """Rows per block of ``_staged_rows``: about ``STAGE_BYTES``, whole spans."""
    return max(1, _staging.STAGE_BYTES // (loops.SPAN * C * ct.itemsize)) * loops.SPAN


def _staged_rows(
    sources: list[np.ndarray],
    scratch: int,
    ct: np.dtype[Any],
    start: int,
    stop: int,
    work: Callable[[int, int, list[np.ndarray]], None],
) -> None:
    """``work(a, e, blocks)`` for the blocks of ``_row_block`` rows in ``[start, stop)``
    of the C-ordered (M, C) ``sources``: their rows ``[a, e)`` converted to ``ct``, then
    ``scratch`` more blocks of that size for the results."""
    C = int(sources[0].shape[1])
    R = _row_block(C, ct)
    bufs = [np.empty((min(R, stop - start), C), dtype=ct) for _ in range(len(sources) + scratch)]
    for a, e in spans(start, stop, R):
        blocks = [buf[: e - a] for buf in bufs]  # e-a,C each
        for src, block in zip(sources, blocks, strict=False):
            cast_into(block, src[a:e])
        work(a, e, blocks)


def _staged_spans(
    sources: list[np.ndarray], ct: np.dtype[Any], work: Callable[[int, int, list[np.ndarray]], None]
) -> None:
    """``work(k, n, blocks)`` for the blocks of ``_staged_rows`` (whole spans of
    ``loops.SPAN`` rows: n spans beginning at span k), the threads taking ranges of the
    spans."""
    M, C = int(sources[0].shape[0]), int(sources[0].shape[1])
    count = -(-M // loops.SPAN)

    def block(a: int, e: int, blocks: list[np.ndarray]) -> None:
        work(a // loops.SPAN, -(-(e - a) // loops.SPAN), blocks)

    def task(k0: int, k1: int) -> None:
        _staged_rows(sources, 0, ct, k0 * loops.SPAN, min(k1 * loops.SPAN, M), block)

    # (whole spans: a count of them rounded up could pass the threads' threshold where
    # the M*C values do not)
    run(task, ranges(count, loops.SPAN * C) if M * C >= 2 * _staging.MIN_PARALLEL else [(0, count)])


def _staged_row_statistics(x: np.ndarray, mean: np.ndarray, var: np.ndarray, ct: np.dtype[Any]) -> None:
    """``_span_statistics`` of x (M, C), C-ordered, staged by blocks of rows."""
    M = int(x.shape[0])

    def fill(dev: bool, sums: np.ndarray) -> None:
        def work(k: int, n: int, blocks: list[np.ndarray]) -> None:
            loops.channel_span_sums(blocks[0], 1, dev, mean, sums[k : k + n], 0, n)

        _staged_spans([x], ct, work)

    _moments_of_spans(fill, -(-M // loops.SPAN), M, mean, var)


def _staged_row_backward(
    dy: np.ndarray,
    x: np.ndarray,
    dx: np.ndarray,
    m: np.ndarray,
    r: np.ndarray,
    w: np.ndarray,
    training: bool,
    dw: np.ndarray,
    db: np.ndarray,
    ct: np.dtype[Any],
) -> None:
    """``_span_backward`` of dy, x into dx (M, C), C-ordered, staged by blocks of rows."""
    M, C = int(x.shape[0]), int(x.shape[1])
    count = -(-M // loops.SPAN)
    sums = _span_sum_arrays(count, C, ct)

    def span_sums(k: int, n: int, blocks: list[np.ndarray]) -> None:
        loops.channel_span_dy_sums(blocks[0], blocks[1], 1, m, r, *(t[k : k + n] for t in sums), 0, n)

    _staged_spans([dy, x], ct, span_sums)
    av, k1v, dhv, dlv = _span_grads(sums, m, r, w, M, training, dw, db, ct)

    def rows_dx(a: int, e: int, blocks: list[np.ndarray]) -> None:
        dyb, xb, dxb = blocks if training else (blocks[0], blocks[0], blocks[1])  # (eval: dx = a*dy)
        loops.channel_dx(dyb, xb, dxb, 0, 1, training, av, k1v, m, r, dhv, dlv)
        cast_into(dx[a:e], dxb)

    srcs = [dy, x] if training else [dy]
    run(lambda r0, r1: _staged_rows(srcs, 1, ct, r0, r1, rows_dx), ranges(M, C))


def _one_call(input: np.ndarray, training: bool, ct: np.dtype[Any], out: np.ndarray | None) -> bool:
    """Whether ``_channel_forward`` calls its loop at once for ``input``: a small
    C-ordered input of the computation dtype, writable, with no ``out`` or a C-ordered
    one of that dtype apart from it (``direct``), one thread's work, whose general path
    (its sweep) makes one loop call over all channels in the calling thread; the short
    cut makes that call without the layout tests and the threads' closures (BatchNorm's
    eval forward at (2, 8, 4, 4): 11-15 against 13-23 us a call). Not for a C-ordered
    input with one value per channel and sample (S = 1 with three axes or more): it is
    channels-last too, and goes through that view (which may then take the short cut)."""
    if not 0 < input.size < 2 * _staging.MIN_PARALLEL or not direct(ct, out, input):
        return False
    N, C = int(input.shape[0]), int(input.shape[1])
    S = input.size // (N * C)
    if S == 1 and input.ndim >= 3:
        return False
    if training and _channel_block(N, S, ct):  # short channels: unless their spans are split
        parts = _span_parts(N, C, S, ct.itemsize)
        return parts is None or len(parts) == 1
    return True


def _channel_loop() -> Any:
    """BatchNorm's training forward loop for channels of ``loops.CHUNK`` values a sample
    and more: the input in memory order (``loops.channel_forward``) on AMD processors, the
    channels pipelined (``channel_forward_pipelined``) on others, whichever measured
    faster there (``loops.CHANNELS_IN_MEMORY_ORDER``)."""
    if not loops.CHANNELS_IN_MEMORY_ORDER:
        return loops.channel_forward_pipelined
    return loops.channel_forward


# The output alone (the running statistics, or the batch's taken already by the threads'
# spans) takes every channel as one block of ``loops.channel_block_forward``: each
# sample's row of C*S values in memory order, a span of S values per channel. Short
# channels in blocks of ``_channel_block`` made it read a block's N rows C*S values apart
# (twice the time at (64, 256, 14, 14)), and ``channel_forward`` makes a view per (sample,
# channel). Timed on a 2-vCPU AMD EPYC (2026-12-07, float32, the loops alone on one
# thread, 15 interleaved rounds, medians of the per-round ratios; two runs): 0.50-0.52x
# the blocks' time at (64, 256, 14, 14) (0.70 against 1.47 ms; a copy 0.63), 0.84-0.96x
# at (64, 256, 7, 7) and (64, 64, 15, 15); 0.70-0.77x ``channel_forward``'s at (16, 256,
# 16, 16) and 0.89x at (8, 64, 28, 28); 0.93-1.02x at five other shapes from (8, 64, 12,
# 12) to (1, 64, 65536); 1.00-1.06x at seven where both made the same calls (as many
# channels as one short block holds).


def _channel_forward(
    input: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    eps: float,
    training: bool,
    mean: np.ndarray,
    var: np.ndarray,
    ct: np.dtype[Any],
    out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """BatchNorm's forward loops over all channels: with ``training`` they fill ``mean``
    and ``var`` (float64 (C,)), else they normalize with them. Returns ``(y, rstd)``.
    A channels-last or Fortran-ordered input is taken as a C-ordered view
    (``_channel_views``), y in its layout."""
    one = _one_call(input, training, ct, out)
    views = None if one else _channel_views(out, input)
    if views is not None:  # channels-last or Fortran order, as a C-ordered view
        (x_v,), out_v, back = views
        y, rstd = _channel_forward(x_v, weight, bias, eps, training, mean, var, ct, out_v)
        return (finish(back(y), out) if out is None or out_v is None else out), rstd
    N, C = int(input.shape[0]), int(input.shape[1])
    S = prod(input.shape[2:])
    w, b = param_or(weight, C, ct, 1.0), param_or(bias, C, ct, 0.0)  # C, C
    rstd = np.empty(C, dtype=ct)  # C
    B = _channel_block(N, S, ct)  # (in training; the output alone: every channel in one block)
    if one:  # the sweep's one call, made at once
        y = np.empty(input.shape, dtype=ct) if out is None else out
        if training and not B:
            _channel_loop()(
                input.reshape(N, C, S), w, b, eps, True, mean, var, rstd, y.reshape(N, C, S), 0, C
            )
        else:  # x, y as N,C*S: the rows of the blocks
            x2, y2 = input.reshape(N, C * S), y.reshape(N, C * S)
            loops.channel_block_forward(
                x2, w, b, eps, training, mean, var, rstd, y2, B if training else C, 0, C
            )
        return y, rstd

    def loop(
        x: np.ndarray,
        y: np.ndarray,
        c0: int,
        c1: int,
        r: np.ndarray,
        stats: bool,
        p: Params = (w, b, mean, var),
    ) -> None:  # x, y (n,C',S); p: the C' channels' w, b, mean, var (all C, or a staged block's)
        if stats and not B:
            _channel_loop()(x, p[0], p[1], eps, True, p[2], p[3], r, y, c0, c1)
            return
        x2, y2 = x.reshape(x.shape[0], -1), y.reshape(x.shape[0], -1)  # n,C'*S: the rows of the blocks
        block = B if stats else max(c1 - c0, 1)  # the output alone: one block
        loops.channel_block_forward(x2, p[0], p[1], eps, stats, p[2], p[3], r, y2, block, c0, c1)

    def sweep(x: np.ndarray, y: np.ndarray) -> None:  # x, y: N,C,S
        parts = _span_parts(N, C, S, ct.itemsize) if training and B else None
        if training and (parts is None or len(parts) == 1):  # one thread, or they split the channels
            channels = ranges(C, N * S) if parts is None else [(0, C)]
            run(lambda c0, c1: loop(x, y, c0, c1, rstd, True), channels)
            return
        if parts is not None:  # the threads split the spans of samples: their sums first
            _span_statistics(x.reshape(N, C * S), S, mean, var, parts)

        def samples(r0: int, r1: int) -> None:  # every channel of samples [r0, r1)
            r = rstd if r0 == 0 else np.empty(C, dtype=ct)
            loop(x[r0:r1], y[r0:r1], 0, C, r, False)  # from the statistics in mean, var

        # with the running statistics the samples split: threads that split the channels of
        # every row wrote neighbouring parts of each row (BatchNorm1d's (N, C) eval was 2-3x
        # slower with two threads than with one)
        run(samples, ranges(N, C * S))

    if direct(ct, out, input):  # no staging
        y = np.empty(input.shape, dtype=ct) if out is None else out
        sweep(input.reshape(N, C, S), y.reshape(N, C, S))
        return y, rstd
    if _channel_blocks(input, S):  # float16, read-only, another dtype: blocks of channels

        def block(src: list[np.ndarray], yb: np.ndarray, a: int, e: int) -> None:  # src [x] (N,k*S)
            x3, y3 = src[0].reshape(N, e - a, S), yb.reshape(N, e - a, S)  # N,k,S each
            loop(x3, y3, 0, e - a, rstd[a:e], training, (w[a:e], b[a:e], mean[a:e], var[a:e]))

        y = output(out, input.shape, input.dtype, (N * C, S), (input,), contiguous=True)
        _by_channel_blocks([input], y, N, C, S, ct, block)
        return finish(y, out), rstd
    if S == 1 and _by_rows(input, ct):  # a value per channel and sample: blocks of rows
        y = output(out, input.shape, input.dtype, (N * C, S), (input,), contiguous=True)
        x2, y2 = input.reshape(N, C), y.reshape(N, C)  # N,C  N,C
        if training:
            _staged_row_statistics(x2, mean, var, ct)

        def rows_out(a: int, e: int, blocks: list[np.ndarray], r: np.ndarray) -> None:
            loop(blocks[0].reshape(e - a, C, 1), blocks[1].reshape(e - a, C, 1), 0, C, r, False)
            cast_into(y2[a:e], blocks[1])

        def samples_out(r0: int, r1: int) -> None:
            r = rstd if r0 == 0 else np.empty(C, dtype=ct)  # (every thread's: the same values)
            _staged_rows([x2], 1, ct, r0, r1, partial(rows_out, r=r))

        run(samples_out, ranges(N, C))
        return finish(y, out), rstd
    x = _source(input, C, ct).whole().reshape(N, C, S)  # N,C,S
    y = output(out, input.shape, input.dtype, (N * C, S), (input,), contiguous=True)
    dst = Target(y, N * C, S, ct)
    y3 = (dst.rows if dst.direct else np.empty((N * C, S), dtype=ct)).reshape(N, C, S)  # N,C,S
    sweep(x, y3)
    if not dst.direct:
        dst.all_done(y3.reshape(N * C, S))
    return finish(y, out), rstd


# With the running statistics the backward's dx (``a*dy``) needs no sum. Channels of
# RUNNING_ROW values a sample and more take ``loops.channel_running_backward``: one pass in
# memory order, each chunk's sums and then its dx while it is in cache, dy read once
# (unless the threads split the spans of samples, ``_span_backward``: see
# RUNNING_SHARE_BYTES). Shorter channels take each thread's channels (or a staged block's)
# as one block of ``loops.channel_block_backward``: its sums pass, then its dx pass, each
# through memory in order, instead of training's blocks, whose N rows lie C*S values
# apart. Every one of these loops adds the same sums in the same order: bitwise the same
# results. Timed on a 2-vCPU AMD EPYC (2026-12-07, float32, the loops
# alone on one thread, 15 interleaved rounds, medians of the per-round ratios):
# - one block against training's blocks (two runs): 0.45-0.50x their time at (64, 256,
#   14, 14), 0.68-0.73x at (64, 64, 15, 15), 0.85x at (64, 256, 7, 7), 0.84-0.87x at (256,
#   8192), 0.98-1.02x at (8, 64, 12, 12); the same calls at (32, 128, 4, 4), (4096, 1024)
#   and (256, 64, 2, 2);
# - the one pass against one block: 0.67x its time at (64, 256, 14, 14), 0.75x at (64, 64,
#   15, 15), 0.78-0.83x at (64, 256, 8, 8) and (64, 256, 10, 10), 0.93x at (64, 256, 7,
#   7); 0.89-0.99x at 32 to 40 values a sample, 1.1-1.7x at 24 and fewer (float64:
#   0.69-0.74x at 64 and 100 values, 0.85x at 49, 1.07x at 32): RUNNING_ROW is where
#   both dtypes gained more than this VM's noise;
# - the one pass against ``channel_backward`` on long channels: see
#   ``loops.channel_running_backward`` (0.40-0.74x its time).
RUNNING_ROW = 64
# Where the threads would split the spans of samples of channels of RUNNING_ROW to 255
# values a sample (under CHUNK) (``_span_parts``: many samples, millions of values;
# ``_span_backward`` reads dy twice), the one pass splits the channels instead where each
# thread's share of a sample's row is RUNNING_SHARE_BYTES or more. Two threads, float32,
# ``F.batch_norm_backward`` with running statistics into ``out``, split so against the
# spans in alternating processes (four runs each): 4.4-5.8 ms against 5.7-6.9 at (256,
# 256, 14, 14) (shares of 100 KB), 1.3-1.4 against 1.6-2.4 at (128, 512, 8, 8) (64 KB),
# 1.2-1.9 against 1.4-2.3 at (256, 256, 8, 8) (32 KB); about the same at (512, 128, 8, 8)
# (16 KB); slower with shares of 8 KB and 4 KB ((1024, 64, 8, 8) 1.7-2.7 against 1.4-2.2,
# (2048, 32, 8, 8) 1.7-3.2 against 1.4-2.4 ms).
RUNNING_SHARE_BYTES = 32 * 1024


def _channel_backward(
    grad_output: np.ndarray,
    input: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    training: bool,
    ct: np.dtype[Any],
    out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """BatchNorm's backward loops over all channels, from (C,) statistics: with
    ``training`` (batch statistics), else the affine map's ``dx = rstd*w*dy``
    (``loops.channel_backward``, ``channel_running_backward`` or the blocks' loop).
    Channels-last or Fortran-ordered input and gradient are taken as C-ordered views
    (``_channel_views``), dx in their layout."""
    views = _channel_views(out, grad_output, input)
    if views is not None:  # channels-last or Fortran order, as C-ordered views
        (dy_v, x_v), out_v, back = views
        dx, dw, db = _channel_backward(dy_v, x_v, mean, rstd, weight, bias, training, ct, out_v)
        return (finish(back(dx), out) if out is None or out_v is None else out), dw, db
    N, C = int(input.shape[0]), int(input.shape[1])
    S = prod(input.shape[2:])
    m, r = vector(mean, C, ct), vector(rstd, C, ct)  # C, C
    w = param_or(weight, C, ct, 1.0)  # C
    dw, db = np.empty(C), np.empty(C)  # C, C float64
    B = _channel_block(N, S, ct)

    fused = not training and S >= RUNNING_ROW  # (else short channels: in blocks)

    def loop(
        dy: np.ndarray, x: np.ndarray, dx: np.ndarray, c0: int, c1: int, p: Params = (m, r, w, dw, db)
    ) -> None:  # N,C',S; p: the C' channels' mean, rstd, w, dw, db (all C, or a staged block's)
        if B and not fused:  # as N,C'*S: the rows of the blocks
            dy2, x2, dx2 = dy.reshape(N, -1), x.reshape(N, -1), dx.reshape(N, -1)
            block = B if training else max(c1 - c0, 1)  # with the running statistics: one block
            loops.channel_block_backward(dy2, x2, p[0], p[1], p[2], training, dx2, p[3], p[4], block, c0, c1)
        elif training:
            loops.channel_backward(dy, x, p[0], p[1], p[2], True, dx, p[3], p[4], c0, c1)
        else:  # dx needs no sum: one pass in memory order
            loops.channel_running_backward(dy, x, p[0], p[1], p[2], dx, p[3], p[4], c0, c1)

    def sweep(dy: np.ndarray, x: np.ndarray, dx: np.ndarray) -> None:  # N,C,S
        parts = _span_parts(N, C, S, ct.itemsize) if B else None
        channels = ranges(C, N * S)  # the threads' channels, where they split them
        if parts is not None and len(parts) > 1 and fused:  # (see RUNNING_SHARE_BYTES)
            if C * S * ct.itemsize >= RUNNING_SHARE_BYTES * len(channels):
                parts = None  # the one pass, the threads splitting the channels
        if parts is None or len(parts) == 1:  # the threads split the channels, or one thread
            run(partial(loop, dy, x, dx), channels if parts is None else [(0, C)])
            return
        args = (dy.reshape(N, C * S), x.reshape(N, C * S), dx.reshape(N, C * S), S, m, r, w)  # N,C*S each
        _span_backward(*args, training, dw, db, parts)

    if direct(ct, out, input, grad_output):  # no staging
        dx = np.empty(input.shape, dtype=ct) if out is None else out
        sweep(grad_output.reshape(N, C, S), input.reshape(N, C, S), dx.reshape(N, C, S))
        return dx, grad_as(dw, weight), grad_as(db, bias)
    if _channel_blocks(input, S, grad_output):  # blocks of channels

        def block(src: list[np.ndarray], dxb: np.ndarray, a: int, e: int) -> None:  # [dy, x] (N,k*S)
            dy3, x3, dx3 = (v.reshape(N, e - a, S) for v in (*src, dxb))  # N,k,S each
            loop(dy3, x3, dx3, 0, e - a, (m[a:e], r[a:e], w[a:e], dw[a:e], db[a:e]))

        dx = output(out, input.shape, input.dtype, (N * C, S), (input, grad_output), contiguous=True)
        _by_channel_blocks([grad_output, input], dx, N, C, S, ct, block)
        return finish(dx, out), grad_as(dw, weight), grad_as(db, bias)
    if S == 1 and _by_rows(input, ct, grad_output):  # blocks of rows
        dx = output(out, input.shape, input.dtype, (N * C, S), (input, grad_output), contiguous=True)
        rows = (grad_output.reshape(N, C), input.reshape(N, C), dx.reshape(N, C))  # N,C each
        _staged_row_backward(*rows, m, r, w, training, dw, db, ct)
        return finish(dx, out), grad_as(dw, weight), grad_as(db, bias)
    x = _source(input, C, ct).whole().reshape(N, C, S)  # N,C,S
    dy = _source(grad_output, C, ct).whole().reshape(N, C, S)  # N,C,S
    dx = output(out, input.shape, input.dtype, (N * C, S), (input, grad_output), contiguous=True)
    dst = Target(dx, N * C, S, ct)
    dx3 = (dst.rows if dst.direct else np.empty((N * C, S), dtype=ct)).reshape(N, C, S)  # N,C,S
    sweep(dy, x, dx3)
    if not dst.direct:
        dst.all_done(dx3.reshape(N * C, S))
    return finish(dx, out), grad_as(dw, weight), grad_as(db, bias)


# --- per-group statistics: GroupNorm, InstanceNorm --------------------------------------


def _group_forward_loop(L: int) -> Any:
    """GroupNorm's forward loop for (sample, group) rows of L values: pipelined, or one
    row at a time for rows of ``loops.LONG_FORWARD_ROW`` values and more on hosts where
    that is faster (``loops.one_row_at_a_time``; bitwise the same results; see there)."""
    return loops.group_forward_long if loops.one_row_at_a_time(L) else loops.group_forward


def _group_forward(
    input: np.ndarray,
    G: int,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    eps: float,
    ct: np.dtype[Any],
    out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``loops.group_forward`` (or ``group_forward_long``: see ``_group_forward_loop``)
    over the N*G (sample, group) rows. Returns ``(y, mean, rstd, var)``, the statistics
    (N*G,), ``var`` (biased) in float64."""
    C = int(input.shape[1])
    R, k = int(input.shape[0]) * G, C // G
    L = input.size // R
    w, b = param_or(weight, C, ct, 1.0), param_or(bias, C, ct, 0.0)  # C, C
    mean, rstd = np.empty(R, dtype=ct), np.empty(R, dtype=ct)  # R, R
    var = np.empty(R)  # R float64
    last = _samples_last(ct, out, input)
    if last is not None:  # channels-last: by samples
        (xs,), ys = last  # N,S,C  N,S,C
        y = np.empty(xs.shape, dtype=input.dtype) if ys is None else ys  # N,S,C
        rows = _span_rows(C)
        split = _split_samples([xs], y, rows, ct)
        if split is not None:
            _group_rows_forward_split(xs, w, b, k, eps, rows, y, mean, rstd, var, *split)
        else:
            _by_samples(loops.group_rows_forward, [xs], (w, b, k, eps, rows), y, (mean, rstd, var), ct)
        return (
            (finish(from_channel_rows(y, input.shape), out) if out is None or ys is None else out),
            mean,
            rstd,
            var,
        )
    if direct(ct, out, input):  # no staging: each thread's rows in one call
        y = np.empty(input.shape, dtype=ct) if out is None else out
        x2, y2 = input.reshape(R, L), y.reshape(R, L)  # R,L  R,L
        run(partial(_group_forward_loop(L), x2, w, b, k, eps, y2, mean, rstd, var, 0), ranges(R, L))
        return y, mean, rstd, var
    src = _source(input, G, ct)
    y = output(out, input.shape, input.dtype, (R, L), (input,), contiguous=True)
    dst = Target(y, R, L, ct)
    B = block_size((src,), (dst,), R, L, ct)
    loop = _group_forward_loop(L)

    def task(start: int, stop: int) -> None:
        xbuf, ybuf = src.buffer(B), dst.buffer(B)
        for a, e in spans(start, stop, B):
            yb = dst.block(a, e, ybuf)  # n,L
            xb = src.block(a, e, xbuf)  # n,L
            loop(xb, w, b, k, eps, yb, mean[a:e], rstd[a:e], var[a:e], a, 0, e - a)
            dst.done(a, e, yb)

    run(task, ranges(R, L))
    return finish(y, out), mean, rstd, var


def _group_backward(
    grad_output: np.ndarray,
    input: np.ndarray,
    G: int,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    ct: np.dtype[Any],
    out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``loops.group_backward`` (``group_backward_short`` for short rows, and long ones
    where the forward takes them one at a time: see SHORT_ROW_BYTES) over the N*G rows;
    dweight and dbias summed over samples (float64, fixed order) from the per-(sample,
    channel) sums."""
    N, C = int(input.shape[0]), int(input.shape[1])
    R, k = N * G, C // G
    L = input.size // R
    m, r = vector(mean, R, ct), vector(rstd, R, ct)  # R, R
    w = param_or(weight, C, ct, 1.0)  # C
    sdy, sdyx = np.empty(N * C), np.empty(N * C)  # N*C float64: sum(dy), sum(dy*(x - mean))
    alone = _short_rows(L, L // k, ct) or loops.one_row_at_a_time(L)  # (see SHORT_ROW_BYTES)
    loop = loops.group_backward_short if alone else loops.group_backward
    last = _samples_last(ct, out, input, grad_output)
    if last is not None:  # channels-last: by samples
        (xs, dys), dxs = last  # N,S,C each
        d = np.empty(xs.shape, dtype=input.dtype) if dxs is None else dxs  # N,S,C
        rows = _span_rows(C)
        split = _split_samples([dys, xs], d, rows, ct)
        if split is not None:
            _group_rows_backward_split(dys, xs, m, r, w, k, rows, d, sdy, sdyx, *split)
        else:
            _by_samples(loops.group_rows_backward, [dys, xs], (m, r, w, k, rows), d, (sdy, sdyx), ct)
        dx = finish(from_channel_rows(d, input.shape), out) if out is None or dxs is None else out
    elif direct(ct, out, input, grad_output):  # no staging: each thread's rows in one call
        dx = np.empty(input.shape, dtype=ct) if out is None else out
        dy2, x2, dx2 = grad_output.reshape(R, L), input.reshape(R, L), dx.reshape(R, L)  # R,L each
        run(partial(loop, dy2, x2, m, r, w, k, dx2, sdy, sdyx, 0), ranges(R, L))
    else:
        src_x, src_dy = _source(input, G, ct), _source(grad_output, G, ct)
        dx = output(out, input.shape, input.dtype, (R, L), (input, grad_output), contiguous=True)
        dst = Target(dx, R, L, ct)
        B = block_size((src_x, src_dy), (dst,), R, L, ct)

        def task(start: int, stop: int) -> None:
            xbuf, dybuf, obuf = src_x.buffer(B), src_dy.buffer(B), dst.buffer(B)
            for a, e in spans(start, stop, B):
                xb, dyb = src_x.block(a, e, xbuf), src_dy.block(a, e, dybuf)  # n,L  n,L
                ob = dst.block(a, e, obuf)  # n,L
                s1, s2 = sdy[a * k : e * k], sdyx[a * k : e * k]  # n*k, n*k
                loop(dyb, xb, m[a:e], r[a:e], w, k, ob, s1, s2, a, 0, e - a)
                dst.done(a, e, ob)

        run(task, ranges(R, L))
        dx = finish(dx, out)
    dw, db = np.empty(C), np.empty(C)  # C, C float64: sums over the samples, in order
    loops.group_param_sums(r, sdy, sdyx, k, dw, db)
    return dx, grad_as(dw, weight), grad_as(db, bias)


def _running_forward(
    xp: Namespace,
    input: np.ndarray,
    running_mean: np.ndarray,
    running_var: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    eps: float,
    ct: np.dtype[Any],
    out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Normalize with the running statistics (BatchNorm eval, InstanceNorm without input
    statistics): ``(y, mean, rstd)``, the mean (a copy of the buffer) and rstd in ``ct``."""
    m = np.array(cast(xp, running_mean, ct), dtype=np.float64)  # C
    v = np.array(cast(xp, running_var, ct), dtype=np.float64)  # C
    y, rstd = _channel_forward(input, weight, bias, eps, False, m, v, ct, out)
    return y, m.astype(ct), rstd


# --- BatchNorm ---------------------------------------------------------------------------


def _as_channel_rows(a: np.ndarray | None) -> np.ndarray | None:
    """A channels-last ``(N, C, *spatial)`` array (C its fastest axis, the other axes
    C-ordered: NumPy's ``moveaxis`` of an ``(N, *spatial, C)`` array, as torch's
    ``channels_last``) as its ``(N*S, C)`` rows, a view; None for any other layout. The
    rows are BatchNorm1d's (N, C) input: a channel is a column, read without the whole
    copy that staging it as (N, C, S) cost (4-5x torch's time in inference)."""
    rows = None if a is None else channels_last_rows(a)  # N*S,C
    return rows if rows is not None and rows.flags.c_contiguous else None


# Channels-last inputs take ``loops.group_rows_*`` where a sample's row of C values has
# WIDE_ROW_BYTES at least (16 float32 channels, 8 float64): narrower rows vectorize
# poorly across the channels, and the staged copy into (N, C, S) order is faster. Timed
# on a 2-vCPU EPYC (8 samples of 2**21/8 values, 2 threads, forward+backward, staged
# against these loops): float32 C = 2 2.1 ms against 10.5, C = 4 3.1 against 7.8, C = 8
# about even, C = 16 3.1 against 1.7, C = 32 3.7 against 1.4; float64 C = 4 5.4 against
# 6.0, C = 8 6.2 against 3.9. At torch's GroupNorm(32, 64) (32, 64, 56, 56) 10.6 against
# 4.3 ms, inference 5.0 against 1.6 (torch: 16-19 and 1.2-1.9 ms); at one sample of
# (64, 256, 256), where the loops run in one thread, 16.4 against 5.3.
WIDE_ROW_BYTES = 64


def _samples_last(
    ct: np.dtype[Any], out: np.ndarray | None, *inputs: np.ndarray
) -> tuple[list[np.ndarray], np.ndarray | None] | None:
    """Channels-last inputs as their ``(N, S, C)`` samples, views of any dtype (see
    ``_as_channel_rows``), with ``out``'s (None where no ``out`` is given, or it has
    another layout, is read-only or shares memory with an input: the result is then
    copied into it, so that an ``out`` of any layout gets bitwise the fresh result), for
    GroupNorm's and InstanceNorm's ``loops.group_rows_*``; None where a row of C values
    is narrower than ``WIDE_ROW_BYTES`` in ``ct``, any of them has another layout, or a
    sample to be converted to or from ``ct`` (float16, another computation dtype or byte
    order; see ``_by_samples``) is larger than ``_staging.STAGE_BYTES`` in ``ct``: those
    are staged in blocks of (sample, group) rows, within a few blocks of memory.
    (Read-only samples of ``ct`` are staged whole, a sample per thread, so that they give
    bitwise the results of writable ones.)"""
    N, C = int(inputs[0].shape[0]), int(inputs[0].shape[1])
    if C * ct.itemsize < WIDE_ROW_BYTES:
        return None
    rows = [r for r in map(_as_channel_rows, inputs) if r is not None]
    if len(rows) < len(inputs):
        return None
    out_rows = None if out is None else _as_channel_rows(out)
    if out is not None and (not out.flags.writeable or any(np.may_share_memory(out, a) for a in inputs)):
        out_rows = None
    out_dtype = inputs[0].dtype if out is None else out.dtype  # (a new output: the input's dtype)
    converted = out_dtype != ct or any(a.dtype != ct for a in rows)
    if converted and (inputs[0].size // N) * ct.itemsize > _staging.STAGE_BYTES:
        return None  # (a staged block is one sample at least: 4-6x the input's bytes in float16)
    samples = [r.reshape(N, -1, C) for r in rows]  # N,S,C each
    return samples, None if out_rows is None else out_rows.reshape(N, -1, C)


def _fits(a: np.ndarray, ct: np.dtype[Any]) -> bool:
    """Whether the sample loops take ``a`` as it is: writable, of the computation dtype."""
    return a.dtype == ct and a.flags.writeable


def _by_samples(
    loop: Any,
    srcs: list[np.ndarray],
    mid: tuple[Any, ...],
    dst: np.ndarray,
    tail: tuple[Any, ...],
    ct: np.dtype[Any],
) -> None:
    """``loop(*srcs, *mid, dst, *tail, base, n0, n1)`` (``loops.group_rows_*``) over the
    ``(N, S, C)`` samples of ``srcs`` into ``dst``: each thread's samples in one call where
    all are writable arrays of ``ct`` (views of the caller's arrays), else in blocks of
    samples of ``_staging.STAGE_BYTES`` (one sample at least), the arrays that are not
    (read-only, another dtype or byte order; float16 is cast by the compiled casts)
    staged through a block of scratch per thread: the same sums either way."""
    N, S, C = srcs[0].shape
    fits = partial(_fits, ct=ct)
    if all(map(fits, srcs)) and fits(dst):
        run(lambda n0, n1: loop(*srcs, *mid, dst, *tail, 0, n0, n1), ranges(N, S * C))
        return
    B = max(1, _staging.STAGE_BYTES // (S * C * ct.itemsize))  # samples per block

    def task(n0: int, n1: int) -> None:
        nb = min(B, n1 - n0)
        bufs = [None if fits(a) else np.empty((nb, S, C), dtype=ct) for a in srcs]  # nb,S,C each
        obuf = None if fits(dst) else np.empty((nb, S, C), dtype=ct)  # nb,S,C
        for a0, a1 in spans(n0, n1, B):
            xs = [a[a0:a1] if b is None else b[: a1 - a0] for a, b in zip(srcs, bufs, strict=True)]
            for a, b in zip(srcs, bufs, strict=True):
                if b is not None:
                    cast_into(b[: a1 - a0], a[a0:a1])
            loop(*xs, *mid, dst[a0:a1] if obuf is None else obuf[: a1 - a0], *tail, a0, 0, a1 - a0)
            if obuf is not None:
                cast_into(dst[a0:a1], obuf[: a1 - a0])

    run(task, ranges(N, S * C))


# A channels-last sample's sums are taken in spans of about SPAN_VALUES values (whole rows
# of C values; the same spans whatever the thread count, see _numba_loops), which the
# threads split where there are fewer samples than threads, each thread taking at least
# SPLIT_SAMPLE_VALUES values: the split costs three hand-offs in the forward and two in
# the backward, against one. Timed on a 2-vCPU EPYC (float32 GroupNorm(32), one sample,
# forward+backward, two threads split against one sample per thread): (64, 256, 256)
# 4.3-4.4 against 5.0-5.3 ms, (128, 128, 128) 1.8-2.1 against 2.3-2.5; (256, 64, 64) 1.3 against 1.1 and
# (512, 32, 32) 1.0 against 0.6 (a hand-off takes 0.05-0.15 ms on that VM). One thread's
# memory bandwidth is most of the VM's; on hosts with many cores it is a small part.
# A span has SPAN_MIN_ROWS rows at least, so that with many channels the partial sums
# (float64, C per span) stay within an eighth of a float32 input's bytes (a quarter in
# the backward, which keeps two), and their serial addition a small part of the work.
SPAN_VALUES = 1 << 14
SPAN_MIN_ROWS = 32
SPLIT_SAMPLE_VALUES = 1 << 20


def _span_rows(C: int) -> int:
    """The rows of C values in a span of a channels-last sample's sums."""
    return max(SPAN_MIN_ROWS, SPAN_VALUES // C, 1)


def _split_samples(
    srcs: list[np.ndarray], dst: np.ndarray, rows: int, ct: np.dtype[Any]
) -> tuple[int, list[tuple[int, int]]] | None:
    """Where the threads would take fewer parts by samples than by the samples' spans of
    ``rows`` rows (fewer samples than threads, each thread's share at least
    ``SPLIT_SAMPLE_VALUES``), the spans per sample and the threads' ranges of spans; None
    otherwise, and where an array must be staged (``_by_samples`` takes those, a sample
    per thread)."""
    N, S, C = srcs[0].shape
    per_sample = -(-S // rows)
    U = N * per_sample  # spans
    parts = min(get_num_threads(), U, N * S * C // SPLIT_SAMPLE_VALUES)
    fits = partial(_fits, ct=ct)
    if parts <= len(ranges(N, S * C)) or not (all(map(fits, srcs)) and fits(dst)):
        return None
    return per_sample, [(j * U // parts, (j + 1) * U // parts) for j in range(parts)]


def _group_rows_forward_split(
    xs: np.ndarray,
    w: np.ndarray,
    b: np.ndarray,
    k: int,
    eps: float,
    rows: int,
    y: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    var: np.ndarray,
    per_sample: int,
    units: list[tuple[int, int]],
) -> None:
    """``loops.group_rows_forward`` on the (N, S, C) samples xs into y, the threads
    splitting the samples' spans of ``rows`` rows (``units``): each span's sums, added per
    sample in order, for the means; the same for the squared deviations, then the output.
    Bitwise ``group_rows_forward``'s results."""
    N, S, C = xs.shape
    part = np.empty((N * per_sample, C))  # spans,C float64
    mc = np.empty((N, C))  # N,C float64: each channel's group mean
    sc, bc, m_hi, m_lo = (np.empty((N, C), dtype=y.dtype) for _ in range(4))  # N,C: y's coefficients
    for dev in (False, True):  # the means, then the statistics
        run(partial(loops.group_rows_partials, xs, rows, dev, mc, part), units)
        loops.group_rows_statistics(
            part, per_sample, dev, k, S * k, eps, w, b, 0, mc, mean, rstd, var, sc, bc, m_hi, m_lo
        )
    run(partial(loops.group_rows_affine, xs, y, rows, m_hi, m_lo, sc, bc), units)


def _group_rows_backward_split(
    dys: np.ndarray,
    xs: np.ndarray,
    m: np.ndarray,
    r: np.ndarray,
    w: np.ndarray,
    k: int,
    rows: int,
    dx: np.ndarray,
    sdy: np.ndarray,
    sdyx: np.ndarray,
    per_sample: int,
    units: list[tuple[int, int]],
) -> None:
    """``loops.group_rows_backward`` on the (N, S, C) samples dys, xs into dx, the threads
    splitting the samples' spans (``units``): each span's sums, added per sample in order
    into dx's coefficients, then dx. Bitwise ``group_rows_backward``'s results."""
    N, S, C = xs.shape
    mc = np.repeat(m.reshape(N, C // k), k, axis=1)  # N,C: each channel's group mean
    pd, pdx, pxc = (np.empty((N * per_sample, C)) for _ in range(3))  # spans,C float64 each
    run(partial(loops.group_rows_dy_partials, dys, xs, rows, mc, m, r, pd, pdx, pxc), units)
    av, k1v, k0v, rcv = (np.empty((N, C), dtype=dx.dtype) for _ in range(4))  # N,C: dx's coefficients
    partials = (pd, pdx, pxc)
    loops.group_rows_coefficients(*partials, per_sample, m, r, w, k, S * k, 0, sdy, sdyx, av, k1v, k0v, rcv)
    run(partial(loops.group_rows_dx, dys, xs, dx, rows, av, k1v, mc, rcv, k0v), units)


def compile_split_loops(dtype: str) -> None:
    """Compile (or load) the loops of a channels-last sample's spans split over the
    threads, which only samples larger than the threads' share take (``python -m npnorm
    warmup``), whatever the thread count, and with no setting changed."""
    ct = np.dtype(dtype)
    xs = np.ones((1, 4, 16), dtype=ct)  # N,S,C: two spans of two rows
    y = np.empty_like(xs)
    w, b = np.ones(16, dtype=ct), np.zeros(16, dtype=ct)
    mean, rstd, var = np.empty(2, dtype=ct), np.empty(2, dtype=ct), np.empty(2)
    _group_rows_forward_split(xs, w, b, 8, 1e-5, 2, y, mean, rstd, var, 2, [(0, 1), (1, 2)])
    sdy, sdyx = np.empty(16), np.empty(16)
    _group_rows_backward_split(xs, xs, mean, rstd, w, 8, 2, y, sdy, sdyx, 2, [(0, 1), (1, 2)])


def _as_channel_planes(a: np.ndarray | None) -> np.ndarray | None:
    """A Fortran-ordered ``(N, C, *spatial)`` array (N its fastest axis: ``np.asfortranarray``,
    a pandas frame's ``.values``, ``x.T`` of a C-ordered ``(C, N)``) as the C-ordered
    ``(S, C, N)`` view of its ``.T``: each channel a row of N values per spatial position,
    the same values per channel as the input's; None for any other layout (a C-ordered
    one too, and inputs of fewer than ``PLANE_SAMPLES`` samples, whose rows of N values
    are too short: staging them, a transpose, is faster there)."""
    if (
        a is None
        or a.ndim < 2
        or a.flags.c_contiguous
        or not a.flags.f_contiguous
        or a.shape[0] < PLANE_SAMPLES
    ):
        return None
    return a.T.reshape(-1, a.shape[1], a.shape[0])


# Fortran-ordered BatchNorm input of PLANE_SAMPLES samples or more runs on its (S, C, N)
# planes. Timed against staging it (2-vCPU EPYC, 2 threads, float32, forward+backward and
# eval): 0.15-0.59x and 0.16-0.35x the staged time from N = 8 ((8, 3, 128, 128), (16, 4, 100,
# 100), (8, 32, 56, 56); (100000, 64): 6.0 against 20.5 ms); at N = 2 to 4, 1.1-3.1x in the
# forward+backward ((2, 3, 200000), (3, 3, 224, 224), (4, 8, 50000), (4, 16, 100, 100)).
PLANE_SAMPLES = 8


def _from_channel_planes(planes: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``(S, C, N)`` planes as the Fortran-ordered ``(N, C, *spatial)`` array they hold (a view)."""
    return planes.reshape(shape[::-1]).T


def _channel_views(
    out: np.ndarray | None, *arrays: np.ndarray
) -> tuple[list[np.ndarray], np.ndarray | None, Callable[[np.ndarray], np.ndarray]] | None:
    """``arrays`` (N, C, *spatial), all channels-last or all Fortran-ordered, as the
    C-ordered views BatchNorm's channel loops take with the same channels (channels-last:
    the (N*S, C) rows of ``_as_channel_rows``; Fortran order: the (S, C, N) planes of
    ``_as_channel_planes``), with ``out``'s view (None where no ``out`` is given or it
    has another layout: the result is then copied into it, so that an ``out`` of any
    layout gets bitwise the fresh result) and the map from a result's view back to the
    array in that layout. None for C-ordered and other layouts."""
    first = arrays[0]
    if first.flags.c_contiguous and (
        first.ndim < 3 or first.shape[1] <= 1 or first.strides[1] != first.itemsize
    ):
        return None  # (the common call: C-ordered, and not channels-last too, as S = 1 is)
    shape = tuple(int(d) for d in first.shape)
    for view, back in ((_as_channel_rows, from_channel_rows), (_as_channel_planes, _from_channel_planes)):
        views = [v for v in map(view, arrays) if v is not None]
        if len(views) < len(arrays):
            continue
        out_view = None if out is None else view(out)
        if out_view is not None and out_view.shape != views[0].shape:
            out_view = None
        return views, out_view, partial(back, shape=shape)
    return None


@specialized("batch_norm_forward", NUMPY, kernels="numba")
@no_fp_warnings
def batch_norm_forward(
    xp: Namespace,
    input: np.ndarray,
    running_mean: np.ndarray | None,
    running_var: np.ndarray | None,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    training: bool,
    momentum: float,
    eps: float,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """BatchNorm forward: each channel read once for its statistics and output."""
    ct = np.dtype(work_dtype(xp, input, weight, bias, running_mean, running_var))  # float32 at least
    if input.size == 0 or not compiled(ct):
        args = (xp, input, running_mean, running_var, weight, bias, training, momentum, eps, out)
        return _fallback("batch_norm_forward", *args)
    C = int(input.shape[1])
    new_mean, new_var = running_mean, running_var
    if training:
        mean, var = np.empty(C), np.empty(C)  # C, C float64, filled by the loop
        y, rstd = _channel_forward(input, weight, bias, eps, True, mean, var, ct, out)
        new_mean, new_var = _running(xp, running_mean, running_var, mean, var, input.size // C, momentum)
        return y, mean.astype(ct), rstd, new_mean, new_var
    assert running_mean is not None and running_var is not None
    y, m, rstd = _running_forward(xp, input, running_mean, running_var, weight, bias, eps, ct, out)
    return y, m, rstd, new_mean, new_var


@specialized("batch_norm_backward", NUMPY, kernels="numba")
@no_fp_warnings
def batch_norm_backward(
    xp: Namespace,
    grad_output: np.ndarray,
    input: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    training: bool,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """BatchNorm backward: each channel read once for its sums and ``dx``."""
    ct = np.dtype(work_dtype(xp, input, weight, bias, mean))
    if input.size == 0 or not compiled(ct) or _coefficients_leave(rstd, weight, ct):
        args = (xp, grad_output, input, mean, rstd, weight, bias, training, out)
        return _fallback("batch_norm_backward", *args)
    return _channel_backward(grad_output, input, mean, rstd, weight, bias, training, ct, out)


# --- InstanceNorm ------------------------------------------------------------------------


@specialized("instance_norm_forward", NUMPY, kernels="numba")
@no_fp_warnings
def instance_norm_forward(
    xp: Namespace,
    input: np.ndarray,
    running_mean: np.ndarray | None,
    running_var: np.ndarray | None,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    use_input_stats: bool,
    momentum: float,
    eps: float,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """InstanceNorm forward: GroupNorm's rows with one channel per group, or BatchNorm's
    channels with the running statistics."""
    ct = np.dtype(work_dtype(xp, input, weight, bias, running_mean, running_var))  # float32 at least
    if input.size == 0 or not compiled(ct):
        args = (xp, input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps, out)
        return _fallback("instance_norm_forward", *args)
    N, C = int(input.shape[0]), int(input.shape[1])
    S = prod(input.shape[2:])
    if use_input_stats:
        y, mean, rstd, var = _group_forward(input, C, weight, bias, eps, ct, out)
        new_mean, new_var = running_mean, running_var
        if running_mean is not None and running_var is not None:
            batch_mean = np.mean(np.reshape(mean, (N, C)).astype(np.float64), axis=0)  # C
            batch_var = np.mean(np.reshape(var, (N, C)), axis=0)  # C, biased
            new_mean, new_var = _running(xp, running_mean, running_var, batch_mean, batch_var, S, momentum)
        return y, np.reshape(mean, (N, C)), np.reshape(rstd, (N, C)), new_mean, new_var
    assert running_mean is not None and running_var is not None
    y, m, rstd = _running_forward(xp, input, running_mean, running_var, weight, bias, eps, ct, out)
    return y, m, rstd, running_mean, running_var


@specialized("instance_norm_backward", NUMPY, kernels="numba")
@no_fp_warnings
def instance_norm_backward(
    xp: Namespace,
    grad_output: np.ndarray,
    input: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    use_input_stats: bool,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """InstanceNorm backward: GroupNorm's with one channel per group, or the affine map's
    with running statistics."""
    ct = np.dtype(work_dtype(xp, input, weight, bias, mean))
    if input.size == 0 or not compiled(ct) or _coefficients_leave(rstd, weight, ct):
        args = (xp, grad_output, input, mean, rstd, weight, bias, use_input_stats, out)
        return _fallback("instance_norm_backward", *args)
    if use_input_stats:
        C = int(input.shape[1])
        return _group_backward(grad_output, input, C, mean, rstd, weight, bias, ct, out)
    return _channel_backward(grad_output, input, mean, rstd, weight, bias, False, ct, out)


# --- GroupNorm ---------------------------------------------------------------------------


@specialized("group_norm_forward", NUMPY, kernels="numba")
@no_fp_warnings
def group_norm_forward(
    xp: Namespace,
    input: np.ndarray,
    num_groups: int,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    eps: float,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GroupNorm forward: each (sample, group) row read once."""
    ct = np.dtype(work_dtype(xp, input, weight, bias))  # float32 at least
    if input.size == 0 or not compiled(ct):
        return _fallback("group_norm_forward", xp, input, num_groups, weight, bias, eps, out)
    N = int(input.shape[0])
    y, mean, rstd, _ = _group_forward(input, num_groups, weight, bias, eps, ct, out)
    return y, mean.reshape(N, num_groups), rstd.reshape(N, num_groups)


@specialized("group_norm_backward", NUMPY, kernels="numba")
@no_fp_warnings
def group_norm_backward(
    xp: Namespace,
    grad_output: np.ndarray,
    input: np.ndarray,
    num_groups: int,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """GroupNorm backward: each (sample, group) row read once."""
    ct = np.dtype(work_dtype(xp, input, weight, bias, mean))
    if input.size == 0 or not compiled(ct) or _coefficients_leave(rstd, weight, ct):
        args = (xp, grad_output, input, num_groups, mean, rstd, weight, bias, out)
        return _fallback("group_norm_backward", *args)
    return _group_backward(grad_output, input, num_groups, mean, rstd, weight, bias, ct, out)
