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
