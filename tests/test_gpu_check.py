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
