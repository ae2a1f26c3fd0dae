"""Run small pieces of vLLM 0.22.1's own Python on the CPU, verbatim from the pinned sources.

Most of vLLM cannot be imported without its CUDA runtime, but a few functions that decide the
bug are plain Python: the KV-cache grouping of hybrid models, the FlashAttention metadata
builder's ``update_block_table``, the block of ``build()`` that stores FA3's schedule in the
builder's persistent buffer. This module lifts such a function (or one statement of a method)
out of the source text of the pinned distribution (:func:`dflash_lab.vllm_sources.read_source`)
and executes it in a namespace the caller provides. The text is not retyped; only its
indentation is removed, and annotations are left unevaluated (``from __future__ import
annotations``), since their types live in modules that need CUDA.
"""

from __future__ import annotations

import ast
import textwrap

from .errors import LabError
from .vllm_sources import read_source

_FUTURE = "from __future__ import annotations\n"


def _find_def(tree: ast.Module, name: str, cls: str | None):
    body = tree.body
    if cls is not None:
        c = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if c is None:
            raise LabError(f"no class {cls!r}")
        body = c.body
    fn = next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None:
        raise LabError(f"no function {(cls + '.') if cls else ''}{name}")
    return fn


def function_source(relpath: str, name: str, cls: str | None = None, text: str | None = None) -> tuple[str, int]:
    """(text, first line) of a top-level function or a method, exactly as in ``relpath`` (or in
    ``text``, another version of that file: e.g. the file with the upstream patch applied)."""
    src = read_source(relpath) if text is None else text
    try:
        fn = _find_def(ast.parse(src), name, cls)
    except LabError as e:
        raise LabError(f"{relpath}: {e}") from None
    start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
    lines = src.splitlines(keepends=True)[start - 1: fn.end_lineno]
    return textwrap.dedent("".join(lines)), start


def statement_source(relpath: str, name: str, cls: str | None, startswith: str) -> tuple[str, int]:
    """(text, first line) of the first statement inside a function whose text starts with ``startswith``."""
    src = read_source(relpath)
    fn = _find_def(ast.parse(src), name, cls)
    for node in ast.walk(fn):
        if isinstance(node, ast.stmt) and node is not fn:
            seg = ast.get_source_segment(src, node) or ""
            if seg.startswith(startswith):
                lines = src.splitlines(keepends=True)[node.lineno - 1: node.end_lineno]
                return textwrap.dedent("".join(lines)), node.lineno
    raise LabError(f"{relpath}: no statement starting with {startswith!r} in {name}")


def load_function(relpath: str, name: str, cls: str | None = None, namespace: dict | None = None,
                  text: str | None = None):
    """The function (or method, unbound) ``name`` of ``relpath`` (or of ``text``), executed in ``namespace``."""
    text, _ = function_source(relpath, name, cls, text)
    ns = dict(namespace or {})
    exec(compile(_FUTURE + text, f"<vllm 0.22.1 {relpath}:{name}>", "exec"), ns)  # noqa: S102
    return ns[name]


def wrap_statement(relpath: str, name: str, cls: str | None, startswith: str, params: str, result: str,
                   namespace: dict | None = None):
    """A function ``(params) -> result`` whose body is one statement of ``name``, verbatim."""
    text, line = statement_source(relpath, name, cls, startswith)
    fname = f"_stmt_{name}_{line}"
    code = f"def {fname}({params}):\n" + textwrap.indent(text, "    ") + f"    return {result}\n"
    ns = dict(namespace or {})
    exec(compile(_FUTURE + code, f"<vllm 0.22.1 {relpath}:{line}>", "exec"), ns)  # noqa: S102
    return ns[fname]
