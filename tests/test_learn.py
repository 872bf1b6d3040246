"""npnorm.learn: the staged graphs, the step checker, the closed form, the command and the exercises.

- staged == npnorm.functional's closed form (float64, 1e-10) for every layer and mode, on
  hypothesis-drawn inputs, through the default (fast) and the generic kernels;
- every row of check_steps passes; a corrupted, missing or wrongly shaped step gradient is
  caught and named (a shape that would broadcast is still wrong);
- properties of the derivation: in training dx sums to zero over the reduced axes (per
  group) and xhat · dx = eps · rstd³ · (xhat · dxhat) (orthogonal when eps = 0); in eval
  dx = rstd · dxhat; the matrix view J = ∂xhat/∂x matches finite differences;
- python -m npnorm learn, and the exercises: solutions pass the grader, stubs fail it
  naming a step.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import npnorm.functional as F
from npnorm.functional._dispatch import generic_only
from npnorm.learn import (
    LAYERS,
    TODO,
    Tape,
    _baseline,
    _cli,
    check_steps,
    check_terms,
    closed_form,
    jacobian,
    numeric_gradient,
    staged_backward,
    staged_forward,
    staged_normalize,
)
from npnorm.learn._library import closed
from npnorm.learn.check import compare
from npnorm.learn.examples import example, upstream
from npnorm.learn.exercises import EXERCISES, grade, load

ROOT = Path(__file__).resolve().parent.parent

# --- hypothesis: the arguments of each layer's forward, drawn as arrays ---

values = st.floats(-10, 10, allow_nan=False, allow_infinity=False, width=64)
params = st.floats(-3, 3, allow_nan=False, allow_infinity=False, width=64)
EPS = st.sampled_from([1e-5, 1e-3, 0.5])


def arrays(shape, elements=values):
    return hnp.arrays(np.float64, shape, elements=elements, fill=st.nothing())


@st.composite
def layer_calls(draw, case: str, *, groups_of_two: bool = False):
    """``(name, args, kwargs)`` for one layer and mode; see CASES. ``groups_of_two``:
    every normalized group has at least two values (else a group of one value, which
    has variance 0, can be drawn)."""
    name, _, mode = case.partition(":")
    eps = draw(EPS)
    if name in ("layer_norm", "rms_norm"):
        batch = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=1, max_side=3))
        norm = draw(hnp.array_shapes(min_dims=2 if mode == "multi-axis" else 1, max_dims=2, max_side=4))
        x = draw(arrays(batch + norm))
        affine = mode != "no affine"
        w = draw(arrays(norm, params)) if affine else None
        if name == "rms_norm":
            return name, (x, norm, w), {"eps": draw(st.sampled_from([None, 1e-5, 0.5]))}
        b = draw(arrays(norm, params)) if affine else None
        return name, (x, norm, w, b, eps), {}
    n = draw(st.integers(1, 3))
    needs_spatial_axis = name == "instance_norm" or (name == "group_norm" and groups_of_two)
    spatial = draw(
        hnp.array_shapes(
            min_dims=1 if needs_spatial_axis else 0,
            max_dims=2,
            min_side=2 if groups_of_two else 1,
            max_side=3,
        )
    )
    if name == "group_norm":
        groups = {"1 group": 1, "C groups": draw(st.integers(1, 4)), "middle": draw(st.integers(2, 3))}[mode]
        per = {"1 group": draw(st.integers(1, 4)), "C groups": 1, "middle": draw(st.integers(2, 3))}[mode]
        c = groups * per
        assume(n * per * int(np.prod(spatial)) > 1)  # one value in all: an error, as in PyTorch
        x = draw(arrays((n, c, *spatial)))
        return name, (x, groups, draw(arrays((c,), params)), draw(arrays((c,), params)), eps), {}
    c = draw(st.integers(1, 3))
    x = draw(arrays((n, c, *spatial)))
    stats = mode in ("train", "input stats")
    per_statistic = x.size // c if name == "batch_norm" else x.size // (n * c)
    assume(not stats or per_statistic > 1)
    buffers = draw(st.booleans()) if stats else True
    rm = draw(arrays((c,), params)) if buffers else None
    rv = draw(arrays((c,), st.floats(0.1, 5.0, width=64))) if buffers else None
    affine = draw(st.booleans())
    w, b = (draw(arrays((c,), params)), draw(arrays((c,), params))) if affine else (None, None)
    flag = "training" if name == "batch_norm" else "use_input_stats"
    return name, (x, rm, rv, w, b), {flag: stats, "momentum": draw(st.sampled_from([0.1, 0.5])), "eps": eps}


CASES = [
    "batch_norm:train",
    "batch_norm:eval",
    "layer_norm:multi-axis",
    "layer_norm:no affine",
    "rms_norm:",
    "group_norm:1 group",
    "group_norm:middle",
    "group_norm:C groups",
    "instance_norm:input stats",
    "instance_norm:running stats",
]


def assert_close(staged, reference, what):
    assert staged.shape == reference.shape, what
    scale = max(1.0, float(np.max(np.abs(reference), initial=0.0)))
    np.testing.assert_allclose(staged, reference, rtol=1e-10, atol=1e-10 * scale, err_msg=what)


@pytest.mark.parametrize("case", CASES)
@given(data=st.data())
def test_staged_equals_closed_form(case, data):
    name, args, kwargs = data.draw(layer_calls(case))
    buffers = name in ("batch_norm", "instance_norm") and args[1] is not None
    running_mean = np.array(args[1], copy=True) if buffers else None  # as given
    tape = staged_forward(name, *args, **kwargs)
    dy = data.draw(arrays(tape.output.shape))
    grads = staged_backward(tape, dy)
    for kernels in ("default", "generic"):
        if kernels == "generic":
            with generic_only():
                lib = closed(name, args, kwargs, dy)
        else:
            lib = closed(name, args, kwargs, dy)
        assert_close(tape.output, lib["y"], f"{kernels}: y")
        for key in ("input", "weight", "bias"):
            assert (lib[key] is None) == (key not in grads), key
            if lib[key] is not None:
                assert_close(grads[key], lib[key], f"{kernels}: d{key}")
        for key, new in tape.updates.items():
            assert_close(new, lib[key], f"{kernels}: {key}")
        if buffers and not tape.updates:  # eval: buffers untouched (returned, not written), none staged
            assert np.array_equal(lib["running_mean"], running_mean)
            assert np.array_equal(args[1], running_mean)


@pytest.mark.parametrize("case", CASES)
def test_every_step_has_a_gradient_of_its_shape_and_every_check_passes(case):
    name, _, mode = case.partition(":")
    kw = {"eval": mode in ("eval", "running stats")}
    if name == "group_norm":
        kw["groups"] = {"1 group": 1, "middle": 3, "C groups": 6}[mode]
    args, kwargs = example(name, **kw)
    if mode == "no affine":
        args = (args[0], args[1])
    if mode == "multi-axis":
        assert len(args[1]) == 2
    tape = staged_forward(name, *args, **kwargs)
    assert len(tape.steps) >= 4 and all(node.formula.startswith(k) for k, node in tape.nodes.items())
    grads = staged_backward(tape, upstream(tape.output.shape))
    assert set(grads) == set(tape.steps) | set(tape.differentiable)
    assert all(grads[k].shape == tape[k].shape for k in grads)
    rows = check_steps(tape, grads)
    assert [r.name for r in rows] == [*tape.differentiable, *tape.steps]
    assert all(r.ok and r.shape_ok for r in rows), [str(r) for r in rows if not r.ok]


EXAMPLE_TAPES = ["batch_norm", "batch_norm eval", "layer_norm", "rms_norm", "group_norm", "instance_norm"]


def example_tape(which: str) -> Tape:
    name, _, mode = which.partition(" ")
    args, kwargs = example(name, eval=mode == "eval")
    return staged_forward(name, *args, **kwargs)


@pytest.mark.parametrize("which", EXAMPLE_TAPES)
def test_a_corrupted_step_gradient_is_caught_and_named(which):
    tape = example_tape(which)
    dy = upstream(tape.output.shape)
    grads = staged_backward(tape, dy)
    for name in grads:
        bad = dict(grads)
        g = grads[name].copy()
        g.reshape(-1)[g.size // 2] += 1e-3 * max(1.0, float(np.max(np.abs(g))))  # one element, 0.1% off
        bad[name] = g
        rows = check_steps(tape, bad, grad_output=dy)
        assert [r.name for r in rows if not r.ok] == [name], name


@pytest.mark.parametrize("which", EXAMPLE_TAPES)
def test_a_wrongly_shaped_step_gradient_is_flagged_even_when_it_broadcasts(which):
    tape = example_tape(which)
    dy = upstream(tape.output.shape)
    grads = staged_backward(tape, dy)
    for name in grads:
        bad = dict(grads)
        bad[name] = grads[name][None]  # the right values, with a leading axis: NumPy would broadcast it
        (row,) = check_steps(tape, bad, grad_output=dy, names=[name])
        assert not row.ok and not row.shape_ok and "would broadcast" in row.note, str(row)
    for name in (k for k, v in grads.items() if v.shape[0] == 1):  # per-channel statistics (1, C, 1, 1)
        bad = dict(grads)
        bad[name] = grads[name][0]  # (C, 1, 1): broadcasts against x, and is still the wrong shape
        (row,) = check_steps(tape, bad, grad_output=dy, names=[name])
        assert not row.ok and "would broadcast" in row.note, str(row)
    bad = dict(grads)
    bad["xhat"] = grads["xhat"][..., None]  # one axis too many
    (row,) = check_steps(tape, bad, grad_output=dy, names=["xhat"])
    assert not row.ok and row.got_shape == (*tape["xhat"].shape, 1)


def test_missing_todo_and_non_array_gradients_are_named():
    tape = example_tape("layer_norm")
    grads = dict(staged_backward(tape, upstream(tape.output.shape)))
    grads["var"] = TODO
    grads["rstd"] = [0.0]
    del grads["mean"]
    rows = {r.name: r for r in check_steps(tape, grads)}
    assert (
        "TODO" in rows["var"].note and "not an array" in rows["rstd"].note and "missing" in rows["mean"].note
    )
    assert [k for k, r in rows.items() if not r.ok] == ["mean", "var", "rstd"]
    assert "WRONG" in str(rows["var"]) and "ok" in str(rows["xc"])


def test_the_check_reruns_only_the_graph_after_the_perturbed_step():
    tape = example_tape("layer_norm")
    after_var = tape.rerun({"var": tape["var"] + 1.0})
    assert set(after_var) == {"var", "rstd", "xhat", "y"}
    assert set(tape.rerun({"weight": tape["weight"] * 2})) == {"weight", "y"}
    assert set(tape.rerun({"input": tape["input"] + 1.0})) == set(tape.steps) | {"input"}
    np.testing.assert_allclose(after_var["rstd"], 1 / np.sqrt(tape["var"] + 1.0 + 1e-5))
    held = tape.rerun({"input": tape["input"] + 1.0}, frozen={("input", "mean")})
    np.testing.assert_array_equal(held["xc"], (tape["input"] + 1.0) - tape["mean"])  # mean held as recorded


def test_the_check_needs_float64_and_the_output_shape():
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    tape = staged_normalize(x, 1, float64=False)
    assert tape.output.dtype == np.float32
    grads = staged_backward(tape, np.ones((4, 8), np.float32))
    assert grads["input"].dtype == np.float32
    with pytest.raises(TypeError, match="float64"):
        check_steps(tape, grads)
    tape64 = example_tape("layer_norm")
    grads = staged_backward(tape64, upstream(tape64.output.shape))
    with pytest.raises(ValueError, match="shape"):
        check_steps(tape64, grads, grad_output=np.ones(tape64.output.shape[1:]))
    with pytest.raises(ValueError, match="not a step"):
        check_steps(tape64, grads, names=["nope"])
    with pytest.raises(ValueError, match="shape"):  # broadcastable, still refused
        staged_backward(tape64, np.ones(tape64.output.shape[1:]))


@pytest.mark.parametrize("name", ["layer_norm", "batch_norm"])
@pytest.mark.parametrize("bias", [None, 1e-5, 1e-8])
def test_every_check_passes_on_centred_data_and_small_biases(name, bias):
    """Steps of values near 0 (the mean of centred rows or channels, a small bias) took
    steps of their own size, drowned in rounding: right gradients were called WRONG."""
    x = np.random.default_rng(3).standard_normal((4, 3, 5))
    axis = -1 if name == "layer_norm" else (0, 2)
    x = x - x.mean(axis=axis, keepdims=True)  # centred: the mean step is ~1e-17
    if name == "layer_norm":
        args = (x, 5, np.full(5, 1.5), None if bias is None else np.full(5, bias))
    else:
        args = (x, None, None, np.full(3, 1.5), None if bias is None else np.full(3, bias))
    kwargs = {} if name == "layer_norm" else {"training": True}
    tape = staged_forward(name, *args, **kwargs)
    rows = check_steps(tape, staged_backward(tape, upstream(tape.output.shape)))
    assert all(r.ok for r in rows), [str(r) for r in rows if not r.ok]


def test_a_numeric_gradient_that_is_nan_is_said_to_be_so():
    # a step so large that var + eps went below 0: the row read "var: WRONG: " with no reason
    tape = staged_forward("layer_norm", np.random.default_rng(0).standard_normal((2, 4)) * 1e-4, 4)
    grads = staged_backward(tape, upstream(tape.output.shape))
    [row] = check_steps(tape, grads, names=["var"], h=1e4)
    assert not row.ok and "numeric gradient is nan or inf" in str(row)


@pytest.mark.parametrize("axes", [2, -3, (0, 2), (1, -1)])
def test_staged_normalize_refuses_an_axis_out_of_range_or_repeated_as_numpy(axes):
    # it wrapped them (a % ndim): axis 2 of a 2-D input normalized axis 0, and (1, -1)
    # counted the values of axis 1 twice
    x = np.random.default_rng(0).standard_normal((4, 3))
    with pytest.raises(ValueError, match=r"out of bounds|repeated axis"):
        staged_normalize(x, axes)
    np.testing.assert_array_equal(staged_normalize(x, (-1,)).output, staged_normalize(x, 1).output)
    assert not np.allclose(staged_normalize(x, 0).output, staged_normalize(x, 1).output)


# --- properties that follow from the derivation ---


def batch_stat_cases():
    return [c for c in CASES if c.partition(":")[2] not in ("eval", "running stats")]


@pytest.mark.parametrize("case", batch_stat_cases())
@given(data=st.data())
def test_training_dx_sums_to_zero_and_is_orthogonal_to_xhat_up_to_eps(case, data):
    name, args, kwargs = data.draw(layer_calls(case, groups_of_two=True))
    tape = staged_forward(name, *args, **kwargs)
    st_ = tape.standardized
    assert st_ is not None and st_.batch_stats
    var = tape["var" if st_.center else "ms"]
    assume(float(np.min(var)) > 1e-3)  # away from a constant group, where rstd is 1/sqrt(eps)
    dy = data.draw(arrays(tape.output.shape))
    grads = staged_backward(tape, dy)
    dx = grads["input"].reshape(tape[st_.src].shape)  # per group: GroupNorm's (N, G, C/G·S) view
    xhat, dxhat, rstd = tape[st_.out], grads[st_.out], tape["rstd"]
    scale = max(1.0, float(np.max(np.abs(dx)) * st_.n))
    if st_.center:
        np.testing.assert_allclose(np.sum(dx, axis=st_.axes), 0.0, atol=1e-12 * scale)
    along = np.sum(xhat * dx, axis=st_.axes, keepdims=True)
    expected = st_.eps * rstd**3 * np.sum(xhat * dxhat, axis=st_.axes, keepdims=True)
    np.testing.assert_allclose(along, expected, atol=1e-11 * scale * float(np.max(np.abs(xhat))))


@given(x=arrays((5, 3, 4)), dy=arrays((5, 3, 4)))
def test_with_eps_0_dx_is_exactly_orthogonal_to_xhat(x, dy):
    assume(float(np.min(np.var(x, axis=(0, 2)))) > 1e-3)
    tape = staged_forward("batch_norm", x, None, None, training=True, eps=0.0)
    grads = staged_backward(tape, dy)
    dx = grads["input"]
    # rounding in dx is relative to its terms (dx itself may cancel to almost 0): bound it
    # by the direct term rstd * dxhat, summed against |xhat| over each channel
    term = np.max(np.abs(tape["rstd"] * grads["xhat"]), axis=(0, 2))  # C
    scale = np.sum(np.abs(tape["xhat"]), axis=(0, 2)) * term  # C
    np.testing.assert_array_less(np.abs(np.sum(tape["xhat"] * dx, axis=(0, 2))), 1e-13 * scale + 1e-300)


@pytest.mark.parametrize("case", ["batch_norm:eval", "instance_norm:running stats"])
@given(data=st.data())
def test_eval_dx_is_rstd_times_dxhat(case, data):
    name, args, kwargs = data.draw(layer_calls(case))
    tape = staged_forward(name, *args, **kwargs)
    grads = staged_backward(tape, data.draw(arrays(tape.output.shape)))
    np.testing.assert_allclose(grads["input"], tape["rstd"] * grads["xhat"], rtol=1e-14, atol=0)
    assert set(closed_form(tape, grads["xhat"])) == {"direct"}


@pytest.mark.parametrize("which", [*EXAMPLE_TAPES, "group_norm 1", "group_norm 6", "unbiased"])
def test_the_matrix_view_matches_finite_differences(which):
    if which == "unbiased":
        tape = staged_normalize(np.random.default_rng(2).normal(size=(6, 3)), 0, correction=1)
    elif which.startswith("group_norm "):
        args, kwargs = example("group_norm", groups=int(which.split()[1]))
        tape = staged_forward("group_norm", *args, **kwargs)
    else:
        tape = example_tape(which)
    J, J_num, xhat, rstd = jacobian(tape)
    np.testing.assert_allclose(J, J_num, atol=1e-7)
    np.testing.assert_array_equal(J, J.T)
    st_ = tape.standardized
    assert st_ is not None
    if st_.batch_stats:  # J · xhat = eps · rstd³ · xhat: dx is orthogonal to xhat up to eps
        np.testing.assert_allclose(J @ xhat, st_.eps * rstd**3 * xhat, atol=1e-13)
    if st_.batch_stats and st_.center:  # J · 1 = 0: dx sums to zero
        np.testing.assert_allclose(J @ np.ones(xhat.size), 0.0, atol=1e-13)
    dy = upstream(tape.output.shape)
    grads = staged_backward(tape, dy)
    sel = tuple(slice(None) if a in st_.axes else 0 for a in range(tape[st_.src].ndim))
    np.testing.assert_allclose(
        J @ grads[st_.out][sel].reshape(-1), grads[st_.src][sel].reshape(-1), atol=1e-12
    )


@given(x=arrays((2, 4, 3, 2)), dy=arrays((2, 4, 3, 2)), w=arrays((4,), params), b=arrays((4,), params))
def test_instance_norm_is_group_norm_with_one_channel_per_group_and_one_group_is_layer_norm(x, dy, w, b):
    def grads(name, *args):
        tape = staged_forward(name, *args)
        return tape.output, staged_backward(tape, dy)

    y_in, d_in = grads("instance_norm", x, None, None, w, b)
    y_gn, d_gn = grads("group_norm", x, 4, w, b)
    assert_close(y_in, y_gn, "y")
    for key in ("input", "weight", "bias"):
        assert_close(d_in[key], d_gn[key], key)
    y_one, d_one = grads("group_norm", x, 1)
    y_ln, d_ln = grads("layer_norm", x, (4, 3, 2))
    assert_close(y_one, y_ln, "y")
    assert_close(d_one["input"], d_ln["input"], "dx")


# --- the closed form, term by term ---


@pytest.mark.parametrize("which", [t for t in EXAMPLE_TAPES if t != "batch_norm eval"] + ["unbiased"])
def test_each_term_matches_its_paths_and_the_terms_sum_to_dx(which):
    if which == "unbiased":
        tape = staged_normalize(np.random.default_rng(2).normal(size=(6, 3)), 0, correction=1)
    else:
        tape = example_tape(which)
    dy = upstream(tape.output.shape)
    grads = staged_backward(tape, dy)
    st_ = tape.standardized
    assert st_ is not None
    terms = closed_form(tape, grads[st_.out])
    assert len(terms) == (3 if st_.center else 2)
    rows = check_terms(tape, terms, grad_output=dy)
    assert all(r.ok for r in rows), [str(r) for r in rows]
    np.testing.assert_allclose(sum(terms.values()), grads[st_.src], atol=1e-13)
    for name in terms:  # each wrong term is named, and only it
        bad = dict(terms)
        bad[name] = terms[name] * 1.01 + 1e-3
        assert [r.name for r in check_terms(tape, bad, grad_output=dy) if not r.ok] == [name]


def test_the_biased_closed_form_is_wrong_for_the_n_minus_1_graph():
    tape = staged_normalize(np.random.default_rng(2).normal(size=(6, 3)), 0, correction=1)
    biased = staged_normalize(tape["input"], 0)
    dy = upstream(tape.output.shape)
    grads = staged_backward(tape, dy)
    mixed = closed_form(biased, grads["xhat"])  # the / n formula ...
    mixed["direct"] = tape["rstd"] * grads["xhat"]  # ... with this graph's rstd and xhat
    mixed["mean"] = closed_form(tape, grads["xhat"])["mean"]
    mixed["var"] = -tape["rstd"] * tape["xhat"] * np.mean(grads["xhat"] * tape["xhat"], axis=0, keepdims=True)
    assert [r.name for r in check_terms(tape, mixed, grad_output=dy) if not r.ok] == ["var"]
    with pytest.raises(ValueError, match=r"pass grad_output: the upstream gradient dy") as info:
        check_terms(tape, mixed, grad_output=None)  # it named a grads argument check_terms lacks
    assert "grads" not in str(info.value)


# --- arguments and errors: exactly those of npnorm.functional ---


@pytest.mark.parametrize("name", list(LAYERS))
def test_staged_forward_takes_the_arguments_of_the_functional_forward(name):
    ours = inspect.signature(LAYERS[name]).parameters
    theirs = inspect.signature(getattr(F, f"{name}_forward")).parameters
    # every argument but ``out=``, the functional forward's output buffer: a tape makes its own
    theirs = {k: p for k, p in theirs.items() if k != "out"}
    assert [(p.name, p.default, p.kind) for p in ours.values()] == [
        (p.name, p.default, p.kind) for p in theirs.values()
    ]


BAD_CALLS = [
    ("layer_norm", ((2, 3), (4,)), {}),  # input does not end in the normalized shape
    ("layer_norm", ((2, 3), 3, np.ones(4)), {}),  # weight of the wrong shape
    ("layer_norm", ((2, 3), 3), {"eps": -1.0}),
    ("rms_norm", ((2, 3), 3, np.ones((1, 3))), {}),
    ("batch_norm", ((1, 3), None, None), {"training": True}),  # one value per channel
    ("batch_norm", ((4, 3), None, None), {"training": False}),  # eval without buffers
    ("batch_norm", ((4, 3), np.zeros(3), None), {"training": True}),  # buffers not paired
    ("batch_norm", ((4, 3), np.zeros(2), np.ones(2)), {"training": True}),
    ("group_norm", ((2, 6, 4), 4), {}),  # 6 channels in 4 groups
    ("instance_norm", ((2, 3), None, None), {}),  # no spatial axis
    ("instance_norm", ((2, 3, 1), None, None), {}),  # one spatial element
    ("group_norm", ((1, 3), 3), {}),  # one value per group (the staged form ran: zeros)
    # empty inputs the functional form refuses: its error, not the staged graph's "needs values"
    ("batch_norm", ((1, 0), None, None), {"training": True}),  # one value per channel (C = 0)
    ("instance_norm", ((0, 3, 1), None, None), {}),  # one spatial element
    ("instance_norm", ((2, 3, 0), None, None), {"use_input_stats": False}),  # no buffers
]


@pytest.mark.parametrize("name,args,kwargs", BAD_CALLS)
def test_bad_arguments_raise_what_the_functional_forward_raises(name, args, kwargs):
    x = np.random.default_rng(0).normal(size=args[0])
    call = (x, *args[1:])
    with pytest.raises(Exception) as theirs:
        getattr(F, f"{name}_forward")(*call, **kwargs)
    with pytest.raises(type(theirs.value)) as ours:
        staged_forward(name, *call, **kwargs)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize(
    "name,args,kwargs",
    [
        ("instance_norm", ((2, 3), np.zeros(3), np.ones(3)), {"use_input_stats": False}),
        ("batch_norm", ((6, 3), np.zeros(3), np.ones(3)), {"training": True}),
        ("batch_norm", ((6, 3), np.zeros(3), np.ones(3)), {"training": False}),
    ],
)
def test_what_the_functional_forward_takes_the_staged_one_takes(name, args, kwargs):
    """(N, C) input to InstanceNorm with running statistics, as the functional form and
    PyTorch take it (the staged form wanted 3 dims); its output and updates are the
    functional's, and every step checks."""
    x = np.random.default_rng(0).normal(size=args[0])
    theirs = getattr(F, f"{name}_forward")(x, *args[1:], **kwargs)
    tape = staged_forward(name, x, *args[1:], **kwargs)
    np.testing.assert_allclose(tape.output, theirs[0], rtol=1e-12, atol=1e-12)
    for key, value in zip(("running_mean", "running_var"), theirs[3:], strict=True):
        np.testing.assert_allclose(tape.updates.get(key, args[1 if key == "running_mean" else 2]), value)
    rows = check_steps(tape, staged_backward(tape, upstream(tape.output.shape)))
    assert all(r.ok for r in rows), [str(r) for r in rows if not r.ok]


@pytest.mark.parametrize(
    "name,args,kwargs",
    [
        ("batch_norm", ((0, 3), None, None), {"training": True}),
        ("batch_norm", ((0, 3, 4), None, None), {"training": False}),  # eval without buffers
        ("instance_norm", ((2, 3, 0), None, None), {}),
        ("group_norm", ((0, 6, 2), 3), {}),
    ],
)
def test_an_empty_batch_says_the_staged_graph_needs_values(name, args, kwargs):
    """The functional forms take an empty batch (empty outputs); the staged graph, which
    takes means of what it holds, says it needs values (BatchNorm and InstanceNorm
    said "Expected more than 1 value", GroupNorm raised ZeroDivisionError)."""
    x = np.zeros(args[0])
    assert getattr(F, f"{name}_forward")(x, *args[1:], **kwargs)[0].shape == x.shape
    with pytest.raises(ValueError, match=f"the staged {name} needs values to run: input of shape"):
        staged_forward(name, x, *args[1:], **kwargs)


def test_only_numpy_float_arrays_and_known_layers():
    import array_api_strict as xps

    with pytest.raises(TypeError, match="NumPy"):
        staged_forward("layer_norm", xps.ones((2, 3), dtype=xps.float64), 3)
    with pytest.raises(TypeError):
        staged_forward("layer_norm", np.ones((2, 3), dtype=np.int64), 3)
    with pytest.raises(ValueError, match="unknown layer"):
        staged_forward("dropout", np.ones((2, 3)), 3)
    with pytest.raises(TypeError, match="Tape"):
        staged_backward(np.ones(3), np.ones(3))


def test_the_tape_copies_its_inputs_and_rms_eps_follows_the_library():
    x = np.random.default_rng(0).normal(size=(2, 4))
    tape = staged_forward("layer_norm", x, 4)
    x[...] = 0.0
    assert np.any(tape["input"] != 0.0)
    assert staged_forward("rms_norm", x.astype(np.float32), 4).standardized.eps == np.finfo(np.float32).eps
    assert staged_forward("rms_norm", x, 4).standardized.eps == np.finfo(np.float64).eps


# --- the benchmark's textbook baseline is this module's staged graph ---


@pytest.mark.parametrize("layer", ["LayerNorm", "RMSNorm", "BatchNorm2d", "InstanceNorm2d", "GroupNorm"])
def test_the_benchmark_baseline_is_the_staged_graph_and_matches_the_library(layer):
    from npnorm._bench import Spec, _textbook_pair

    assert _textbook_pair.__globals__["textbook"] is _baseline
    shape = (2, 32, 3, 3) if layer != "LayerNorm" and layer != "RMSNorm" else (2, 3, 8)
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype(np.float32)
    dy = rng.normal(size=shape).astype(np.float32)
    fwd, bwd = _textbook_pair(Spec(layer, shape))
    out = fwd(x)
    dx = bwd(dy, out)[0]
    assert out[0].dtype == np.float32 and dx.dtype == np.float32
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    c = shape[1]
    if layer == "LayerNorm":
        y, m, r = F.layer_norm_forward(x64, 8, np.ones(8), np.zeros(8))
        ref = F.layer_norm_backward(dy64, x64, 8, m, r, np.ones(8), np.zeros(8))[0]
    elif layer == "RMSNorm":
        y, r = F.rms_norm_forward(x64, 8, np.ones(8), eps=1e-5)
        ref = F.rms_norm_backward(dy64, x64, 8, r, np.ones(8))[0]
    elif layer == "BatchNorm2d":
        y, m, r, _, _ = F.batch_norm_forward(x64, None, None, np.ones(c), np.zeros(c), training=True)
        ref = F.batch_norm_backward(dy64, x64, m, r, np.ones(c), np.zeros(c), training=True)[0]
    elif layer == "InstanceNorm2d":
        y, m, r, _, _ = F.instance_norm_forward(x64)
        ref = F.instance_norm_backward(dy64, x64, m, r)[0]
    else:
        y, m, r = F.group_norm_forward(x64, 32, np.ones(c), np.zeros(c))
        ref = F.group_norm_backward(dy64, x64, 32, m, r, np.ones(c), np.zeros(c))[0]
    np.testing.assert_allclose(out[0], y, atol=1e-5)
    np.testing.assert_allclose(dx, ref, atol=1e-4)


# --- python -m npnorm learn ---


@pytest.mark.parametrize(
    "argv,expect",
    [
        (["batch_norm"], "all 9 gradients match finite differences"),
        (["batch_norm", "--eval"], "all 9 gradients match finite differences"),
        (["rms_norm"], "all 6 gradients match finite differences"),
        (["group_norm"], "all 11 gradients match finite differences"),
        (["group_norm", "--groups", "6"], "all 11 gradients match finite differences"),
        (["instance_norm"], "all 9 gradients match finite differences"),
        (["instance_norm", "--eval"], "all 9 gradients match finite differences"),
        (["layer_norm", "--staged-vs-closed"], "equal to 1e-10"),
        (["batch_norm", "--eval", "--staged-vs-closed"], "equal to 1e-10"),
        (["group_norm", "--staged-vs-closed"], "equal to 1e-10"),
        (["rms_norm", "--matrix"], "J is symmetric"),
        (["bessel"], "term 3 with / n (the biased closed form on the n-1 graph): WRONG\n"),
        ([], "exercises: batch_norm_staged"),
    ],
)
def test_the_learn_command(capsys, argv, expect):
    assert _cli.main(argv) == 0
    out = capsys.readouterr().out
    assert expect in out, out
    assert "WRONG" not in out.replace("): WRONG", "")  # the bessel line shows a wrong formula on purpose


def test_python_m_npnorm_learn_layer_norm_prints_a_passing_step_table():
    out = subprocess.run(
        [sys.executable, "-m", "npnorm", "learn", "layer_norm"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    for step, formula in [
        ("mean", "mean = Σ x / n"),
        ("var", "var = Σ xc² / n"),
        ("xhat", "xhat = xc · rstd"),
    ]:
        assert any(line.split()[1:2] == [step] and formula in line for line in out.stdout.splitlines())
    assert "all 9 gradients match finite differences" in out.stdout


def test_the_learn_command_refuses_bad_arguments(capsys):
    bad = (["dropout"], ["layer_norm", "--eval"], ["check"], ["layer_norm", "extra"], ["check", "no_such"])
    for argv in (*bad, ["check", "/no/such/dir/rms_norm.py"]):
        with pytest.raises(SystemExit) as exit_:
            _cli.main(argv)
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown exercise 'no_such'" in err and "no file /no/such/dir/rms_norm.py" in err


# --- the exercises ---


def test_an_exercise_outside_a_checkout_says_where_the_exercises_are(tmp_path, monkeypatch):
    """Installed from a wheel, npnorm has no exercises/ beside it: the error says that they
    come with the source repository (it named two paths that could not exist)."""
    from npnorm.learn import exercises

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(exercises, "__file__", str(tmp_path / "site-packages" / "npnorm" / "learn" / "x.py"))
    with pytest.raises(FileNotFoundError, match="come with npnorm's source repository"):
        exercises.find("batch_norm_staged")


@pytest.mark.parametrize("name", list(EXERCISES))
def test_each_solution_passes_the_grader_in_ci(name):
    out = subprocess.run(
        [sys.executable, "-m", "npnorm", "learn", "check", name, "--solution"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout


@pytest.mark.parametrize("name", list(EXERCISES))
def test_each_stub_fails_the_grader_naming_the_wrong_step(name, capsys):
    path = ROOT / "exercises" / f"{name}.py"
    assert "TODO" in path.read_text()
    assert _cli.main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    first = next(line for line in out.splitlines() if line.startswith("FAIL"))
    assert "Wrong step: `" in first or "Wrong term: `" in first, first
    assert "not filled in" in first


@pytest.mark.parametrize("name", [n for n, e in EXERCISES.items() if e.function != "closed_form"])
def test_a_solution_with_one_wrong_step_is_named(name):
    exercise = EXERCISES[name]
    solution = load(ROOT / "exercises" / "solutions" / f"{name}.py", exercise.function)
    result = grade(exercise, solution)
    assert result.ok, result.message()
    for step in [r.name for r in result.rows]:

        def wrong(*args, step=step):
            d = dict(solution(*args))
            d[step] = d[step] * 1.01
            return d

        bad = grade(exercise, wrong)
        assert bad.first_wrong is not None and bad.first_wrong.name == step
        assert f"Wrong step: `{step}`" in bad.message()


def test_an_exercise_that_raises_is_reported_not_crashed():
    exercise = EXERCISES["rms_norm"]

    def broken(t, dy):
        return {"y": dy, "weight": t["no_such_step"]}

    result = grade(exercise, broken)
    assert not result.ok and "no step 'no_such_step' on this tape" in result.message()


def test_the_package_docstring_example_runs():
    import doctest

    import npnorm.learn

    result = doctest.testmod(npnorm.learn)
    assert result.attempted >= 5 and result.failed == 0
    assert npnorm.learn is __import__("npnorm").learn  # public from `import npnorm`


def test_an_exercise_that_writes_into_the_tape_cannot_fool_the_grader():
    exercise = EXERCISES["rms_norm"]
    solution = load(ROOT / "exercises" / "solutions" / "rms_norm.py", "backward")

    def vandal(t, dy):
        d = solution(t, dy)
        t["input"][...] = 0.0  # would make the finite differences agree with anything
        t["xhat"][...] = 0.0
        d["weight"] = d["weight"] * 0.0
        return d

    result = grade(exercise, vandal)
    assert not result.ok and "your backward changed its argument t['input'] in place" in result.message()


@pytest.mark.parametrize(
    "name, write",
    [
        ("batch_norm_staged", lambda args: args[1].__setitem__(..., 0.0)),  # dy
        ("batch_norm_staged", lambda args: args[0]["rstd"].__imul__(2.0)),  # a step of the tape
        ("closed_form", lambda args: args[0].__isub__(1.0)),  # dxhat
        ("unbiased_variance", lambda args: args[2].__imul__(1.5)),  # rstd
        ("cache_vs_recompute", lambda args: args[1].__isub__(args[2][:, :, None, None])),  # x -= mean
    ],
)
def test_an_exercise_that_writes_into_an_argument_fails(name, write):
    """The grader hands the function copies, so a write could not change the check; but a
    backward that overwrites what it reads breaks the code that reads it after (x -= mean
    in a backward from the saved statistics left the caller's x equal to xhat)."""
    exercise = EXERCISES[name]
    solution = load(ROOT / "exercises" / "solutions" / f"{name}.py", exercise.function)

    def writes(*args):
        result = solution(*args)
        write(args)
        return result

    result = grade(exercise, writes)
    assert not result.ok and not result.rows and "in place" in result.message(), result.message()
    assert grade(exercise, solution).ok


@pytest.mark.parametrize(
    "name, old, new",
    [
        ("batch_norm_staged", "n = x.shape[0] * x.shape[2] * x.shape[3]", "n = 16"),
        ("batch_norm_staged", "n = x.shape[0] * x.shape[2] * x.shape[3]", "n = x.shape[0] ** 2"),
        ("group_norm", 'n = t["xg"].shape[2]', "n = x.shape[0] * x.shape[2] * x.shape[3]"),
        ("group_norm", 'n = t["xg"].shape[2]', "n = x.size // (x.shape[0] * 3)"),  # G = 3 hard-coded
        ("group_norm", 'n = t["xg"].shape[2]', "n = 2 * x.shape[2] * x.shape[3]"),  # 2 channels a group
        ("group_norm", 'n = t["xg"].shape[2]', "n = x.shape[1] // 3 * x.shape[2] * x.shape[3]"),
        ("layer_norm", 'n = t["input"].shape[2] * t["input"].shape[3]', "n = 4 * 5"),
        ("closed_form", "axis=axes", "axis=(0, 2, 3)"),
        # eps left out, (ms)^(-3/2): the first example's eps is float64's epsilon
        ("rms_norm", 't["rstd"] ** 3', 't["ms"] ** -1.5'),
    ],
)
def test_a_solution_right_only_for_the_first_example_fails_on_the_second(tmp_path, name, old, new):
    """Counts written for the first example's sizes (n = N**2 where N·H·W = 16 = N**2), axes
    hard-coded, eps left out where the first example's is negligible: the second example,
    of other sizes (and eps), fails them."""
    text = (ROOT / "exercises" / "solutions" / f"{name}.py").read_text()
    if old not in text:  # (the solution spells it otherwise: find the line to change)
        pytest.fail(f"{old!r} is not in solutions/{name}.py")
    path = tmp_path / f"{name}.py"
    path.write_text(text.replace(old, new))
    exercise = EXERCISES[name]
    result = grade(exercise, load(path, exercise.function))
    assert not result.ok and len(result.passed_before) == 1, result.message()
    assert result.message().startswith("FAIL") and "on the second example (" in result.message()
    assert "written for the first example's sizes" in result.message()


def test_every_exercise_has_a_second_example_of_other_sizes():
    for name, exercise in EXERCISES.items():
        first, second = (make() for make in exercise.examples)
        assert first["input"].shape != second["input"].shape, name
        result = grade(exercise, load(ROOT / "exercises" / "solutions" / f"{name}.py", exercise.function))
        assert result.ok and "on both examples" in result.message(), (name, result.message())


@pytest.mark.parametrize("use", ["multiply", "method"])
def test_a_step_that_reads_a_todo_says_to_fill_them_in_order(use):
    exercise = EXERCISES["rms_norm"]

    def partial(t, dy):
        from npnorm.learn import TODO

        d = {"y": dy, "weight": TODO}
        d["xhat"] = dy * d["weight"] if use == "multiply" else d["weight"].sum(axis=0)  # reads the TODO
        return d

    result = grade(exercise, partial)
    assert not result.ok and "reads the gradient of a step still TODO" in result.message()
    assert "raised an error:\n" in result.message()  # (the first example: no example named)


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "--solution", "rms_norm"],
        ["--solution", "check", "rms_norm"],
        ["check", "rms_norm", "--solution"],
    ],
)
def test_options_may_come_between_check_and_its_exercise(argv, monkeypatch, capsys):
    """check --solution NAME was 'unrecognized arguments: NAME' (argparse's two optional
    positionals): options go anywhere among them."""
    monkeypatch.chdir(ROOT)
    assert _cli.main(argv) == 0
    assert "PASS" in capsys.readouterr().out


def test_the_overview_says_where_the_pages_and_exercises_are(capsys):
    """The overview names docs/ and exercises/ paths, which an installed package lacks:
    it says they are the source repository's."""
    assert _cli.main([]) == 0
    assert "in npnorm's source repository, not in an installed package" in capsys.readouterr().out


@pytest.mark.parametrize("topic", [["layer_norm"], ["batch_norm", "--eval"], ["sync_batch_norm"]])
def test_a_topic_names_its_page_where_it_can_be_opened(topic, tmp_path, monkeypatch, capsys):
    """Each topic ends with the derivation page it follows. From a checkout the line is a path
    that opens from the working directory; installed, npnorm has no docs/, and the line says the
    page is the source repository's (it named a docs/ path that did not exist)."""
    from npnorm.learn import _pages

    assert _cli.main(topic) == 0
    shown = capsys.readouterr().out.splitlines()[-1].removeprefix("the derivation: ")
    assert (ROOT / shown).is_file() or Path(shown).is_file(), shown
    monkeypatch.chdir(tmp_path)
    assert _cli.main(topic) == 0
    shown = capsys.readouterr().out.splitlines()[-1].removeprefix("the derivation: ")
    assert Path(shown).is_absolute() and Path(shown).is_file(), shown
    monkeypatch.setattr(_pages, "CHECKOUT", tmp_path / "site-packages")
    assert _cli.main(topic) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("the derivation: docs/derivations/") and "source repository" in last, last


def test_the_overview_survives_python_OO():
    """``python -OO`` strips docstrings: the overview printed ``None`` where its usage was."""
    out = subprocess.run(
        [sys.executable, "-OO", "-m", "npnorm", "learn"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("python -m npnorm learn: print the staged graphs"), out.stdout[:200]


@pytest.mark.parametrize("where", ["in the function", "at import"])
def test_a_learners_sys_exit_is_a_failure(where, tmp_path, capsys):
    """Learner code that calls ``sys.exit()`` (a debug line left in) fails the check with
    its traceback; the grader printed nothing more and exited 0 before."""
    body = "import sys\n"
    if where == "at import":
        body += "raise SystemExit(0)\n"
    body += "def backward(t, dy):\n    sys.exit()\n"
    path = tmp_path / "rms_norm.py"
    path.write_text(body)
    assert _cli.main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "SystemExit" in out, out


@pytest.mark.parametrize(
    "argv, match",
    [
        # options check does not take were ignored (--solution with a file graded the file)
        (["check", "exercises/layer_norm.py", "--solution"], "--solution takes an exercise name"),
        (["check", "layer_norm", "--eval"], "check takes an exercise and --solution only"),
        (["check", "layer_norm", "--split", ""], "check takes an exercise and --solution only"),
        (["layer_norm", "--solution"], "--solution applies to check"),
        # a copy under another name was refused without saying why
        (["check", __file__], "a file is graded as the exercise its name names"),
        # a number of groups that does not divide the 6 channels printed a traceback
        (["group_norm", "--groups", "4"], "--groups must divide the 6 channels: 1, 2, 3 or 6 (got 4)"),
        (["group_norm", "--groups", "0"], "--groups must divide the 6 channels"),
        (["batch_norm", "--groups", "3"], "--groups applies to group_norm"),  # was ignored
        # options the topic would ignore
        (["layer_norm", "--staged-vs-closed", "--matrix"], "choose one"),
        (["bessel", "--matrix"], "bessel takes no options"),
        (["bessel", "--eval"], "bessel takes no options"),
        (["bessel", "--groups", "3"], "bessel takes no options"),
        (["sync_batch_norm", "--groups", "3"], "sync_batch_norm takes --split only"),
        # a value that begins with "-" was taken for an option: "expected one argument"
        (["sync_batch_norm", "--split", "-1,3"], "counts >= 0, one sample at least; got '-1,3'"),
        (["--split", "-1", "sync_batch_norm"], "two ranks at least"),
    ],
)
def test_options_a_topic_does_not_take_are_usage_errors(argv, match, capsys):
    """Options the topic or command would ignore, and bad values, are usage errors (exit 2)
    that say what is expected (options a topic ignored ran the plain topic, exit 0)."""
    with pytest.raises(SystemExit) as info:
        _cli.main(argv)
    assert info.value.code == 2
    assert match in capsys.readouterr().err


def test_a_closed_form_of_the_wrong_type_is_not_said_to_have_raised(tmp_path, capsys):
    """A closed form that returns a list fails with what it must return, not as an error it
    raised (it read "raised an error: ... must return a dict")."""
    from npnorm.learn.exercises import EXERCISES as ALL

    name = next(n for n, e in ALL.items() if e.function == "closed_form")
    path = tmp_path / f"{name}.py"
    path.write_text("def closed_form(dxhat, xhat, rstd, axes):\n    return [dxhat]\n")
    assert _cli.main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL: your closed_form must return a dict of terms" in out and "raised" not in out, out


def test_closed_form_and_check_steps_say_what_they_take():
    """A wrong argument to closed_form or check_steps is an error that says what was
    expected (a raw AxisError, an AttributeError, or 'pass grad_output' before)."""
    from npnorm.learn import check_steps, closed_form, staged_forward

    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    tape = staged_forward("layer_norm", x, 4)
    with pytest.raises(ValueError, match=r"dxhat must have the shape of the tape's 'xhat', \(2, 3, 4\)"):
        closed_form(tape, np.ones((2, 3)))
    with pytest.raises(TypeError, match="closed_form takes the tape of a normalization"):
        closed_form(None, np.ones((2, 3, 4)))
    with pytest.raises(TypeError, match=r"grads must map step names to gradients.*got list"):
        check_steps(tape, [1, 2])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "offset,scale",
    [(0.0, 1e-3), (0.0, 1e-2), (0.0, 1e2), (1e2, 0.1), (1e3, 0.1), (1e4, 1.0)],
)
def test_every_check_passes_on_data_far_from_unit_scale(case, offset, scale):
    """The step h_i = h·max(1, |s_i|) was 1% of a variance of 1e-4 and of a spread of 0.1
    about 1000: right gradients were called WRONG (and a mean square pushed below 0 gave
    NaN). Now the step follows the element's magnitude, with Richardson extrapolation."""
    name, _, mode = case.partition(":")
    kw = {"eval": mode in ("eval", "running stats")}
    if name == "group_norm":
        kw["groups"] = {"1 group": 1, "middle": 3, "C groups": 6}[mode]
    args, kwargs = example(name, **kw)
    x = offset + scale * np.asarray(args[0])
    if name in ("batch_norm", "instance_norm") and args[1] is not None:  # running stats to match
        args = (x, offset + scale * args[1], scale * scale * args[2], *args[3:])
    else:
        args = (x, *args[1:])
    tape = staged_forward(name, *args, **kwargs)
    grads = staged_backward(tape, upstream(tape.output.shape))
    rows = check_steps(tape, grads)
    assert all(r.ok for r in rows), [str(r) for r in rows if not r.ok]


def test_python_m_npnorm_learn_runs_the_same_command():
    # "npnorm.learn is a package and cannot be directly executed" before
    def run(*argv):
        cmd = [sys.executable, "-m", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)

    out, same = run("npnorm.learn", "layer_norm"), run("npnorm", "learn", "layer_norm")
    assert out.returncode == 0 and out.stdout == same.stdout, out.stderr


def _grade_solution_changed(name, change):
    """The grade of exercise ``name``'s solution with ``change`` applied to what it returns."""
    exercise = EXERCISES[name]
    solution = load(ROOT / "exercises" / "solutions" / f"{name}.py", exercise.function)

    def changed(*args):
        return change(solution(*args))

    return grade(exercise, changed)


def test_a_key_that_names_no_step_is_named_in_the_grade():
    """A misspelt key next to the right one passed unseen, and one in place of it was only
    'missing'."""
    passed = _grade_solution_changed("batch_norm_staged", lambda d: {**d, "variance": d["var"]})
    assert passed.ok and passed.message().endswith(
        "Not checked: 'variance', no step of this exercise (a typo?)."
    )
    failed = _grade_solution_changed(
        "closed_form", lambda d: {"var0" if k == "mean" else k: v for k, v in d.items()}
    )
    assert not failed.ok
    assert "missing (no gradient given). Not checked: 'var0', no term of this exercise" in failed.message()


def test_a_term_of_a_statistics_shape_is_told_to_broadcast():
    result = _grade_solution_changed(
        "closed_form", lambda d: {**d, "mean": np.asarray(d["mean"])[:1, :, :1, :1]}
    )
    assert "where the term has shape (4, 3, 2, 2)" in result.message()
    assert "np.broadcast_to(term, shape)" in result.message()


def test_a_small_real_error_is_not_passed_off_as_rounding():
    """eps left out of dvar fails at ~4e-6 of the gradient: the message looked like noise."""
    result = _grade_solution_changed("batch_norm_staged", lambda d: {**d, "var": d["var"] * (1 + 4e-6)})
    assert not result.ok and result.first_wrong is not None and result.first_wrong.name == "var"
    assert "small, but far above rounding in float64, so a real difference" in result.message()


def test_a_broadcast_error_points_back_at_the_shapes_of_earlier_gradients():
    """The traceback shows the line where the wrong shape met another: the mistake is earlier."""
    exercise = EXERCISES["batch_norm_staged"]

    def no_keepdims(t, dy):
        return {"xc": np.ones((1, 3, 1, 3)) * np.ones((4, 3, 2, 2))}

    result = grade(exercise, no_keepdims)
    assert "a statistic's gradient keeps its reduced axes (keepdims=True)" in result.message()


def test_a_term_key_the_grader_does_not_check_is_named_and_shown_as_given():
    """A key named like the source step ("input") was taken as checked among the terms;
    a non-str key 3 was shown as '3'."""
    extra = _grade_solution_changed("closed_form", lambda d: {**d, "input": d["mean"], 3: d["mean"]})
    assert extra.ok and extra.message().endswith(
        "Not checked: 'input', 3, no term of this exercise (a typo?)."
    )


@pytest.mark.parametrize(
    "case",
    ["mean 1000 over a spread of 0.01", "a variance of 1e-6 under eps 0.1, bias 1", "bias 100 over 1e-3"],
)
@pytest.mark.parametrize("layer", ["layer_norm", "batch_norm"])
def test_the_step_checker_passes_right_gradients_where_one_step_does_not_suit(case, layer):
    """One finite-difference step per element called the library's own (right) gradients
    WRONG: a tenth of the spread for a mean of 1000 (truncation, 1e-4), far too small for
    a variance under a large eps, or for outputs under a large bias (rounding, 5e-5)."""
    rng = np.random.default_rng(0)
    loc, spread, eps, bias = {
        "mean 1000 over a spread of 0.01": (1000.0, 0.01, 1e-5, 0.0),
        "a variance of 1e-6 under eps 0.1, bias 1": (0.0, 1e-3, 0.1, 1.0),
        "bias 100 over 1e-3": (0.0, 1e-3, 0.1, 100.0),
    }[case]
    x = rng.normal(loc, spread, (4, 5))
    if layer == "layer_norm":
        tape = staged_forward("layer_norm", x, 5, rng.normal(1.0, 0.5, 5), np.full(5, bias), eps)
    else:
        tape = staged_forward(
            "batch_norm", x, None, None, rng.normal(1.0, 0.5, 5), np.full(5, bias), training=True, eps=eps
        )
    dy = rng.standard_normal(x.shape)
    grads = staged_backward(tape, dy)
    rows = check_steps(tape, grads)
    assert all(r.ok for r in rows), [str(r) for r in rows if not r.ok]
    grads["mean"] = grads["mean"] * (1 + 1e-4)  # and a gradient 1e-4 off still fails
    assert not check_steps(tape, grads, names=["mean"])[0].ok


# --- pinned by mutation testing (each mutation passed the suite) -------------------------


def test_compare_refuses_an_integer_gradient_and_says_so():
    row = compare("x", np.array([1, 2]), np.array([1.0, 2.0]))
    assert not row.ok and "not floating point" in str(row)


def test_compare_calls_a_gradient_off_from_a_zero_one_relatively_infinite():
    """Where the numeric gradient is 0 and the given one is not, the relative error is inf
    (0 read as "relative 0.00e+00" beside a wrong gradient)."""
    row = compare("b", np.array([1e-3, 0.0]), np.zeros(2))
    assert not row.ok and row.max_rel == float("inf") and "relative inf" in str(row)


def test_check_steps_refuses_a_grad_output_that_would_broadcast():
    args, kwargs = example("layer_norm")
    t = staged_forward("layer_norm", *args, **kwargs)
    dy = np.ones((1, *t.output.shape[1:]))
    with pytest.raises(ValueError, match="grad_output must have the output's shape"):
        check_steps(t, staged_backward(t, np.ones(t.output.shape)), grad_output=dy)


def test_an_example_of_another_shape_takes_sizes_from_it():
    """example(name, shape=...): the parameters and running statistics follow the shape's
    channels (and LayerNorm's normalized axes); SyncBatchNorm's batch must be the split's."""
    (x, normalized, w, b), _ = example("layer_norm", shape=(3, 2, 3, 6), eps=0.5)
    assert x.shape == (3, 2, 3, 6) and normalized == (3, 6) and w.shape == b.shape == (3, 6)
    (x, rm, rv, w, b), kw = example("batch_norm", shape=(5, 2, 3), eps=0.5)
    assert rm.shape == rv.shape == w.shape == b.shape == (2,) and kw == {"training": True, "eps": 0.5}
    with pytest.raises(ValueError, match=r"shape\[0\] \(5\) must be sum\(split\) \(4\)"):
        example("sync_batch_norm", shape=(5, 3, 2))


# --- pinned by mutation testing, fourth round: the staged normalization and its tape ---


def test_staged_normalize_computes_in_float64_on_a_copy():
    x32 = np.random.default_rng(0).random((3, 4)).astype(np.float32)
    t = staged_normalize(x32, 0)
    assert t["y"].dtype == np.float64 and t["input"] is not x32


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"eps": -1.0}, ValueError, "eps must be a non-negative number"),
        ({"correction": 2}, ValueError, "correction must be 0"),
        ({"correction": np.array([0, 1])}, ValueError, r"correction must be 0 .*, got array\(\[0, 1\]\)$"),
        ({"weight": np.ones((3, 4))}, ValueError, "weight of shape"),
    ],
)
def test_staged_normalize_refuses_what_the_layers_refuse(kw, error, match):
    x = np.random.default_rng(1).random((1, 4) if "weight" in kw else (3, 4))
    with pytest.raises(error, match=match):
        staged_normalize(x, 0, **kw)


def test_the_n_minus_1_variance_of_one_value_is_refused():
    with pytest.raises(ValueError, match=r"over 1 value\(s\) needs more than 1"):
        staged_normalize(np.random.default_rng(2).random((1, 4)), 0, correction=1)


def test_staged_normalize_sorts_its_axes_and_differentiates_its_bias():
    x = np.random.default_rng(3).random((3, 4))
    t = staged_normalize(x, (1, 0))
    assert t.standardized is not None and tuple(t.standardized.axes) == (0, 1)
    assert "(0, 1)" in t.description
    assert staged_normalize(x, 0, bias=np.zeros(4)).differentiable == ["input", "bias"]


def test_the_formulas_name_the_n_minus_1_variance_and_the_shift():
    x = np.random.default_rng(4).random((3, 4))
    assert staged_normalize(x, 0, correction=1).nodes["var"].formula.endswith("/ (n - 1)")
    assert "+ b" in staged_normalize(x, 0, bias=np.zeros((1, 4))).nodes["y"].formula


def test_a_tape_refuses_a_step_named_as_a_leaf():
    t = Tape("x", input=np.ones(3))
    with pytest.raises(ValueError, match="already on the tape"):
        t.node("input", "f", lambda a: a + 1, "input")


def test_rerun_keeps_the_values_set_and_leaves_the_callers_mapping_alone():
    t = staged_normalize(np.arange(6.0).reshape(2, 3), 1)
    changed = {"xc": np.full((2, 3), 5.0), "input": np.ones((2, 3))}
    got = t.rerun(changed)
    np.testing.assert_array_equal(got["xc"], 5.0)  # set by the caller, not recomputed from input
    assert list(changed) == ["xc", "input"]


# --- pinned by mutation testing, fifth round: the step checker and the grader ----------


@pytest.mark.parametrize(
    "name, line, wrong",
    [
        ("layer_norm", 'd["xhat"] = dy * t["weight"]', "xhat"),  # every step computed from it is off too
        ("group_norm", 'd["xhatg"] = d["xhat"].reshape(t["xhatg"].shape)', "xhatg"),
        ("cache_vs_recompute", "dxhat = dy * weight", "xhat"),  # (checked in the order of SAVED)
    ],
)
def test_a_wrong_step_is_named_not_the_steps_computed_from_it(tmp_path, name, line, wrong):
    """A mistake in one step (its gradient 1% off) spoils every step computed from it: the
    grade names the first wrong one going back from y (the mistake), not the input."""
    exercise = EXERCISES[name]
    text = (ROOT / "exercises" / "solutions" / f"{name}.py").read_text()
    assert text.count(line) == 1, line
    path = tmp_path / f"{name}.py"
    path.write_text(text.replace(line, line + " * 1.01"))
    result = grade(exercise, load(path, exercise.function))
    wrong_rows = [r.name for r in result.rows if not r.ok]
    assert len(wrong_rows) >= 2 and wrong_rows[0] == wrong and "input" in wrong_rows, wrong_rows
    assert result.first_wrong is not None and result.first_wrong.name == wrong
    assert f"Wrong step: `{wrong}`" in result.message() and "`input`" not in result.message()
    assert f"{len(wrong_rows)} of {len(result.rows)} wrong." in result.message()


def test_a_function_wrong_on_the_first_example_fails_though_right_on_the_second():
    """The second example is graded only after the first passed: a grade that went on
    past a failure passed a function wrong on the example the exercise describes."""
    exercise = EXERCISES["layer_norm"]
    solution = load(ROOT / "exercises" / "solutions" / "layer_norm.py", exercise.function)
    first = exercise.make()["input"].shape

    def wrong_on_first(t, dy):
        d = solution(t, dy)
        if t["input"].shape == first:
            d["mean"] = d["mean"] * 1.01
        return d

    result = grade(exercise, wrong_on_first)
    assert (
        not result.ok and not result.passed_before and result.tape.description == exercise.make().description
    )
    assert result.first_wrong is not None and result.first_wrong.name == "mean"
    assert result.message().startswith("FAIL: ") and "second example" not in result.message()


def test_a_backward_of_the_wrong_type_fails_with_what_it_must_return():
    """A backward that returns a list is a FAIL that says a dict is expected (not an
    error of the grader's own)."""
    result = grade(EXERCISES["rms_norm"], lambda t, dy: [dy])
    assert not result.ok and not result.rows
    assert result.message() == "FAIL: your backward must return a dict of gradients, got <class 'list'>"


def test_the_tolerances_and_step_given_to_the_checks_are_used():
    """check_steps and check_terms took atol, rtol and h and passed the defaults on."""
    tape = example_tape("layer_norm")
    dy = upstream(tape.output.shape)
    grads = dict(staged_backward(tape, dy))
    grads["var"] = grads["var"] * 1.001  # 0.1% off
    assert not check_steps(tape, grads, grad_output=dy, names=["var"])[0].ok
    assert check_steps(tape, grads, grad_output=dy, names=["var"], rtol=1e-2)[0].ok
    assert check_steps(tape, grads, grad_output=dy, names=["var"], atol=1.0)[0].ok
    terms = {k: v * 1.001 for k, v in closed_form(tape, staged_backward(tape, dy)["xhat"]).items()}
    assert not any(r.ok for r in check_terms(tape, terms, grad_output=dy))
    assert all(r.ok for r in check_terms(tape, terms, grad_output=dy, rtol=1e-2))
    assert all(r.ok for r in check_terms(tape, terms, grad_output=dy, atol=1.0))
    # a step far too large for data of spread 1e-4: h reaches the finite differences
    small = staged_forward("layer_norm", np.random.default_rng(0).standard_normal((2, 4)) * 1e-4, 4)
    dy = upstream(small.output.shape)
    terms = closed_form(small, staged_backward(small, dy)["xhat"])
    assert all(r.ok for r in check_terms(small, terms, grad_output=dy))
    assert not all(r.ok for r in check_terms(small, terms, grad_output=dy, h=1e4))


@pytest.mark.parametrize("which", ["layer_norm", "group_norm"])
def test_every_gradient_1e_5_off_fails_whatever_its_size(which):
    """The tolerance is rtol of the gradient's largest value, however many elements it
    has: a tolerance that grew with the size passed dx 1e-5 off (eps left out, roughly)."""
    tape = example_tape(which)
    dy = upstream(tape.output.shape)
    grads = staged_backward(tape, dy)
    for name in grads:
        if name == tape.output_name:
            continue
        (row,) = check_steps(tape, {**grads, name: grads[name] * (1 + 1e-5)}, grad_output=dy, names=[name])
        assert not row.ok and 5e-6 < row.max_rel < 2e-5, str(row)


def test_a_backward_that_adds_a_step_to_its_tape_cannot_fool_the_grader():
    """The function gets a tape of its own: a node it adds (a new output, y·0) changes
    nothing in place, and must not become the output the check differentiates."""
    exercise = EXERCISES["rms_norm"]

    def zero_output(t, dy):
        t.node("z", "z = 0 · y", lambda y: 0.0 * y, "y")  # the loss no longer depends on anything
        return {k: np.zeros_like(t[k]) for k in ("weight", "xhat", "rstd", "ms", "input")}

    result = grade(exercise, zero_output)
    assert not result.ok and result.first_wrong is not None and result.first_wrong.name == "weight"


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_gradient_with_nan_or_inf_fails_and_says_so(bad):
    given = np.array([1.0, bad])
    row = compare("xhat", given, np.array([1.0, 2.0]))
    assert not row.ok and row.shape_ok and str(row) == "xhat: WRONG: contains nan or inf"
    result = _grade_solution_changed("rms_norm", lambda d: {**d, "ms": d["ms"] * bad})
    assert "Wrong step: `ms` (the first wrong one going back from y: fix it first): contains nan or inf" in (
        result.message()
    )


def test_a_running_buffer_is_not_a_step_to_check():
    """The running statistics are constants of the graph (no gradient): naming one is the
    error naming no step is, not a row called WRONG for a gradient that cannot exist."""
    tape = example_tape("batch_norm eval")
    grads = staged_backward(tape, upstream(tape.output.shape))
    assert "running_mean" in tape and "running_mean" not in grads
    with pytest.raises(ValueError, match="'running_mean' is not a step of this tape"):
        check_steps(tape, grads, names=["running_mean"])


def test_a_wrong_term_of_the_right_shape_is_still_summed_into_dx():
    """shape_ok says the shape only: a term of the right shape and wrong values keeps it,
    so the grade still checks the terms' sum against dx (it skips it for a wrong shape)."""
    row = compare("x", np.array([1.0, 3.0]), np.array([1.0, 2.0]))
    assert not row.ok and row.shape_ok
    result = _grade_solution_changed("closed_form", lambda d: {**d, "var": d["var"] * 1.01})
    assert [(r.name, r.ok) for r in result.rows] == [
        ("direct", True),
        ("mean", True),
        ("var", False),
        ("input", False),
    ]
    assert "Wrong term: `var`" in result.message() and "2 of 4 wrong" in result.message()


def test_the_finite_differences_stop_at_the_step_no_later_one_can_beat(monkeypatch):
    """Once the rounding at the next step passes the least error found, no smaller step
    can do better: the search stops there (eight re-runs per element here, twenty at
    most), not after all five steps (twenty always)."""
    tape = example_tape("layer_norm")
    dy = upstream(tape.output.shape)
    reruns = []
    rerun = Tape.rerun
    monkeypatch.setattr(Tape, "rerun", lambda self, *a, **k: reruns.append(1) or rerun(self, *a, **k))
    for name in ("input", "rstd"):
        reruns.clear()
        numeric_gradient(tape, name, dy)
        assert len(reruns) == 8 * tape[name].size, (name, len(reruns) / tape[name].size)


def test_a_gradient_of_a_running_buffer_is_named_as_not_checked():
    """The running statistics are leaves of the eval tape but get no gradient: a key for
    one is not checked, and the grade says so (as for a typo)."""
    result = _grade_solution_changed("batch_norm_eval", lambda d: {**d, "running_var": d["var"]})
    assert result.ok and result.message().endswith(
        "Not checked: 'running_var', no step of this exercise (a typo?)."
    )


@pytest.mark.parametrize("off, small", [(1e-4, True), (1e-2, False)])
def test_an_error_under_a_thousandth_is_called_small_but_real(off, small):
    result = _grade_solution_changed("layer_norm", lambda d: {**d, "var": d["var"] * (1 + off)})
    assert not result.ok and result.first_wrong is not None and result.first_wrong.name == "var"
    assert ("small, but far above rounding in float64" in result.message()) is small, result.message()


def test_staged_backward_refuses_a_tape_built_by_hand_by_saying_so():
    """A Tape built by hand has no backward: the message said "expected a Tape from
    staged_forward, got Tape", though it was given a Tape (and staged_normalize's are
    taken too)."""
    tape = Tape("mine", input=np.ones(3))
    with pytest.raises(TypeError, match=r"staged_forward or staged_normalize, got a Tape without a backward"):
        staged_backward(tape, np.ones(3))
    with pytest.raises(TypeError, match=r"staged_normalize, got dict$"):
        staged_backward({}, np.ones(3))
