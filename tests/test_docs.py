"""The documentation: help() of every public name reads well and is complete, the
examples in the docstrings run, and README.md runs top to bottom."""

from __future__ import annotations

import doctest
import importlib
import inspect
import json
import pathlib
import pydoc
import re
import subprocess
import sys

import numpy as np
import pytest

import npnorm
import npnorm.functional as F

ROOT = pathlib.Path(__file__).parent.parent
PUBLIC = [
    *(f"npnorm.{n}" for n in npnorm.__all__ if n not in ("__version__", "functional", "learn")),
    *(f"npnorm.learn.{n}" for n in npnorm.learn.__all__ if callable(getattr(npnorm.learn, n))),
    *(f"npnorm.functional.{n}" for n in F.__all__),
]
LAYERS = [
    n for n in npnorm.__all__
    if isinstance(getattr(npnorm, n), type) and issubclass(getattr(npnorm, n), npnorm.Module)
    and getattr(npnorm, n) is not npnorm.Module
]  # fmt: skip
RUNNING_STATS = [n for n in LAYERS if "BatchNorm" in n or "InstanceNorm" in n]
RAW_REST = re.compile(
    r"\.\. math::|:math:`|\\(frac|sqrt|mathrm|hat|bar|overline|sum|cdot|epsilon|quad|text)\b"
)


def _obj(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _documented_parameters(doc: str) -> set[str]:
    """Names listed in the numpydoc Parameters section (``a, b : type`` lines)."""
    match = re.search(r"^Parameters\n-+\n(.*?)(?:^\S[^\n]*\n-+\n|\Z)", doc, re.M | re.S)
    assert match, "no Parameters section"
    names: set[str] = set()
    for line in match.group(1).splitlines():
        entry = re.match(r"^([*\w][\w, *]*?)\s+:", line)
        if entry and not line.startswith(" "):
            names.update(n.strip().lstrip("*") for n in entry.group(1).split(","))
    return names


def _signature_parameters(obj) -> list[str]:
    try:
        params = inspect.signature(obj).parameters.values()
    except ValueError:  # an exception class: no signature of its own
        return []
    return [p.name for p in params if p.name != "self"]


@pytest.mark.parametrize("path", PUBLIC)
def test_help_renders_a_complete_numpydoc_docstring(path):
    obj = _obj(path)
    doc = inspect.getdoc(obj)
    assert doc and len(doc.splitlines()) >= 5, f"{path}: a one-line docstring"
    rendered = pydoc.render_doc(obj, renderer=pydoc.plaintext)
    raw = RAW_REST.search(rendered)
    assert raw is None, f"{path}: help() shows raw reST/LaTeX {raw.group(0)!r}"
    assert ":class:`_" not in rendered, f"{path}: help() points at a private class"
    wanted = _signature_parameters(obj)
    if wanted:
        missing = set(wanted) - _documented_parameters(doc)
        assert not missing, f"{path}: Parameters section lacks {sorted(missing)}"
    examples = re.search(r"^Examples\n-+\n(.*)", doc, re.M | re.S)
    assert examples and ">>> " in examples.group(1), f"{path}: no Examples section"


@pytest.mark.parametrize("name", LAYERS)
def test_layer_docstrings_state_the_math(name):
    doc = inspect.getdoc(getattr(npnorm, name))
    assert re.search(r"^\s+y(\[.*?\])?\s+= .*sqrt\(.*eps\)", doc, re.M), f"{name}: no forward formula"
    assert re.search(r"^\s+dx\s+= .*dxhat", doc, re.M), f"{name}: no backward formula in dxhat"
    assert "https://arxiv.org/" in doc, f"{name}: no paper"


@pytest.mark.parametrize("name", RUNNING_STATS)
def test_batch_statistics_layers_state_the_running_stat_rules(name):
    doc = inspect.getdoc(getattr(npnorm, name))
    rules = (
        r"running_mean\s+=",
        r"running_var\s+=",
        "momentum",
        "unbiased",
        "num_batches_tracked",
        r"(?i)eval",
    )
    for rule in rules:
        assert re.search(rule, doc), f"{name}: the running-statistics rules do not mention {rule!r}"


@pytest.mark.parametrize("name", [n for n in F.__all__ if n.endswith(("_forward", "_backward"))])
def test_functional_docstrings_state_the_math(name):
    doc = inspect.getdoc(getattr(F, name))
    if name.endswith("_forward"):
        assert "sqrt(" in doc and re.search(r"^\s+y(\[.*?\])?\s+= ", doc, re.M), name
    else:
        assert re.search(r"^\s+dx\s+= .*dxhat", doc, re.M), name


@pytest.mark.parametrize("cls", ["Module", *LAYERS])
def test_public_methods_document_their_arguments(cls):
    for name, method in inspect.getmembers(getattr(npnorm, cls), inspect.isfunction):
        if name.startswith("_"):
            continue
        doc = inspect.getdoc(method)
        assert doc, f"{cls}.{name}: no docstring"
        for p in _signature_parameters(method):
            assert p in doc, f"{cls}.{name}: argument {p!r} undocumented"


DOCTEST_MODULES = [
    "npnorm.functional._dispatch",
    "npnorm._grad_mode",
    "npnorm._threads",
    "npnorm.convert",
    "npnorm.gradient_check",
    "npnorm.learn",
    "npnorm.learn._tape",
    "npnorm.learn.check",
    "npnorm.learn.closed_form",
    "npnorm.learn.normalize",
    "npnorm.learn.sync_batch_norm",
    "npnorm.modules._module",
    *(
        f"npnorm.{package}.{m}"
        for package in ("modules", "functional")
        for m in ("batch_norm", "group_norm", "instance_norm", "layer_norm", "rms_norm", "sync_batch_norm")
    ),
]


@pytest.mark.parametrize("module", DOCTEST_MODULES)
def test_docstring_examples_run(torch, module):
    mod = importlib.import_module(module)
    with np.errstate(all="raise"):
        result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {module} failed (run doctest -v)"


def test_every_public_object_has_examples_that_run():
    """Each public name's Examples are collected by one of the doctest modules above."""
    for path in PUBLIC:
        obj = _obj(path)
        assert obj.__module__ in DOCTEST_MODULES, (
            f"{path} lives in {obj.__module__}, whose examples are not run"
        )


# --- README.md ---------------------------------------------------------------------

README = ROOT / "README.md"
FENCE = re.compile(r"^```(?:python|py)\n(.*?)^```", re.M | re.S)

RUNNER = r"""
import json, sys, traceback
with open(sys.argv[1]) as f:
    blocks = json.load(f)
namespace = {"__name__": "__main__"}
for line, source in blocks:
    code = compile("\n" * (line - 1) + source, "README.md", "exec")  # tracebacks show README lines
    try:
        exec(code, namespace)
    except BaseException:
        print(f"README.md: the Python block at line {line} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def readme_blocks() -> list[tuple[int, str]]:
    text = README.read_text()
    return [(text[: m.start(1)].count("\n") + 1, m.group(1)) for m in FENCE.finditer(text)]


def test_readme_has_python_blocks():
    blocks = readme_blocks()
    assert len(blocks) >= 5
    assert any("npnorm.functional" in source for _, source in blocks)


@pytest.mark.slow
def test_readme_runs_top_to_bottom_in_a_fresh_interpreter(torch, tmp_path):
    """Every Python block of README.md, in order, in one namespace, in a new process
    (as a reader pasting them into one session), from an empty directory."""
    blocks = tmp_path / "blocks.json"
    blocks.write_text(json.dumps(readme_blocks()))
    runner = tmp_path / "run_readme.py"
    runner.write_text(RUNNER)
    out = subprocess.run(
        [sys.executable, "-W", "error", str(runner), str(blocks)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-6000:]


# --- links of every Markdown page ----------------------------------------------------

PAGES = sorted(
    p.relative_to(ROOT).as_posix()
    for p in [
        ROOT / "README.md",
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("exercises/**/*.md"),
        *ROOT.glob("tools/*.md"),
    ]
)


def test_the_pages_are_found():
    assert {"README.md", "docs/speed/compiled-kernels.md", "docs/speed/bench-log.md"} <= set(PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_of_a_page_holds(page):
    """Relative links name files that exist, ``page.md#heading`` anchors name a heading of
    that page (GitHub's anchor), and links to a line of code hold that code (the check the
    derivation pages' test makes, on every page: the README's links into docs/speed/, say)."""
    from npnorm.learn import _doclinks

    assert _doclinks.problems(ROOT / page) == []
