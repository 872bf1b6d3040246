"""Helpers for parity with torch.nn: same parameters, same data, compare everything."""

from __future__ import annotations

import numpy as np

from npnorm._backend import to_host
from npnorm._selfcheck import randomize  # noqa: F401  (re-exported for the tests)

TOL = {"float64": dict(rtol=1e-10, atol=1e-10), "float32": dict(rtol=1e-4, atol=2e-5)}


def load_into_torch(torch, ours, ref) -> None:
    ref.load_state_dict({k: torch.as_tensor(to_host(v)) for k, v in ours.state_dict().items()})


def close(a, b, dtype: str, what: str) -> None:
    """``a`` (any backend) against ``b`` (a torch tensor or array), scaled tolerance."""
    a = to_host(a).astype(np.float64)
    b = b.detach().double().numpy() if hasattr(b, "detach") else np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"{what}: shape {a.shape} vs {b.shape}"
    tol = TOL[dtype]
    scale = max(1.0, float(np.abs(b).max(initial=0.0)))
    np.testing.assert_allclose(a, b, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=what)


def step_and_compare(torch, backend, ours, ref, x_np, dy_np, dtype: str) -> None:
    """One forward+backward of both modules on the same data; compare all results."""
    tdtype = getattr(torch, dtype)
    ours.zero_grad()
    ref.zero_grad()
    y = ours(backend.asarray(x_np, dtype))
    dx = ours.backward(backend.asarray(dy_np, dtype))
    xt = torch.tensor(x_np, dtype=tdtype, requires_grad=True)
    yt = ref(xt)
    yt.backward(torch.tensor(dy_np, dtype=tdtype))
    close(y, yt, dtype, "output")
    assert to_host(y).dtype == np.dtype(dtype)
    close(dx, xt.grad, dtype, "dx")
    tparams = dict(ref.named_parameters())
    assert set(ours.grads) == {k for k, p in tparams.items() if p.grad is not None}
    for k, g in ours.grads.items():
        close(g, tparams[k].grad, dtype, f"grad {k}")
    tstate = ref.state_dict()
    assert set(ours.state_dict()) == set(tstate)
    for k, v in ours.state_dict().items():
        close(v, tstate[k], dtype, k)
