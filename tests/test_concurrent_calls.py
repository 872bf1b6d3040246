"""Kernel calls from several Python threads at once, each with its own arrays or modules
(as torch's functions and modules may be called): every call gives bitwise the results it
gives alone.

One caller at a time holds the worker pool; a call that finds it held runs its share of
the work in its own thread (``npnorm._threads.run_parallel``), split as the pool would
split it, so the results must not depend on who got the pool, nor on what the other
threads are running. The inputs are large enough for the kernels to split them over
threads (the sample-split sums of BatchNorm1d's short channels included), and each
thread picks a kernel family per call (``use_kernels`` holds per thread), so that
families run side by side too.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest

import npnorm
import npnorm.functional as F

pytestmark = pytest.mark.usefixtures("restore_threads")  # (tests/conftest.py)


def _calls(rng: np.random.Generator) -> list:
    """Functions that run a layer's forward and backward and return every array made."""
    calls = []
    x = (rng.standard_normal((8, 96, 257)) * 3 + 5).astype(np.float32)  # 197K values
    dy = rng.standard_normal(x.shape).astype(np.float32)
    w, b = rng.standard_normal(257).astype(np.float32), rng.standard_normal(257).astype(np.float32)

    def layer_norm():
        y, mean, rstd = F.layer_norm_forward(x, 257, w, b)
        return (y, mean, rstd, *F.layer_norm_backward(dy, x, 257, mean, rstd, w, b))

    calls.append(layer_norm)
    for shape in [(65536, 64), (32, 16, 20, 20)]:  # BatchNorm1d's short channels; 2d
        xc = (rng.standard_normal(shape) * 3 + 5).astype(np.float32)
        dyc = rng.standard_normal(shape).astype(np.float32)
        wc, bc = rng.standard_normal(shape[1]).astype(np.float32), np.ones(shape[1], np.float32)

        def batch_norm(xc=xc, dyc=dyc, wc=wc, bc=bc):
            rm, rv = np.zeros(xc.shape[1], np.float32), np.ones(xc.shape[1], np.float32)
            y, mean, rstd, rm, rv = F.batch_norm_forward(xc, rm, rv, wc, bc, training=True)
            dx, dw, db = F.batch_norm_backward(dyc, xc, mean, rstd, wc, bc, training=True)
            y_eval = F.batch_norm_forward(xc, rm, rv, wc, bc)[0]
            return y, mean, rstd, rm, rv, dx, dw, db, y_eval

        calls.append(batch_norm)
        if len(shape) == 4:

            def group_norm(xc=xc, dyc=dyc, wc=wc, bc=bc):
                y, mean, rstd = F.group_norm_forward(xc, 4, wc, bc)
                return (y, mean, rstd, *F.group_norm_backward(dyc, xc, 4, mean, rstd, wc, bc))

            calls.append(group_norm)

            def module(xc=xc, dyc=dyc, wc=wc):  # a BatchNorm2d's training step, then eval
                m = npnorm.BatchNorm2d(xc.shape[1])
                m.weight[...] = wc
                y = m(xc)
                dx = m.backward(dyc)
                y_eval = m.eval()(xc)
                return y, dx, m.grads["weight"], m.grads["bias"], m.running_mean, m.running_var, y_eval

            calls.append(module)
    return calls


def _digests(arrays) -> list[str]:
    """The bytes of each array, as a digest (the results alone are kept so: BatchNorm1d's
    are large, to split its samples over the threads)."""
    return [hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for a in arrays]


def test_calls_from_several_threads_at_once_give_each_calls_own_results(rng):
    npnorm.set_num_threads(2)
    threads = 4
    calls = [_calls(rng) for _ in range(threads)]  # each thread's own arrays
    families = npnorm.kernels_available()
    alone = {}
    for family in families:
        with npnorm.use_kernels(family):
            for t in range(threads):
                for i, call in enumerate(calls[t]):
                    alone[t, family, i] = _digests(call())
    # the steps every thread takes together (after a barrier): a call, and a family, the
    # same for all threads on even steps, one per thread on odd steps
    steps = [(int(rng.integers(len(calls[0]))), int(rng.integers(len(families)))) for _ in range(24)]
    barrier = threading.Barrier(threads, timeout=60)
    errors: list = []

    def caller(t: int) -> None:
        try:
            for s, (i, f) in enumerate(steps):
                family = families[(f + t * (s % 2)) % len(families)]
                barrier.wait()
                with npnorm.use_kernels(family):
                    got = calls[t][i]()
                for k, (a, want) in enumerate(zip(_digests(got), alone[t, family, i], strict=True)):
                    if a != want:
                        name = calls[t][i].__name__
                        errors.append(f"step {s}, thread {t}: {family} {name}: result {k} differs")
        except BaseException as err:  # reported below (a broken barrier: see the first)
            errors.append(err)
            barrier.abort()

    workers = [threading.Thread(target=caller, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    assert not any(w.is_alive() for w in workers)
    assert not errors, errors[:3]
