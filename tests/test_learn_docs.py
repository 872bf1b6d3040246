"""docs/derivations/: every link resolves, every line anchor lands on the line whose code it
quotes, every command a page quotes runs, every step name matches the code, one vocabulary;
the SyncBatchNorm page quotes what its command prints."""

from __future__ import annotations

import io
import re
import shlex
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from npnorm.learn import _cli, _doclinks, staged_forward
from npnorm.learn.examples import example

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "derivations"
PAGES = sorted(DOCS.glob("*.md"))
LINKED = [*PAGES, ROOT / "exercises" / "README.md", ROOT / "README.md"]
LAYER_PAGES = {
    "batch_norm_training.md": [("batch_norm", {})],
    "batch_norm_eval.md": [("batch_norm", {"eval": True})],
    "layer_norm.md": [("layer_norm", {})],
    "rms_norm.md": [("rms_norm", {})],
    "group_norm_instance_norm.md": [("group_norm", {})],
}
SYNC_PAGE = (
    DOCS / "sync_batch_norm.md"
)  # no staged tape: the ranks are simulated (npnorm.learn.sync_batch_norm)


def test_the_pages_are_there():
    assert {p.name for p in PAGES} == {"README.md", *LAYER_PAGES, SYNC_PAGE.name}


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_and_every_line_anchor_lands_on_its_code(page):
    assert _doclinks.problems(page) == []


def test_the_link_checker_catches_a_moved_line_and_a_missing_file(tmp_path):
    target = tmp_path / "code.py"
    target.write_text("a = 1\nb = 2\n")
    page = tmp_path / "page.md"
    links = "[`b = 2`](code.py#L1) [`a = 1`](code.py#L1) [x](nope.py) [y](page.md#no-such-heading)"
    page.write_text(links + "\n# Head\n")
    found = _doclinks.problems(page)
    assert len(found) == 3 and "does not contain `b = 2`" in found[0] and "no such file" in found[1]
    assert "no heading" in found[2]
    _doclinks.fix(page)
    assert "[`b = 2`](code.py#L2)" in page.read_text()


def test_fix_keeps_an_anchor_that_holds_where_its_text_is_on_several_lines(tmp_path):
    # --fix called such a link unfixable (exit 1) though the check passed, and rewrote
    # every page whether or not a link moved
    target = tmp_path / "code.py"
    target.write_text("a = 1\nb = 2\na = 1  # again\n")
    page = tmp_path / "page.md"
    page.write_text("[`a = 1`](code.py#L3) [`b = 2`](code.py#L2)\n")
    stamp = page.stat().st_mtime_ns
    assert _doclinks.problems(page) == [] and _doclinks.fix(page) == []
    assert page.stat().st_mtime_ns == stamp  # nothing moved: not rewritten
    page.write_text("[`a = 1`](code.py#L2)\n")  # broken, and ambiguous: said so
    assert "is on 2 lines" in _doclinks.fix(page)[0]


def test_every_formula_row_links_to_code():
    """Each row of a node or local-derivative table ends in a link to the line that computes it."""
    for page in PAGES:
        rows = [line for line in page.read_text().splitlines() if re.match(r"\| *\d", line)]
        for row in rows:
            assert "../../npnorm/" in row, f"{page.name}: {row}"


def commands(text: str) -> list[list[str]]:
    found = re.findall(r"python -m npnorm learn([^`\n#]*)", text)
    return [shlex.split(c.replace("<exercise>", "")) for c in found]


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_a_page_quotes_runs(page, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for argv in commands(page.read_text()):
        if argv[:1] == ["check"] and len(argv) > 1 and "/" in argv[1] and not Path(argv[1]).exists():
            continue  # an example path ("path/to/my_copy/...")
        if argv == ["check"]:
            continue  # the generic "check <exercise>"
        if argv[:1] == ["check"] and "--solution" not in argv:
            expected = 1  # a stub, graded: it fails until filled in
        else:
            expected = 0  # a solution passes its grader; every other command succeeds
        assert _cli.main(argv) == expected, argv
    capsys.readouterr()


@pytest.mark.parametrize("page", [DOCS / "README.md", SYNC_PAGE], ids=["index", "sync_batch_norm"])
def test_learn_blocks_run(page):
    """The pages' Python blocks that use ``npnorm.learn`` run (README.md's blocks, none of
    which does, run in test_docs)."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S) if "npnorm.learn" in b]
    assert blocks, page
    for block in blocks:
        exec(compile(block, str(page), "exec"), {})


@pytest.mark.parametrize("name", list(LAYER_PAGES))
def test_each_page_names_the_steps_the_code_has(name):
    text = (DOCS / name).read_text()
    for layer, kw in LAYER_PAGES[name]:
        args, kwargs = example(layer, **kw)
        tape = staged_forward(layer, *args, **kwargs)
        rows = [line.split("|") for line in text.splitlines() if re.match(r"\| *\d+ *\| *`", line)]
        steps = [cells[2].strip().strip("`") for cells in rows]
        formulas = [cells[3].strip().strip("`") for cells in rows]
        assert steps[: len(tape.steps)] == list(tape.steps)
        assert formulas[: len(tape.steps)] == [n.formula for n in tape.nodes.values()]


@pytest.mark.parametrize("name", list(LAYER_PAGES))
def test_each_page_runs_derives_and_shows_the_matrix_view(name):
    text = (DOCS / name).read_text()
    assert text.count("python -m npnorm learn") >= 2
    assert "matrix" in text.lower() and "J = rstd" in text
    assert "it simplifies to" not in text.lower()
    if name != "batch_norm_eval.md":
        assert "## 3. Collapsing the staged backward into the closed form" in text
        assert re.search(r"mean\(dxhat\w* · xhat\w*\)", text)


def test_the_index_gives_an_order_and_lists_sync_batch_norm_last():
    text = (DOCS / "README.md").read_text()
    order = [text.index(f"]({p})") for p in [*LAYER_PAGES, SYNC_PAGE.name]]
    assert order == sorted(order)
    assert "coming" not in text


def _numbers_agree(quoted: str, printed: str) -> bool:
    """The same line up to rounding noise: equal text, numbers with fixed decimals equal as
    printed, and numbers in e-notation within 5% of each other (or both below 1e-4 in
    magnitude: rounding errors of a result that is right, which vary with the platform)."""
    number = r"[-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|nan)"
    if re.sub(number, "#", quoted) != re.sub(number, "#", printed):
        return False
    pairs = zip(re.findall(number, quoted), re.findall(number, printed), strict=True)
    for a, b in pairs:
        if a == b:
            continue
        if "e" not in a + b:
            return False
        x, y = abs(float(a)), abs(float(b))
        if max(x, y) >= 1e-4 and (np.sign(float(a)) != np.sign(float(b)) or abs(x - y) > 0.05 * max(x, y)):
            return False
    return True


def test_the_sync_page_quotes_what_its_command_prints():
    text = SYNC_PAGE.read_text()
    assert text.startswith("# SyncBatchNorm") and "```sh\npython -m npnorm learn sync_batch_norm " in text
    assert "it simplifies to" not in text.lower() and "J = rstd" in text
    out = io.StringIO()
    with redirect_stdout(out):
        assert _cli.main(["sync_batch_norm"]) == 0
    printed = out.getvalue().splitlines()
    blocks = re.findall(r"```text\n(.*?)```", text, re.S)
    assert len(blocks) >= 5
    for block in blocks:
        for line in block.splitlines():
            assert any(_numbers_agree(line, p) for p in printed), f"not printed: {line!r}"


def test_a_large_split_passes_its_checks(capsys):
    """``learn sync_batch_norm --split 100000,1`` said WRONG for Σ_G dx (2.2e-11 against an
    absolute 1e-12): a sum of 4e5 values compared with 0 rounds relative to the sum of
    their sizes."""
    assert _cli.main(["sync_batch_norm", "--split", "100000,1"]) == 0
    assert "WRONG" not in capsys.readouterr().out


def test_the_number_check_of_the_sync_page_can_fail():
    assert _numbers_agree("mean [1.0268 0.985 ]", "mean [1.0268 0.985 ]")
    assert not _numbers_agree("mean [1.0268 0.985 ]", "mean [1.0269 0.985 ]")
    assert not _numbers_agree("error 3.65e-01", "error 3.65e-02") and _numbers_agree("d 3.6e-15", "d 1.8e-16")
    assert _numbers_agree("error 1.8e-01", "error 1.85e-01") and not _numbers_agree("e 2.1e-03", "e -2.1e-03")
    assert not _numbers_agree("mean [1.0268]", "var [1.0268]")


def test_one_name_for_the_gradient_of_xhat():
    texts = [*(p.read_text() for p in LINKED), (ROOT / "npnorm" / "_stats.py").read_text()]
    texts += [p.read_text() for p in (ROOT / "npnorm" / "learn").glob("*.py")]
    for text in texts:
        assert not re.search(r"\bg = dy|mean\(g\b|\(g -", text)
    assert "dxhat = dy · w" in (ROOT / "README.md").read_text()


def test_readme_learn_section_comes_first_and_starts_with_its_command():
    text = (ROOT / "README.md").read_text()
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections[0] == "Learn the derivations"
    body = text.split("## Learn the derivations\n", 1)[1]
    assert body.lstrip().startswith("```sh\npython -m npnorm learn layer_norm\n```")
    assert "(docs/derivations/README.md)" in body.split("\n## ", 1)[0]


def test_doclinks_command_checks_the_derivation_pages_by_default(capsys):
    """Without page arguments it checks docs/derivations/*.md (it checked none and said they
    all held); ``--help`` prints the usage, an unknown flag is a usage error (both were read
    as page paths)."""
    assert _doclinks.main([]) == 0
    out = capsys.readouterr().out
    n = len(list(DOCS.glob("*.md")))
    assert n >= 7 and f"all links of {n} pages hold" in out
    assert _doclinks.main(["--help"]) == 0 and "usage:" in capsys.readouterr().out
    assert _doclinks.main(["--bogus"]) == 2 and "usage:" in capsys.readouterr().err
