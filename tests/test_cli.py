import subprocess
import sys


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


def test_profile_restores_the_kernels_numpy():
    import numpy as np

    from npnorm import _profile
    from npnorm._bench import Spec

    result = _profile.profile(Spec("LayerNorm", (2, 8, 64)), reps=1)
    assert all(m.np is np for m in _profile.KERNEL_MODULES)
    sites = result["sites"]
    assert sites and all(s["file"] != "_blocks.py" for s in sites)  # charged to kernel lines
    assert {s["function"] for s in sites} >= {"subtract", "multiply", "vecdot"}
