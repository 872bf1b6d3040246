"""``python -m npnorm warmup`` (``npnorm._warmup``) and ``python -m npnorm profile``
(``npnorm._profile``): their bookkeeping pinned with the compile step and the clock
replaced, and warmup's coverage checked in a process of its own."""

import importlib.util
import itertools
import json
import linecache
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from npnorm import _profile, _warmup, get_kernels, get_num_threads, set_num_threads
from npnorm.__main__ import main as cli_main
from npnorm._bench import FULL, Spec

HAS_NUMBA = importlib.util.find_spec("numba") is not None
needs_numba = pytest.mark.skipif(not HAS_NUMBA, reason="needs numba")


class _Clock:
    """A ``time`` module stand-in whose ``perf_counter`` moves only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@needs_numba
def test_warmup_times_each_step_and_writes_what_it_returns(monkeypatch, tmp_path, capsys):
    """Each layer and dtype, the float16 casts and the transposing copies timed on their
    own (not since the start, not including the step before), import_s and total_s from
    the start, all of it under the "numba" kernels, printed and written as returned."""
    clock = _Clock()
    monkeypatch.setattr(_warmup, "time", clock)
    real_available = _warmup.kernels_available

    def available():
        clock.now += 0.25  # importing numba
        return real_available()

    monkeypatch.setattr(_warmup, "kernels_available", available)
    calls = []

    def step(key, seconds):
        def call():
            calls.append((key, get_kernels()))
            clock.now += seconds

        return call

    durations = {"LayerNorm": 1, "RMSNorm": 2, "BatchNorm": 4, "GroupNorm": 8}
    scale = {"float32": 1, "float64": 16}
    monkeypatch.setattr(
        _warmup,
        "_layers",
        lambda dtype: {n: step(f"{n} {dtype}", s * scale[dtype]) for n, s in durations.items()},
    )
    monkeypatch.setattr(_warmup, "_float16_casts", step("float16 casts", 256))
    monkeypatch.setattr(_warmup, "_transposing_copies", step("transposing copies", 512))
    path = tmp_path / "w.json"

    result = _warmup.run(verbose=True, json_path=str(path))

    want = {f"{n} {d}": s * scale[d] for d in ("float32", "float64") for n, s in durations.items()}
    want |= {"float16 casts": 256, "transposing copies": 512}
    assert calls == [(key, "numba") for key in want]
    assert result["seconds"] == want
    assert result["import_s"] == 0.25
    assert result["total_s"] == 0.25 + sum(want.values())
    assert result["compiled_loops"] == _warmup._compiled_loops()
    assert json.loads(path.read_text()) == result
    out = capsys.readouterr().out
    assert "numba imported in 0.25 s" in out
    for key, seconds in want.items():
        assert f"  {key:20} {seconds:6.2f} s\n" in out, key
    assert f"{result['compiled_loops']} compiled loops (" in out
    assert f"ready in {result['total_s']:.2f} s" in out

    _warmup.run(verbose=False)
    assert capsys.readouterr().out == ""


@needs_numba
def test_warmup_counts_the_signatures_of_the_public_loops(monkeypatch):
    """compiled_loops: every signature of every public loop, the private helpers not."""
    from npnorm.kernels import _numba_loops as loops

    before = _warmup._compiled_loops()
    monkeypatch.setattr(loops, "a_loop", types.SimpleNamespace(signatures=[1, 2, 3]), raising=False)
    monkeypatch.setattr(loops, "_a_helper", types.SimpleNamespace(signatures=[1]), raising=False)
    assert _warmup._compiled_loops() == before + 3


@needs_numba
def test_a_loop_rule_holds_inside_the_block_only():
    """_loop_rule sets the host's choice inside the block and puts it back after, an
    error included (a warmup in a process left the other host's loops chosen)."""
    from npnorm.kernels import _numba_loops as loops

    for name in ("LONG_ROWS_ALONE", "CHANNELS_IN_MEMORY_ORDER"):
        before = getattr(loops, name)
        for value in (True, False):
            with _warmup._loop_rule(name, value):
                assert getattr(loops, name) is value
            assert getattr(loops, name) is before
        with pytest.raises(KeyError), _warmup._loop_rule(name, not before):
            raise KeyError
        assert getattr(loops, name) is before


_SIGNATURES = """\
import json
from npnorm import _warmup
from npnorm.kernels import _numba_loops as loops
rules = (loops.LONG_ROWS_ALONE, loops.CHANNELS_IN_MEMORY_ORDER)
_warmup.run(verbose=False)
assert (loops.LONG_ROWS_ALONE, loops.CHANNELS_IN_MEMORY_ORDER) == rules
def kinds(sig):
    return [str(getattr(a, "dtype", a)) for a in sig] + [sig[0].layout, sig[0].mutable]
print(json.dumps({
    name: [kinds(sig) for sig in f.signatures]
    for name, f in vars(loops).items() if hasattr(f, "signatures") and not name.startswith("_")
}))
"""


@pytest.mark.slow
@needs_numba
def test_warmup_alone_compiles_every_loop_for_both_dtypes():
    """In a process of its own (in the test process other tests compile loops too), warmup
    compiles every public loop for float32 and float64, both host rules' loops, the
    float16 casts for read-only input, and the four kinds of transposing copy per dtype.
    (3 s where the loops are cached; up to a minute where they are not, as on a fresh clone
    for the loops no test before it ran.)"""
    out = subprocess.run(
        [sys.executable, "-c", _SIGNATURES],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env={**os.environ, "NPNORM_KERNELS": "numba"},
    )
    assert out.returncode == 0, out.stderr
    signatures = json.loads(out.stdout)
    ct_arg = {"group_rows_statistics": -3, "group_rows_coefficients": -3}  # (the float64 partials first)
    for name, sigs in signatures.items():
        if name in _warmup.CASTS:
            continue
        dtypes = {sig[ct_arg.get(name, 0)] for sig in sigs}
        assert dtypes >= ({"float64"} if name == "add_spans" else {"float32", "float64"}), (name, sigs)
    assert {sig[-1] for sig in signatures["half_columns_to_float"]} == {True, False}  # read-only input
    assert signatures["float_to_half_columns"]
    kinds = {(sig[0], sig[-2], sig[-1]) for sig in signatures["transpose_into"]}
    assert kinds == {(d, lay, m) for d in (*_warmup.DTYPES, "uint16") for lay in "CA" for m in (True, False)}


def _fake_clock(monkeypatch) -> list[int]:
    """``_profile``'s clock ticks one second per reading; the thread counts it saw."""
    ticks = itertools.count()
    threads = []

    def perf_counter():
        threads.append(get_num_threads())
        return float(next(ticks))

    monkeypatch.setattr(_profile, "time", types.SimpleNamespace(perf_counter=perf_counter))
    return threads


def test_profile_figures_are_per_forward_backward(monkeypatch, capsys, restore_threads):
    """Under a clock where every timed NumPy call takes one second: per site, calls and ms
    are per forward+backward (divided by reps), sites sorted by time, the top ones printed
    and the rest summed in one line, the NumPy total of all sites, one thread throughout
    (and the caller's count back after), float32 input, one untimed warm-up."""
    threads_seen = _fake_clock(monkeypatch)
    real_ours = _profile._ours
    inputs = []

    class Recorded:
        def __init__(self, spec):
            self.m = real_ours(spec)

        def __call__(self, x):
            inputs.append(x.dtype)
            return self.m(x)

        def backward(self, dy):
            return self.m.backward(dy)

    monkeypatch.setattr(_profile, "_ours", Recorded)
    spec, reps, top = Spec("LayerNorm", (2, 8, 64)), 3, 4
    set_num_threads(2)
    result = _profile.profile(spec, reps=reps, top=top)
    assert get_num_threads() == 2
    assert inputs == [np.float32] * (reps + 1)
    assert set(threads_seen) == {1}
    sites = result["sites"]
    assert len(sites) > top + 1
    assert all(s["calls"] >= 1 and s["ms"] == 1e3 * s["calls"] for s in sites), sites
    ms = [s["ms"] for s in sites]
    assert ms == sorted(ms, reverse=True) and ms[0] > ms[-1]
    assert result["layer"] == "LayerNorm" and result["shape"] == [2, 8, 64]
    # the clock read once before the timed runs, twice per NumPy call, once after
    assert result["total_ms"] == pytest.approx(1e3 * (2 * sum(s["calls"] for s in sites) + 1 / reps))
    files = {os.path.basename(m.__file__): m.__file__ for m in _profile.KERNEL_MODULES}
    for s in sites:
        assert s["source"] == linecache.getline(files[s["file"]], s["line"]).strip(), s
    out = capsys.readouterr().out.splitlines()
    assert f"forward+backward {result['total_ms']:.1f} ms," in out[1]
    assert f"of which {sum(ms):.1f} ms in NumPy calls" in out[2]
    lines = out[4:]
    size = 2 * 8 * 64
    assert len(lines) == top + 1
    for line, s in zip(lines, sites[:top], strict=False):
        assert line.split()[:4] == [
            f"{s['ms']:.2f}",
            f"{1e6 * s['ms'] / size:.3f}",
            str(s["calls"]),
            f"{s['file']}:{s['line']}",
        ]
    assert lines[-1].split() == [f"{sum(ms[top:]):.2f}", str(len(sites) - top), "more", "sites"]


def test_profile_puts_the_threads_and_the_kernels_numpy_back_after_an_error(monkeypatch, restore_threads):
    """A layer that raises leaves neither one thread nor the timed NumPy behind."""

    class Broken:
        def __call__(self, x):
            raise ZeroDivisionError

    monkeypatch.setattr(_profile, "_ours", lambda spec: Broken())
    set_num_threads(2)
    with pytest.raises(ZeroDivisionError):
        _profile.profile(Spec("LayerNorm", (2, 8)), reps=1)
    assert get_num_threads() == 2
    with pytest.raises(ZeroDivisionError), _profile.timed_kernels(_profile._Totals()):
        1 / 0  # noqa: B018
    assert all(m.np is np for m in _profile.KERNEL_MODULES)


def test_profile_command_times_the_first_shape_of_each_layer_asked_for(monkeypatch):
    """Each layer once, at its first standard shape, in FULL's order, with --reps."""
    got = []
    monkeypatch.setattr(_profile, "profile", lambda spec, reps: got.append((spec, reps)) or {})
    first = {}
    for spec in FULL:
        first.setdefault(spec.layer, spec)
    assert cli_main(["profile", "--reps", "3"]) == 0
    assert got == [(spec, 3) for spec in first.values()]
    got.clear()
    assert _profile.run(["GroupNorm", "LayerNorm"], reps=2) == [{}, {}]
    assert got == [(first["LayerNorm"], 2), (first["GroupNorm"], 2)]
