"""Notebook conventions shared by every notebook in ``notebooks/``.

- one ``parameters``-tagged cell (papermill), then ``check(...)`` validates the values and
  raises :class:`ParameterError` with one readable line for the first bad one;
- figures go to ``figures/<notebook>-<name>.png`` and are shown inline (:func:`save_fig`);
- the repository root is the working directory (:func:`repo_root`), whether the notebook
  runs in JupyterLab or under papermill.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import atomic
from .errors import LabError


class ParameterError(LabError):
    """A notebook parameter with a wrong value."""


class ClaimError(LabError):
    """A sentence of a notebook's narrative that the data no longer supports."""


def claim(enforce: bool, holds: bool, sentence: str) -> None:
    """Guard a sentence of the narrative with the data it rests on: the render fails when it stops holding.

    ``enforce`` False (a notebook run on other data) prints the verdict instead of failing.
    """
    if not holds and not enforce:
        print(f"NOT supported by this data: {sentence}")
        return
    if not holds:
        raise ClaimError(f"the data no longer supports: {sentence!r} (update the narrative with the data)")
    print(f"supported by the data: {sentence}")


def repo_root() -> Path:
    here = Path.cwd()
    for p in [here, *here.parents]:
        if (p / "pyproject.toml").is_file() and (p / "dflash_lab").is_dir():
            return p
    raise LabError("cannot find the dflash-lab checkout above the current folder")


def chdir_root() -> Path:
    root = repo_root()
    os.chdir(root)
    return root


def check(name: str, value, *, kind=None, min=None, max=None, choices=None, nonempty=False, each=None):
    """Validate one notebook parameter; raise ParameterError naming it otherwise."""
    def bad(why):
        raise ParameterError(f"bad notebook parameter {name}={value!r}: {why}")

    if kind is not None:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            bad(f"must be {' or '.join(k.__name__ for k in kinds)}")
        if not isinstance(value, kinds):
            bad(f"must be {' or '.join(k.__name__ for k in kinds)}")
    if choices is not None and value not in choices:
        bad(f"must be one of {list(choices)}")
    if min is not None and value < min:
        bad(f"must be >= {min}")
    if max is not None and value > max:
        bad(f"must be <= {max}")
    if nonempty and not value:
        bad("must not be empty")
    if each is not None:
        for i, v in enumerate(value):
            try:
                check(f"{name}[{i}]", v, **each)
            except ParameterError:
                bad(f"element {i} ({v!r}) must satisfy {each}")
    return value


def save_fig(fig, notebook: str, name: str, figures_dir: str = "figures") -> str:
    path = os.path.join(figures_dir, f"{notebook}-{name}.png")
    atomic.replace_with(path, lambda tmp: fig.savefig(tmp, dpi=110, bbox_inches="tight"), suffix=".png")
    return path


def legend_all(axes, order=None, **kwargs):
    """One legend on the last of ``axes`` naming every label drawn in any of them, once each (panels of one figure can
    hold different modes), in ``order`` where given (labels not in it are left out), else in the order first drawn."""
    drawn = {}
    for ax in axes:
        for h, l in zip(*ax.get_legend_handles_labels()):
            drawn.setdefault(l, h)
    labels = [l for l in order if l in drawn] if order is not None else list(drawn)
    return axes[-1].legend([drawn[l] for l in labels], labels, **kwargs)


def show_table(df, caption: str | None = None):
    """Render a DataFrame as HTML with an optional caption (works in papermill output too)."""
    from IPython.display import HTML, display

    html = df.to_html(index=False, escape=True)
    if caption:
        html = f"<p><b>{caption}</b></p>" + html
    display(HTML(html))
