"""The runs behind ``python -m npnorm demo``'s figures, on the networks of ``train_digits``.

Each experiment returns plain lists and dicts (JSON-ready) and reports its progress, one
training step at a time, to ``progress`` (anything with ``update(n)``, e.g. a tqdm bar);
``steps_*`` functions count the steps in advance, for the bar's total.

- :func:`compare_norms`: the MLP and the conv net trained once per norm (loss and held-out
  accuracy curves, the table);
- :func:`batch_size_sweep`: the BatchNorm MLP at batch sizes 2..256, its held-out accuracy in
  eval mode (running statistics) and in train mode (statistics of held-out batches of the
  training batch size), and the gap between the two modes' outputs, with batch-independent
  networks for reference;
- :func:`lr_sweep`: the MLP with and without normalization over a range of learning rates;
- :func:`layer_statistics`: per-layer activation statistics and weight-gradient norms of the
  MLP over training, with and without normalization.

All run on one thread (``train_digits.single_threaded``): the same seed gives the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from .train_digits import (
    BATCH_SIZE,
    CONV_NORMS,
    LEARNING_RATE,
    MLP_NORMS,
    Digits,
    Linear,
    Network,
    ReLU,
    build,
    eval_logits,
    single_threaded,
    train,
)

LAYER_NAMES = {
    "mlp": {"none": "none", "batch": "BatchNorm1d", "layer": "LayerNorm", "rms": "RMSNorm"},
    "conv": {"none": "none", "batch": "BatchNorm2d", "group": "GroupNorm(4)", "instance": "InstanceNorm2d"},
}
ARCH_NAMES = {"mlp": "MLP 64-128-128-10", "conv": "conv net"}


class Progress(Protocol):
    def update(self, n: int = 1) -> Any: ...


@dataclass(frozen=True)
class Settings:
    """How long and over what each experiment runs (``QUICK`` and ``FULL`` below)."""

    epochs: int  # MLP epochs in compare_norms and layer_statistics
    conv_epochs: int  # conv net epochs in compare_norms
    batch_size: int  # batch size everywhere but the batch-size sweep
    lr: float  # learning rate everywhere but the learning-rate sweep (SGD, momentum 0.9)
    batch_sizes: tuple[int, ...]  # the batch-size sweep: lr = lr * sqrt(batch / batch_size)
    batch_sweep_epochs: int  # at least this many epochs at every batch size,
    batch_sweep_min_steps: int  # and at least this many steps (large batches take few per epoch)
    batch_sweep_references: tuple[str, ...]  # batch-independent MLPs trained alongside
    lrs: tuple[float, ...]  # the learning-rate sweep
    lr_sweep_epochs: int
    stats_every: int  # layer_statistics records every this many steps
    stats_lrs: tuple[float, ...]  # layer_statistics trains at each of these learning rates


QUICK = Settings(
    epochs=5,
    conv_epochs=4,
    batch_size=BATCH_SIZE,
    lr=LEARNING_RATE,
    batch_sizes=(2, 4, 8, 16, 32, 64, 128, 256),
    batch_sweep_epochs=1,
    batch_sweep_min_steps=60,
    batch_sweep_references=("none",),
    lrs=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0),
    lr_sweep_epochs=2,
    stats_every=3,
    stats_lrs=(LEARNING_RATE, 0.3),
)
FULL = Settings(
    epochs=20,
    conv_epochs=12,
    batch_size=BATCH_SIZE,
    lr=LEARNING_RATE,
    batch_sizes=(2, 4, 8, 16, 32, 64, 128, 256),
    batch_sweep_epochs=3,
    batch_sweep_min_steps=150,
    batch_sweep_references=("none", "layer"),
    lrs=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
    lr_sweep_epochs=5,
    stats_every=5,
    stats_lrs=(LEARNING_RATE, 0.3),
)


def steps_per_epoch(data: Digits, batch_size: int) -> int:
    return len(data.y_train) // batch_size


def _train(
    arch: str, norm: str, data: Digits, seed: int, progress: Progress | None, **kwargs: Any
) -> tuple[Network, dict[str, Any]]:
    """Build and train one network; return it and its record (the ``History`` as a dict)."""
    net = build(arch, norm, seed)
    total = kwargs["epochs"] * steps_per_epoch(data, kwargs["batch_size"])
    done = 0
    inner = kwargs.pop("after_backward", None)

    def after_backward(step: int, net: Network) -> None:
        nonlocal done
        if inner is not None:
            inner(step, net)
        done += 1
        if progress is not None:
            progress.update(1)

    history = train(net, data, seed=seed, after_backward=after_backward, **kwargs)
    if progress is not None and done < total:  # a diverged run stops early
        progress.update(total - done)
    settings = {k: kwargs[k] for k in ("epochs", "batch_size", "lr")}
    record = {"arch": arch, "norm": norm, "layer": LAYER_NAMES[arch][norm], **settings, **asdict(history)}
    return net, record


# --- per-norm curves ----------------------------------------------------------------------


def runs_for(norms: Sequence[str]) -> list[tuple[str, str]]:
    """The (architecture, norm) pairs ``norms`` selects: each norm in the nets that have it."""
    return [
        (arch, n) for arch, names in (("mlp", MLP_NORMS), ("conv", CONV_NORMS)) for n in names if n in norms
    ]


def steps_compare(data: Digits, norms: Sequence[str], s: Settings) -> int:
    per_epoch = steps_per_epoch(data, s.batch_size)
    return sum((s.epochs if a == "mlp" else s.conv_epochs) * per_epoch for a, _ in runs_for(norms))


def compare_norms(
    data: Digits, norms: Sequence[str], s: Settings, seed: int, progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Train the MLP and the conv net once per norm; the records hold loss and accuracy curves."""
    records = []
    with single_threaded():
        for arch, norm in runs_for(norms):
            epochs = s.epochs if arch == "mlp" else s.conv_epochs
            _, record = _train(
                arch, norm, data, seed, progress, epochs=epochs, batch_size=s.batch_size, lr=s.lr
            )
            records.append(record)
    return records


# --- BatchNorm's batch-size sweep --------------------------------------------------------


def batch_sweep_epochs(data: Digits, s: Settings, batch_size: int) -> int:
    """``s.batch_sweep_epochs``, or more where that gives fewer than ``s.batch_sweep_min_steps``
    steps: with too few steps the running statistics (momentum 0.1) are still close to their
    initial values, and the large batches would only show that."""
    return max(s.batch_sweep_epochs, math.ceil(s.batch_sweep_min_steps / steps_per_epoch(data, batch_size)))


def steps_batch_sweep(data: Digits, s: Settings) -> int:
    nets = 1 + len(s.batch_sweep_references)
    return nets * sum(batch_sweep_epochs(data, s, b) * steps_per_epoch(data, b) for b in s.batch_sizes)


def train_eval_gap(net: Network, x: np.ndarray, y: np.ndarray, batch_size: int) -> tuple[float, float]:
    """Held-out accuracy in train mode and the relative gap between train- and eval-mode outputs.

    Train mode normalizes each held-out batch of ``batch_size`` with its own statistics, as
    training did; eval mode uses the running statistics. Every image is scored in both
    modes, each in a batch of ``batch_size`` (the last batch is the last ``batch_size``
    images, of which only those not yet scored count), so that the train-mode accuracy is
    on the images of the eval-mode one. The gap is
    ``mean |logits_train - logits_eval| / mean |logits_eval|``. Works on a copy: ``net``'s
    running statistics are left alone.
    """
    probe = net.copy()
    n, b = len(y), min(batch_size, len(y))
    logits_eval = eval_logits(probe, x)  # n,10 (probe back in train mode)
    whole = n // b * b  # the images in whole batches
    parts = [probe.forward(x[i : i + b]) for i in range(0, whole, b)]
    if whole < n:  # the rest, in the batch of the last b images
        parts.append(probe.forward(x[n - b :])[b - (n - whole) :])
    train_logits = np.concatenate(parts)  # n,10
    gap = float(np.mean(np.abs(train_logits - logits_eval)) / np.mean(np.abs(logits_eval)))
    return float(np.mean(train_logits.argmax(axis=1) == y)), gap


def batch_size_sweep(
    data: Digits, s: Settings, seed: int, progress: Progress | None = None
) -> dict[str, Any]:
    """The BatchNorm MLP (and the reference MLPs) trained at each batch size (epochs from
    :func:`batch_sweep_epochs`), the learning rate scaled by ``sqrt(batch / s.batch_size)``."""
    result: dict[str, Any] = {
        "batch_sizes": list(s.batch_sizes),
        "epochs": [batch_sweep_epochs(data, s, b) for b in s.batch_sizes],
        "min_epochs": s.batch_sweep_epochs,
        "min_steps": s.batch_sweep_min_steps,
        "base_lr": s.lr,
        "base_batch_size": s.batch_size,
        "lrs": [],
        "eval_accuracy": [],
        "train_mode_accuracy": [],
        "gap": [],
        "references": {n: [] for n in s.batch_sweep_references},
    }
    with single_threaded():
        for b in s.batch_sizes:
            lr = s.lr * math.sqrt(b / s.batch_size)
            result["lrs"].append(lr)
            kwargs = {"epochs": batch_sweep_epochs(data, s, b), "batch_size": b, "lr": lr}
            net, record = _train("mlp", "batch", data, seed, progress, **kwargs)
            train_acc, gap = train_eval_gap(net, data.x_test, data.y_test, b)
            result["eval_accuracy"].append(record["test_accuracy"][-1])
            result["train_mode_accuracy"].append(train_acc)
            result["gap"].append(gap)
            for ref in s.batch_sweep_references:
                _, record = _train("mlp", ref, data, seed, progress, **kwargs)
                result["references"][ref].append(record["test_accuracy"][-1])
    return result


# --- learning-rate sweep -----------------------------------------------------------------


def mlp_norms(norms: Sequence[str]) -> list[str]:
    """The MLP norms of ``norms``, always with ``none`` first (the comparisons need it)."""
    return ["none", *(n for n in MLP_NORMS if n in norms and n != "none")]


def steps_lr_sweep(data: Digits, norms: Sequence[str], s: Settings) -> int:
    return len(mlp_norms(norms)) * len(s.lrs) * s.lr_sweep_epochs * steps_per_epoch(data, s.batch_size)


def lr_sweep(
    data: Digits, norms: Sequence[str], s: Settings, seed: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Final held-out accuracy and training loss of the MLP per norm and learning rate (a run
    whose loss or held-out logits become inf or nan is marked diverged and scored at its last
    accuracy)."""
    result: dict[str, Any] = {
        "lrs": list(s.lrs),
        "epochs": s.lr_sweep_epochs,
        "batch_size": s.batch_size,
        "norms": {},
    }
    with single_threaded():
        for norm in mlp_norms(norms):
            rows: dict[str, list[Any]] = {"accuracy": [], "train_loss": [], "diverged": []}
            for lr in s.lrs:
                _, record = _train(
                    "mlp",
                    norm,
                    data,
                    seed,
                    progress,
                    epochs=s.lr_sweep_epochs,
                    batch_size=s.batch_size,
                    lr=lr,
                )
                rows["accuracy"].append(record["test_accuracy"][-1])
                rows["train_loss"].append(record["train_loss"][-1] if record["train_loss"] else math.nan)
                rows["diverged"].append(record["diverged"])
            result["norms"][norm] = rows
    return result


# --- per-layer statistics ----------------------------------------------------------------


def steps_layer_stats(data: Digits, norms: Sequence[str], s: Settings) -> int:
    return len(mlp_norms(norms)) * len(s.stats_lrs) * s.epochs * steps_per_epoch(data, s.batch_size)


def layer_statistics(
    data: Digits, norms: Sequence[str], s: Settings, seed: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Every ``s.stats_every`` steps of training the MLP at each of ``s.stats_lrs``: for each
    hidden layer, the mean and standard deviation (over the batch and units) of the values
    entering its ReLU (the Linear output, or the norm's output when there is one); for each
    Linear layer, the norm of its weight gradient. Indexed ``["norms"][norm][str(lr)]``."""
    result: dict[str, Any] = {
        "every": s.stats_every,
        "lrs": list(s.stats_lrs),
        "epochs": s.epochs,
        "batch_size": s.batch_size,
        "norms": {},
    }
    with single_threaded():
        for norm in mlp_norms(norms):
            result["norms"][norm] = {}
            for lr in s.stats_lrs:
                rows: dict[str, list[Any]] = {"step": [], "mean": [], "std": [], "grad_norm": []}

                def record(step: int, net: Network, rows: dict[str, list[Any]] = rows) -> None:
                    if step % s.stats_every:
                        return
                    layers = net.layers
                    relu_inputs = [
                        net.outputs[i - 1] for i, layer in enumerate(layers) if isinstance(layer, ReLU)
                    ]
                    rows["step"].append(step)
                    rows["mean"].append([float(a.mean()) for a in relu_inputs])
                    rows["std"].append([float(a.std()) for a in relu_inputs])
                    rows["grad_norm"].append(
                        [
                            float(np.linalg.norm(layer.grads["weight"]))
                            for layer in layers
                            if isinstance(layer, Linear)
                        ]
                    )

                kwargs = {"epochs": s.epochs, "batch_size": s.batch_size, "lr": lr, "after_backward": record}
                _, run = _train("mlp", norm, data, seed, progress, **kwargs)
                rows["diverged"] = [run["diverged"]]
                result["norms"][norm][str(lr)] = rows
    return result
