"""SyncBatchNorm: cases the rest of the suite left open (from mutation testing of the
functional pair, ``npnorm._mpi``, the fast NumPy kernels and the module), each over
thread ranks (``npnorm._threadcomm``) against BatchNorm on the concatenated batch or
against what the docstrings say.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_sync_batch_norm import NoCollectives

import npnorm
import npnorm.functional as F
from npnorm._backend import to_host
from npnorm._threadcomm import run_ranks
from npnorm.functional.sync_batch_norm import merge_moments


def test_the_functional_inference_pair_is_batch_norms_with_no_collective_call():
    """``training=False`` is ``batch_norm_forward``/``batch_norm_backward`` with
    ``training=False`` exactly, on a communicator of several ranks: the running statistics
    normalize and come back unchanged, and dx is the inference one (only the mpiexec
    script checked it, on rank 0 alone)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3, 5)) * 2 + 1
    rm, rv = rng.normal(size=3), rng.uniform(0.5, 2, 3)
    w, b = rng.uniform(0.5, 1.5, 3), rng.normal(size=3)
    kept = rm.copy(), rv.copy()
    got = F.sync_batch_norm_forward(x, rm, rv, w, b, False, 0.3, 1e-3, comm=NoCollectives(3))
    want = F.batch_norm_forward(x, rm, rv, w, b, False, 0.3, 1e-3)
    for g, e in zip(got, want, strict=True):
        assert np.array_equal(g, e)
    for buffers in ((got[3], got[4]), (rm, rv)):
        for ours, before in zip(buffers, kept, strict=True):
            np.testing.assert_array_equal(ours, before)
    dy = rng.normal(size=x.shape)
    got_b = F.sync_batch_norm_backward(dy, x, got[1], got[2], w, b, False, comm=NoCollectives(3))
    want_b = F.batch_norm_backward(dy, x, want[1], want[2], w, b, False)
    for g, e in zip(got_b, want_b, strict=True):
        assert np.array_equal(g, e)


def test_two_ranks_failing_differently_raise_the_first_ranks_error_on_every_rank():
    """The class and message are the first failing rank's, the others named after it. (The
    suite's cases of two failing ranks had the same message on both, so that taking the
    last failing rank's message under the first one's number passed.)"""

    def rank_fn(comm):
        rank = comm.Get_rank()
        good = np.random.default_rng(rank).normal(size=(2, 3, 4))
        x = {1: good.astype(np.int64), 2: good[0, 0]}.get(rank, good)
        m = npnorm.SyncBatchNorm(3, comm=comm, dtype="float64")
        with pytest.raises(TypeError) as info:
            m(x)
        return str(info.value)

    messages = run_ranks(3, rank_fn)
    assert all(isinstance(m, str) for m in messages), messages
    assert len(set(messages)) == 1, messages
    assert "SyncBatchNorm failed on rank 1 of 3: input must have a floating dtype" in messages[0]
    assert messages[0].endswith("(rank(s) 2 failed too)"), messages[0]
    assert "2D input" not in messages[0]


def test_an_empty_rank_after_a_mean_beyond_1e154_merges_without_nan():
    """An empty rank after a non-empty one adds nothing: skipped, not merged with a weight
    of 0 (``delta**2 * n * 0`` is inf * 0 = NaN beyond 1e154). test_a_mean_beyond_1e154
    has its empty rank first only."""
    n, mean, m2 = merge_moments(np.array([[2, 3e200, 0.0], [0, 0.0, 0.0], [2, 3e200, 0.0]]))
    assert n == 4 and mean.tolist() == [3e200] and m2.tolist() == [0.0]
    x = np.full((4, 1), 3e200)
    ref = npnorm.BatchNorm1d(1, dtype="float64")
    ref(x)

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(1, comm=comm, dtype="float64")
        m(x if comm.Get_rank() == 0 else x[:0])
        return to_host(m.running_mean), to_host(m.running_var)

    for mean, var in run_ranks(2, rank_fn):
        np.testing.assert_array_equal(mean, ref.running_mean)
        np.testing.assert_array_equal(var, ref.running_var)


def test_where_the_ranks_means_are_too_far_apart_to_subtract_the_counts_weight_them():
    """Means whose difference overflows (``delta`` inf): the merged mean is the counts'
    weighted sum, as the docstring says (1 value at -1.5e308 and 3 at 1.5e308 average to
    7.5e307, not to 0, the ranks' plain average)."""
    n, mean, _ = merge_moments(np.array([[1, -1.5e308, 0.0], [3, 1.5e308, 0.0]]))
    assert n == 4 and mean.tolist() == [7.5e307]


@pytest.mark.parametrize("family", ["reference", "numpy"])
def test_float16_input_computes_in_float32_as_batch_norm(family):
    """float16 input to a float32 module: the global statistics, the output and the running
    statistics are computed in float32 (BatchNorm's computation dtype), not rounded to
    float16 on the way (4e-4 of the running mean, 1e-3 of y): over the ranks as on the
    concatenated batch, to float32's rounding."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(7, 3, 5)) * 3 + 20).astype(np.float16)
    dy = rng.normal(size=x.shape).astype(np.float16)
    with npnorm.use_kernels(family):
        ref = npnorm.BatchNorm1d(3, momentum=0.5)
        y_ref, dx_ref = ref(x), ref.backward(dy)
    ends = np.cumsum([0, 3, 0, 4])

    def rank_fn(comm):
        lo, hi = ends[comm.Get_rank()], ends[comm.Get_rank() + 1]
        with npnorm.use_kernels(family):
            m = npnorm.SyncBatchNorm(3, momentum=0.5, comm=comm)
            y, dx = m(x[lo:hi]), m.backward(dy[lo:hi])
        return y, dx, to_host(m.running_mean), to_host(m.running_var)

    results = run_ranks(3, rank_fn)
    y = np.concatenate([r[0] for r in results])
    dx = np.concatenate([r[1] for r in results])
    assert y.dtype == dx.dtype == np.float16
    np.testing.assert_array_equal(y, y_ref)  # (float16 results of float32 values that agree)
    np.testing.assert_allclose(dx.astype(np.float32), dx_ref.astype(np.float32), rtol=2e-3, atol=2e-3)
    for _, _, mean, var in results:
        assert mean.dtype == var.dtype == np.float32
        np.testing.assert_allclose(mean, ref.running_mean, rtol=1e-6)
        np.testing.assert_allclose(var, ref.running_var, rtol=1e-6)


def _exchanges(size, fn):
    """``fn(comm)`` on ``size`` thread ranks; each rank's result and the kinds of the
    collective calls the group made."""
    results = run_ranks(size, lambda comm: (fn(comm), comm))
    assert all(not isinstance(r, BaseException) for r in results), results
    return [r[0] for r in results], [e.kind for e in results[0][1].log]


def test_a_training_step_makes_the_collective_calls_the_docstrings_count():
    """A module's training step: the header and the statistics (two all-gathers), then the
    backward's one all-reduce (no channel-count exchange: its forward checked them); the
    functional backward gathers the channel counts first. A failed forward adds the
    exchange of the errors (one object all-gather) after the header, and nothing else."""
    x = np.random.default_rng(0).normal(size=(4, 3, 2))

    def module_step(comm):
        m = npnorm.SyncBatchNorm(3, comm=comm, dtype="float64")
        return m.backward(m(x)).shape

    shapes, kinds = _exchanges(3, module_step)
    assert shapes == [x.shape] * 3 and kinds == ["Allgather", "Allgather", "Allreduce"]

    def functional_step(comm):
        y, mean, rstd, _, _ = F.sync_batch_norm_forward(x, None, None, training=True, comm=comm)
        return F.sync_batch_norm_backward(y, x, mean, rstd, training=True, comm=comm)[0].shape

    shapes, kinds = _exchanges(2, functional_step)
    assert shapes == [x.shape] * 2 and kinds == ["Allgather", "Allgather", "Allgather", "Allreduce"]

    def failed_step(comm):
        with pytest.raises(ValueError, match="failed on rank 1 of 2"):
            npnorm.SyncBatchNorm(3, comm=comm)(x[:, :2] if comm.Get_rank() == 1 else x)
        return True

    assert _exchanges(2, failed_step)[1] == ["Allgather", "allgather"]


@pytest.mark.parametrize(
    "bad, cls, message",
    [
        ("running_var", ValueError, "running_mean and running_var must be given together"),
        ("weight", ValueError, "weight must have shape (3,)"),
        ("running_mean", ValueError, "running_mean must have shape (3,)"),
        ("momentum", TypeError, "momentum"),
        ("eps", TypeError, "eps must be a non-negative number"),
    ],
)
def test_a_bad_argument_of_the_functional_forward_on_one_rank_raises_on_every_rank(bad, cls, message):
    """The functional forward's checks of its other arguments run before the first
    exchange, on each rank, and a failure on one rank is raised on every rank with that
    rank's message (without them one rank raised alone after the exchange, or not at
    all, and under MPI the others waited in the next collective)."""
    x = np.random.default_rng(0).normal(size=(4, 3, 2))

    good = dict(running_mean=np.zeros(3), running_var=np.ones(3), weight=np.ones(3), momentum=0.1, eps=1e-5)
    wrong = {"running_var": None, "weight": np.ones(2), "running_mean": np.zeros(4)}.get(bad, "0.1")

    def rank_fn(comm):
        args = {**good, bad: wrong} if comm.Get_rank() == 1 else good
        with pytest.raises(cls) as info:
            F.sync_batch_norm_forward(x, bias=None, training=True, comm=comm, **args)
        return str(info.value)

    messages = run_ranks(3, rank_fn)
    assert all(isinstance(m, str) for m in messages), messages
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("sync_batch_norm failed on rank 1 of 3: ") and message in messages[0]


def test_running_statistics_of_another_length_are_refused_as_batch_norm_refuses_them():
    """Without affine parameters the running statistics give the channel count a training
    input must have: every rank raises BatchNorm's message for it, in the module's checks
    (a mutation that left it to the functional forward's checks said "running_mean must
    have shape (3,)" instead, where BatchNorm and one rank say "expected 3 channels")."""
    x = np.random.default_rng(0).normal(size=(2, 5, 4))
    with pytest.raises(ValueError) as one:
        npnorm.BatchNorm1d(3, affine=False, dtype="float64")(x)

    def rank_fn(comm):
        m = npnorm.SyncBatchNorm(3, affine=False, comm=comm, dtype="float64")
        with pytest.raises(ValueError) as info:
            m(x)
        return str(info.value)

    messages = run_ranks(2, rank_fn)
    own = str(one.value).replace("BatchNorm1d", "SyncBatchNorm")  # "expected 3 channels at dim 1, ..."
    assert messages == [f"SyncBatchNorm failed on rank 0 of 2: {own} (rank(s) 1 failed too)"] * 2


def test_the_synced_backward_leaves_no_history_on_a_weight_that_requires_grad(torch):
    """The functional pair on torch tensors whose weight requires grad: dx, dweight and
    dbias carry no autograd history across ranks (the synced backward detached the
    gradient and the input, and a mutation that left the weight attached passed)."""
    x = torch.randn(4, 3, 2, dtype=torch.float64)
    w = torch.rand(3, dtype=torch.float64).add_(0.5).requires_grad_()
    b = torch.zeros(3, dtype=torch.float64, requires_grad=True)

    def rank_fn(comm):
        part = x[2 * comm.Get_rank() : 2 * comm.Get_rank() + 2]
        y, mean, rstd, _, _ = F.sync_batch_norm_forward(part, None, None, w, b, True, comm=comm)
        grads = F.sync_batch_norm_backward(torch.ones_like(part), part, mean, rstd, w, b, True, comm=comm)
        return [t.requires_grad for t in (y, *grads)]

    with pytest.warns(UserWarning, match="sync_batch_norm_forward ran on torch tensors that require grad"):
        results = run_ranks(2, rank_fn)
    assert results == [[False] * 4] * 2, results
