"""npnorm.learn's SyncBatchNorm over simulated ranks, and ``python -m npnorm learn sync_batch_norm``.

- ``simulate_sync_batch_norm`` on hypothesis-drawn batches and splits (empty ranks too):
  what each rank sent is its own (n_r, mean_r, M2_r) and its own backward sums, the merge
  after the last rank is the concatenated batch's (n, mean, M2), and the result is
  BatchNorm's on the concatenated batch;
- the shortcuts are what the page says: the uncounted average is right exactly when the
  counts are equal, Bessel with the local count differs from the global one, the variance
  recovered from invstd and the one-pass variance are exact on benign data and lose their
  digits where the page says they do, while npnorm's statistics keep them;
- the command prints passing tables for the default split and for others, and refuses bad
  splits.
"""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npnorm.functional as F
from npnorm.learn import _cli, simulate_sync_batch_norm
from npnorm.learn import sync_batch_norm as S
from npnorm.learn.examples import SPLIT


@st.composite
def batches(draw, dtype=np.float64):
    split = draw(st.lists(st.integers(0, 3), min_size=2, max_size=4))
    if sum(split) == 0:
        split[0] = 1
    spatial = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3))
    if sum(split) * int(np.prod(spatial)) < 2:  # training needs 2 values per channel
        split[-1] += 1
    c = draw(st.integers(1, 3))
    shape = (sum(split), c, *spatial)
    elements = st.floats(-20, 20, allow_nan=False, allow_subnormal=False)
    x = draw(hnp.arrays(dtype, shape, elements=elements, fill=st.nothing()))
    dy = draw(hnp.arrays(dtype, shape, elements=elements, fill=st.nothing()))
    w = draw(hnp.arrays(dtype, (c,), elements=st.floats(0.5, 2)))
    b = draw(hnp.arrays(dtype, (c,), elements=st.floats(-1, 1)))
    return tuple(split), x, dy, w, b


@settings(max_examples=40, deadline=None)
@given(case=batches())
def test_the_exchanges_are_each_ranks_own_statistics_and_sums_and_the_result_is_batch_norm(case):
    split, x, dy, w, b = case
    rm, rv = np.zeros(x.shape[1]), np.ones(x.shape[1])
    run = simulate_sync_batch_norm(x, dy, split, rm, rv, w, b)
    # header, statistics; the functional backward's channel counts, its sums
    assert [e.kind for e in run.log] == ["Allgather", "Allgather", "Allgather", "Allreduce"]
    axes = (0, *range(2, x.ndim))
    scale = 1 + float(np.max(np.abs(x))) ** 2 * x.size
    for r, part in enumerate(run.parts):  # what rank r sent is its own (n_r, mean_r, M2_r)
        n_r, mean_r, m2_r = S.rank_moments(part)
        assert run.stats[r, 0] == n_r == part.size // x.shape[1]
        sent = np.concatenate([mean_r, m2_r])
        np.testing.assert_allclose(run.stats[r, 1:], sent, rtol=0, atol=1e-12 * scale)
    n, mean, m2 = S.merge_steps(run.stats)[-1]  # the merge after the last rank: the whole batch's
    assert n == x.size // x.shape[1]
    np.testing.assert_allclose(mean, x.mean(axis=axes), rtol=0, atol=1e-12 * scale)
    np.testing.assert_allclose(m2, n * x.var(axis=axes), rtol=0, atol=1e-12 * scale)
    for r, (part, d) in enumerate(zip(run.parts, S.split_batch(dy, split), strict=True)):
        sums = np.concatenate(S.rank_sums(d, part, run.ranks[r].mean))
        np.testing.assert_allclose(run.sums[r, 2:], sums, rtol=0, atol=1e-12 * scale)
    y, mean_bn, rstd, new_rm, new_rv = F.batch_norm_forward(x, rm, rv, w, b, True)
    dx, dw, db = F.batch_norm_backward(dy, x, mean_bn, rstd, w, b, True)
    r_max = float(np.max(rstd))
    tol = 1e-11 * (1 + r_max * float(np.max(np.abs(x)))) * (1 + float(np.max(np.abs(dy))))
    np.testing.assert_allclose(run.output, y, rtol=0, atol=tol)
    np.testing.assert_allclose(run.grad_input, dx, rtol=0, atol=tol * (1 + r_max))
    np.testing.assert_allclose(run.grad_param("weight"), dw, rtol=0, atol=tol * x.size)
    np.testing.assert_allclose(run.grad_param("bias"), db, rtol=0, atol=tol * x.size)
    for rank in run.ranks:  # the running buffers: BatchNorm's, on every rank
        np.testing.assert_allclose(rank.running_mean, new_rm, rtol=1e-12, atol=1e-12 * scale)
        np.testing.assert_allclose(rank.running_var, new_rv, rtol=1e-12, atol=1e-12 * scale)


def test_the_merge_steps_are_chans_formula_and_skip_an_empty_rank():
    # rank 0: 1 value (10), rank 1: none, rank 2: 3 values (0, 0, 0): after rank 2, n = 4,
    # mean = 10 + (0 - 10) * 3/4 = 2.5, M2 = 0 + 0 + 10² * 1 * 3 / 4 = 75
    table = np.array([[1, 10.0, 0.0], [0, 0.0, 0.0], [3, 0.0, 0.0]])
    steps = S.merge_steps(table)
    assert [(n, float(m[0]), float(m2[0])) for n, m, m2 in steps] == [(1, 10, 0), (1, 10, 0), (4, 2.5, 75)]
    assert np.var([10.0, 0, 0, 0]) * 4 == 75


def test_a_split_that_does_not_fit_is_refused():
    x = np.zeros((3, 2))
    with pytest.raises(ValueError, match="summing to N = 3"):
        simulate_sync_batch_norm(x, x, [1, 1])
    with pytest.raises(ValueError, match="two ranks at least"):
        simulate_sync_batch_norm(x, x, [3])
    with pytest.raises(ValueError, match="grad_output must have the shape"):
        simulate_sync_batch_norm(x, x[:, :1], [2, 1])
    with pytest.raises(ValueError, match=r"split \(1.5, 1.5\) must be whole counts"):
        simulate_sync_batch_norm(x, x, [1.5, 1.5])  # (said "split (1, 1) must ... sum to N = 3")


# --- the shortcuts ----------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    per_rank=st.integers(1, 4),
    ranks=st.integers(2, 4),
    data=st.data(),
)
def test_the_uncounted_average_is_right_with_equal_counts(per_rank, ranks, data):
    x = data.draw(
        hnp.arrays(np.float64, (per_rank * ranks, 2, 3), elements=st.floats(-5, 5), fill=st.nothing())
    )
    mean, var = S.uncounted_mean(S.split_batch(x, [per_rank] * ranks))
    np.testing.assert_allclose(mean, x.mean(axis=(0, 2)), rtol=0, atol=1e-12)
    np.testing.assert_allclose(var, x.var(axis=(0, 2)), rtol=0, atol=1e-10)


def test_the_uncounted_average_is_wrong_with_uneven_counts_and_nan_with_an_empty_rank():
    parts = [np.full((1, 1), 10.0), np.zeros((3, 1))]
    mean, var = S.uncounted_mean(parts)
    assert mean[0] == 5.0 and np.mean([10.0, 0, 0, 0]) == 2.5  # (10 + 0)/2, not 10/4
    assert var[0] == 25.0 and np.var([10.0, 0, 0, 0]) == 18.75
    assert np.isnan(S.uncounted_mean([*parts, np.zeros((0, 1))])[0][0])


def test_bessel_with_the_local_count_differs_from_the_global_one():
    assert S.local_bessel(4) == 4 / 3 and S.local_bessel(1) == 1.0 and S.local_bessel(0) == 0.0
    n = 16  # 4 ranks of 4 values: 4/3 instead of 16/15, 25% too much
    assert S.local_bessel(4) / (n / (n - 1)) == pytest.approx(1.25)


def _relative(value, x):
    return np.abs(value / x.astype(np.float64).var(axis=(0, 2)) - 1)


def test_the_variance_from_invstd_loses_small_variances_in_float32_and_npnorm_does_not():
    rng = np.random.default_rng(0)
    std = np.array([1.0, 1e-6])
    x = (rng.standard_normal((8, 2, 4)) * std.reshape(1, 2, 1)).astype(np.float32)
    split = [5, 0, 3]
    theirs = _relative(S.variance_from_invstd(S.split_batch(x, split), 1e-5, np.float32), x)
    assert theirs[0] < 1e-6 and theirs[1] > 0.05  # fine for a unit variance, no digit left at 1e-12
    assert np.all(_relative(S.variance_from_invstd(S.split_batch(x, split), 1e-5, np.float64), x) < 1e-9)
    n, _, m2 = S.merge_steps(simulate_sync_batch_norm(x, np.ones_like(x), split).stats)[-1]
    assert np.all(_relative(m2 / n, x) < 1e-6)


def test_the_one_pass_variance_cancels_with_a_large_mean_and_npnorm_does_not():
    rng = np.random.default_rng(1)
    offset = np.array([0.0, 1e3])
    x = (rng.standard_normal((8, 2, 4)) + offset.reshape(1, 2, 1)).astype(np.float32)
    split = [2, 3, 3]
    theirs = _relative(S.one_pass_variance(S.split_batch(x, split), np.float32), x)
    assert theirs[0] < 1e-5 and theirs[1] > 1e-2
    assert np.all(_relative(S.one_pass_variance(S.split_batch(x, split), np.float64), x) < 1e-9)
    n, _, m2 = S.merge_steps(simulate_sync_batch_norm(x, np.ones_like(x), split).stats)[-1]
    assert np.all(_relative(m2 / n, x) < 1e-5)


# --- the command ----------------------------------------------------------------------------


@pytest.mark.parametrize("split", [None, "5,1,0", "1,1", "0,3,0,1,2"])
def test_the_command_prints_passing_tables(capsys, split):
    argv = ["sync_batch_norm"] + ([] if split is None else ["--split", split])
    assert _cli.main(argv) == 0
    out = capsys.readouterr().out
    shown = ",".join(map(str, SPLIT)) if split is None else split
    assert f"split {shown} along N" in out
    assert "every comparison with BatchNorm on the whole batch holds" in out and "WRONG" not in out
    for section in range(1, 7):
        assert f"\n{section}. " in out
    assert "4 collective calls" in out
    assert ("(skipped: an empty rank's mean is 0/0)" in out) == ("0" in shown.split(","))
    assert ("the average is right" in out) == (split == "1,1")


def test_the_command_refuses_bad_splits_and_options(capsys):
    bad = (
        ["sync_batch_norm", "--split", "4"],
        ["sync_batch_norm", "--split", "a,b"],
        ["sync_batch_norm", "--split", "0,0"],
        ["sync_batch_norm", "--split", "-1,2"],
        ["sync_batch_norm", "--eval"],
        ["layer_norm", "--split", "1,1"],
        ["sync_batch_norm", "--split", ",".join(["1"] * 65)],  # threads: 2000 broke their barrier
        ["sync_batch_norm", "--split", "100000000000,1"],  # asked for terabytes
    )
    for argv in bad:
        with pytest.raises(SystemExit) as exit_:
            _cli.main(argv)
        assert exit_.value.code == 2, argv
    err = capsys.readouterr().err
    assert "--split: two ranks at least" in err and "--split applies to sync_batch_norm" in err
    assert "got 65 ranks and 65 samples" in err and "got 2 ranks and 100000000001 samples" in err
    assert _cli.main(["sync_batch_norm", "--split", ",".join(["1"] * 64)]) == 0  # 64 ranks run
