"""Where the derivation pages (docs/derivations/*.md) are, for the lines that name them.

The pages come with npnorm's source repository, not with an installed package: a line names
the page where it can be opened from here, and says it is the repository's otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

# the checkout npnorm runs from, when it runs from one (an editable install)
CHECKOUT = Path(__file__).resolve().parents[2]

PAGE = {
    "batch_norm": "batch_norm_training.md",
    "layer_norm": "layer_norm.md",
    "rms_norm": "rms_norm.md",
    "group_norm": "group_norm_instance_norm.md",
    "instance_norm": "group_norm_instance_norm.md",
}


def derivation(page: str) -> str:
    """``the derivation: PATH`` for ``docs/derivations/PAGE``: the path relative to the working
    directory when the page is there, the checkout's path when npnorm runs from a checkout
    (absolute when it is not below the working directory),
    else the repository path, said to be the repository's."""
    path = Path("docs", "derivations", page)
    if path.is_file():
        return f"the derivation: {path}"
    if (CHECKOUT / path).is_file():
        shown = os.path.relpath(CHECKOUT / path)
        return f"the derivation: {CHECKOUT / path if shown.startswith('..') else shown}"
    return f"the derivation: {path} (in npnorm's source repository, not in the installed package)"
