"""The bounds instrumenter on small kernels of our own (it must be generic)."""

import pytest
import torch

from dflash_lab.errors import LabError
from dflash_lab.instrument import instrument, tensor_extent
from dflash_lab.kernels import extract_kernel

GATHER = '''
import triton
import triton.language as tl

@triton.jit
def gather(x_ptr, idx_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    i = tl.load(idx_ptr + offs, mask=m, other=0)
    row = x_ptr + 0
    v = tl.load(row + i, mask=m)
    tl.store(out_ptr + offs, v, mask=m)
'''

SCALAR = '''
import triton
import triton.language as tl

SHIFT = 1

@triton.jit
def last(x_ptr, starts_ptr, out_ptr):
    r = tl.program_id(0)
    s = tl.load(starts_ptr + r)
    p = x_ptr
    p += s
    tl.store(out_ptr + r, tl.load(p - SHIFT))
'''


def run_gather(idx, n=None):
    ins = instrument(extract_kernel(GATHER, "gather"), ["x_ptr", "idx_ptr", "out_ptr"])
    x = torch.arange(10, dtype=torch.float32)
    idx = torch.tensor(idx)
    out = torch.zeros(len(idx))
    return ins, ins.run((2,), dict(x_ptr=x, idx_ptr=idx, out_ptr=out, n=len(idx) if n is None else n, BLOCK=4))


def test_in_bounds_gather_is_clean_and_unchanged():
    ins, (viol, over) = run_gather([0, 3, 9, 2, 5, 1])
    assert viol == [] and not over
    assert "_bc_ext_x_ptr" in ins.source.text and "_bc_ext_x_ptr" not in ins.original.text


def test_out_of_bounds_lanes_are_reported_with_param_offset_extent_program():
    _, (viol, _) = run_gather([0, 3, 9, 10, -1, 2])
    got = sorted((v.param, v.op, v.program_id[0], v.offset_min, v.offset_max, v.extent, v.lanes) for v in viol)
    assert got == [("x_ptr", "load", 0, 10, 10, 10, 1), ("x_ptr", "load", 1, -1, -1, 10, 1)]


def test_masked_lanes_are_not_reported():
    # n=3 masks the lanes holding the bad indices
    _, (viol, _) = run_gather([0, 3, 9, 10, -1, 2], n=3)
    assert viol == []


def test_scalar_loads_aliases_and_module_constants():
    ks = extract_kernel(SCALAR, "last")
    assert ks.constants == {"SHIFT": 1}
    ins = instrument(ks, ["x_ptr", "starts_ptr", "out_ptr"])
    x = torch.arange(5, dtype=torch.int64) * 10
    starts = torch.tensor([3, 0, 5], dtype=torch.int64)
    out = torch.zeros(3, dtype=torch.int64)
    viol, _ = ins.run((3,), dict(x_ptr=x, starts_ptr=starts, out_ptr=out))
    assert [(v.param, v.program_id[0], v.offset_min) for v in viol] == [("x_ptr", 1, -1)]
    assert out[0] == 20 and out[2] == 40


def test_pointer_that_cannot_be_attributed_is_refused():
    src = GATHER.replace("v = tl.load(row + i, mask=m)", "v = tl.load(tl.load(idx_ptr) + i, mask=m)")
    with pytest.raises(LabError, match="cannot tell which pointer parameter"):
        instrument(extract_kernel(src, "gather"), ["x_ptr", "idx_ptr", "out_ptr"])


def test_unknown_pointer_param_is_refused():
    with pytest.raises(LabError, match="has no parameters"):
        instrument(extract_kernel(GATHER, "gather"), ["y_ptr"])


def test_tensor_extent_of_views():
    t = torch.zeros(3, 10)
    assert tensor_extent(t) == 30
    assert tensor_extent(t[0]) == 10
    assert tensor_extent(t[:, :4]) == 24
