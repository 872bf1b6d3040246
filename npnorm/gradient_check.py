"""``gradcheck``: compare a module's analytical backward with finite differences.

The check differentiates the scalar ``L = sum(module(x) * u)`` for a fixed random
``u`` (a random projection of the output, so every output element's gradient path
is exercised). Its analytic gradient is ``module.backward(u)`` (input) and
``module.grads`` (parameters); its numeric gradient is the central difference

    dL/dt ~ (L(t + eps) - L(t - eps)) / (2 eps)

for every element ``t`` of the input and of each parameter, all in float64.
It costs two forwards per element: use small inputs (a few hundred elements).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ._backend import Array, namespace_of, to_host, to_namespace
from .modules._module import Module


class GradcheckError(AssertionError):
    """Raised by :func:`gradcheck` when analytic and numeric gradients disagree."""


def gradcheck(
    module: Module,
    x: Array,
    *,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    seed: int = 0,
) -> bool:
    """Check ``module.backward`` against central finite differences of its forward.

    Parameters
    ----------
    module : npnorm module
        Checked in its current train/eval mode. Its parameters, buffers, grads,
        mode and saved context are restored afterwards, whatever happens.
    x : array
        The input (any float dtype; the check runs in float64).
    eps : float
        Finite-difference step.
    atol, rtol : float
        An element passes when ``|analytic - numeric| <= atol + rtol * |numeric|``.
        The defaults fail a 1% error in any gradient of ordinary magnitude.
    seed : int
        Seed of the random projection ``u``.

    Returns
    -------
    True

    Raises
    ------
    GradcheckError
        (an ``AssertionError``) listing, per tensor, the largest discrepancy and the
        analytic and numeric values side by side.
    """
    xp = namespace_of(x, what="x")
    snapshot = _snapshot(module)
    try:
        module.to(xp=xp, dtype="float64")
        x64 = to_namespace(x, xp, xp.float64)
        module.zero_grad()
        y = module(x64)
        rng = np.random.default_rng(seed)
        u = xp.asarray(rng.standard_normal(tuple(y.shape)), dtype=xp.float64)
        analytic: dict[str, Array] = {"input": module.backward(u)}
        analytic.update({f"grad {k}": v for k, v in module.grads.items()})

        def loss(inp: Array) -> float:
            return float(xp.sum(module(inp) * u))

        numeric: dict[str, np.ndarray] = {"input": _numeric(lambda: loss(x64), x64, eps)}
        for name, p in module.parameters().items():
            numeric[f"grad {name}"] = _numeric(lambda: loss(x64), p, eps)
        missing = sorted(set(numeric) - set(analytic))
        if missing:
            raise GradcheckError(f"backward produced no gradient for: {', '.join(missing)}")
        failures = [_report(name, analytic[name], numeric[name], atol, rtol) for name in numeric]
        failures = [f for f in failures if f]
        if failures:
            raise GradcheckError(
                f"gradcheck failed for {type(module).__name__} "
                f"({'train' if module.training else 'eval'} mode, input shape {tuple(x.shape)}):\n"
                + "\n".join(failures)
            )
        return True
    finally:
        _restore(module, snapshot)


def _numeric(f: Any, t: Array, eps: float) -> np.ndarray:
    """Central differences of ``f()`` w.r.t. each element of ``t`` (perturbed in place)."""
    out = np.empty(tuple(t.shape))
    for idx in itertools.product(*(range(int(n)) for n in t.shape)):
        orig = float(t[idx])
        t[idx] = orig + eps
        f_plus = f()
        t[idx] = orig - eps
        f_minus = f()
        t[idx] = orig
        out[idx] = (f_plus - f_minus) / (2 * eps)
    return out


def _report(name: str, analytic: Array, n: np.ndarray, atol: float, rtol: float) -> str:
    a = to_host(analytic).astype(np.float64)
    err = np.abs(a - n)
    bad = err > atol + rtol * np.abs(n)
    if not bad.any():
        return ""
    worst = np.unravel_index(int(np.argmax(err)), err.shape) if err.ndim else ()
    shown = min(a.size, 6)
    return (
        f"  {name}: {int(bad.sum())} of {a.size} elements differ; max |analytic - numeric| = "
        f"{err.max():.3e} at {tuple(int(i) for i in worst)} "
        f"(analytic {a[worst]:.6e}, numeric {n[worst]:.6e})\n"
        f"    analytic[:{shown}] = {np.array2string(a.reshape(-1)[:shown], precision=6)}\n"
        f"    numeric[:{shown}]  = {np.array2string(n.reshape(-1)[:shown], precision=6)}"
    )


def _snapshot(module: Module) -> dict[str, Any]:
    state = dict(module.__dict__)
    state["grads"] = dict(module.grads)
    return state


def _restore(module: Module, state: dict[str, Any]) -> None:
    grads = module.grads
    module.__dict__.clear()
    module.__dict__.update(state)
    grads.clear()
    grads.update(state["grads"])
    module.grads = grads
