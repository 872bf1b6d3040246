import importlib.util
import os
import signal
import subprocess
import sys

import pytest

from npnorm.__main__ import PROFILED
from npnorm.__main__ import main as cli_main


def test_main_job_passes_and_prints_a_table():
    out = subprocess.run(
        [sys.executable, "-m", "npnorm"], capture_output=True, text=True, check=False, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout
    for layer in (
        "LayerNorm",
        "RMSNorm",
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm3d",
        "InstanceNorm1d",
        "InstanceNorm2d",
        "InstanceNorm3d",
        "GroupNorm",
    ):
        assert layer in out.stdout
    assert "array_api_strict" in out.stdout
    if importlib.util.find_spec("torch") is not None:  # its tensors as a backend
        assert any(line.split()[1:2] == ["torch"] for line in out.stdout.splitlines())


def test_profile_command_charges_time_to_kernel_lines():
    out = subprocess.run(
        [sys.executable, "-m", "npnorm", "profile", "GroupNorm", "--reps", "1"],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "GroupNorm (32, 64, 56, 56)" in out.stdout and "in NumPy calls" in out.stdout
    assert "numpy_fast_channels.py:" in out.stdout


@pytest.mark.parametrize(
    "argv,message",
    [
        (["profile", "NoSuchLayer"], "unknown layer 'NoSuchLayer'"),
        (["profile", "layernorm"], "unknown layer 'layernorm'"),
        (["profile", "LayerNorm", "--reps", "0"], "expected a positive integer, got 0"),
        (["profile", "LayerNorm", "--reps", "-1"], "expected a positive integer, got -1"),
        (["bench", "--reps", "0"], "expected a positive integer, got 0"),
        (["gpu-check", "out", "--rounds", "0"], "expected a positive integer, got 0"),
    ],
)
def test_bad_counts_and_layer_names_are_usage_errors(argv, message, capsys):
    # an unknown layer printed nothing and exited 0; --reps 0 was a ZeroDivisionError,
    # --reps -1 printed negative times
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--foo"],
        ["warmup", "extra"],
        ["profile", "LayerNorm", "--zap"],
        ["demo", "--quick", "--nope"],
    ],
)
def test_an_argument_a_command_does_not_take_is_refused_with_its_usage(argv, capsys):
    """The main parser's usage was printed, which does not show the command's options."""
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"usage: python -m npnorm {argv[0]} ")
    assert f"python -m npnorm {argv[0]}: error: unrecognized arguments: {argv[-1]}" in err


def test_profiled_layers_are_the_benchmark_layers():
    from npnorm._bench import FULL

    assert set(PROFILED) == {spec.layer for spec in FULL}


def test_profile_restores_the_kernels_numpy():
    import numpy as np

    from npnorm import _profile
    from npnorm._bench import Spec

    result = _profile.profile(Spec("LayerNorm", (2, 8, 64)), reps=1)
    assert all(m.np is np for m in _profile.KERNEL_MODULES)
    sites = result["sites"]
    assert sites and all(s["file"] != "_blocks.py" for s in sites)  # charged to kernel lines
    assert {s["function"] for s in sites} >= {"subtract", "multiply", "vecdot"}


@pytest.mark.parametrize(
    "argv,message",
    [
        (["demo", "--seed", "-3"], "expected a non-negative integer, got -3"),
        (["demo", "--seed", "x"], "expected a non-negative integer, got 'x'"),
    ],
)
def test_bad_demo_seed_is_a_usage_error(argv, message, capsys):
    # a negative seed was a numpy traceback, after the output folder was made
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["--quiet", "learn", "layer_norm"],
        ["--quiet", "profile", "LayerNorm", "--reps", "1"],
        ["learn", "layer_norm", "--quiet"],  # after the command: was a usage error
        ["profile", "LayerNorm", "--reps", "1", "--quiet"],
    ],
)
def test_quiet_prints_nothing_for_any_command(argv, capsys):
    # --quiet reached the main job and warmup only; before learn it was a usage error
    assert cli_main(argv) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("epochs", ["0", "-2"])
def test_training_script_refuses_no_epochs(epochs, capsys):
    from npnorm.demo import train_digits

    with pytest.raises(SystemExit) as exit_:  # 0 trained the default 15, -2 an IndexError
        train_digits.main(["--epochs", epochs])
    assert exit_.value.code == 2 and f"expected at least 1, got {epochs}" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["learn", "bessel"]])
def test_a_wrong_kernels_variable_is_a_one_line_usage_error(argv):
    """``NPNORM_KERNELS=nope python -m npnorm`` ended in a traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "npnorm", *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, "NPNORM_KERNELS": "nope"},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("python -m npnorm: NPNORM_KERNELS: unknown or unavailable kernels 'nope'")


def _warmup_in_a_process(**variables: str) -> subprocess.CompletedProcess[str]:
    """``python -m npnorm warmup`` in a new process, with these environment variables set."""
    return subprocess.run(
        [sys.executable, "-m", "npnorm", "warmup"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, **variables},
    )


@pytest.mark.parametrize("value", ["abc", "0", "-1", "2.5"])
def test_a_wrong_threads_variable_is_a_one_line_usage_error(value):
    """``NPNORM_NUM_THREADS=abc python -m npnorm`` ended in a traceback (exit 1), where a
    wrong NPNORM_KERNELS is one line (exit 2)."""
    out = _warmup_in_a_process(NPNORM_NUM_THREADS=value)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("python -m npnorm: NPNORM_NUM_THREADS must be ")
    assert out.stderr.count("\n") == 1


@pytest.mark.parametrize("variable", ["NPNORM_NUM_THREADS", "NPNORM_KERNELS"])
def test_help_is_printed_whatever_the_variables_say(variable):
    """A wrong variable made ``--help`` a usage error (exit 2, no help)."""
    out = subprocess.run(
        [sys.executable, "-m", "npnorm", "bench", "--he"],  # (argparse takes --help's abbreviations)
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, variable: "0"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m npnorm bench")


def test_output_paths_are_checked_before_the_work(tmp_path, capsys):
    """A --json file or an output folder that cannot be written is a usage error before the
    command runs (tracebacks after a 36 s cold warmup, or after the demo's training)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = [
        (["warmup", "--json", str(tmp_path / "no" / "w.json")], "no folder"),
        (["warmup", "--json", str(tmp_path)], "is a folder, not a file"),
        (["bench", "--quick", "--json", str(tmp_path / "no" / "b.json")], "no folder"),
        (["demo", "--quick", "--out", str(a_file / "sub")], "cannot make the folder"),
        (["demo", "--quick", "--out", str(a_file)], "is a file, not a folder"),
        (["gpu-check", str(a_file)], "is a file, not a folder"),
        # gpu-check's own usage (the top-level one was printed), and no negative limit
        (["gpu-check", str(tmp_path / "g"), "--stages", "bogus"], "gpu-check: error: argument --stages"),
        (["gpu-check", str(tmp_path / "g"), "--main-timeout", "-5"], "a positive, finite number of seconds"),
        (
            ["gpu-check", str(tmp_path / "g"), "--tests-timeout", "inf"],
            "a positive, finite number of seconds",
        ),
        (["warmup", "--json", ""], "an empty file name"),  # (nothing written, nothing said)
        (["bench", "--quick", "--json", ""], "an empty file name"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            cli_main(argv)
        assert exit_.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "no").exists()
    assert cli_main(["learn", "bessel"]) == 0  # (the parser's checks make nothing)
    with pytest.raises(SystemExit):
        cli_main(["demo", "--quick", "--out", str(tmp_path / "new" / "deeper"), "--seed", "x"])
    assert not (tmp_path / "new").exists()  # a trial folder is removed again


def test_an_existing_file_that_cannot_be_written_is_a_usage_error_before_the_work(
    tmp_path, monkeypatch, capsys
):
    """A read-only --json file passed the check (its folder is writable) and failed after a
    whole warmup. (os.access is asked: a root user may write any file.)"""
    target = tmp_path / "w.json"
    target.write_text("{}")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(target) else real(p, mode))
    with pytest.raises(SystemExit) as exit_:
        cli_main(["warmup", "--json", str(target)])
    assert exit_.value.code == 2
    assert "the file is not writable" in capsys.readouterr().err


def test_a_json_write_that_fails_leaves_the_previous_file_and_says_why(tmp_path, monkeypatch, capsys):
    """A full disk at the end of a benchmark left a truncated file in place of the previous
    one, and a traceback: the file is written beside and renamed, and the command says why."""
    import json

    from npnorm import _files, _warmup

    target = tmp_path / "w.json"
    target.write_text('{"previous": 1}')

    def full_disk(data, f, **kw):
        f.write('{"trunc')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", full_disk)
    with pytest.raises(_files.CannotWrite, match=r"cannot write .*w\.json: No space left on device"):
        _warmup._written({"numba": False}, str(target))
    assert target.read_text() == '{"previous": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["w.json"]  # no part left
    monkeypatch.setattr(_warmup, "kernels_available", lambda: ["reference", "numpy"])
    monkeypatch.setattr(_warmup, "numba_import_error", lambda: "")
    assert cli_main(["warmup", "--json", str(target)]) == 1
    assert "python -m npnorm warmup: cannot write" in capsys.readouterr().err


def test_warmup_with_a_broken_numba_says_so_and_fails(tmp_path):
    """A numba that raises on import was reported as "not installed" and warmup passed (a CI
    warmup step passed having compiled nothing)."""
    (tmp_path / "numba.py").write_text("raise ImportError('simulated broken numba')\n")
    out = _warmup_in_a_process(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "numba is installed but importing it raised ImportError: simulated broken numba" in out.stderr


def test_bench_compile_times_with_the_jit_disabled_say_so(monkeypatch, capsys):
    """Under NUMBA_DISABLE_JIT=1 the benchmark failed at its end with KeyError 'total_s'
    (warmup writes no times there), after every figure was printed."""
    pytest.importorskip("numba")
    from npnorm import _bench

    monkeypatch.setenv("NUMBA_DISABLE_JIT", "1")
    assert _bench.compile_times() == {"jit": False}
    assert "NUMBA_DISABLE_JIT is set, so numba compiles nothing" in capsys.readouterr().out


def test_warmup_with_the_jit_disabled_says_nothing_was_compiled(tmp_path):
    """Under NUMBA_DISABLE_JIT=1 warmup printed "0 compiled loops ... ready" and wrote
    "cached": true."""
    pytest.importorskip("numba")
    out = subprocess.run(
        [sys.executable, "-m", "npnorm", "warmup", "--json", str(tmp_path / "w.json")],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env={**os.environ, "NUMBA_DISABLE_JIT": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert "NUMBA_DISABLE_JIT is set: numba compiles nothing" in out.stdout
    assert '"jit": false' in (tmp_path / "w.json").read_text()


def test_a_reader_that_stops_reading_ends_it_quietly():
    """``python -m npnorm learn layer_norm | head -1``: the reader closes the pipe; the
    command ends with the status of a SIGPIPE'd process and no traceback (it printed a
    BrokenPipeError traceback)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "npnorm", "learn", "layer_norm"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    p.stdout.close()  # before anything is read: the first flush meets a closed pipe
    err = p.stderr.read().decode()
    p.stderr.close()
    assert p.wait(timeout=120) == 141 and "BrokenPipeError" not in err, err


def test_python_m_npnorm_demo_is_python_m_npnorm_demo():
    # "npnorm.demo is a package and cannot be directly executed" before (as npnorm.learn's)
    def run(*argv):
        cmd = [sys.executable, "-m", *argv, "--help"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    out, same = run("npnorm.demo"), run("npnorm", "demo")
    assert out.returncode == 0 and out.stdout == same.stdout and "--quick" in out.stdout, out.stderr


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    """Ctrl-C in a long command (the demo, the bench) ended in a traceback."""
    import npnorm.__main__ as cli

    def interrupted(argv=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "main", interrupted)
    assert cli._run_to_a_pipe([]) == 130
    assert capsys.readouterr().err == "python -m npnorm: interrupted\n"


@pytest.mark.skipif(os.name != "posix", reason="death by SIGINT is POSIX's")
@pytest.mark.parametrize("entry", ["npnorm", "npnorm.demo", "npnorm.learn"])
def test_ctrl_c_ends_the_process_by_sigint_so_a_shell_loop_stops(entry):
    """After its one line, an interrupted command ends as Python does on an uncaught
    KeyboardInterrupt: its output flushed, then by SIGINT. An exit with status 130 told
    a shell that the command had handled the Ctrl-C, and a loop around it went on (seen
    with the SIGINT sent to the loop's process group, as a terminal does); a kill of its
    own lost what standard output still buffered; ``python -m npnorm.demo`` and
    ``npnorm.learn`` exited with 130 still."""
    code = (
        "import runpy\n"
        "import npnorm.__main__ as m\n"
        "def interrupted(argv=None):\n"
        "    print('made before the Ctrl-C')\n"
        "    raise KeyboardInterrupt\n"
        "m.main = interrupted\n"
        # (python -m npnorm's __main__ block is this line; run_module would run a copy
        # of npnorm.__main__ without the patch)
        + (
            "m._exit(m._run_to_a_pipe())\n"
            if entry == "npnorm"
            else f"runpy.run_module({entry!r}, run_name='__main__')\n"
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (a pipe: buffered)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == -signal.SIGINT, out
    assert out.stderr == "python -m npnorm: interrupted\n", out
    assert out.stdout == "made before the Ctrl-C\n", out


def test_the_main_help_keeps_its_paragraphs_without_markup(capsys):
    """argparse reflowed the module docstring into one paragraph, double backquotes kept
    and words broken ("--reuse-" / "memory")."""
    with pytest.raises(SystemExit) as done:
        cli_main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text
    assert (
        "\npython -m npnorm bench [--quick] [--cold] [--reuse-memory] [--json FILE] [--reps N]: time\n"
        in text
    )


def test_gpu_check_runs_each_stage_once(monkeypatch, tmp_path):
    """--stages tests,main,tests ran the tests twice."""
    from npnorm import _gpu_check

    ran = []
    for name in ("tests", "main"):
        monkeypatch.setattr(
            _gpu_check, f"stage_{name}", lambda *a, name=name, **k: ran.append(name) or {"status": "passed"}
        )
    assert (
        cli_main(["--quiet", "gpu-check", str(tmp_path), "--stand-in", "--stages", "tests,main,tests"]) == 0
    )
    assert ran == ["tests", "main"]


@pytest.mark.parametrize("lead", [["--quiet"], ["--qui"], ["--quiet", "--quiet"]])
def test_quiet_before_learn_is_taken_as_before_any_command(lead, capsys):
    """--qui learn and --quiet --quiet learn were 'unrecognized arguments' (the other
    commands take them, as argparse does); --quiet learn --help printed nothing."""
    assert cli_main([*lead, "learn", "bessel"]) == 0
    assert capsys.readouterr().out == ""
    with pytest.raises(SystemExit) as exit_:
        cli_main([*lead, "learn", "--help"])
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out


def test_a_new_json_file_gets_a_new_files_mode_and_its_part_is_made_beside_it(tmp_path, monkeypatch):
    """A new file has the mode open() gives (0666 less the umask: 0644 under 022), not a
    private 0600; the part is made in the target's folder, so that the rename replaces
    the file atomically (across file systems it is a copy, or EXDEV)."""
    import json
    import stat

    from npnorm import _files

    made = []
    new_part = _files._new_part
    monkeypatch.setattr(_files, "_new_part", lambda folder: made.append(folder) or new_part(folder))
    old_umask = os.umask(0o022)
    try:
        _files.write_json(str(tmp_path / "new.json"), {"a": [1]})
    finally:
        os.umask(old_umask)
    assert made == [tmp_path]
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o644
    assert (tmp_path / "new.json").read_text() == json.dumps({"a": [1]}, indent=1)


@pytest.mark.parametrize("code", ["EPERM", "EINVAL", "ENOTSUP"])
def test_a_refused_chown_never_fails_the_write(tmp_path, monkeypatch, code):
    """Keeping the replaced file's owner is best effort: a chown refused in any way (EINVAL:
    an owner not mapped in a user namespace; ENOTSUP: some network file systems) leaves
    the part as created, and the file is written (only PermissionError was caught)."""
    import errno
    import json

    from npnorm import _files

    target = tmp_path / "theirs.json"
    target.write_text("{}")

    def refuse(*args):
        raise OSError(getattr(errno, code), code)

    monkeypatch.setattr(os, "chown", refuse)
    real_stat = os.stat

    def other_owner(path, *a, **k):  # the target looks another user's
        st = real_stat(path, *a, **k)
        if str(path) == str(target):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, 4321, 4322, *st[6:]))
        return st

    monkeypatch.setattr(os, "stat", other_owner)
    _files.write_json(str(target), {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}


def test_a_json_file_is_replaced_as_open_would_write_it(tmp_path):
    """The whole-file write (beside, then renamed) replaced a symbolic link by a file, and
    would have replaced a FIFO or /dev/stdout; it made a 0600 file 0644, failed on a name
    within 5 characters of the length limit (its NAME.part was too long), and took a
    user's NAME.part."""
    import json
    import stat
    import threading

    from npnorm._files import write_json

    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_json(str(link), {"a": 1})
    assert link.is_symlink() and json.loads(real.read_text()) == {"a": 1}

    private = tmp_path / "private.json"
    private.write_text("{}")
    private.chmod(0o600)
    write_json(str(private), {"b": 2})
    assert stat.S_IMODE(private.stat().st_mode) == 0o600 and json.loads(private.read_text()) == {"b": 2}

    if os.geteuid() == 0:  # root replaces another user's file: its owner and group are kept
        theirs = tmp_path / "theirs.json"
        theirs.write_text("{}")
        os.chown(theirs, 4321, 4322)
        write_json(str(theirs), {"e": 5})
        assert (theirs.stat().st_uid, theirs.stat().st_gid) == (4321, 4322)
        assert json.loads(theirs.read_text()) == {"e": 5}

    long_name = tmp_path / ("x" * 250 + ".json")  # 255 characters: NAME.part would be 260
    write_json(str(long_name), {"c": 3})
    assert json.loads(long_name.read_text()) == {"c": 3}

    mine = tmp_path / "y.json.part"
    mine.write_text("user data")
    write_json(str(tmp_path / "y.json"), {})
    assert mine.read_text() == "user data"

    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    writer = threading.Thread(target=write_json, args=(str(fifo), {"d": 4}), daemon=True)
    writer.start()  # (a write that replaced the FIFO left the reader, and the test, waiting)
    writer.join(10)
    reader.join(10)
    assert not writer.is_alive() and not reader.is_alive(), "the write into the FIFO hung"
    assert stat.S_ISFIFO(fifo.stat().st_mode) and json.loads(got[0]) == {"d": 4}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part") and p != mine]
