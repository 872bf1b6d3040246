"""A stand-in for an mpi4py communicator whose ranks are threads of this process.

It has the methods SyncBatchNorm calls (``Get_size``, ``Get_rank``, ``Is_inter``,
``Allgather``, ``Allreduce``, ``allgather``) with MPI's semantics: collective, results in
rank order, every rank gets the same bytes. It lets the tests draw many splits of a batch
over ranks in-process, in milliseconds, with or without mpi4py (the real thing is tested
under ``mpiexec``, ``tests/mpi/``), and ``python -m npnorm learn sync_batch_norm`` show
SyncBatchNorm's exchanges without MPI. Every collective is recorded (``log``): what each
rank sent, in rank order. A collective that not every rank enters times out
(``threading.BrokenBarrierError``) instead of hanging, and ``run_ranks`` reports it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

TIMEOUT = 20.0  # seconds a rank waits for the others in one collective


@dataclass(frozen=True)
class Exchange:
    """One collective call: its name (``Allgather``, ``Allreduce``, ``allgather``) and
    what each rank sent, in rank order."""

    kind: str
    sent: list[Any]


class _Group:
    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[Any] = [None] * size
        self.log: list[Exchange] = []  # every collective call, recorded once (by rank 0)
        self._cond = threading.Condition()
        self._arrived = 0  # ranks waiting at the current barrier
        self._generation = 0  # barriers passed
        self._broken = False

    def wait(self) -> None:
        """Wait until every rank has arrived. ``threading.BrokenBarrierError`` once a rank
        has failed (``abort``) or after ``TIMEOUT``, but never for a barrier that every
        rank had passed (``threading.Barrier.abort`` breaks that one too, for the ranks
        not yet woken from it: the others then saw an error that was not theirs)."""
        with self._cond:
            if self._broken:  # as threading.Barrier: once broken, every wait raises
                raise threading.BrokenBarrierError
            generation = self._generation
            self._arrived += 1
            if self._arrived == self.size:
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
                return
            passed = self._cond.wait_for(lambda: self._generation != generation or self._broken, TIMEOUT)
            if self._generation == generation:  # a rank failed, or the others never came
                if not passed:
                    self._broken = True
                    self._cond.notify_all()
                raise threading.BrokenBarrierError

    def abort(self) -> None:
        """A rank failed: every rank waiting in a collective, now or later, stops waiting."""
        with self._cond:
            self._broken = True
            self._cond.notify_all()


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
        """Collective calls made so far by the group."""
        return len(self._group.log)

    @property
    def log(self) -> list[Exchange]:
        """The group's collective calls so far, each with what every rank sent."""
        return self._group.log

    def _exchange(self, kind: str, value: Any) -> list[Any]:
        g = self._group
        g.wait()  # every rank has read the previous exchange's slots
        g.slots[self._rank] = value
        g.wait()  # every rank has written its slot
        sent = list(g.slots)
        if self._rank == 0:
            g.log.append(Exchange(kind, sent))
        return sent

    def Allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        recv[...] = np.stack(self._exchange("Allgather", np.array(send, copy=True)))

    def Allreduce(self, send: np.ndarray, recv: np.ndarray) -> None:
        total = np.zeros_like(send)
        with np.errstate(all="ignore"):  # inf + -inf is NaN without a warning, as MPI's sum
            for part in self._exchange("Allreduce", np.array(send, copy=True)):  # rank order
                total += part
        recv[...] = total

    def allgather(self, obj: Any) -> list[Any]:
        return self._exchange("allgather", obj)


def run_ranks(size: int, fn: Callable[[ThreadComm], Any]) -> list[Any]:
    """``fn(comm)`` on ``size`` threads, one per rank; each rank's result, or the
    exception it raised. Raises RuntimeError if a rank is still running after the
    others have finished and the timeout has passed (a hang)."""
    group = _Group(size)
    results: list[Any] = [None] * size

    def target(rank: int) -> None:
        try:
            results[rank] = fn(ThreadComm(group, rank))
        except BaseException as err:  # reported to the caller, never lost in the thread
            results[rank] = err
            group.abort()  # any rank still waiting in a collective stops waiting

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 5)
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        raise RuntimeError(f"rank(s) {hung} never returned")
    return results
