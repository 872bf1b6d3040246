"""The worker threads npnorm's fast kernels split their work over.

NumPy releases the GIL inside ufuncs and reductions on large enough arrays, and the
compiled loops release it throughout, so plain Python threads each working on their
own rows run in parallel. One pool of workers is kept for the whole process, created on
first use and recreated when the thread count changes. The calling thread always takes
the first share of the work itself, so ``n`` threads means a pool of ``n - 1`` workers,
and ``set_num_threads(1)`` means no pool at all: everything runs inline.

Each worker is a thread waiting on a queue of its own (``queue.SimpleQueue``, a C
object): handing it tasks is a put, and waiting for it a get from its second queue,
guarded by the number of the last hand-off it finished, so that a Ctrl-C at any moment
of a call leaves the pool working (see ``_Worker``). That costs about a third of what
a ``concurrent.futures.ThreadPoolExecutor`` hand-off did (15 against 47 us per call on a
2-vCPU VM: 4-8% off a module's forward+backward of 1-2.3 ms, 2% at 4 ms). One caller
uses the pool at a time: a call made while another thread's call holds it (or from
inside a task) runs its tasks in the calling thread instead, which gives the same
results, since how the work is split depends on the thread count only. Workers never
spin: between calls they sleep.

The default count is the environment variable ``NPNORM_NUM_THREADS`` if set, else
the number of CPUs this process may run on.
"""

from __future__ import annotations

import contextvars
import itertools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, SupportsIndex, TypeVar

from ._checks import check_count

T = TypeVar("T")

ENV_VAR = "NPNORM_NUM_THREADS"
_EXPECTED = "an integer of at least 1 (1 = no worker threads)"

_lock = threading.Lock()
_num_threads: int | None = None  # None: not yet read from the environment


def default_num_threads() -> int:
    """``NPNORM_NUM_THREADS`` if set, else the CPUs available to this process."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        # one wording for every wrong value, the variable's text quoted ("0" and "abc" alike)
        try:
            value = int(env)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{ENV_VAR} must be {_EXPECTED}, got {env!r}")
        return value
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def get_num_threads() -> int:
    """How many threads the fast NumPy kernels split their work over (the caller's included).

    The default is the environment variable ``NPNORM_NUM_THREADS`` if set, else the
    number of CPUs this process may run on; ``set_num_threads`` changes it. Results
    are bitwise reproducible for a fixed count.

    Returns
    -------
    int
        At least 1 (1: everything runs in the calling thread).

    Examples
    --------
    >>> import npnorm
    >>> npnorm.get_num_threads() >= 1
    True
    """
    global _num_threads
    with _lock:
        if _num_threads is None:
            _num_threads = default_num_threads()
        return _num_threads


def set_num_threads(n: SupportsIndex) -> None:
    """Make the fast NumPy kernels split their work over ``n`` threads, for the whole process.

    Parameters
    ----------
    n : int
        At least 1 (any integer: ``np.int64(2)`` too); 1 runs everything in the calling
        thread (no pool). Workers start as calls need them, up to ``n - 1``; the ones
        beyond a lowered count stop at the next call that uses the pool.

    Raises
    ------
    TypeError
        If ``n`` is not an integer.
    ValueError
        If ``n`` is less than 1.

    Examples
    --------
    >>> import npnorm
    >>> before = npnorm.get_num_threads()
    >>> npnorm.set_num_threads(1)
    >>> npnorm.get_num_threads()
    1
    >>> npnorm.set_num_threads(before)
    """
    global _num_threads
    count = check_count(n, "the number of threads", _EXPECTED)
    with _lock:
        _num_threads = count


class _Worker:
    """A pool thread. It sleeps on its inbox until handed a ticket and a list of tasks,
    runs them in order, keeps each one's result or exception with the ticket, records
    the ticket as finished and drops a token into its outbox.

    The hand-off survives an interruption (KeyboardInterrupt, or any exception a signal
    handler raises) at any point of the calling thread: the two queues are C objects
    (a put or get either happens or not), and the truth about what ran is the ticket
    the worker wrote (``finished``), never the count of tokens, so a wait interrupted
    just after taking its token waits again without blocking, and a stale token only
    costs a wait one more round. (With two bare locks an interruption there acquired a
    lock twice: the next call hung, and a worker died on "release unlocked lock".)"""

    def __init__(self, name: str) -> None:
        self._inbox: queue.SimpleQueue[tuple[int, list[Callable[[], Any]]] | None] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.finished = 0  # the last ticket whose tasks ran (written by the worker only)
        self._outcomes: tuple[int, list[tuple[Any, BaseException | None]]] = (0, [])
        # set by the worker's own thread as its loop ends, stopped or killed (not
        # ``thread.is_alive()``, which an interruption of the asking thread can turn False
        # for a thread that still runs: CPython 3.10-3.12)
        self.dead = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            self.dead = True
            self._outbox.put(None)  # (wakes a caller waiting for a ticket it will never run)

    def _serve(self) -> None:
        while True:
            handed = self._inbox.get()
            if handed is None:
                return
            ticket, tasks = handed
            # nothing of a call stays bound while the worker sleeps: its tasks hold the
            # caller's arrays (input, output, dx), which stayed alive until the next call
            # used the pool, and for good after set_num_threads(1)
            del handed
            outcomes = [_outcome(t) for t in tasks]
            del tasks
            self._outcomes = (ticket, outcomes)
            del outcomes
            self.finished = ticket
            self._outbox.put(None)

    def start(self, ticket: int, tasks: list[Callable[[], Any]]) -> None:
        self._inbox.put((ticket, tasks))

    def wait(self, ticket: int) -> None:
        """Until the tasks of ``ticket`` have run (their ``start`` must have returned),
        even if the wait is interrupted: the interruption is raised after. Also until the
        worker has ended (an exception sent into its thread from outside, as
        ``PyThreadState_SetAsyncExc`` does, ends its loop): its tasks will never run, and
        ``take`` says so (the caller waited for ever, Ctrl-C included, before)."""
        interrupted: BaseException | None = None
        while self.finished < ticket:
            try:
                self._outbox.get(timeout=ALIVE_CHECK_S)  # a token per finished ticket (maybe an older one's)
            except queue.Empty:
                pass
            except BaseException as e:  # re-raised below
                interrupted = e
            if self.dead:  # (its tasks will never run: see take)
                break
        if interrupted is not None:
            raise interrupted

    def take(self, ticket: int) -> list[tuple[Any, BaseException | None]]:
        """The outcomes of the tasks of ``ticket``, which ``wait`` waited for."""
        got, outcomes = self._outcomes
        if got != ticket:
            if self.dead:
                raise RuntimeError(
                    f"npnorm's thread pool: its thread {self.thread.name} was ended by an exception "
                    "raised into it from outside, so this call's tasks on it did not run; the next call "
                    "starts a new one"
                )
            # cannot happen otherwise: tickets run in the order they were handed
            raise RuntimeError(f"npnorm's thread pool: outcomes of hand-off {got}, expected {ticket}")
        self._outcomes = (got, [])  # (results and exceptions are the caller's alone now)
        return outcomes

    def forget(self, ticket: int) -> None:
        """Drop the outcomes of ``ticket`` (waited for) unread."""
        if self._outcomes[0] == ticket:
            self._outcomes = (ticket, [])

    def stop(self) -> None:
        """End the thread once the tasks already handed to it have run."""
        self._inbox.put(None)


def _outcome(task: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    try:
        return task(), None
    except BaseException as e:  # raised by run_parallel, in the calling thread
        return None, e


# seconds between a waiting caller's looks at whether the worker it waits for has ended
# (a safety net: an ended worker wakes its caller itself)
ALIVE_CHECK_S = 0.5

_busy = threading.Lock()  # held by the one call using the pool
_workers_list: list[_Worker] = []
_tickets = itertools.count(1)  # one per call that uses the pool (taken under _busy)


def _workers(needed: int, most: int) -> list[_Worker]:
    """The pool, with at least ``needed`` workers and at most ``most`` (the thread count
    less the caller): the workers beyond ``most`` stop, and workers start only as a call
    needs them (``set_num_threads(64)`` and a call split in two tasks start one, not 63).
    The caller holds ``_busy``: no task is running on the pool."""
    global _workers_list
    if any(w.dead for w in _workers_list):  # (see ``_Worker.wait``)
        _workers_list = [w for w in _workers_list if not w.dead]
    if len(_workers_list) > most:
        # the list is cut first, then the workers cut off stop, so that an interruption
        # leaves the list short (filled again by the next call), never holding a stopped
        # worker (a hand-off to it was waited for forever)
        old, _workers_list = _workers_list, _workers_list[:most]
        for w in old[most:]:
            w.stop()
    while len(_workers_list) < needed:
        _workers_list.append(_Worker(f"npnorm-{len(_workers_list)}"))
    return _workers_list


def _forget_pool_after_fork() -> None:
    # A forked child has the parent's pool objects but none of its threads, and the
    # parent's locks in whatever state the fork found them.
    global _busy, _workers_list, _tickets
    _busy = threading.Lock()
    _workers_list = []
    _tickets = itertools.count(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def run_parallel(tasks: Sequence[Callable[[], T]]) -> list[T]:
    """Run the tasks, the first in the calling thread, the others on the pool.

    With ``n`` threads, task ``i`` runs in thread ``i % n`` (thread 0 being the caller),
    each thread taking its tasks in order. Returns their results in the order of
    ``tasks`` (so that whatever combines them does so in a fixed order). An exception
    in any task is raised here, the first in task order, after all of them have run.
    While another call holds the pool (another thread's, or the one whose task this
    is), the tasks run one after another in the calling thread, and the first exception
    stops them (a call that finds the pool free but loses the race for it to another
    thread's waits for that call instead). Every task runs in the caller's context
    (``contextvars``): an ``np.errstate`` the caller set holds in the pool's threads too.
    An interruption (Ctrl-C) is raised once every worker has finished its share.
    """
    n = get_num_threads()
    threads = min(len(tasks), n)
    if threads <= 1 or _busy.locked():
        return [t() for t in tasks]
    # ``with``: released even if an interruption comes right after it is taken (a
    # non-blocking acquire before a ``try`` left it held, the pool off for good); a caller
    # that lost the race for it since the check above waits for the other call
    with _busy:
        ticket = next(_tickets)
        workers = _workers(threads - 1, n - 1)[: threads - 1]
        handed = 0  # workers[:handed] certainly have their tasks
        mine: list[tuple[Any, BaseException | None]] | None = None  # the caller's outcomes
        try:
            for k, w in enumerate(workers, start=1):
                # each in a copy of the caller's context: NumPy's errstate is a context
                # variable, which a pool thread would otherwise see at its defaults
                w.start(ticket, [partial(contextvars.copy_context().run, t) for t in tasks[k::threads]])
                handed = k
            mine = [_outcome(t) for t in tasks[::threads]]
        finally:
            # every worker finishes this ticket before the call ends, whatever interrupts
            # it: one whose start was interrupted may hold its tasks or not, so it is
            # handed nothing under the same ticket too; each step is safe to repeat
            interrupted: BaseException | None = None
            while True:
                try:
                    for w in workers[handed:]:
                        w.start(ticket, [])
                    handed = len(workers)
                    for w in workers:
                        w.wait(ticket)  # returns at once where already waited for
                    break
                except BaseException as e:  # raised below, once every worker has finished
                    interrupted = interrupted or e
            if interrupted is not None or mine is None:  # (an interruption in the try)
                for w in workers:  # their outcomes (results, exceptions with their frames)
                    w.forget(ticket)  # are nobody's now: nothing of the call stays held
            if interrupted is not None:
                raise interrupted
        try:
            per_thread = [mine, *(w.take(ticket) for w in workers)]
        except RuntimeError:  # a worker ended from outside (``_Worker.take``)
            for w in workers:
                w.forget(ticket)
            raise
        outcomes = [per_thread[i % threads][i // threads] for i in range(len(tasks))]
    for _, err in outcomes:
        if err is not None:
            raise err
    return [result for result, _ in outcomes]
