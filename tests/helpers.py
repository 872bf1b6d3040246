"""Helpers for parity with torch.nn (same parameters, same data, compare everything), and
for running every operation through two kernel families."""

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


def op_calls(x, dy, w, b, groups: int) -> list:
    """``(op, forward arguments, backward arguments from the forward's results)`` of every
    operation on (N, C, ..., D) data: LayerNorm and RMSNorm (its default eps) over the
    last axis, with weight ``w`` and bias ``b`` ((D,) or None); GroupNorm in ``groups``
    groups; BatchNorm and InstanceNorm with batch and with running statistics. The
    channel layers' weights, biases and buffers are fixed (C,) values of x's dtype."""
    D, C, dt = x.shape[-1], x.shape[1], x.dtype
    wc, bc = np.linspace(0.5, 1.5, C).astype(dt), np.linspace(-1, 1, C).astype(dt)
    rm, rv = np.linspace(-1, 1, C).astype(dt), np.linspace(0.5, 2, C).astype(dt)
    calls = [
        ("layer_norm", (x, (D,), w, b, 1e-5), lambda f: (dy, x, (D,), f[1], f[2], w, b)),
        ("rms_norm", (x, (D,), w, None), lambda f: (dy, x, (D,), f[1], w)),
        ("group_norm", (x, groups, wc, bc, 1e-5), lambda f: (dy, x, groups, f[1], f[2], wc, bc)),
    ]
    for op in ("batch_norm", "instance_norm"):
        for stats in (True, False):  # batch statistics, running statistics
            calls.append(
                (
                    op,
                    (x, rm, rv, wc, bc, stats, 0.1, 1e-5),
                    lambda f, s=stats: (dy, x, f[1], f[2], wc, bc, s),
                )
            )
    return calls


def same_results(ours, ref, what: str, tol: float = 0.0) -> None:
    """Two sequences of results: None in the same places, the same dtypes and shapes, and
    values equal to ``tol`` (relative and absolute; NaN equals NaN; 0: exactly)."""
    assert len(ours) == len(ref), what
    for a, c in zip(ours, ref, strict=True):
        if c is None:
            assert a is None, what
            continue
        assert (a.dtype, a.shape) == (c.dtype, c.shape), what
        np.testing.assert_allclose(
            a.astype(np.float64), c.astype(np.float64), rtol=tol, atol=tol, err_msg=what
        )
