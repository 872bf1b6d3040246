"""SyncBatchNorm: BatchNorm over the global batch of a data-parallel MPI job."""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any

from .._backend import Array
from .._mpi import Comm, check_comm, resolve_comm
from ..functional._channels import check_channels
from ..functional.sync_batch_norm import synced_backward, synced_forward
from ._module import Module, Saved, Updates
from .batch_norm import _BatchNorm


class SyncBatchNorm(_BatchNorm):
    r"""BatchNorm whose training statistics are those of the whole batch, split over the
    ranks of an MPI communicator (as ``torch.nn.SyncBatchNorm``, on CPU and GPU).

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot w + b

    per channel, with ``E`` and ``Var`` (biased) over the batch and spatial axes of every
    rank's input together. In training the ranks exchange per-channel (count, mean, M2)
    and merge them with Chan et al.'s formula, weighted by counts; the result equals
    single-process BatchNorm on the concatenated batch, including uneven and empty
    ranks. The running variance takes the global unbiased variance ``M2/(n - 1)``;
    ``momentum=None`` is the cumulative average; ``num_batches_tracked`` counts
    successful steps. Eval with running statistics, and any call on a communicator of
    one rank, make no collective call (one rank may run eval alone); eval without
    running statistics normalizes with the local batch's statistics (as torch).

    Backward: ``dx`` uses the global sums of ``dy`` and ``dy*(x - mean)`` (one
    all-reduce); ``grads["weight"]``/``grads["bias"]`` are this rank's own sums, whose
    sum over ranks equals single-process BatchNorm's: the data-parallel optimizer sums
    (or averages) them, as it does every other parameter gradient.

    Training forward and backward are collective: every rank of ``comm`` must call
    them, in the same order, empty ranks (N = 0) included. Errors are collective too:
    a bad input on any rank, channel counts or dtypes that differ across ranks, or a
    global batch of 0 or 1 values per channel raise the same ``ValueError``
    (``TypeError`` for a non-floating or wrong-backend input) on every rank, leaving
    every rank's parameters, buffers and counter unchanged.

    Parameters
    ----------
    num_features : int
        C, for input of shape (N, C, *) with any number of trailing axes.
    eps, momentum, affine, track_running_stats
        As :class:`BatchNorm1d`; same ``state_dict`` keys.
    comm : mpi4py intracommunicator, keyword-only, default None
        None means ``MPI.COMM_WORLD``, resolved at each training step (mpi4py is
        imported then, never by ``import npnorm`` nor in eval). Kept in ``self.comm``.
        ``copy.copy``/``copy.deepcopy`` keep the communicator (it is a handle on this
        process's MPI state, shared, never copied); a pickled module comes back with
        ``comm=None`` (communicators cannot be pickled): set ``m.comm`` again if it
        used another one.
    dtype, xp : keyword-only; float32 and numpy by default
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        comm: Comm | None = None,
        dtype: Any = None,
        xp: str | ModuleType | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, dtype=dtype, xp=xp)
        self.comm: Comm | None = check_comm(comm)

    def _check_input_dim(self, input: Array) -> None:
        if input.ndim < 2:
            raise ValueError(
                f"expected at least 2D input (got {input.ndim}D input of shape {tuple(input.shape)})"
            )

    def _forward(self, input: Array) -> tuple[Array, Saved, Updates]:
        if self.training:
            comm = resolve_comm(self.comm)
            if int(comm.Get_size()) > 1:
                return self._synced_forward(comm, input)
        # eval (running statistics, or this rank's batch statistics without them), or one
        # rank: BatchNorm's forward, no collective call
        y, saved, updates = super()._forward(input)
        return y, (*saved, False), updates

    def _synced_forward(self, comm: Comm, input: Array) -> tuple[Array, Saved, Updates]:
        what = type(self).__name__
        error = None
        try:  # this rank's checks, raised collectively by synced_forward
            self._check_backend(input)
            self._check_input_dim(input)
            check_channels(input, self.num_features, what)
        except (TypeError, ValueError) as err:
            error = err
        factor = 0.0 if self.momentum is None else self.momentum
        updates: Updates = {}
        if self.track_running_stats and self.num_batches_tracked is not None:
            updates["num_batches_tracked"] = self.num_batches_tracked + 1
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(updates["num_batches_tracked"])
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        y, mean, rstd, new_mean, new_var = synced_forward(
            comm, input, running_mean, running_var, self.weight, self.bias, factor, self.eps, what, error
        )
        if running_mean is not None:
            updates["running_mean"], updates["running_var"] = new_mean, new_var
        return y, (input, mean, rstd, True, True), updates

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        input, mean, rstd, _, synced = saved
        if not synced:
            return super()._backward(grad_output, saved[:4])
        dx, dweight, dbias = synced_backward(
            resolve_comm(self.comm),
            grad_output,
            input,
            mean,
            rstd,
            self.weight,
            self.bias,
            type(self).__name__,
        )
        return dx, {"weight": dweight, "bias": dbias}

    @classmethod
    def convert_sync_batchnorm(cls, module: Module, comm: Comm | None = None) -> Module:
        """A SyncBatchNorm with the configuration, parameters, buffers, grads and
        training flag of ``module`` (a BatchNorm1d/2d/3d, or a SyncBatchNorm), on
        ``comm``; any other module is returned as it is. As torch's, the new module
        holds the same parameter and buffer arrays as ``module`` (not copies)."""
        if not isinstance(module, _BatchNorm):
            return module
        new = cls(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            comm=comm,
            dtype=module.dtype,
            xp=module.xp,
        )
        for name in (*cls._parameter_names, *cls._buffer_names):
            setattr(new, name, getattr(module, name))
        new.grads.update(module.grads)
        new.train(module.training)
        return new

    # --- copies and pickles: the communicator is shared, or dropped -----------------

    def __getstate__(self) -> dict[str, Any]:
        """The state to pickle: everything but the communicator (``comm`` is None)."""
        getstate = getattr(super(), "__getstate__", None)  # object's from Python 3.11 on
        state = dict((getstate() if getstate is not None else None) or self.__dict__)
        state["comm"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        setstate = getattr(super(), "__setstate__", None)
        if setstate is not None:
            setstate(state)
        else:
            self.__dict__.update(state)
        self.comm = state.get("comm")

    def __copy__(self) -> SyncBatchNorm:
        new = type(self).__new__(type(self))
        new.__setstate__(self.__getstate__())
        new.comm = self.comm
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> SyncBatchNorm:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        new.comm = self.comm  # the same communicator: a handle, not data
        return new
