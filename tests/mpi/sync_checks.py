"""Rank script: SyncBatchNorm over MPI against single-process BatchNorm on the concatenated batch.

Run by ``tests/test_sync_batch_norm.py`` as ``mpiexec -n 3 python -m mpi4py tests/mpi/sync_checks.py``
(``-m mpi4py``: an uncaught exception on one rank aborts every rank instead of leaving the others
waiting in a collective). Every rank draws the same global batch from a seed, takes its slice,
and compares what SyncBatchNorm gives it with what BatchNorm gives on the whole batch, which it
computes too: y and dx (its slice), dweight/dbias (summed over ranks), running statistics and
counter, over several steps then eval. Then every error case, each of which must raise the same
error on every rank and change nothing. Rank 0 ends by printing, for each rank,
``rank R: K checks passed, error cases raised in at most T s``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
from mpi4py import MPI

import npnorm
import npnorm.functional as F
from npnorm._backend import resolve_namespace, to_host
from npnorm._selfcheck import randomize

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
if WORLD.Get_size() != 3:
    sys.exit(f"run this script on 3 ranks (got {WORLD.Get_size()})")

TOL = {"float64": 1e-12, "float32": 1e-4, "float16": 2e-3}
checks = 0
slowest_error = 0.0


def close(ours: Any, ref: Any, tol: float, what: str) -> None:
    """``|ours - ref| <= tol * max(1, |ref|)`` everywhere (tol 0: bitwise equal)."""
    global checks
    a, b = to_host(ours), to_host(ref)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    if tol == 0:
        assert a.dtype == b.dtype and np.array_equal(a, b), f"{what}: not bitwise equal"
    else:
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        err = float(np.max(np.abs(a64 - b64), initial=0.0))
        scale = max(1.0, float(np.max(np.abs(b64), initial=0.0)))
        assert err <= tol * scale, f"{what}: differs by {err:.3g} > {tol:.0e} * {scale:.3g}"
    checks += 1


def same_on_every_rank(comm: Any, a: Any, what: str) -> None:
    """``a`` has the same bytes on every rank of ``comm``."""
    global checks
    h = to_host(a)
    everyone = comm.allgather((h.dtype.str, h.shape, h.tobytes()))
    assert all(e == everyone[0] for e in everyone), f"{what}: differs across ranks"
    checks += 1


def bounds(comm: Any, splits: tuple[int, ...]) -> tuple[int, int]:
    r = comm.Get_rank()
    return sum(splits[:r]), sum(splits[: r + 1])


def draw(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    c = shape[1]
    offset = rng.normal(size=(1, c) + (1,) * (len(shape) - 2)) * 3
    x = (rng.normal(size=shape) * rng.uniform(0.5, 3) + offset).astype(dtype)
    return x, rng.normal(size=shape).astype(dtype)


def run_case(
    comm: Any,
    splits: tuple[int, ...],
    spatial: tuple[int, ...] = (),
    *,
    c: int = 3,
    dtype: str = "float64",
    momentum: float | None = 0.1,
    affine: bool = True,
    track: bool = True,
    steps: int = 3,
    backend: str = "numpy",
    input_dtype: str | None = None,
    seed: int = 0,
) -> None:
    """Train SyncBatchNorm on ``comm`` (rank r holding ``splits[r]`` samples) and BatchNorm
    on the whole batch for ``steps`` steps, then eval; compare everything each step."""
    xp = resolve_namespace(backend)
    rng = np.random.default_rng(seed)
    in_dtype = input_dtype or dtype
    tol = 0.0 if comm.Get_size() == 1 and backend == "numpy" else TOL[in_dtype]
    lo, hi = bounds(comm, splits)
    total = sum(splits)
    shape = (total, c, *spatial)
    sync = npnorm.SyncBatchNorm(c, 1e-5, momentum, affine, track, comm=comm, dtype=dtype, xp=backend)
    ref = npnorm.BatchNorm1d(c, 1e-5, momentum, affine, track, dtype=dtype)  # on (N, C, S)
    randomize(ref, rng)
    sync.load_state_dict(ref.state_dict())
    flat = (total, c, int(np.prod(spatial)))  # (-1 cannot be inferred for an empty batch)

    def step(training: bool) -> None:
        x, dy = draw(rng, shape, in_dtype)
        sync.zero_grad()
        ref.zero_grad()
        y = sync(xp.asarray(x[lo:hi]))
        dx = sync.backward(xp.asarray(dy[lo:hi]))
        label = f"{backend} {in_dtype} {splits} {spatial} momentum={momentum} affine={affine} track={track}"
        if not training and not track:  # eval without running stats: this rank's batch statistics
            local = npnorm.BatchNorm1d(c, 1e-5, momentum, affine, False, dtype=dtype)
            local.load_state_dict(ref.state_dict())
            local.eval()
            y_ref = local(x[lo:hi].reshape(hi - lo, c, -1)).reshape(y.shape)
            dx_ref = local.backward(dy[lo:hi].reshape(hi - lo, c, -1)).reshape(y.shape)
            close(y, y_ref, tol, f"eval-local y {label}")
            close(dx, dx_ref, tol, f"eval-local dx {label}")
            return
        y_ref = ref(x.reshape(flat)).reshape(shape)
        dx_ref = ref.backward(dy.reshape(flat)).reshape(shape)
        close(y, y_ref[lo:hi], tol, f"y {label}")
        close(dx, dx_ref[lo:hi], tol, f"dx {label}")
        assert to_host(y).dtype == np.dtype(in_dtype) == to_host(dx).dtype
        assert set(sync.grads) == set(ref.grads)
        for name, g in sync.grads.items():
            if hi == lo:  # an empty rank's sums are zeros
                close(g, np.zeros_like(to_host(g)), 0, f"empty rank d{name}")
            summed = comm.allreduce(to_host(g).astype(np.float64))
            close(summed, ref.grads[name], tol, f"sum over ranks of d{name} {label}")
        ours, theirs = sync.state_dict(), ref.state_dict()
        assert list(ours) == list(theirs)
        for name in ours:
            close(ours[name], theirs[name], tol, f"{name} {label}")
            same_on_every_rank(comm, ours[name], name)
        if training and sync._saved is not None:
            same_on_every_rank(comm, sync._saved[1], "the global mean")
            same_on_every_rank(comm, sync._saved[2], "the global rstd")

    for _ in range(steps):
        step(True)
    sync.eval()
    ref.eval()
    local_count = (hi - lo) * int(np.prod(spatial))
    if not track and local_count == 1:  # eval without running stats needs > 1 local value
        try:
            sync(xp.asarray(draw(rng, shape, in_dtype)[0][lo:hi]))
        except ValueError:
            pass
        else:
            raise AssertionError("eval without running stats on 1 local value did not raise")
    elif not track and local_count == 0:  # no local value: an empty output, as PyTorch's
        x_local = xp.asarray(draw(rng, shape, in_dtype)[0][lo:hi])
        assert tuple(sync(x_local).shape) == tuple(x_local.shape)
    else:
        step(False)


def check_functional(comm: Any) -> None:
    """The functional pair against batch_norm's on the concatenated batch, and its
    inference path against batch_norm_forward bitwise."""
    rng = np.random.default_rng(7)
    splits = (2, 0, 3)
    lo, hi = bounds(comm, splits)
    x, dy = draw(rng, (5, 4, 3), "float64")
    w, b = rng.uniform(0.5, 1.5, 4), rng.normal(size=4)
    rm, rv = rng.normal(size=4), rng.uniform(0.5, 2, 4)
    ours = F.sync_batch_norm_forward(x[lo:hi], rm, rv, w, b, True, 0.3, 1e-3, comm=comm)
    ref = F.batch_norm_forward(x, rm, rv, w, b, True, 0.3, 1e-3)
    close(ours[0], ref[0][lo:hi], 1e-12, "functional y")
    for i in range(1, 5):
        close(ours[i], ref[i], 1e-12, f"functional output {i}")
    dx, dw, db = F.sync_batch_norm_backward(dy[lo:hi], x[lo:hi], ours[1], ours[2], w, b, True, comm=comm)
    rdx, rdw, rdb = F.batch_norm_backward(dy, x, ref[1], ref[2], w, b, True)
    close(dx, rdx[lo:hi], 1e-12, "functional dx")
    close(comm.allreduce(dw), rdw, 1e-12, "functional sum of dweight")
    close(comm.allreduce(db), rdb, 1e-12, "functional sum of dbias")
    # inference: batch_norm exactly, no collective (rank 0 alone)
    if comm.Get_rank() == 0:
        got = F.sync_batch_norm_forward(x, rm, rv, w, b, False, comm=comm)
        want = F.batch_norm_forward(x, rm, rv, w, b, False)
        for g, e in zip(got, want, strict=True):
            close(g, e, 0, "functional inference")
        got_b = F.sync_batch_norm_backward(dy, x, got[1], got[2], w, b, False, comm=comm)
        want_b = F.batch_norm_backward(dy, x, want[1], want[2], w, b, False)
        for g, e in zip(got_b, want_b, strict=True):
            close(g, e, 0, "functional inference backward")
    comm.Barrier()


def check_eval_alone() -> None:
    """One rank runs eval (forward and backward) while the others wait at a barrier: a
    collective call in eval would never return."""
    m = npnorm.SyncBatchNorm(3, dtype="float64")
    ref = npnorm.BatchNorm2d(3, dtype="float64")
    randomize(ref, np.random.default_rng(3))
    m.load_state_dict(ref.state_dict())
    m.eval()
    ref.eval()
    if RANK == 1:
        x, dy = draw(np.random.default_rng(4), (1, 3, 2, 2), "float64")
        close(m(x), ref(x), 0, "eval alone y")
        close(m.backward(dy), ref.backward(dy), 0, "eval alone dx")
    WORLD.Barrier()


# --- errors ---------------------------------------------------------------------------


def snapshot(m: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], Any]:
    return (
        {k: to_host(v) for k, v in m.state_dict().items()},
        {k: to_host(v) for k, v in m.grads.items()},
        m._saved,
    )


def expect_error(cls: type[Exception], fn: Any, module: Any, contains: str) -> None:
    """``fn()`` raises ``cls`` on every rank with one message containing ``contains``,
    and ``module`` (if any) is left exactly as it was."""
    global checks, slowest_error
    before = None if module is None else snapshot(module)
    start = time.perf_counter()
    try:
        fn()
    except cls as err:
        message = str(err)
    else:
        raise AssertionError(f"expected {cls.__name__} containing {contains!r}: nothing raised")
    slowest_error = max(slowest_error, time.perf_counter() - start)
    everyone = WORLD.allgather(message)
    assert all(m == message for m in everyone), f"different messages across ranks: {everyone}"
    assert contains in message, f"{contains!r} not in {message!r}"
    if module is not None:
        after = snapshot(module)
        for part in (0, 1):
            assert before[part].keys() == after[part].keys()
            for k in before[part]:
                assert np.array_equal(before[part][k], after[part][k]), f"{k} changed on error"
        assert after[2] is before[2], "the saved forward changed on error"
    checks += 1


def check_errors() -> None:
    rng = np.random.default_rng(11)
    m = npnorm.SyncBatchNorm(3, momentum=None, dtype="float64")
    randomize(m, rng)
    good = rng.normal(size=(2, 3, 4))

    m(good)  # a step that succeeds first, so that the saved forward and grads exist
    m.backward(good)

    one = np.zeros((1 if RANK == 1 else 0, 3))
    expect_error(
        ValueError, lambda: m(one), m, "got 1 over the 3 ranks (values per channel on each rank: 0, 1, 0)"
    )
    bad_c = rng.normal(size=(2, 2 if RANK == 1 else 3, 4))
    expect_error(ValueError, lambda: m(bad_c), m, "failed on rank 1 of 3: SyncBatchNorm expected 3 channels")
    mixed = good.astype(np.float32) if RANK == 0 else good
    expect_error(ValueError, lambda: m(mixed), m, "different dtypes (rank 0: float32, rank 1: float64")
    flat = good[0, 0] if RANK == 0 else good
    expect_error(ValueError, lambda: m(flat), m, "failed on rank 0 of 3: expected at least 2D input")
    ints = np.ones((2, 3, 4), dtype=np.int64) if RANK == 2 else good
    expect_error(TypeError, lambda: m(ints), m, "failed on rank 2 of 3: input must have a floating dtype")
    strict = resolve_namespace("array_api_strict").asarray(good) if RANK == 1 else good
    expect_error(TypeError, lambda: m(strict), m, "failed on rank 1 of 3: input and the module")
    two_bad = good[0, 0] if RANK != 1 else good
    expect_error(ValueError, lambda: m(two_bad), m, "(rank(s) 2 failed too)")
    # the functional forms: channel counts compared across ranks, eps checked on one rank
    fc = rng.normal(size=(2, 2 if RANK == 2 else 3))
    expect_error(
        ValueError,
        lambda: F.sync_batch_norm_forward(fc, None, None, training=True, comm=WORLD),
        None,
        "different numbers of channels (rank 0: 3, rank 1: 3, rank 2: 2)",
    )
    eps = -1.0 if RANK == 0 else 1e-5
    expect_error(
        ValueError,
        lambda: F.sync_batch_norm_forward(good, None, None, training=True, eps=eps, comm=WORLD),
        None,
        "eps must be a non-negative number",
    )
    # backward: a wrong grad_output on one rank
    m(good)
    bad_dy = good[:, :, :2] if RANK == 2 else good
    expect_error(
        ValueError, lambda: m.backward(bad_dy), m, "failed on rank 2 of 3: grad_output must have the shape"
    )
    int_dy = np.ones(good.shape, dtype=np.int64) if RANK == 0 else good
    expect_error(TypeError, lambda: m.backward(int_dy), m, "grad_output must have a floating dtype")
    # backward: what one rank's forward saved, overwritten since or never saved (it raised on
    # that rank alone, before the exchange, and the other ranks waited for ever)
    m(good)
    if RANK == 1:
        m.load_state_dict(m.state_dict())
    lost = "failed on rank 1 of 3: SyncBatchNorm.backward(): the"
    expect_error(RuntimeError, lambda: m.backward(good), m, lost)
    if RANK == 0:
        with npnorm.no_grad():
            m(good)
    else:
        m(good)
    lost = "failed on rank 0 of 3: SyncBatchNorm.backward() called"
    expect_error(RuntimeError, lambda: m.backward(good), m, lost)
    # after every error the ranks are still in step: a full step matches BatchNorm
    ref = npnorm.BatchNorm1d(3, momentum=None, dtype="float64")
    ref.load_state_dict(m.state_dict())
    m.zero_grad()
    x, dy = draw(np.random.default_rng(12), (6, 3, 4), "float64")  # the same on every rank
    lo, hi = 2 * RANK, 2 * RANK + 2
    close(m(x[lo:hi]), ref(x)[lo:hi], 1e-12, "y after the errors")
    close(m.backward(dy[lo:hi]), ref.backward(dy)[lo:hi], 1e-12, "dx after the errors")
    close(m.running_var, ref.running_var, 1e-12, "running_var after the errors")
    close(m.num_batches_tracked, ref.num_batches_tracked, 0, "num_batches_tracked after the errors")


def main() -> None:
    global checks
    # 1d, 2d, 3d and more trailing axes; uneven and empty ranks; flags; dtypes; backends
    run_case(WORLD, (5, 1, 0))
    run_case(WORLD, (5, 1, 0), (4,), momentum=None, seed=1)
    run_case(WORLD, (2, 3, 1), (3, 2), affine=False, seed=2)
    run_case(WORLD, (0, 4, 2), (2, 1, 3), track=False, seed=3)
    run_case(WORLD, (1, 0, 1), (), track=False, affine=False, momentum=None, seed=4)
    run_case(WORLD, (0, 0, 3), (2,), momentum=1.0, seed=5)
    run_case(WORLD, (3, 3, 3), (2, 2, 1, 2), steps=2, seed=6)
    run_case(WORLD, (4, 0, 2), (3, 1), momentum=None, affine=False, track=False, seed=7)
    run_case(WORLD, (5, 1, 0), (3, 2), dtype="float32", momentum=None, seed=8)
    run_case(WORLD, (2, 2, 2), (4,), dtype="float32", affine=False, track=False, seed=9)
    run_case(WORLD, (1, 6, 2), (2, 3), dtype="float32", input_dtype="float16", seed=10)
    run_case(WORLD, (5, 1, 0), (3,), backend="array_api_strict", seed=11)
    run_case(WORLD, (0, 3, 3), (2, 2), dtype="float32", backend="array_api_strict", momentum=None, seed=12)
    # an empty batch on every rank: BatchNorm's on the empty batch (it raised "got 0 over the
    # 3 ranks", where one rank, and BatchNorm, return empty outputs and count the batch)
    run_case(WORLD, (0, 0, 0), (4,), seed=17)
    run_case(WORLD, (0, 0, 0), (), momentum=None, affine=False, seed=18)
    run_case(WORLD, (0, 0, 0), (2,), dtype="float32", backend="array_api_strict", seed=19)
    check_functional(WORLD)

    # sub-communicators: {0, 2} (in reverse rank order) and {1} alone
    sub = WORLD.Split(color=RANK % 2, key=-RANK)
    if sub.Get_size() == 2:
        run_case(sub, (4, 1), (3,), seed=13)
        run_case(sub, (0, 3), (2, 2), momentum=None, seed=14)
    else:
        run_case(sub, (5,), (3,), seed=15)  # one rank: BatchNorm bitwise, no collective
    sub.Free()
    pair = WORLD.Split(color=0 if RANK < 2 else MPI.UNDEFINED, key=RANK)
    if pair != MPI.COMM_NULL:
        run_case(pair, (3, 0), (2,), dtype="float32", seed=16)
        pair.Free()
    else:  # the rank Split left out: a clear TypeError, not MPI's "Invalid communicator"
        try:
            npnorm.SyncBatchNorm(2, comm=pair)
        except TypeError as err:
            assert "MPI.COMM_NULL" in str(err), err
            checks += 1
        else:
            raise AssertionError("SyncBatchNorm took MPI.COMM_NULL")
    check_eval_alone()

    check_errors()
    lines = WORLD.gather(
        f"rank {RANK}: {checks} checks passed, error cases raised in at most {slowest_error:.3f} s"
    )
    if RANK == 0:  # one writer: lines from several ranks would interleave
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
