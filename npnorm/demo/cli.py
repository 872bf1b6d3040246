"""``python -m npnorm demo``: train on digits with every norm, print a table, write figures.

Needs the ``demo`` extra (matplotlib, scikit-learn, tqdm); says so, and which is missing,
when one is not installed.
"""

from __future__ import annotations

import importlib
import json
import math
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

from .._files import write_whole
from . import experiments as ex
from .train_digits import DEMO_EXTRA_HINT, NORMS, load_data

DEFAULT_OUT = "npnorm-demo"
REQUIREMENTS = {"matplotlib": "matplotlib", "sklearn": "scikit-learn", "tqdm": "tqdm"}  # module: package


def missing_requirements() -> list[str]:
    """The packages of the demo extra that cannot be imported."""
    missing = []
    for module, package in REQUIREMENTS.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    return missing


def format_table(records: list[dict[str, Any]]) -> str:
    """One line per trained network: norm, final training loss, held-out accuracy, time."""
    head = f"{'network':18s} {'norm':15s} {'final train loss':>17s} {'held-out accuracy':>18s} {'time':>7s}"
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(
            f"{ex.ARCH_NAMES[r['arch']]:18s} {r['layer']:15s} {r['train_loss'][-1]:17.4f} "
            f"{r['test_accuracy'][-1]:18.3f} {r['seconds']:6.2f}s"
        )
    return "\n".join(lines)


def run(*, quick: bool, out: str | None, norms: Sequence[str] | None, seed: int, quiet: bool = False) -> int:
    """The demo; ``quiet``: no progress bars (``--quiet``: the caller discards standard
    output; the bars go to standard error). The exit status."""
    missing = missing_requirements()
    if missing:
        print(
            f"python -m npnorm demo needs {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: {DEMO_EXTRA_HINT}",
            file=sys.stderr,
        )
        return 1
    from tqdm import tqdm

    from . import figures

    start = time.perf_counter()
    norms = list(NORMS) if not norms else list(dict.fromkeys(norms))
    settings = ex.QUICK if quick else ex.FULL
    out_dir = pathlib.Path(out or DEFAULT_OUT).resolve()
    if out_dir.exists() and not out_dir.is_dir():
        print(f"python -m npnorm demo: --out {out_dir} is a file, not a folder", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    data = load_data(seed)
    print(
        f"npnorm demo ({'quick' if quick else 'full'}): digits, {len(data.y_train)} training and "
        f"{len(data.y_test)} held-out 8x8 images; norms {', '.join(norms)}; seed {seed}"
    )
    print(f"figures go to {out_dir}")

    def bar(desc: str, total: int) -> Any:
        return tqdm(
            total=total, desc=desc, unit="step", file=sys.stderr, leave=False, mininterval=0.2, disable=quiet
        )

    results: dict[str, Any] = {
        "seed": seed,
        "quick": quick,
        "norms": norms,
        "settings": vars(settings).copy(),
    }
    with bar("one network per norm", ex.steps_compare(data, norms, settings)) as progress:
        results["compare"] = ex.compare_norms(data, norms, settings, seed, progress)
    table = format_table(results["compare"])
    print(table)
    if "batch" in norms:
        with bar("BatchNorm batch-size sweep", ex.steps_batch_sweep(data, settings)) as progress:
            results["batch_size_sweep"] = ex.batch_size_sweep(data, settings, seed, progress)
    with bar("learning-rate sweep", ex.steps_lr_sweep(data, norms, settings)) as progress:
        results["lr_sweep"] = ex.lr_sweep(data, norms, settings, seed, progress)
    with bar("per-layer statistics", ex.steps_layer_stats(data, norms, settings)) as progress:
        results["layer_statistics"] = ex.layer_statistics(data, norms, settings, seed, progress)

    try:  # (a folder that takes no files: a one-line error, as for a bad --out)
        written = [figures.curves(results["compare"], out_dir / "curves.png", seed=seed)]
        if "batch_size_sweep" in results:
            sweep = results["batch_size_sweep"]
            written.append(figures.batch_size_sweep(sweep, out_dir / "batch_size_sweep.png", seed=seed))
        written.append(figures.lr_sweep(results["lr_sweep"], out_dir / "lr_sweep.png", seed=seed))
        stats = results["layer_statistics"]
        written.append(figures.layer_statistics(stats, out_dir / "layer_statistics.png", seed=seed))
        write_whole(out_dir / "table.txt", lambda p: p.write_text(table + "\n", encoding="utf-8"))
        # strict JSON: a diverged run's NaN or inf loss as null
        text = json.dumps(_finite_or_none(results), indent=1, allow_nan=False)
        write_whole(out_dir / "results.json", lambda p: p.write_text(text + "\n", encoding="utf-8"))
    except OSError as err:
        print(f"python -m npnorm demo: cannot write in {out_dir}: {err}", file=sys.stderr)
        return 1
    written += [out_dir / "table.txt", out_dir / "results.json"]
    print("wrote " + ", ".join(p.name for p in written) + f" in {out_dir}")
    earlier = [name for name in FIGURES if (out_dir / name).exists() and out_dir / name not in written]
    if earlier:  # (not this run's: say so, rather than delete files in the user's folder)
        print(f"left from an earlier run, not made by this one: {', '.join(earlier)}")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


# every figure a run may write
FIGURES = ("curves.png", "batch_size_sweep.png", "lr_sweep.png", "layer_statistics.png")


def _finite_or_none(value: Any) -> Any:
    """``value`` with every float that is not finite (a diverged run's loss) replaced by None,
    in nested dicts and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value
