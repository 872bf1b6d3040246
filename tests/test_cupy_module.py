"""The CuPy kernels' module on machines without a GPU (CI): it imports, and its kernels take
exactly the generic kernels' parameters, so that a change to the helpers it imports or to a
kernel signature fails here and not first on a GPU. Nothing of it runs: a stand-in module
takes cupy's place in a subprocess (tests/test_cupy_kernels.py runs the kernels on a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import inspect, json, sys, types
sys.modules["cupy"] = types.ModuleType("cupy")  # imported by the module; on import it uses
sys.modules["cupy"].ndarray = type("ndarray", (), {})  # only the array type
from npnorm.functional import _dispatch
from npnorm.kernels import cupy_fused
found = {}
for (op, namespace), fn in _dispatch._SPECIALIZED.items():
    if namespace == cupy_fused.CUPY:
        found[op] = [
            [(p.name, str(p.kind), repr(p.default)) for p in inspect.signature(f).parameters.values()]
            for f in (fn, _dispatch.generic_kernel(op))
        ]
print(json.dumps({"providers": _dispatch._PROVIDERS.get(cupy_fused.CUPY), "kernels": found}))
"""


def test_cupy_kernels_import_and_take_the_generic_kernels_parameters():
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["providers"] == ["npnorm.kernels.cupy_fused"]
    layers = ("layer_norm", "rms_norm", "batch_norm", "instance_norm")
    ops = {f"{layer}_{step}" for layer in layers for step in ("forward", "backward")}
    assert set(report["kernels"]) == ops
    for op, (fused, generic) in report["kernels"].items():
        assert fused == generic, op
