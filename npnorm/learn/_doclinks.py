"""Check, and repair, the links of the derivation pages (docs/derivations/*.md).

A formula on those pages links to the line of code that computes it, with the code
itself as the link text::

    [`d["rstd"] = sum_to(dxhat * t[xc], t["rstd"].shape)`](../../npnorm/learn/_graph.py#L110)

so that a reader sees the line and a test can verify it: the target file exists and
line 110 contains that text. When code moves, ``--fix`` moves each anchor to the one
line that contains its text (and reports texts found on no line, or on several)::

    python -m npnorm.learn._doclinks [--fix] docs/derivations/*.md

Other relative links must name an existing file, and a ``page.md#heading`` anchor must
be a heading of that page (GitHub's anchor for it).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

LINK = re.compile(r"\[(`[^`]+`|[^\]]*)\]\(([^)\s]+)\)")  # [text](target); text may be a code span holding "]"
CODE = re.compile(r"^`([^`]+)`$")  # link text that is one code span
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _lines_with(path: Path, text: str) -> list[int]:
    return [i for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if text in line]


def problems(md: Path) -> list[str]:
    """What is wrong with the links of ``md`` (empty when all hold)."""
    found = []
    source = md.read_text(encoding="utf-8")
    for lineno, line in enumerate(source.splitlines(), 1):
        for text, target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, frag = target.partition("#")
            path = (md.parent / file).resolve() if file else md.resolve()
            where = f"{md}:{lineno}: {target}"
            if not path.exists():
                found.append(f"{where}: no such file")
                continue
            if not frag:
                continue
            if re.fullmatch(r"L\d+", frag):
                code = CODE.match(text)
                if code is None:
                    found.append(f"{where}: a line anchor needs the line's code as its link text")
                    continue
                n = int(frag[1:])
                lines = path.read_text(encoding="utf-8").splitlines()
                if not (1 <= n <= len(lines)) or code.group(1) not in lines[n - 1]:
                    at = _lines_with(path, code.group(1))
                    found.append(
                        f"{where}: line {n} does not contain `{code.group(1)}` (found on lines {at})"
                    )
            elif path.suffix == ".md":
                if frag not in {anchor(h) for h in HEADING.findall(path.read_text(encoding="utf-8"))}:
                    found.append(f"{where}: no heading #{frag} in {path.name}")
    return found


def fix(md: Path) -> list[str]:
    """Move each line anchor of ``md`` that no longer lands on its text to the one line
    holding it; return what could not be fixed. An anchor that holds stays, even where its
    text is on several lines; the page is written only where a link moved."""
    unfixable = []

    def repair(m: re.Match[str]) -> str:
        text, target = m.group(1), m.group(2)
        file, _, frag = target.partition("#")
        code = CODE.match(text)
        if not code or not re.fullmatch(r"L\d+", frag) or re.match(r"[a-z]+:", target):
            return m.group(0)
        path = (md.parent / file).resolve()
        if not path.exists():
            unfixable.append(f"{md}: {file}: no such file")
            return m.group(0)
        at = _lines_with(path, code.group(1))
        if int(frag[1:]) in at:  # the anchor holds
            return m.group(0)
        if len(at) != 1:
            unfixable.append(f"{md}: `{code.group(1)}` is on {len(at)} lines of {file}: {at}")
            return m.group(0)
        return f"[{text}]({file}#L{at[0]})"

    before = md.read_text(encoding="utf-8")
    after = LINK.sub(repair, before)
    if after != before:
        md.write_text(after, encoding="utf-8")
    return unfixable


USAGE = "usage: python -m npnorm.learn._doclinks [--fix] [PAGE.md ...]  (default: docs/derivations/*.md)"


def main(argv: list[str]) -> int:
    do_fix = "--fix" in argv
    flags = [a for a in argv if a.startswith("-") and a != "--fix"]
    if flags:  # --help, or a flag this tool lacks
        asked = flags in (["--help"], ["-h"])
        print(USAGE, file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    pages = [Path(a) for a in argv if a != "--fix"]
    if not pages:  # the derivation pages of this checkout
        pages = sorted((Path(__file__).resolve().parents[2] / "docs" / "derivations").glob("*.md"))
        if not pages:
            print("no pages given, and no docs/derivations/*.md beside this package", file=sys.stderr)
            return 2
    bad = [p for md in pages for p in fix(md)] if do_fix else []
    bad += [p for md in pages for p in problems(md)]
    print("\n".join(bad) or f"all links of {len(pages)} pages hold")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
