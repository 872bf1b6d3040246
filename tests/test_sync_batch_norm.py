"""SyncBatchNorm: equal to BatchNorm on the concatenated batch, over MPI and over threads.

Three layers of tests:

* under ``mpiexec -n 3 python -m mpi4py`` (real MPI, one launch per rank script, with a
  timeout so that a hang fails instead of blocking): ``tests/mpi/sync_checks.py`` runs
  every comparison and every error case, and the data-parallel example trains to the
  parameters of its one-process run. Skipped, with the reason, without mpi4py/mpiexec.
* in-process, with ``npnorm._threadcomm`` (ranks as threads, MPI's semantics): hypothesis
  draws the number of ranks, the split of the batch (empty ranks too), shapes, dtypes and
  flags, and every error case is raised on every rank;
* the rest: no collective call in eval or on one rank, ``import npnorm`` without mpi4py,
  conversion from BatchNorm, copies and pickles.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pathlib
import signal
import subprocess
import sys
import threading

import array_api_compat.numpy as xp
import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from conftest import assert_state_equal, snapshot
from helpers import (
    MPIEXEC,
    at_elements,
    close,
    draw_state,
    gains,
    gradient_terms,
    load_into_torch,
    needs_extra,
    output_terms,
    parameter_at,
    randomize,
    statistic_max,
    statistic_scales,
    statistic_shape,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fast_channels import LAYOUTS, config, laid_out

import npnorm
import npnorm.functional as F
from npnorm._backend import to_host
from npnorm._threadcomm import ThreadComm, run_ranks
from npnorm.functional._dispatch import family_kernel, generic_kernel
from npnorm.functional.sync_batch_norm import merge_moments
from npnorm.kernels import numpy_fast_channels

ROOT = pathlib.Path(__file__).resolve().parent.parent
needs_mpi = needs_extra("mpi")


def launch(args: list[str], timeout: float, ranks: int | None = 3) -> subprocess.CompletedProcess[str]:
    """Run ``mpiexec -n ranks python -m mpi4py args`` (or plain python when ``ranks`` is
    None); on timeout kill the whole process group and fail: a hang."""
    cmd = [sys.executable, *args]
    if ranks is not None:
        cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "mpi4py", *args]
    env = {**os.environ, "NPNORM_NUM_THREADS": "1"}  # 3 ranks on a shared machine: no pools
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s: a hang")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# --- under mpiexec ------------------------------------------------------------------------


@needs_mpi
def test_three_ranks_equal_batch_norm_on_the_whole_batch_and_errors_are_collective():
    run = launch(["tests/mpi/sync_checks.py"], timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = sorted(line for line in run.stdout.splitlines() if "checks passed" in line)
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1", "rank 2"], run.stdout


@needs_mpi
def test_example_trains_the_same_parameters_on_one_and_three_ranks(tmp_path):
    example = "examples/sync_batchnorm_data_parallel.py"
    one = launch([example, "--save", str(tmp_path / "one.npz")], timeout=120, ranks=None)
    three = launch([example, "--save", str(tmp_path / "three.npz")], timeout=120)
    for run in (one, three):
        assert run.returncode == 0, run.stdout + run.stderr
        assert "same parameters as one process (to 1e-12): True" in run.stdout, run.stdout
    assert "3 rank(s) holding [11, 11, 10]" in three.stdout
    a, b = np.load(tmp_path / "one.npz"), np.load(tmp_path / "three.npz")
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-12, err_msg=k)
    bn = npnorm.BatchNorm1d(16, dtype="float64")  # its state_dict under "bn.", torch's keys
    assert bn.load_state_dict(dict(b), prefix="bn.") == ([], [])
    assert int(bn.num_batches_tracked) == 60 and np.array_equal(bn.running_var, b["bn.running_var"])


@needs_mpi
def test_example_with_more_ranks_than_samples_and_its_usage_errors(tmp_path):
    """Fewer samples than ranks (33 ranks for its 32; here 3 for 2) ended every rank with
    an IndexError; --save without a file name, or into no folder, raised after training,
    and --help trained (no argument parsing)."""
    example = "examples/sync_batchnorm_data_parallel.py"
    run = launch([example, "--batch", "2"], timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 rank(s) holding [1, 1, 0] of the 2 samples" in run.stdout
    assert "same parameters as one process (to 1e-12): True" in run.stdout
    for argv, message in [
        (["--save"], "expected one argument"),
        (["--save", str(tmp_path / "no" / "p.npz")], "--save: no folder"),
        (["--batch", "1"], "at least 2 samples"),
    ]:
        bad = launch([example, *argv], timeout=60, ranks=None)
        assert bad.returncode == 2 and message in bad.stderr and "step" not in bad.stdout, argv
    assert "--batch N" in launch([example, "--help"], timeout=60, ranks=None).stdout


# --- over threads: drawn splits, shapes, dtypes and flags ----------------------------------


@st.composite
def sync_cases(draw):
    ranks = draw(st.integers(1, 4))
    splits = draw(st.lists(st.integers(0, 4), min_size=ranks, max_size=ranks))
    spatial = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=3))
    if sum(splits) * int(np.prod(spatial)) < 2:  # training needs 2 values per channel
        splits[-1] += 2
    c = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(["float64", "float32"]))
    shape = (sum(splits), c, *spatial)
    elements = st.floats(-50, 50, allow_nan=False, allow_subnormal=False)
    # each channel (x's and dy's) scaled on its own: channels of very different sizes in
    # one call, for the per-channel bounds below
    scales = statistic_scales("batch_norm", shape, statistic_shape("batch_norm", shape))
    x_factor = draw(scales)
    x = draw(hnp.arrays(np.float64, shape, elements=elements, fill=st.nothing())) * x_factor
    dy = draw(hnp.arrays(np.float64, shape, elements=elements, fill=st.nothing())) * draw(scales)
    flags = dict(
        momentum=draw(st.sampled_from([0.1, 0.7, None])),
        affine=draw(st.booleans()),
        track=draw(st.booleans()),
    )
    channel = statistic_max("batch_norm", x_factor, np.zeros(c))  # C: each channel's factor
    return splits, x.astype(dtype), dy.astype(dtype), dtype, flags, channel


def _train_step(m, x, dy):
    m.zero_grad()
    y = m(x)
    rstd = to_host(m._saved[2])
    return y, m.backward(dy), {k: to_host(g) for k, g in m.grads.items()}, snapshot(m)[0], rstd


def check_splits(splits, x, dy, dtype: str, flags: dict, start: dict) -> None:
    """SyncBatchNorm over ``splits`` of the batch ``x`` (threads as ranks), two training
    steps from the state ``start``, against BatchNorm1d on the whole batch: y and dx of
    each rank's slice, the running buffers and counter on every rank, dweight/dbias
    summed over the ranks."""
    n, c = x.shape[:2]
    flat = (n, c, -1)
    ref = npnorm.BatchNorm1d(c, 1e-5, flags["momentum"], flags["affine"], flags["track"], dtype=dtype)
    ref.load_state_dict(start)
    start = {k: np.array(v, copy=True) for k, v in ref.state_dict().items()}  # ref trains in place
    want = [_train_step(ref, x.reshape(flat), dy.reshape(flat)) for _ in range(2)]  # two steps, same data
    ends = np.cumsum([0, *splits])

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(
            c, 1e-5, flags["momentum"], flags["affine"], flags["track"], comm=comm, dtype=dtype
        )
        m.load_state_dict(start)
        lo, hi = ends[comm.Get_rank()], ends[comm.Get_rank() + 1]
        return [_train_step(m, x[lo:hi], dy[lo:hi]) for _ in range(2)]

    got = run_ranks(len(splits), rank_fn)
    # Each result to the rounding of its own terms on its own channel (helpers.output_terms,
    # gradient_terms), not to the largest of its channel or of all, and with no term of
    # size 1: a bound of tol * (1 + ...) per channel let a dx off on a channel of small
    # terms (r |w| max|dy| under ~0.1) pass, and so did a running mean off on a channel of
    # small values. So bounded, every result of the drawn data agreed to 1e-15 (float64)
    # and 2e-7 (float32) of its terms, ~5 and ~2 roundings, on 12 seeds; tol was 1e-12 and
    # 2e-4. The allowances below the terms are for what the drawn data seldom reaches
    # (SPLITS_AT_THE_EDGES).
    tol = 1e-14 if dtype == "float64" else 2e-6
    eps64, tiny = float(np.finfo(np.float64).eps), float(np.finfo(dtype).smallest_subnormal)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    n_c = x.size // c  # values per channel
    x_max = statistic_max("batch_norm", x64, np.zeros(c))  # C
    mean = x64.reshape(flat).mean(axis=(0, 2))  # C: the batch mean (float64)
    spread = np.sqrt(x64.reshape(flat).var(axis=(0, 2), ddof=1))  # C
    w = start["weight"] if flags["affine"] else None
    w_at = parameter_at("batch_norm", x64, w)
    b_at = parameter_at("batch_norm", x64, start["bias"]) if flags["affine"] else 0.0
    mean_at = at_elements("batch_norm", x64, mean)
    m_at = np.abs(mean_at)
    # the ranks' merge takes the difference of float64 means already rounded: the merged
    # variance is off by ~n eps64 |mean| spread, rstd by n eps64 |mean| r relative, which
    # dx and dweight carry (a channel of 49.999 and 50: dx 1e-10 off, tol * terms 2.4e-11)
    var_floor = (n_c * eps64 * x_max) ** 2 + 2 * n_c * eps64 * x_max * spread  # C
    stat_floor = {"running_mean": tol * x_max, "running_var": var_floor}
    rstd = want[0][4].astype(np.float64)  # C (the same data both steps)
    r_at = at_elements("batch_norm", x64, rstd)
    merged = n_c * eps64 * np.abs(mean) * rstd  # C: rstd's relative error from the merge
    xhat = np.abs(x64 - mean_at) * r_at
    terms, mean_rounding = output_terms("batch_norm", x64, w, mean, rstd)
    # y: the mean rounded to float32 where the ranks normalize with it, |mean| r up to
    # RECENTRE_ABOVE = 4 (beyond, with the float64 statistics: a y normalized with the
    # rounded mean at x = 1000 +- 0.1 was 4e-4 off, which |mean| r |w| let pass); each
    # kernel's float64 mean n roundings of |mean| off, times |xhat| + 1 through rstd
    y_atol = (
        tol * (terms + b_at + np.minimum(m_at * r_at, 4.0) * w_at) + 2 * mean_rounding * (1 + xhat) + 2 * tiny
    )
    dx_terms, dw_terms, db_terms = gradient_terms("batch_norm", x64, dy64, w, mean, rstd, batch=True)
    # dx: products below the normal range round to the subnormal spacing, which r (and r^2
    # |xhat| where a mean of them scales xhat) amplifies, and the kernels' coefficient of
    # x - mean (or of x, folded), rounded to it, is multiplied by |x| + |mean| (float32 dy
    # of 1e-40 at x = 50: 21 subnormal spacings apart)
    dx_atol = (tol + 3 * at_elements("batch_norm", x64, merged)) * dx_terms
    dx_atol += 4 * (2 + r_at * (1 + xhat)) * r_at * w_at * tiny + (np.abs(x64) + m_at) * tiny
    # dweight: each product dy * (x - mean) rounds to the subnormal spacing at worst, then
    # times r (dy of 1e-45 in float32: BatchNorm's sum came out -3e-45 where the ranks' was
    # the exact 0)
    grad_floor = n_c * tiny * (1 + rstd)  # C
    for step in range(2):
        y_ref, dx_ref, grads_ref, state_ref, _ = want[step]
        y_want, dx_want = to_host(y_ref).reshape(x.shape), to_host(dx_ref).reshape(x.shape)
        for r, result in enumerate(got):
            assert not isinstance(result, BaseException), result
            y, dx, _, state, _ = result[step]
            lo, hi = ends[r], ends[r + 1]
            assert y.shape == y_want[lo:hi].shape and dx.shape == dx_want[lo:hi].shape
            y_bound = y_atol[lo:hi] + tol * np.abs(y_want[lo:hi])
            assert np.all(np.abs(y.astype(np.float64) - y_want[lo:hi]) <= y_bound), "y"
            assert np.all(np.abs(dx.astype(np.float64) - dx_want[lo:hi]) <= dx_atol[lo:hi]), "dx"
            for k in state_ref:  # running stats and counter: the global batch's, on every rank
                assert np.array_equal(state[k], got[0][step][3][k]), f"{k} differs across ranks"
                if k not in ("running_mean", "running_var"):  # the counter, weight and bias
                    assert np.array_equal(state[k], state_ref[k]), k
                    continue
                # new = (1 - m) old + m stat: to its terms (the old buffer, the new) and the
                # statistic's own error: a float32 mean to a rounding of the channel's
                # largest |x|, the variance as above
                old = np.abs((start if step == 0 else want[0][3])[k].astype(np.float64))
                bound = tol * (old + np.abs(state_ref[k].astype(np.float64))) + stat_floor[k] + 2 * tiny
                assert np.all(np.abs(state[k].astype(np.float64) - state_ref[k]) <= bound), k
        for k, g_ref in grads_ref.items():  # dweight/dbias: local sums, summing to BatchNorm's
            total = sum(result[step][2][k].astype(np.float64) for result in got)
            bound = (tol + merged) * dw_terms if k == "weight" else tol * db_terms  # C
            assert np.all(np.abs(total - g_ref) <= bound + grad_floor), k


@settings(max_examples=60)
@given(case=sync_cases(), data=st.data())
def test_drawn_splits_equal_batch_norm_on_the_concatenated_batch(case, data):
    splits, x, dy, dtype, flags, channel = case
    c = x.shape[1]
    bn = npnorm.BatchNorm1d(c, 1e-5, flags["momentum"], flags["affine"], flags["track"], dtype=dtype)
    start = draw_state(data, bn)
    # the running buffers to the size of their channel's data: a buffer of its own size
    # does not hide a wrong batch statistic on a small channel
    for name, power in (("running_mean", 1), ("running_var", 2)):
        if name in start:
            start[name] = (start[name] * channel**power).astype(dtype)
    check_splits(splits, x, dy, dtype, flags, start)


# (splits, x of one channel, dy, dtype, momentum) that the drawn data seldom reaches
SPLITS_AT_THE_EDGES = {
    # a mean 5e4 spreads from 0: the merged variance carries the ranks' means' rounding
    "float64 offset": ([2, 3], [49.999, 49.999, 49.999, 50, 50], [-3, -3, 2, 1, -1], "float64", None),
    # the ranks normalize with the float64 statistics at |mean| r over 4: with the mean
    # rounded to float32, y was 4e-4 off
    "float32 offset": ([2, 2], [999.9, 1000.1, 1000, 999.95], [1, -2, 0.5, 3], "float32", 0.1),
    # dy of subnormal size in float32 (dx's coefficients round to the subnormal spacing)
    "float32 subnormal dy": ([1, 2], [-50, 50, 7], [1e-40, -3e-40, 2.5e-40], "float32", 0.1),
    # and a near-constant channel: rstd 1/sqrt(eps) times dweight's products' rounding
    "float32 subnormal dy, constant x": (
        [2, 2], [1, 1 + 2**-23, 1, 1 + 2**-23], [1e-39, -2e-39, 3e-39, 1e-39], "float32", 0.1,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SPLITS_AT_THE_EDGES))
@pytest.mark.parametrize("family", npnorm.kernels_available())
@pytest.mark.parametrize("affine", [True, False])
def test_splits_at_the_edges_equal_batch_norm_on_the_concatenated_batch(name, family, affine):
    splits, x, dy, dtype, momentum = SPLITS_AT_THE_EDGES[name]
    flags = dict(momentum=momentum, affine=affine, track=True)
    shape = (len(x), 1)
    start = {"running_mean": np.zeros(1, dtype), "running_var": np.ones(1, dtype)}
    start["num_batches_tracked"] = np.asarray(0)
    if affine:
        start["weight"], start["bias"] = np.ones(1, dtype), np.zeros(1, dtype)
    before = npnorm.get_kernels()
    npnorm.set_kernels(family)  # (for the rank threads too)
    try:
        check_splits(
            splits,
            np.reshape(np.array(x, dtype), shape),
            np.reshape(np.array(dy, dtype), shape),
            dtype,
            flags,
            start,
        )
    finally:
        npnorm.set_kernels(before)


@pytest.mark.parametrize("family", npnorm.kernels_available())
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "kw",
    [{}, {"affine": False, "momentum": None}, {"track_running_stats": False}],
    ids=["default", "no affine", "untracked"],
)
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_the_ranks_together_equal_torch_batch_norm_on_the_whole_batch(torch, family, dtype, kw, data):
    """SyncBatchNorm over 3 thread ranks (one empty) against torch.autograd's BatchNorm2d
    on the concatenated batch, in float64 and float32, with each kernel family: two
    training steps, then eval where there are running statistics (without them eval
    uses each rank's own batch, as torch's SyncBatchNorm does). y and dx of every rank,
    the weight and bias gradients summed over ranks, and every rank's buffers. In
    float32 the truth is torch's float64 step on the same values, from npnorm's state."""
    shape, splits = (6, 3, 2, 3), (2, 0, 4)
    ends = np.cumsum([0, *splits])
    values = st.floats(-4, 4, width=32)
    x = data.draw(hnp.arrays(np.float64, shape, elements=values, fill=st.nothing()), label="x") * 3 + 0.5
    dy = data.draw(hnp.arrays(np.float64, shape, elements=values, fill=st.nothing()), label="dy")
    x, dy = x.astype(dtype), dy.astype(dtype)
    state = npnorm.BatchNorm2d(3, **kw, dtype=dtype)
    draw_state(data, state)
    start = {k: np.array(to_host(v)) for k, v in state.state_dict().items()}
    modes = (True, True, False) if kw.get("track_running_stats", True) else (True, True)

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(3, **kw, comm=comm, dtype=dtype)
        m.load_state_dict(start)
        lo, hi = ends[comm.Get_rank()], ends[comm.Get_rank() + 1]
        steps = []
        with npnorm.use_kernels(family):
            for mode in modes:
                m.train(mode)
                m.zero_grad()
                y = m(x[lo:hi])
                dx = m.backward(dy[lo:hi])
                grads = {k: to_host(g).copy() for k, g in m.grads.items()}
                steps.append(
                    (to_host(y), to_host(dx), grads, {k: np.array(v) for k, v in m.state_dict().items()})
                )
        return steps

    got = run_ranks(len(splits), rank_fn)
    for result in got:
        assert not isinstance(result, BaseException), result
    ref = torch.nn.BatchNorm2d(3, **kw, dtype=getattr(torch, dtype))
    load_into_torch(torch, state, ref)

    def run(module, dt):
        xt = torch.tensor(x.astype(np.float64), dtype=dt, requires_grad=True)
        yt = module(xt)
        yt.backward(torch.tensor(dy.astype(np.float64), dtype=dt))
        return yt, xt.grad, dict(module.named_parameters()), module.state_dict()

    for step, mode in enumerate(modes):
        state.train(mode)  # (for gains: npnorm's state before this step)
        ref.train(mode)
        ref.zero_grad()
        ref64 = None
        if dtype == "float32":
            ref64 = copy.deepcopy(ref).double()
            load_into_torch(torch, state, ref64)
            ref64.zero_grad()
        yt, dxt, tparams, tstate = run(ref, getattr(torch, dtype))
        y64, dx64, params64, state64 = run(ref64, torch.float64) if ref64 is not None else (None,) * 4
        y = np.concatenate([result[step][0] for result in got])
        dx = np.concatenate([result[step][1] for result in got])
        close(y, yt, dtype, f"step {step}: output", y64)
        close(
            dx,
            dxt,
            dtype,
            f"step {step}: dx",
            dx64,
            gains(state, x.astype(np.float64), dtype) * float(np.abs(dy).max()),
        )
        for result in got:  # every rank's gradients hold torch's keys
            assert set(result[step][2]) == {k for k, p in tparams.items() if p.grad is not None}
        for k in got[0][step][2]:
            total = sum(result[step][2][k].astype(np.float64) for result in got)
            close(
                total,
                tparams[k].grad,
                dtype,
                f"step {step}: grad {k}",
                params64[k].grad if params64 else None,
            )
        assert set(got[0][step][3]) == set(tstate)
        for k, v in got[0][step][3].items():
            close(v, tstate[k], dtype, f"step {step}: {k}", state64[k] if state64 else None)
            assert all(np.array_equal(result[step][3][k], v) for result in got), f"{k} differs across ranks"
        state.load_state_dict(got[0][step][3])


def test_finite_differences_of_the_loss_over_every_rank():
    # loss = sum over ranks of sum(y_r * dy_r): its derivative in any rank's x (and in the
    # shared weight and bias, summed over ranks) is what the ranks' backward returns
    rng = np.random.default_rng(2)
    splits = np.cumsum([0, 2, 1, 0])
    x, dy = rng.normal(size=(3, 2, 2)) * 2 + 1, rng.normal(size=(3, 2, 2))
    w, b = rng.uniform(0.5, 1.5, 2), rng.normal(size=2)

    def run(x, w, b, backward=False):
        def rank_fn(comm):
            m = npnorm.SyncBatchNorm(2, comm=comm, dtype="float64")
            m.weight, m.bias = w.copy(), b.copy()
            lo, hi = splits[comm.Get_rank()], splits[comm.Get_rank() + 1]
            y = m(x[lo:hi])
            if not backward:
                return float(np.sum(y * dy[lo:hi]))
            return m.backward(dy[lo:hi]), m.grads["weight"], m.grads["bias"]

        return run_ranks(3, rank_fn)

    results = run(x, w, b, backward=True)
    dx = np.concatenate([r[0] for r in results])
    dw, db = sum(r[1] for r in results), sum(r[2] for r in results)
    h = 1e-6

    def numeric(arrays, which, index):
        plus = [a.copy() for a in arrays]
        minus = [a.copy() for a in arrays]
        plus[which][index] += h
        minus[which][index] -= h
        return (sum(run(*plus)) - sum(run(*minus))) / (2 * h)

    for index in np.ndindex(x.shape):
        assert abs(numeric([x, w, b], 0, index) - dx[index]) < 1e-6, index
    for c in range(2):
        assert abs(numeric([x, w, b], 1, c) - dw[c]) < 1e-6
        assert abs(numeric([x, w, b], 2, c) - db[c]) < 1e-6


def test_the_merge_weights_ranks_by_their_counts():
    # rank 0: 1 value (10), rank 1: 3 values (0, 0, 0); the global mean is 2.5, not (10 + 0)/2
    x = [np.full((1, 1), 10.0), np.zeros((3, 1))]

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(1, momentum=1.0, affine=False, comm=comm, dtype="float64")
        m(x[comm.Get_rank()])
        return float(m.running_mean[0]), float(m.running_var[0])

    for mean, var in run_ranks(2, rank_fn):
        assert mean == 2.5
        assert var == np.var([10.0, 0, 0, 0], ddof=1)  # the global count in Bessel's correction


def test_momentum_none_without_a_counter_leaves_the_running_stats_on_every_rank():
    """momentum=None with num_batches_tracked set to None: a factor of 0, as BatchNorm's
    (and torch's); the running statistics stay where they are on every rank. (A mutation
    that took a factor of 1 passed the suite.)"""
    x = [np.array([[1.0, 4.0], [3.0, -2.0]]), np.array([[7.0, 0.5]])]

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(2, momentum=None, comm=comm, dtype="float64")
        m.num_batches_tracked = None
        m.running_mean[...] = [0.25, -3.0]
        m(x[comm.Get_rank()])
        return to_host(m.running_mean), to_host(m.running_var), m.num_batches_tracked

    for mean, var, counter in run_ranks(2, rank_fn):
        np.testing.assert_array_equal(mean, [0.25, -3.0])
        np.testing.assert_array_equal(var, [1.0, 1.0])
        assert counter is None


def test_an_offset_of_1e8_keeps_the_variance():
    # a one-pass sum of squares loses everything here; two-pass and Chan's merge do not
    rng = np.random.default_rng(0)
    parts = [1e8 + rng.normal(size=(k, 2)) for k in (3, 4, 5)]
    whole = np.concatenate(parts)

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(2, momentum=1.0, comm=comm, dtype="float64")
        m(parts[comm.Get_rank()])
        return to_host(m.running_var)

    for var in run_ranks(3, rank_fn):
        np.testing.assert_allclose(var, whole.var(axis=0, ddof=1), rtol=1e-7)


@pytest.mark.parametrize("family", npnorm.kernels_available())
@pytest.mark.parametrize("offset,spread", [(1e4, 0.1), (1e3, 0.01), (100.0, 1e-3)])
def test_float32_with_an_offset_keeps_the_variance(family, offset, spread):
    # each rank's mean was rounded to float32 before the merge squared its distance from
    # the others': running_var was 1.9e-4 to 6e-4 off (torch's float32 BatchNorm 6e-6 to
    # 2e-5); one process's BatchNorm2d 3e-8
    rng = np.random.default_rng(0)
    parts = [(offset + spread * rng.normal(size=(k, 4, 3, 3))).astype(np.float32) for k in (5, 1, 6)]
    whole = np.concatenate(parts).astype(np.float64).transpose(1, 0, 2, 3).reshape(4, -1)

    def rank_fn(comm):
        with npnorm.use_kernels(family):
            m = npnorm.SyncBatchNorm(4, momentum=1.0, comm=comm)
            m(parts[comm.Get_rank()])
        return to_host(m.running_var), to_host(m.running_mean)

    for var, mean in run_ranks(3, rank_fn):
        np.testing.assert_allclose(var, whole.var(axis=1, ddof=1), rtol=2e-7)
        np.testing.assert_allclose(mean, whole.mean(axis=1), rtol=1e-7)


# --- over threads: every error on every rank, nothing changed -------------------------------


def _error_case(name, rank):
    """The input rank ``rank`` passes in error case ``name`` (3 ranks, a module of 3 channels)."""
    good = np.random.default_rng(rank).normal(size=(2, 3, 4))
    if name == "count 1":
        return np.ones((1, 3)) if rank == 1 else np.zeros((0, 3))
    if name == "channels":
        return good[:, :2] if rank == 1 else good
    if name == "dtype":
        return good.astype(np.float32) if rank == 0 else good
    if name == "ndim":
        return good[0, 0] if rank == 2 else good
    if name == "integer":
        return good.astype(np.int64) if rank == 0 else good
    if name == "none":
        return None if rank == 1 else good
    if name == "list":
        return good.tolist() if rank == 2 else good
    return good


ERRORS = {
    "count 1": (ValueError, "got 1 over the 3 ranks (values per channel on each rank: 0, 1, 0)"),
    "channels": (ValueError, "SyncBatchNorm failed on rank 1 of 3: SyncBatchNorm expected 3 channels"),
    "dtype": (ValueError, "different dtypes (rank 0: float32, rank 1: float64, rank 2: float64)"),
    "ndim": (ValueError, "SyncBatchNorm failed on rank 2 of 3: expected at least 2D input (got 1D input"),
    "integer": (TypeError, "SyncBatchNorm failed on rank 0 of 3: input must have a floating dtype"),
    # not an array on one rank: raised there by the checks (IndexError for None), the
    # other ranks waited in the exchange
    "none": (TypeError, "SyncBatchNorm failed on rank 1 of 3: input: expected an array"),
    "list": (TypeError, "SyncBatchNorm failed on rank 2 of 3: input: expected an array"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_every_forward_error_is_raised_on_every_rank_and_changes_nothing(name):
    cls, message = ERRORS[name]

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(3, momentum=None, comm=comm, dtype="float64")
        randomize(m, np.random.default_rng(0))
        m(np.random.default_rng(comm.Get_rank()).normal(size=(2, 3, 4)))  # a good step first
        before, saved = snapshot(m), m._saved
        with pytest.raises(cls) as info:
            m(_error_case(name, comm.Get_rank()))
        assert_state_equal(m, before[0], before[1])
        assert m._saved is saved
        return str(info.value)

    messages = run_ranks(3, rank_fn)
    assert all(isinstance(msg, str) for msg in messages), messages
    assert len(set(messages)) == 1, messages
    assert message in messages[0]


def test_an_empty_batch_on_every_rank_is_batch_norms_empty_batch():
    """No values on any rank: what BatchNorm does with the empty batch, as one rank did
    (empty output and dx, zero parameter gradients, the buffers kept, the batch counted);
    three ranks raised "expected more than 1 value per channel ... got 0 over the 3 ranks"."""
    ref = npnorm.BatchNorm1d(3, dtype="float64")
    randomize(ref, np.random.default_rng(0))
    empty = np.zeros((0, 3, 4))
    y_ref, dx_ref = ref(empty), ref.backward(empty)

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(3, comm=comm, dtype="float64")
        randomize(m, np.random.default_rng(0))
        y, dx = m(empty), m.backward(empty)
        return y.shape, dx.shape, m.state_dict(), m.grads

    for y_shape, dx_shape, state, grads in run_ranks(3, rank_fn):
        assert y_shape == y_ref.shape and dx_shape == dx_ref.shape
        for name, value in ref.state_dict().items():
            np.testing.assert_array_equal(state[name], value, err_msg=name)
        assert set(grads) == set(ref.grads) == {"weight", "bias"}
        for name, g in grads.items():
            np.testing.assert_array_equal(g, ref.grads[name])


def test_a_bad_grad_output_on_one_rank_raises_on_every_rank():
    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(3, comm=comm, dtype="float64")
        x = np.random.default_rng(comm.Get_rank()).normal(size=(2, 3, 4))
        m(x)
        with pytest.raises(ValueError) as info:
            m.backward(x[:, :, :3] if comm.Get_rank() == 2 else x)
        assert m.grads == {}
        dx = m.backward(x)  # the ranks are still in step
        return str(info.value), dx.shape

    results = run_ranks(3, rank_fn)
    assert len({msg for msg, _ in results}) == 1, results
    assert [shape for _, shape in results] == [(2, 3, 4)] * 3, results
    assert "failed on rank 2 of 3: grad_output must have the shape" in results[0][0]


@pytest.mark.parametrize("how", ["load_state_dict", "no_grad", "to", "in place"])
def test_a_saved_forward_lost_on_one_rank_raises_on_every_rank(torch, how):
    """Module.backward's checks of what the forward saved ran before the backward's
    exchange, on one rank alone: a load_state_dict, a forward inside no_grad, a to() or an
    input changed in place on rank 1 raised RuntimeError there, and under MPI the other
    ranks waited in the all-reduce for ever (here the thread ranks are aborted instead).
    Now every rank raises rank 1's RuntimeError and the ranks stay in step."""

    def rank_fn(comm):
        rank = comm.Get_rank()
        m = npnorm.SyncBatchNorm(3, comm=comm, dtype="float64", xp="torch" if how == "in place" else None)
        x = np.random.default_rng(rank).normal(size=(2, 3, 4))
        if how == "in place":
            x = torch.from_numpy(x)
        if how == "no_grad" and rank == 1:
            with npnorm.no_grad():
                m(x)
        else:
            m(x)
        if rank == 1:
            if how == "load_state_dict":
                m.load_state_dict(m.state_dict())
            elif how == "to":
                m.to(dtype="float32")
            elif how == "in place":
                x.add_(1.0)
        with pytest.raises(RuntimeError) as info:
            m.backward(x * 0 + 1)
        assert m.grads == {}
        m.to(dtype="float64")
        x = x * 1.0  # (a fresh input where it was changed in place)
        m(x)
        dx = m.backward(x)  # the ranks are still in step
        return str(info.value), tuple(dx.shape)

    results = run_ranks(3, rank_fn)
    assert all(isinstance(r, tuple) for r in results), results
    assert len(set(results)) == 1, results
    assert "SyncBatchNorm failed on rank 1 of 3: SyncBatchNorm.backward" in results[0][0], results


def _synced_then_eval_on_rank_0(comm, grad: bool):
    """A SyncBatchNorm after a synced training forward on every rank, then an eval forward
    on rank 0 alone (inside no_grad unless ``grad``); returns it and the rank's input."""
    m = npnorm.SyncBatchNorm(3, comm=comm, dtype="float64")
    x = np.random.default_rng(comm.Get_rank()).normal(size=(2, 3, 4))
    m(x)
    if comm.Get_rank() == 0:
        m.eval()
        with contextlib.nullcontext() if grad else npnorm.no_grad():
            m(x)
        m.train()
    return m, x


@pytest.mark.parametrize("grad", [True, False])
def test_an_eval_forward_on_one_rank_before_the_synced_backward_raises_on_every_rank(grad):
    """An eval forward on rank 0 alone (which the README allows: no collective call) between
    the synced training forward and its backward: rank 0's backward was then the eval
    forward's, local (or, after an eval forward inside no_grad, a RuntimeError there alone),
    and the other ranks waited in the backward's exchange for ever. Now every rank raises,
    and the ranks stay in step."""

    def rank_fn(comm):
        m, x = _synced_then_eval_on_rank_0(comm, grad)
        with pytest.raises(RuntimeError) as info:
            m.backward(np.ones_like(x))
        assert m.grads == {}
        m(x)
        return str(info.value), tuple(m.backward(np.ones_like(x)).shape)  # in step

    results = run_ranks(3, rank_fn)
    assert all(isinstance(r, tuple) for r in results), results
    assert len(set(results)) == 1, results
    expected = "did not sync" if grad else "no saved forward"
    assert "SyncBatchNorm failed on rank 0 of 3: SyncBatchNorm.backward" in results[0][0], results
    assert expected in results[0][0], results


@pytest.mark.parametrize("step_between", [True, False])
def test_after_a_backward_that_failed_on_every_rank_nothing_is_pending(step_between):
    """The collective failure above left the synced backward "pending" on every rank: the
    next eval forward and backward on one rank alone joined an exchange no other rank
    entered (a hang; here the stand-in's barrier breaks). With ``step_between`` a synced
    step whose backward fails in the exchange runs first; without it, rank 0's eval step
    follows the failure at once (the synced step clears what the failure left pending:
    a mutation that kept it passed the case with the step alone)."""

    def rank_fn(comm):
        rank = comm.Get_rank()
        m, x = _synced_then_eval_on_rank_0(comm, True)
        with pytest.raises(RuntimeError, match="did not sync"):
            m.backward(np.ones_like(x))
        if step_between:
            m(x)
            with pytest.raises(ValueError, match="grad_output must have the shape"):  # fails in the exchange
                m.backward(np.ones((1, 3, 4)) if rank == 1 else np.ones_like(x))
        if rank != 0:
            return None
        m.eval()
        m(x)
        return tuple(m.backward(np.ones_like(x)).shape)  # rank 0's own

    assert run_ranks(3, rank_fn) == [(2, 3, 4), None, None]


def test_buffers_made_in_inference_mode_on_one_rank_raise_on_every_rank(torch):
    """The refusal of inference-mode buffers ran after the ranks' exchange, on their rank
    alone: the other ranks updated their running statistics and counter."""

    def rank_fn(comm):
        with torch.inference_mode() if comm.Get_rank() == 0 else contextlib.nullcontext():
            m = npnorm.SyncBatchNorm(3, comm=comm, xp="torch", dtype="float64")
        with pytest.raises(RuntimeError, match="failed on rank 0 of 2: Inplace update to inference tensor"):
            m(torch.randn(2, 3, 4, dtype=torch.float64))
        return int(m.num_batches_tracked), m.running_mean.tolist()

    assert run_ranks(2, rank_fn) == [(0, [0.0] * 3)] * 2


def test_an_eval_forward_and_backward_on_one_rank_after_a_finished_step_is_its_own():
    """The other side of the test above: once the synced backward ran (or the training
    forward ran inside no_grad, as a recalibration of the running statistics does), an
    eval forward and backward on one rank alone are that rank's own, with no exchange."""

    def rank_fn(comm):
        rank = comm.Get_rank()
        x = np.random.default_rng(rank).normal(size=(2, 3, 4))
        trained = npnorm.SyncBatchNorm(3, comm=comm, dtype="float64")
        trained(x)
        trained.backward(np.ones_like(x))
        recalibrated = npnorm.SyncBatchNorm(3, comm=comm, dtype="float64")
        with npnorm.no_grad():
            recalibrated(x)
        if rank != 0:
            return None
        shapes = []
        for m in (trained, recalibrated):
            m.eval()
            m(x)
            shapes.append(tuple(m.backward(np.ones_like(x)).shape))  # would wait for ranks 1, 2
        return shapes

    assert run_ranks(3, rank_fn) == [[(2, 3, 4)] * 2, None, None]


def test_a_backward_on_one_rank_of_a_module_that_never_synced_raises_there_alone():
    """A module that ran no synced forward (new, unpickled, copied) has no backward the
    other ranks take part in: its backward raises at once on that rank, which joined an
    all-reduce that no other rank entered (a hang) in the first version of the fix."""
    import pickle

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(3, comm=comm)
        m(np.random.default_rng(comm.Get_rank()).normal(size=(2, 3)))
        if comm.Get_rank() == 0:
            for lone in (npnorm.SyncBatchNorm(3, comm=comm), pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
                lone.comm = comm
                with pytest.raises(RuntimeError, match="no saved forward"):
                    lone.backward(np.ones((2, 3)))
        return m.backward(np.ones((2, 3))).shape  # the ranks are still in step

    assert run_ranks(3, rank_fn) == [(2, 3)] * 3


def test_the_failure_exchange_takes_the_inputs_channel_count():
    """Without per-channel arrays a module syncs input of any C: the failing rank sent
    2 + 2 * num_features numbers where the others sent 2 + 2C (MPI: "Message truncated"
    on that rank, the others waiting)."""

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(3, affine=False, track_running_stats=False, comm=comm)
        x = np.random.default_rng(comm.Get_rank()).normal(size=(4, 5, 2))
        m(x)
        if comm.Get_rank() == 0:
            m.to(dtype="float64")  # drops what the forward saved
        with pytest.raises(RuntimeError, match=r"failed on rank 0 of 3: SyncBatchNorm\.backward"):
            m.backward(np.ones_like(x))
        return True

    assert run_ranks(3, rank_fn) == [True] * 3


def test_no_forward_on_any_rank_raises_on_each_rank_as_on_one_process():
    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(3, comm=comm)
        with pytest.raises(RuntimeError) as info:
            m.backward(np.ones((2, 3)))
        return str(info.value)

    results = run_ranks(2, rank_fn)
    local = "SyncBatchNorm.backward() called with no saved forward"
    assert all(isinstance(r, str) and r.startswith(local) for r in results), results


def test_a_missing_argument_on_one_rank_raises_on_every_rank():
    def rank_fn(comm):
        rank = comm.Get_rank()
        x = np.random.default_rng(rank).normal(size=(2, 3, 4))
        with pytest.raises(TypeError) as forward:
            F.sync_batch_norm_forward(None if rank == 1 else x, None, None, training=True, comm=comm)
        y, mean, rstd, _, _ = F.sync_batch_norm_forward(x, None, None, training=True, comm=comm)
        with pytest.raises(TypeError) as backward:
            F.sync_batch_norm_backward(None if rank == 2 else y, x, mean, rstd, training=True, comm=comm)
        m = npnorm.SyncBatchNorm(3, comm=comm, dtype="float64")
        m(x)
        with pytest.raises(TypeError) as module:
            m.backward(None if rank == 0 else y)
        return str(forward.value), str(backward.value), str(module.value)

    results = run_ranks(3, rank_fn)
    assert all(isinstance(r, tuple) for r in results), results
    assert len(set(results)) == 1, results
    forward, backward, module = results[0]
    assert "sync_batch_norm failed on rank 1 of 3: input: expected an array" in forward
    assert "sync_batch_norm failed on rank 2 of 3: grad_output: expected an array" in backward
    assert "SyncBatchNorm failed on rank 0 of 3: grad_output: expected an array" in module


def test_statistics_of_another_length_on_one_rank_raise_on_every_rank():
    # the backward's payload was sized from mean: under MPI the ranks' all-reduce buffers
    # then differed, and MPI aborted the job ("Message truncated")
    def rank_fn(comm):
        rank = comm.Get_rank()
        x = np.random.default_rng(rank).normal(size=(2, 3, 4))
        y, mean, rstd, _, _ = F.sync_batch_norm_forward(x, None, None, training=True, comm=comm)
        if rank == 1:
            mean, rstd = np.ones(4), np.ones(4)
        with pytest.raises(ValueError) as info:
            F.sync_batch_norm_backward(y, x, mean, rstd, training=True, comm=comm)
        return str(info.value)

    messages = run_ranks(3, rank_fn)
    assert all(isinstance(m, str) for m in messages), messages
    assert len(set(messages)) == 1 and "failed on rank 1 of 3: mean must have shape (3,)" in messages[0]


def test_run_ranks_reports_each_ranks_own_error():
    # every rank raises after a collective all of them completed: each reports its own
    # error (threading.Barrier.abort broke the barrier the slower ranks were leaving)
    def rank_fn(comm):
        comm.allgather(comm.Get_rank())
        raise KeyError(comm.Get_rank())

    for _ in range(5):
        assert [repr(r) for r in run_ranks(3, rank_fn)] == [repr(KeyError(r)) for r in range(3)]


def test_a_thread_barrier_once_broken_stays_broken():
    # as threading.Barrier: the waits that raised were counted as arrivals, so that the
    # third wait of a group of 3 after abort() passed
    from npnorm._threadcomm import _Group

    group = _Group(3)
    group.abort()
    for _ in range(4):
        with pytest.raises(threading.BrokenBarrierError):
            group.wait()


def test_torch_tensors_that_require_grad_leave_no_history_across_ranks(torch):
    # the synced path called its kernels directly, not through the dispatcher that detaches
    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(3, comm=comm, xp="torch", dtype="float64")
        x = torch.randn(2 + comm.Get_rank(), 3, 4, dtype=torch.float64, requires_grad=True)
        history = []
        for _ in range(2):
            y = m(x)
            dx = m.backward(torch.ones_like(y, requires_grad=True))
            history += [t.requires_grad for t in (y, dx, m.running_mean, *m.grads.values())]
        return history

    # and each synced forward warns that it runs outside autograd, as on one rank (it said
    # nothing across ranks: its kernels are not called through the dispatcher)
    with pytest.warns(
        UserWarning, match="sync_batch_norm_forward ran on torch tensors that require grad"
    ) as said:
        results = run_ranks(2, rank_fn)
    for history in results:
        assert history == [False] * len(history)
    assert len([w for w in said if "outside torch's autograd" in str(w.message)]) == 4  # 2 ranks, 2 steps


def test_run_ranks_stops_ranks_waiting_for_a_failed_one():
    def rank_fn(comm):
        if comm.Get_rank() == 1:
            raise KeyError("gone")
        comm.allgather(0)

    results = run_ranks(3, rank_fn)
    assert isinstance(results[1], KeyError)
    assert all(isinstance(results[r], threading.BrokenBarrierError) for r in (0, 2)), results


def test_functional_errors_across_ranks():
    def rank_fn(comm):
        rank = comm.Get_rank()
        x = np.ones((2, 2 if rank == 2 else 3))
        with pytest.raises(ValueError) as channels:
            F.sync_batch_norm_forward(x, None, None, training=True, comm=comm)
        with pytest.raises(ValueError) as eps:
            F.sync_batch_norm_forward(
                np.ones((2, 3)), None, None, training=True, eps=-1.0 if rank else 1.0, comm=comm
            )
        return str(channels.value), str(eps.value)

    results = run_ranks(3, rank_fn)
    assert len(set(results)) == 1, results
    assert "different numbers of channels (rank 0: 3, rank 1: 3, rank 2: 2)" in results[0][0]
    assert "failed on rank 1 of 3: eps must be a non-negative number" in results[0][1]
    assert "(rank(s) 2 failed too)" in results[0][1]


# --- no collective call in eval or on one rank ----------------------------------------------


class NoCollectives:
    """A communicator of ``size`` ranks on which any collective call fails the test."""

    def __init__(self, size: int) -> None:
        self.size = size

    def Get_size(self) -> int:
        return self.size

    def Get_rank(self) -> int:
        return 0

    def Is_inter(self) -> bool:
        return False

    def _fail(self, *args):
        raise AssertionError("a collective call was made")

    Allgather = Allreduce = allgather = _fail


@pytest.mark.parametrize("track", [True, False])
def test_eval_makes_no_collective_call_and_equals_batch_norm(rng, track):
    m = npnorm.SyncBatchNorm(3, track_running_stats=track, comm=NoCollectives(3), dtype="float64")
    ref = npnorm.BatchNorm2d(3, track_running_stats=track, dtype="float64")
    randomize(ref, rng)
    m.load_state_dict(ref.state_dict())
    m.eval()
    ref.eval()
    x, dy = rng.normal(size=(2, 3, 2, 2)), rng.normal(size=(2, 3, 2, 2))
    assert np.array_equal(m(x), ref(x))  # without running stats: the local batch's statistics
    assert np.array_equal(m.backward(dy), ref.backward(dy))
    assert_state_equal(m, ref.state_dict(), ref.grads)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_one_rank_is_batch_norm_bitwise_with_no_collective_call(rng, momentum):
    m = npnorm.SyncBatchNorm(4, momentum=momentum, comm=NoCollectives(1))
    ref = npnorm.BatchNorm3d(4, momentum=momentum)
    for _ in range(3):
        x = rng.normal(size=(2, 4, 2, 1, 3)).astype(np.float32)
        dy = rng.normal(size=x.shape).astype(np.float32)
        assert np.array_equal(m(x), ref(x))
        assert np.array_equal(m.backward(dy), ref.backward(dy))
    assert_state_equal(m, ref.state_dict(), ref.grads)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        m(np.ones((1, 4)))
    dx = F.sync_batch_norm_backward(
        x, x, m._saved[1], m._saved[2], m.weight, m.bias, True, comm=NoCollectives(1)
    )
    assert np.array_equal(
        dx[0], F.batch_norm_backward(x, x, m._saved[1], m._saved[2], m.weight, m.bias, True)[0]
    )
    # the functional forward too: batch_norm_forward's five results, bitwise, the running
    # statistics moved in training (as the module's are: it has its own one-rank path)
    rm, rv = np.full(4, 0.5, np.float32), np.full(4, 2.0, np.float32)
    got = F.sync_batch_norm_forward(x, rm, rv, m.weight, m.bias, True, 0.3, comm=NoCollectives(1))
    want = F.batch_norm_forward(x, rm, rv, m.weight, m.bias, True, 0.3)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert not np.array_equal(got[3], rm)


@pytest.mark.parametrize("backend", ["array_api_strict", "cupy"], indirect=True)
@pytest.mark.parametrize(
    ("shape", "sizes", "dtype", "momentum"),
    [((2, 3), (3, 0, 2), "float64", 0.1), ((2, 40), (1, 4, 2), "float32", None)],
)
def test_other_backends_over_threads(backend, shape, sizes, dtype, momentum):
    """SyncBatchNorm on array_api_strict and (with a GPU) CuPy, ranks as threads: each
    rank's y and dx are BatchNorm's on the whole batch (one rank empty in the first
    case), and every rank's running statistics are BatchNorm's."""
    rng = np.random.default_rng(5)
    n = sum(sizes)
    x, dy = rng.normal(size=(n, *shape)), rng.normal(size=(n, *shape))
    ref = npnorm.BatchNorm1d(shape[0], momentum=momentum, dtype="float64")
    y_ref, dx_ref = ref(x), ref.backward(dy)
    splits = np.cumsum([0, *sizes])
    tol = 1e-12 if dtype == "float64" else 2e-5

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(shape[0], momentum=momentum, comm=comm, dtype=dtype, xp=backend.name)
        lo, hi = splits[comm.Get_rank()], splits[comm.Get_rank() + 1]
        y = m(backend.asarray(x[lo:hi], dtype))
        dx = m.backward(backend.asarray(dy[lo:hi], dtype))
        return to_host(y), to_host(dx), to_host(m.running_mean), to_host(m.running_var)

    for r, (y, dx, mean, var) in enumerate(run_ranks(len(sizes), rank_fn)):
        lo, hi = splits[r], splits[r + 1]
        np.testing.assert_allclose(y, y_ref[lo:hi], rtol=tol, atol=tol)
        np.testing.assert_allclose(dx, dx_ref[lo:hi], rtol=tol, atol=tol)
        np.testing.assert_allclose(mean, ref.running_mean, rtol=tol, atol=tol)
        np.testing.assert_allclose(var, ref.running_var, rtol=tol)


# --- the module: construction, conversion, copies ---------------------------------------------


def test_import_npnorm_and_eval_do_not_import_mpi4py():
    code = (
        "import sys, numpy as np, npnorm, npnorm.functional, npnorm.modules\n"
        "m = npnorm.SyncBatchNorm(3).eval()\n"
        "m(np.ones((2, 3, 4), dtype=np.float32))\n"
        "t = npnorm.SyncBatchNorm(3)  # training: a backward with nothing saved raises alone\n"
        "try:\n"
        "    t.backward(np.ones((2, 3)))\n"
        "except RuntimeError as err:\n"
        "    assert 'no saved forward' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('backward with nothing saved returned')\n"
        "assert 'mpi4py' not in sys.modules, 'mpi4py was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_training_without_mpi4py_says_what_to_install():
    code = (
        "import sys, numpy as np\n"
        "sys.modules['mpi4py'] = None  # as if not installed\n"
        "import npnorm\n"
        "m = npnorm.SyncBatchNorm(3)\n"
        "try:\n"
        "    m(np.ones((2, 3), dtype=np.float32))\n"
        "except ImportError as err:\n"
        "    assert \"pip install 'npnorm[mpi]'\" in str(err), err\n"
        "    assert int(m.num_batches_tracked) == 0\n"
        "else:\n"
        "    raise AssertionError('no ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_same_state_dict_keys_as_batch_norm_and_any_trailing_axes():
    for affine in (True, False):
        for track in (True, False):
            m = npnorm.SyncBatchNorm(3, affine=affine, track_running_stats=track)
            ref = npnorm.BatchNorm2d(3, affine=affine, track_running_stats=track)
            assert list(m.state_dict()) == list(ref.state_dict())
    m = npnorm.SyncBatchNorm(2, comm=NoCollectives(1), dtype="float64")
    for shape in [(3, 2), (3, 2, 2), (2, 2, 1, 2, 2, 2)]:
        assert m(np.random.default_rng(0).normal(size=shape)).shape == shape
    with pytest.raises(ValueError, match="expected at least 2D input"):
        m(np.ones(2))


def test_comm_must_be_an_intracommunicator():
    with pytest.raises(TypeError, match="mpi4py intracommunicator"):
        npnorm.SyncBatchNorm(3, comm=object())

    class Inter(NoCollectives):
        def Is_inter(self) -> bool:
            return True

    with pytest.raises(TypeError, match="intercommunicator"):
        npnorm.SyncBatchNorm(3, comm=Inter(2))

    class SizeAndRankOnly:  # what a hand-rolled stand-in may offer: no collectives
        def Get_size(self) -> int:
            return 2

        def Get_rank(self) -> int:
            return 0

    with pytest.raises(TypeError, match="got SizeAndRankOnly without Allgather, Allreduce, allgather"):
        npnorm.SyncBatchNorm(3, comm=SizeAndRankOnly())


def test_the_functional_pair_and_a_reassigned_comm_are_checked_as_the_constructor_checks():
    """Only the constructor checked ``comm``: the functional pair took an intercommunicator
    (its ranks then waited for ever, or normalized a slice alone) and a string
    (AttributeError: no Get_size), and ``m.comm = "world"`` failed at the next training
    step with that AttributeError."""

    class Inter(NoCollectives):
        def Is_inter(self) -> bool:
            return True

    x = np.random.default_rng(0).normal(size=(4, 3, 2))
    ones = np.ones(3)
    for bad, match in (("world", "mpi4py intracommunicator"), (Inter(2), "intercommunicator")):
        for training in (True, False):
            with pytest.raises(TypeError, match=match):
                F.sync_batch_norm_forward(x, None if training else ones, ones, training=training, comm=bad)
            with pytest.raises(TypeError, match=match):
                F.sync_batch_norm_backward(x, x, ones, ones, training=training, comm=bad)
        m = npnorm.SyncBatchNorm(3, dtype="float64")
        m.comm = bad
        before = snapshot(m)
        with pytest.raises(TypeError, match=match):
            m(x)
        assert_state_equal(m, *before)


@pytest.mark.parametrize("cls,shape", [(npnorm.BatchNorm1d, (4, 3)), (npnorm.BatchNorm2d, (2, 3, 2, 2))])
def test_convert_sync_batchnorm_keeps_configuration_state_and_mode(rng, cls, shape):
    bn = cls(3, eps=1e-3, momentum=None, affine=True, track_running_stats=True, dtype="float64")
    randomize(bn, rng)
    bn(rng.normal(size=shape))
    bn.backward(rng.normal(size=shape))
    bn.eval()
    comm = NoCollectives(1)
    sync = npnorm.SyncBatchNorm.convert_sync_batchnorm(bn, comm)
    assert isinstance(sync, npnorm.SyncBatchNorm) and sync.comm is comm
    assert (sync.num_features, sync.eps, sync.momentum, sync.affine, sync.track_running_stats) == (
        3, 1e-3, None, True, True,
    )  # fmt: skip
    assert sync.dtype == bn.dtype and sync.xp is bn.xp and sync.training is False
    assert_state_equal(sync, bn.state_dict(), bn.grads)
    assert sync.weight is bn.weight  # the same arrays, as torch's conversion shares its Parameters
    x = rng.normal(size=shape)
    assert np.array_equal(sync(x), bn(x))
    no_affine = npnorm.SyncBatchNorm.convert_sync_batchnorm(
        npnorm.BatchNorm1d(2, affine=False, track_running_stats=False)
    )
    assert no_affine.weight is None and no_affine.running_mean is None and no_affine.comm is None
    ln = npnorm.LayerNorm(3)
    assert npnorm.SyncBatchNorm.convert_sync_batchnorm(ln) is ln
    inorm = npnorm.InstanceNorm1d(3)
    assert npnorm.SyncBatchNorm.convert_sync_batchnorm(inorm) is inorm


class _Model:
    """A model of the caller's own, holding a BatchNorm."""

    def __init__(self) -> None:
        self.bn = npnorm.BatchNorm1d(3)


@pytest.mark.parametrize(
    "make, hint",
    [
        (_Model, "npnorm modules do not nest: convert each BatchNorm of a model and assign it back"),
        (lambda: [npnorm.BatchNorm1d(3)], "convert each BatchNorm"),
        (lambda: None, "convert each BatchNorm"),
    ],
)
def test_convert_sync_batchnorm_refuses_what_is_not_an_npnorm_module(make, hint):
    """npnorm modules do not nest, so a model is not walked as torch's is: a model, a list
    or None is a TypeError that says to convert each layer (it came back unconverted,
    and every rank trained on its own batch's statistics)."""
    with pytest.raises(TypeError, match="converts an npnorm BatchNorm1d/2d/3d module, got ") as info:
        npnorm.SyncBatchNorm.convert_sync_batchnorm(make())
    assert hint in str(info.value)


def test_convert_sync_batchnorm_of_a_torch_module_says_how_to_convert_it(torch):
    """A torch layer or a torch model of the user's own (any torch.nn.Module) is told of
    torch's own conversion and of npnorm.from_torch."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(3)

    for module in (torch.nn.BatchNorm1d(3), Net()):
        with pytest.raises(TypeError, match=r"torch's own torch\.nn\.SyncBatchNorm\.convert_sync_batchnorm"):
            npnorm.SyncBatchNorm.convert_sync_batchnorm(module)


def test_copies_share_the_communicator_and_pickles_drop_it(rng):
    comm = NoCollectives(1)
    m = npnorm.SyncBatchNorm(3, comm=comm, dtype="float64")
    randomize(m, rng)
    for copied in (copy.copy(m), copy.deepcopy(m)):  # arrays copied, as for every Module
        assert copied.comm is comm and not np.shares_memory(copied.weight, m.weight)
        assert_state_equal(copied, m.state_dict())
    deep = copy.deepcopy(m)
    assert_state_equal(deep, m.state_dict())
    state = m.__getstate__()  # what pickle stores
    assert state["comm"] is None and m.comm is comm
    restored = npnorm.SyncBatchNorm.__new__(npnorm.SyncBatchNorm)
    restored.__setstate__(state)
    assert restored.comm is None  # falls back to the default communicator, resolved at use
    assert_state_equal(restored, m.state_dict())


def test_thread_comm_is_a_faithful_stand_in():
    # the stand-in's collectives: rank order, every rank the same result
    def rank_fn(comm: ThreadComm):
        r = comm.Get_rank()
        out = np.empty((3, 2))
        comm.Allgather(np.array([r, 10.0 * r]), out)
        total = np.empty(2)
        comm.Allreduce(np.array([1.0, r]), total)
        return out, total, comm.allgather(r), comm

    results = run_ranks(3, rank_fn)
    for out, total, objs, _ in results:
        assert np.array_equal(out, [[0, 0], [1, 10], [2, 20]])
        assert np.array_equal(total, [3, 3]) and objs == [0, 1, 2]
    # the record of what each rank sent, in rank order, once per collective call
    log = results[0][3].log
    assert [e.kind for e in log] == ["Allgather", "Allreduce", "allgather"] and results[0][3].collectives == 3
    assert [list(a) for a in log[1].sent] == [[1, 0], [1, 1], [1, 2]] and log[2].sent == [0, 1, 2]


# --- the fast NumPy kernels against the generic ones ------------------------------------------


@settings(max_examples=160)  # (each spread ~80)
@given(
    shape=hnp.array_shapes(min_dims=2, max_dims=5, min_side=1, max_side=5),
    dtype=st.sampled_from(["float16", "float32", "float64"]),
    layout=st.sampled_from(LAYOUTS),
    weight=st.booleans(),
    offset=st.sampled_from([0.0, 1e3]),  # 1e3: the mean is not folded into the sums
    spread=st.sampled_from([1.0, 1e-3]),  # 1e-3: rstd ~300, a mean near 0 still folded
    block_bytes=st.sampled_from([None, 64]),
    threads=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_fast_kernels_match_generic(shape, dtype, layout, weight, offset, spread, block_bytes, threads, data):
    c = shape[1]
    ct = np.dtype(np.result_type(np.float32, dtype))
    values = st.floats(-4, 4, width=16)  # exact in every dtype
    x = data.draw(hnp.arrays(np.float64, shape, elements=values), label="x")  # (times a spread
    # of 1e-3 they are not, but both kernels take x as cast to the dtype)
    x = laid_out((x * spread + offset).astype(dtype), layout)
    dy = laid_out(data.draw(hnp.arrays(dtype, shape, elements=values), label="dy"), layout)
    w = data.draw(hnp.arrays(dtype, c, elements=st.floats(0.5, 1.5, width=16)), label="w") if weight else None
    mean, var = generic_kernel("sync_batch_norm_moments")(xp, x, ct)
    rstd = (1.0 / np.sqrt(var + 1e-5)).astype(ct)
    mean_dy = data.draw(hnp.arrays(ct, c, elements=values), label="mean_dy")
    mean_dyxc = data.draw(hnp.arrays(ct, c, elements=values), label="mean_dyxc")
    tol = {"float64": 1e-11, "float32": 2e-5}[ct.name]
    n_values = x.size // c
    sums = generic_kernel("sync_batch_norm_grad_sums")(xp, dy, x, mean, rstd, ct)
    # mean(x - mean) as the ranks' sums give it (the mean's rounding): the generic kernel
    # always centres on it, the fast one where the mean is far from 0 (as BatchNorm's)
    mean_xc = (sums[2].astype(np.float64) / n_values).astype(ct)
    with config(threads, block_bytes):
        fast = (
            family_kernel("sync_batch_norm_moments", "numpy")(xp, x, ct),
            family_kernel("sync_batch_norm_grad_sums", "numpy")(xp, dy, x, mean, rstd, ct),
            family_kernel("sync_batch_norm_dx", "numpy")(
                xp, dy, x, mean, rstd, w, mean_dy, mean_dyxc, mean_xc
            ),
        )
    ref = (
        (mean, var),
        sums,
        generic_kernel("sync_batch_norm_dx")(xp, dy, x, mean, rstd, w, mean_dy, mean_dyxc, mean_xc),
    )
    x_max = float(np.max(np.abs(x.astype(np.float64))))
    centred = np.moveaxis(x.astype(np.float64), 1, -1) - mean.astype(np.float64)  # ...,C
    xc_max = float(np.max(np.abs(centred)))  # the spread, without the offset
    dy_max = float(np.max(np.abs(dy.astype(np.float64))))
    # the variance of values a few ulps apart (a spread of 1e-3 on an offset, or a constant
    # 0.001 whose mean rounds) is the square of the mean's rounding, either kernel's: up to
    # an ulp an addend, of float64 (both kernels' moments; eps of a float32 ct let a
    # variance 0.2% off pass)
    mean_rounding = (1 + n_values) * float(np.finfo(np.float64).eps) * x_max
    # sum(dy), sum(dy*(x - mean)), sum(x - mean)
    sum_scales = n_values * np.array([dy_max, dy_max * xc_max, xc_max])
    atols = (
        (tol * 5 * x_max, tol * 5 * xc_max**2 + mean_rounding**2),  # mean (rounds with |x|), var
        tol * 5 * sum_scales,
    )
    for (got_pair, want_pair), pair_atols in zip(zip(fast[:2], ref[:2], strict=True), atols, strict=True):
        for got, want, atol in zip(got_pair, want_pair, pair_atols, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape == (c,)
            np.testing.assert_allclose(got, want, rtol=tol, atol=atol)
    # dx = a*(dy - mean_dy) + b*(x - mean - xi), a = r*w, b = -r^3*w*mean_dyxc, xi = mean_xc
    # (where the kernel centres again): each element's rounding goes with its own terms on
    # its own channel (a bound from the largest term of all let a wrong dx pass on a channel
    # whose terms are small)
    r = np.reshape(rstd.astype(np.float64), (1, c) + (1,) * (len(shape) - 2))
    w64 = parameter_at("batch_norm", x, w)  # (1 without a weight)

    def per_channel(v: np.ndarray) -> np.ndarray:  # |v| along the channel axis
        return parameter_at("batch_norm", x, v)

    xc = np.abs(x.astype(np.float64) - np.reshape(mean.astype(np.float64), r.shape))
    dy64 = np.abs(dy.astype(np.float64))
    terms = (
        r * w64 * (dy64 + per_channel(mean_dy) + r * r * per_channel(mean_dyxc) * (xc + per_channel(mean_xc)))
    )
    # where every mean is within FOLD_LIMIT deviations of 0 (by rstd, as the kernel asks), the
    # kernel folds the mean into its constant, b*x - b*mean, whose few roundings go with
    # |b*mean| on that channel (a channel of one value, x = mean, var 0, rstd 1/sqrt(eps),
    # gave 4.5e-13 where x - mean first gives 0), and does not centre again: b*xi, the
    # mean's rounding times b, is the generic kernel's alone (a constant channel of 100
    # values 0.0039 gave 3e-10)
    folded = 0.0
    if numpy_fast_channels._foldable(mean.astype(ct), rstd.astype(ct)):
        b = r**3 * w64 * per_channel(mean_dyxc)  # |b| per channel
        folded = b * (8 * float(np.finfo(ct).eps) * per_channel(mean.astype(ct)) + per_channel(mean_xc))
    assert fast[2].dtype == ref[2].dtype == np.dtype(dtype) and fast[2].shape == shape
    # dx of channels-last input and gradient is channels-last (as BatchNorm's), else C-ordered
    last = len(shape) > 2 and all(np.moveaxis(a, 1, -1).flags.c_contiguous for a in (x, dy))
    assert np.moveaxis(fast[2], 1, -1).flags.c_contiguous if last else fast[2].flags.c_contiguous
    rounding = 2 * float(np.finfo(dtype).eps) * np.abs(ref[2].astype(np.float64))
    atol = tol * 8 * terms + rounding + folded
    got, want = fast[2].astype(np.float64), ref[2].astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf where both overflow the dtype (float16)
        assert np.all((np.abs(got - want) <= atol) | (got == want)), "dx"


def test_without_per_channel_arrays_every_rank_takes_another_channel_count():
    # as BatchNorm (and PyTorch, which checks only those arrays' lengths): the synced path
    # refused what one rank and eval took
    x = np.random.default_rng(0).normal(size=(4, 5, 3))

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(3, affine=False, track_running_stats=False, comm=comm, dtype="float64")
        return m(x)

    whole = npnorm.BatchNorm1d(3, affine=False, track_running_stats=False, dtype="float64")(
        np.concatenate([x, x])
    )
    for y in run_ranks(2, rank_fn):
        np.testing.assert_allclose(y, whole[:4], rtol=1e-12, atol=1e-12)

    def with_weight(comm):
        with pytest.raises(ValueError, match="expected 3 channels"):
            npnorm.SyncBatchNorm(3, comm=comm)(x)
        return "refused"

    assert (
        run_ranks(2, with_weight) == ["refused"] * 2
    )  # (a rank's exception is its result: unchecked before)


@pytest.mark.parametrize("offset,spread", [(1e3, 1.0), (1e4, 0.1), (1e3, 1e-3)])
def test_float32_with_a_large_offset_is_as_accurate_as_batch_norm(offset, spread):
    # the global mean was rounded to float32 before normalizing: 3e-3 off at offset 1e4,
    # spread 0.1, where BatchNorm on the whole batch is 2e-7 off
    rng = np.random.default_rng(0)
    parts = [(rng.normal(size=(n, 3, 4)) * spread + offset).astype(np.float32) for n in (5, 3, 4)]
    whole = np.concatenate(parts)
    truth = npnorm.BatchNorm1d(3, dtype="float64")(whole.astype(np.float64))
    bn = npnorm.BatchNorm1d(3)(whole)

    def rank_fn(comm):
        return npnorm.SyncBatchNorm(3, comm=comm)(parts[comm.Get_rank()])

    ours = np.concatenate(run_ranks(3, rank_fn))
    err = np.abs(ours - truth).max()
    assert err <= max(3e-7, 2 * np.abs(bn - truth).max()), err


def _dx_by_module(m, x, dy):
    m(x)
    return m.backward(dy)


def _sync_dx(family, x, dy, split):
    """SyncBatchNorm's dx over ranks holding ``split`` samples each, concatenated."""

    def rank_fn(comm):
        part = slice(sum(split[: comm.Get_rank()]), sum(split[: comm.Get_rank() + 1]))
        with npnorm.use_kernels(family):
            return _dx_by_module(npnorm.SyncBatchNorm(x.shape[1], comm=comm), x[part], dy[part])

    return np.concatenate(run_ranks(len(split), rank_fn))


@pytest.mark.parametrize("family", npnorm.kernels_available())
@pytest.mark.parametrize("offset,spread", [(1e3, 1.0), (1e4, 0.1), (1e3, 1e-3)])
@pytest.mark.parametrize("dy_offset", [0.0, 1e3])
def test_float32_backward_with_a_large_offset_is_as_accurate_as_batch_norm(family, offset, spread, dy_offset):
    # the backward did not centre xhat again on what the global mean's rounding to float32
    # left, as BatchNorm's does: dx was as far off as PyTorch's (2e-4 of its scale at offset
    # 1e3 and spread 1e-3; 1.3 with a common part of 1e3 in dy); the sums crossed the ranks
    # rounded to float32, which cost the centring 4 times BatchNorm's error with that dy
    rng = np.random.default_rng(1)
    shape = (12, 4, 3, 3)
    x = (rng.normal(size=shape) * spread + offset).astype(np.float32)
    dy = (rng.normal(size=shape) + dy_offset).astype(np.float32)
    truth = _dx_by_module(npnorm.BatchNorm2d(4, dtype="float64"), x.astype(np.float64), dy.astype(np.float64))
    # under "numba", SyncBatchNorm's per-rank steps are the "numpy" family's (README)
    with npnorm.use_kernels("numpy" if family == "numba" else family):
        bn = _dx_by_module(npnorm.BatchNorm2d(4), x, dy)
    ours = _sync_dx(family, x, dy, (5, 0, 7))  # an empty rank too
    scale = np.abs(truth).max()
    err, bn_err = np.abs(ours - truth).max() / scale, np.abs(bn - truth).max() / scale
    assert err <= max(1.5e-7, 2 * bn_err), (err, bn_err)


@pytest.mark.parametrize("family", npnorm.kernels_available())
def test_float32_dweight_at_a_large_offset_takes_xhat_centred_again(family):
    # each rank's dweight = rstd*sum(dy*(x - mean)) took the global mean as rounded to
    # float32: their sum was 3e-2 of dweight off at offset 1e3 and spread 1e-3 (BatchNorm's
    # and PyTorch's too); each rank now takes out xi*sum(dy), xi the global mean of x - mean
    rng = np.random.default_rng(1)
    x = (1e-3 * rng.normal(size=(12, 4, 3, 3)) + 1e3).astype(np.float32)
    dy = rng.normal(size=x.shape).astype(np.float32)
    truth = npnorm.BatchNorm2d(4, dtype="float64")
    _dx_by_module(truth, x.astype(np.float64), dy.astype(np.float64))
    split = (5, 0, 7)

    def rank_fn(comm):
        part = slice(sum(split[: comm.Get_rank()]), sum(split[: comm.Get_rank() + 1]))
        with npnorm.use_kernels(family):
            m = npnorm.SyncBatchNorm(4, comm=comm)
            _dx_by_module(m, x[part], dy[part])
        return m.grads["weight"]

    dweight, want = sum(run_ranks(3, rank_fn)), truth.grads["weight"]
    assert np.abs(dweight - want).max() <= 1e-6 * np.abs(want).max()


@pytest.mark.parametrize("family", ["reference", "numpy"])
def test_float32_sums_cross_the_ranks_unrounded(family):
    # each rank's sums were rounded to float32 before the all-reduce, and the global means
    # to float32 before the centring subtracted two of them: with a common part of 1e3 in
    # dy, dx was up to 7 times BatchNorm's error (drawn: the third batch of this seed)
    rng = np.random.default_rng(3)
    for _ in range(3):
        x = (rng.normal(size=(12, 4, 3, 3)) * 1e-3 + 1e3).astype(np.float32)
        dy = (rng.normal(size=x.shape) + 1e3).astype(np.float32)
        truth = _dx_by_module(
            npnorm.BatchNorm2d(4, dtype="float64"), x.astype(np.float64), dy.astype(np.float64)
        )
        with npnorm.use_kernels(family):
            bn = _dx_by_module(npnorm.BatchNorm2d(4), x, dy)
        ours = _sync_dx(family, x, dy, (5, 0, 7))
        scale = np.abs(truth).max()
        err, bn_err = np.abs(ours - truth).max() / scale, np.abs(bn - truth).max() / scale
        assert err <= max(1.5e-7, 2 * bn_err), (err, bn_err)


@pytest.mark.parametrize("family", ["reference", "numpy"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_an_infinite_gradient_gives_batch_norms_infinities(family, dtype):
    # the centring's xi*mean(dy) was inf - inf (or 0*inf) there: every dx NaN, where
    # BatchNorm gives -inf at one value
    x = np.array([[0.0], [1.0], [2.0], [3.0]], dtype=dtype)
    dy = np.array([[np.inf], [0.0], [0.0], [0.0]], dtype=dtype)
    with npnorm.use_kernels(family), np.errstate(all="ignore"):
        bn = _dx_by_module(npnorm.BatchNorm1d(1, affine=False, dtype=dtype), x, dy)
        ours = _sync_dx(family, x, dy, (2, 2))
    np.testing.assert_array_equal(ours, bn)


def test_infinities_of_both_signs_on_two_ranks_add_to_nan_quietly():
    # the thread ranks' all-reduce warned "invalid value encountered in add" (an error
    # under pytest), where MPI's sum gives NaN without a word; BatchNorm's dx then too
    x = np.array([[0.0], [1.0], [2.0], [3.0]])
    dy = np.array([[np.inf], [0.0], [-np.inf], [0.0]])
    with np.errstate(all="ignore"):
        bn = _dx_by_module(npnorm.BatchNorm1d(1, affine=False, dtype="float64"), x, dy)
    assert np.isnan(bn).all()
    assert np.isnan(_sync_dx("reference", x, dy, (2, 2))).all()


@pytest.mark.parametrize("family", npnorm.kernels_available())
def test_a_constant_gradient_gives_zero_dx_at_a_large_offset(family):
    # dy = 1 everywhere: the exact dx is 0 (the loss does not change when every value of a
    # channel moves together); without the centring it was 1.1 on values near 1e3
    x = (1e3 + 1e-3 * np.random.default_rng(0).normal(size=(16, 2, 3))).astype(np.float32)
    dx = _sync_dx(family, x, np.ones_like(x), (5, 0, 11))
    assert np.abs(dx).max() <= 1e-6


def test_the_functional_backward_with_other_channel_counts_raises_on_every_rank():
    # the all-reduce was sized from each rank's channels: ranks of different counts hung
    # (or MPI aborted the job: "Message truncated")
    def rank_fn(comm):
        r = comm.Get_rank()
        x = np.random.default_rng(r).normal(size=(4, 3))
        _, mean, rstd, _, _ = F.sync_batch_norm_forward(x, None, None, training=True, comm=comm)
        bad = np.ones((4, 2)) if r == 1 else x
        # rank 1's own check fails first (its mean has 3 values for 2 channels)
        with pytest.raises(ValueError, match="failed on rank 1 of 3: mean must have shape"):
            F.sync_batch_norm_backward(np.ones_like(bad), bad, mean, rstd, training=True, comm=comm)
        bad_stats = (mean[:2], rstd[:2]) if r == 1 else (mean, rstd)
        with pytest.raises(ValueError, match=r"different numbers of channels \(rank 0: 3, rank 1: 2"):
            F.sync_batch_norm_backward(np.ones_like(bad), bad, *bad_stats, training=True, comm=comm)
        with pytest.raises(TypeError, match="failed on rank 1 of 3"):  # not "0 channels"
            F.sync_batch_norm_backward(
                *((None, None, None) if r == 1 else (x, x, mean)), rstd, training=True, comm=comm
            )
        dx, _, _ = F.sync_batch_norm_backward(np.ones_like(x), x, mean, rstd, training=True, comm=comm)
        return dx.shape

    assert run_ranks(3, rank_fn) == [(4, 3)] * 3


def test_a_mean_beyond_1e154_merges_without_nan():
    # the first rank's delta*delta*0 was inf*0 = NaN (and an overflow warning)
    table = np.array([[0, 0.0, 0.0], [2, 3e200, 0.0], [2, 3e200, 0.0]])
    n, mean, m2 = merge_moments(table)
    assert n == 4 and mean.tolist() == [3e200] and m2.tolist() == [0.0]


def test_eps_zero_is_refused_in_training_on_every_rank_count():
    # one rank ran BatchNorm's forward (which refuses it, as PyTorch's F.batch_norm); two
    # or more accepted it and gave NaN for a constant channel
    x = np.ones((4, 3))

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(3, eps=0.0, comm=comm)
        with pytest.raises(ValueError, match="eps must be positive during training"):
            m(x)
        return int(m.num_batches_tracked)

    for ranks in (1, 2):
        assert run_ranks(ranks, rank_fn) == [0] * ranks


def test_bfloat16_torch_input_syncs_as_batch_norm_takes_it(torch):
    x = torch.randn(6, 3, dtype=torch.bfloat16)

    def rank_fn(comm):
        r = comm.Get_rank()
        return npnorm.SyncBatchNorm(3, comm=comm, xp="torch")(x[3 * r : 3 * r + 3])

    ours = torch.cat(run_ranks(2, rank_fn))
    ref = npnorm.BatchNorm1d(3, xp="torch")(x)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("other", [0.0, 1e3])  # another channel near 0, or far from it
def test_a_variance_beyond_float32_normalizes_and_saves_rstd_as_batch_norm(other):
    # channel 1 (+-3e38) has a variance beyond float32's range: its output was 0 or +-1
    # depending on the other channel, and the saved rstd 0 (so dx 0) where y was +-1
    x = np.array([[other, 3e38], [other + 1, -3e38], [other + 2, 3e38], [other + 3, -3e38]], np.float32)
    dy = np.array([[1, 1], [0, 0], [0, 0], [0, 0]], np.float32)

    def rank_fn(comm):
        r = comm.Get_rank()
        part, d = x[2 * r : 2 * r + 2], dy[2 * r : 2 * r + 2]
        y, mean, rstd, _, _ = F.sync_batch_norm_forward(part, None, None, training=True, comm=comm)
        dx, _, _ = F.sync_batch_norm_backward(d, part, mean, rstd, training=True, comm=comm)
        return y, dx, rstd

    out = run_ranks(2, rank_fn)
    y, dx = np.concatenate([o[0] for o in out]), np.concatenate([o[1] for o in out])
    y_bn, mean_bn, rstd_bn, _, _ = F.batch_norm_forward(x, None, None, training=True)
    dx_bn, _, _ = F.batch_norm_backward(dy, x, mean_bn, rstd_bn, training=True)
    np.testing.assert_allclose(y, y_bn, rtol=1e-6, atol=1e-6)
    for o in out:  # every rank saves the same rstd
        np.testing.assert_allclose(o[2], rstd_bn, rtol=1e-6)
    np.testing.assert_allclose(dx, dx_bn, rtol=1e-5, atol=1e-44)


def test_a_float16_running_variance_beyond_its_range_is_inf_without_a_warning():
    """A float16 module whose batch variance (~1e6) passes float16's 65504: BatchNorm's
    running_var is inf, quietly; SyncBatchNorm's cast of the update to float16 let NumPy's
    overflow warning out (an error under the tests' settings, and with warnings as errors
    the training step failed on every rank)."""
    x = (np.random.default_rng(0).normal(size=(6, 3, 4)) * 1000 + 2000).astype(np.float16)
    bn = npnorm.BatchNorm1d(3, dtype="float16")
    bn(x)

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(3, dtype="float16", comm=comm)
        r = comm.Get_rank()
        m(x[2 * r : 2 * r + 2])
        return to_host(m.running_var), to_host(m.running_mean)

    for var, mean in run_ranks(3, rank_fn):
        assert np.isinf(bn.running_var).all() and np.isinf(var).all()
        np.testing.assert_allclose(mean, bn.running_mean, rtol=1e-3)


@pytest.mark.parametrize(
    "momentum, running_mean", [(0.0, 0.0), (1.0, np.inf), (None, np.inf)]
)  # 0*inf: in the batch's statistics, or in the running ones (a factor of 1)
def test_a_running_update_of_zero_times_inf_is_nan_without_a_warning(momentum, running_mean):
    """BatchNorm's running update gives NaN quietly where a momentum of 0 meets an inf
    batch mean, or a factor of 1 an inf running mean; SyncBatchNorm's let NumPy's invalid
    warning out (an error under warnings as errors: the training step failed on every
    rank)."""
    x = np.array([[1.0], [2.0], [np.inf], [3.0]])

    def step(m):
        m.load_state_dict({**m.state_dict(), "running_mean": np.array([running_mean])})
        m(x if m.__class__ is npnorm.BatchNorm1d else x[2 * m.comm.Get_rank() :][:2])
        return to_host(m.running_mean), to_host(m.running_var)

    want = step(npnorm.BatchNorm1d(1, momentum=momentum, dtype="float64"))
    for got in run_ranks(
        2, lambda comm: step(npnorm.SyncBatchNorm(1, momentum=momentum, comm=comm, dtype="float64"))
    ):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("family", ["reference", "numpy"])
def test_the_per_rank_kernels_emit_no_floating_point_warning(family):
    """A float16 dx beyond float16's range is inf, as every other kernel gives it: the
    generic SyncBatchNorm kernels alone let NumPy's overflow warning out (hypothesis found
    a near-constant channel)."""
    from npnorm.functional._dispatch import family_kernel

    x = np.array([[[0.0, 0.03125, 0.03125, 0.03125, 0.03125]]] + [[[0.03125] * 5]] * 3, np.float16)
    ct = np.dtype(np.float32)
    mean, var = family_kernel("sync_batch_norm_moments", family)(xp, x, ct)
    rstd = (1.0 / np.sqrt(var + 1e-5)).astype(ct)
    mean_dyxc = np.full(1, 4.0, np.float32)
    dx = family_kernel("sync_batch_norm_dx", family)(
        xp, np.zeros_like(x), x, mean, rstd, None, 0 * rstd, mean_dyxc, 0 * rstd
    )
    assert np.isinf(dx.ravel()[0]) and dx.dtype == np.float16


@pytest.mark.parametrize("family", npnorm.kernels_available())
@pytest.mark.parametrize("spread, weight, scale", [(1e-20, 1.0, 1.0), (1e-14, 1e8, 1e4)])
def test_a_spread_near_float32s_smallest_keeps_finite_gradients(family, spread, weight, scale):
    """Values of spread 1e-20 with eps = 1e-45 (rstd ~1e20, whose square overflows
    float32), or 1e-14 with a weight of 1e8 and dy of 1e4, over two ranks: dx finite and
    as BatchNorm's on the whole batch in float64 (the "numpy" family's dx sweep took
    coefficients of about rstd^2*w*dy: inf, then NaN)."""
    rng = np.random.default_rng(0)
    x = (spread * rng.normal(size=(4, 3, 16))).astype(np.float32)
    dy = (scale * rng.normal(size=x.shape)).astype(np.float32)
    ref = npnorm.BatchNorm1d(3, eps=1e-45, dtype="float64")
    ref.weight[...] = weight
    with npnorm.use_kernels("reference"):
        ref(x.astype(np.float64))
        truth = ref.backward(dy.astype(np.float64))

    def rank_fn(comm: ThreadComm):
        part = slice(2 * comm.Get_rank(), 2 * comm.Get_rank() + 2)
        m = npnorm.SyncBatchNorm(3, eps=1e-45, comm=comm)
        m.weight[...] = weight
        with npnorm.use_kernels(family):
            m(x[part])
            return m.backward(dy[part])

    dx = np.concatenate(run_ranks(2, rank_fn))
    assert np.isfinite(dx).all()
    np.testing.assert_allclose(dx, truth, rtol=1e-5, atol=1e-5 * np.abs(truth).max())


def test_an_inf_on_any_rank_gives_batch_norms_running_mean():
    """An inf on rank 0 of 2: the merge of the ranks' means gave NaN (inf + (-inf)*f, with
    an "invalid value" warning, an error here) where BatchNorm on the whole batch, and
    PyTorch, give inf; on the last rank it was right already."""
    x = np.arange(8.0).reshape(4, 2)
    x[0, 1] = np.inf
    ref = npnorm.BatchNorm1d(2, dtype="float64")
    ref(x)

    def rank_fn(comm: ThreadComm):
        m = npnorm.SyncBatchNorm(2, comm=comm, dtype="float64")
        m(x[2 * comm.Get_rank() : 2 * comm.Get_rank() + 2])
        return m.running_mean, m.running_var

    for running_mean, running_var in run_ranks(2, rank_fn):  # (to rounding: merged, not two-pass)
        np.testing.assert_allclose(running_mean, ref.running_mean, rtol=1e-14)
        np.testing.assert_allclose(running_var, ref.running_var, rtol=1e-14)
        assert running_mean[1] == np.inf


@pytest.mark.parametrize("overwrite", ["reset_running_stats", "load_state_dict"])
def test_overwriting_the_running_statistics_before_a_synced_backward(overwrite):
    """Across ranks the backward uses the saved input, statistics and weight only, and
    PyTorch's SyncBatchNorm function keeps no running statistics: overwriting them between
    forward and backward does not raise there (it raised, saying PyTorch raises too). On
    one rank it does, as BatchNorm's (F.batch_norm's backward keeps them)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3))

    def step(m) -> np.ndarray:
        m(x[: len(x) // m.comm.Get_size()])
        if overwrite == "reset_running_stats":
            m.reset_running_stats()
        else:
            m.load_state_dict({k: np.zeros_like(v) for k, v in m.state_dict().items()})
        return m.backward(np.ones((len(x) // m.comm.Get_size(), 3)))

    for dx in run_ranks(2, lambda comm: step(npnorm.SyncBatchNorm(3, affine=False, comm=comm))):
        assert isinstance(dx, np.ndarray)
    (err,) = run_ranks(1, lambda comm: step(npnorm.SyncBatchNorm(3, affine=False, comm=comm)))
    assert isinstance(err, RuntimeError) and "overwritten in place" in str(err)


def test_a_bad_counter_on_one_rank_raises_on_every_rank():
    """momentum=None with num_batches_tracked = -1 loaded on rank 1 only: the step to 0
    divides by zero there, before the first exchange, outside the checks every rank
    hears of; the other ranks waited for it (a hang). Now every rank raises it."""

    def rank_fn(comm: ThreadComm):
        m = npnorm.SyncBatchNorm(2, momentum=None, comm=comm)
        if comm.Get_rank() == 1:
            m.num_batches_tracked[...] = -1
        before = {k: np.array(v, copy=True) for k, v in m.state_dict().items()}
        try:
            m(np.ones((2, 2), np.float32))
        except ValueError as err:
            for k, v in m.state_dict().items():
                np.testing.assert_array_equal(v, before[k])
            return err
        return None

    errors = run_ranks(3, rank_fn)
    assert all(isinstance(e, ValueError) and "division by zero" in str(e) for e in errors), errors


def test_an_overwrite_after_an_overwrite_names_only_what_the_synced_backward_keeps():
    """After a first overwrite (the weight, by load_state_dict), a reset of the running
    statistics added them to the error as if the synced backward kept them (the record of
    the first overwrite was read as a one-rank forward)."""
    x = np.random.default_rng(0).normal(size=(4, 3))

    def rank_fn(comm: ThreadComm):
        m = npnorm.SyncBatchNorm(3, comm=comm)
        m(x[2 * comm.Get_rank() : 2 * comm.Get_rank() + 2])
        m.load_state_dict({"weight": np.full(3, 2.0)}, strict=False)
        m.reset_running_stats()
        try:
            m.backward(np.ones((2, 3)))
        except RuntimeError as err:
            return str(err)
        return None

    for message in run_ranks(2, rank_fn):
        assert message is not None and "the weight that the last forward used" in message, message
        assert "running" not in message and "by load_state_dict" in message, message


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_zero_channels_are_a_value_error_in_every_mode_as_in_torch(torch, mode):
    x = np.ones((4, 0, 2))
    theirs = getattr(torch.nn.SyncBatchNorm(3, affine=False, track_running_stats=False), mode)()
    with pytest.raises(ValueError, match="number of input channels should be non-zero"):
        theirs(torch.tensor(x))
    m = getattr(npnorm.SyncBatchNorm(3, affine=False, track_running_stats=False), mode)()
    with pytest.raises(ValueError, match="number of input channels should be non-zero"):
        m(x)

    def rank_fn(comm):  # over ranks (collectively when training)
        m = npnorm.SyncBatchNorm(3, affine=False, track_running_stats=False, comm=comm)
        synced = "failed on rank 0 of 2: .*" if mode == "train" else ""
        with pytest.raises(ValueError, match=f"{synced}should be non-zero"):
            getattr(m, mode)()(x)
        return True

    assert run_ranks(2, rank_fn) == [True] * 2


def test_a_subclass_listing_its_own_forward_context_keeps_the_synced_channels():
    """Only Module's forward context was merged into a subclass's own list: a subclass of
    SyncBatchNorm that listed one name of its own lost ``_synced_channels``, so that a copy
    kept it and the copy's backward on one rank entered the ranks' exchange alone (a hang
    under MPI)."""
    import copy

    class Cached(npnorm.SyncBatchNorm):
        _forward_context = ("_my_cache",)

    assert {"_saved", "_synced_channels", "_synced_pending", "_my_cache"} <= set(Cached._forward_context)

    def rank_fn(comm):
        m = Cached(3, comm=comm)
        m(np.random.default_rng(comm.Get_rank()).normal(size=(2, 3)))
        twin = copy.deepcopy(m)
        if comm.Get_rank() == 0:  # the copy has no forward: a local error, no exchange
            with pytest.raises(RuntimeError, match="forward"):
                twin.backward(np.ones((2, 3)))
        return m.backward(np.ones((2, 3))).shape

    assert run_ranks(2, rank_fn) == [(2, 3)] * 2


def test_dask_ranks_of_float16_and_float64_are_refused_on_every_rank():
    """dask's namespace has no float16: NumPy takes ``None == np.dtype("float64")`` as true,
    so float64 input took float16's code, and ranks of the two dtypes were not refused
    (float32 against float64 was named "float32, float16")."""
    da = pytest.importorskip("dask.array")
    x = np.random.default_rng(0).normal(size=(4, 3, 4))

    def rank_fn(dtypes):
        def run(comm):
            part = da.from_array(x.astype(dtypes[comm.Get_rank()]))
            with pytest.raises(
                ValueError, match=rf"different dtypes \(rank 0: {dtypes[0]}, rank 1: {dtypes[1]}"
            ):
                F.sync_batch_norm_forward(part, None, None, training=True, comm=comm)
            return "refused"

        return run

    for dtypes in (("float16", "float64"), ("float32", "float64")):
        assert run_ranks(2, rank_fn(dtypes)) == ["refused"] * 2  # (a rank's exception is its result)


@pytest.mark.parametrize("rows", [(2, 2), (3, 1)], ids=["equal", "uneven"])
def test_gradcheck_of_a_synced_training_layer_says_it_cannot_check_it_on_every_rank(rows):
    """Over several ranks the backward's gradients are those of the loss summed over all
    ranks, which a finite difference on one rank does not see: a correct layer failed on
    every rank (equal batches), and ranks of unequal batches ran unequal numbers of
    collective forwards (a hang under MPI). Every rank refuses now, before any collective;
    in eval, and on one rank, the check runs."""
    x = np.random.default_rng(0).normal(size=(4, 3))

    def rank_fn(comm):
        lo = sum(rows[: comm.Get_rank()])
        m = npnorm.SyncBatchNorm(3, comm=comm, dtype="float64")
        try:
            npnorm.gradcheck(m, x[lo : lo + rows[comm.Get_rank()]])
        except ValueError as err:
            refused = str(err)
        else:
            refused = ""
        return refused, npnorm.gradcheck(m.eval(), x[lo : lo + rows[comm.Get_rank()]])

    for result in run_ranks(2, rank_fn):
        assert not isinstance(result, BaseException), result
        refused, eval_ok = result
        assert "SyncBatchNorm in training over 2 ranks cannot be checked on one rank" in refused
        assert eval_ok is True
    assert npnorm.gradcheck(npnorm.SyncBatchNorm(3, comm=run_ranks(1, lambda c: c)[0], dtype="float64"), x)
