"""npnorm's torch-signature functions (``F.batch_norm``, ``F.instance_norm``,
``F.group_norm``, ``F.layer_norm``, ``F.rms_norm``) against torch.nn.functional's, on
drawn shapes, flags, dtypes (float16, float32, float64), layouts (C-ordered,
Fortran-ordered, channels-last) and kernel families (which NumPy input runs: torch tensors
run the generic kernels), with NumPy arrays or torch tensors as npnorm's input: the same
outputs, the same error types (not messages), and for BatchNorm and InstanceNorm the same
running statistics after a few calls that update them in place (the caller's arrays, as
torch updates its tensors). float32 and float16 results pass also within twice torch's own
error of its float64 result on the same values (``helpers.close``).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from helpers import channels_last, grid_arrays, same_as_torch
from hypothesis import given
from hypothesis import strategies as st

import npnorm
import npnorm.functional as F

torch = pytest.importorskip("torch", reason="parity tests need torch==2.13.0 (the 'parity' extra)")
TF = torch.nn.functional


class _Draw:
    """The draws of one example: dtype, layout, kernel family, and arrays of them (for
    npnorm as NumPy arrays, or with ``torch_input`` as torch tensors)."""

    def __init__(self, data, torch_input: bool):
        self.data, self.torch_input = data, torch_input
        self.dtype = data.draw(st.sampled_from(["float64", "float32", "float16"]), label="dtype")
        self.layout = data.draw(st.sampled_from(["C", "F", "channels last"]), label="layout")
        self.family = data.draw(st.sampled_from(npnorm.kernels_available()), label="kernels")

    def values(self, shape, lo=-6.0, hi=6.0, step=0.25) -> np.ndarray:
        """Grid values (exact in float16) of ``shape`` in the dtype and layout drawn."""
        a = self.data.draw(grid_arrays(shape, lo, hi, step)).astype(self.dtype)
        if self.layout == "F":
            return np.asfortranarray(a)
        if self.layout == "channels last" and a.ndim > 2:
            return channels_last(a)
        return a

    def optional(self, shape, lo, hi, step):
        """A parameter, or None."""
        return self.values(shape, lo, hi, step) if self.data.draw(st.booleans()) else None

    def ours(self, a):
        """``a`` as npnorm's input: the array, or a torch tensor of it."""
        return a if a is None or not self.torch_input else torch.from_numpy(a)

    def theirs(self, a, truth: bool = False):
        """``a`` as torch's input (a copy); with ``truth``, in float64: torch's own result
        on the same values in float64 tells how far its float32 or float16 one is off."""
        if a is None:
            return None
        return torch.from_numpy(np.array(a, dtype=np.float64 if truth else a.dtype))


def _both(ours, theirs):
    """Both calls' results, or both errors' types (which must then agree)."""
    try:
        want = theirs()
    except (RuntimeError, ValueError, IndexError, TypeError) as err:
        with pytest.raises((RuntimeError, ValueError, IndexError, TypeError)) as ours_err:
            ours()
        assert ours_err.type is type(err), (err, ours_err.value)
        return None, None
    return ours(), want


def _same(ours, theirs, dtype: str, what: str, truth=None) -> None:
    """npnorm's result is torch's: its dtype, and its values to the dtype's tolerance, or
    within twice torch's own error of ``truth`` (torch's float64 result: ``close``)."""
    same_as_torch(ours, theirs, dtype, what, truth if dtype != "float64" else None)


@pytest.mark.parametrize("track", [True, False], ids=["running statistics", "none"])
@pytest.mark.parametrize("torch_input", [False, True], ids=["numpy", "torch tensors"])
@pytest.mark.parametrize("name", ["batch_norm", "instance_norm"])
@given(data=st.data())
def test_running_statistics_layers_over_calls_are_torchs(name, torch_input, track, data):
    d = _Draw(data, torch_input)
    with npnorm.use_kernels(d.family):
        C = data.draw(st.sampled_from([1, 2, 4]), label="C")
        shape = (
            data.draw(st.integers(1, 4), label="N"),
            C,
            *data.draw(st.lists(st.integers(1, 3), max_size=2)),
        )
        eps = data.draw(st.sampled_from([1e-5, 1e-3, 0.5]), label="eps")
        rm, rv = d.values((C,), -2.0, 2.0), d.values((C,), 0.25, 2.0, 0.125)
        rm_ours, rv_ours = d.ours(np.array(rm)), d.ours(np.array(rv))  # (their own memory)
        rm_theirs, rv_theirs = d.theirs(rm), d.theirs(rv)
        rm_truth, rv_truth = d.theirs(rm, truth=True), d.theirs(rv, truth=True)
        w, b = d.optional((C,), -1.5, 1.5, 0.125), d.optional((C,), -2.0, 2.0, 0.25)
        ours_fn, theirs_fn = getattr(F, name), getattr(TF, name)
        for call in range(data.draw(st.integers(1, 3), label="calls")):
            x = d.values(shape)
            # (InstanceNorm without running statistics takes its batch statistics only: the
            # error both raise otherwise is checked in test_batch_norm; BatchNorm's eval
            # without them takes the batch statistics too, as torch's does)
            flag = data.draw(st.booleans(), label="training / use_input_stats")
            flag = flag or (name == "instance_norm" and not track)
            momentum = data.draw(st.sampled_from([0.1, 0.0, 0.5, 1.0]), label="momentum")
            stats_ours = (rm_ours, rv_ours) if track else (None, None)
            stats_theirs = (rm_theirs, rv_theirs) if track else (None, None)
            stats_truth = (rm_truth, rv_truth) if track else (None, None)
            y, yt = _both(
                partial(ours_fn, d.ours(x), *stats_ours, d.ours(w), d.ours(b), flag, momentum, eps),
                partial(theirs_fn, d.theirs(x), *stats_theirs, d.theirs(w), d.theirs(b), flag, momentum, eps),
            )
            if yt is not None:
                truth = [d.theirs(a, truth=True) for a in (x, w, b)]
                y_truth = theirs_fn(truth[0], *stats_truth, *truth[1:], flag, momentum, eps)
                _same(y, yt, d.dtype, f"call {call}: output", y_truth)
            if track:
                _same(rm_ours, rm_theirs, d.dtype, f"call {call}: running_mean", rm_truth)
                _same(rv_ours, rv_theirs, d.dtype, f"call {call}: running_var", rv_truth)


@pytest.mark.parametrize("torch_input", [False, True], ids=["numpy", "torch tensors"])
@given(data=st.data())
def test_group_norm_is_torchs(torch_input, data):
    d = _Draw(data, torch_input)
    with npnorm.use_kernels(d.family):
        C = data.draw(st.sampled_from([2, 4, 6]), label="C")
        G = data.draw(st.sampled_from([g for g in (1, 2, 3) if C % g == 0]), label="groups")
        shape = (
            data.draw(st.integers(1, 3), label="N"),
            C,
            *data.draw(st.lists(st.integers(1, 3), max_size=2)),
        )
        eps = data.draw(st.sampled_from([1e-5, 1e-3, 0.5]), label="eps")
        x = d.values(shape)
        w, b = d.optional((C,), -1.5, 1.5, 0.125), d.optional((C,), -2.0, 2.0, 0.25)
        y, yt = _both(
            lambda: F.group_norm(d.ours(x), G, d.ours(w), d.ours(b), eps),
            lambda: TF.group_norm(d.theirs(x), G, d.theirs(w), d.theirs(b), eps),
        )
        if yt is not None:
            truth = [d.theirs(a, truth=True) for a in (x, w, b)]
            _same(y, yt, d.dtype, "output", TF.group_norm(truth[0], G, *truth[1:], eps))


@pytest.mark.parametrize("torch_input", [False, True], ids=["numpy", "torch tensors"])
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
@given(data=st.data())
def test_row_layers_are_torchs(name, torch_input, data):
    d = _Draw(data, torch_input)
    with npnorm.use_kernels(d.family):
        shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4), label="shape"))
        normalized = shape[len(shape) - data.draw(st.integers(1, len(shape)), label="normalized dims") :]
        eps = data.draw(st.sampled_from([1e-5, 1e-3, 0.5] + [None] * (name == "rms_norm")), label="eps")
        x = d.values(shape)
        w = d.optional(normalized, -1.5, 1.5, 0.125)
        if name == "layer_norm":
            b = d.optional(normalized, -2.0, 2.0, 0.25)
            ours = partial(F.layer_norm, d.ours(x), normalized, d.ours(w), d.ours(b), eps)
            theirs = partial(TF.layer_norm, normalized_shape=list(normalized), eps=eps)
            arrays = dict(input=x, weight=w, bias=b)
        else:
            ours = partial(F.rms_norm, d.ours(x), normalized, d.ours(w), eps)
            theirs = partial(TF.rms_norm, normalized_shape=list(normalized), eps=eps)
            arrays = dict(input=x, weight=w)
        y, yt = _both(ours, lambda: theirs(**{k: d.theirs(a) for k, a in arrays.items()}))
        if yt is not None:
            # (eps=None is the dtype's eps: torch's float64 result would take float64's)
            truth = None if eps is None else theirs(**{k: d.theirs(a, truth=True) for k, a in arrays.items()})
            _same(y, yt, d.dtype, "output", truth)
