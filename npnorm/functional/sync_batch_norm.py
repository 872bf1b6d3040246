"""SyncBatchNorm: BatchNorm whose training statistics span every rank of an MPI communicator.

Ioffe & Szegedy (2015), https://arxiv.org/abs/1502.03167; the merge of per-rank
statistics is Chan, Golub & LeVeque (1979), "Updating formulae and a pairwise
algorithm for computing sample variances".

Each rank holds a slice of the global batch. A training step computes, per channel,
the rank's count, mean and M2 (sum of squared deviations, two-pass), exchanges them
(one allgather of a float64 payload) and merges them in rank order, so every rank
normalizes with the same global statistics, bitwise. The normalization itself is
BatchNorm's with those statistics as constants (``batch_norm_forward`` with
``training=False``, so the fast NumPy kernels serve it). The backward sums
``[sum(dy), sum(dy*(x - mean))]`` over ranks (one all-reduce; a call of the functional
backward exchanges the ranks' channel counts first) and takes ``dx`` with the global
count; ``dweight``/``dbias`` stay the rank's own sums. See the README's
"SyncBatchNorm" math section for the derivation.

Errors are collective: a training step starts with one small fixed-size exchange
(ok-flag, channels, local count, dtype), so that every rank raises the same error
instead of one rank raising while the others wait in a collective forever.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np

from .._backend import FLOAT_NAMES, Array, Namespace, no_fp_warnings, on_device_of, to_host, to_namespace
from .._checks import (
    cast,
    check_backward_training,
    check_eps,
    check_flag,
    check_grad_output,
    float_inputs,
    prod,
    work_dtype,
)
from .._mpi import Comm, allgather, allgather_object, allreduce_sum, check_comm, resolve_comm
from .._stats import RECENTRE_ABOVE, less_centre, moments, reshaped, square_dtype, wide_sum, xhat_from
from ._channels import (
    as_ncs,
    check_buffers_paired,
    check_channels,
    check_momentum,
    check_per_channel,
    running_update,
)
from ._dispatch import as_plain, detached, generic, kernel, warn_outside_autograd
from .batch_norm import batch_norm_backward, batch_norm_forward

_WHAT = "sync_batch_norm"


def sync_batch_norm_forward(
    input: Array,
    running_mean: Array | None,
    running_var: Array | None,
    weight: Array | None = None,
    bias: Array | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    *,
    comm: Comm | None = None,
) -> tuple[Array, Array, Array, Array | None, Array | None]:
    """SyncBatchNorm forward: ``batch_norm_forward`` with the statistics of the
    global batch, the union of every rank's ``input``.

    Ioffe & Szegedy (2015), https://arxiv.org/abs/1502.03167; the merge of the ranks'
    statistics is Chan, Golub & LeVeque (1979), "Updating formulae and a pairwise
    algorithm for computing sample variances". Per channel c, over every rank's values:

        y = (x - mean_c) / sqrt(var_c + eps) * weight_c + bias_c     (var_c biased, global)

    Training. Rank r holds n_r values of channel c (N * prod(spatial)) with mean
    mean_r and M2_r = sum((x - mean_r)**2) (two passes). The ranks' triples are
    merged in rank order (Chan et al.), empty ranks skipped; merging b into a:

        n     = n_a + n_b
        delta = mean_b - mean_a
        mean  = mean_a + delta * n_b / n
        M2    = M2_a + M2_b + delta**2 * n_a * n_b / n

    then, on the local slice, with the global biased variance M2 / n:

        y = (x - mean_c) / sqrt(M2_c / n + eps) * weight_c + bias_c

    and the running variance takes the global unbiased variance M2 / (n - 1).
    Inference (``training=False``) and a communicator of one rank make no
    collective call: this is then ``batch_norm_forward`` exactly.

    Every rank must call this collectively (empty ranks included: they return empty
    outputs). Errors are collective: a bad input on any rank, channel counts or dtypes
    that differ across ranks, or a global count of 1 value per channel raise the
    same ``ValueError`` (``TypeError`` for a non-floating or mixed-backend input) on
    every rank, with the same message. ``training`` and ``comm`` are checked on each
    rank alone, before any exchange (they decide whether and where the call is
    collective): a bad one raises there at once.

    Parameters
    ----------
    input : array, shape (N, C, *spatial)
        This rank's slice of the batch; N may differ across ranks, and be 0.
    running_mean, running_var : arrays of shape (C,), or None
        The running statistics (identical on every rank); required when
        ``training`` is False.
    weight, bias : arrays of shape (C,), optional
    training : bool, default False
        Use the global batch statistics (and update the buffers, if any).
    momentum : float, default 0.1
        Weight of the batch statistics in the running-statistics update.
    eps : float, default 1e-5
        Added to the variance before the square root.
    comm : mpi4py intracommunicator, keyword-only
        Default ``MPI.COMM_WORLD`` (mpi4py is imported only when training needs it).

    Returns
    -------
    output, mean, rstd, new_running_mean, new_running_var
        As ``batch_norm_forward``; ``mean`` and ``rstd`` (the global statistics,
        identical on every rank) are what ``sync_batch_norm_backward`` needs.

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> x = np.random.default_rng(0).normal(size=(4, 3, 5))
    >>> y, mean, rstd, rm, rv = F.sync_batch_norm_forward(x, None, None, training=False)
    Traceback (most recent call last):
    RuntimeError: running_mean must be defined in evaluation mode (training=False)
    >>> y, mean, rstd, rm, rv = F.sync_batch_norm_forward(x, np.zeros(3), np.ones(3), training=False)
    >>> y.shape, mean.shape
    ((4, 3, 5), (3,))
    """
    training = check_flag(training, "sync_batch_norm_forward: training")
    comm = check_comm(comm)  # (an intercommunicator had hung, a string given AttributeError)
    if not training:
        return batch_norm_forward(input, running_mean, running_var, weight, bias, False, momentum, eps)
    comm = resolve_comm(comm)
    if int(comm.Get_size()) == 1:
        return batch_norm_forward(input, running_mean, running_var, weight, bias, True, momentum, eps)
    return synced_forward(comm, input, running_mean, running_var, weight, bias, momentum, eps, _WHAT)


def sync_batch_norm_backward(
    grad_output: Array,
    input: Array,
    mean: Array,
    rstd: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    training: bool | None = None,
    *,
    comm: Comm | None = None,
) -> tuple[Array, Array | None, Array | None]:
    """SyncBatchNorm backward from the upstream gradient and the saved global statistics.

    Ioffe & Szegedy (2015), https://arxiv.org/abs/1502.03167. With xhat =
    (x - mean_c) * rstd_c and dxhat = dy * weight_c, and sums over the n values of
    channel c on *every* rank (one all-reduce of [sum(dy), sum(dy * (x - mean_c)),
    sum(x - mean_c)] per channel, means taken with the global count n, after an allgather
    of the ranks' channel counts):

        dx = rstd_c * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))

    The third sum is 0 in exact arithmetic. The saved ``mean`` is rounded to the dtype the
    layer computes in (float32 for float16 input), and xhat is first centred again on what
    that rounding left, as BatchNorm's backward does (without it, float32 dx with a large
    common offset is as far off as PyTorch's: 16 to thousands of times BatchNorm's error).

    The weight and bias gradients are this rank's own sums,

        dweight_c = sum(dy * xhat)        dbias_c = sum(dy)      (local values only)

    and their sum over ranks is single-process BatchNorm's (a data-parallel optimizer
    sums or averages them). ``training=False`` (or one rank) is
    ``batch_norm_backward`` exactly, with no collective call.

    Called collectively, with ``mean``/``rstd`` as ``sync_batch_norm_forward``
    returned them on the same communicator (so the same C on every rank); a bad
    ``grad_output`` (or other array argument) on any rank raises the same error on every
    rank. ``training`` and ``comm`` are checked on each rank alone, as the forward's.

    Parameters
    ----------
    grad_output : array, shape of ``input``
        The upstream gradient dy.
    input : array, shape (N, C, *spatial)
        The forward's input on this rank.
    mean, rstd : arrays of shape (C,)
        What ``sync_batch_norm_forward`` returned.
    weight, bias : arrays of shape (C,), optional
    training : bool
        The value the forward was called with; required, as ``batch_norm_backward``'s
        (the forward's default is False).
    comm : mpi4py intracommunicator, keyword-only
        The forward's communicator (default ``MPI.COMM_WORLD``).

    Returns
    -------
    (dx, dweight, dbias)
        ``dweight``/``dbias`` are None when ``weight``/``bias`` is None.

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> x = np.random.default_rng(0).normal(size=(4, 3, 5))
    >>> y, mean, rstd, _, _ = F.sync_batch_norm_forward(x, np.zeros(3), np.ones(3))
    >>> dx, dw, db = F.sync_batch_norm_backward(np.ones_like(y), x, mean, rstd, training=False)
    >>> dx.shape, dw, db
    ((4, 3, 5), None, None)
    """
    training = check_backward_training(training, "sync_batch_norm_backward")
    comm = check_comm(comm)  # (an intercommunicator had hung, a string given AttributeError)
    if not training:
        return batch_norm_backward(grad_output, input, mean, rstd, weight, bias, False)
    comm = resolve_comm(comm)
    if int(comm.Get_size()) == 1:
        return batch_norm_backward(grad_output, input, mean, rstd, weight, bias, True)
    return synced_backward(
        comm, grad_output, input, mean, rstd, weight, bias, _WHAT, check_channels_across=True
    )


# --- the synchronized paths (also the module's) ------------------------------------------


def synced_forward(
    comm: Comm,
    input: Array,
    running_mean: Array | None,
    running_var: Array | None,
    weight: Array | None,
    bias: Array | None,
    momentum: float,
    eps: float,
    what: str,
    local_error: Exception | None = None,
) -> tuple[Array, Array, Array, Array | None, Array | None]:
    """The training forward over a communicator of several ranks.

    ``local_error`` is an error the caller's own checks found on this rank (the
    module's); it is raised collectively like the checks made here.
    """
    error = local_error
    header = np.array([0, -1, -1, -1], dtype=np.int64)  # ok, C, values per channel, dtype
    if error is None:
        try:
            eps = check_eps(eps)
            momentum = check_momentum(momentum)
            xp = float_inputs(
                input, running_mean, running_var, weight, bias,
                names=("input", "running_mean", "running_var", "weight", "bias"),
            )  # fmt: skip
            c = check_channels(input, None, what)
            check_per_channel(c, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias)
            check_buffers_paired(running_mean, running_var)
            n_local = int(input.shape[0]) * prod(input.shape[2:])  # values per channel here
            header = np.array([1, c, n_local, _dtype_code(xp, input.dtype)], dtype=np.int64)
        except Exception as err:  # whatever fails here, every rank must hear of it
            error = err
    table = allgather(comm, header)  # P,4: the one fixed-size exchange of the step
    if not table[:, 0].all():  # some rank failed its checks: every rank knows, every rank raises
        raise_collectively(comm, error, what)
    _check_across_ranks(table, what)
    warn_outside_autograd("sync_batch_norm_forward", (input, weight, bias))  # (as run()'s kernels)
    input, weight, bias = detached(input), detached(weight), detached(bias)  # torch: no autograd

    # local (count, mean, M2) per channel, two-pass, in the computation dtype
    ct = work_dtype(xp, input, weight, bias, running_mean, running_var)  # float32 at least
    payload = np.zeros(1 + 2 * c, dtype=np.float64)  # n, mean (C), M2 (C)
    if n_local > 0:
        mean_r, var_r = kernel("sync_batch_norm_moments", xp)(xp, input, ct)  # C, C
        payload[0] = n_local
        payload[1 : 1 + c] = to_host(mean_r)  # staged through host memory
        payload[1 + c :] = to_host(var_r).astype(np.float64) * n_local  # M2 = n * var
    n, mean64, m2 = merge_moments(allgather(comm, payload))  # (), C, C: identical on every rank
    if n == 0:  # an empty batch on every rank: BatchNorm's on it (NaN statistics, buffers kept)
        y, mean, rstd, _, _ = batch_norm_forward(input, None, None, weight, bias, True, momentum, eps)
        return y, mean, rstd, running_mean, running_var

    var64 = m2 / n  # C, biased: what normalizes
    mean = _on_device(input, mean64, xp, ct)  # C
    # The global statistics as constants: BatchNorm's inference path on the local slice.
    # Where some channel's mean is many standard deviations from 0, its rounding to a
    # float32 computation would cost the output accuracy (3e-3 at offset 1e4, spread 0.1)
    # that BatchNorm's float64 batch mean keeps, and a variance beyond float32's range
    # would overflow: the whole slice is then normalized with the float64 statistics.
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        var = _on_device(input, var64, xp, ct)  # C (inf beyond the dtype's range)
        offset = bool(np.any(mean64 * mean64 > RECENTRE_ABOVE**2 * var64))
        overflow = bool(np.any(np.isinf(to_host(var)) & np.isfinite(var64)))
        # rstd as saved for backward: from the float64 variance, as BatchNorm's, the same
        # on every rank (the kernel that normalized may differ between ranks)
        rstd = _on_device(input, 1.0 / np.sqrt(var64 + eps), xp, ct)  # C
    if offset or overflow:  # C, C (float64 where the device has it)
        wide = square_dtype(xp, mean)
        mean_n, var_n = _on_device(input, mean64, xp, wide), _on_device(input, var64, xp, wide)
    else:
        mean_n, var_n = mean, var
    y, _, _, _, _ = batch_norm_forward(input, mean_n, var_n, weight, bias, False, momentum, eps)
    new_mean, new_var = running_mean, running_var
    if running_mean is not None and running_var is not None:
        # inf beyond the dtype's range, and NaN for 0*inf (a momentum of 0 and an inf
        # batch mean), without a warning, as BatchNorm's: the unbiased variance in ct, and
        # the buffers' updates cast to their dtype (a float16 buffer)
        with np.errstate(over="ignore", invalid="ignore"):
            unbiased = _on_device(input, m2 / (n - 1), xp, ct)  # C: global count n
            new_mean = running_update(xp, running_mean, mean, momentum)  # C
            new_var = running_update(xp, running_var, unbiased, momentum)  # C
    return y, mean, rstd, new_mean, new_var


def synced_backward(
    comm: Comm,
    grad_output: Array,
    input: Array,
    mean: Array,
    rstd: Array,
    weight: Array | None,
    bias: Array | None,
    what: str,
    check_channels_across: bool = False,
) -> tuple[Array, Array | None, Array | None]:
    """The training backward over a communicator of several ranks: one all-reduce of
    ``[failed, n, sum(dy) (C), sum(dy*(x - mean)) (C), sum(x - mean) (C)]`` in float64; with
    ``check_channels_across`` (a functional call, which no forward checked), an
    all-gather of each rank's channel count first, so that ranks of different counts
    raise together instead of meeting in all-reduces of different sizes."""
    error = None
    # the payload's C, which must be the same on every rank for the all-reduce: the input's
    # channels (the forward checked them equal across ranks; a call of the functional
    # backward is checked by a header exchange first), so that a rank whose mean or rstd
    # has another length fails its checks below instead of the exchange
    c = _channel_count(input, mean)
    try:
        xp = float_inputs(
            grad_output, input, mean, rstd, weight, bias,
            names=("grad_output", "input", "mean", "rstd", "weight", "bias"), required=4,
        )  # fmt: skip
        check_per_channel(check_channels(input, None, what), mean=mean, rstd=rstd, weight=weight, bias=bias)
        check_grad_output(grad_output, input)
    except Exception as err:  # whatever fails here, every rank must hear of it
        error = err
    if check_channels_across:
        table = allgather(comm, np.array([error is None, c], dtype=np.int64))  # P,2: ok, C
        if not table[:, 0].all():  # some rank failed its checks: every rank raises its error
            raise_collectively(comm, error, what)
        _check_same_channels(table[:, 1], what)
    # failed, n, then C each: sum dy, sum dy*(x - mean), sum (x - mean)
    payload = np.zeros(2 + 3 * c, dtype=np.float64)
    if error is not None:
        payload[0] = 1.0
    else:
        grad_output, input, weight = detached(grad_output), detached(input), detached(weight)  # torch
        ct = work_dtype(xp, input, weight, bias, mean)
        sums = kernel("sync_batch_norm_grad_sums", xp)
        sum_dy, sum_dyxc, sum_xc = sums(xp, grad_output, input, mean, rstd, ct)  # C, C, C
        payload[1] = int(input.shape[0]) * prod(input.shape[2:])
        payload[2 : 2 + c] = to_host(sum_dy)  # staged through host memory
        payload[2 + c : 2 + 2 * c] = to_host(sum_dyxc)
        payload[2 + 2 * c :] = to_host(sum_xc)
    total = allreduce_sum(comm, payload)  # the backward's one exchange of numbers
    if total[0] > 0:  # some rank failed its checks: every rank knows, every rank raises
        raise_collectively(comm, error, what)
    n = total[1]
    if n == 0:  # an empty batch on every rank: BatchNorm's gradients on it (empty, zeros)
        return batch_norm_backward(grad_output, input, mean, rstd, weight, bias, True)
    wide = sum_dy.dtype  # float64 where the device has it: the means before they cancel
    mean_dy = _on_device(input, total[2 : 2 + c] / n, xp, wide)  # C: global mean of dy
    mean_dyxc = _on_device(input, total[2 + c : 2 + 2 * c] / n, xp, wide)  # C: global mean of dy*(x - mean)
    mean_xc = _on_device(input, total[2 + 2 * c :] / n, xp, wide)  # C: mean of x - mean (the rounding's)
    dx_kernel = kernel("sync_batch_norm_dx", xp)
    dx = dx_kernel(xp, grad_output, input, mean, rstd, weight, mean_dy, mean_dyxc, mean_xc)
    dx = as_plain(dx)  # (NumPy: native byte order, as every kernel's result through ``run``)
    # the rank's own sums: dw = sum(dy*xhat) = rstd*sum(dy*(x - mean - xi)), xhat centred again
    # on the global xi as dx takes it, db = sum(dy)
    sum_dyxc = less_centre(xp, sum_dyxc, mean_xc, sum_dy)  # C (wide): this rank's, less xi*sum(dy)
    dweight = None if weight is None else cast(xp, cast(xp, rstd, ct) * sum_dyxc, weight.dtype)  # C
    dbias = None if bias is None else cast(xp, sum_dy, bias.dtype)  # C
    return dx, dweight, dbias


def _on_device(input: Array, value: np.ndarray, xp: Namespace, dtype: Any) -> Array:
    """``value``, computed on the host from what the ranks exchanged, as an array of
    ``xp`` and ``dtype`` on ``input``'s device (a GPU's, say: made on the default device,
    it failed to combine with the input there)."""
    return on_device_of(input, to_namespace(value, xp, dtype))


def _channel_count(input: Any, mean: Any) -> int:
    """C of an (N, C, *) ``input``, else the length of ``mean``, else 0 (a bad argument:
    its rank fails its checks and says so in the exchange)."""
    shape: tuple[int, ...] = tuple(getattr(input, "shape", ()))
    if len(shape) >= 2:
        return int(shape[1])
    return int(prod(getattr(mean, "shape", (0,))))


def merge_moments(table: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Chan et al.'s merge of per-rank ``[n, mean (C), M2 (C)]`` rows (float64), in rank
    order, ranks with ``n = 0`` skipped. Returns the global ``(n, mean, M2)``.

    The counts weight the merge: a rank of 1 value must move the mean 1/n of the way,
    not 1/P (averaging the ranks' means is wrong for uneven ranks), and the spread of
    the ranks' means about the global mean adds ``delta^2 * n_a*n_b/n`` to M2. Where a
    mean is not finite (an inf in a rank's values), ``delta`` is not either, and the
    mean is the counts' weighted sum instead: inf as BatchNorm's on the whole batch
    (``inf + (-inf)*f`` was NaN, where the inf was on any rank but the last). No
    floating-point warning, as BatchNorm's none.
    """
    c = (int(table.shape[1]) - 1) // 2
    n = 0.0
    mean = np.zeros(c)  # C
    m2 = np.zeros(c)  # C
    for row in table:  # rank order
        n_b = float(row[0])
        if n_b == 0:
            continue
        mean_b, m2_b = row[1 : 1 + c], row[1 + c :]  # C, C
        if n == 0:  # the first non-empty rank: its statistics as they are (delta*delta*0 would
            n, mean, m2 = n_b, mean_b.copy(), m2_b.copy()  # be NaN for |mean| beyond 1e154)
            continue
        total = n + n_b
        with np.errstate(invalid="ignore", over="ignore"):
            delta = mean_b - mean  # C
            chan = mean + delta * (n_b / total)  # C
            weighted = mean * (n / total) + mean_b * (n_b / total)  # C: where delta is not finite
            mean = np.where(np.isfinite(delta), chan, weighted)  # C
            m2 = m2 + m2_b + delta * delta * (n * n_b / total)  # C
        n = total  # the merged count
    return n, mean, m2


def fail_backward(comm: Comm, error: Exception, c: int, what: str) -> NoReturn:
    """This rank's part in a module's training backward that failed before its sums
    (what its forward saved is missing, overwritten or modified in place): the backward's
    all-reduce of ``synced_backward``, of ``c`` channels, with the failure flag set, then
    the collective raise, so that the other ranks raise the same error instead of waiting."""
    failed = np.zeros(2 + 3 * c, dtype=np.float64)  # synced_backward's payload: the flag set
    failed[0] = 1.0
    allreduce_sum(comm, failed)
    raise_collectively(comm, error, what)


def raise_collectively(comm: Comm, error: Exception | None, what: str) -> NoReturn:
    """Raise the same error on every rank, once every rank knows that some rank failed
    (``error`` is this rank's failure, or None): the first failing rank's message and
    class (TypeError and RuntimeError keep theirs, else ValueError), and which other ranks
    failed. One collective call, made by every rank."""
    mine = None if error is None else (type(error).__name__, str(error))
    reports = allgather_object(comm, mine)  # every rank learns every rank's failure
    ranks = [r for r, report in enumerate(reports) if report is not None]
    kind, message = reports[ranks[0]]
    also = f" (rank(s) {', '.join(map(str, ranks[1:]))} failed too)" if len(ranks) > 1 else ""
    text = f"{what} failed on rank {ranks[0]} of {len(reports)}: {message}{also}"
    cls = {"TypeError": TypeError, "RuntimeError": RuntimeError}.get(kind, ValueError)
    raise cls(text) from error


def _check_across_ranks(table: np.ndarray, what: str) -> None:
    """The checks that need every rank's header: same C, same dtype, n > 1 overall."""
    per_rank = ", ".join
    counts, codes = table[:, 2], table[:, 3]
    _check_same_channels(table[:, 1], what)
    if len(set(codes.tolist())) > 1:
        listed = per_rank(f"rank {r}: {_DTYPE_NAMES[int(v)]}" for r, v in enumerate(codes))
        raise ValueError(
            f"{what}: the ranks' inputs have different dtypes ({listed}); every rank must pass one dtype"
        )
    total = int(counts.sum())
    if total == 1:  # (0: an empty batch, as BatchNorm's: no error)
        raise ValueError(
            f"{what}: expected more than 1 value per channel when training, got {total} over the "
            f"{len(counts)} ranks (values per channel on each rank: {per_rank(str(int(v)) for v in counts)})"
        )


def _check_same_channels(channels: np.ndarray, what: str) -> None:
    """Every rank's channel count (one per rank, in rank order) the same."""
    if len(set(channels.tolist())) > 1:
        listed = ", ".join(f"rank {r}: {int(v)}" for r, v in enumerate(channels))
        raise ValueError(
            f"{what}: the ranks' inputs have different numbers of channels ({listed}); "
            "every rank must pass (N, C, *) with the same C"
        )


# the input dtypes the ranks compare by code: NumPy's floats and a backend's bfloat16
# (torch's), which float_inputs accepts too
_DTYPE_NAMES = (*FLOAT_NAMES, "bfloat16")


def _dtype_code(xp: Namespace, dtype: Any) -> int:
    if isinstance(dtype, np.dtype):  # NumPy's ">f4" is float32 in the other byte order
        dtype = dtype.newbyteorder("=")
    for code, name in enumerate(_DTYPE_NAMES):
        if isinstance(dtype, np.dtype):  # by name: dask's namespace has no float16 (and NumPy
            if dtype.name == name:  # takes None == np.dtype("float64") as true)
                return code
        elif (found := getattr(xp, name, None)) is not None and found == dtype:
            return code
    raise TypeError(f"input must have a floating dtype (float16/32/64, or bfloat16), got {dtype}")


# --- generic Array API kernels ---


@generic("sync_batch_norm_moments")
@no_fp_warnings
def sync_batch_norm_moments_generic(xp: Namespace, input: Array, ct: Any) -> tuple[Array, Array]:
    """Per channel of a non-empty (N, C, *) input: the mean and the biased variance over
    the batch and spatial axes, two-pass, in ``moments``' dtype (float64 where the
    backend has it: the merge across ranks starts from unrounded statistics)."""
    mean, var = moments(xp, as_ncs(xp, input, ct), (0, 2))  # 1,C,1  1,C,1
    assert mean is not None
    return xp.reshape(mean, (-1,)), xp.reshape(var, (-1,))  # C, C


@generic("sync_batch_norm_grad_sums")
@no_fp_warnings
def sync_batch_norm_grad_sums_generic(
    xp: Namespace, grad_output: Array, input: Array, mean: Array, rstd: Array, ct: Any
) -> tuple[Array, Array, Array]:
    """Per channel: ``sum(dy)``, ``sum(dy * (x - mean))`` and ``sum(x - mean)`` over this
    rank's values, accumulated and returned in float64 where the device has it
    (``wide_sum``; ``rstd`` is for kernels that fold the mean when it is small against
    it). The last is 0 but for the rounding of ``mean`` to ``ct``: the dx kernel centres
    xhat again with it, which cancels digits that a float32 sum would not have kept."""
    x = as_ncs(xp, input, ct)  # N,C,S
    dy = as_ncs(xp, grad_output, ct)  # N,C,S
    xc = x - xp.reshape(cast(xp, mean, ct), (1, -1, 1))  # N,C,S
    sum_dy = wide_sum(xp, dy, (0, 2))  # C
    sum_dyxc = wide_sum(xp, dy * xc, (0, 2))  # C
    sum_xc = wide_sum(xp, xc, (0, 2))  # C: 0 but for the rounding of mean
    return sum_dy, sum_dyxc, sum_xc  # C, C, C


@generic("sync_batch_norm_dx")
@no_fp_warnings
def sync_batch_norm_dx_generic(
    xp: Namespace,
    grad_output: Array,
    input: Array,
    mean: Array,
    rstd: Array,
    weight: Array | None,
    mean_dy: Array,
    mean_dyxc: Array,
    mean_xc: Array,
) -> Array:
    """``dx = rstd*(dxhat - mean_G(dxhat) - xhat*mean_G(dxhat*xhat))`` from the global
    means of ``dy``, ``dy*(x - mean)`` and ``x - mean`` (``mean_G``: over every rank's
    values; float64 where the device has it). xhat is first centred again on
    ``xi = mean_G(x - mean)``, what the rounding of the saved ``mean`` to the computation
    dtype left, as ``centred_again`` centres it: ``mean_G(dy*(x - mean - xi)) =
    mean_G(dy*(x - mean)) - xi*mean_G(dy)``, taken before the means are rounded to the
    computation dtype (an infinite ``mean_G(dy)``, from an infinite dy, is left as it was)."""
    ct = work_dtype(xp, input, weight, mean)
    x = as_ncs(xp, input, ct)  # N,C,S
    dy = as_ncs(xp, grad_output, ct)  # N,C,S
    m = xp.reshape(cast(xp, mean, ct), (1, -1, 1))  # 1,C,1
    r = xp.reshape(cast(xp, rstd, ct), (1, -1, 1))  # 1,C,1
    w = 1.0 if weight is None else xp.reshape(cast(xp, weight, ct), (1, -1, 1))  # 1,C,1
    centred = less_centre(xp, mean_dyxc, mean_xc, mean_dy)  # C (wide): mean_G(dy*(x - mean - xi))
    g = xp.reshape(cast(xp, mean_dy, ct), (1, -1, 1))  # 1,C,1: mean_G(dy)
    p = xp.reshape(cast(xp, centred, ct), (1, -1, 1))  # 1,C,1: mean_G(dy*(x - mean - xi))
    xi = xp.reshape(cast(xp, mean_xc, ct), (1, -1, 1))  # 1,C,1: mean_G(x - mean), the mean's rounding
    xhat = xhat_from(x, m, r) - xi * r  # N,C,S: centred again
    dxhat = dy * w  # N,C,S
    mean_dxhat = w * g  # 1,C,1: term 2's mean
    mean_dxhat_xhat = w * r * p  # 1,C,1: term 3's
    dx = (dxhat - mean_dxhat - xhat * mean_dxhat_xhat) * r  # N,C,S: term 1 + term 2 + term 3, signed
    return cast(xp, reshaped(xp, dx, tuple(input.shape)), input.dtype)
