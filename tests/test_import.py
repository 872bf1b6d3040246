import subprocess
import sys


def test_import_pulls_in_neither_cupy_nor_torch_nor_numba():
    code = (
        "import sys, npnorm, npnorm.functional, npnorm.modules\n"
        "lazy = ('cupy', 'torch', 'numba', 'npnorm.kernels.numpy_fast')\n"
        "bad = sorted(m for m in lazy if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names():
    import npnorm
    import npnorm.functional as F

    for name in (
        "LayerNorm",
        "RMSNorm",
        "gradcheck",
        "GradcheckError",
        "functional",
        "kernels_available",
        "get_kernels",
        "set_kernels",
        "use_kernels",
    ):
        assert hasattr(npnorm, name)
    for name in (
        "layer_norm",
        "layer_norm_forward",
        "layer_norm_backward",
        "rms_norm",
        "rms_norm_forward",
        "rms_norm_backward",
    ):
        assert callable(getattr(F, name))
    assert issubclass(npnorm.GradcheckError, AssertionError)


def test_thread_controls_are_public():
    import npnorm

    n = npnorm.get_num_threads()
    try:
        npnorm.set_num_threads(1)
        assert npnorm.get_num_threads() == 1
    finally:
        npnorm.set_num_threads(n)
