"""SyncBatchNorm: BatchNorm over the global batch of a data-parallel MPI job."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from .._backend import Array
from .._grad_mode import is_grad_enabled
from .._mpi import Comm, check_comm, resolve_comm
from ..functional._channels import check_channels, check_training_eps
from ..functional.sync_batch_norm import fail_backward, synced_backward, synced_forward
from ._module import DEVICE_DTYPE_XP_DOC, Module, Saved, Updates
from .batch_norm import _BatchNorm, cumulative_factor

_SYNC_BATCH_NORM_DOC = """BatchNorm over the global batch of a data-parallel MPI job
    (Ioffe & Szegedy 2015, https://arxiv.org/abs/1502.03167), as
    ``torch.nn.SyncBatchNorm``, on CPU and GPU.

    Each rank of the communicator holds a slice of the global batch. Each channel c
    is normalized over the batch and spatial axes of every rank's input together,
    n = (sum over ranks of N_r) * prod(spatial) values per channel:

        mean_c = sum(x[:, c]) / n                     (over all ranks)
        var_c  = sum((x[:, c] - mean_c)**2) / n       (biased; two passes per rank)
        y      = (x - mean_c) / sqrt(var_c + eps) * weight_c + bias_c

    In training the ranks exchange per-channel (count, mean, M2) and merge them in
    rank order with Chan et al.'s formula, weighted by counts; the result equals
    single-process BatchNorm on the concatenated batch, with uneven and empty ranks,
    and is bitwise the same on every rank.

    Training and evaluation (PyTorch's rules):

    - Training mode: the global batch statistics normalize, and the running
      statistics (identical on every rank) move towards them:

          running_mean = (1 - momentum) * running_mean + momentum * mean_c
          running_var  = (1 - momentum) * running_var  + momentum * var_c * n/(n - 1)

      with the *unbiased* global variance (Bessel's correction with the global
      count n). ``momentum=None`` is the cumulative average, factor
      ``1 / num_batches_tracked``; ``num_batches_tracked`` counts successful steps.
    - Eval mode with running statistics, and any call on a communicator of one
      rank, make no collective call (one rank may run eval alone); eval without
      running statistics normalizes with the local batch's statistics (as torch).

    Backward, with ``rstd_c = 1 / sqrt(var_c + eps)``, ``xhat = (x - mean_c) * rstd_c``,
    ``dxhat = dy * weight_c`` and means over the n values of a channel on every rank
    (one all-reduce of two sums per channel, and a third that centres xhat again on
    what the saved mean's rounding left, as BatchNorm's backward does):

        dx = rstd_c * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        dweight_c = sum(dy * xhat)        dbias_c = sum(dy)      (this rank's values)

    ``grads["weight"]``/``grads["bias"]`` are this rank's own sums, whose sum over
    ranks equals single-process BatchNorm's: the data-parallel optimizer sums (or
    averages) them, as it does every other parameter gradient.

    Training forward and backward are collective: every rank of ``comm`` must call
    them, in the same order, empty ranks (N = 0) included. Errors are collective too:
    a bad input on any rank, channel counts or dtypes that differ across ranks, or a
    global batch of 1 value per channel raise the same ``ValueError`` (``TypeError``
    for a non-floating or wrong-backend input, ``RuntimeError`` where one process raises
    one) on every rank, leaving every rank's parameters, buffers and counter unchanged;
    so does a backward on a rank that lost or changed what its synced forward saved, or
    ran an eval forward since.

    Parameters
    ----------
    num_features : int
        C, for input of shape (N, C, *) with any number of trailing axes.
    eps : float, default 1e-5
        Added to the variance before the square root.
    momentum : float or None, default 0.1
        Weight of the batch statistics in the running-statistics update; ``None``
        for a cumulative average.
    affine : bool, default True
        Learn a per-channel ``weight`` (ones) and ``bias`` (zeros).
    track_running_stats : bool, default True
        Keep ``running_mean``, ``running_var`` and ``num_batches_tracked`` (same
        ``state_dict`` keys as BatchNorm).
    bias : bool, keyword-only, default True
        With ``affine``, learn ``bias`` as well as ``weight``.
    comm : mpi4py intracommunicator, default None
        In the place of PyTorch's ``process_group`` (positional after
        ``track_running_stats``, before ``device`` and ``dtype``, as there).
        None means ``MPI.COMM_WORLD``, resolved at each training step (mpi4py is
        imported then, never by ``import npnorm`` nor in eval). Kept in ``self.comm``.
        ``copy.copy``/``copy.deepcopy`` keep the communicator (a handle on this
        process's MPI state, shared, never copied); a pickled module comes back with
        ``comm=None`` (communicators cannot be pickled): set ``m.comm`` again if it
        used another one.
    {device_dtype_xp}

    Examples
    --------
    >>> import numpy as np, npnorm
    >>> bn = npnorm.SyncBatchNorm(3).eval()   # eval: no communication at all
    >>> x = np.random.default_rng(0).normal(size=(4, 3, 2, 2)).astype(np.float32)
    >>> bn(x).shape
    (4, 3, 2, 2)

    Run under ``mpiexec -n 3 python -m mpi4py script.py`` for the training steps to
    span the ranks; see ``examples/sync_batchnorm_data_parallel.py``.
    """


# what a synced forward keeps for the backward (``SyncBatchNorm._kept``)
_SYNCED_KEPT = ("weight",)


class SyncBatchNorm(_BatchNorm):
    __doc__ = _SYNC_BATCH_NORM_DOC.format(device_dtype_xp=DEVICE_DTYPE_XP_DOC)

    # what copies and pickles leave out, besides the saved forward (Module.__init_subclass__
    # adds the bases' names)
    _forward_context = ("_synced_channels", "_synced_pending")

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        comm: Comm | None = None,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
        xp: str | ModuleType | None = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias, xp=xp
        )
        self.comm: Comm | None = check_comm(comm)

    def _takes_ndim(self, ndim: int) -> bool:
        return ndim >= 2  # (N, C, *)

    def _check_input_dim(self, input: Array) -> None:
        if not self._takes_ndim(input.ndim):
            raise ValueError(
                f"expected at least 2D input (got {input.ndim}D input of shape {tuple(input.shape)})"
            )
        if int(input.shape[1]) == 0:  # as PyTorch's, in every mode
            raise ValueError(
                f"SyncBatchNorm number of input channels should be non-zero (got input of shape "
                f"{tuple(input.shape)})"
            )

    def _forward(self, input: Array) -> tuple[Array, Saved, Updates]:
        if self.training:
            comm = resolve_comm(check_comm(self.comm))  # (``m.comm`` may have been set since)
            if int(comm.Get_size()) > 1:
                result = self._synced_forward(comm, input)
                # the backward is collective now, whatever becomes of what was saved
                # (``no_grad``, ``to()``, ``load_state_dict``): its exchange's C; and
                # pending, where this forward saved for it
                self._synced_channels: int | None = int(input.shape[1])
                self._synced_pending = is_grad_enabled()
                return result
        # eval (running statistics, or this rank's batch statistics without them), or one
        # rank: BatchNorm's forward, no collective call
        y, saved, updates = super()._forward(input)
        if not getattr(self, "_synced_pending", False):
            self._synced_channels = None  # no synced backward to come: this one is local
        # else the other ranks may call the synced forward's backward: this rank's backward
        # must take part, if only to raise with them (an eval forward on one rank between)
        return y, (*saved, False), updates

    def _gradcheck_refusal(self) -> str | None:
        """In training over several ranks the forward and backward are collective: the
        backward's gradients are those of the loss summed over every rank, and a finite
        difference on one rank sees its own loss only (and ranks of unequal batches would
        run unequal numbers of collective forwards, and wait for ever)."""
        if not self.training:
            return None
        size = int(resolve_comm(check_comm(self.comm)).Get_size())
        if size == 1:
            return None
        return (
            f"SyncBatchNorm in training over {size} ranks cannot be checked on one rank: its "
            "gradients are those of the loss summed over all ranks (and every forward is "
            "collective). Check it in eval mode, or on a communicator of one rank (its training "
            "forward is BatchNorm's then), and compare the synced layer with BatchNorm on the "
            "whole batch"
        )

    def _synced_forward(self, comm: Comm, input: Array) -> tuple[Array, Saved, Updates]:
        what = type(self).__name__
        error = None
        # this rank's checks and the counter's step, raised collectively by synced_forward (a
        # counter of -1 loaded on one rank divides by zero there: every rank raises)
        try:
            self._check_backend(input)
            self._check_input_dim(input)
            self._check_updates_allowed()  # (Module.forward's check comes after the exchange)
            expected, source = self._expected_channels(self.track_running_stats)
            check_channels(input, expected, what, source=source, unbatched=True)
            check_training_eps(self.eps, True)  # as on one rank (BatchNorm's, PyTorch's F.batch_norm)
            factor = 0.0 if self.momentum is None else self.momentum
            updates: Updates = {}
            if self.track_running_stats and self.num_batches_tracked is not None:
                updates["num_batches_tracked"] = self.num_batches_tracked + 1
                if self.momentum is None:  # cumulative moving average
                    factor = cumulative_factor(self.xp, updates["num_batches_tracked"])
        except Exception as err:  # whatever fails here, every rank must hear of it
            error, factor, updates = err, 0.0, {}
        running_mean = self.running_mean if self.track_running_stats else None
        running_var = self.running_var if self.track_running_stats else None
        y, mean, rstd, new_mean, new_var = synced_forward(
            comm, input, running_mean, running_var, self.weight, self.bias, factor, self.eps, what, error
        )
        if running_mean is not None:
            updates["running_mean"], updates["running_var"] = new_mean, new_var
        return y, (input, mean, rstd, True, self.weight, self.bias, True), updates

    def _kept(self) -> tuple[str, ...] | None:
        """Across ranks, the weight only: PyTorch's SyncBatchNorm function saves the input,
        weight, mean, invstd and counts, not the running statistics, so that overwriting
        those between forward and backward does not raise there (on one rank, or in eval,
        BatchNorm's: F.batch_norm's backward keeps them)."""
        return _SYNCED_KEPT if self._saved_synced() else super()._kept()

    def _saved_synced(self) -> bool:
        """Whether what the last forward saved is a synced training forward's (the saved
        tuple's last item; an eval or one-rank forward's is False)."""
        saved = self._saved
        return isinstance(saved, tuple) and bool(saved) and saved[-1] is True

    def backward(self, grad_output: Array) -> Array:
        """Gradient of the input for the last forward, as ``Module.backward``; after a
        training forward over several ranks, a collective call, errors included.

        Parameters
        ----------
        grad_output : array
            The gradient of the loss with respect to the last forward's output.

        Returns
        -------
        array
            The gradient with respect to the last forward's input.

        Raises
        ------
        RuntimeError
            As ``Module.backward``; over several ranks, on every rank where one rank's
            saved forward is missing (a forward inside ``no_grad``, a ``to()``),
            overwritten (a ``load_state_dict``) or modified in place since, or replaced
            by an eval forward on that rank alone (the other ranks would wait in the
            backward's exchange).
        """
        # the last forward on this module synced (a copy or a pickle has none: the other
        # ranks' modules are not in a backward with it); the payload's C is its input's
        channels = getattr(self, "_synced_channels", None)
        if channels is None:
            return super().backward(grad_output)
        comm = resolve_comm(check_comm(self.comm))
        try:
            self._check_saved_forward()
            if not self._saved_synced():
                raise RuntimeError(
                    f"{type(self).__name__}.backward(): the last forward on this rank did not "
                    "sync (eval mode) and replaced the synced training forward whose backward "
                    "the ranks were to run together: call backward before another forward on "
                    "the module (evaluate a copy: copy.deepcopy(m).eval()); a training step "
                    "whose backward is skipped (a NaN loss, say) leaves that backward to come: "
                    "run such forwards inside npnorm.no_grad()"
                )
        except RuntimeError as err:
            self._synced_pending = False  # every rank raises: nothing pending any more
            fail_backward(comm, err, channels, type(self).__name__)
        try:
            return super().backward(grad_output)
        finally:  # done, or failed on every rank: a later eval forward's backward is this rank's own
            self._synced_pending = False

    def _backward(self, grad_output: Array, saved: Saved) -> tuple[Array, dict[str, Array | None]]:
        input, mean, rstd, _, weight, bias, synced = saved
        if not synced:
            return super()._backward(grad_output, saved[:6])
        dx, dweight, dbias = synced_backward(
            resolve_comm(self.comm),
            grad_output,
            input,
            mean,
            rstd,
            weight,
            bias,
            type(self).__name__,
        )
        return dx, {"weight": dweight, "bias": dbias}

    @classmethod
    def convert_sync_batchnorm(cls, module: Module, comm: Comm | None = None) -> Module:
        """A SyncBatchNorm with the configuration, parameters, buffers, grads and
        training flag of ``module`` (a BatchNorm1d/2d/3d, or a SyncBatchNorm), on
        ``comm``; any other npnorm module is returned as it is. As torch's, the new module
        holds the same parameter and buffer arrays as ``module`` (not copies). npnorm
        modules do not nest, so a model is not walked as torch's is: anything but an
        npnorm module (a model of the caller's own, a list, a torch module) is a
        ``TypeError``, where it came back unconverted and every rank went on with its own
        batch's statistics.

        Parameters
        ----------
        module : npnorm Module
            The layer to convert: a BatchNorm1d/2d/3d or SyncBatchNorm (converted), or
            any other npnorm module (returned as it is).
        comm : mpi4py intracommunicator, default None
            The processes whose batches are normalized together (None:
            ``MPI.COMM_WORLD``, resolved at each training step, as the constructor's).

        Returns
        -------
        Module
            The new SyncBatchNorm, or ``module`` itself where it is no BatchNorm.

        Raises
        ------
        TypeError
            When ``module`` is not an npnorm module (a model of the caller's own, a
            list, a torch module).
        """
        if not isinstance(module, Module):
            torch = sys.modules.get("torch")  # (a torch module means torch is imported)
            hint = (
                "torch's own torch.nn.SyncBatchNorm.convert_sync_batchnorm converts a torch "
                "model, and npnorm.from_torch turns one torch norm layer into npnorm's"
                if torch is not None and isinstance(module, torch.nn.Module)
                else "npnorm modules do not nest: convert each BatchNorm of a model and assign "
                "it back (model.bn = SyncBatchNorm.convert_sync_batchnorm(model.bn))"
            )
            raise TypeError(
                f"convert_sync_batchnorm converts an npnorm BatchNorm1d/2d/3d module, "
                f"got {type(module).__module__}.{type(module).__qualname__}: {hint}"
            )
        if not isinstance(module, _BatchNorm):
            return module
        new = cls(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            bias=module.bias is not None or not module.affine,
            comm=comm,
            dtype=module.dtype,
            xp=module.xp,
        )
        for name in (*cls._parameter_names, *cls._buffer_names):
            setattr(new, name, getattr(module, name))
        new.grads = module.grads  # one dict: grads made later are shared too, as torch's .grad
        new.train(module.training)
        return new

    # --- copies and pickles: the communicator is shared, or dropped -----------------

    def __getstate__(self) -> dict[str, Any]:
        """The state to pickle: ``Module``'s, with the communicator left out (None)."""
        state = super().__getstate__()
        state["comm"] = None
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> SyncBatchNorm:
        if self.comm is not None:  # the same communicator: a handle, not data
            memo.setdefault(id(self.comm), self.comm)
        return super().__deepcopy__(memo)
