"""A stand-in for an mpi4py communicator whose ranks are threads of this process.

It has the methods SyncBatchNorm calls (``Get_size``, ``Get_rank``, ``Is_inter``,
``Allgather``, ``Allreduce``, ``allgather``) with MPI's semantics: collective, results in
rank order, every rank gets the same bytes. It lets hypothesis draw many splits of a batch
over ranks in-process, in milliseconds, with or without mpi4py; the real thing is tested
under ``mpiexec`` (``tests/mpi/``). A collective that not every rank enters times out
(``threading.BrokenBarrierError``) instead of hanging, and ``run_ranks`` reports it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

TIMEOUT = 20.0  # seconds a rank waits for the others in one collective


class _Group:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT)
        self.slots: list[Any] = [None] * size
        self.collectives = 0  # collective calls made (counted once per call, by rank 0)


class ThreadComm:
    """Rank ``rank`` of a group of threads."""

    def __init__(self, group: _Group, rank: int) -> None:
        self._group, self._rank = group, rank

    def Get_size(self) -> int:
        return self._group.size

    def Get_rank(self) -> int:
        return self._rank

    def Is_inter(self) -> bool:
        return False

    @property
    def collectives(self) -> int:
        return self._group.collectives

    def _exchange(self, value: Any) -> list[Any]:
        g = self._group
        g.barrier.wait()  # every rank has read the previous exchange's slots
        g.slots[self._rank] = value
        if self._rank == 0:
            g.collectives += 1
        g.barrier.wait()  # every rank has written its slot
        return list(g.slots)

    def Allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        recv[...] = np.stack(self._exchange(np.array(send, copy=True)))

    def Allreduce(self, send: np.ndarray, recv: np.ndarray) -> None:
        total = np.zeros_like(send)
        for part in self._exchange(np.array(send, copy=True)):  # rank order
            total += part
        recv[...] = total

    def allgather(self, obj: Any) -> list[Any]:
        return self._exchange(obj)


def run_ranks(size: int, fn: Callable[[ThreadComm], Any]) -> list[Any]:
    """``fn(comm)`` on ``size`` threads, one per rank; each rank's result, or the
    exception it raised. Raises AssertionError if a rank is still running after the
    others have finished and the timeout has passed (a hang)."""
    group = _Group(size)
    results: list[Any] = [None] * size

    def target(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(group, rank))
        except BaseException as err:  # reported to the caller, never lost in the thread
            results[rank] = err
            group.barrier.abort()  # any rank still waiting in a collective stops waiting

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 5)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    assert not hung, f"rank(s) {hung} never returned"
    return results
