"""``gradcheck``: compare an analytical backward with finite differences.

The check differentiates the scalar ``L = sum(forward(x) * u)`` for a fixed random
``u`` (a random projection of the output, so every output element's gradient path
is exercised). Its analytic gradient is what the backward returns for ``dy = u``;
its numeric gradient is the central difference

    dL/dt ~ (L(t + eps) - L(t - eps)) / (2 eps)

for every element ``t`` of the input and of each parameter, all in float64.
It costs two forwards per element: use small inputs (a few hundred elements).

Two things can be checked: an npnorm ``Module`` (its ``backward`` and ``grads``),
or a plain pair of functions ``(forward, backward)``.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import types
from collections.abc import Callable
from typing import Any

import array_api_compat
import numpy as np

from ._backend import (
    Array,
    Namespace,
    check_dense,
    check_floating,
    copy_array,
    namespace_of,
    resolve_dtype,
    to_host,
    to_namespace,
    writable,
)
from ._checks import changed_in_place, check_real
from ._grad_mode import enable_grad
from .modules._module import Module

_ACCEPTS = (
    "gradcheck checks either an npnorm Module, as gradcheck(module, x), or a pair of "
    "functions, as gradcheck((forward, backward), x, *params), where forward(x, *params) "
    "returns y or (y, *saved) and backward(dy, x, *params, *saved) returns dx or "
    "(dx, *dparams), one gradient per parameter"
)


_PROJECTION_STREAM = 0x6E706E6F726D  # "npnorm": mixed into the projection's seed


class GradcheckError(AssertionError):
    """Raised by :func:`gradcheck` when analytic and numeric gradients disagree.

    An ``AssertionError``, so that a failed check inside a test reads as a failed
    assertion. Its message lists, per checked array, how many elements differ,
    the largest discrepancy and the analytic and numeric values side by side.

    Examples
    --------
    >>> import numpy as np, npnorm
    >>> forward = lambda x: x**2
    >>> wrong_backward = lambda dy, x: dy * x  # should be dy * 2 * x
    >>> try:
    ...     npnorm.gradcheck((forward, wrong_backward), np.ones(3))
    ... except npnorm.GradcheckError as err:
    ...     print(str(err).splitlines()[1].split(";")[0])
      input: 3 of 3 elements differ
    """


def gradcheck(
    target: Module | tuple[Callable[..., Any], Callable[..., Any]],
    x: Array,
    *params: Array | None,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    seed: int = 0,
    nondet_tol: float = 0.0,
) -> bool:
    """Check an analytical backward against central finite differences of its forward.

    Parameters
    ----------
    target : Module, or tuple (forward, backward)
        An npnorm module (a layer, or your own ``Module`` subclass): its
        ``backward`` and the parameter gradients it adds to ``grads`` are checked,
        in its current train/eval mode. Every forward of the check starts from the
        buffers as the check found them (a training forward updates them), and the
        parameters, buffers, grads, dtype, backend, mode and saved context are
        restored afterwards, whatever happens. Modules do not nest: a module that
        holds another npnorm module (in an attribute, or at any depth of the dicts,
        lists, tuples, sets and namespaces it holds) is refused (the check would
        miss the inner one's gradients and change its buffers); check each on its
        own. A SyncBatchNorm in training over several ranks is refused too (its
        gradients are those of the loss over every rank).

        Or a pair of functions, checked for the input and every parameter in
        ``params`` that is not None:

        - ``forward(x, *params)`` returns the output ``y``, or a tuple
          ``(y, *saved)`` whose extra items are passed on to backward (they are
          not outputs: only ``y`` is checked; check a layer with several outputs
          once per output);
        - ``backward(dy, x, *params, *saved)`` returns ``dx``, or a tuple
          ``(dx, *dparams)`` with one gradient per parameter (``None`` allowed
          where the parameter is None).

        ``npnorm.functional``'s pairs fit through a lambda, e.g. for LayerNorm
        over the last axis of size 4:
        ``(lambda x, w, b: F.layer_norm_forward(x, 4, w, b),
        lambda dy, x, w, b, mean, rstd: F.layer_norm_backward(dy, x, 4, mean, rstd, w, b))``.
    x : array
        The input (a floating dtype the layers take, of any backend; the check runs
        on a float64 copy, laid out in memory as ``x`` is for a strided NumPy view).
    *params : array or None
        Only with a function pair: the parameters passed to ``forward`` after
        ``x`` (float64 copies; ``None`` passes through unchecked).
    eps : float, default 1e-6
        Finite-difference step, absolute (as torch's): every element moves by
        ``eps`` whatever its size, so the check suits inputs and parameters of
        moderate size (below ~1e5: at 1e8 the step is lost to float64 rounding,
        and a correct backward fails).
    atol, rtol : float, default 1e-5 and 1e-3
        An element passes when ``|analytic - numeric| <= atol + rtol * |numeric|``
        (a NaN on either side fails).
        The defaults fail a 1% error in any gradient of ordinary magnitude.
    seed : int, default 0
        Seed of the random projection ``u`` (non-negative).
    nondet_tol : float, default 0.0
        How far two backwards of the same forward may differ (as torch's): 0 asks for
        the same gradients bit for bit; a backward whose sums change order from call to
        call (threads finishing in another order) needs a little more.

    Returns
    -------
    bool
        True (a failed check raises).

    Raises
    ------
    GradcheckError
        (an ``AssertionError``) listing, per checked array, the largest discrepancy
        and the analytic and numeric values side by side; also when the backward
        returns no gradient for the input or a parameter, or more gradients than
        parameters, when the forward changed its input or a parameter in place
        (finite differences need a forward that leaves them as they were), or the
        backward changed them or its upstream gradient, and when a second backward
        of the same forward gives other gradients than the first (not reentrant,
        as ``torch.autograd.gradcheck`` says: a backward that changes what its
        forward saved).
    TypeError
        When ``target`` is neither a Module nor a (forward, backward) pair, params
        are given with a Module, a module holds another module or did not call
        ``Module.__init__``, a module's parameter is not a floating-point array,
        ``x`` (or a param) is not an array of a floating dtype the layers take
        (integer, bool, complex, NumPy longdouble or ml_dtypes' bfloat16), an
        option is not a number (``seed``: not an int), the backend or device
        has no float64 (JAX without x64), ``forward`` or ``backward`` returns
        neither an array nor a tuple starting with one (a module's forward: not an
        array), or a parameter's gradient is neither an array nor None.
    ValueError
        When ``eps`` is not a positive finite number, ``atol``, ``rtol`` or
        ``nondet_tol`` is negative or NaN, ``seed`` is negative, or the module cannot
        be checked as it is set (a SyncBatchNorm in training over several ranks:
        check it in eval, or on one rank).

    Notes
    -----
    The check differentiates the scalar ``L = sum(forward(x) * u)`` for a fixed
    random ``u`` drawn from ``seed``. Its analytic gradient is what the backward
    returns for the upstream gradient ``dy = u``; its numeric gradient is the
    central difference ``dL/dt ~ (L(t + eps) - L(t - eps)) / (2 eps)`` for every
    element ``t`` of the input and of each parameter, all in float64, whose error
    is O(eps^2) from the truncation plus O(1e-16 |L| / eps) from rounding. It is
    the check ``torch.autograd.gradcheck`` makes, here on one random projection of
    the output; it costs two forwards per element, so use small inputs. The backward
    is then run a second time on the same forward, and must give the same gradients.

    One projection sees the Jacobian's entries summed with random weights, where
    torch's check compares every entry: an error confined to a few small entries can
    cancel in the sum. Measured on a LayerNorm pair whose backward leaks 1e-4 of one
    row's ``dy`` into another row's ``dx`` (torch's check fails it), 12 of 20 seeds
    failed it at rows of 16 values and 20 of 20 at rows of 64; a single wrong entry of
    1e-3, 7 to 9 of 20. Run the check with a few seeds where such errors matter. (In
    turn a backward that is not linear in ``dy``, one that clips it, fails here and
    passes torch's, whose unit upstream gradients never reach the clip.)

    Examples
    --------
    >>> import numpy as np, npnorm
    >>> import npnorm.functional as F
    >>> x = np.random.default_rng(0).normal(size=(3, 4))
    >>> npnorm.gradcheck(npnorm.LayerNorm(4), x)
    True
    >>> forward = lambda x, w, b: F.layer_norm_forward(x, 4, w, b)
    >>> backward = lambda dy, x, w, b, mean, rstd: F.layer_norm_backward(dy, x, 4, mean, rstd, w, b)
    >>> npnorm.gradcheck((forward, backward), x, np.full(4, 2.0), np.zeros(4))
    True
    """
    eps, atol, rtol, seed, nondet_tol = _options(eps, atol, rtol, seed, nondet_tol)
    _check_float(x, "x")  # an array of floats, before anything runs
    if isinstance(target, Module):
        if params:
            raise TypeError(
                f"gradcheck(module, x) takes no params: a module's parameters are its own "
                f"(got {len(params)} extra argument(s)); " + _ACCEPTS
            )
        target._check_initialized()
        _check_no_inner_modules(target)
        refusal = target._gradcheck_refusal()
        if refusal:
            raise ValueError(f"gradcheck: {refusal}")
        with enable_grad():
            return _check_module(target, x, eps, atol, rtol, seed, nondet_tol)
    if isinstance(target, tuple) and len(target) == 2 and all(callable(f) for f in target):
        return _check_pair(target[0], target[1], x, params, eps, atol, rtol, seed, nondet_tol)
    what = type(target).__name__
    if callable(target):
        what += " (a single function has no backward to check against: pass (forward, backward))"
    raise TypeError(f"{_ACCEPTS}; got {what}")


def _options(
    eps: Any, atol: Any, rtol: Any, seed: Any, nondet_tol: Any = 0.0
) -> tuple[float, float, float, int, float]:
    """gradcheck's options, checked: ``(eps, atol, rtol, seed, nondet_tol)``."""
    given = {"eps": eps, "atol": atol, "rtol": rtol, "nondet_tol": nondet_tol}
    values = {name: check_real(v, f"gradcheck: {name}") for name, v in given.items()}
    if not (0 < values["eps"] < float("inf")):
        raise ValueError(
            f"gradcheck: eps (the finite-difference step) must be positive and finite, got {eps!r}"
        )
    for name in ("atol", "rtol", "nondet_tol"):
        if not values[name] >= 0:
            raise ValueError(f"gradcheck: {name} must be a non-negative number, got {given[name]!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"gradcheck: seed must be an int, got {seed!r}")
    if seed < 0:
        raise ValueError(
            f"gradcheck: seed must be a non-negative int (it seeds NumPy's generator), got {seed}"
        )
    return values["eps"], values["atol"], values["rtol"], int(seed), values["nondet_tol"]


def _check_float(a: Any, what: str) -> None:
    """A TypeError unless ``a`` is an array of a floating dtype the layers take: the
    check's float64 copy of an integer, bool or complex array checked another function
    than the one called on it (a layer refuses integer input; a complex one lost its
    imaginary part)."""
    check_dense(a, f"gradcheck: {what}")
    check_floating(namespace_of(a, what=what), a, f"gradcheck: {what}")


def _check_no_inner_modules(module: Module) -> None:
    """A TypeError where ``module`` holds another npnorm Module, in an attribute or at any
    depth of the dicts, lists, tuples, sets and ``SimpleNamespace`` objects it holds:
    modules do not nest (a module's parameters, buffers, mode and dtype are its own), so
    the check would neither check the inner one's gradients nor restore its buffers and
    grads after."""
    where = _inner_module(
        [(f"{type(module).__name__}.{name}", value) for name, value in reversed(vars(module).items())],
        {id(module)},
    )
    if where is not None:
        raise TypeError(
            f"gradcheck: {where} is an npnorm Module. Modules do not nest: "
            "the check would miss the inner module's parameter gradients and leave its buffers, "
            "counters and grads changed. Check each module on its own (or, for a layer of your "
            "own, hold the inner layer's arrays as this module's parameters and buffers)"
        )


def _inner_module(stack: list[tuple[str, Any]], seen: set[int]) -> str | None:
    """The path of the first npnorm Module among the ``(path, value)`` pairs of ``stack``
    (the last first) and the containers they hold, at any depth, or None. Each container
    is looked into once (``seen``: their ids), and without recursion: a list that holds
    itself, one held many times over, or one nested a thousand deep ends in linear time."""
    while stack:
        path, value = stack.pop()
        if isinstance(value, Module):
            return path
        if id(value) in seen:
            continue
        if isinstance(value, dict):
            items: list[tuple[str, Any]] = [(f"{path}[{k!r}]", v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, (set, frozenset)):
            items = [(f"an item of {path}", v) for v in value]
        elif isinstance(value, types.SimpleNamespace):
            items = [(f"{path}.{k}", v) for k, v in vars(value).items()]
        else:
            continue
        seen.add(id(value))
        stack.extend(reversed(items))  # (the first item is looked at first)
    return None


def _check_module(
    module: Module, x: Array, eps: float, atol: float, rtol: float, seed: int, nondet_tol: float
) -> bool:
    xp = namespace_of(x, what="x")
    _check_parameters(module)
    snapshot = _snapshot(module)
    try:
        module.to(xp=xp)  # the input's backend: the module's settings are read against it
        module._pin_for_float64(x)
        module.to(dtype="float64")
        for name, value in {**module.parameters(), **module.buffers()}.items():  # the check's own
            setattr(module, name, copy_array(value))  # arrays (to() keeps those already float64)
        buffers = {name: copy_array(value) for name, value in module.buffers().items()}
        x64 = _laid_out_as(x, to_namespace(x, xp, xp.float64))

        def forward(at: Array) -> Array:
            """The module's forward at ``at``, from the buffers as the check found them: a
            forward in training mode updates them, and the check differentiates a function
            (a layer whose output reads a buffer it updates would otherwise see another
            buffer at every evaluation)."""
            for name, value in buffers.items():
                setattr(module, name, copy_array(value))
            return module(at)

        module.zero_grad()
        given = {"its input": (copy_array(x64), x64)}
        given.update({name: (copy_array(p), p) for name, p in module.parameters().items()})
        y = forward(x64)
        if not array_api_compat.is_array_api_obj(y):
            raise TypeError(
                f"gradcheck: {type(module).__name__}'s forward returned a {type(y).__name__}, not "
                "an array: gradcheck checks a module with one output (for several, check a "
                "(forward, backward) pair per output)"
            )
        _check_unchanged(f"{type(module).__name__}'s forward", given)
        u = _projection(xp, y, seed)
        given["its grad_output"] = (copy_array(u), u)
        analytic = _module_gradients(module, u)
        _check_unchanged(f"{type(module).__name__}'s backward", given)
        module.zero_grad()
        again = _module_gradients(module, copy_array(u))  # the same backward once more

        def loss(at: Array) -> float:
            return float(xp.sum(forward(at) * u))

        def loss_at(name: str) -> Callable[[Array], float]:
            def of_param(p: Array) -> float:  # the module's parameter ``name`` set to p
                own = getattr(module, name)
                setattr(module, name, p)
                try:
                    return loss(x64)
                finally:
                    setattr(module, name, own)

            return of_param

        numeric: dict[str, np.ndarray] = {"input": _numeric(loss, x64, eps)}
        for name, p in module.parameters().items():
            numeric[f"grad {name}"] = _numeric(loss_at(name), p, eps)
        where = (
            f"{type(module).__name__} ({'train' if module.training else 'eval'} mode, "
            f"input shape {tuple(x.shape)}, in float64)"
        ) + _precision_note(xp, y)
        _compare(where, analytic, numeric, atol, rtol)
        _check_reentrant(f"{type(module).__name__}'s backward", analytic, again, nondet_tol)
        return True
    finally:
        _restore(module, snapshot)


def _module_gradients(module: Module, u: Array) -> dict[str, Array]:
    """Copies of what ``module.backward(u)`` returns and adds to ``grads`` (from zero):
    ``{"input": dx, "grad <name>": ...}``; no ``"input"`` where it returned None."""
    dx = module.backward(u)
    grads = {} if dx is None else {"input": copy_array(dx)}
    grads.update({f"grad {k}": copy_array(v) for k, v in module.grads.items()})
    return grads


def _check_reentrant(what: str, first: dict[str, Array], again: dict[str, Array], tol: float) -> None:
    """A GradcheckError where a second backward of the same forward, with the same
    grad_output, gave other gradients than the first (which matched the finite
    differences), as ``torch.autograd.gradcheck`` checks: a backward that changes in place
    an array its forward saved (``u *= ...`` on a saved ``u``) is right once, then wrong."""
    differ = []
    for name in first.keys() | again.keys():
        a, b = first.get(name), again.get(name)
        if a is None or b is None:
            differ.append(f"{name} (given once only)")
            continue
        ha, hb = to_host(a), to_host(b)
        if ha.shape != hb.shape:
            differ.append(f"{name} (shapes {ha.shape} and {hb.shape})")
            continue
        if np.array_equal(ha, hb, equal_nan=True):
            continue
        with np.errstate(invalid="ignore"):
            diff = float(np.max(np.abs(ha.astype(np.float64) - hb), initial=0.0))
        if not (diff <= tol and np.isfinite(diff)):  # (NaN or inf in one of them: differs, as torch's)
            differ.append(f"{name} (largest difference {diff:.3e})")
    if differ:
        raise GradcheckError(
            f"gradcheck: {what} is not reentrant: a second backward of the same forward, with the same "
            f"grad_output, gave other gradients for {', '.join(sorted(differ))}, where the first matched "
            "the finite differences. Does it change in place an array its forward saved (or keep "
            "state from one call to the next)? A backward must leave what it reads as it was. "
            f"(Where it sums in another order from call to call, pass nondet_tol=, now {tol:g}.)"
        )


def _check_parameters(module: Module) -> None:
    """A TypeError unless every parameter of ``module`` is a floating-point array: finite
    differences perturb each element by eps, which an integer array truncates away."""
    for name in module._parameter_names:
        value: Any = getattr(module, name, None)
        if value is None:
            continue
        if not array_api_compat.is_array_api_obj(value):
            raise TypeError(
                f"gradcheck: {type(module).__name__}.{name} is a parameter but not an array "
                f"(got {type(value).__name__}): create it with the module's backend, e.g. "
                f"self.{name} = self.xp.asarray(2.0, dtype=self.dtype)"
            )
        xp = array_api_compat.array_namespace(value)
        if not xp.isdtype(value.dtype, "real floating"):
            raise TypeError(
                f"gradcheck: {type(module).__name__}.{name} is a parameter of dtype {value.dtype}, "
                "not a floating-point one (finite differences perturb it by eps): create it with a "
                f"float dtype, e.g. self.{name} = self.xp.asarray(2.0, dtype=self.dtype)"
            )


def _check_pair(
    forward: Callable[..., Any],
    backward: Callable[..., Any],
    x: Array,
    params: tuple[Array | None, ...],
    eps: float,
    atol: float,
    rtol: float,
    seed: int,
    nondet_tol: float,
) -> bool:
    xp = namespace_of(x, *params, what="x and params")
    for i, p in enumerate(params):
        if p is not None:
            _check_float(p, f"params[{i}]")
    try:  # the check's copies are float64 (JAX without x64 made them float32, silently)
        resolve_dtype(xp, "float64", array_api_compat.device(x))
    except TypeError as err:
        raise TypeError(f"gradcheck runs in float64: {err}") from None
    x64 = _laid_out_as(x, to_namespace(x, xp, xp.float64))
    p64 = [None if p is None else to_namespace(p, xp, xp.float64) for p in params]
    given = {"x": (copy_array(x64), x64)}
    given.update({f"params[{i}]": (copy_array(p), p) for i, p in enumerate(p64) if p is not None})
    out = forward(x64, *p64)
    _check_unchanged("forward", given)
    y, saved = (out[0], tuple(out[1:])) if isinstance(out, tuple) and out else (out, ())
    if not array_api_compat.is_array_api_obj(y):
        raise TypeError(
            "gradcheck: forward must return the output array, or a tuple (output, *saved); got "
            + ("an empty tuple" if isinstance(out, tuple) and not out else type(out).__name__)
            + ("" if y is out else f" whose first item is a {type(y).__name__}")
        )
    u = _projection(xp, y, seed)
    given["dy"] = (copy_array(u), u)
    analytic = _pair_gradients(backward, u, x64, p64, saved)
    _check_unchanged("backward", given)
    again = _pair_gradients(backward, copy_array(u), x64, p64, saved)  # the same backward once more

    def loss(at: Array, i: int | None = None) -> float:  # at: the input, or params[i]
        args = [at, *p64] if i is None else [x64, *p64[:i], at, *p64[i + 1 :]]
        result = forward(*args)
        return float(xp.sum((result[0] if isinstance(result, tuple) else result) * u))

    numeric: dict[str, np.ndarray] = {"input": _numeric(loss, x64, eps)}
    for i, p in enumerate(p64):
        if p is not None:
            numeric[f"params[{i}]"] = _numeric(functools.partial(loss, i=i), p, eps)
    names = [getattr(f, "__name__", type(f).__name__) for f in (forward, backward)]
    where = f"({names[0]}, {names[1]}) at input shape {tuple(x.shape)}, in float64" + _precision_note(xp, y)
    _compare(where, analytic, numeric, atol, rtol)
    _check_reentrant("backward", analytic, again, nondet_tol)
    return True


def _pair_gradients(
    backward: Callable[..., Any], u: Array, x64: Array, p64: list[Array | None], saved: tuple[Any, ...]
) -> dict[str, Array]:
    """Copies of what ``backward(u, x64, *p64, *saved)`` returns, checked:
    ``{"input": dx, "params[i]": ...}`` (the parameters' that are not None)."""
    back = backward(u, x64, *p64, *saved)
    dx, dparams = (back[0], tuple(back[1:])) if isinstance(back, tuple) and back else (back, ())
    if not array_api_compat.is_array_api_obj(dx):
        raise TypeError(
            "gradcheck: backward must return dx, or a tuple (dx, *dparams); got "
            + (
                "an empty tuple"
                if isinstance(back, tuple) and not back
                else type(back).__name__
                if dx is back
                else f"a tuple whose first item is {type(dx).__name__}"
            )
        )
    extra = [i for i in range(len(p64), len(dparams)) if dparams[i] is not None]
    if extra:
        raise GradcheckError(
            f"backward returned {len(dparams)} parameter gradient(s) for {len(p64)} parameter(s): " + _ACCEPTS
        )
    analytic: dict[str, Array] = {"input": copy_array(dx)}
    for i, g in enumerate(dparams[: len(p64)]):
        if g is None:
            continue
        if not array_api_compat.is_array_api_obj(g):
            raise TypeError(
                f"gradcheck: backward's gradient for params[{i}] must be an array (or None where the "
                f"parameter is None); got {type(g).__name__}"
            )
        analytic[f"params[{i}]"] = copy_array(g)
    return analytic


def _check_unchanged(what: str, arrays: dict[str, tuple[Array, Array]]) -> None:
    """A GradcheckError where ``what`` (the check's first forward, or its backward) changed
    one of ``arrays`` (name: (copy taken before, the array passed)) in place: after a forward,
    each perturbed evaluation would start from another point, and the numeric gradients
    mean nothing; after the backward, the check compared them with gradients of another
    point (a backward that scaled its grad_output in place failed as a wrong gradient)."""
    changed = changed_in_place(arrays)
    if changed:
        need = (
            "finite differences need a forward that leaves its input and parameters as they were"
            if what.endswith("forward")
            else f"the check uses {'it' if len(changed) == 1 else 'them'} again afterwards, and a "
            "caller's arrays would change too"
        )
        raise GradcheckError(
            f"gradcheck: {what} changed {', '.join(changed)} in place; {need} (compute into new arrays)"
        )


def _laid_out_as(x: Any, x64: Any) -> Any:
    """``x64`` (a float64 copy of ``x``) in ``x``'s own memory layout, for a NumPy ``x``
    that is a strided view (``base[:, ::2]``, a reversed axis): the check perturbs and
    passes that array, so that a backward that depends on the layout (one that reads the
    input as if it were C-ordered, as compiled code may) meets the layout it is given.
    (The copy keeps C, Fortran and transposed orders already; other backends, and inputs
    whose elements share memory, such as a broadcast, keep the copy.)"""
    if not isinstance(x, np.ndarray) or x.size <= 1 or x.flags.c_contiguous or x.flags.f_contiguous:
        return x64
    if any(s % x.itemsize for s in x.strides):  # (an unaligned view)
        return x64
    steps = [s // x.itemsize for s in x.strides]  # in elements
    offsets = np.zeros(x.shape, dtype=np.int64)  # each element's place in memory
    for axis, (n, step) in enumerate(zip(x.shape, steps, strict=True)):
        along = [1] * x.ndim
        along[axis] = n
        offsets = offsets + np.arange(n).reshape(along) * step
    if np.unique(offsets).size != x.size:  # elements sharing memory: perturbing one moves others
        return x64
    lo = int(offsets.min())  # <= 0: the first element's place is 0
    base = np.zeros(int(offsets.max()) - lo + 1)  # x's span, in float64
    view = np.lib.stride_tricks.as_strided(base[-lo:], x.shape, [step * 8 for step in steps])
    view[...] = x64
    return view


def _projection(xp: Namespace, y: Array, seed: int) -> Array:
    """The fixed random ``u`` of ``L = sum(y * u)``.

    Drawn from ``seed`` mixed with a constant, so that it is not the array a user draws
    with ``default_rng(seed)``: were ``u`` the input itself, a layer that ignores its
    input's scale (LayerNorm, RMSNorm) would have ``dx = J.T @ x ~ 0``, and a wrong
    scale of dx would pass."""
    rng = np.random.default_rng([seed, _PROJECTION_STREAM])
    return xp.asarray(
        rng.standard_normal(tuple(y.shape)), dtype=xp.float64, device=array_api_compat.device(y)
    )


def _precision_note(xp: Namespace, y: Array) -> str:
    """A note for the failure message where the forward turned the float64 input into
    output of less precision (a ``.astype(np.float32)`` in it): its finite differences
    then carry that dtype's rounding, about 1e-2 at ``eps=1e-6``, and a correct backward
    fails for it."""
    if y.dtype == xp.float64:
        return ""
    return (
        f". Note: the forward returned {y.dtype} output for the float64 input, so the finite "
        "differences carry its rounding and a correct backward can fail; compute the forward in "
        "its input's dtype"
    )


def _compare(
    where: str, analytic: dict[str, Array], numeric: dict[str, np.ndarray], atol: float, rtol: float
) -> None:
    missing = sorted(set(numeric) - set(analytic))
    if missing:
        raise GradcheckError(
            f"gradcheck failed for {where}: backward produced no gradient for: {', '.join(missing)}"
        )
    failures = [_report(name, analytic[name], numeric[name], atol, rtol) for name in numeric]
    failures = [f for f in failures if f]
    if failures:
        raise GradcheckError(f"gradcheck failed for {where}:\n" + "\n".join(failures))


def _numeric(f: Callable[[Array], float], t: Array, eps: float) -> np.ndarray:
    """Central differences of ``f(t)`` w.r.t. each element of ``t``: perturbed in place,
    or, where ``t`` cannot be written (JAX's arrays), in a new array with that element
    changed."""
    xp = namespace_of(t)
    out = np.empty(tuple(t.shape))
    in_place = writable(t)
    device = array_api_compat.device(t)
    if not in_place:  # each element's flat index, to pick it out with xp.where
        position = xp.reshape(xp.arange(math.prod(t.shape), device=device), t.shape)
    for k, idx in enumerate(itertools.product(*(range(int(n)) for n in t.shape))):
        orig = float(t[idx])
        f_at = []
        for value in (orig + eps, orig - eps):
            if in_place:
                t[idx] = value
                f_at.append(f(t))
            else:
                f_at.append(f(xp.where(position == k, xp.asarray(value, dtype=t.dtype, device=device), t)))
        if in_place:
            t[idx] = orig
        out[idx] = (f_at[0] - f_at[1]) / (2 * eps)
    return out


def _report(name: str, analytic: Array, n: np.ndarray, atol: float, rtol: float) -> str:
    a = to_host(analytic).astype(np.float64)
    if a.shape != n.shape:
        return f"  {name}: the analytic gradient has shape {a.shape}, expected {n.shape}"
    err = np.abs(a - n)
    tol = atol + rtol * np.abs(n)
    bad = ~(err <= tol)  # NaN on either side fails (err > tol would pass it)
    if not bad.any():
        return ""
    # The worst failing element: the largest discrepancy relative to its own tolerance (the
    # largest absolute one may sit on a large gradient that passes); a NaN is the worst.
    with np.errstate(divide="ignore", invalid="ignore"):
        ranked = np.where(bad, np.nan_to_num(err / tol, nan=np.inf), -1.0)  # (NaN on either side: inf)
    worst = np.unravel_index(int(np.argmax(ranked)), err.shape) if err.ndim else ()
    shown = min(a.size, 6)
    return (
        f"  {name}: {int(bad.sum())} of {a.size} elements differ; worst at "
        f"{tuple(int(i) for i in worst)}: |analytic - numeric| = {err[worst]:.3e} against a "
        f"tolerance of {tol[worst]:.3e} (analytic {a[worst]:.6e}, numeric {n[worst]:.6e})\n"
        f"    analytic[:{shown}] = {_one_line(a.reshape(-1)[:shown])}\n"
        f"    numeric[:{shown}]  = {_one_line(n.reshape(-1)[:shown])}"
    )


def _one_line(values: np.ndarray) -> str:
    """A few values, on one line whatever their width (NumPy wraps at 75 characters, and
    the continuation lost the report's indentation)."""
    return np.array2string(values, precision=6, max_line_width=10**6)


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
