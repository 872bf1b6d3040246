"""``python -m npnorm gpu-check`` and ``tools/gpu_check.sh`` without a GPU: argument handling,
the no-GPU path, the report, and the benchmark's code path with NumPy standing in for CuPy
(a wall-clock timer for the CUDA events). No timing is asserted: only that every figure is
there and consistent."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from npnorm import _gpu_bench, _gpu_check
from npnorm.__main__ import main
from npnorm._bench import Spec
from npnorm.functional import _dispatch

REPO = Path(__file__).resolve().parent.parent
WRAPPER = REPO / "tools" / "gpu_check.sh"
LAYERS = {"LayerNorm", "RMSNorm", "BatchNorm2d", "GroupNorm", "InstanceNorm2d"}
TINY = [
    Spec("LayerNorm", (2, 3, 16)),
    Spec("RMSNorm", (2, 3, 16)),
    Spec("BatchNorm2d", (2, 32, 3, 3)),
    Spec("GroupNorm", (2, 32, 3, 3)),
    Spec("InstanceNorm2d", (2, 32, 3, 3)),
]


def _wrapper(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", str(WRAPPER), *args], capture_output=True, text=True, env=full_env, timeout=300, check=False
    )


def _device_limits_hold(folder: Path) -> None:
    """What the GPU machine's tool brings back: at most 8 files, plainly named."""
    files = [p for p in folder.iterdir() if p.is_file()]
    assert len(files) <= 8, files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files), files


def test_wrapper_rejects_a_missing_or_misplaced_out_dir():
    out = _wrapper()
    assert out.returncode == 2 and "missing OUT_DIR" in out.stderr and "usage:" in out.stderr
    out = _wrapper("--quick")
    assert out.returncode == 2 and "must be OUT_DIR" in out.stderr
    out = _wrapper("--help")
    assert out.returncode == 0 and "usage:" in out.stdout


def test_wrapper_without_a_gpu_says_why_and_exits_2(tmp_path):
    # no device visible: CuPy, where installed, finds none; where not, the check says so
    out = _wrapper(str(tmp_path / "out"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no GPU can be used" in out.stderr or "finds no" in out.stderr, out.stderr
    report = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "no GPU:" in report and "exit status 2" in report
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert data["exit_status"] == 2 and data["stages"] == {}
    assert "array_api_compat: already there" in (tmp_path / "out" / "install.log").read_text()
    _device_limits_hold(tmp_path / "out")


def test_gpu_check_rejects_unknown_stages(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["gpu-check", str(tmp_path), "--stages", "tests,speed"])
    assert exc.value.code == 2 and "--stages" in capsys.readouterr().err


def _fake_cupy(count=None, error=None) -> types.ModuleType:
    def device_count() -> int:
        if error is not None:
            raise error
        return count

    cupy = types.ModuleType("cupy")
    cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=device_count))
    return cupy


def test_gpu_info_says_why_there_is_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # not installed
    with pytest.raises(_gpu_bench.NoGPU, match="CuPy is not installed"):
        _gpu_bench.gpu_info()
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(error=RuntimeError("no CUDA-capable device")))
    with pytest.raises(_gpu_bench.NoGPU, match="no usable CUDA GPU: RuntimeError: no CUDA-capable device"):
        _gpu_bench.gpu_info()
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(count=0))
    with pytest.raises(_gpu_bench.NoGPU, match="device count 0"):
        _gpu_bench.gpu_info()


def test_bench_stand_in_measures_every_layer_against_torch_and_the_copy(tmp_path):
    device = _gpu_bench.Device.cpu_stand_in()
    path = tmp_path / "bench.json"
    result = _gpu_bench.run(device, TINY, rounds=2, warmup=1, json_path=str(path), log=lambda _: None)
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    assert result["complete"] and result["stand_in"] and result["timer"] == "wall clock (stand-in)"
    rows = result["rows"]
    torch_there = device.torch is not None
    expected = {"npnorm generic", "npnorm"} | ({"torch cpu"} if torch_there else set())
    assert {r["layer"] for r in rows} == LAYERS
    for layer in LAYERS:
        assert {r["impl"] for r in rows if r["layer"] == layer} == expected
    for r in rows:
        nbytes = 4 * int(np.prod(r["shape"]))
        for key in ("fwd_ms", "bwd_ms", "fb_ms", "copy_ms", "fb_GBps", "copy_GBps", "fb_of_copy"):
            assert r[key] > 0, (r["impl"], key)
        assert r["fb_GBps"] == pytest.approx(5 * nbytes / r["fb_ms"] / 1e6)
        assert r["copy_GBps"] == pytest.approx(2 * nbytes / r["copy_ms"] / 1e6)
        assert (r["fb_vs_torch"] is not None) == torch_there
        assert r["max_error_vs"] == ("torch cpu" if torch_there else "npnorm generic")
        assert r["max_error_y"] < 1e-5 and r["max_error_dx"] < 1e-5, r


def test_bench_generic_rows_run_the_generic_kernels(monkeypatch):
    device = _gpu_bench.Device.cpu_stand_in()
    spec = Spec("LayerNorm", (2, 3, 16))
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((2, 2, 3, 16), dtype=np.float32)
    impls = _gpu_bench.impls_for(device, spec, x, dy)
    y_fast, dx_fast = impls["npnorm"].both()  # loads NumPy's specialized kernels

    def boom(*args, **kwargs):
        raise AssertionError("a specialized kernel ran")

    monkeypatch.setattr(_dispatch, "_SPECIALIZED", dict.fromkeys(_dispatch._SPECIALIZED, boom))
    y, dx = impls["npnorm generic"].both()
    np.testing.assert_allclose(y, y_fast, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dx_fast, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="specialized kernel ran"):
        impls["npnorm"].both()


def test_stage_limit_stops_a_hung_stage_and_says_so(tmp_path):
    res = _gpu_check._run_logged(
        [sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "s.log", 0.5
    )
    assert res["timed_out"] and res["returncode"] is None and res["seconds"] < 20
    assert "stopped after the stage's limit" in (tmp_path / "s.log").read_text()


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, which no one reaps here, has stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _ended(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running(pid)


def _pid_from(path: Path, within: float = 30.0) -> int:
    deadline = time.monotonic() + within
    while not (path.exists() and path.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(path.read_text())


PROC = pytest.mark.skipif(
    not hasattr(os, "killpg") or not Path("/proc/self/stat").exists(),
    reason="process groups are POSIX; the checks read /proc",
)


@contextlib.contextmanager
def _job_with_a_stage(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    """A gpu-check job (its own session, as a runner starts one) running a stage that
    sleeps: ``(the job's process, the stage's pid)``. Whatever is left is killed after."""
    pid_file = tmp_path / "stage.pid"
    stage = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    job = (
        "import sys\nfrom pathlib import Path\nfrom npnorm import _gpu_check\n"
        f"_gpu_check._run_logged([sys.executable, '-c', {stage!r}], Path({str(tmp_path / 's.log')!r}), 60)\n"
    )
    runner = subprocess.Popen([sys.executable, "-c", job], start_new_session=True)
    try:
        yield runner, _pid_from(pid_file)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
        runner.wait()
        if pid_file.exists() and _running(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


@PROC
def test_a_stage_goes_with_the_job_when_a_runner_kills_the_jobs_process_group(tmp_path):
    """a0bbaf9 put each stage in a session of its own: a job runner's kill of the job's
    process group (kill -- -PGID) then left the stage running on the GPU, unlimited."""
    with _job_with_a_stage(tmp_path) as (runner, stage):
        os.killpg(runner.pid, signal.SIGKILL)  # the job's whole group, as a runner kills it
        assert _ended(stage)


@PROC
def test_a_sigterm_to_the_job_alone_stops_its_stage_too(tmp_path):
    """Python's default SIGTERM ended gpu-check at once, without the stage's finally: the
    stage ran on, on the GPU."""
    with _job_with_a_stage(tmp_path) as (runner, stage):
        runner.send_signal(signal.SIGTERM)  # the job's process only
        assert runner.wait(timeout=30) == 128 + signal.SIGTERM
        assert _ended(stage)


@PROC
def test_a_stage_that_times_out_takes_its_children_with_it(tmp_path):
    """subprocess.run's timeout killed only the stage's own process: a pytest's xdist
    workers went on running (on the GPU) under the next stages."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    res = _gpu_check._run_logged([sys.executable, "-c", script], tmp_path / "s.log", 10.0)
    assert res["timed_out"]
    assert _ended(_pid_from(pid_file))


def _result(stand_in: bool) -> dict:
    row = {
        "layer": "LayerNorm",
        "shape": [8, 2048, 4096],
        "impl": "npnorm generic",
        "rounds": 10,
        "fwd_ms": 1.0,
        "bwd_ms": 2.0,
        "fb_ms": 3.0,
        "fb_GBps": 447.0,
        "copy_ms": 0.12,
        "copy_GBps": 4474.0,
        "fb_of_copy": 0.1,
        "fb_vs_torch": 4.5,
        "max_error_vs": "torch cuda",
        "max_error_y": 1e-7,
        "max_error_dx": 2e-7,
    }
    tests = {"status": "FAILED", "passed": 50, "cupy_passed": 49, "failed": 2, "errors": 0, "skipped": 9}
    tests |= {"failed_ids": ["tests.test_layer_norm::test_x[cupy]"], "skip_reasons": {"why": 9}}
    tests |= {"note": "2 failed, 0 errors", "log": "pytest_cupy.log"}
    main_job = {"status": "passed", "backends": ["cupy", "numpy"], "cupy_rows": 11, "log": "main_job.log"}
    bench = {"status": "passed", "rows": [row], "timer": "CUDA events", "log": "gpu_bench.log"}
    return {
        "started": "then",
        "stand_in": stand_in,
        "environment": {"python": "3.12.3", "cupy": "14.2.0"},
        "device": {"device": "Some GPU"},
        "stages": {"tests": tests, "main": main_job, "bench": bench},
        "exit_status": 1,
    }


@pytest.mark.parametrize("stand_in", [False, True])
def test_report_states_each_stage_and_the_figures(tmp_path, stand_in):
    (tmp_path / "pytest_cupy.log").write_text("line 1\nFAILED tests/test_layer_norm.py::test_x[cupy]\n")
    md_path, json_path = _gpu_check.write_report(tmp_path, _result(stand_in))
    md = md_path.read_text()
    assert json.loads(json_path.read_text()) == _result(stand_in)
    assert ("CPU STAND-IN" in md.splitlines()[0]) == stand_in
    summary = _gpu_check.summary(_result(stand_in)).splitlines()
    assert summary == [
        "tests: FAILED (50 passed, 49 of them on cupy, 2 failed, 0 errors, 9 skipped): 2 failed, 0 errors",
        "main: passed (backends: cupy, numpy; cupy rows: 11)",
        "bench: passed (1 rows; timer: CUDA events)",
    ]
    assert all(line in md for line in summary)
    assert "- failed: `tests.test_layer_norm::test_x[cupy]`" in md and "- skipped 9: why" in md
    assert "| LayerNorm (8, 2048, 4096) | npnorm generic | 1.000 | 2.000 | 3.000 | 447 | 10% | 4.50x |" in md
    assert (
        "### End of `pytest_cupy.log`" in md and "FAILED tests/test_layer_norm.py" in md
    )  # a failed log's tail
    _device_limits_hold(tmp_path)


def test_gpu_check_stand_in_runs_every_stage_and_claims_no_gpu(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "npnorm", "gpu-check", str(out), "--stand-in", "--quick", "--rounds", "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        check=False,
    )
    # on the CPU no case runs on cupy and the main job has no cupy rows: the check fails, as it must
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads((out / "gpu_check.json").read_text())
    tests, main_job, bench = (data["stages"][s] for s in ("tests", "main", "bench"))
    assert tests["status"] == "FAILED" and tests["cupy_passed"] == 0 and tests["skipped"] > 0
    assert "no case ran on the cupy backend" in tests["note"]
    assert main_job["all_passed"] and {"numpy", "array_api_strict"} <= set(main_job["backends"])
    assert main_job["status"] == "FAILED" and main_job["cupy_rows"] == 0
    assert bench["status"] == "passed" and {r["layer"] for r in bench["rows"]} == LAYERS
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# npnorm gpu-check: CPU STAND-IN, no GPU")
    assert (out / "pytest_cupy.log").exists() and (out / "main_job.log").exists()
    _device_limits_hold(out)


def test_tests_stage_without_pytest_says_why(tmp_path, monkeypatch):
    """A python without pytest: the report said only "pytest wrote no report", the reason
    was in the log."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "$0: No module named pytest"\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setattr(_gpu_check.sys, "executable", str(fake))
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the repository root (tests/)
    res = _gpu_check.stage_tests(tmp_path, timeout=60)
    assert res["status"] == _gpu_check.FAILED
    assert "exit status 1" in res["note"] and "No module named pytest" in res["note"]


def _pretend_xdist(monkeypatch, installed: bool) -> None:
    """pytest-xdist installed or not, as gpu-check finds it (whatever this machine has)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        _gpu_check.importlib.util,
        "find_spec",
        lambda name, *args: (object() if installed else None) if name == "xdist" else real(name, *args),
    )


@pytest.mark.parametrize("xdist", [True, False])
@pytest.mark.parametrize("workers", [0, 3])
def test_tests_stage_command_workers_and_no_benchmark_plugin(monkeypatch, tmp_path, xdist, workers):
    # -p no:benchmark always: pytest-benchmark's warning under xdist, an error under the
    # project's settings, stopped the stage on the GPU machine before it collected anything
    _pretend_xdist(monkeypatch, xdist)
    cmd = _gpu_check.pytest_command(tmp_path / "junit.xml", workers)
    assert cmd[:3] == [sys.executable, "-m", "pytest"]
    assert ["-p", "no:benchmark"] == cmd[cmd.index("no:benchmark") - 1 : cmd.index("no:benchmark") + 1]
    assert ("-n" in cmd) == (xdist and workers > 0)
    if "-n" in cmd:
        assert cmd[cmd.index("-n") + 1] == "3"
    assert cmd[-5:] == [
        "--hypothesis-profile=gpu",
        "-k",
        "cupy and not stand_in",
        f"--junit-xml={tmp_path / 'junit.xml'}",
        "tests",
    ]


@pytest.mark.parametrize(
    ("cores", "xdist", "expected"), [(16, True, 8), (4, True, 4), (2, True, 0), (16, False, 0)]
)
def test_default_workers(monkeypatch, cores, xdist, expected):
    monkeypatch.setattr(_gpu_check.os, "cpu_count", lambda: cores)
    _pretend_xdist(monkeypatch, xdist)
    assert _gpu_check.default_workers() == expected


def test_gpu_check_passes_workers_to_the_tests_stage(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(
        _gpu_check,
        "stage_tests",
        lambda out, limit, workers: seen.append(workers) or {"status": _gpu_check.SKIPPED},
    )
    _gpu_check.run(tmp_path, stages=("tests",), workers=5, stand_in=True)
    monkeypatch.setattr(_gpu_check, "default_workers", lambda: 7)
    _gpu_check.run(tmp_path, stages=("tests",), stand_in=True)
    assert seen == [5, 7]


def test_a_reader_that_stops_reading_stops_no_stage(monkeypatch, tmp_path):
    """``gpu-check OUT | head -1``: the first progress line's BrokenPipeError ended the
    command before any stage ran (or between two, the report left "running"): the stages
    and the report go on, standard output writing nowhere."""

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):
            raise OSError("no file descriptor")

    ran = []
    for name in ("tests", "main"):
        monkeypatch.setattr(
            _gpu_check,
            f"stage_{name}",
            lambda *a, name=name, **k: ran.append(name) or {"status": _gpu_check.PASSED},
        )
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    status = _gpu_check.run(tmp_path, stages=("tests", "main"), stand_in=True)
    assert ran == ["tests", "main"] and status == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["exit_status"] == 0 and set(report["stages"]) == {"tests", "main"}


def test_the_gpu_profile_reports_a_failure_without_shrinking_it():
    # the tests stage passes --hypothesis-profile=gpu: a CUDA compile error recompiles on
    # every call, and shrinking it ran the stage into its limit with no report
    from hypothesis import Phase, settings

    phases = settings.get_profile("gpu").phases
    assert Phase.shrink not in phases and Phase.generate in phases


# --- the stages' verdicts, the report and the exit status on synthetic child results ---
# (mutation testing by a subagent: each test below fails on a one-spot change of
# _gpu_check.py or _gpu_bench.py that every test above let through)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_ok[cupy-float32]" />
<testcase classname="tests.test_a" name="test_ok[numpy-float32]" />
<testcase classname="tests.test_cupy_only" name="test_names_cupy" />
<testcase classname="tests.test_a" name="test_bad[cupy]"><failure message="boom" /></testcase>
<testcase classname="tests.test_b" name="test_broken[cupy]"><error message="fixture" /></testcase>
<testcase classname="tests.test_a" name="test_gone[cupy]"><skipped message="no GPU" /></testcase>
<testcase classname="tests.test_a" name="test_gone[numpy]"><skipped message="no GPU" /></testcase>
<testcase classname="tests.test_c" name="test_other[cupy]"><skipped message="other" /></testcase>
</testsuite></testsuites>
"""


def test_parse_junit_counts_each_outcome_and_the_gpu_backends_passes(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    assert _gpu_check.parse_junit(path) == {
        "passed": 3,
        "failed": 1,
        "errors": 1,
        "skipped": 3,
        "cupy_passed": 1,  # not the numpy case, nor a test whose name alone says cupy
        "failed_ids": ["tests.test_a::test_bad[cupy]", "tests.test_b::test_broken[cupy]"],
        "skip_reasons": {"no GPU": 2, "other": 1},
    }


def _fake_run_logged(monkeypatch, returncode, *, timed_out=False, log="", write=None):
    """_run_logged as a stage calls it, the child replaced: ``write(cmd)`` plays its output
    files; the commands are returned in a list as they come."""
    calls = []

    def run_logged(cmd, log_path, timeout):
        calls.append((cmd, timeout))
        log_path.write_text(log)
        if write is not None:
            write(cmd)
        return {"returncode": returncode, "timed_out": timed_out, "seconds": 1.0, "log": log_path.name}

    monkeypatch.setattr(_gpu_check, "_run_logged", run_logged)
    return calls


def _junit_case(name, inner=""):
    return f'<testcase classname="tests.test_x" name="{name}">{inner}</testcase>'


@pytest.mark.parametrize(
    ("cases", "returncode", "timed_out", "status", "note"),
    [
        ([_junit_case("t[cupy]")], 0, False, "passed", None),
        (
            [_junit_case("t[cupy]"), _junit_case("u[cupy]", "<error/>")],
            1,
            False,
            "FAILED",
            "0 failed, 1 errors",
        ),
        (
            [_junit_case("t[cupy]"), _junit_case("u[cupy]", "<failure/>")],
            1,
            False,
            "FAILED",
            "1 failed, 0 errors",
        ),
        ([_junit_case("t[numpy]")], 0, False, "FAILED", "no case ran on the cupy backend"),
        (None, None, True, "FAILED", "timed out"),
        # a report written by a pytest that stopped early (KeyboardInterrupt, pytest.exit,
        # an internal error: exit status 2 or 3) holds only the cases run before: passed
        # cases in it are not a pass
        ([_junit_case("t[cupy]")], 2, False, "FAILED", "exit status 2"),
        ([_junit_case("t[cupy]")], 3, False, "FAILED", "exit status 3"),
    ],
    ids=["passed", "an error", "a failure", "no GPU case", "timed out", "interrupted", "internal error"],
)
def test_tests_stage_verdicts(monkeypatch, tmp_path, cases, returncode, timed_out, status, note):
    def write(cmd):
        if cases is not None:
            junit = next(a for a in cmd if a.startswith("--junit-xml=")).partition("=")[2]
            Path(junit).write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")

    monkeypatch.chdir(REPO)  # tests/ is there
    calls = _fake_run_logged(monkeypatch, returncode, timed_out=timed_out, write=write)
    res = _gpu_check.stage_tests(tmp_path, 12.5, workers=0)
    assert res["status"] == status
    assert (note is None and "note" not in res) or note in res["note"]
    assert [c[1] for c in calls] == [12.5]


def test_tests_stage_without_a_report_quotes_the_last_line(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    _fake_run_logged(monkeypatch, 4, log="$ pytest\nfirst\nERROR: usage: bad option\n")
    res = _gpu_check.stage_tests(tmp_path, 60, workers=0)
    assert res["status"] == "FAILED"
    assert res["note"] == "pytest wrote no report (exit status 4: ERROR: usage: bad option)"


def test_tests_stage_passes_its_workers_to_pytest(monkeypatch, tmp_path):
    _pretend_xdist(monkeypatch, True)
    monkeypatch.chdir(REPO)
    calls = _fake_run_logged(monkeypatch, None, timed_out=True)
    _gpu_check.stage_tests(tmp_path, 60, workers=3)
    cmd = calls[0][0]
    assert cmd[cmd.index("-n") + 1] == "3"
    assert "-rfEs" in cmd  # the failures' and skips' reasons in the log


MAIN_LOG = """layer      backend  forward  gradcheck  train+eval  torch f64  torch f32  result
---------  -------  -------  ---------  ----------  ---------  ---------  ------
LayerNorm  numpy    finite   pass       pass        3.1e-16    2.1e-07    ok
LayerNorm  cupy     finite   pass       pass        3.1e-16    2.1e-07    ok
RMSNorm    cupy     finite   FAIL       pass        3.1e-16    2.1e-07    FAIL
  a note on two lines that end in  a  b  c  d  e  ok
"""


def test_parse_main_job_reads_the_rows_and_the_verdict():
    parsed = _gpu_check.parse_main_job(MAIN_LOG + "some checks FAILED\n")
    assert parsed == {"backends": ["cupy", "numpy"], "cupy_rows": 2, "cupy_failed": 1, "all_passed": False}
    assert _gpu_check.parse_main_job(MAIN_LOG + "all checks passed\n")["all_passed"]


@pytest.mark.parametrize(
    ("returncode", "timed_out", "last", "status", "note"),
    [
        (0, False, "all checks passed", "passed", None),
        (1, False, "all checks passed", "FAILED", "exit status 1"),
        (0, False, "2 checks failed; the others passed", "FAILED", "exit status 0"),
        (None, True, "", "FAILED", "timed out"),
    ],
)
def test_main_stage_verdicts(monkeypatch, tmp_path, returncode, timed_out, last, status, note):
    calls = _fake_run_logged(monkeypatch, returncode, timed_out=timed_out, log=MAIN_LOG + last + "\n")
    res = _gpu_check.stage_main(tmp_path, 33.0)
    assert res["status"] == status
    assert (note is None and "note" not in res) or note in res["note"]
    assert calls == [([sys.executable, "-m", "npnorm"], 33.0)]


def test_main_stage_without_gpu_rows_fails(monkeypatch, tmp_path):
    log = MAIN_LOG.replace("cupy  ", "torch ") + "all checks passed\n"
    _fake_run_logged(monkeypatch, 0, log=log)
    res = _gpu_check.stage_main(tmp_path, 30)
    assert res["status"] == "FAILED" and res["note"] == "the main job found no cupy backend"


def _bench_row(layer="LayerNorm", shape=(2, 3), impl="npnorm"):
    return {
        "layer": layer,
        "shape": list(shape),
        "impl": impl,
        "rounds": 3,
        "fwd_ms": 1.0,
        "bwd_ms": 2.0,
        "fb_ms": 3.0,
        "fb_GBps": 10.0,
        "copy_ms": 0.5,
        "copy_GBps": 20.0,
        "fb_of_copy": 0.25,
        "fb_vs_torch": None,
        "max_error_vs": "npnorm generic",
        "max_error_y": 0.0,
        "max_error_dx": 0.0,
    }


@pytest.mark.parametrize(
    ("returncode", "timed_out", "complete", "status", "note"),
    [
        (0, False, True, "passed", None),
        (0, False, False, "FAILED", "exit status 0; 2 shapes measured"),
        (1, False, True, "FAILED", "exit status 1; 2 shapes measured"),
        (None, True, False, "FAILED", "timed out; 2 shapes measured"),
    ],
)
def test_bench_stage_verdicts(monkeypatch, tmp_path, returncode, timed_out, complete, status, note):
    rows = [_bench_row(), _bench_row(impl="npnorm generic"), _bench_row("RMSNorm")]

    def write(cmd):
        path = Path(cmd[cmd.index("--json") + 1])
        path.write_text(json.dumps({"rows": rows, "complete": complete, "timer": "CUDA events"}))

    calls = _fake_run_logged(monkeypatch, returncode, timed_out=timed_out, write=write)
    res = _gpu_check.stage_bench(tmp_path, 44.0, quick=True, rounds=7, stand_in=True)
    assert res["status"] == status and res.get("note") == note
    assert res["rows"] == rows and res["timer"] == "CUDA events"
    cmd, limit = calls[0]
    assert limit == 44.0 and cmd[:3] == [sys.executable, "-m", "npnorm._gpu_bench"]
    assert cmd[cmd.index("--rounds") + 1] == "7" and "--quick" in cmd and "--stand-in" in cmd
    cmd = _gpu_check.stage_bench(tmp_path, 44.0, quick=False, rounds=7, stand_in=False) and calls[1][0]
    assert "--quick" not in cmd and "--stand-in" not in cmd


def test_bench_stage_reads_no_figures_of_an_earlier_run(monkeypatch, tmp_path):
    (tmp_path / "gpu_bench.json").write_text(json.dumps({"rows": [_bench_row()], "complete": True}))
    _fake_run_logged(monkeypatch, 0)  # a benchmark that wrote nothing
    res = _gpu_check.stage_bench(tmp_path, 60, quick=True, rounds=1, stand_in=True)
    assert res["status"] == "FAILED" and res["rows"] == [] and res["note"] == "exit status 0"


def _stages_playing(monkeypatch, statuses, calls=None):
    """run()'s stages replaced by ones that return the given statuses (a stage whose status
    is an exception raises it) and record (name, limit)."""
    calls = [] if calls is None else calls

    def stage(name):
        def play(out, limit, *args, **kwargs):
            calls.append((name, limit, *args, *sorted(kwargs.items())))
            if isinstance(statuses[name], BaseException):
                raise statuses[name]
            return {"status": statuses[name], "log": f"{name}.log", "rows": []}

        return play

    for name in _gpu_check.STAGES:
        monkeypatch.setattr(_gpu_check, f"stage_{name}", stage(name))
    return calls


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        ({"tests": "passed", "main": "passed", "bench": "passed"}, 0),
        ({"tests": "FAILED", "main": "passed", "bench": "passed"}, 1),
        ({"tests": "passed", "main": "passed", "bench": "FAILED"}, 1),
        ({"tests": "not run", "main": "not run", "bench": "not run"}, 1),  # nothing passed
    ],
)
def test_gpu_check_exit_status(monkeypatch, tmp_path, statuses, expected):
    _stages_playing(monkeypatch, statuses)
    assert _gpu_check.run(tmp_path, stand_in=True) == expected
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["exit_status"] == expected and set(data["stages"]) == set(_gpu_check.STAGES)
    assert f"; exit status {expected}\n" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_runs_the_chosen_stages_in_their_order_with_their_limits(monkeypatch, tmp_path):
    calls = _stages_playing(monkeypatch, dict.fromkeys(_gpu_check.STAGES, "passed"))
    limits = {"tests": 11.0, "main": 22.0, "bench": None}
    stages = ("bench", "main")
    assert _gpu_check.run(tmp_path, stages=stages, timeouts=limits, quick=True, rounds=3, stand_in=True) == 0
    bench_options = (("quick", True), ("rounds", 3), ("stand_in", True))
    assert calls == [("bench", _gpu_check.DEFAULT_TIMEOUTS["bench"], *bench_options), ("main", 22.0)]
    assert _gpu_check.summary(json.loads((tmp_path / "gpu_check.json").read_text())).splitlines()[0] == (
        "tests: not run"
    )


def test_the_report_keeps_each_stage_when_a_later_one_breaks(monkeypatch, tmp_path):
    """The report is rewritten after each stage: a check that dies in a later stage (or is
    killed there) still reports the stages before it."""
    _stages_playing(monkeypatch, {"tests": "FAILED", "main": "passed", "bench": KeyboardInterrupt()})
    with pytest.raises(KeyboardInterrupt):
        _gpu_check.run(tmp_path, stand_in=True)
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {n: s["status"] for n, s in data["stages"].items()} == {"tests": "FAILED", "main": "passed"}
    assert "exit_status" not in data and "; exit status (running)" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_without_a_gpu_exits_2_and_says_why(monkeypatch, tmp_path, capsys):
    def no_gpu():
        raise _gpu_bench.NoGPU("no CUDA GPU here")

    monkeypatch.setattr(_gpu_check, "gpu_info", no_gpu)
    monkeypatch.setattr(_gpu_check, "nvidia_smi", lambda: "NVIDIA-SMI has failed")
    calls = _stages_playing(monkeypatch, dict.fromkeys(_gpu_check.STAGES, "passed"))
    assert _gpu_check.run(tmp_path / "out") == 2
    assert calls == [] and "no CUDA GPU here" in capsys.readouterr().err
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert data["exit_status"] == 2 and data["no_gpu"] == "no CUDA GPU here"
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "no GPU: no CUDA GPU here" in md and "NVIDIA-SMI has failed" in md


def test_report_details_notes_and_logs(tmp_path):
    (tmp_path / "main_job.log").write_text("".join(f"line {i}\n" for i in range(40)))
    (tmp_path / "pytest_cupy.log").write_text("tests' log\n")
    result = _result(stand_in=False)
    result["stages"]["tests"] |= {"status": "passed", "failed_ids": [f"t{i}" for i in range(60)]}
    result["stages"]["main"] |= {"status": "FAILED", "note": "exit status 1: some checks failed"}
    del result["stages"]["bench"]
    result["stages"]["main"].pop("backends")
    result["device"]["memory_GiB"] = 80.0
    md = _gpu_check.write_report(tmp_path, result)[0].read_text()
    assert "main: FAILED: exit status 1: some checks failed" in md and "bench: not run" in md
    assert "- memory_GiB: 80.0" in md
    assert "- failed: `t49`" in md and "t50" not in md  # 50 at most
    tail = md.split("### End of `main_job.log`")[1]
    assert "line 39" in tail and "line 25" in tail and "line 24" not in tail  # the last 15 lines
    assert "tests' log" not in md and "### End of `pytest_cupy.log`" not in md  # passed: no log


def test_summary_of_no_gpu_says_why():
    assert _gpu_check.summary({"no_gpu": "CuPy is not installed"}) == "no GPU: CuPy is not installed"


# --- the benchmark's arithmetic on scripted timings ---


class _Script:
    """A timer whose calls take the given times in turn (and run the timed call)."""

    def __init__(self, times, log, name):
        self.times, self.log, self.name = list(times), log, name

    def __call__(self, fn):
        self.log.append(self.name)
        return self.times.pop(0), fn()


def test_bench_spec_medians_ratios_and_rotation(monkeypatch):
    """Three rounds after one warm-up round: figures are medians of the timed rounds only,
    'vs torch' the median of per-round ratios npnorm/torch, 'of copy' the median of per-round
    2.5 x copy / f+b; each round starts at the next implementation."""
    log = []
    spec = Spec("LayerNorm", (2, 4))
    # per round: fwd, bwd, f+b; the warm-up round's times are huge and must not count
    ours = [900, 900, 900, 1, 10, 4, 2, 20, 10, 9, 30, 2]
    torch = [900, 900, 900, 1, 1, 2, 1, 1, 2, 1, 1, 8]
    y = np.ones(spec.shape, np.float32)

    def impl(times, name, scale):
        result = (scale * y, scale**2 * 2 * y)
        return _gpu_bench.Impl(
            forward=lambda: None,
            backward=lambda _: None,
            both=lambda: result,
            timer=_Script(times, log, name),
        )

    impls = {"npnorm": impl(ours, "npnorm", 1.5), "torch cuda": impl(torch, "torch cuda", 1.0)}
    monkeypatch.setattr(_gpu_bench, "impls_for", lambda *a: impls)
    copy = _Script([900, 1.0, 2.0, 4.0], log, "copy")
    device = _gpu_bench.Device(xp=np, timer=copy, torch=None, torch_device=None, torch_timer=None)
    rows = {r["impl"]: r for r in _gpu_bench.bench_spec(device, spec, rounds=3, warmup=1)}
    assert log == [
        *["copy", *["npnorm"] * 3, *["torch cuda"] * 3],
        *["copy", *["torch cuda"] * 3, *["npnorm"] * 3],
        *["copy", *["npnorm"] * 3, *["torch cuda"] * 3],
        *["copy", *["torch cuda"] * 3, *["npnorm"] * 3],
    ]
    ours_row, torch_row = rows["npnorm"], rows["torch cuda"]
    assert (ours_row["fwd_ms"], ours_row["bwd_ms"], ours_row["fb_ms"]) == (2, 20, 4)
    assert ours_row["copy_ms"] == torch_row["copy_ms"] == 2.0 and ours_row["rounds"] == 3
    assert ours_row["fb_vs_torch"] == pytest.approx(2.0)  # per round 4/2, 10/2, 2/8: median 2
    assert torch_row["fb_vs_torch"] == 1.0
    assert ours_row["fb_of_copy"] == pytest.approx(0.625)  # 2.5 x (1/4, 2/10, 4/2): median 0.625
    nbytes = 4 * 8
    assert ours_row["fb_GBps"] == pytest.approx(5 * nbytes / 4 / 1e6)
    assert ours_row["copy_GBps"] == pytest.approx(2 * nbytes / 2 / 1e6)
    assert ours_row["max_error_vs"] == "torch cuda"
    assert ours_row["max_error_y"] == pytest.approx(0.5) and ours_row["max_error_dx"] == pytest.approx(1.25)
    assert torch_row["max_error_y"] == torch_row["max_error_dx"] == 0


def test_max_error_is_relative_to_at_least_one():
    assert _gpu_bench._max_error(np.array([0.5, 0.0]), np.array([0.25, 0.0])) == 0.25
    assert _gpu_bench._max_error(np.array([3.0, 0.0]), np.array([4.0, -1.0])) == 0.25


def test_format_rows_columns():
    row = _bench_row() | {"fb_vs_torch": 1.234, "fb_of_copy": 0.5, "max_error_y": 1e-7}
    text = _gpu_bench.format_rows([row, _bench_row(impl="npnorm generic")])
    head, _columns, ours, generic = text.splitlines()
    assert head == "LayerNorm (2, 3) float32   copy 0.500 ms (20 GB/s read+write); medians of 3 rounds"
    assert ours.split() == ["npnorm", "1.000", "2.000", "3.000", "10", "50%", "1.23", "1.0e-07", "0.0e+00"]
    assert generic.split()[-3] == "-"  # no torch figure


def test_cuda_versions_and_the_devices_memory(monkeypatch):
    assert _gpu_bench._cuda_version(12040) == "12.4" and _gpu_bench._cuda_version(13000) == "13.0"
    props = {"name": b"Some GPU", "totalGlobalMem": 80 * 2**30, "major": 9, "minor": 0}
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1,
        getDeviceProperties=lambda i: props,
        runtimeGetVersion=lambda: 12080,
        driverGetVersion=lambda: 12090,
    )
    cupy = _fake_cupy(count=1)
    cupy.cuda = types.SimpleNamespace(runtime=runtime)
    cupy.__version__ = "14.0"
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    info = _gpu_bench.gpu_info()
    assert info["device"] == "Some GPU" and info["memory_GiB"] == 80.0 and info["compute_capability"] == "9.0"
    assert (info["cuda_runtime"], info["cuda_driver"]) == ("12.8", "12.9")


def test_bench_saves_after_each_spec_and_marks_the_end(monkeypatch, tmp_path):
    """A benchmark cut short keeps the shapes it measured, and says it was cut short."""
    path = tmp_path / "bench.json"
    seen = []

    def bench_spec(device, spec, rounds, warmup):
        if path.exists():
            seen.append(json.loads(path.read_text()))
        return [_bench_row(spec.layer, spec.shape)]

    monkeypatch.setattr(_gpu_bench, "bench_spec", bench_spec)
    specs = [Spec("LayerNorm", (2, 3)), Spec("RMSNorm", (2, 3))]
    _gpu_bench.run(_gpu_bench.Device.cpu_stand_in(), specs, json_path=str(path), log=lambda _: None)
    assert len(seen) == 1 and not seen[0]["complete"] and len(seen[0]["rows"]) == 1
    final = json.loads(path.read_text())
    assert final["complete"] and [r["layer"] for r in final["rows"]] == ["LayerNorm", "RMSNorm"]


def test_bench_main_options_and_no_gpu(monkeypatch, capsys):
    def no_gpu():
        raise _gpu_bench.NoGPU("none here")

    monkeypatch.setattr(_gpu_bench.Device, "cuda", staticmethod(no_gpu))
    assert _gpu_bench.main([]) == 2 and "none here" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(_gpu_bench, "run", lambda device, specs, **kw: seen.append((specs, kw)))
    assert _gpu_bench.main(["--stand-in", "--rounds", "4", "--warmup", "3"]) == 0
    assert _gpu_bench.main(["--stand-in", "--quick"]) == 0
    assert seen[0] == (_gpu_bench.FULL, {"rounds": 4, "warmup": 3, "json_path": None})
    assert seen[1][0] == _gpu_bench.QUICK


def test_bench_stage_with_figures_cut_off_mid_write(monkeypatch, tmp_path):
    """A benchmark killed at its limit while it saved its figures left half a JSON file:
    gpu-check ended in a traceback, the bench stage and the exit status missing from the report."""

    def write(cmd):
        Path(cmd[cmd.index("--json") + 1]).write_text('{"device": {}, "rows": [{"layer": "La')

    _fake_run_logged(monkeypatch, None, timed_out=True, write=write)
    res = _gpu_check.stage_bench(tmp_path, 60, quick=True, rounds=1, stand_in=True)
    assert res["status"] == "FAILED" and res["rows"] == [] and res["note"].startswith("timed out")
    assert "gpu_bench.json" in res["note"]


def test_bench_figures_survive_a_kill_while_they_are_saved(monkeypatch, tmp_path):
    """The figures are saved after each shape by replacing the file: a benchmark killed
    while it saved left half a JSON file, and every figure of the shapes before was lost."""
    path = tmp_path / "bench.json"
    monkeypatch.setattr(_gpu_bench, "bench_spec", lambda d, spec, r, w: [_bench_row(spec.layer, spec.shape)])
    real_dump, saves = json.dump, []

    def dump(obj, f, **kwargs):
        saves.append(1)
        if len(saves) == 2:  # the second save is killed halfway
            f.write(json.dumps(obj)[:20])
            raise KeyboardInterrupt
        real_dump(obj, f, **kwargs)

    monkeypatch.setattr(json, "dump", dump)  # (write_json's)
    specs = [Spec("LayerNorm", (2, 3)), Spec("RMSNorm", (2, 3))]
    with pytest.raises(KeyboardInterrupt):
        _gpu_bench.run(_gpu_bench.Device.cpu_stand_in(), specs, json_path=str(path), log=lambda _: None)
    saved = json.loads(path.read_text())
    assert not saved["complete"] and [r["layer"] for r in saved["rows"]] == ["LayerNorm"]


def test_a_stages_log_has_its_standard_error_too(tmp_path):
    """Python's tracebacks and "No module named pytest" go to standard error: the log,
    and the report's tail of it, must have them."""
    script = "import sys; print('out', flush=True); sys.exit('Traceback: on stderr')"
    res = _gpu_check._run_logged([sys.executable, "-c", script], tmp_path / "s.log", 60)
    assert res["returncode"] == 1 and not res["timed_out"]
    assert (tmp_path / "s.log").read_text().splitlines()[1:] == ["out", "Traceback: on stderr"]


def test_tests_stage_run_outside_the_repository_fails(monkeypatch, tmp_path):
    # asked for the cupy tests and finding no tests/ folder, it ran none: a failure (it was
    # "not run", and gpu-check exited 0 when the main job and the benchmark passed)
    monkeypatch.chdir(tmp_path)
    calls = _fake_run_logged(monkeypatch, 0)
    res = _gpu_check.stage_tests(tmp_path, 60, workers=0)
    assert res["status"] == "FAILED" and "run from the repository root" in res["note"]
    assert calls == []
