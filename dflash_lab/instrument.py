"""A generic bounds instrumenter for Triton kernels.

``instrument(kernel_source, pointer_params)`` rewrites a ``@triton.jit`` function so that
before every ``tl.load`` / ``tl.store`` / ``tl.atomic_*`` it computes, for every active
(unmasked) lane, the element offset from the pointer parameter that the access is based
on, and compares it with that parameter's extent (passed in as an extra scalar argument).
Each access site that goes out of bounds in a program instance appends one row to a
violations buffer: site, program id, number of bad lanes, lowest and highest bad offset,
extent. The access itself is left exactly as it was, so the kernel computes what the
original computes (including what an out-of-bounds read returns).

Why a buffer and not ``tl.device_assert``: under the Triton interpreter (3.6 and 3.8)
``device_assert`` never fires, and on a GPU a firing assert kills the CUDA context. The
buffer works in both places. ``assert_mode=True`` adds a ``tl.device_assert`` per site as
well, for runs under ``TRITON_DEBUG=1`` on a GPU.

Nothing here knows about any particular kernel. The base pointer of an access is found by
splitting its pointer expression into additive terms: exactly one term must be a pointer
parameter (or a local name assigned from one); the other terms are the offset. Pointer
expressions that cannot be split this way (block pointers, pointers loaded from memory)
are refused with a clear error rather than silently left unchecked.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass, field

from .errors import LabError
from .kernels import KernelSource, load

_ACCESS = {"load", "store", "atomic_add", "atomic_max", "atomic_min", "atomic_and",
           "atomic_or", "atomic_xor", "atomic_xchg", "atomic_cas"}
# position of the ``mask`` argument when passed positionally
_MASK_POS = {"load": 1, "store": 2}
_ROW = 8  # int64 words per violation row
_BIG = 1 << 62


@dataclass(frozen=True)
class Site:
    id: int
    op: str
    param: str
    line: int  # line in the kernel's origin file
    text: str


@dataclass(frozen=True)
class Violation:
    param: str
    op: str
    site: int
    line: int
    program_id: tuple
    lanes: int
    offset_min: int
    offset_max: int
    extent: int

    def as_dict(self) -> dict:
        return {
            "param": self.param, "op": self.op, "site": self.site, "line": self.line,
            "program_id": list(self.program_id), "lanes": self.lanes,
            "offset": self.offset_min, "offset_max": self.offset_max, "extent": self.extent,
        }


def _is_tl_call(node: ast.AST) -> str | None:
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "tl"
            and node.func.attr in _ACCESS):
        return node.func.attr
    return None


def _add(a: ast.expr | None, b: ast.expr, op: ast.operator | None = None) -> ast.expr:
    op = op or ast.Add()
    if a is None:
        return b if isinstance(op, ast.Add) else ast.UnaryOp(ast.USub(), b)
    return ast.BinOp(a, op, b)


def _expressions_of(stmt: ast.stmt):
    """The expressions a statement evaluates itself (not those of nested statements)."""
    if isinstance(stmt, (ast.If, ast.While)):
        return [stmt.test]
    if isinstance(stmt, ast.For):
        return [stmt.iter]
    if isinstance(stmt, ast.With):
        return [i.context_expr for i in stmt.items]
    if isinstance(stmt, (ast.FunctionDef, ast.ClassDef)):
        raise LabError("nested functions or classes in a kernel are not supported")
    return [stmt]


def _walk_expr(node: ast.AST):
    """ast.walk that does not enter nested statements."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        for c in ast.iter_child_nodes(n):
            if not isinstance(c, ast.stmt):
                stack.append(c)


class _Rewriter:
    def __init__(self, pointer_params: list[str], assert_mode: bool, first_line: int,
                 contain: int | None = None):
        self.first_line = first_line
        self.contain = contain
        self.pointers = set(pointer_params)
        self.aliases: dict[str, tuple[str, ast.expr | None]] = {}
        self.sites: list[Site] = []
        self.assert_mode = assert_mode
        self.n_alias = 0

    def decompose(self, e: ast.expr):
        """(base pointer parameter, offset expression or None) or None."""
        if isinstance(e, ast.Name):
            if e.id in self.aliases:
                return self.aliases[e.id]
            if e.id in self.pointers:
                return e.id, None
            return None
        if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)):
            left = self.decompose(e.left)
            if left is not None:
                return left[0], _add(left[1], e.right, e.op)
            if isinstance(e.op, ast.Add):
                right = self.decompose(e.right)
                if right is not None:
                    return right[0], _add(right[1], e.left)
        return None

    def _check(self, site: Site, off: ast.expr | None, mask: ast.expr | None) -> list[ast.stmt]:
        off_src = ast.unparse(off) if off is not None else "0"
        mask_src = f" & ({ast.unparse(mask)})" if mask is not None else ""
        src = f"""
_bc_off = tl.zeros([1], dtype=tl.int64) + ({off_src})
_bc_bad = ((_bc_off == _bc_off){mask_src}) & ((_bc_off < 0) | (_bc_off >= _bc_ext_{site.param}))
_bc_n = tl.sum(_bc_bad.to(tl.int32))
if _bc_n > 0:
    _bc_lo = tl.min(tl.where(_bc_bad, _bc_off, {_BIG}))
    _bc_hi = tl.max(tl.where(_bc_bad, _bc_off, -{_BIG}))
    _bc_row = tl.atomic_add(_bc_count_ptr, 1)
    if _bc_row < _bc_capacity:
        _bc_at = _bc_viol_ptr + _bc_row.to(tl.int64) * {_ROW}
        tl.store(_bc_at + 0, {site.id})
        tl.store(_bc_at + 1, tl.program_id(0))
        tl.store(_bc_at + 2, tl.program_id(1))
        tl.store(_bc_at + 3, tl.program_id(2))
        tl.store(_bc_at + 4, _bc_n)
        tl.store(_bc_at + 5, _bc_lo)
        tl.store(_bc_at + 6, _bc_hi)
        tl.store(_bc_at + 7, _bc_ext_{site.param})
"""
        if self.assert_mode:
            src += f'tl.device_assert(_bc_n == 0, "out-of-bounds {site.op} of {site.param} (site {site.id})")\n'
        return ast.parse(src).body

    def _contain(self, node: ast.Call, site: Site, off, mask, pos: int) -> list[ast.stmt]:
        """Mask lanes that would land farther than ``contain`` elements outside the extent.

        Lanes within the guard zone still access memory (a replay surrounds buffers with
        guard cells, so a near out-of-bounds read returns a visible sentinel); lanes beyond it
        are reported like the others but not performed, so a wild offset cannot crash the
        replaying process. The safe mask has the offset's own shape (scalar or block).
        """
        off_src = ast.unparse(off) if off is not None else "0"
        name = f"_bc_safe{site.id}"
        stmt = ast.parse(f"{name} = ((({off_src}) >= -{self.contain}) & "
                         f"(({off_src}) < _bc_ext_{site.param} + {self.contain}))").body[0]
        safe = ast.Name(name, ast.Load())
        new_mask = safe if mask is None else ast.BinOp(mask, ast.BitAnd(), safe)
        if any(k.arg == "mask" for k in node.keywords):
            for k in node.keywords:
                if k.arg == "mask":
                    k.value = new_mask
        elif len(node.args) > pos:
            node.args[pos] = new_mask
        else:
            node.keywords.append(ast.keyword(arg="mask", value=new_mask))
        return [stmt]

    def _track_alias(self, stmt: ast.stmt) -> list[ast.stmt]:
        """Follow local names assigned from pointer expressions; returns statements to add after."""
        after: list[ast.stmt] = []
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            d = self.decompose(stmt.value)
            self.aliases.pop(name, None)
            if d is not None:
                base, off = d
                if off is not None:
                    # freeze the offset now: the names in it may be reassigned later
                    self.n_alias += 1
                    tmp = f"_bc_alias{self.n_alias}_{name}"
                    after.append(ast.parse(f"{tmp} = {ast.unparse(off)}").body[0])
                    off = ast.Name(tmp, ast.Load())
                self.aliases[name] = (base, off)
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
            name = stmt.target.id
            if name in self.aliases or name in self.pointers:
                if not isinstance(stmt.op, (ast.Add, ast.Sub)):
                    raise LabError(f"pointer {name} updated with an operator other than += / -=")
                base, off = self.decompose(ast.Name(name, ast.Load()))
                self.n_alias += 1
                tmp = f"_bc_alias{self.n_alias}_{name}"
                after.append(ast.parse(f"{tmp} = {ast.unparse(_add(off, stmt.value, stmt.op))}").body[0])
                self.aliases[name] = (base, ast.Name(tmp, ast.Load()))
        return after

    def rewrite_block(self, body: list[ast.stmt], line0: int) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for stmt in body:
            checks: list[ast.stmt] = []
            for expr in _expressions_of(stmt):
                for node in _walk_expr(expr):
                    op = _is_tl_call(node)
                    if op is None:
                        continue
                    ptr = node.args[0] if node.args else next(
                        (k.value for k in node.keywords if k.arg == "pointer"), None)
                    if ptr is None:
                        raise LabError(f"line {node.lineno - line0 + 1}: tl.{op} without a pointer argument")
                    d = self.decompose(ptr)
                    if d is None:
                        raise LabError(
                            f"line {node.lineno - line0 + 1}: cannot tell which pointer parameter "
                            f"`{ast.unparse(ptr)}` addresses (pointer parameters: {sorted(self.pointers)})")
                    mask = next((k.value for k in node.keywords if k.arg == "mask"), None)
                    pos = _MASK_POS.get(op, 2)
                    if mask is None and len(node.args) > pos:
                        mask = node.args[pos]
                    site = Site(id=len(self.sites), op=op, param=d[0],
                                line=node.lineno - line0 + self.first_line, text=ast.unparse(node))
                    self.sites.append(site)
                    checks += self._check(site, d[1], mask)
                    if self.contain is not None:
                        checks += self._contain(node, site, d[1], mask, pos)
            out += checks
            if isinstance(stmt, (ast.If, ast.For, ast.While, ast.With)):
                saved = dict(self.aliases)
                stmt.body = self.rewrite_block(stmt.body, line0)
                if getattr(stmt, "orelse", None):
                    self.aliases = dict(saved)
                    stmt.orelse = self.rewrite_block(stmt.orelse, line0)
                self.aliases = saved  # names aliased only inside a branch are not tracked after it
            out.append(stmt)
            out += self._track_alias(stmt)
        return out


@dataclass
class Instrumented:
    """An instrumented kernel: ``run`` launches it and returns the violations found."""

    original: KernelSource
    source: KernelSource
    sites: list[Site]
    pointer_params: list[str]
    assert_mode: bool = False
    contain: int | None = None
    _fn: object = field(default=None, repr=False)

    @property
    def fn(self):
        if self._fn is None:
            self._fn = load(self.source, tag=f"bc_{self.original.name}")
        return self._fn

    def run(self, grid, args: dict, extents: dict | None = None, capacity: int = 4096):
        """Launch on ``args`` (the original kernel's arguments by name).

        ``extents`` overrides, per pointer parameter, the number of addressable elements
        (default: the span of the tensor passed). Returns (violations, overflowed).
        """
        import torch

        extents = dict(extents or {})
        device = None
        call = dict(args)
        for p in self.pointer_params:
            v = args.get(p)
            if isinstance(v, torch.Tensor):
                device = v.device
                if p not in extents:
                    extents[p] = tensor_extent(v)
            elif p not in extents:
                extents[p] = 0  # a null pointer (e.g. an optional input passed as 0)
            call[f"_bc_ext_{p}"] = int(extents[p])
        if device is None:
            raise LabError("no tensor among the pointer arguments")
        viol = torch.full((capacity * _ROW,), -1, dtype=torch.int64, device=device)
        count = torch.zeros(1, dtype=torch.int32, device=device)
        call.update(_bc_viol_ptr=viol, _bc_count_ptr=count, _bc_capacity=capacity)
        self.fn[tuple(grid)](**call)
        n = int(count.item())
        rows = viol[: min(n, capacity) * _ROW].view(-1, _ROW).cpu().tolist()
        out = []
        for r in rows:
            s = self.sites[r[0]]
            out.append(Violation(param=s.param, op=s.op, site=s.id, line=s.line,
                                 program_id=(r[1], r[2], r[3]), lanes=r[4],
                                 offset_min=r[5], offset_max=r[6], extent=r[7]))
        out.sort(key=lambda v: (v.program_id, v.site))
        return out, n > capacity


def tensor_extent(t) -> int:
    """Elements addressable from ``t.data_ptr()`` through its sizes and strides."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if st > 0)


def instrument(ks: KernelSource, pointer_params: list[str], assert_mode: bool = False,
               contain: int | None = None) -> Instrumented:
    """Return the bounds-checked version of kernel ``ks``.

    ``pointer_params``: names of the parameters that are tensors (pointers) at launch.
    ``contain``: if set, accesses more than this many elements outside a tensor are reported
    but not performed (see ``_Rewriter._contain``); None leaves every access as it was.
    """
    mod = ast.parse(ks.text)
    fn = copy.deepcopy(next(n for n in mod.body if isinstance(n, ast.FunctionDef) and n.name == ks.name))
    params = [a.arg for a in fn.args.args]
    unknown = set(pointer_params) - set(params)
    if unknown:
        raise LabError(f"{ks.name} has no parameters {sorted(unknown)}")
    line0 = min([d.lineno for d in fn.decorator_list] or [fn.lineno])
    rw = _Rewriter(list(pointer_params), assert_mode, ks.first_line, contain)
    fn.body = rw.rewrite_block(fn.body, line0)
    extra = ["_bc_viol_ptr", "_bc_count_ptr", "_bc_capacity"] + [f"_bc_ext_{p}" for p in pointer_params]
    at = len(fn.args.args) - len(fn.args.defaults)
    fn.args.args[at:at] = [ast.arg(arg=a) for a in extra]
    text = ast.unparse(ast.fix_missing_locations(fn)) + "\n"
    new = KernelSource(name=ks.name, text=text, constants=ks.constants,
                       origin=f"{ks.origin} (bounds-instrumented)", first_line=ks.first_line)
    return Instrumented(original=ks, source=new, sites=rw.sites, pointer_params=list(pointer_params),
                        assert_mode=assert_mode, contain=contain)
