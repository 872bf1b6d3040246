"""npnorm's worker pool (``npnorm._threads.run_parallel``): which thread runs which
task, results and errors in task order, the pool's life (recreated with the thread
count, after a fork), and callers that find it in use (other threads, nested calls)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from npnorm import _threads

pytestmark = pytest.mark.usefixtures("restore_threads")  # (tests/conftest.py)


def _where(i: int):
    """A task that returns its index and the name of the thread that ran it."""
    return lambda: (i, threading.current_thread().name)


def test_task_i_runs_in_thread_i_mod_n_results_in_task_order():
    _threads.set_num_threads(3)
    caller = threading.current_thread().name
    out = _threads.run_parallel([_where(i) for i in range(7)])
    assert [i for i, _ in out] == list(range(7))
    names = [name for _, name in out]
    assert names[0::3] == [caller] * 3  # tasks 0, 3, 6: the calling thread
    assert len(set(names[1::3])) == 1 and len(set(names[2::3])) == 1
    assert len({caller, names[1], names[2]}) == 3  # three threads in all
    assert _threads.run_parallel([lambda k=k: k * k for k in range(6)]) == [0, 1, 4, 9, 16, 25]


def test_fewer_tasks_than_threads_and_one_thread():
    _threads.set_num_threads(4)
    assert _threads.run_parallel([lambda: 1, lambda: 2]) == [1, 2]
    assert _threads.run_parallel([lambda: 5]) == [5]
    assert _threads.run_parallel([]) == []
    _threads.set_num_threads(1)
    caller = threading.current_thread().name
    assert [name for _, name in _threads.run_parallel([_where(i) for i in range(3)])] == [caller] * 3


def test_tasks_on_the_pool_see_the_callers_errstate():
    """NumPy's errstate is a context variable: the pool's threads saw the defaults, so a
    kernel's quiet cast to float16 (inf, as the reference gives) warned there."""
    _threads.set_num_threads(2)
    with np.errstate(over="ignore", invalid="raise"):
        states = _threads.run_parallel([np.geterr for _ in range(4)])
        casts = _threads.run_parallel([lambda: np.array([1e6]).astype(np.float16) for _ in range(4)])
    assert all(s["over"] == "ignore" and s["invalid"] == "raise" for s in states)
    assert all(np.isinf(c[0]) for c in casts)  # and no RuntimeWarning (an error in pytest)
    assert all(s["over"] == np.geterr()["over"] for s in _threads.run_parallel([np.geterr] * 2))


def test_pool_recreated_when_the_count_changes():
    _threads.set_num_threads(3)
    _threads.run_parallel([_where(i) for i in range(3)])
    old = list(_threads._workers_list)
    assert len(old) == 2 and all(w.thread.is_alive() for w in old)
    _threads.set_num_threads(2)
    assert _threads.run_parallel([lambda: 1, lambda: 2]) == [1, 2]
    assert len(_threads._workers_list) == 1 and _threads._workers_list[0] not in old
    for w in old:  # the old workers exit
        w.thread.join(timeout=10)
        assert not w.thread.is_alive()


def test_errors_raised_first_in_task_order_after_every_task_ran():
    _threads.set_num_threads(2)
    ran = []

    def ok(i):
        def task():
            time.sleep(0.01)
            ran.append(i)

        return task

    def boom(msg):
        def task():
            raise RuntimeError(msg)

        return task

    with pytest.raises(RuntimeError, match="task 1"):
        _threads.run_parallel([ok(0), boom("task 1"), ok(2), boom("task 3"), ok(4)])
    assert sorted(ran) == [0, 2, 4]
    # the caller's own task failing: raised after the worker's task has finished
    with pytest.raises(RuntimeError, match="task 0"):
        _threads.run_parallel([boom("task 0"), ok(5)])
    assert sorted(ran) == [0, 2, 4, 5]
    # and the pool still works
    assert _threads.run_parallel([lambda: "a", lambda: "b"]) == ["a", "b"]


def test_a_nested_call_runs_in_its_thread():
    _threads.set_num_threads(2)

    def inner():
        out = _threads.run_parallel([_where(0), _where(1)])
        me = threading.current_thread().name
        return [name == me for _, name in out]

    assert _threads.run_parallel([inner, inner]) == [[True, True], [True, True]]


def test_callers_in_several_threads_each_get_their_results():
    _threads.set_num_threads(2)
    errors: list[BaseException] = []
    results: dict[int, list[list[int]]] = {}

    def caller(c: int) -> None:
        try:
            tasks = [lambda k=k: c * 100 + k for k in range(3)]
            results[c] = [_threads.run_parallel(tasks) for _ in range(200)]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    for c in range(4):
        assert results[c] == [[c * 100, c * 100 + 1, c * 100 + 2]] * 200


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_pool_works_in_a_forked_child():
    _threads.set_num_threads(2)
    assert _threads.run_parallel([lambda: 1, lambda: 2]) == [1, 2]  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child: its own pool, created on first use
        ok = False
        try:
            ok = _threads.run_parallel([lambda: 3, lambda: 4]) == [3, 4]
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer (POSIX)")
def test_an_interrupted_wait_still_waits_for_the_workers():
    """A KeyboardInterrupt while the caller waits for a worker is raised once the worker's
    task has finished, and the pool is then as good as new."""
    _threads.set_num_threads(2)
    finished = []

    def slow():
        time.sleep(0.3)
        finished.append(True)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)  # while the caller waits for `slow`
        with pytest.raises(KeyboardInterrupt):
            _threads.run_parallel([lambda: None, slow])
        assert finished == [True]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert _threads.run_parallel([lambda: "a", lambda: "b"]) == ["a", "b"]
