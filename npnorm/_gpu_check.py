"""``python -m npnorm gpu-check OUT_DIR``: everything npnorm has to show on a GPU, in one run.

On a machine with an NVIDIA GPU and CuPy it runs, each stage in its own process with its own
time limit (so that one stage that hangs or crashes leaves the others and the report):

1. ``tests``: the cupy test cases (``pytest -k "cupy and not stand_in"`` on ``tests/`` of the
   current folder, on up to 8 pytest-xdist workers where xdist is installed: ``--workers``);
2. ``main``: the main job, ``python -m npnorm``, which must show cupy rows and pass;
3. ``bench``: the GPU benchmark (:mod:`npnorm._gpu_bench`).

It writes into OUT_DIR ``gpu_check.md`` (summary first, then each stage) and
``gpu_check.json`` (the same, as data), rewritten after each stage, and beside them each
stage's log (``pytest_cupy.log``, ``main_job.log``, ``gpu_bench.log``) and the benchmark's
``gpu_bench.json``: at most 6 files, and ``tools/gpu_check.sh`` adds its ``install.log``.
Exit status: 0 when every stage run passed, 1 when one failed, 2 when there is no GPU (the
report then says why, and nothing else runs).

``--stand-in`` runs the same stages on the CPU, with NumPy standing in for CuPy in the
benchmark: a test of this script, whose report says so in its first line and whose tests
and main-job stages fail (no cupy case runs). It proves nothing about a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ._files import write_json, write_whole
from ._gpu_bench import Device, NoGPU, format_rows, gpu_info

STAGES = ("tests", "main", "bench")
# seconds, 6.5 minutes in all: about 3x the stages' times on the H200 of 2026-12-04 (54, 29
# and 37 s), so that a device call of 450 s leaves time in a session's 15 minutes for a second
DEFAULT_TIMEOUTS = {"tests": 180.0, "main": 90.0, "bench": 120.0}
PASSED, FAILED, SKIPPED = "passed", "FAILED", "not run"


def versions() -> dict[str, str]:
    """Python and the versions of the packages the check uses ('-' where missing)."""
    found = {"python": platform.python_version(), "executable": sys.executable}
    names = (
        "npnorm",
        "numpy",
        "array_api_compat",
        "array_api_strict",
        "cupy",
        "torch",
        "pytest",
        "hypothesis",
    )
    for name in names:
        if importlib.util.find_spec(name) is None:
            found[name] = "-"
            continue
        try:
            module = __import__(name)
            found[name] = str(getattr(module, "__version__", "?"))
            if name == "npnorm":  # the installed copy or the source tree: which one ran
                found[name] += f" ({os.path.dirname(str(module.__file__))})"
        except Exception as err:  # a package that is there but does not import is worth reporting
            found[name] = f"import fails: {type(err).__name__}: {err}"
    return found


def nvidia_smi() -> str:
    """``nvidia-smi``'s view of the GPUs and driver, or why it gave none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"nvidia-smi: {type(err).__name__}: {err}"
    return (out.stdout + out.stderr).strip()


def _run_logged(cmd: list[str], log: Path, timeout: float) -> dict[str, Any]:
    """Run ``cmd`` with stdout and stderr into ``log``; its exit status, time and whether it timed out.

    A stage that times out is killed with every process below it: a timed-out pytest's
    xdist workers (or a main job's children) would otherwise go on using the GPU under the
    next stages, skewing their timings. The stage stays in this process's group, so that a
    job runner that kills the group (``kill -- -PGID``) stops it too, and a SIGTERM or
    SIGHUP to this process alone stops the stage before it exits (``_signals_exit``)."""
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f, _signals_exit():
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc: int | None = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
        finally:
            _kill_tree(proc)
    seconds = round(time.perf_counter() - t0, 1)
    if timed_out:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"\n[gpu-check: stopped after the stage's limit of {timeout:.0f} s]\n")
    return {"returncode": rc, "timed_out": timed_out, "seconds": seconds, "log": log.name}


@contextlib.contextmanager
def _signals_exit() -> Iterator[None]:
    """While a stage runs, SIGTERM and SIGHUP raise SystemExit (128 + the signal), so that
    the stage's ``finally`` kills it: Python's default for them ends the process at once,
    and the stage ran on. Only the main thread may set handlers; elsewhere, nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    names = [s for s in ("SIGTERM", "SIGHUP") if hasattr(signal, s)]
    before = {name: signal.signal(getattr(signal, name), leave) for name in names}
    try:
        yield
    finally:
        for name, handler in before.items():
            signal.signal(getattr(signal, name), handler)


def _kill_tree(proc: subprocess.Popen[Any]) -> None:
    """Where ``proc`` still runs (it timed out), SIGKILL it and the processes below it
    (found in Linux's /proc before the kill: an orphan is the init process's child after
    it); then reap ``proc``. A ``proc`` that ended was reaped by ``wait``: its pid may be
    another process's by now, so nothing is killed."""
    if proc.poll() is None:  # not reaped: the pid is still proc's
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # gone already
                pass
    proc.wait()


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid``, from /proc/*/stat's parent ids (none where there is no
    /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid
        except (OSError, IndexError):  # a process that ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts of a pytest JUnit XML report (``cupy_passed``: passed cases whose parameters
    name cupy), the ids of the failed cases and the skip reasons."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "cupy_passed": 0}
    failed: list[str] = []
    skip_reasons: dict[str, int] = {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            failed.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            failed.append(name)
        elif (skip := case.find("skipped")) is not None:
            counts["skipped"] += 1
            reason = skip.get("message", "")
            skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
        else:
            counts["passed"] += 1
            params = name.partition("[")[2]
            counts["cupy_passed"] += "cupy" in params  # a case run on the cupy backend
    return {**counts, "failed_ids": failed, "skip_reasons": skip_reasons}


def default_workers() -> int:
    """pytest-xdist workers for the tests stage: up to 8 where xdist is installed and the
    machine has 4 cores or more, else 0 (one process). On the H200 machine of 2026-12-04,
    8 workers ran the 118 cases in 50 s."""
    cores = os.cpu_count() or 1
    return min(8, cores) if cores >= 4 and importlib.util.find_spec("xdist") is not None else 0


def pytest_command(junit: Path, workers: int) -> list[str]:
    """The tests stage's pytest call: the cupy cases, a JUnit report into ``junit``, and, with
    ``workers`` > 0 where pytest-xdist is installed, that many worker processes; the
    "gpu" Hypothesis profile (no shrinking), and not the stand-in's CPU tests.
    pytest-benchmark is switched off (``-p no:benchmark``; nothing where it is absent): it
    warns whenever xdist is active, and the project's pytest settings make warnings errors,
    which stopped pytest before it collected anything on the GPU machine."""
    cmd = [sys.executable, "-m", "pytest", "-v", "--tb=short", "-rfEs", "-p", "no:cacheprovider"]
    cmd += ["-p", "no:benchmark"]
    if workers > 0 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers)]
    # the "gpu" profile (tests/conftest.py) skips Hypothesis's shrinking: a failure that is
    # slow on every call (a CUDA compile error recompiles each time) shrank for minutes and
    # ran the stage into its limit with no report; the stand-in's tests run on the CPU
    cmd += ["--hypothesis-profile=gpu"]
    return [*cmd, "-k", "cupy and not stand_in", f"--junit-xml={junit}", "tests"]


def stage_tests(out: Path, timeout: float, workers: int = 0) -> dict[str, Any]:
    """The cupy test cases, ``pytest -k "cupy and not stand_in"`` (on ``workers`` xdist
    processes, see ``pytest_command``); passed when none fails, cases on the cupy backend
    ran (``-k cupy`` also selects tests that merely name cupy) and pytest exited with 0 (a
    pytest interrupted or stopped by an internal error still writes its JUnit report, of
    the cases run until then)."""
    if not Path("tests").is_dir():  # asked for the cupy tests, it ran none: not a pass
        return {"status": FAILED, "note": f"no tests/ folder in {os.getcwd()}: run from the repository root"}
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        res = _run_logged(pytest_command(junit, workers), out / "pytest_cupy.log", timeout)
        if junit.exists():
            res.update(parse_junit(junit))
    if res["timed_out"] or "passed" not in res:
        res["status"] = FAILED
        last = _tail(out / res["log"], 1).strip()  # "No module named pytest", say
        res["note"] = (
            "timed out"
            if res["timed_out"]
            else f"pytest wrote no report (exit status {res['returncode']}: {last or 'no output'})"
        )
    elif res["failed"] or res["errors"]:
        res["status"] = FAILED
        res["note"] = f"{res['failed']} failed, {res['errors']} errors"
    elif res["cupy_passed"] == 0:
        res["status"] = FAILED
        res["note"] = "no case ran on the cupy backend (see the skip reasons)"
    elif res["returncode"] != 0:  # interrupted or an internal error: the cases before it only
        res["status"] = FAILED
        res["note"] = f"pytest stopped with exit status {res['returncode']} and no failed case: see the log"
    else:
        res["status"] = PASSED
    return res


def parse_main_job(text: str) -> dict[str, Any]:
    """Backends and results of the main job's table (``python -m npnorm``)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cols = line.split()
        if len(cols) >= 7 and cols[-1] in ("ok", "FAIL") and not line.startswith(" "):
            rows.setdefault(cols[1], []).append(cols[-1])
    return {
        "backends": sorted(rows),
        "cupy_rows": len(rows.get("cupy", [])),
        "cupy_failed": rows.get("cupy", []).count("FAIL"),
        "all_passed": "all checks passed" in text,
    }


def stage_main(out: Path, timeout: float) -> dict[str, Any]:
    """The main job; passed when it passes and includes cupy."""
    log = out / "main_job.log"
    res = _run_logged([sys.executable, "-m", "npnorm"], log, timeout)
    res.update(parse_main_job(log.read_text(errors="replace")))
    if res["timed_out"]:
        res["status"], res["note"] = FAILED, "timed out"
    elif res["returncode"] != 0 or not res["all_passed"]:
        res["status"], res["note"] = FAILED, f"exit status {res['returncode']}: some checks failed"
    elif res["cupy_rows"] == 0:
        res["status"], res["note"] = FAILED, "the main job found no cupy backend"
    else:
        res["status"] = PASSED
    return res


def stage_bench(out: Path, timeout: float, *, quick: bool, rounds: int, stand_in: bool) -> dict[str, Any]:
    """The GPU benchmark in its own process; its figures are read back from its JSON."""
    data_file = out / "gpu_bench.json"
    data_file.unlink(missing_ok=True)  # figures of an earlier run in the same folder are not this run's
    cmd = [sys.executable, "-m", "npnorm._gpu_bench", "--json", str(data_file), "--rounds", str(rounds)]
    cmd += ["--quick"] if quick else []
    cmd += ["--stand-in"] if stand_in else []
    res = _run_logged(cmd, out / "gpu_bench.log", timeout)
    data: dict[str, Any] = {}
    unreadable = ""
    if data_file.exists():
        try:
            data = json.loads(data_file.read_text(encoding="utf-8"))
        except ValueError as err:  # cut off mid-write: the benchmark was killed while it saved
            unreadable = f"; {data_file.name} unreadable ({err})"
    res["rows"] = data.get("rows", [])
    res["complete"] = bool(data.get("complete"))
    res["timer"] = data.get("timer")
    if res["returncode"] == 0 and res["complete"]:
        res["status"] = PASSED
    else:
        res["status"] = FAILED
        res["note"] = "timed out" if res["timed_out"] else f"exit status {res['returncode']}"
        res["note"] += unreadable
        if res["rows"]:
            res["note"] += f"; {len({(r['layer'], tuple(r['shape'])) for r in res['rows']})} shapes measured"
    return res


def _md_bench_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| layer, shape | impl | fwd ms | bwd ms | f+b ms | f+b GB/s | of copy | vs torch | copy GB/s |"
        " err y | err dx |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = "-" if r["fb_vs_torch"] is None else f"{r['fb_vs_torch']:.2f}x"
        lines.append(
            f"| {r['layer']} {tuple(r['shape'])} | {r['impl']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | "
            f"{r['fb_ms']:.3f} | {r['fb_GBps']:.0f} | {r['fb_of_copy']:.0%} | {vs} | {r['copy_GBps']:.0f} | "
            f"{r['max_error_y']:.1e} | {r['max_error_dx']:.1e} |"
        )
    return lines


def summary(result: dict[str, Any]) -> str:
    """One line per stage: what passed, with its figures."""
    if result.get("no_gpu"):
        return f"no GPU: {result['no_gpu']}"
    lines = []
    for name in STAGES:
        st = result["stages"].get(name)
        if st is None:
            lines.append(f"{name}: {SKIPPED}")
            continue
        text = f"{name}: {st['status']}"
        if name == "tests" and "passed" in st:
            text += f" ({st['passed']} passed, {st['cupy_passed']} of them on cupy, {st['failed']} failed, "
            text += f"{st['errors']} errors, {st['skipped']} skipped)"
        if name == "main" and "backends" in st:
            text += f" (backends: {', '.join(st['backends']) or 'none'}; cupy rows: {st['cupy_rows']})"
        if name == "bench" and st.get("rows"):
            text += f" ({len(st['rows'])} rows; timer: {st.get('timer')})"
        if st.get("note"):
            text += f": {st['note']}"
        lines.append(text)
    return "\n".join(lines)


def write_report(out: Path, result: dict[str, Any]) -> tuple[Path, Path]:
    """``gpu_check.md`` and ``gpu_check.json`` in ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "gpu_check.json"  # (each file whole: a kill while writing leaves the last)
    write_json(str(json_path), result)
    env = result.get("environment", {})
    title = "# npnorm gpu-check"
    if result.get("stand_in"):
        title += ": CPU STAND-IN, no GPU (a test of the script; no figure here is a GPU figure)"
    status = result.get("exit_status", "(running)")
    lines = [title, "", f"{result.get('started', '')}; exit status {status}", ""]
    lines += ["## Summary", "", "```", summary(result), "```", "", "## Environment", ""]
    lines += [f"- {k}: {v}" for k, v in {**env, **result.get("device", {})}.items()]
    if result.get("nvidia_smi"):
        lines += ["", "```", result["nvidia_smi"], "```"]
    stages = result.get("stages", {})
    if "tests" in stages:
        st = stages["tests"]
        lines += ["", '## Tests: `pytest -k "cupy and not stand_in"`', ""]
        lines += [f"{st['status']}; log: `{st.get('log', '-')}`"]
        for case in st.get("failed_ids", [])[:50]:
            lines.append(f"- failed: `{case}`")
        for reason, n in st.get("skip_reasons", {}).items():
            lines.append(f"- skipped {n}: {reason}")
    if "main" in stages:
        st = stages["main"]
        lines += ["", "## Main job: `python -m npnorm`", "", f"{st['status']}; log: `{st.get('log', '-')}`"]
    if "bench" in stages:
        st = stages["bench"]
        lines += ["", "## GPU benchmark", ""]
        lines += [f"{st['status']}; log: `{st.get('log', '-')}`; timer: {st.get('timer')}"]
        lines += [
            "",
            "float32; f+b GB/s counts 5 x the input's bytes (forward reads x, writes y; backward reads "
            "x and dy, writes dx); 'of copy' is that bandwidth over the device-to-device copy's "
            "(2 x bytes); 'vs torch' the median per-round ratio of f+b times; err: largest "
            "difference from the reference (torch; npnorm generic where torch is absent) relative "
            "to max(1, |reference|), after one forward+backward.",
            "",
        ]
        lines += _md_bench_table(st.get("rows", [])) if st.get("rows") else ["(no rows)"]
    for name in STAGES:
        st = stages.get(name)
        if st and st["status"] == FAILED and st.get("log"):
            lines += ["", f"### End of `{st['log']}`", "", "```", _tail(out / st["log"]), "```"]
    md_path = out / "gpu_check.md"
    write_whole(md_path, lambda part: part.write_text("\n".join(lines) + "\n", encoding="utf-8"))
    return md_path, json_path


def run(
    out_dir: str | Path,
    *,
    stages: Sequence[str] = STAGES,
    timeouts: dict[str, float | None] | None = None,
    quick: bool = False,
    rounds: int = 10,
    stand_in: bool = False,
    workers: int | None = None,
) -> int:
    """Run the stages and write the report; returns the exit status (module docstring).
    ``workers``: the tests stage's xdist processes (None: ``default_workers()``; 0: one)."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    limits = {s: (timeouts or {}).get(s) or DEFAULT_TIMEOUTS[s] for s in STAGES}
    result: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "stand_in": stand_in,
        "environment": versions(),
        "stages": {},
    }
    say = _Progress()  # the report is the output: a reader that stops reading stops no stage
    if stand_in:
        result["device"] = Device.cpu_stand_in().info
    else:
        result["nvidia_smi"] = nvidia_smi()
        try:
            result["device"] = gpu_info()
        except NoGPU as err:
            result["no_gpu"] = str(err)
            result["exit_status"] = 2
            md, _ = write_report(out, result)
            print(f"gpu-check: {err}\nreport: {md}", file=sys.stderr)
            return 2
    say(f"gpu-check: {result['device'].get('device')}; writing into {out}")
    for name in stages:
        say(f"gpu-check: {name} (limit {limits[name]:.0f} s) ...")
        if name == "tests":
            st = stage_tests(out, limits[name], default_workers() if workers is None else workers)
        elif name == "main":
            st = stage_main(out, limits[name])
        else:
            st = stage_bench(out, limits[name], quick=quick, rounds=rounds, stand_in=stand_in)
        result["stages"][name] = st
        write_report(out, result)
        note = f" ({st['note']})" if st.get("note") else ""
        say(f"gpu-check: {name}: {st['status']}{note}")
        if name == "bench" and st["rows"]:
            for layer_shape in dict.fromkeys((r["layer"], tuple(r["shape"])) for r in st["rows"]):
                say(format_rows([r for r in st["rows"] if (r["layer"], tuple(r["shape"])) == layer_shape]))
    ran = [result["stages"][n]["status"] for n in stages]
    result["exit_status"] = 0 if all(s in (PASSED, SKIPPED) for s in ran) and PASSED in ran else 1
    md, _ = write_report(out, result)
    say("\n" + summary(result) + f"\nreport: {md}")
    return int(result["exit_status"])


class _Progress:
    """gpu-check's progress lines on standard output, which it goes on without once the
    reader stops reading (``gpu-check OUT | head -1`` ended the command by BrokenPipeError
    before any stage ran, or between two, leaving the report "running"): standard output
    then writes nowhere, and the stages and the report go on."""

    def __init__(self) -> None:
        self.closed = False

    def __call__(self, text: str) -> None:
        if self.closed:
            return
        try:
            print(text, flush=True)
        except BrokenPipeError:
            self.closed = True
            try:  # the interpreter's last flush writes nowhere too
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError, io.UnsupportedOperation):
                pass
