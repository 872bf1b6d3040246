"""Properties every layer has, on arrays, shapes and dtypes drawn by hypothesis (so a
failure shrinks to a small input):

- the output of each normalization group has mean 0 and variance var/(var + eps)
  (RMSNorm: mean square ms/(ms + eps));
- dx is orthogonal to the directions the output ignores: sum(dx) = 0 over each group
  (shifting a group does not change the output) and sum(dx * xhat) = 0 (nor does
  scaling it, with eps = 0);
- shifting a group's input leaves output and gradients unchanged; scaling the input
  by a power of two a with eps * a**2 scales dx by 1/a and leaves the rest unchanged;
- the analytical backward passes gradcheck;
- each fast kernel family (NumPy's, numba's) agrees with the generic (reference) kernels.

Tolerances follow the conditioning of each group: an error of one rounding in x
becomes ``|x| * rstd`` rounding errors in xhat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, reject
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import npnorm
from npnorm.functional._dispatch import generic_only

LAYER_NAMES = ["LayerNorm", "RMSNorm", "BatchNorm", "InstanceNorm", "GroupNorm"]
EPS = st.sampled_from([1e-5, 1e-3, 0.1])
DTYPES = hnp.floating_dtypes(sizes=(16, 32, 64), endianness="=")


@dataclass
class Case:
    """A layer configuration and its input shape, with the view of an input as its
    normalization groups: (number of groups, values per group)."""

    shape: tuple[int, ...]
    make: Callable[..., npnorm.Module]  # (eps=, dtype=) -> module in training mode
    groups: Callable[[np.ndarray], np.ndarray]
    ungroup: Callable[[np.ndarray], np.ndarray]
    centered: bool = True
    running_stats: bool = False


@st.composite
def cases(draw, name: str, min_group: int = 1, max_size: int = 96, affine: bool = False) -> Case:
    """A ``name`` layer (without affine map unless ``affine``) and an input shape of at
    most ``max_size`` elements whose groups hold at least ``min_group`` values (and 2
    for the layers whose training forward needs 2, as in torch)."""
    if name in ("LayerNorm", "RMSNorm"):
        norm = draw(
            hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=4).filter(
                lambda s: min_group <= int(np.prod(s)) <= max_size
            )
        )
        room = max_size // int(np.prod(norm))
        batch = draw(
            hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3).filter(
                lambda s: int(np.prod(s)) <= room
            )
        )
        shape = (*batch, *norm)
        cls = getattr(npnorm, name)
        extra = {} if name == "RMSNorm" else {"bias": affine}
        return Case(
            shape=shape,
            make=lambda **kw: cls(norm, elementwise_affine=affine, **extra, **kw),
            groups=lambda a: a.reshape(-1, int(np.prod(norm))),
            ungroup=lambda g: g.reshape(shape),
            centered=name == "LayerNorm",
        )
    low, high = {"BatchNorm": (0, 3), "InstanceNorm": (1, 3), "GroupNorm": (0, 2)}[name]
    spatial = draw(
        hnp.array_shapes(min_dims=low, max_dims=high, min_side=1, max_side=3).filter(
            lambda s: int(np.prod(s)) <= max_size // 2
        )
    )
    size = int(np.prod(spatial))
    num_groups = draw(st.integers(1, 3)) if name == "GroupNorm" else 1
    c = num_groups * draw(st.integers(1, 2)) if name == "GroupNorm" else draw(st.integers(1, 3))
    room = max_size // (c * size)
    need = max(min_group, 1 if name == "GroupNorm" else 2)
    per_group_size = {"BatchNorm": size, "InstanceNorm": size, "GroupNorm": c // num_groups * size}[name]
    if (
        room < 1
        or (name != "BatchNorm" and per_group_size < need)
        or (name == "BatchNorm" and room * size < need)
    ):
        reject()
    n = draw(st.integers(1 if name != "BatchNorm" else -(-need // size), min(3, room)))
    if name == "GroupNorm" and n * per_group_size == 1:
        reject()  # one value in all: an error, as in PyTorch
    shape = (n, c, *spatial)
    if name == "BatchNorm":
        cls = {2: npnorm.BatchNorm1d, 3: npnorm.BatchNorm1d, 4: npnorm.BatchNorm2d, 5: npnorm.BatchNorm3d}[
            len(shape)
        ]
        return Case(
            shape=shape,
            make=lambda **kw: cls(c, affine=affine, **kw),
            groups=lambda a: np.moveaxis(a, 1, 0).reshape(c, -1),
            ungroup=lambda g: np.moveaxis(g.reshape(c, n, *spatial), 0, 1),
            running_stats=True,
        )
    if name == "InstanceNorm":
        cls = {3: npnorm.InstanceNorm1d, 4: npnorm.InstanceNorm2d, 5: npnorm.InstanceNorm3d}[len(shape)]
        return Case(
            shape=shape,
            make=lambda **kw: cls(c, affine=affine, track_running_stats=True, **kw),
            groups=lambda a: a.reshape(n * c, -1),
            ungroup=lambda g: g.reshape(shape),
            running_stats=True,
        )
    return Case(
        shape=shape,
        make=lambda **kw: npnorm.GroupNorm(num_groups, c, affine=affine, **kw),
        groups=lambda a: a.reshape(n * num_groups, -1),
        ungroup=lambda g: g.reshape(shape),
    )


def floats(dtype: np.dtype, bound: float = 100.0) -> st.SearchStrategy[float]:
    return st.floats(-bound, bound, allow_nan=False, allow_subnormal=False, width=8 * dtype.itemsize)


def module_dtype(dtype: np.dtype) -> str:
    return "float32" if dtype == np.float16 else dtype.name  # float16 runs in float32


def conditioning(case: Case, x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Per element (broadcast from its group): rstd, and 1 + max|x| * rstd, the factor by
    which the group amplifies a rounding error of its input."""
    g = case.groups(x.astype(np.float64))
    second = (g * g).mean(axis=1) if not case.centered else g.var(axis=1)
    rstd = 1.0 / np.sqrt(second + eps)  # G
    amplify = 1.0 + np.abs(g).max(axis=1) * rstd  # G
    return (
        case.ungroup(np.broadcast_to(rstd[:, None], g.shape)),
        case.ungroup(np.broadcast_to(amplify[:, None], g.shape)),
    )


def assert_within(actual, expected, tol, what: str) -> None:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf
        err = np.abs(actual - expected)
        # NaN fails on either side (these properties hold on finite drawn data, and both
        # sides may come from the code under test: err > tol let an all-NaN run pass);
        # an infinite expected value needs the same value
        bad = ~np.where(np.isfinite(expected), err <= tol, actual == expected)
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.size} differ; worst {err.max():.3e} "
        f"(tolerance there {np.broadcast_to(tol, err.shape).flat[int(np.argmax(err - tol))]:.3e})"
    )


def dx_tolerance(unit, rstd, m: npnorm.Module, dy: np.ndarray, size: int):
    """dx = rstd * (a few means over the group of dy * weight * (1 or xhat)): each term
    carries the input's amplified rounding (``unit``)."""
    w = 1.0 if getattr(m, "weight", None) is None else float(np.abs(m.weight).max())
    return unit * rstd * w * (np.abs(dy.astype(np.float64)).max() + 1) * 4 * size


def with_params(m: npnorm.Module, data: st.DataObject) -> None:
    """Draw the module's parameters (and running statistics) with hypothesis."""
    state = {}
    for k, v in m.state_dict().items():
        if k == "num_batches_tracked":
            state[k] = data.draw(st.integers(0, 5))
        else:
            low = 0.25 if k in ("weight", "running_var") else -2.0
            state[k] = data.draw(
                hnp.arrays(np.float64, tuple(v.shape), elements=st.floats(low, 2.0, allow_subnormal=False)),
                label=k,
            )
    m.load_state_dict(state)


# --- statistics of the output --------------------------------------------------


@pytest.mark.parametrize("name", LAYER_NAMES)
@given(data=st.data(), dtype=DTYPES, eps=EPS)
def test_output_mean_and_variance_per_group(name, data, dtype, eps):
    case = data.draw(cases(name), label="case")
    x = data.draw(hnp.arrays(dtype, case.shape, elements=floats(dtype), fill=st.nothing()), label="x")
    y = case.make(eps=eps, dtype=module_dtype(dtype))(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    g, gy = case.groups(x.astype(np.float64)), case.groups(y.astype(np.float64))
    _, amplify = conditioning(case, x, eps)
    # G: the computation's rounding (float16 runs in float32), amplified, and y's to its dtype
    computed = 32 * np.finfo(module_dtype(dtype)).eps * case.groups(amplify).max(axis=1)
    tol = computed + np.finfo(dtype).eps * (1 + np.abs(gy).max(axis=1))
    spread = 2 * (1 + np.abs(gy).max(axis=1)) * tol  # G: error of a mean of squares
    if case.centered:
        var = g.var(axis=1)
        assert_within(gy.mean(axis=1), 0.0, tol, "mean of each group's output")
        assert_within(gy.var(axis=1), var / (var + eps), spread, "variance of each group's output")
    else:
        ms = (g * g).mean(axis=1)
        assert_within((gy * gy).mean(axis=1), ms / (ms + eps), spread, "mean square of each row's output")


# --- dx is orthogonal to shifts and scalings ---------------------------------------


@pytest.mark.parametrize("name", LAYER_NAMES)
@given(data=st.data())
def test_dx_is_orthogonal_to_what_the_output_ignores(name, data):
    """With eps = 0 the output ignores a shift (centred layers) and a scaling of each
    group, so dx has no component along 1 nor along xhat."""
    case = data.draw(cases(name, min_group=2), label="case")
    # distinct values keep every group's variance > 0; values of float32 range keep rstd**3 finite
    x = data.draw(
        hnp.arrays(np.float64, case.shape, elements=floats(np.dtype("float32")), unique=True), label="x"
    )
    dy = data.draw(
        hnp.arrays(np.float64, case.shape, elements=st.floats(-10, 10), fill=st.nothing()), label="dy"
    )
    # (BatchNorm refuses eps = 0 in training, as PyTorch's: the smallest normal eps moves
    # dx by eps*rstd**2 relative to its rounding scale, far below it)
    m = case.make(eps=np.finfo(np.float64).tiny if name == "BatchNorm" else 0.0, dtype="float64")
    xhat = m(x)  # no affine map: the output is xhat
    dx = m.backward(dy)
    gdx, gxhat, gdy = case.groups(dx), case.groups(xhat), case.groups(dy)
    rstd, amplify = (case.groups(a)[:, 0] for a in conditioning(case, x, 0.0))
    size = gdx.shape[1]
    # each dx is rstd * (a sum over the group of dy * (1 or xhat)): its rounding scale; and
    # products dy*(x - mean) below the normal range (dy 1e-308, x - mean 1e-12) lose digits:
    # up to the subnormal spacing each, which the term rstd * xhat * rstd * sum(...) / n
    # amplifies by rstd**2 (a drawn case: 3.8e-300 where the first part allowed 1.2e-301)
    scale = 64 * np.finfo(np.float64).eps * size * amplify * rstd * (np.abs(gdy).sum(axis=1) + 1e-300)
    scale = scale + 8 * size * rstd * rstd * np.finfo(np.float64).smallest_subnormal
    if case.centered:
        assert_within(gdx.sum(axis=1), 0.0, scale, "sum(dx) over each group")
    assert_within((gdx * gxhat).sum(axis=1), 0.0, scale * np.abs(gxhat).max(axis=1), "sum(dx * xhat)")


# The layers whose backward centres the recomputed xhat again in every kernel family, as
# the reference does (the fast kernels on the rows or channels far from 0, where the
# saved mean's rounding matters; the others: in the reference only, so far).
CENTRED_IN_EVERY_FAMILY = ["LayerNorm", "BatchNorm", "InstanceNorm", "GroupNorm"]


@pytest.mark.parametrize(
    "name, family",
    [(n, "reference") for n in LAYER_NAMES if n != "RMSNorm"]
    + [(n, f) for n in CENTRED_IN_EVERY_FAMILY for f in npnorm.kernels_available()[1:]],
)
@given(
    data=st.data(),
    dtype=st.sampled_from([np.dtype("float32"), np.dtype("float64")]),
    eps=EPS,
    base=st.floats(0.5, 1e3, width=32) | st.floats(-1e3, -0.5, width=32),
)
def test_a_constant_dy_gives_no_dx(name, family, data, dtype, eps, base):
    """A dy constant over each group moves every output of the group alike, which the
    centred layers (without weight) ignore: dx = 0. On nearly constant groups (values a
    few ulps apart, rstd ~ 1/sqrt(eps)) the saved mean's rounding leaves xhat off centre,
    and the reference's dx was 1e-2 in float32 (3x PyTorch's error on a drawn GroupNorm
    case) until its backward centred the recomputed xhat again; LayerNorm's "numpy" and
    "numba" kernels gave 2.4 until theirs did too, "numba"'s GroupNorm and InstanceNorm
    up to 3, and BatchNorm's fast kernels as much."""
    case = data.draw(cases(name, min_group=2), label="case")
    bumps = data.draw(hnp.arrays(np.int8, case.shape, elements=st.integers(-3, 3)), label="bumps")
    x = (dtype.type(base) + bumps.astype(dtype) * np.spacing(dtype.type(base))).astype(dtype)
    groups = case.groups(np.zeros(case.shape)).shape
    per_group = data.draw(hnp.arrays(dtype, (groups[0], 1), elements=floats(dtype, 10.0)), label="dy")
    dy = case.ungroup(np.broadcast_to(per_group, groups)).astype(dtype)
    m = case.make(eps=eps, dtype=dtype.name)
    with npnorm.use_kernels(family):
        m(x)
        dx = m.backward(dy)
    rstd, _ = conditioning(case, x, eps)
    assert_within(dx, 0.0, 4 * np.finfo(dtype).eps * rstd * (np.abs(dy) + 1e-30), "dx")


# --- equivariance --------------------------------------------------------------------


@pytest.mark.parametrize("name", LAYER_NAMES)
@given(data=st.data(), dtype=st.sampled_from([np.dtype("float32"), np.dtype("float64")]), eps=EPS)
def test_scaling_the_input_by_a_power_of_two(name, data, dtype, eps):
    """f(a x; eps a**2) = f(x; eps) and dx(a x) = dx(x) / a, exactly up to rounding (a = 2**k
    scales every intermediate exactly)."""
    case = data.draw(cases(name, affine=True), label="case")
    x = data.draw(hnp.arrays(dtype, case.shape, elements=floats(dtype), fill=st.nothing()), label="x")
    dy = data.draw(hnp.arrays(dtype, case.shape, elements=floats(dtype, 10.0), fill=st.nothing()), label="dy")
    a = 2.0 ** data.draw(st.integers(-3, 3), label="log2 a")
    m1, m2 = case.make(eps=eps, dtype=dtype.name), case.make(eps=eps * a * a, dtype=dtype.name)
    with_params(m1, data)
    m2.load_state_dict(m1.state_dict())
    y1, y2 = m1(x), m2((x * a).astype(dtype))
    dx1, dx2 = m1.backward(dy), m2.backward(dy)
    rstd, amplify = conditioning(case, x, eps)
    unit = 16 * np.finfo(dtype).eps * amplify
    size = case.groups(x).shape[1]
    assert_within(y2, y1, unit * (1 + np.abs(y1)), "output")
    assert_within(dx2 * a, dx1, dx_tolerance(unit, rstd, m1, dy, size), "dx * a")
    for k in m1.grads:
        tol = 16 * np.finfo(dtype).eps * amplify.max() * (1 + np.abs(dy).sum())
        assert_within(m2.grads[k], m1.grads[k], tol, f"grad {k}")


@pytest.mark.parametrize("name", [n for n in LAYER_NAMES if n != "RMSNorm"])
@given(data=st.data(), dtype=st.sampled_from([np.dtype("float32"), np.dtype("float64")]), eps=EPS)
def test_shifting_a_group_changes_nothing(name, data, dtype, eps):
    case = data.draw(cases(name, affine=True), label="case")
    x = data.draw(hnp.arrays(dtype, case.shape, elements=floats(dtype), fill=st.nothing()), label="x")
    dy = data.draw(hnp.arrays(dtype, case.shape, elements=floats(dtype, 10.0), fill=st.nothing()), label="dy")
    groups = case.groups(np.zeros(case.shape)).shape[0]
    shift = data.draw(
        hnp.arrays(np.float64, (groups, 1), elements=st.integers(-50, 50).map(float)), label="shift"
    )
    shifted = (x + case.ungroup(np.broadcast_to(shift, case.groups(np.zeros(case.shape)).shape))).astype(
        dtype
    )
    m1, m2 = case.make(eps=eps, dtype=dtype.name), case.make(eps=eps, dtype=dtype.name)
    with_params(m1, data)
    m2.load_state_dict(m1.state_dict())
    y1, y2 = m1(x), m2(shifted)
    dx1, dx2 = m1.backward(dy), m2.backward(dy)
    rstd, amplify = conditioning(case, shifted, eps)
    unit = 32 * np.finfo(dtype).eps * (amplify + conditioning(case, x, eps)[1])
    w = 1.0 if m1.weight is None else float(np.abs(m1.weight).max())
    size = case.groups(x).shape[1]
    assert_within(y2, y1, unit * (w + 1), "output")
    assert_within(dx2, dx1, dx_tolerance(unit, rstd, m1, dy, size), "dx")
    for k in m1.grads:
        tol = 32 * np.finfo(dtype).eps * (amplify.max() + 1) * (1 + np.abs(dy).sum())
        assert_within(m2.grads[k], m1.grads[k], tol, f"grad {k}")


# --- gradcheck -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYER_NAMES)
@given(data=st.data(), eps=st.sampled_from([1e-3, 0.1]), training=st.booleans())
def test_gradcheck(name, data, eps, training):
    case = data.draw(cases(name, max_size=24, affine=True), label="case")
    x = data.draw(hnp.arrays(np.float64, case.shape, elements=st.floats(-5, 5), fill=st.nothing()), label="x")
    m = case.make(eps=eps, dtype="float64")
    with_params(m, data)
    m.train(training)
    assert npnorm.gradcheck(m, x)


# --- fast kernels == the generic reference ----------------------------------------------


@pytest.mark.parametrize("family", npnorm.kernels_available()[1:])
@pytest.mark.parametrize("name", LAYER_NAMES)
@given(data=st.data(), dtype=DTYPES, eps=EPS, training=st.booleans())
def test_fast_kernels_equal_the_reference(family, name, data, dtype, eps, training):
    case = data.draw(cases(name, affine=True), label="case")
    x = data.draw(hnp.arrays(dtype, case.shape, elements=floats(dtype), fill=st.nothing()), label="x")
    dy = data.draw(hnp.arrays(dtype, case.shape, elements=floats(dtype, 10.0), fill=st.nothing()), label="dy")
    fast = case.make(eps=eps, dtype=module_dtype(dtype))
    with_params(fast, data)
    fast.train(training)
    ref = case.make(eps=eps, dtype=module_dtype(dtype))
    ref.load_state_dict(fast.state_dict())
    ref.train(training)
    with npnorm.use_kernels(family):
        y, dx = fast(x), fast.backward(dy)
    with generic_only():
        y_ref, dx_ref = ref(x), ref.backward(dy)
    assert y.dtype == y_ref.dtype == dx.dtype == x.dtype
    uses_running = case.running_stats and not training
    if uses_running:  # normalized by the running statistics: conditioning of those
        rv = ref.running_var.astype(np.float64)
        rstd_c = 1 / np.sqrt(rv + eps)
        rstd = np.broadcast_to(rstd_c.reshape((1, -1) + (1,) * (len(case.shape) - 2)), case.shape)
        amplify = 1 + (np.abs(x.astype(np.float64)) + np.abs(ref.running_mean).max()) * rstd
    else:
        rstd, amplify = conditioning(case, x, eps)
    ct_eps = np.finfo(module_dtype(dtype)).eps  # float16 runs in float32
    unit = 32 * ct_eps * amplify
    w = 1.0 if fast.weight is None else float(np.abs(fast.weight).max())
    size = case.groups(x).shape[1]
    y_ref64, dx_ref64 = np.abs(y_ref.astype(np.float64)), np.abs(dx_ref.astype(np.float64))
    rounded = 2 * np.finfo(dtype).eps  # each result's rounding to the data's dtype
    assert_within(y, y_ref, unit * (w + 2 + y_ref64) + rounded * y_ref64, "output")
    assert_within(dx, dx_ref, dx_tolerance(unit, rstd, fast, dy, size) + rounded * dx_ref64, "dx")
    for k in ref.grads:
        scale = np.abs(dy.astype(np.float64)).sum() + 1
        assert_within(fast.grads[k], ref.grads[k], 32 * ct_eps * amplify.max() * scale, f"grad {k}")
    for k, v in ref.buffers().items():
        tol = (
            0
            if k == "num_batches_tracked"
            else 32 * np.finfo(np.float32).eps * (1 + np.abs(v)) * amplify.max()
        )
        assert_within(fast.buffers()[k], v, tol, k)
