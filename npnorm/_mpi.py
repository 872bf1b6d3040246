"""The few MPI calls SyncBatchNorm makes, on small host (NumPy) buffers.

mpi4py is imported only when a communicator is first needed (a training step on the
default communicator): ``import npnorm`` never imports it, and eval never needs it.
Any mpi4py intracommunicator works (``MPI.COMM_WORLD``, one made by ``comm.Split``,
...). Only O(C) payloads cross ranks: per-channel statistics staged through host
memory. For CuPy arrays the copy to the host (``cupy.ndarray.get``) blocks until the
stream has produced them, so MPI never reads a buffer the device is still writing.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

Comm = Any  # an mpi4py intracommunicator (or anything with the same methods)

INSTALL_HINT = "pip install 'npnorm[mpi]' (mpi4py and the mpich MPI library)"


def default_comm() -> Comm:
    """``mpi4py.MPI.COMM_WORLD``, importing mpi4py now (and so initializing MPI)."""
    try:
        from mpi4py import MPI
    except ImportError as err:  # mpi4py missing, or no MPI library for it to load
        raise ImportError(
            f"SyncBatchNorm needs mpi4py to synchronize training across processes: {INSTALL_HINT}; "
            f"importing it failed with: {err}"
        ) from err
    return MPI.COMM_WORLD


def resolve_comm(comm: Comm | None) -> Comm:
    """``comm``, or the default communicator when it is None."""
    return default_comm() if comm is None else comm


def check_comm(comm: Comm | None) -> Comm | None:
    """``comm`` if it is None or looks like an mpi4py intracommunicator; else TypeError."""
    if comm is None:
        return None
    needed = ("Get_size", "Get_rank", "Allgather", "Allreduce", "allgather")
    missing = [name for name in needed if not callable(getattr(comm, name, None))]
    if missing:
        raise TypeError(
            f"comm must be an mpi4py intracommunicator (e.g. MPI.COMM_WORLD), got {type(comm).__name__} "
            f"without {', '.join(missing)}"
        )
    mpi = sys.modules.get("mpi4py.MPI")  # imported wherever an mpi4py communicator exists
    if mpi is not None and comm == mpi.COMM_NULL:
        raise TypeError(
            "comm is MPI.COMM_NULL, a communicator of no process (as Split gives the ranks it "
            "leaves out): pass one this rank belongs to"
        )
    is_inter = getattr(comm, "Is_inter", None)
    if callable(is_inter) and is_inter():
        raise TypeError("comm must be an intracommunicator; an intercommunicator joins two groups")
    return comm


def allgather(comm: Comm, local: np.ndarray) -> np.ndarray:
    """Every rank's ``local`` (same shape and dtype on every rank), stacked in rank
    order: shape ``(size, *local.shape)``, the same bytes on every rank."""
    send = np.ascontiguousarray(local)
    out = np.empty((int(comm.Get_size()), *send.shape), dtype=send.dtype)
    comm.Allgather(send, out)
    return out


def allreduce_sum(comm: Comm, local: np.ndarray) -> np.ndarray:
    """The sum over ranks of ``local`` (same shape and dtype on every rank)."""
    send = np.ascontiguousarray(local)
    out = np.empty_like(send)
    comm.Allreduce(send, out)  # mpi4py's default op is MPI.SUM
    return out


def allgather_object(comm: Comm, obj: Any) -> list[Any]:
    """Every rank's (small, picklable) ``obj``, in rank order."""
    return list(comm.allgather(obj))
