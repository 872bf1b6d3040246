"""SyncBatchNorm over simulated ranks, in one process (docs/derivations/sync_batch_norm.md).

:func:`simulate_sync_batch_norm` splits a batch along N over ranks and runs the library's
``sync_batch_norm_forward`` and ``sync_batch_norm_backward`` on every slice, each rank a
thread of :mod:`npnorm._threadcomm` (a stand-in for an MPI communicator, with MPI's
semantics), and keeps what crossed the ranks: the per-rank ``(n, mean, M2)`` of the
forward's allgather and the ``[Σ dy, Σ dy · (x - mean), Σ (x - mean)]`` of the backward's
all-reduce.
BatchNorm on the concatenated batch is what the result must equal.

The shortcuts other implementations take are here too, one line per formula, to show
what goes wrong without them: the ranks' means averaged without their counts, Bessel's
correction with a rank's own count, the variance recovered from an exchanged
``invstd``, and a one-pass sum of squares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import functional as F
from .._threadcomm import Exchange, ThreadComm, run_ranks
from ..functional.sync_batch_norm import merge_moments

Stats = tuple[float, np.ndarray, np.ndarray]  # n, mean (C), M2 (C)


@dataclass(frozen=True)
class Rank:
    """One rank's results: its forward's outputs and its backward's gradients."""

    y: np.ndarray
    mean: np.ndarray
    rstd: np.ndarray
    running_mean: np.ndarray | None
    running_var: np.ndarray | None
    dx: np.ndarray
    dweight: np.ndarray | None
    dbias: np.ndarray | None


@dataclass(frozen=True)
class SyncRun:
    """A training step of SyncBatchNorm over simulated ranks (``simulate_sync_batch_norm``)."""

    split: tuple[int, ...]  # N_r: the samples of each rank
    parts: list[np.ndarray]  # each rank's slice of the input
    ranks: list[Rank]
    log: list[Exchange]  # the collective calls, in order, with what each rank sent

    def exchange(self, kind: str, size: int) -> np.ndarray:
        """What each rank sent (rows, in rank order) in the one collective ``kind`` of payload ``size``."""
        found = [e for e in self.log if e.kind == kind and np.asarray(e.sent[0]).size == size]
        assert len(found) == 1, f"expected one {kind} of {size} numbers, got {len(found)}"
        return np.stack([np.asarray(s) for s in found[0].sent])

    @property
    def channels(self) -> int:
        return int(self.parts[0].shape[1])

    @property
    def stats(self) -> np.ndarray:
        """P, 1 + 2C: each rank's ``[n_r, mean_r (C), M2_r (C)]``, the forward's allgather (float64)."""
        return self.exchange("Allgather", 1 + 2 * self.channels)

    @property
    def sums(self) -> np.ndarray:
        """P, 2 + 3C: each rank's ``[failed, n_r, Σ dy (C), Σ dy · (x - mean) (C), Σ (x - mean) (C)]``
        (the backward's)."""
        return self.exchange("Allreduce", 2 + 3 * self.channels)

    @property
    def output(self) -> np.ndarray:
        """The ranks' outputs, concatenated along N."""
        return np.concatenate([r.y for r in self.ranks])

    @property
    def grad_input(self) -> np.ndarray:
        """The ranks' ``dx``, concatenated along N."""
        return np.concatenate([r.dx for r in self.ranks])

    def grad_param(self, name: str) -> np.ndarray | None:
        """``"weight"`` or ``"bias"``: the sum over ranks of the ranks' own gradients."""
        grads = [getattr(r, f"d{name}") for r in self.ranks]
        return None if grads[0] is None else np.sum(grads, axis=0)


def split_batch(x: np.ndarray, split: Sequence[int]) -> list[np.ndarray]:
    """``x`` cut along N into slices of ``split[r]`` samples, one per rank (empty ones too)."""
    if any(int(k) < 0 for k in split) or sum(split) != x.shape[0]:
        raise ValueError(f"split {tuple(split)} must be non-negative counts summing to N = {x.shape[0]}")
    ends = np.cumsum([0, *split])
    return [x[ends[r] : ends[r + 1]] for r in range(len(split))]


def simulate_sync_batch_norm(
    input: np.ndarray,
    grad_output: np.ndarray,
    split: Sequence[int],
    running_mean: np.ndarray | None = None,
    running_var: np.ndarray | None = None,
    weight: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> SyncRun:
    """One SyncBatchNorm training step, forward and backward, over ranks simulated by threads.

    Rank r gets ``split[r]`` samples of ``input`` (N, C, *) and of ``grad_output`` and
    calls ``npnorm.functional.sync_batch_norm_forward`` (training) then
    ``sync_batch_norm_backward`` on a communicator whose ranks are threads of this
    process (MPI's semantics, no MPI needed). Each rank starts from copies of the
    running buffers; the result should equal BatchNorm on the whole batch::

        y, dx = concatenation over ranks       dweight, dbias = sum over ranks

    Parameters
    ----------
    input : ndarray, shape (N, C, *)
        The global batch.
    grad_output : ndarray, shape of ``input``
        The upstream gradient dy.
    split : sequence of int
        Samples per rank, summing to N (zeros make empty ranks); two ranks at least.
    running_mean, running_var : ndarray of shape (C,), optional
        The running buffers every rank starts from.
    weight, bias : ndarray of shape (C,), optional
        The affine parameters, the same on every rank.
    momentum, eps : float, default 0.1 and 1e-5
        As ``sync_batch_norm_forward``.

    Returns
    -------
    SyncRun
        ``.ranks[r]``: rank r's ``y``, ``mean``, ``rstd``, new running buffers, ``dx``,
        ``dweight``, ``dbias``; ``.stats``: the (n_r, mean_r, M2_r) each rank sent;
        ``.sums``: the backward's per-rank sums; ``.log``: every collective call.

    Raises
    ------
    ValueError
        For a split that does not fit the batch, fewer than two ranks, and where
        ``sync_batch_norm_forward``/``_backward`` raise it.

    Examples
    --------
    >>> import numpy as np
    >>> import npnorm.functional as F
    >>> from npnorm.learn import simulate_sync_batch_norm
    >>> x = np.random.default_rng(0).normal(size=(5, 2, 3))
    >>> dy = np.random.default_rng(1).normal(size=x.shape)
    >>> run = simulate_sync_batch_norm(x, dy, [3, 0, 2])
    >>> run.stats[:, 0]                         # n_r: values per channel on each rank
    array([9., 0., 6.])
    >>> y, mean, rstd, _, _ = F.batch_norm_forward(x, None, None, training=True)
    >>> dx, _, _ = F.batch_norm_backward(dy, x, mean, rstd, training=True)
    >>> np.allclose(run.output, y), np.allclose(run.grad_input, dx)
    (True, True)
    >>> [e.kind for e in run.log]               # header, statistics, channel counts, backward sums
    ['Allgather', 'Allgather', 'Allgather', 'Allreduce']
    """
    if any(int(k) != k for k in split):  # (int() truncated 2.5, and the message named 2)
        raise ValueError(f"split {tuple(split)} must be whole counts of samples, one per rank")
    split = tuple(int(k) for k in split)
    if len(split) < 2:
        raise ValueError(f"a split over two ranks at least, got {split} (one rank is BatchNorm: no exchange)")
    x, dy = np.asarray(input), np.asarray(grad_output)
    if dy.shape != x.shape:
        raise ValueError(f"grad_output must have the shape of input {x.shape}, got {dy.shape}")
    parts, dparts = split_batch(x, split), split_batch(dy, split)

    def copy(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.array(a, copy=True)

    def rank_step(comm: ThreadComm) -> tuple[Rank, ThreadComm]:
        r = comm.Get_rank()
        rm, rv = copy(running_mean), copy(running_var)
        y, mean, rstd, new_rm, new_rv = F.sync_batch_norm_forward(
            parts[r], rm, rv, weight, bias, True, momentum, eps, comm=comm
        )
        dx, dw, db = F.sync_batch_norm_backward(
            dparts[r], parts[r], mean, rstd, weight, bias, True, comm=comm
        )
        return Rank(y, mean, rstd, new_rm, new_rv, dx, dw, db), comm

    results = run_ranks(len(split), rank_step)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return SyncRun(split, parts, [r for r, _ in results], results[0][1].log)


def merge_steps(stats: np.ndarray) -> list[Stats]:
    """The merge's state ``(n, mean, M2)`` after each rank: the library's ``merge_moments``
    on the first 1, 2, ..., P rows of the gathered table."""
    return [merge_moments(stats[: k + 1]) for k in range(len(stats))]


def _axes(x: np.ndarray) -> tuple[int, ...]:
    return (0, *range(2, x.ndim))  # the batch and spatial axes: one statistic per channel


def _count(x: np.ndarray) -> int:
    return x.size // x.shape[1]  # values per channel


def rank_moments(part: np.ndarray) -> Stats:
    """A rank's ``(n_r, mean_r, M2_r)`` by hand, in float64, two passes."""
    n_r = _count(part)
    mean_r = np.sum(part, axis=_axes(part)) / max(n_r, 1)  # C (0 for an empty rank)
    xc = part - np.reshape(mean_r, (1, -1) + (1,) * (part.ndim - 2))  # the rank's values minus its mean
    return float(n_r), mean_r, np.sum(xc * xc, axis=_axes(part))  # (), C, C


def rank_sums(
    dy_part: np.ndarray, part: np.ndarray, mean: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A rank's ``Σ dy``, ``Σ dy · (x - mean)`` and ``Σ (x - mean)`` by hand, in float64,
    ``mean`` the global one (the last sums to 0 over the ranks but for ``mean``'s rounding)."""
    xc = part - np.reshape(mean, (1, -1) + (1,) * (part.ndim - 2))  # x - mean, with the global mean
    axes = _axes(part)
    return np.sum(dy_part, axis=axes), np.sum(dy_part * xc, axis=axes), np.sum(xc, axis=axes)  # C, C, C


# --- the shortcuts, one line per formula ------------------------------------------------


def uncounted_mean(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The ranks' means and mean squares averaged without their counts (Flax's
    ``lax.pmean``, ChainerMN's ``Allreduce`` then ``/ size``): ``(mean, var)``, C each."""
    with np.errstate(invalid="ignore", divide="ignore"):  # an empty rank: 0/0 = NaN, as on a device
        means = [np.sum(p, axis=_axes(p)) / _count(p) for p in parts]  # C each: every rank's own mean
        squares = [np.sum(p * p, axis=_axes(p)) / _count(p) for p in parts]  # C each: mean(x²) on the rank
    mean = sum(means) / len(parts)  # C: (1/P) Σ_r mean_r, each rank weighted 1/P whatever its n_r
    return mean, sum(squares) / len(parts) - mean * mean  # C, C: var = mean(x²) - mean²


def local_bessel(n_r: float) -> float:
    """ChainerMN's unbiasing factor for the running variance, from the rank's own count."""
    return n_r / max(n_r - 1.0, 1.0)  # instead of n / (n - 1) with the global n


def variance_from_invstd(parts: list[np.ndarray], eps: float, dtype: Any) -> np.ndarray:
    """The global biased variance when each rank sends ``invstd_r = 1 / sqrt(var_r + eps)``
    (in ``dtype``) instead of M2_r, and the merge recovers ``var_r = 1 / invstd_r² - eps``
    (PyTorch's SyncBatchNorm gathers ``(mean, invstd, count)`` that way)."""
    rows = []
    for p in (np.asarray(p, dtype=dtype) for p in parts if p.size):
        mean_r = np.mean(p, axis=_axes(p), dtype=dtype)  # C
        var_r = np.mean((p - mean_r.reshape(1, -1, *(1,) * (p.ndim - 2))) ** 2, axis=_axes(p), dtype=dtype)
        invstd_r = np.asarray(1, dtype) / np.sqrt(var_r + np.asarray(eps, dtype))  # C: sent instead of M2_r
        recovered = (np.asarray(1, dtype) / invstd_r) ** 2 - np.asarray(eps, dtype)  # C: var_r, recovered
        rows.append(np.concatenate([[_count(p)], mean_r, recovered * _count(p)]))  # n_r, mean_r, M2_r
    n, _, m2 = merge_moments(np.array(rows, dtype=np.float64))
    return m2 / n  # C


def one_pass_variance(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    """The global biased variance from all-reduced ``Σ x`` and ``Σ x²`` (in ``dtype``):
    Keras's SyncBatchNormalization, Flax's default ``use_fast_variance``, ChainerMN."""
    parts = [np.asarray(p, dtype=dtype) for p in parts]
    n = sum(_count(p) for p in parts)
    s1 = sum(np.sum(p, axis=_axes(p)) for p in parts)  # C: Σ x over every rank
    s2 = sum(np.sum(p * p, axis=_axes(p)) for p in parts)  # C: Σ x² over every rank
    mean = s1 / np.asarray(n, dtype)  # C
    return s2 / np.asarray(n, dtype) - mean * mean  # C: E[x²] - E[x]², cancels when |mean| >> std
