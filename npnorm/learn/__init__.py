"""npnorm.learn: every backward pass derived node by node, and every step checkable.

The library's backward passes are closed forms (``npnorm._stats.standardize_backward``:
``dx = rstd · (dxhat - mean(dxhat) - xhat · mean(dxhat · xhat))``). This package writes
each layer as the graph those forms come from, one node per line, keeps every node's
value on a :class:`Tape`, and runs the chain rule back through it one local derivative
per line. Each step's gradient can then be checked on its own against finite
differences, and the staged result compared with the closed form.

>>> import numpy as np
>>> from npnorm.learn import staged_forward, staged_backward, check_steps
>>> x = np.random.default_rng(0).standard_normal((2, 3, 4))
>>> tape = staged_forward("layer_norm", x, 4)   # the arguments of layer_norm_forward
>>> list(tape.steps)
['mean', 'xc', 'var', 'rstd', 'xhat', 'y']
>>> grads = staged_backward(tape, np.random.default_rng(1).standard_normal(tape.output.shape))
>>> all(row.ok for row in check_steps(tape, grads))
True

SyncBatchNorm, whose statistics span the ranks of an MPI job, runs without MPI in
:func:`simulate_sync_batch_norm` (ranks as threads of this process):
``python -m npnorm learn sync_batch_norm``.

NumPy only, float64. The derivations: docs/derivations/; the exercises: exercises/;
the command: ``python -m npnorm learn layer_norm``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ._tape import Node, Tape
from .batch_norm import batch_norm
from .check import TODO, CheckRow, check_steps, check_terms, numeric_gradient, term_paths
from .closed_form import closed_form, jacobian
from .group_norm import group_norm
from .instance_norm import instance_norm
from .layer_norm import layer_norm
from .normalize import staged_normalize
from .rms_norm import rms_norm
from .sync_batch_norm import simulate_sync_batch_norm

LAYERS: dict[str, Callable[..., Tape]] = {
    "batch_norm": batch_norm,
    "layer_norm": layer_norm,
    "rms_norm": rms_norm,
    "group_norm": group_norm,
    "instance_norm": instance_norm,
}


def staged_forward(name: str, *args: Any, **kwargs: Any) -> Tape:
    """Run layer ``name``'s forward node by node and record every step on a tape.

    The layer is written as its graph, one node per step (``docs/derivations/``):
    for LayerNorm, ``mean = Σ x / n``, ``xc = x - mean``, ``var = Σ xc² / n``,
    ``rstd = 1 / sqrt(var + eps)``, ``xhat = xc · rstd``, ``y = xhat · w + b``.

    Parameters
    ----------
    name : {"batch_norm", "layer_norm", "rms_norm", "group_norm", "instance_norm"}
        The layer.
    *args, **kwargs : any
        The arguments of ``npnorm.functional.<name>_forward`` (same names, defaults
        and errors) but ``out=``; NumPy arrays, computed in float64. An input without
        values for the statistics (an empty batch), which the functional forms take,
        is a ``ValueError``: the staged graph runs on values.

    Returns
    -------
    Tape
        ``.steps``: step name -> value in forward order (``mean``, ``xc``, ``var``,
        ``rstd``, ``xhat``, ``y`` for LayerNorm); ``.nodes[name].formula``: what each
        step computes; ``.output``: the layer's output; ``.updates``: new running
        buffers, if the forward updates any.

    Raises
    ------
    ValueError
        For an unknown ``name``, and where ``<name>_forward`` raises it.
    TypeError
        Where ``<name>_forward`` raises it, and for arrays that are not NumPy arrays.

    Examples
    --------
    >>> import numpy as np
    >>> from npnorm.learn import staged_forward
    >>> x = np.random.default_rng(0).standard_normal((4, 3, 2))
    >>> tape = staged_forward("batch_norm", x, np.zeros(3), np.ones(3), training=True)
    >>> tape.nodes["rstd"].formula
    'rstd = 1 / sqrt(var + eps)'
    >>> tape["rstd"].shape, tape.output.shape
    ((1, 3, 1), (4, 3, 2))
    >>> sorted(tape.updates)
    ['running_mean', 'running_var']
    """
    try:
        layer = LAYERS[name]
    except KeyError:
        raise ValueError(f"unknown layer {name!r}; one of {', '.join(LAYERS)}") from None
    return layer(*args, **kwargs)


def staged_backward(tape: Tape, grad_output: np.ndarray) -> dict[str, np.ndarray]:
    """The gradient of ``L = sum(y · grad_output)`` with respect to every step.

    Computed node by node from the output back, one line per local derivative (the
    code is in ``npnorm/learn/_graph.py`` and, for GroupNorm's reshapes,
    ``group_norm.py``): for ``y = xhat · w + b``, ``dxhat = dy · w``; then back through
    ``xhat = xc · rstd``, ``rstd``, ``var``, ``xc`` and ``mean`` to ``dx``.

    Parameters
    ----------
    tape : Tape
        From ``staged_forward`` or ``staged_normalize``.
    grad_output : ndarray
        The upstream gradient ``dy``, of the output's shape exactly (it is never
        broadcast).

    Returns
    -------
    dict of str to ndarray
        Step name, and ``"input"``, ``"weight"``, ``"bias"`` (those the forward was
        given), to its gradient, in the order computed; each gradient has its step's
        shape.

    Raises
    ------
    TypeError
        When ``tape`` is not a tape with a backward (one from ``staged_forward`` or
        ``staged_normalize``; a Tape built by hand has none).
    ValueError
        When ``grad_output`` does not have the output's shape.

    Examples
    --------
    >>> import numpy as np
    >>> from npnorm.learn import staged_forward, staged_backward
    >>> x = np.random.default_rng(0).standard_normal((2, 4))
    >>> w = np.array([1.0, 2.0, 3.0, 4.0])
    >>> tape = staged_forward("layer_norm", x, 4, w)
    >>> dy = np.random.default_rng(1).standard_normal((2, 4))
    >>> grads = staged_backward(tape, dy)
    >>> list(grads)
    ['y', 'weight', 'xhat', 'rstd', 'var', 'xc', 'mean', 'input']
    >>> dxhat = grads["xhat"]
    >>> np.allclose(dxhat, dy * w)
    True
    """
    if not isinstance(tape, Tape) or tape.backward is None:
        got = "a Tape without a backward (built by hand)" if isinstance(tape, Tape) else type(tape).__name__
        raise TypeError(f"expected a Tape from staged_forward or staged_normalize, got {got}")
    dy = np.asarray(grad_output)
    if dy.shape != tape.output.shape:
        raise ValueError(f"grad_output must have the output's shape {tape.output.shape}, got {dy.shape}")
    return tape.backward(tape, dy.astype(tape.output.dtype))


__all__ = [
    "LAYERS",
    "TODO",
    "CheckRow",
    "Node",
    "Tape",
    "check_steps",
    "check_terms",
    "closed_form",
    "jacobian",
    "numeric_gradient",
    "simulate_sync_batch_norm",
    "staged_backward",
    "staged_forward",
    "staged_normalize",
    "term_paths",
]
