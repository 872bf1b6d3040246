"""The main job's verdicts (``npnorm._selfcheck``): each check that fails makes its row
and the whole run fail, and what it compares covers every layer, mode and backend.
(``tests/test_cli.py`` runs the whole job once, where everything passes.)"""

import importlib.util
import math
import sys
import types

import numpy as np
import pytest

from npnorm import _selfcheck
from npnorm._backend import resolve_namespace
from npnorm._selfcheck import Case, torch_parity
from npnorm.gradient_check import GradcheckError
from npnorm.modules import BatchNorm1d, LayerNorm

HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")

SMALL = Case("LayerNorm", lambda **kw: LayerNorm(6, **kw), lambda t: t.nn.LayerNorm(6), (2, 6))


def run_with(monkeypatch, capsys, *, cases=(SMALL,), backends=("numpy",), parity=None, gradcheck=None):
    """``_selfcheck.run()`` over ``cases`` and ``backends``, with torch_parity's and
    gradcheck's results replaced where given: (verdict, printed lines, table rows)."""
    monkeypatch.setattr(_selfcheck, "CASES", list(cases))
    monkeypatch.setattr(_selfcheck, "available_backends", lambda: list(backends))
    if parity is not None:
        monkeypatch.setattr(_selfcheck, "torch_parity", parity)
    if gradcheck is not None:
        monkeypatch.setattr(_selfcheck, "gradcheck", gradcheck)
    ok = _selfcheck.run(verbose=True)
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2 : 2 + len(cases) * len(backends)]]
    return ok, lines, rows


def assert_failed(ok, lines, rows):
    assert ok is False
    assert lines[-1] == "SOME CHECKS FAILED"
    assert "all checks passed" not in lines
    assert rows[0][-1] == "FAIL"


@needs_torch
@pytest.mark.parametrize(
    ("errors", "passes"),
    [
        ({"float64": 5e-11, "float32": 5e-5}, True),  # under both tolerances
        ({"float64": 2e-10, "float32": 0.0}, False),
        ({"float64": 0.0, "float32": 2e-4}, False),
        ({"float64": math.nan, "float32": 0.0}, False),
        ({"float64": 0.0, "float32": math.nan}, False),
        ({"float64": math.inf, "float32": 0.0}, False),
    ],
)
def test_each_parity_tolerance_decides_the_row_and_the_verdict(monkeypatch, capsys, errors, passes):
    ok, lines, rows = run_with(
        monkeypatch,
        capsys,
        parity=lambda case, xp, dtype, seed=0: errors[dtype],
        gradcheck=lambda module, x: True,
    )
    assert ok is passes
    assert lines[-1] == ("all checks passed" if passes else "SOME CHECKS FAILED")
    header, row = lines[0], lines[2]
    for dtype, column in (("float64", "torch f64"), ("float32", "torch f32")):
        shown = f"{errors[dtype]:.1e}" + ("" if passes or errors[dtype] == 0.0 else " FAIL")
        assert row[header.index(column) :].startswith(shown + " "), (dtype, row)
    assert rows[0][-1] == ("ok" if passes else "FAIL")


def test_a_failed_gradcheck_fails_the_row(monkeypatch, capsys):
    def failing(module, x):
        raise GradcheckError("wrong backward")

    ok, lines, rows = run_with(monkeypatch, capsys, parity=lambda *a, **k: 0.0, gradcheck=failing)
    assert_failed(ok, lines, rows)
    assert rows[0][2:4] == ["finite", "FAIL"]


def test_a_gradcheck_that_fails_in_eval_only_fails_the_row(monkeypatch, capsys):
    modes = []

    def failing_in_eval(module, x):
        modes.append(module.training)
        if not module.training:
            raise GradcheckError("wrong eval backward")
        return True

    ok, lines, rows = run_with(monkeypatch, capsys, parity=lambda *a, **k: 0.0, gradcheck=failing_in_eval)
    assert modes == [True, False]  # train, then eval
    assert_failed(ok, lines, rows)
    assert rows[0][3] == "FAIL"


class NaNOutput(LayerNorm):
    """A layer whose forward output has one NaN among finite values."""

    def forward(self, input):
        y = super().forward(input)
        y = np.array(y, copy=True)
        y.flat[1] = np.nan
        return y


def test_a_forward_with_a_nan_fails_the_row(monkeypatch, capsys):
    case = Case("LayerNorm", lambda **kw: NaNOutput(6, **kw), lambda t: t.nn.LayerNorm(6), (2, 6))
    ok, lines, rows = run_with(
        monkeypatch, capsys, cases=[case], parity=lambda *a, **k: 0.0, gradcheck=lambda module, x: True
    )
    assert_failed(ok, lines, rows)
    assert rows[0][2] == "NaN"


def test_a_nan_forward_stays_nan_in_the_table_when_gradcheck_raises(monkeypatch, capsys):
    """The forward's column shows what the forward gave, also when the gradcheck after
    it raised (it showed "finite" then)."""
    case = Case("LayerNorm", lambda **kw: NaNOutput(6, **kw), lambda t: t.nn.LayerNorm(6), (2, 6))

    def failing(module, x):
        raise GradcheckError("wrong backward")

    ok, lines, rows = run_with(
        monkeypatch, capsys, cases=[case], parity=lambda *a, **k: 0.0, gradcheck=failing
    )
    assert_failed(ok, lines, rows)
    assert rows[0][2:4] == ["NaN", "FAIL"]


def test_every_case_runs_on_every_backend_found(monkeypatch, capsys):
    made, compared = [], []

    def make(**kw):
        made.append(kw["xp"])
        return LayerNorm(6, **kw)

    def parity(case, xp, dtype, seed=0):
        compared.append((xp, dtype))
        return 0.0

    case = Case("LayerNorm", make, lambda t: t.nn.LayerNorm(6), (2, 6))
    other = Case("Other", make, lambda t: t.nn.LayerNorm(6), (2, 6))
    backends = ("numpy", "array_api_strict")
    ok, lines, rows = run_with(
        monkeypatch,
        capsys,
        cases=[case, other],
        backends=backends,
        parity=parity,
        gradcheck=lambda m, x: True,
    )
    assert ok is True and lines[-1] == "all checks passed"
    assert [r[:2] for r in rows] == [[c, b] for b in backends for c in ("LayerNorm", "Other")]
    spaces = [resolve_namespace(b) for b in backends for _ in range(2)]
    assert made == spaces
    if HAS_TORCH:
        assert compared == [(xp, d) for xp in spaces for d in ("float64", "float32")]


def test_the_cases_cover_every_layer_and_option():
    assert [c.name for c in _selfcheck.CASES] == [
        "LayerNorm",
        "LayerNorm(bias=False)",
        "RMSNorm",
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm2d(momentum=None)",
        "BatchNorm3d",
        "InstanceNorm1d(affine)",
        "InstanceNorm2d(track)",
        "InstanceNorm3d",
        "GroupNorm",
    ]


def test_randomize_gives_positive_variances_and_non_trivial_weights():
    m = BatchNorm1d(5, dtype="float64")
    _selfcheck.randomize(m, np.random.default_rng(0))
    state = m.state_dict()
    for name in ("running_var", "weight"):
        assert np.all((0.5 <= state[name]) & (state[name] <= 1.5)), name
    assert int(state["num_batches_tracked"]) == 3


@pytest.mark.parametrize(
    ("devices", "listed"), [(lambda: 1, True), (lambda: 0, False), (lambda: 1 / 0, False)]
)
def test_cupy_is_a_backend_only_with_a_device(monkeypatch, devices, listed):
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=devices))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    real = importlib.util.find_spec
    found = {"array_api_strict", "torch", "cupy"}
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: types.SimpleNamespace() if name in found else real(name, *a),
    )
    expected = ["numpy", "array_api_strict", "torch", *(["cupy"] if listed else [])]
    assert _selfcheck.available_backends() == expected


def test_backends_found_are_listed_after_numpy(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert _selfcheck.available_backends() == ["numpy"]


# torch_parity itself: a layer that differs from torch's in one place is seen there


class Off(LayerNorm):
    """LayerNorm, off by 1e-2 in one place: ``where``."""

    where = ""
    calls = 0

    def forward(self, input):
        y = super().forward(input)
        Off.calls += self.training
        if self.where == "eval output" and not self.training:
            return y + 1e-2
        if self.where == "third step" and Off.calls == 3:
            return y + 1e-2
        return y

    def backward(self, grad_output):
        dx = super().backward(grad_output)
        if self.where == "input gradient":
            return dx * (1 + 1e-2)
        if self.where == "weight gradient":
            self.grads["weight"] += 1e-2
        return dx


class OffBuffers(BatchNorm1d):
    """A BatchNorm that counts each training batch twice: only its buffers are off."""

    def forward(self, input):
        y = super().forward(input)
        if self.training:
            self.num_batches_tracked[...] = self.num_batches_tracked + 1
        return y


@needs_torch
@pytest.mark.parametrize("where", ["", "eval output", "third step", "input gradient", "weight gradient"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_parity_sees_a_difference_wherever_it_is(monkeypatch, where, dtype):
    monkeypatch.setattr(Off, "where", where)
    monkeypatch.setattr(Off, "calls", 0)
    case = Case("LayerNorm", lambda **kw: Off(6, **kw), lambda t: t.nn.LayerNorm(6), (2, 6), steps=3)
    err = torch_parity(case, resolve_namespace("numpy"), dtype)
    if where:
        assert 1e-3 < err < 1e-1, err
    else:
        assert err < (1e-12 if dtype == "float64" else 1e-5), err


@needs_torch
def test_torch_parity_compares_the_running_buffers():
    case = Case("BatchNorm1d", lambda **kw: OffBuffers(3, **kw), lambda t: t.nn.BatchNorm1d(3), (4, 3))
    err = torch_parity(case, resolve_namespace("numpy"), "float64")
    assert err == 1 / 4, err  # num_batches_tracked: 5 where torch counts 4


@needs_torch
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_parity_reports_a_nan(dtype):
    """A NaN in an output, a gradient or a buffer is an error (``max(0.0, nan)`` is 0.0:
    it was dropped, and the row said ok)."""
    case = Case("LayerNorm", lambda **kw: NaNOutput(6, **kw), lambda t: t.nn.LayerNorm(6), (2, 6))
    assert math.isnan(torch_parity(case, resolve_namespace("numpy"), dtype))


class NaNRunningVar(BatchNorm1d):
    """A BatchNorm whose running variance gets a NaN from its second training batch on
    (num_batches_tracked starts at 3): its first forward and its gradients are right."""

    def forward(self, input):
        y = super().forward(input)
        if self.training and int(self.num_batches_tracked) >= 5:
            self.running_var[0] = np.nan
        return y


@needs_torch
def test_a_nan_in_the_running_statistics_fails_the_main_job(monkeypatch, capsys):
    """Only the parity's training steps see the NaN: it was dropped (``max(0.0, nan)``
    is 0.0), and the main job said "all checks passed"."""
    case = Case(
        "BatchNorm1d",
        lambda **kw: NaNRunningVar(3, **kw),
        lambda t: t.nn.BatchNorm1d(3),
        (4, 3),
        steps=3,
    )
    ok, lines, rows = run_with(monkeypatch, capsys, cases=[case])
    assert_failed(ok, lines, rows)
    assert rows[0][2:] == ["finite", "pass", "nan", "FAIL", "nan", "FAIL", "FAIL"]
