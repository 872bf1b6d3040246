"""Train small networks on handwritten digits with every npnorm layer, in NumPy alone.

Read this file top to bottom; it is the whole training code, in six parts:

1. the data: scikit-learn's ``load_digits`` (1797 grey 8x8 images of the digits 0-9; the
   file ships with scikit-learn, nothing is downloaded), split into a training set and a
   held-out set the networks never train on;
2. the layers npnorm does not provide, written by hand with their backward passes:
   ``Linear``, ``Conv2d``, ``ReLU``, ``Reshape`` and the softmax cross-entropy loss. Each
   layer is an ``npnorm.Module`` (forward returns the output and what backward needs;
   backward returns the input gradient and the parameter gradients), so ``npnorm.gradcheck``
   checks it exactly as it checks the norm layers;
3. two networks, each with a choice of normalization after every hidden layer: an MLP
   64-128-128-10 (none, BatchNorm1d, LayerNorm, RMSNorm) and a small conv net (none,
   BatchNorm2d, GroupNorm, InstanceNorm2d);
4. SGD with momentum, and the training loop;
5. the checks: ``npnorm.gradcheck`` on every layer, and a finite-difference check of a whole
   network with its loss;
6. ``main``: check, then train every network and print a table.

Run it with ``python examples/train_digits.py [--quick]`` or
``python -m npnorm.demo.train_digits [--quick]``. ``python -m npnorm demo`` trains with the
same code and adds sweeps and figures (``npnorm/demo/experiments.py``, ``figures.py``).
It needs scikit-learn for the data: ``pip install "npnorm[demo]"``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

import npnorm
from npnorm.modules._module import Module, Saved, Updates

DEMO_EXTRA_HINT = (
    'install the demo extra: pip install "npnorm[demo]" (in a checkout: pip install -e ".[demo]")'
)


# ---------------------------------------------------------------------------------------
# 0. Random numbers: every run draws from its own generator, derived from one seed
# ---------------------------------------------------------------------------------------


def rng_for(seed: int, *names: str) -> np.random.Generator:
    """A generator for one purpose (e.g. ``rng_for(0, "mlp", "init")``), derived from ``seed``.

    Each purpose gets its own stream, so a run draws the same numbers whatever else runs
    before it: the MLP with BatchNorm starts from the same weights and sees the batches in the
    same order as the MLP without normalization, and only the normalization differs.
    """
    return np.random.default_rng([seed, *(zlib.crc32(n.encode()) for n in names)])


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run BLAS (the matrix products) and npnorm's kernels on one thread inside the block.

    These arrays are tiny: threads cost more in hand-offs than they save (much more on a busy
    machine), and one thread gives the same numbers for a seed on every run of a machine (on
    another processor the matrix products may round differently).
    """
    before = npnorm.get_num_threads()
    npnorm.set_num_threads(1)
    try:
        try:
            from threadpoolctl import threadpool_limits  # installed with scikit-learn
        except ImportError:
            yield
            return
        with threadpool_limits(1):
            yield
    finally:
        npnorm.set_num_threads(before)


# ---------------------------------------------------------------------------------------
# 1. The data
# ---------------------------------------------------------------------------------------


@dataclass
class Digits:
    """Images as rows of 64 pixels scaled to [0, 1], labels 0-9."""

    x_train: np.ndarray  # N_train,64 float32
    y_train: np.ndarray  # N_train    int64
    x_test: np.ndarray  # N_test,64  float32
    y_test: np.ndarray  # N_test     int64


def load_data(seed: int = 0, test_fraction: float = 0.25) -> Digits:
    """``load_digits`` split into training and held-out sets, each class in both in proportion."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(f"the digits data come from scikit-learn: {DEMO_EXTRA_HINT}") from err
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # 1797,64  pixel values 0..16 -> 0..1
    y = digits.target.astype(np.int64)  # 1797
    rng = rng_for(seed, "split")
    test = np.zeros(len(y), dtype=bool)
    for label in range(10):  # a stratified split: test_fraction of every digit is held out
        members = rng.permutation(np.flatnonzero(y == label))
        test[members[: round(test_fraction * len(members))]] = True
    return Digits(x[~test], y[~test], x[test], y[test])


# ---------------------------------------------------------------------------------------
# 2. Hand-written layers (npnorm supplies the norm layers)
# ---------------------------------------------------------------------------------------
# A layer's _forward(x) returns (output, saved, updates): ``saved`` is whatever _backward
# needs, ``updates`` the buffers to change (none here). _backward(dy, saved) returns
# (dx, {parameter name: gradient}). Module.forward/backward store ``saved`` and accumulate
# the gradients into ``layer.grads``.


class Linear(Module):
    """``y = x @ weight.T + bias``, weight (out, in) as in ``torch.nn.Linear``.

    Backward, from ``y[n, o] = sum_i x[n, i] * weight[o, i] + bias[o]``:
    ``dx = dy @ weight``, ``dweight = dy.T @ x``, ``dbias = sum_n dy``.
    """

    _parameter_names = ("weight", "bias")

    def __init__(self, in_features: int, out_features: int, *, rng: np.random.Generator) -> None:
        super().__init__()  # float32 on NumPy
        self.in_features, self.out_features = in_features, out_features
        # He initialization: std sqrt(2 / fan_in) keeps the scale of ReLU activations steady
        # from layer to layer at the start, with or without normalization
        std = math.sqrt(2.0 / in_features)
        self.weight = (rng.standard_normal((out_features, in_features)) * std).astype(self.dtype)
        self.bias = np.zeros(out_features, dtype=self.dtype)

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, Saved, Updates]:
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"Linear expected (N, {self.in_features}) input, got shape {x.shape}")
        y = x @ self.weight.T + self.bias  # N,out
        return y, (x,), {}

    def _backward(self, dy: np.ndarray, saved: Saved) -> tuple[np.ndarray, dict[str, Any]]:
        (x,) = saved  # N,in
        dx = dy @ self.weight  # N,in
        dweight = dy.T @ x  # out,in
        dbias = dy.sum(axis=0)  # out
        return dx, {"weight": dweight, "bias": dbias}

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}"


class Conv2d(Module):
    """2-D convolution (cross-correlation, as ``torch.nn.Conv2d``): weight (C_out, C_in, k, k).

    Written as a matrix product ("im2col"): every k x k window of the padded input, across all
    input channels, becomes one row of ``cols`` (C_in*k*k values), and the output at that
    position is that row times the flattened filters. Backward is Linear's backward on
    ``cols``, after which each window's gradient is added back onto the pixels it was cut
    from ("col2im"); windows overlap, so a pixel collects gradient from every window
    that contains it.
    """

    _parameter_names = ("weight", "bias")

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        stride: int = 1,
        padding: int = 0,
        rng: np.random.Generator,
    ) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.k, self.stride, self.padding = kernel_size, stride, padding
        fan_in = in_channels * kernel_size * kernel_size
        shape = (out_channels, in_channels, kernel_size, kernel_size)
        self.weight = (rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)).astype(self.dtype)
        self.bias = np.zeros(out_channels, dtype=self.dtype)

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, Saved, Updates]:
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f"Conv2d expected (N, {self.in_channels}, H, W) input, got shape {x.shape}")
        n, c, h, w = x.shape
        k, s, p = self.k, self.stride, self.padding
        ho, wo = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
        xpad = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))  # N,C,H+2p,W+2p
        windows = sliding_window_view(xpad, (k, k), axis=(2, 3))[:, :, ::s, ::s]  # N,C,Ho,Wo,k,k (a view)
        cols = windows.transpose(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, c * k * k)  # N*Ho*Wo,C*k*k
        y = cols @ self.weight.reshape(self.out_channels, -1).T + self.bias  # N*Ho*Wo,C_out
        y = y.reshape(n, ho, wo, self.out_channels).transpose(0, 3, 1, 2)  # N,C_out,Ho,Wo
        return np.ascontiguousarray(y), (x.shape, cols), {}

    def _backward(self, dy: np.ndarray, saved: Saved) -> tuple[np.ndarray, dict[str, Any]]:
        (n, c, h, w), cols = saved
        k, s, p = self.k, self.stride, self.padding
        ho, wo = dy.shape[2], dy.shape[3]
        dy_rows = dy.transpose(0, 2, 3, 1).reshape(n * ho * wo, self.out_channels)  # N*Ho*Wo,C_out
        dweight = (dy_rows.T @ cols).reshape(self.weight.shape)  # C_out,C,k,k
        dbias = dy_rows.sum(axis=0)  # C_out
        dcols = dy_rows @ self.weight.reshape(self.out_channels, -1)  # N*Ho*Wo,C*k*k
        dwindows = dcols.reshape(n, ho, wo, c, k, k)  # N,Ho,Wo,C,k,k
        dxpad = np.zeros((n, c, h + 2 * p, w + 2 * p), dtype=dy.dtype)  # N,C,H+2p,W+2p
        for i in range(k):  # col2im: offset (i, j) of output (r, q)'s window read pixel (i + s*r, j + s*q)
            for j in range(k):
                dpixels = dwindows[..., i, j].transpose(0, 3, 1, 2)  # N,C,Ho,Wo
                dxpad[:, :, i : i + s * ho : s, j : j + s * wo : s] += dpixels
        dx = dxpad[:, :, p : p + h, p : p + w]  # N,C,H,W  (the padding's gradient is dropped)
        return dx, {"weight": dweight, "bias": dbias}

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.k}, "
            f"stride={self.stride}, padding={self.padding}"
        )


class ReLU(Module):
    """``y = max(x, 0)``; ``dx = dy`` where ``x > 0``, else 0."""

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, Saved, Updates]:
        return np.maximum(x, 0), (x > 0,), {}

    def _backward(self, dy: np.ndarray, saved: Saved) -> tuple[np.ndarray, dict[str, Any]]:
        (positive,) = saved
        return dy * positive, {}


class Reshape(Module):
    """Reshape each example to ``shape`` (e.g. rows of 64 pixels to 1x8x8 images); backward undoes it."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.shape = shape

    def _forward(self, x: np.ndarray) -> tuple[np.ndarray, Saved, Updates]:
        return x.reshape(x.shape[0], *self.shape), (x.shape,), {}

    def _backward(self, dy: np.ndarray, saved: Saved) -> tuple[np.ndarray, dict[str, Any]]:
        (shape,) = saved
        return dy.reshape(shape), {}

    def extra_repr(self) -> str:
        return ", ".join(map(str, self.shape))


def cross_entropy(logits: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean softmax cross-entropy of ``logits`` (N, K) for integer ``labels`` (N), and its
    gradient ``dlogits``.

    ``loss = -(1/N) sum_n log softmax(logits[n])[labels[n]]``. Its gradient is the softmax
    probabilities minus the one-hot labels, over N: ``dlogits = (p - onehot) / N``.
    """
    n = logits.shape[0]
    z = logits - logits.max(axis=1, keepdims=True)  # N,K  shifted: exp(z) <= 1 never overflows
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))  # N,K  log softmax
    loss = -float(log_p[np.arange(n), labels].mean())
    dlogits = np.exp(log_p)  # N,K  p
    dlogits[np.arange(n), labels] -= 1  # N,K  p - onehot
    return loss, dlogits / n


# ---------------------------------------------------------------------------------------
# 3. Networks
# ---------------------------------------------------------------------------------------

BATCH_SIZE = 32  # the training defaults, for the script and the demo
LEARNING_RATE = 0.05
MLP_NORMS = ("none", "batch", "layer", "rms")
CONV_NORMS = ("none", "batch", "group", "instance")
NORMS = ("none", "batch", "layer", "rms", "group", "instance")


def norm_layer(norm: str, features: int, *, conv: bool) -> list[Module]:
    """The normalization after a hidden layer with ``features`` units (or channels, if ``conv``)."""
    if norm == "none":
        return []
    if norm == "batch":
        return [npnorm.BatchNorm2d(features) if conv else npnorm.BatchNorm1d(features)]
    if norm == "layer" and not conv:
        return [npnorm.LayerNorm(features)]
    if norm == "rms" and not conv:
        return [npnorm.RMSNorm(features)]
    if norm == "group" and conv:
        return [npnorm.GroupNorm(4, features)]  # 4 groups of channels per example
    if norm == "instance" and conv:
        return [npnorm.InstanceNorm2d(features, affine=True)]  # per example and channel
    raise ValueError(f"no {norm!r} normalization for the {'conv net' if conv else 'MLP'}")


class Network:
    """Layers applied in order; backward runs them in reverse. Holds no math of its own."""

    def __init__(self, name: str, layers: list[Module]) -> None:
        self.name = name
        self.layers = layers
        self.outputs: list[np.ndarray] = []

    def forward(self, x: np.ndarray) -> np.ndarray:
        self.outputs = []  # every layer's output, kept to look inside (the demo plots their statistics)
        for layer in self.layers:
            x = layer(x)
            self.outputs.append(x)
        return x

    def backward(self, dlogits: np.ndarray) -> np.ndarray:
        """Propagate ``dlogits`` to the input; every layer accumulates its parameter gradients."""
        d = dlogits
        for layer in reversed(self.layers):
            d = layer.backward(d)
        return d

    def parameters(self) -> Iterator[tuple[str, Module, str]]:
        """``(key, layer, parameter name)`` for every parameter, keys like ``"3.weight"``."""
        for i, layer in enumerate(self.layers):
            for name in layer.parameters():
                yield f"{i}.{name}", layer, name

    def zero_grad(self) -> None:
        for layer in self.layers:
            layer.zero_grad()

    def train(self, mode: bool = True) -> None:
        for layer in self.layers:
            layer.train(mode)

    def eval(self) -> None:
        self.train(False)

    def copy(self) -> Network:
        """An independent copy (own arrays; the layers share only their array namespace module)."""
        memo: dict[int, Any] = {id(layer.xp): layer.xp for layer in self.layers}
        return copy.deepcopy(self, memo)

    def to(self, dtype: str) -> Network:
        for layer in self.layers:
            layer.to(dtype=dtype)
        return self

    def __repr__(self) -> str:
        inner = "".join(f"\n  {layer!r}" for layer in self.layers)
        return f"Network({self.name}):{inner}"


def mlp(norm: str, *, rng: np.random.Generator) -> Network:
    """64 pixels -> 128 -> 128 -> 10 logits; ``norm`` after each hidden Linear, before its ReLU."""
    return Network(
        f"MLP, {norm}",
        [
            Linear(64, 128, rng=rng),
            *norm_layer(norm, 128, conv=False),
            ReLU(),
            Linear(128, 128, rng=rng),
            *norm_layer(norm, 128, conv=False),
            ReLU(),
            Linear(128, 10, rng=rng),
        ],
    )


def convnet(norm: str, *, rng: np.random.Generator) -> Network:
    """1x8x8 -> conv 3x3 (16 channels, 8x8) -> conv 3x3 stride 2 (32 channels, 4x4) -> 10 logits."""
    return Network(
        f"conv net, {norm}",
        [
            Reshape(1, 8, 8),
            Conv2d(1, 16, 3, padding=1, rng=rng),
            *norm_layer(norm, 16, conv=True),
            ReLU(),
            Conv2d(16, 32, 3, stride=2, padding=1, rng=rng),
            *norm_layer(norm, 32, conv=True),
            ReLU(),
            Reshape(32 * 4 * 4),
            Linear(32 * 4 * 4, 10, rng=rng),
        ],
    )


ARCHITECTURES: dict[str, Callable[..., Network]] = {"mlp": mlp, "conv": convnet}


def build(arch: str, norm: str, seed: int) -> Network:
    """A fresh network; its initial weights depend on ``arch`` and ``seed``, not on ``norm``."""
    return ARCHITECTURES[arch](norm, rng=rng_for(seed, arch, "init"))


# ---------------------------------------------------------------------------------------
# 4. Optimizer and training loop
# ---------------------------------------------------------------------------------------


class SGD:
    """SGD with momentum, as ``torch.optim.SGD``: ``v = momentum * v + grad``; ``p -= lr * v``."""

    def __init__(self, net: Network, lr: float, momentum: float = 0.9) -> None:
        self.net, self.lr, self.momentum = net, lr, momentum
        self.velocity: dict[str, np.ndarray] = {}

    def step(self) -> None:
        for key, layer, name in self.net.parameters():
            grad = layer.grads[name]
            v = self.velocity.get(key)
            v = grad.copy() if v is None else self.momentum * v + grad
            self.velocity[key] = v
            setattr(layer, name, getattr(layer, name) - self.lr * v)


@dataclass
class History:
    """What a training run records: per epoch, and once before training (epoch 0) for accuracy."""

    train_loss: list[float] = field(default_factory=list)  # mean minibatch loss of each epoch
    test_accuracy: list[float] = field(default_factory=list)  # held-out accuracy after each epoch
    seconds: float = 0.0  # wall time of the epochs: steps, held-out scoring and callbacks
    diverged: bool = False  # a loss or the held-out logits became inf or nan; training stopped there


def accuracy(net: Network, x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of ``x`` classified correctly, in eval mode (BatchNorm uses its running statistics)."""
    return _scored(eval_logits(net, x), y)


def eval_logits(net: Network, x: np.ndarray) -> np.ndarray:
    """The logits of ``x`` in eval mode; the net is left in training mode."""
    net.eval()
    logits = net.forward(x)
    net.train()
    return logits


def _scored(logits: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(logits.argmax(axis=1) == y))


def train(
    net: Network,
    data: Digits,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    momentum: float = 0.9,
    after_backward: Callable[[int, Network], None] | None = None,
    after_epoch: Callable[[int], None] | None = None,
) -> History:
    """Train ``net`` with minibatch SGD on ``data.x_train``; return its :class:`History`.

    Each epoch visits the training set in a new random order, in full batches of
    ``batch_size`` (the last partial batch is dropped, as ``drop_last=True`` does: a batch of
    one has no batch statistics). ``after_backward(step, net)`` runs after every backward, with
    the gradients in place; ``after_epoch(epoch)`` after every epoch.
    """
    rng = rng_for(seed, net.name.split(",")[0], "order")  # the same order whatever the norm
    opt = SGD(net, lr, momentum)
    history = History(test_accuracy=[accuracy(net, data.x_test, data.y_test)])
    caller = np.geterr()
    n = len(data.y_train)
    step = 0
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        order = rng.permutation(n)
        losses = []
        net.train()
        # divergence is reported, not warned: a loss that is huge but finite overflows in the
        # backward or the step, or later in the held-out forward, before one is inf (the
        # caller's callback runs under the caller's settings)
        with np.errstate(over="ignore", invalid="ignore"):
            for first in range(0, n - batch_size + 1, batch_size):
                idx = order[first : first + batch_size]
                logits = net.forward(data.x_train[idx])  # B,10
                loss, dlogits = cross_entropy(logits, data.y_train[idx])
                if not math.isfinite(loss):
                    history.diverged = True
                    break
                net.zero_grad()
                net.backward(dlogits)
                if after_backward is not None:
                    with np.errstate(**caller):
                        after_backward(step, net)
                opt.step()
                losses.append(loss)
                step += 1
            held_out = None if history.diverged else eval_logits(net, data.x_test)  # T,10
        if held_out is None or not np.isfinite(held_out).all():  # (weights past the logits' range)
            history.diverged = True
            break
        history.test_accuracy.append(_scored(held_out, data.y_test))
        history.train_loss.append(float(np.mean(losses)))
        if after_epoch is not None:
            after_epoch(epoch)
    history.seconds = time.perf_counter() - start
    return history


# ---------------------------------------------------------------------------------------
# 5. Checks: every layer's backward, then a whole network against finite differences
# ---------------------------------------------------------------------------------------


def check_layers(seed: int = 0) -> dict[str, bool]:
    """``npnorm.gradcheck`` (central differences in float64) on each layer the networks use."""
    rng = rng_for(seed, "gradcheck")
    cases: dict[str, tuple[Module, tuple[int, ...]]] = {
        "Linear": (Linear(5, 4, rng=rng), (3, 5)),
        "Conv2d stride 2, padding 1": (Conv2d(2, 3, 3, stride=2, padding=1, rng=rng), (2, 2, 5, 5)),
        "ReLU": (ReLU(), (3, 5)),
        "Reshape": (Reshape(2, 3), (2, 6)),
        "BatchNorm1d": (npnorm.BatchNorm1d(5), (4, 5)),
        "LayerNorm": (npnorm.LayerNorm(5), (3, 5)),
        "RMSNorm": (npnorm.RMSNorm(5), (3, 5)),
        "BatchNorm2d": (npnorm.BatchNorm2d(4), (2, 4, 3, 3)),
        "GroupNorm": (npnorm.GroupNorm(2, 4), (2, 4, 3, 3)),
        "InstanceNorm2d": (npnorm.InstanceNorm2d(4, affine=True), (2, 4, 3, 3)),
    }
    results = {}
    for name, (layer, shape) in cases.items():
        for pname, p in layer.parameters().items():  # not the initial ones and zeros: a real test
            setattr(layer, pname, p + 0.3 * rng.standard_normal(p.shape).astype(p.dtype))
        x = rng.standard_normal(shape)
        if isinstance(layer, ReLU):  # keep inputs away from the kink at 0
            x = np.where(np.abs(x) < 0.1, 0.5, x)
        results[name] = npnorm.gradcheck(layer, x)  # raises npnorm.GradcheckError if wrong
    return results


def loss_and_gradients(
    net: Network, x: np.ndarray, labels: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    """Loss on one minibatch and the gradient of every parameter (key ``"input"`` for ``x``)."""
    net.zero_grad()
    loss, dlogits = cross_entropy(net.forward(x), labels)
    grads = {"input": net.backward(dlogits)}
    grads.update({key: layer.grads[name] for key, layer, name in net.parameters()})
    return loss, grads


def check_network(
    net: Network,
    x: np.ndarray,
    labels: np.ndarray,
    *,
    seed: int = 0,
    coordinates: int = 3,
    eps: float = 1e-5,
) -> float:
    """Check backpropagation through ``net`` and the loss against central finite differences.

    Works on a float64 copy of ``net`` (``net`` itself is left alone), in its current mode.
    Two comparisons: the derivative along one random direction in all parameters and the
    input at once (every gradient entry takes part), and ``coordinates`` single entries of
    every parameter and of the input. The difference is the fourth-order central one,
    ``(8 (L(h) - L(-h)) - (L(2h) - L(-2h))) / 12h``, whose truncation error stays small even
    where the loss curves sharply (BatchNorm over a batch of two). Where a ReLU input would
    cross 0 between the points (a kink, across which a difference measures nothing), the step
    shrinks tenfold, twice, and the probe is skipped if that is not enough (at most half of
    them may be). Each derivative must agree to ``1e-7 + 1e-5 * |finite difference|``
    (float64 round-off and truncation are far below; a wrong term in a backward is far above),
    or ``AssertionError`` is raised. Returns the largest ``|backprop - finite difference|``.
    """
    net64 = net.copy().to("float64")
    x64 = np.array(x, dtype=np.float64)
    _, grads = loss_and_gradients(net64, x64, labels)
    where = {key: (layer, name) for key, layer, name in net64.parameters()}
    base = {"input": x64, **{key: getattr(layer, name) for key, (layer, name) in where.items()}}

    def relu_signs() -> list[np.ndarray]:
        """Which inputs of each ReLU are positive, in the last forward."""
        layers, outputs = net64.layers, net64.outputs
        return [outputs[i - 1] > 0 for i, layer in enumerate(layers) if isinstance(layer, ReLU)]

    signs = relu_signs()  # of the forward in loss_and_gradients

    def loss_along(direction: dict[str, np.ndarray], step: float) -> tuple[float, bool]:
        """The loss with ``step * direction`` added to the tensors ``direction`` names, and
        whether every ReLU input kept its sign (the loss is smooth between there and here)."""
        values = {k: base[k] + step * direction[k] if k in direction else base[k] for k in base}
        for key, (layer, name) in where.items():
            setattr(layer, name, values[key])
        loss, _ = cross_entropy(net64.forward(values["input"]), labels)
        return loss, all(np.array_equal(a, b) for a, b in zip(relu_signs(), signs, strict=True))

    rng = rng_for(seed, "check network")
    everything = {k: rng.standard_normal(t.shape) for k, t in base.items()}  # all tensors at once,
    norm = math.sqrt(sum(float(np.sum(d * d)) for d in everything.values()))  # a unit vector: each
    directions = [{k: d / norm for k, d in everything.items()}]  # entry moves little, few ReLUs flip
    for key, t in base.items():  # then a few single entries of each tensor
        for flat in rng.choice(t.size, size=min(coordinates, t.size), replace=False):
            unit = np.zeros(t.shape)
            unit.flat[flat] = 1.0
            directions.append({key: unit})
    worst, skipped = 0.0, 0
    for direction in directions:
        # a ReLU input that crosses 0 within the stencil puts a kink between the points, and
        # the difference measures nothing: retry 10 times closer; skip if the kink is that close
        for h in (eps, eps / 10, eps / 100):
            points = [loss_along(direction, k * h) for k in (1, -1, 2, -2)]
            if all(smooth for _, smooth in points):
                break
        else:
            skipped += 1
            continue
        (plus, _), (minus, _), (plus2, _), (minus2, _) = points
        numeric = (8 * (plus - minus) - (plus2 - minus2)) / (12 * h)
        analytic = sum(float(np.sum(grads[k] * d)) for k, d in direction.items())
        worst = max(worst, abs(numeric - analytic))
        if abs(numeric - analytic) > 1e-7 + 1e-5 * abs(numeric):
            what = (
                "all parameters and the input"
                if len(direction) > 1
                else f"an entry of {next(iter(direction))}"
            )
            raise AssertionError(
                f"{net.name}: along {what}, backprop gives {analytic:.9e}, finite differences {numeric:.9e}"
            )
    if 2 * skipped > len(directions):
        raise AssertionError(f"{net.name}: {skipped} of {len(directions)} probes lie on ReLU kinks")
    return worst


# ---------------------------------------------------------------------------------------
# 6. Main: check, train every network, print a table
# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train an MLP and a conv net on digits with every norm.")
    parser.add_argument("--quick", action="store_true", help="fewer epochs")
    parser.add_argument("--epochs", type=int, default=None, help="MLP epochs (default 15, 5 with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="all random state comes from it")
    args = parser.parse_args(argv)
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs: expected at least 1, got {args.epochs}")
    if args.seed < 0:
        parser.error(f"--seed: expected a non-negative integer, got {args.seed}")
    epochs = args.epochs if args.epochs is not None else (5 if args.quick else 15)
    try:  # (before the checks: without scikit-learn there is nothing to train on)
        data = load_data(args.seed)
    except ImportError as err:
        print(f"{parser.prog}: {err}", file=sys.stderr)
        return 1

    print("gradient checks (npnorm.gradcheck, float64 central differences):")
    for name, ok in check_layers(args.seed).items():
        print(f"  {name:28s} {ok}")

    print(f"\ndigits: {len(data.y_train)} training and {len(data.y_test)} held-out images of 8x8 pixels")
    net = build("mlp", "batch", args.seed)
    error = check_network(net, data.x_train[:16], data.y_train[:16], seed=args.seed)
    print(f"MLP with BatchNorm and its loss vs finite differences: largest difference {error:.1e}")

    print(
        f"\n{'network':8s} {'norm':9s} {'epochs':>6s} {'train loss':>10s} {'held-out acc.':>14s} {'time':>7s}"
    )
    with single_threaded():
        for arch, norms, arch_epochs in (
            ("mlp", MLP_NORMS, epochs),
            ("conv", CONV_NORMS, max(1, epochs // 2)),
        ):
            for norm in norms:
                net = build(arch, norm, args.seed)
                hist = train(
                    net, data, epochs=arch_epochs, batch_size=BATCH_SIZE, lr=LEARNING_RATE, seed=args.seed
                )
                print(
                    f"{arch:8s} {norm:9s} {arch_epochs:6d} {hist.train_loss[-1]:10.4f} "
                    f"{hist.test_accuracy[-1]:14.3f} {hist.seconds:6.1f}s"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
