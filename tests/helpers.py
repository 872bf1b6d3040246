"""Helpers for parity with torch.nn (same parameters, same data, compare everything), and
for running every operation through two kernel families."""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import sys

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import npnorm
from npnorm._backend import to_host
from npnorm._selfcheck import randomize  # noqa: F401  (re-exported for the tests)

# what each optional extra of setup.cfg brings that tests need: modules, and for `mpi` the
# mpiexec launcher that mpich installs next to the interpreter (mpi4py cannot load MPI without it)
EXTRA_MODULES = {"mpi": ("mpi4py",), "demo": ("matplotlib", "sklearn", "tqdm")}
MPIEXEC = pathlib.Path(sys.executable).parent / "mpiexec"


def extra_missing(extra: str) -> str | None:
    """Why the tests that need the optional ``extra`` cannot run here, or None when they can.

    Without an extra, its tests skip and say which (as the parity tests do without torch);
    .ci/run installs every extra and checks that each imports, so none skips there.
    """
    absent = [name for name in EXTRA_MODULES[extra] if importlib.util.find_spec(name) is None]
    if extra == "mpi" and not MPIEXEC.exists():
        absent.append(f"mpiexec next to {sys.executable} (the mpich package)")
    if not absent:
        return None
    return f'needs the {extra!r} extra ({", ".join(absent)} missing): pip install -e ".[{extra}]"'


def needs_extra(extra: str) -> pytest.MarkDecorator:
    """A mark that skips a test where ``extra`` is missing (see ``extra_missing``)."""
    reason = extra_missing(extra)
    return pytest.mark.skipif(reason is not None, reason=str(reason))


TOL = {
    "float64": dict(rtol=1e-10, atol=1e-10),
    "float32": dict(rtol=1e-4, atol=2e-5),
    "float16": dict(rtol=2e-3, atol=1e-3),  # (its ulp is 1e-3 relative)
}


def grid_arrays(shape, lo: float = -6.0, hi: float = 6.0, step: float = 0.25) -> st.SearchStrategy:
    """float64 arrays of ``shape`` drawn element by element by ``hnp.arrays`` (so a failure
    shrinks to a small array of small values), each value a multiple of ``step`` in
    [lo, hi].

    Why a grid: every value is exact in float32 and float16 (both libraries see the values
    drawn), every sum of up to 2**18 values of the default grid (quarters in [-6, 6]) is
    exact in float32, and a group of values is either constant or spread by at least
    ``step / sqrt(n)``: the cases that float32 rounding makes hard to compare (a spread of
    a few ulps) are left to the tests written for them (constant rows, test_offset_accuracy).
    """
    ints = st.integers(round(lo / step), round(hi / step))
    # fill=nothing: every element drawn on its own (by default most of an array is one fill
    # value, and half the drawn rows were constant, where the gradient's terms vanish)
    return hnp.arrays(np.int32, shape, elements=ints, fill=st.nothing()).map(lambda k: k * step)


def channels_last(a: np.ndarray) -> np.ndarray:
    """``a`` (N, C, *spatial) with the same values, its channels last in memory."""
    return np.moveaxis(np.ascontiguousarray(np.moveaxis(a, 1, -1)), -1, 1)


def draw_state(data, module) -> dict[str, np.ndarray]:
    """Load drawn values (``data``: hypothesis's ``st.data()``) into every entry of
    ``module``'s state_dict: weights in [-1.5, 1.5], running variances in [0.25, 2],
    biases and running means in [-2, 2], a count in 0..5. Returns what it loaded."""
    state = {}
    for name, value in module.state_dict().items():
        shape = tuple(value.shape)
        if name == "num_batches_tracked":
            state[name] = np.asarray(data.draw(st.integers(0, 5), label=name), dtype=np.int64)
        elif name == "running_var":
            state[name] = data.draw(grid_arrays(shape, 0.25, 2.0, 0.125), label=name)
        elif name == "weight":
            state[name] = data.draw(grid_arrays(shape, -1.5, 1.5, 0.125), label=name)
        else:
            state[name] = data.draw(grid_arrays(shape, -2.0, 2.0), label=name)
    module.load_state_dict(state)
    return state


def load_into_torch(torch, ours, ref) -> None:
    ref.load_state_dict({k: torch.as_tensor(to_host(v)) for k, v in ours.state_dict().items()})


def _host64(a) -> np.ndarray:
    """Any backend's array or a torch tensor, as a float64 NumPy array."""
    if hasattr(a, "detach"):
        return a.detach().double().numpy()
    return to_host(a).astype(np.float64)


def close(a, b, dtype: str, what: str, truth=None, scale: float | np.ndarray = 1.0) -> None:
    """``a`` (npnorm's, any backend) against ``b`` (torch's), tolerance scaled by the
    largest of ``scale`` (a number, or one per value) and ``b``'s values.

    With ``truth`` (torch's result in float64 on the same float32 values), float32 results
    pass also where each value is within twice torch's largest error of the truth: on
    ill-conditioned data (a group of nearly equal values, whose rstd is near 1/sqrt(eps))
    torch's own float32 rounding error exceeds any fixed tolerance, and the two libraries
    round differently, value by value (GroupNorm's dweight on such groups: torch 6.4e-4
    off at one channel and 1e-6 at another, npnorm the other way round; compared value
    by value, a drawn case failed where both are as accurate overall).
    """
    a, b = _host64(a), _host64(b)
    assert a.shape == b.shape, f"{what}: shape {a.shape} vs {b.shape}"
    tol = TOL[dtype]
    scale = np.maximum(max(1.0, float(np.abs(b).max(initial=0.0))), scale)
    if truth is not None:
        truth = _host64(truth)
        torch_error = float(np.max(np.abs(b - truth), initial=0.0))  # its largest
        allowed = 2 * torch_error + tol["rtol"] * np.abs(truth) + tol["atol"] * scale
        if np.all(np.abs(a - truth) <= allowed):
            return
    with np.errstate(invalid="ignore"):  # inf - inf
        ok = (np.abs(a - b) <= tol["rtol"] * np.abs(b) + tol["atol"] * scale) | (np.isnan(a) & np.isnan(b))
        ok |= a == b  # the same infinity
    if not ok.all():
        worst = np.unravel_index(np.argmax(np.where(ok, -np.inf, np.abs(a - b))), a.shape)
        raise AssertionError(
            f"{what}: {int((~ok).sum())} of {ok.size} values differ beyond rtol={tol['rtol']}, "
            f"atol={tol['atol']} x scale; at {worst}: npnorm {a[worst]!r}, torch {b[worst]!r}"
            + ("" if truth is None else f", torch in float64 {truth[worst]!r}")
        )


def same_dtype(ours, theirs, what: str) -> None:
    """npnorm's array (any backend) has the dtype of torch's tensor ``theirs``."""
    a, b = to_host(ours).dtype, to_host(theirs).dtype
    assert a == b, f"{what}: dtype {a}, torch's {b}"


def same_as_torch(ours, theirs, dtype: str, what: str, truth=None) -> None:
    """npnorm's array is torch's: its dtype, and its values as ``close`` has them."""
    same_dtype(ours, theirs, what)
    close(ours, theirs, dtype, what, truth)


_SPATIAL = {"1d": 1, "2d": 2, "3d": 3}


def gains(module, x: np.ndarray, dtype: str) -> np.ndarray:
    """``|weight| * rstd`` of each value's group for ``module`` on input ``x``, in ``x``'s
    shape: dx is a sum of terms up to this factor times ``|dy|``, so its rounding error
    scales with it. A constant group (rstd = 1/sqrt(eps)) makes those terms large, and the
    difference of two of them (dx = 0 exactly in theory) is rounding, in torch's order of
    operations or in npnorm's; the other groups keep their own, smaller, factor."""
    name = type(module).__name__
    eps = module.eps if module.eps is not None else float(np.finfo(dtype).eps)  # RMSNorm(eps=None)
    # the channel axis of the layers with per-channel weights (InstanceNorm: batched or not)
    channel = x.ndim - _SPATIAL[name[-2:]] - 1 if name.startswith("InstanceNorm") else 1
    per_channel = tuple(x.shape[a] if a == channel else 1 for a in range(x.ndim))
    if name == "LayerNorm" or name == "RMSNorm":
        axes = tuple(range(x.ndim - len(module.normalized_shape), x.ndim))
        centred = x - x.mean(axis=axes, keepdims=True) if name == "LayerNorm" else x
        var = (centred * centred).mean(axis=axes, keepdims=True)
    elif name == "GroupNorm":
        var = x.reshape(x.shape[0], module.num_groups, -1).var(axis=-1, keepdims=True)
        var = np.broadcast_to(var, (x.shape[0], module.num_groups, x[0].size // module.num_groups))
        var = var.reshape(x.shape)
    elif module.track_running_stats and not module.training:
        var = to_host(module.running_var).reshape(per_channel)
    elif name.startswith("BatchNorm"):
        var = x.var(axis=tuple(a for a in range(x.ndim) if a != channel), keepdims=True)
    else:  # InstanceNorm: the axes after the channel axis
        var = x.var(axis=tuple(range(channel + 1, x.ndim)), keepdims=True)
    weight = np.ones(1) if module.weight is None else np.abs(to_host(module.weight))
    if module.weight is not None and name not in ("LayerNorm", "RMSNorm"):
        weight = weight.reshape(per_channel)
    return np.broadcast_to(weight / np.sqrt(var + eps), x.shape)


def train_then_eval(torch, backend, ours, ref, data, shape, steps: int, dtype: str) -> None:
    """``steps`` training steps of both modules on drawn data, then one in eval."""
    for step in [*range(steps), "eval"]:
        if step == "eval":
            ours.eval()
            ref.eval()
        x, dy = data.draw(grid_arrays(shape), label="x"), data.draw(grid_arrays(shape), label="dy")
        step_and_compare(torch, backend, ours, ref, x, dy, dtype)


def step_and_compare(torch, backend, ours, ref, x_np, dy_np, dtype: str) -> None:
    """One forward+backward of both modules on the same data; compare all results.

    In float32, a float64 copy of ``ref`` with ``ours``'s parameters and buffers takes the
    same step on the same (float32) values: its results are the truth ``close`` measures
    both libraries' errors by."""
    tdtype = getattr(torch, dtype)
    x_np = np.asarray(x_np, dtype=dtype).astype(np.float64)  # the values both libraries see
    dy_np = np.asarray(dy_np, dtype=dtype).astype(np.float64)
    ref64 = None
    if dtype != "float64":  # the truth starts from npnorm's state: after a few steps in
        # float32 the running statistics of the two libraries differ by their rounding
        ref64 = copy.deepcopy(ref).double()
        load_into_torch(torch, ours, ref64)
        ref64.zero_grad()
    ours.zero_grad()
    ref.zero_grad()
    y = ours(backend.asarray(x_np, dtype))
    dx = ours.backward(backend.asarray(dy_np, dtype))

    def run(module, dt):
        xt = torch.tensor(x_np, dtype=dt, requires_grad=True)
        yt = module(xt)
        yt.backward(torch.tensor(dy_np, dtype=dt))
        return yt, xt.grad, dict(module.named_parameters()), module.state_dict()

    yt, dxt, tparams, tstate = run(ref, tdtype)
    y64, dx64, params64, state64 = run(ref64, torch.float64) if ref64 is not None else (None,) * 4
    close(y, yt, dtype, "output", y64)
    assert to_host(y).dtype == np.dtype(dtype)
    close(dx, dxt, dtype, "dx", dx64, gains(ours, x_np, dtype) * float(np.abs(dy_np).max(initial=0.0)))
    assert set(ours.grads) == {k for k, p in tparams.items() if p.grad is not None}
    for k, g in ours.grads.items():
        close(g, tparams[k].grad, dtype, f"grad {k}", params64[k].grad if params64 else None)
    assert set(ours.state_dict()) == set(tstate)
    for k, v in ours.state_dict().items():
        close(v, tstate[k], dtype, k, state64[k] if state64 else None)


def op_calls(x, dy, w, b, groups: int) -> list:
    """``(op, forward arguments, backward arguments from the forward's results)`` of every
    operation on (N, C, ..., D) data: LayerNorm and RMSNorm (its default eps) over the
    last axis, with weight ``w`` and bias ``b`` ((D,) or None); GroupNorm in ``groups``
    groups; BatchNorm and InstanceNorm with batch and with running statistics. The
    channel layers' weights, biases and buffers are fixed (C,) values of x's dtype."""
    D, C, dt = x.shape[-1], x.shape[1], x.dtype
    wc, bc = np.linspace(0.5, 1.5, C).astype(dt), np.linspace(-1, 1, C).astype(dt)
    rm, rv = np.linspace(-1, 1, C).astype(dt), np.linspace(0.5, 2, C).astype(dt)
    calls = [
        ("layer_norm", (x, (D,), w, b, 1e-5), lambda f: (dy, x, (D,), f[1], f[2], w, b)),
        ("rms_norm", (x, (D,), w, None), lambda f: (dy, x, (D,), f[1], w)),
        ("group_norm", (x, groups, wc, bc, 1e-5), lambda f: (dy, x, groups, f[1], f[2], wc, bc)),
    ]
    for op in ("batch_norm", "instance_norm"):
        for stats in (True, False):  # batch statistics, running statistics
            calls.append(
                (
                    op,
                    (x, rm, rv, wc, bc, stats, 0.1, 1e-5),
                    lambda f, s=stats: (dy, x, f[1], f[2], wc, bc, s),
                )
            )
    return calls


def same_results(ours, ref, what: str, tol: float = 0.0) -> None:
    """Two sequences of results: None in the same places, the same dtypes and shapes, and
    values equal to ``tol`` (relative and absolute; NaN equals NaN; 0: exactly)."""
    assert len(ours) == len(ref), what
    for a, c in zip(ours, ref, strict=True):
        if c is None:
            assert a is None, what
            continue
        assert (a.dtype, a.shape) == (c.dtype, c.shape), what
        np.testing.assert_allclose(
            a.astype(np.float64), c.astype(np.float64), rtol=tol, atol=tol, err_msg=what
        )


def _host_state(m) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in {**m.state_dict(), **m.grads}.items()}


def module_as_on_numpy(ours, ref, shape, to_backend, array_type, *, gradcheck: bool = True) -> None:
    """Module ``ours`` (of another backend; ``to_backend`` makes its arrays from NumPy's,
    results are of ``array_type``) does what the NumPy module ``ref`` does, in float64: a
    load, two steps (running statistics, grads accumulated over two backwards), a reset,
    and (``gradcheck``) gradcheck."""
    rng = np.random.default_rng(0)
    state = {
        k: rng.uniform(0.5, 1.5, size=v.shape) if k != "num_batches_tracked" else np.asarray(3)
        for k, v in ref.state_dict().items()
    }
    for m in (ours, ref):
        m.load_state_dict(state)
    for _ in range(2):
        x, dy = rng.normal(size=shape), rng.normal(size=shape)
        y, y_ref = ours(to_backend(x)), ref(x)
        dx, dx_ref = ours.backward(to_backend(dy)), ref.backward(dy)
        assert isinstance(y, array_type) and isinstance(dx, array_type)
        np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(dx), dx_ref, rtol=1e-12, atol=1e-12)
    got, want = _host_state(ours), _host_state(ref)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-12, err_msg=k)
    ours.reset_parameters()
    ref.reset_parameters()
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(np.asarray(ours.state_dict()[k]), v, err_msg=k)
    if gradcheck:
        assert npnorm.gradcheck(ours, to_backend(rng.normal(size=shape)))


# --- each element's own scale, for comparing two kernels' gradients ---------------------------


def statistic_ids(op: str, shape: tuple[int, ...], stat_shape: tuple[int, ...]) -> np.ndarray:
    """Each element's statistic: its index into the flattened mean and rstd of ``op``
    ("layer_norm", "rms_norm": one per leading index, over the trailing axes; of (N, C,
    *spatial) input, per channel (BatchNorm; running statistics) or per (sample, group)
    (GroupNorm; InstanceNorm's groups of one channel))."""
    size = int(np.prod(stat_shape))
    if op in ("layer_norm", "rms_norm"):
        per = int(np.prod(shape)) // max(size, 1)
        return np.arange(size).repeat(per).reshape(shape)
    n, c = shape[:2]
    spatial = (1,) * (len(shape) - 2)
    channel = np.arange(c).reshape(1, c, *spatial)
    if len(stat_shape) == 1:  # (C,)
        return np.broadcast_to(channel, shape)
    groups = stat_shape[1]
    return np.broadcast_to(np.arange(n).reshape(n, 1, *spatial) * groups + channel // (c // groups), shape)


def statistic_shape(op: str, shape: tuple[int, ...], groups: int = 1) -> tuple[int, ...]:
    """The shape of ``op``'s mean and rstd for (N, C, *spatial) input of ``shape``: per
    channel ("batch_norm"), per (sample, channel) ("instance_norm") or per (sample, group)
    ("group_norm", of ``groups`` groups)."""
    n, c = shape[:2]
    return {"batch_norm": (c,), "instance_norm": (n, c), "group_norm": (n, groups)}[op]


# the sizes a drawn statistic is scaled to: powers of two, so that scaling rounds nothing
# above the subnormals (float16 values of 1e-3 scaled by 2**-10 are subnormal and round)
STATISTIC_SCALES = (1.0, 2.0**-5, 2.0**-10)


def statistic_scales(op: str, shape: tuple[int, ...], stat_shape: tuple[int, ...]) -> st.SearchStrategy:
    """A drawn factor per statistic of ``op`` (one of ``STATISTIC_SCALES``, statistics
    shaped ``stat_shape`` as ``statistic_ids`` has them), at each element of an array of
    ``shape``, in float64.

    Drawn values multiplied by it give statistics up to 1024x apart in size, where one
    spread (and one offset, or one per channel) for the whole array seldom did: the
    bounds that go by each statistic's own values are exercised, and a wrong result on a
    small statistic, which a bound from the largest statistic of all lets pass, is
    caught far more often. Each factor is drawn on its own (``fill=st.nothing()``; with
    hypothesis's default fill most statistics of a large array share one)."""
    ids = statistic_ids(op, tuple(shape), tuple(stat_shape))
    size = int(np.prod(stat_shape))
    factors = hnp.arrays(np.float64, size, elements=st.sampled_from(STATISTIC_SCALES), fill=st.nothing())
    return factors.map(lambda f: f[ids])


def at_elements(op: str, x, stat) -> np.ndarray:
    """The float64 value of the statistic ``stat`` (shaped as ``op``'s mean or rstd) at
    each element of ``x``."""
    shape = np.shape(x)
    return np.asarray(stat, np.float64).ravel()[statistic_ids(op, shape, np.shape(stat))]


def count_at(op: str, x, stat) -> np.ndarray:
    """The number of values of each element's statistic (``stat`` shaped as ``op``'s
    mean or rstd)."""
    ids = statistic_ids(op, np.shape(x), np.shape(stat))
    return np.bincount(ids.ravel(), minlength=int(np.size(stat)))[ids]


def statistic_max(op: str, x, stat) -> np.ndarray:
    """The largest ``|x|`` of each statistic's values, shaped as ``stat`` (``op``'s mean
    or rstd, or a running buffer per channel), in float64; 0 for a statistic of none."""
    ids = statistic_ids(op, np.shape(x), np.shape(stat)).ravel()
    largest = np.zeros(int(np.size(stat)))
    np.maximum.at(largest, ids, np.abs(np.asarray(x, np.float64)).ravel())
    return largest.reshape(np.shape(stat))


def parameter_at(op: str, x, w) -> np.ndarray:
    """``|w|`` of an array shaped as ``op``'s parameters (a weight, a bias, any value per
    channel or per normalized element), in float64 where it broadcasts against ``x``:
    over the trailing axes ("layer_norm", "rms_norm"), along axis 1 (the channel layers);
    1 for None."""
    if w is None:
        return np.ones(())
    w64 = np.abs(np.asarray(w, np.float64))
    return w64 if op in ("layer_norm", "rms_norm") else w64.reshape(1, -1, *(1,) * (np.ndim(x) - 2))


def output_terms(op: str, x, w, mean, rstd) -> tuple[np.ndarray, np.ndarray]:
    """``(terms, mean_rounding)`` per element of ``y = w (x - mean) r + b``, in float64:
    ``|w| (|x - mean| r + 1)``, the size of ``w xhat`` and its rounding, and the float64
    mean's rounding, n roundings of ``|mean|`` on a statistic of n values (its sum rounds
    up to n - 1 times; two at least), times ``r |w|``: what two kernels that both take
    back the mean's rounding to the computation dtype may still differ by, for summing in
    other orders."""
    x64 = np.asarray(x, np.float64)
    mean_at, r_at = at_elements(op, x64, mean), np.abs(at_elements(op, x64, rstd))
    w_at = parameter_at(op, x64, w)
    n_at = np.maximum(count_at(op, x64, mean), 2)
    terms = (np.abs(x64 - mean_at) * r_at + 1) * w_at
    return terms, n_at * float(np.finfo(np.float64).eps) * np.abs(mean_at) * r_at * w_at


def gradient_terms(
    op: str, x, dy, w, mean, rstd, *, batch: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dx, dweight, dbias)`` terms: per element of dx, and per parameter element, the
    sum of the magnitudes of the terms their formulas add, in float64. Two kernels'
    gradients differ by a few roundings of the computation dtype of these, so a bound
    from them goes with each element's own statistic (a bound from the largest term of
    all lets a gradient wrong on a statistic of small terms pass).

    With batch statistics (``batch``), ``dx = r (g - mean(g) - xhat mean(g xhat))``,
    ``g = w dy``, the means over the element's statistic (RMSNorm has no ``mean(g)``;
    the bound takes it anyway): the terms ``r (|g| + mean|g| + (|xhat| + 1)(mean|g xhat|
    + mean|g|))``, where the 1 takes xhat's own rounding (the saved mean's, a few ulps
    once centred again). With running statistics ``dx = r g``. ``dweight`` sums ``|dy|
    (|xhat| + 1)``, ``dbias`` ``|dy|``, over what each parameter element scales. ``xhat``
    is ``(x - mean) r``, or, with running statistics, ``(|x| + |mean|) r``: the given
    mean is subtracted in the computation dtype (``mean`` None: RMSNorm, ``x r``)."""
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    rstd64 = np.abs(np.asarray(rstd, np.float64)).ravel()
    ids = statistic_ids(op, x64.shape, np.shape(rstd))
    rows = op in ("layer_norm", "rms_norm")
    w64 = parameter_at(op, x64, w)
    r = rstd64[ids]
    m = 0.0 if mean is None else at_elements(op, x64, mean)
    with np.errstate(invalid="ignore", over="ignore"):  # (non-finite data: see the end)
        xhat = (np.abs(x64 - m) if batch else np.abs(x64) + np.abs(m)) * r
        g = np.abs(dy64) * w64
        if batch:
            count = np.maximum(np.bincount(ids.ravel(), minlength=rstd64.size), 1)

            def average(v: np.ndarray) -> np.ndarray:  # over each element's statistic
                return (np.bincount(ids.ravel(), weights=v.ravel(), minlength=rstd64.size) / count)[ids]

            dx = r * (g + average(g) + (xhat + 1) * (average(g * xhat) + average(g)))
        else:
            dx = r * g
        # over the rows (the leading axes, rstd's) or all but the channel axis
        summed = tuple(range(np.ndim(rstd))) if rows else (0, *range(2, x64.ndim))
        dweight = np.sum(np.abs(dy64) * (xhat + 1), axis=summed)
        dbias = np.sum(np.abs(dy64), axis=summed)
    # an infinite or NaN value (inf - inf, 0 * inf) makes its terms NaN, which no
    # comparison passes: an infinite bound instead, as the largest terms of all gave
    dx, dweight, dbias = (np.nan_to_num(t, nan=np.inf, posinf=np.inf) for t in (dx, dweight, dbias))
    return dx, dweight, dbias
