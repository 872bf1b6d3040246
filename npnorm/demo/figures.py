"""The demo's figures, drawn from :mod:`npnorm.demo.experiments`' records with matplotlib.

Figures are ``matplotlib.figure.Figure`` objects saved straight to PNG: no pyplot, no
window, no global state (the Agg canvas, whatever backend the user has configured).
Each norm keeps its colour across figures.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import (
    FixedLocator,
    FormatStrFormatter,
    LogLocator,
    MaxNLocator,
    NullFormatter,
    NullLocator,
)

from .._files import write_whole
from .experiments import ARCH_NAMES, LAYER_NAMES

COLORS = {
    "none": "#444444",
    "batch": "#1f77b4",
    "layer": "#ff7f0e",
    "rms": "#2ca02c",
    "group": "#d62728",
    "instance": "#9467bd",
}
LAYER_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c")
STYLE_NAMES = ("solid", "dashed", "dotted", "dash-dotted")
DPI = 110


def _save(fig: Figure, path: pathlib.Path) -> pathlib.Path:
    """``fig`` as PNG at ``path``, whole or not at all: written beside it, then renamed (a
    Ctrl-C during the write left a truncated PNG in place of the figure)."""
    write_whole(path, lambda part: fig.savefig(part, dpi=DPI, format="png"))
    return path


def _label(arch: str, norm: str) -> str:
    return "no normalization" if norm == "none" else LAYER_NAMES[arch][norm]


def _powers_of_two(ax: Any, values: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(values))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(v) for v in values])


def _plain_log(ax: Any, axis: str = "y", subs: tuple[float, ...] = (1.0, 2.0, 5.0)) -> None:
    """Log scale with ticks at ``subs`` times powers of ten, written as plain numbers
    (0.2, 0.5, 1, 2), not 2 x 10^-1; unlabelled minor ticks in between."""
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_locator(LogLocator(base=10, subs=subs))
    target.set_major_formatter(FormatStrFormatter("%g"))
    target.set_minor_formatter(NullFormatter())


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Moving average along axis 0 (shorter windows at the start), to see through step noise."""
    cumsum = np.cumsum(values, axis=0)
    out = cumsum.copy()
    out[window:] = cumsum[window:] - cumsum[:-window]
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return out / counts.reshape(-1, *([1] * (values.ndim - 1)))


def curves(records: list[dict[str, Any]], path: pathlib.Path, *, seed: int) -> pathlib.Path:
    """Training loss and held-out accuracy per epoch, one line per norm, one row per network."""
    archs = [a for a in ARCH_NAMES if any(r["arch"] == a for r in records)]
    fig = Figure(figsize=(11, 4.2 * len(archs)), layout="constrained")
    axes = np.atleast_2d(fig.subplots(len(archs), 2, squeeze=False))
    for row, arch in zip(axes, archs, strict=True):
        for r in (r for r in records if r["arch"] == arch):
            epochs = np.arange(1, len(r["train_loss"]) + 1)
            style = {"color": COLORS[r["norm"]], "label": _label(arch, r["norm"]), "marker": "o", "ms": 3}
            row[0].plot(epochs, r["train_loss"], **style)
            row[1].plot(epochs, r["test_accuracy"][1:], **style)
        _plain_log(row[0])
        row[0].set(
            xlabel="epoch",
            ylabel="training loss (mean over the epoch)",
            title=f"{ARCH_NAMES[arch]}: training loss",
        )
        row[1].set(xlabel="epoch", ylabel="held-out accuracy", title=f"{ARCH_NAMES[arch]}: held-out accuracy")
        lowest = min(min(r["test_accuracy"][1:]) for r in records if r["arch"] == arch)
        row[1].set_ylim(max(0.0, min(0.9, lowest) - 0.02), 1.0)
        for ax in row:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle(
        "Digits (8x8 images): one network per norm, all starting from the same weights; SGD with momentum, "
        f"batch {records[0]['batch_size']}, learning rate {records[0]['lr']:g};\n"
        f"held-out accuracy on images the networks never train on; seed {seed}"
    )
    return _save(fig, path)


def batch_size_sweep(result: dict[str, Any], path: pathlib.Path, *, seed: int) -> pathlib.Path:
    """BatchNorm's held-out accuracy (eval and train mode) and train/eval output gap vs batch size."""
    sizes = result["batch_sizes"]
    fig = Figure(figsize=(12, 4.6), layout="constrained")
    acc, gap = fig.subplots(1, 2)
    acc.plot(sizes, result["eval_accuracy"], "o-", color=COLORS["batch"], label="BatchNorm1d, eval mode")
    acc.plot(
        sizes,
        result["train_mode_accuracy"],
        "s--",
        color=COLORS["batch"],
        alpha=0.6,
        label="BatchNorm1d, train mode (batch statistics)",
    )
    for ref, values in result["references"].items():
        acc.plot(sizes, values, "o-", color=COLORS[ref], label=_label("mlp", ref))
    acc.set(
        xlabel="training batch size",
        ylabel="held-out accuracy",
        title="Held-out accuracy after training at each batch size",
        ylim=(0, 1.02),
    )
    gap.plot(sizes, result["gap"], "o-", color=COLORS["batch"], label="BatchNorm1d")
    _plain_log(gap)
    gap.set(
        xlabel="batch size (training, and held-out batches in train mode)",
        ylabel="relative gap between the two modes' logits",
        title="Train mode (batch statistics) vs eval mode (running statistics)",
    )
    gap.text(
        0.98,
        0.96,
        "gap = mean |logits_train - logits_eval| / mean |logits_eval|\n"
        "on held-out batches of the training size",
        transform=gap.transAxes,
        ha="right",
        va="top",
        fontsize="small",
    )
    for ax in (acc, gap):
        _powers_of_two(ax, sizes)
        ax.grid(alpha=0.3)
    acc.legend(loc="lower right")
    gap.legend(loc="lower left")
    fig.suptitle(
        f"BatchNorm's batch-size sweep: MLP, {result['min_epochs']} epoch(s) or at least "
        f"{result['min_steps']} steps at each batch size, learning rate {result['base_lr']:g} "
        f"* sqrt(batch / {result['base_batch_size']}); seed {seed}"
    )
    return _save(fig, path)


def lr_sweep(result: dict[str, Any], path: pathlib.Path, *, seed: int) -> pathlib.Path:
    """Held-out accuracy and final training loss vs learning rate, one line per norm."""
    lrs = result["lrs"]
    fig = Figure(figsize=(12, 4.6), layout="constrained")
    acc, loss = fig.subplots(1, 2)
    for norm, rows in result["norms"].items():
        color, label = COLORS[norm], _label("mlp", norm)
        acc.plot(lrs, rows["accuracy"], "o-", color=color, label=label)
        finite = np.isfinite(rows["train_loss"])
        loss.plot(
            np.asarray(lrs)[finite], np.asarray(rows["train_loss"])[finite], "o-", color=color, label=label
        )
        diverged = [lr for lr, d in zip(lrs, rows["diverged"], strict=True) if d]
        if diverged:
            acc.plot(diverged, [0.1] * len(diverged), "x", color=color, ms=9, mew=2)
    any_diverged = any(any(rows["diverged"]) for rows in result["norms"].values())
    chance = "chance (0.1)" + ("; x: diverged (inf/nan)" if any_diverged else "")
    acc.axhline(0.1, color="black", lw=0.8, ls=":", label=chance)
    _plain_log(acc, "x", subs=(1.0,))
    acc.set(xlabel="learning rate", ylabel="held-out accuracy", ylim=(0, 1.02))
    acc.set_title("Held-out accuracy after training at each rate")
    _plain_log(loss, "x", subs=(1.0,))
    _plain_log(loss)
    loss.set(
        xlabel="learning rate",
        ylabel="training loss, last epoch",
        title="Final training loss",
    )
    for ax in (acc, loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"Learning-rate sweep: MLP, {result['epochs']} epochs at each rate, batch {result['batch_size']}; "
        f"seed {seed}"
    )
    return _save(fig, path)


def layer_statistics(result: dict[str, Any], path: pathlib.Path, *, seed: int) -> pathlib.Path:
    """Per hidden layer, mean and std of the ReLU inputs, and per Linear layer the weight-gradient
    norm, over training steps; one column per norm, solid and dashed lines for the two rates."""
    norms = list(result["norms"])
    lrs = result["lrs"]
    styles = ["-", "--", ":", "-."][: len(lrs)]
    # (11 inches at least: the two-line title is about as wide)
    fig = Figure(figsize=(max(3.6 * len(norms) + 1, 11), 10), layout="constrained")
    axes = fig.subplots(3, len(norms), sharex=True, squeeze=False)
    for col in range(1, len(norms)):  # the std and gradient rows on one scale each; the mean row
        axes[0, col].sharey(axes[0, 0])  # not: no norm's -60 would flatten the norms' +-1 to 0
        axes[2, col].sharey(axes[2, 0])
    for col, norm in enumerate(norms):
        for k, lr in enumerate(lrs):
            rows = result["norms"][norm][str(lr)]
            steps = np.asarray(rows["step"])
            for what, ax in (("std", axes[0, col]), ("mean", axes[1, col])):
                values = np.asarray(rows[what])
                for layer in range(values.shape[1]):
                    ax.plot(
                        steps,
                        values[:, layer],
                        styles[k],
                        color=LAYER_COLORS[layer],
                        label=f"hidden layer {layer + 1}, lr {lr:g}",
                    )
            raw = np.asarray(rows["grad_norm"])
            grads = _smooth(raw, 5)
            dead = np.flatnonzero(np.all(raw == 0, axis=1))
            if dead.size:  # zero has no place on a log axis: say where the lines drop off
                axes[2, col].axvline(steps[dead[0]], color="0.4", ls=":", lw=1)
                axes[2, col].text(
                    steps[dead[0]],
                    0.97,
                    f" lr {lr:g}: every weight gradient\n is 0 from step {steps[dead[0]]} on",
                    transform=axes[2, col].get_xaxis_transform(),
                    fontsize="small",
                    va="top",
                )
            for layer in range(grads.shape[1]):
                axes[2, col].plot(
                    steps,
                    grads[:, layer],
                    styles[k],
                    color=LAYER_COLORS[layer],
                    lw=1,
                    label=f"Linear {layer + 1}, lr {lr:g}",
                )
        axes[0, col].set_title(_label("mlp", norm))
        axes[2, col].set_xlabel("training step")
    axes[0, 0].set_ylabel("std of the ReLU inputs")
    axes[1, 0].set_ylabel("mean of the ReLU inputs")
    axes[2, 0].set_ylabel("norm of the weight gradient\n(moving average over 5 records)")
    _plain_log(axes[0, 0])
    _plain_log(axes[2, 0])
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0, -1].legend(fontsize="small")
    axes[2, -1].legend(fontsize="small")
    fig.suptitle(
        "Inside the MLP during training: each hidden layer's ReLU input (after the norm, if any) "
        "and each Linear layer's weight gradient;\n"
        + ", ".join(f"{name}: learning rate {lr:g}" for name, lr in zip(STYLE_NAMES, lrs, strict=False))
        + f"; {result['epochs']} epochs, batch {result['batch_size']}, "
        f"recorded every {result['every']} steps; seed {seed}"
    )
    return _save(fig, path)
