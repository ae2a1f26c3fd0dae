"""Execute every notebook with papermill and render it to HTML: ``python -m dflash_lab.report``.

``python -m dflash_lab.report [--out reports] [--only 01_buffer_vs_capture] [-p NAME VALUE ...]``

A notebook whose metadata declares the data it needs (``dflash_lab.requires``: a glob such as
``data/bench/*.jsonl``) is listed as not rendered while nothing matches it (the GPU runs it reads
have not been recorded yet). One that needs more than some lines names a readiness function
(``dflash_lab.ready: "module:function"``), called from the repository root with the ``-p``
parameters it accepts (else its defaults, which are the notebook's): it returns None when the
recorded data has what the notebook needs, else a one-line reason, and the notebook is listed as
not rendered with that reason. Named with ``--only``, a notebook runs whatever the data holds and
fails with its own error.

Each notebook in ``notebooks/`` runs in a fresh kernel with the repository root as working
directory; the executed copy is rendered to ``reports/<name>.html``, with a contents list of its
section headings under its title (:func:`with_contents`), and ``reports/index.html`` links them.
Each notebook gets the ``-p`` names its parameters cell declares; a name that no notebook run declares (a typo,
which papermill itself only warns about before running the defaults) stops the command with one line before
anything runs. A notebook that fails (a bad parameter, a missing data file) is reported in one line naming the
notebook and the error, its old HTML (if any) is left untouched, and the command exits non-zero
after trying the others.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import importlib
import inspect
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from . import atomic
from .nbutil import repo_root


def notebooks(root: Path, only: list[str] | None = None) -> list[Path]:
    nbs = sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if only:
        nbs = [p for p in nbs if p.stem in only]
        missing = set(only) - {p.stem for p in nbs}
        if missing:
            raise SystemExit(f"dflash-lab: error: no notebook named {', '.join(sorted(missing))}")
    return nbs


def _cells(nb) -> list[tuple]:
    return [(c.cell_type, c.source, list(c.metadata.get("tags", []))) for c in nb.cells]


def pair_mismatches(root: Path) -> list[str]:
    """Where the notebooks and their Markdown twins (jupytext pairing, ``notebooks/NN_name.md``: what a review reads in
    a diff) disagree, one line each; [] when each twin is exactly the text jupytext writes from its notebook (every
    cell's type, source and metadata, the notebook metadata it keeps: kernelspec, ``dflash_lab``). Edit either file,
    then ``make pair`` (``jupytext --sync``) writes the other."""
    import jupytext
    import nbformat

    d = root / "notebooks"
    nbs = {p.stem for p in d.glob("[0-9][0-9]_*.ipynb")}
    mds = {p.stem for p in d.glob("[0-9][0-9]_*.md")}
    out = [f"notebooks/{s}.ipynb has no Markdown twin notebooks/{s}.md" for s in sorted(nbs - mds)]
    out += [f"notebooks/{s}.md has no notebook notebooks/{s}.ipynb" for s in sorted(mds - nbs)]
    for s in sorted(nbs & mds):
        nb = nbformat.read(str(d / f"{s}.ipynb"), as_version=4)
        if nb.metadata.get("jupytext", {}).get("formats") != "ipynb,md":
            out.append(f"notebooks/{s}.ipynb is not paired with its Markdown twin (metadata jupytext.formats 'ipynb,md')")
            continue
        text = (d / f"{s}.md").read_text()
        try:
            md = jupytext.reads(text, fmt="md")
        except Exception as e:  # noqa: BLE001 - a twin jupytext cannot read is a mismatch, said in one line
            out.append(f"notebooks/{s}.md: jupytext cannot read it: {type(e).__name__}: {e}")
            continue
        a, b = _cells(nb), _cells(md)
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(f"notebooks/{s}: the notebook and its Markdown twin differ from cell {i} on "
                       f"({len(a)} and {len(b)} cells)")
        elif jupytext.writes(nb, fmt="md") != text:
            out.append(f"notebooks/{s}: the notebook and its Markdown twin have the same cells but differ in their "
                       "metadata (a cell's, or the notebook's: kernelspec, dflash_lab)")
    return out


def missing_inputs(nb_path: Path, root: Path) -> str | None:
    """The data glob a notebook declares it needs (metadata ``dflash_lab.requires``) when nothing
    matches it yet, else None. Such a notebook is listed in the index as not rendered, with why."""
    req = json.loads(nb_path.read_text()).get("metadata", {}).get("dflash_lab", {}).get("requires")
    if req and not list(root.glob(req)):
        return req
    return None


def not_ready(nb_path: Path, root: Path, params: dict | None = None) -> str | None:
    """The reason a notebook's readiness function (metadata ``dflash_lab.ready``: ``"module:function"``)
    gives why the recorded data cannot render it yet, or None (ready, or no such function). The function
    runs in ``root`` with the parameters of ``params`` that its signature names; its errors propagate."""
    spec = json.loads(nb_path.read_text()).get("metadata", {}).get("dflash_lab", {}).get("ready")
    if not spec:
        return None
    mod, sep, name = spec.partition(":")
    if not sep or not mod or not name:
        raise ValueError(f"{nb_path.name}: metadata dflash_lab.ready must be 'module:function', got {spec!r}")
    fn = getattr(importlib.import_module(mod), name)
    accepted = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in (params or {}).items() if k in accepted}
    with contextlib.chdir(root):
        reason = fn(**kwargs)
    return " ".join(str(reason).split()) if reason else None


def title_of(nb_path: Path) -> str:
    nb = json.loads(nb_path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return nb_path.stem


def _error_line(exc) -> str:
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    return f"{ename}: {evalue}".strip()


_HEADING = re.compile(r'<h([23]) id="([^"]+)"[^>]*>(.*?)</h\1>', re.S)
_ANCHOR = re.compile(r'<a class="anchor-link"[^>]*>.*?</a>', re.S)


def with_contents(body: str) -> str:
    """``body`` (nbconvert's HTML of one notebook) with a contents list of its ``h2``/``h3`` section headings, each a
    link to nbconvert's heading id, put right after the first ``h1`` (notebook 03 renders to ~4 MB in 37 sections).
    A page with fewer than 3 such headings, or no ``h1``, is returned unchanged."""
    heads = [(int(level), hid, " ".join(re.sub(r"<[^>]+>", "", _ANCHOR.sub("", text)).split()))
             for level, hid, text in _HEADING.findall(body)]
    end = body.find("</h1>")
    if len(heads) < 3 or end < 0:
        return body
    items, open_sub = [], False
    for level, hid, text in heads:
        link = f'<a href="#{hid}">{text}</a>'   # text and id are nbconvert's, already escaped
        if level == 3 and items:   # an h3 before any h2 is listed as one
            items.append(("" if open_sub else "<ul>") + f"<li>{link}</li>")
            open_sub = True
        else:
            items.append(("</ul></li>" if open_sub else "</li>" if items else "") + f"<li>{link}")
            open_sub = False
    items.append("</ul></li>" if open_sub else "</li>")
    nav = ('<details class="dflash-lab-contents" open><summary><b>Contents</b></summary><ul>'
           + "".join(items) + "</ul></details>")
    return body[:end + len("</h1>")] + nav + body[end + len("</h1>"):]


def run_one(nb: Path, out_dir: Path, params: dict, kernel: str | None = None) -> tuple[bool, str]:
    import nbformat
    import papermill as pm
    from nbconvert import HTMLExporter

    root = repo_root()
    with tempfile.TemporaryDirectory() as tmp:
        executed = Path(tmp) / nb.name
        try:
            pm.execute_notebook(str(nb), str(executed), parameters=params, cwd=str(root),
                                kernel_name=kernel, progress_bar=False, log_output=False)
        except Exception as e:  # noqa: BLE001 - papermill wraps the cell's exception
            return False, _error_line(e)
        body, _ = HTMLExporter().from_notebook_node(nbformat.read(str(executed), as_version=4))
        body = with_contents(body)
        target = atomic.write_text(out_dir / f"{nb.stem}.html", body)
    return True, str(target)


def write_index(out_dir: Path, entries: list[tuple[Path, bool, str]]) -> None:
    items = []
    for nb, ok, info in entries:
        name = html.escape(title_of(nb))
        if ok or (out_dir / f"{nb.stem}.html").exists():
            link = f'<a href="{nb.stem}.html">{name}</a>'
        else:
            link = name
        status = "" if ok else (f' <span style="color:#555">({html.escape(info)})</span>' if info.startswith("not rendered")
                                else f' <span style="color:#b00">(failed: {html.escape(info)})</span>')
        items.append(f"<li>{link} <code>{nb.stem}</code>{status}</li>")
    extra = ""
    if (out_dir / "findings.html").exists():
        extra = '<p><a href="findings.html"><b>Findings page</b></a> (for the issue thread)</p>'
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>dflash-lab report</title></head>
<body style="font-family: sans-serif; max-width: 60em; margin: 2em auto">
<h1>dflash-lab: the DFlash + CUDA-graph crash of vLLM 0.22.1</h1>
{extra}<ol>{''.join(items)}</ol>
<p>Rendered {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by <code>make report</code>.
GPU results are read from <code>data/</code>, each with its provenance.</p></body></html>"""
    atomic.write_text(out_dir / "index.html", page)


def parse_value(v: str):
    try:
        return json.loads(v)
    except ValueError:
        return v


def declared_parameters(nb: Path) -> list[str]:
    """The names a notebook's ``parameters`` cell assigns, in order, read with Python's own parser (no kernel is
    started). Not papermill's ``inspect_notebook``: its line parser drops a line with a second ``=`` (notebook 02's
    ``discard_prob``, whose comment has one), which would refuse a real parameter."""
    import ast

    import nbformat

    cells = [c for c in nbformat.read(str(nb), as_version=4).cells
             if c.cell_type == "code" and "parameters" in c.metadata.get("tags", [])]
    names: list[str] = []
    for cell in cells:
        try:
            tree = ast.parse(cell.source)
        except SyntaxError as e:
            raise SystemExit(f"dflash-lab: error: {nb.name}: its parameters cell is not valid Python ({e.msg}, "
                             f"line {e.lineno})") from None
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            names += [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and n.id not in names]
    return names


def check_parameters(nbs: list[Path], params: dict) -> dict[Path, dict]:
    """Each notebook's share of ``params``: the names its parameters cell declares. A name that none of ``nbs``
    declares is a typo (papermill only warns "Passed unknown parameter" and runs the defaults): one line, non-zero exit,
    before any notebook runs or any rendered page is replaced."""
    declared = {nb: declared_parameters(nb) for nb in nbs}
    unknown = sorted(set(params) - {name for names in declared.values() for name in names})
    if unknown:
        having = "; ".join(f"{nb.stem}: {', '.join(names) or 'none'}" for nb, names in declared.items())
        raise SystemExit(f"dflash-lab: error: no notebook run here has a parameter named {', '.join(unknown)} "
                         f"(their parameters: {having})")
    return {nb: {k: v for k, v in params.items() if k in names} for nb, names in declared.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_lab.report")
    ap.add_argument("--out", default="reports")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    ap.add_argument("--kernel", default=None)
    a = ap.parse_args(argv)
    root = repo_root()
    params = {k: parse_value(v) for k, v in a.parameter}
    nbs = notebooks(root, a.only)
    share = check_parameters(nbs, params)
    try:   # the render goes on: the notebooks are what runs; the tests fail on a pair that differs
        for line in pair_mismatches(root):
            print(f"dflash-lab: warning: {line}: run `make pair`", file=sys.stderr, flush=True)
    except ImportError as e:   # an environment built before the twins (make's stamp rebuilds it on pyproject's change)
        print(f"dflash-lab: warning: the notebooks' Markdown twins are not checked ({e}): run `make env`",
              file=sys.stderr, flush=True)
    out = (root / a.out) if not os.path.isabs(a.out) else Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    entries, failed = [], 0
    for nb in nbs:
        t0 = time.time()
        missing = missing_inputs(nb, root)
        if missing and not a.only:  # asked for by name, it runs and fails with its own clear error
            entries.append((nb, False, f"not rendered: needs {missing}, not recorded yet"))
            print(f"{nb.stem}: not rendered: its data ({missing}) is not recorded yet", flush=True)
            continue
        if not a.only:
            try:
                reason = not_ready(nb, root, share[nb])
            except Exception as e:  # noqa: BLE001 - a broken readiness check fails this notebook, not the report
                failed += 1
                entries.append((nb, False, f"readiness check: {_error_line(e)}"))
                print(f"dflash-lab: error: notebook {nb.stem}: readiness check failed: {_error_line(e)}",
                      file=sys.stderr, flush=True)
                continue
            if reason:
                entries.append((nb, False, f"not rendered: {reason}"))
                print(f"{nb.stem}: not rendered: {reason}", flush=True)
                continue
        ok, info = run_one(nb, out, share[nb], a.kernel)
        entries.append((nb, ok, info))
        if ok:
            print(f"{nb.stem}: rendered to {info} ({time.time() - t0:.0f} s)", flush=True)
        else:
            failed += 1
            print(f"dflash-lab: error: notebook {nb.stem} failed: {info}", file=sys.stderr, flush=True)
    if not a.only:
        from .findings import write_findings

        try:
            write_findings(root, out)
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"dflash-lab: error: findings page failed: {_error_line(e)}", file=sys.stderr)
    write_index(out, entries)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
