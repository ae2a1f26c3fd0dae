"""The step probe (dflash_lab.probe) on a small fake hybrid model: no GPU, no vLLM.

The fake model does what a verify step of vLLM 0.22.1's hybrid target does to its state: every
Gated-DeltaNet layer reads each request's recurrent state from column ``num_accepted - 1`` of its
state indices and its conv state from column 0, writes per-token states into columns
``0..q_len-1`` and the conv state back in place; every attention layer writes this step's K/V at
the slot mapping. A "replay bug" can be switched on in one layer for FULL-graph mode only.
"""

import enum
import json
import sys
import types
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from dflash_lab import probe as P

K = 3  # speculative tokens: 4 query tokens per request
H = 8  # hidden size
HV = 2  # recurrent heads


class Mode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


class Ctx:
    def __init__(self, attn_metadata, layers, slot_mapping, mode):
        self.attn_metadata = attn_metadata
        self.no_compile_layers = layers
        self.slot_mapping = slot_mapping
        self.cudagraph_runtime_mode = mode
        self.batch_descriptor = None
        self.moe_layer_index = 0


_CTX = {}


@pytest.fixture(autouse=True)
def fake_vllm(monkeypatch):
    vllm = types.ModuleType("vllm")
    config = types.ModuleType("vllm.config")
    config.CUDAGraphMode = Mode
    fc = types.ModuleType("vllm.forward_context")
    fc.get_forward_context = lambda: _CTX["ctx"]
    fc.is_forward_context_available = lambda: "ctx" in _CTX
    for name, mod in (("vllm", vllm), ("vllm.config", config), ("vllm.forward_context", fc)):
        monkeypatch.setitem(sys.modules, name, mod)
    yield
    _CTX.clear()


class Layer:
    def __init__(self, kv_cache):
        self.kv_cache = kv_cache


class GDNMeta:
    def __init__(self, idx, na, qsl, pad_rows=0):
        n = idx.shape[0]
        self.num_spec_decodes = n
        self.num_actual_tokens = int(qsl[-1])
        self.num_prefills = 0
        self.num_decodes = 0
        pad = torch.zeros((pad_rows, idx.shape[1]), dtype=torch.int32)
        self.spec_state_indices_tensor = torch.cat([idx, pad])
        self.num_accepted_tokens = torch.cat([na, torch.ones(pad_rows, dtype=torch.int32)])
        self.spec_query_start_loc = qsl


class AttnMeta:
    def __init__(self, slots, block_table, seq_lens, qsl):
        self.num_actual_tokens = len(slots)
        self.slot_mapping = slots
        self.block_table = block_table
        self.seq_lens = seq_lens
        self.query_start_loc = qsl
        self.max_seq_len = int(seq_lens.max())


class Batch:
    def __init__(self, n, block_rows):
        self.num_reqs = n
        self.req_ids = [f"req-{i}" for i in range(n)]
        bt = types.SimpleNamespace(block_table=types.SimpleNamespace(cpu=block_rows.clone(), gpu=block_rows.clone()))
        self.block_table = types.SimpleNamespace(block_tables=[bt])


class FakeModel:
    """Layers 0, 1, 2 Gated-DeltaNet-like, layer 3 attention-like."""

    def __init__(self, bug_layer=None):
        self.bug_layer = bug_layer

    def __call__(self, x):
        ctx = _CTX["ctx"]
        h = x.clone()
        for name in sorted(ctx.attn_metadata, key=P.layer_number):
            meta, layer = ctx.attn_metadata[name], ctx.no_compile_layers[name]
            if isinstance(meta, GDNMeta):
                conv, ssm = layer.kv_cache
                n = meta.num_spec_decodes
                idx, na, qsl = meta.spec_state_indices_tensor, meta.num_accepted_tokens, meta.spec_query_start_loc
                for b in range(n):
                    col = int(na[b]) - 1
                    if name == self.bug_layer and ctx.cudagraph_runtime_mode == Mode.FULL and b == 1:
                        col += 1  # the replay reads the wrong column for one request
                    s = ssm[int(idx[b, col])].clone()
                    c = conv[int(idx[b, 0])].clone()
                    for t in range(int(qsl[b + 1] - qsl[b])):
                        tok = int(qsl[b]) + t
                        s = 0.5 * s + h[tok, :HV, None]
                        ssm[int(idx[b, t])] = s
                        c = 0.5 * c + h[tok, 0]
                        h[tok] = h[tok] + s.mean()
                    conv[int(idx[b, 0])] = c
            else:
                kv = layer.kv_cache
                bs = kv.shape[2]
                for tok, slot in enumerate(meta.slot_mapping.tolist()):
                    kv[0][slot // bs, slot % bs] = h[tok, :2]
                    kv[1][slot // bs, slot % bs] = -h[tok, :2]
                h = h + kv[0].sum() * 1e-3
        return h, [h * 2.0]


def build(n=3, num_slots=40, na=(1, 2, 4), blocks=16):
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(num_slots, 5, generator=g)
    ssm = torch.randn(num_slots, HV, 3, generator=g)
    ssm[0] = float("nan")  # the null block holds garbage: nobody may read it
    layers, metas = {}, {}
    idx = (1 + torch.arange(n * (K + 1), dtype=torch.int32)).reshape(n, K + 1)
    qsl = torch.arange(0, (n + 1) * (K + 1), K + 1, dtype=torch.int32)
    gdn_meta = GDNMeta(idx, torch.tensor(na, dtype=torch.int32), qsl, pad_rows=2)
    for i in range(3):
        name = f"model.layers.{i}.linear_attn"
        layers[name] = Layer((conv.clone(), ssm.clone()))
        metas[name] = gdn_meta
    kv = torch.zeros(2, blocks, 4, 2)
    seq_lens = torch.tensor([10] * n, dtype=torch.int32)
    block_rows = torch.tensor([[3 * r + j for j in range(4)] for r in range(n)], dtype=torch.int32)
    slots = torch.tensor([int(block_rows[r, (6 + t) // 4]) * 4 + (6 + t) % 4 for r in range(n) for t in range(K + 1)])
    name = "model.layers.3.self_attn.attn"
    layers[name] = Layer(kv)
    metas[name] = AttnMeta(slots, block_rows, seq_lens, qsl)
    runner = types.SimpleNamespace(input_batch=Batch(n, block_rows),
                                   speculative_config=types.SimpleNamespace(num_speculative_tokens=K))
    x = torch.randn(n * (K + 1), H, generator=g)
    return runner, layers, metas, {name: metas[name].slot_mapping}, x


def states(layers):
    return {n: [t.clone() for t in (l.kv_cache if isinstance(l.kv_cache, tuple) else (l.kv_cache,))]
            for n, l in layers.items()}


def same(a, b):
    return all(torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(y, nan=7.0))
               for n in a for x, y in zip(a[n], b[n]))


@contextmanager
def context(layers, metas, slots, mode):
    _CTX["ctx"] = Ctx(metas, layers, slots, mode)
    try:
        yield _CTX["ctx"]
    finally:
        _CTX.pop("ctx", None)


def run_step(tmp_path, bug_layer=None, mode=Mode.FULL, **kw):
    runner, layers, metas, slots, x = build(**kw)
    # expected: the production pass alone, on a copy of the same state
    _r2, layers_alone, _m, _s, _x = build(**kw)
    model = FakeModel(bug_layer)
    with context(layers_alone, {n: metas[n] for n in metas}, slots, mode):
        expected_out = model(x)
    pr = P.StepProbe(str(tmp_path), raise_on_violation=False, reference=True)
    with context(layers, metas, slots, mode):
        out = pr.forward(runner, lambda r, *a, **k: model(*a), (x,), {})
    line = [l for l in map(__import__("json").loads, open(pr.path)) if "kind" not in l][-1]
    return line, out, expected_out, layers, layers_alone


def test_reference_pass_is_invisible_to_production_state(tmp_path):
    line, out, expected, layers, alone = run_step(tmp_path)
    assert same(states(layers), states(alone))
    assert torch.equal(out[0], expected[0])
    assert line["diverge"]["diverged"] is False and line["diverge"]["first_layer"] is None
    assert line["violations"] == []


def test_replay_bug_is_named_at_its_layer(tmp_path):
    line, out, expected, layers, alone = run_step(tmp_path, bug_layer="model.layers.1.linear_attn")
    d = line["diverge"]
    assert d["diverged"] is True
    assert d["first_layer"] == "model.layers.1.linear_attn"
    assert d["layers"]["model.layers.0.linear_attn"]["max_rel"] == 0.0
    assert d["outputs"]["hidden"]["first_rows"][0] == K + 1  # request 1's first token
    # layers before the bug keep exactly the production values of the FULL pass alone; the buggy
    # layer read a slot outside the documented read set, which the reference pass had written
    before, alone_before = states(layers), states(alone)
    assert same({"l0": before["model.layers.0.linear_attn"]}, {"l0": alone_before["model.layers.0.linear_attn"]})


def test_no_reference_pass_outside_full_graphs(tmp_path):
    line, *_ = run_step(tmp_path, bug_layer="model.layers.1.linear_attn", mode=Mode.PIECEWISE)
    assert "diverge" not in line


def test_canaries_name_step_row_field_value(tmp_path):
    runner, layers, metas, slots, x = build(na=(1, 0, 2))
    pr = P.StepProbe(None, raise_on_violation=True, reference=False)
    with context(layers, metas, slots, Mode.FULL), pytest.raises(P.CanaryError) as e:
        pr.forward(runner, lambda r, *a, **k: FakeModel()(*a), (x,), {})
    assert "step 1, gdn.num_accepted, row 1, value 0" in str(e.value)


def test_shared_state_slot_and_foreign_kv_block_are_violations():
    idx = np.array([[1, 2, 3, 4], [5, 6, 3, 8]])
    rows = {"n": 2, "idx": idx, "idx_pad": np.zeros((1, 4), int), "na": np.array([1, 2]),
            "qlen": np.array([4, 4]), "mixed": False}
    v = P.check_gdn(rows, num_slots=40, k=K, group="gdn0")
    assert [x["field"] for x in v] == ["gdn.state_index"] and "shared by rows [0, 1]" in v[0]["why"]
    rows["idx_pad"] = np.array([[9, 0, 0, 0]])
    assert any("padded row" in x.get("why", "") for x in P.check_gdn(rows, 40, K, "gdn0"))
    bt = np.array([[3, 4, 0], [5, 6, 0]])
    slots = np.array([12, 13, 20, 21, 24])  # request 1's third slot is in block 5: fine; 24 is block 6
    ok = P.check_attn_slots(slots[:4], bt, np.array([8, 8]), np.array([0, 2, 4]), 100, 4, "attn0")
    assert ok == [] or ok[0]["row"] == 1
    bad = P.check_attn_slots(np.array([12, 13, 36, 21]), bt, np.array([8, 8]), np.array([0, 2, 4]), 100, 4, "attn0")
    assert bad[0]["row"] == 1 and bad[0]["value"] == 36 and "not in the request" in bad[0]["why"]
    out = P.check_attn_slots(np.array([12, 400]), bt[:1], np.array([8]), np.array([0, 2]), 100, 4, "attn0")
    assert "outside the cache" in out[0]["why"]


def test_nonfinite_output_row_is_reported(tmp_path):
    runner, layers, metas, slots, x = build()
    x[5, 3] = float("nan")
    pr = P.StepProbe(str(tmp_path), raise_on_violation=False, reference=False)
    with context(layers, metas, slots, Mode.FULL):
        pr.forward(runner, lambda r, *a, **k: FakeModel()(*a), (x,), {})
    line = __import__("json").loads(open(pr.path).read().splitlines()[-1])
    fields = [v["field"] for v in line["violations"]]
    assert "hidden.nonfinite" in fields
    assert next(v for v in line["violations"] if v["field"] == "hidden.nonfinite")["row"] == 5


def test_accepted_count_must_follow_the_previous_sample(tmp_path):
    runner, layers, metas, slots, x = build(na=(1, 2, 4))
    pr = P.StepProbe(str(tmp_path), raise_on_violation=False, reference=False)
    pr.step = 1
    pr.after_update(runner, torch.tensor([[5, -1, -1, -1], [5, 6, 7, -1], [1, 2, 3, 4]]))
    with context(layers, metas, slots, Mode.FULL):
        pr.forward(runner, lambda r, *a, **k: FakeModel()(*a), (x,), {})
    line = __import__("json").loads(open(pr.path).read().splitlines()[-1])
    v = [x for x in line["violations"] if x["field"] == "gdn.num_accepted"]
    assert len(v) == 1 and v[0]["row"] == 1 and v[0]["value"] == 2 and "had 3 valid" in v[0]["why"]


def test_runs_without_requests_are_left_alone(tmp_path):
    runner, layers, metas, slots, x = build()
    runner.input_batch.num_reqs = 0
    pr = P.StepProbe(str(tmp_path), raise_on_violation=True, reference=True)
    with context(layers, metas, slots, Mode.FULL):
        pr.forward(runner, lambda r, *a, **k: FakeModel()(*a), (x,), {})
    assert pr.step == 0


def test_stale_graph_schedule_is_a_violation():
    class B:
        use_full_cuda_graph = True

        def __init__(self, v):
            self.scheduler_metadata = torch.tensor(v, dtype=torch.int32)

    def group(name, b):
        return types.SimpleNamespace(layer_names=[name], get_metadata_builder=lambda i: b)

    meta = types.SimpleNamespace(scheduler_metadata=torch.tensor([4, 2, 4], dtype=torch.int32))
    groups = [[group("layers.3.attn", B([4, 2, 4, 0]))], [group("layers.7.attn", B([9, 9, 9, 1]))]]
    v = P.check_graph_schedules(groups, {"layers.3.attn": meta, "layers.7.attn": meta})
    assert [(x["field"], x["group"], x["row"], x["value"], x["expected"]) for x in v] == [
        ("attn.scheduler_metadata", 1, 0, 9, 4)]
    groups[1][0].get_metadata_builder(0).scheduler_metadata[:3] = meta.scheduler_metadata
    assert P.check_graph_schedules(groups, {"layers.3.attn": meta, "layers.7.attn": meta}) == []


# ----------------------------------------------------------------------------- attention-output taps

ATTN = "model.layers.3.self_attn.attn"


class FakeImpl:
    """FlashAttention-like forward: writes ``0.5 * query`` into ``output`` request by request; with
    ``skip_in_full`` a FULL replay leaves the rows of requests >= 1 unwritten (a stale schedule's
    skipped work), as the FA3 kernel would if its per-batch schedule said so."""

    skip_in_full = False

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None):
        qsl = attn_metadata.query_start_loc
        for b in range(len(qsl) - 1):
            if self.skip_in_full and _CTX["ctx"].cudagraph_runtime_mode == Mode.FULL and b >= 1:
                continue
            output[int(qsl[b]):int(qsl[b + 1])] = query[int(qsl[b]):int(qsl[b + 1])] * 0.5
        return output


class TappedModel(FakeModel):
    """FakeModel, then its attention layer's output through a (tapped) FlashAttention-like impl.

    A FULL replay's output buffer is graph-pool memory, not the eager pass's: it starts out NaN."""

    def __init__(self, impl_cls, n_tokens, copy_in_full=True):
        super().__init__()
        self.impl = impl_cls()
        self.copy_in_full = copy_in_full  # False: the replay runs the forward without the tap's copy
        self.buf = {Mode.FULL: torch.full((n_tokens, H), float("nan")), Mode.NONE: torch.zeros(n_tokens, H),
                    Mode.PIECEWISE: torch.zeros(n_tokens, H)}

    def __call__(self, x):
        h, _ = super().__call__(x)
        ctx = _CTX["ctx"]
        meta, layer = ctx.attn_metadata[ATTN], ctx.no_compile_layers[ATTN]
        out = self.buf[ctx.cudagraph_runtime_mode]
        if self.copy_in_full or ctx.cudagraph_runtime_mode != Mode.FULL:
            self.impl.forward(layer, h, h, h, layer.kv_cache, meta, output=out)
        else:
            FakeImpl.forward(self.impl, layer, h, h, h, layer.kv_cache, meta, output=out)
        h = h + out
        return h, [h * 2.0]


def tapped_step(tmp_path, sentinel, skip, copy_in_full=True, taps=None):
    taps = taps or P.AttnTaps(fill=P.SENTINEL if sentinel else None, rows=64)

    class Impl(FakeImpl):
        skip_in_full = skip

    Impl.forward = taps.wrap(Impl.forward)
    runner, layers, metas, slots, x = build()
    layers[ATTN].layer_name = ATTN
    model = TappedModel(Impl, x.shape[0], copy_in_full)
    pr = P.StepProbe(str(tmp_path), raise_on_violation=False, reference=True, taps=taps)
    with context(layers, metas, slots, Mode.FULL):
        pr.forward(runner, lambda r, *a, **k: model(*a), (x,), {})
    return [l for l in map(__import__("json").loads, open(pr.path)) if "kind" not in l][-1]


def test_sentinel_taps_name_the_requests_a_replay_leaves_unwritten(tmp_path):
    t = tapped_step(tmp_path, sentinel=True, skip=True)["taps"][ATTN]
    assert t["unwritten_ref"] == 0
    assert t["unwritten_run"] == 2 * (K + 1) and t["req_unwritten_run"] == [1, 2] and t["partly_unwritten_run"] == 0
    assert t["req_differ"] == [1, 2] and t["nonfinite_run"] == 0  # the sentinel replaced what the rows held


def test_plain_taps_show_what_unwritten_rows_hold(tmp_path):
    line = tapped_step(tmp_path, sentinel=False, skip=True)
    t = line["taps"][ATTN]
    assert "unwritten_run" not in t
    assert t["nonfinite_ref"] == 0 and t["nonfinite_run"] == 2 * (K + 1) and t["req_nonfinite_run"] == [1, 2]
    assert line["diverge"]["outputs"]["hidden"]["nonfinite_run"] == 2 * (K + 1)


def test_taps_of_a_faithful_replay_are_identical(tmp_path):
    t = tapped_step(tmp_path, sentinel=True, skip=False)["taps"][ATTN]
    assert (t["max_abs"], t["rows_differ"], t["unwritten_run"], t["nonfinite_run"]) == (0.0, 0, 0, 0)


def test_a_layer_whose_copy_the_replay_lacks_is_not_reported_identical(tmp_path):
    # the tap buffers persist: without the poison before each pass, the replay would "show" the reference's values
    line = tapped_step(tmp_path, sentinel=True, skip=True, copy_in_full=False)
    assert ATTN not in line["taps"]


def test_taps_setting_is_checked(monkeypatch):
    monkeypatch.delenv(P.ENV_TAPS, raising=False)
    assert P.taps_from_env() is None
    monkeypatch.setenv(P.ENV_TAPS, "yes")
    with pytest.raises(ValueError, match="expected 0, 1, sentinel, nan, zero"):
        P.taps_from_env()
    monkeypatch.setenv(P.ENV_TAPS, "sentinel")
    monkeypatch.delenv(P.ENV_PROBE, raising=False)
    with pytest.raises(ValueError, match="needs DFLASH_LAB_PROBE"):
        P.taps_from_env()
    monkeypatch.setenv(P.ENV_PROBE, "/tmp/x")
    assert P.taps_from_env().fill == P.SENTINEL and P.taps_from_env().fill_layers is None
    monkeypatch.setenv(P.ENV_TAPS, "nan")
    monkeypatch.setenv(P.ENV_FILL_LAYERS, "7, 15")
    t = P.taps_from_env()
    assert t.fill != t.fill and t.fill_layers == {7, 15}
    assert t.fills("m.layers.15.self_attn.attn") and not t.fills("m.layers.3.self_attn.attn")
    monkeypatch.setenv(P.ENV_FILL_LAYERS, "7,x")
    with pytest.raises(ValueError, match="comma-separated layer numbers"):
        P.taps_from_env()
    monkeypatch.setenv(P.ENV_TAPS, "1")
    monkeypatch.setenv(P.ENV_FILL_LAYERS, "7")
    with pytest.raises(ValueError, match="needs a pre-fill"):
        P.taps_from_env()


def test_graph_schedules_record_both_sides_where_they_differ():
    def group(name, v):
        b = types.SimpleNamespace(scheduler_metadata=torch.tensor(v, dtype=torch.int32))
        return types.SimpleNamespace(layer_names=[name], get_metadata_builder=lambda i: b)

    meta = types.SimpleNamespace(scheduler_metadata=torch.tensor([4, 2, 4], dtype=torch.int32))
    groups = [[group("a", [4, 2, 4, 0])], [group("b", [9, 9, 9, 1])]]
    s = P.graph_schedules(groups, {"a": meta, "b": meta})
    assert s == {"0": {"n": 3, "same": True}, "1": {"n": 3, "same": False, "graph": [9, 9, 9], "step": [4, 2, 4]}}


def test_a_nan_prefill_counts_unwritten_rows_only_in_the_layers_it_fills(tmp_path):
    t = tapped_step(tmp_path, None, skip=True, taps=P.AttnTaps(float("nan"), {3}, rows=64))["taps"][ATTN]
    assert t["unwritten_run"] == 2 * (K + 1) and t["req_unwritten_run"] == [1, 2] and t["unwritten_ref"] == 0
    assert t["nonfinite_run"] == 2 * (K + 1)  # the NaN pre-fill is what the unwritten rows hold
    t = tapped_step(tmp_path, None, skip=True, taps=P.AttnTaps(0.0, {7}, rows=64))["taps"][ATTN]
    assert "unwritten_run" not in t  # layer 3 was not pre-filled: its rows hold what the buffer held (NaN here)
    assert t["req_nonfinite_run"] == [1, 2]


# ----------------------------------------------------------------------------- the builders' last builds

class SchedBuilder:
    """An FA3-like metadata builder: ``build`` writes the batch's schedule into its persistent buffer, zeroing the
    tail, as vLLM 0.22.1's FlashAttentionMetadataBuilder does for full CUDA graphs."""

    use_full_cuda_graph = True

    def __init__(self):
        self.scheduler_metadata = torch.zeros(13, dtype=torch.int32)

    def build(self, common_prefix_len, cm, fast_build=False):
        v = torch.tensor([16 * 8] * cm.num_reqs + [1] * cm.num_reqs, dtype=torch.int32)
        self.scheduler_metadata[: len(v)] = v
        self.scheduler_metadata[len(v):] = 0
        return types.SimpleNamespace(scheduler_metadata=self.scheduler_metadata[: len(v)])


def test_build_ledger_names_the_last_build_and_whether_the_buffer_is_still_its():
    ledger = P.BuildLedger()
    build = ledger.wrap(SchedBuilder.build)
    g6, g7 = SchedBuilder(), SchedBuilder()
    cm = lambda b: types.SimpleNamespace(num_reqs=b, num_actual_tokens=16 * b)  # noqa: E731
    for b in (4, 2, 1):            # capture, largest batch first: both groups' builders build
        build(g6, 0, cm(b))
        build(g7, 0, cm(b))
    ledger.step_began()            # step 1 (its own build came before: here none)
    build(g6, 0, cm(3))            # step 2: only group 6's builder builds; group 7 reuses its metadata
    ledger.step_began()
    assert ledger.history(g7) == [[4, 64], [2, 32], [1, 16]]
    last6, last7 = ledger.of(g6), ledger.of(g7)
    assert (last7["num_reqs"], last7["before_first_step"], last7["since_previous_step"], last7["buffer_as_left"]) == (
        1, True, False, True)
    assert (last6["num_reqs"], last6["before_first_step"], last6["since_previous_step"], last6["buffer_as_left"]) == (
        3, False, True, True)
    # a refresh that writes the buffer without build (the fix's part 1) leaves it no longer as the last build left it
    g7.scheduler_metadata[:6] = g6.scheduler_metadata[:6]
    assert ledger.of(g7)["buffer_as_left"] is False
    assert ledger.of(SchedBuilder()) is None and ledger.history(SchedBuilder()) is None


def test_graph_schedules_carry_the_last_build_with_a_ledger():
    ledger = P.BuildLedger()
    b = SchedBuilder()
    ledger.wrap(SchedBuilder.build)(b, 0, types.SimpleNamespace(num_reqs=1, num_actual_tokens=16))
    ledger.step_began()
    grp = [[types.SimpleNamespace(layer_names=["b"], get_metadata_builder=lambda i: b)]]
    meta = types.SimpleNamespace(scheduler_metadata=torch.tensor([128, 128, 1, 1], dtype=torch.int32))
    s = P.graph_schedules(grp, {"b": meta}, ledger)["0"]
    assert s["same"] is False and s["last_build"]["num_reqs"] == 1 and s["last_build"]["buffer_as_left"] is True
    assert "last_build" not in P.graph_schedules(grp, {"b": meta})["0"]


def test_a_builder_without_a_persistent_schedule_is_not_recorded():
    ledger = P.BuildLedger()

    class NoGraph(SchedBuilder):
        use_full_cuda_graph = False

    b = NoGraph()
    res = ledger.wrap(NoGraph.build)(b, 0, types.SimpleNamespace(num_reqs=2, num_actual_tokens=32))
    assert res.scheduler_metadata.tolist() == [128, 128, 1, 1] and ledger.of(b) is None and ledger.seq == 0


def test_build_ledger_takes_keyword_calls_and_skips_builds_that_wrote_nothing(monkeypatch):
    class FastBuilder(SchedBuilder):
        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            if fast_build:   # the drafter's builds: no AOT schedule, the persistent buffer left alone
                return types.SimpleNamespace(scheduler_metadata=None)
            return SchedBuilder.build(self, common_prefix_len, common_attn_metadata)

    ledger = P.BuildLedger()
    build = ledger.wrap(FastBuilder.build)
    b = FastBuilder()
    cm = types.SimpleNamespace(num_reqs=2, num_actual_tokens=32)
    build(b, common_prefix_len=0, common_attn_metadata=cm)
    build(b, common_prefix_len=0, common_attn_metadata=types.SimpleNamespace(num_reqs=5, num_actual_tokens=5),
          fast_build=True)
    assert ledger.history(b) == [[2, 32]] and ledger.seq == 1 and ledger.of(b)["num_reqs"] == 2
    # under stream capture no copy is taken (it would be captured into the graph): nothing to compare then
    monkeypatch.setattr(P, "_capturing", lambda: True)
    build(b, common_prefix_len=0, common_attn_metadata=cm)
    assert ledger.of(b)["buffer_as_left"] is None


def test_build_ledger_keeps_freed_builders_apart_and_caps_the_history(monkeypatch):
    monkeypatch.setattr(P, "MAX_BUILD_HISTORY", 3)
    ledger = P.BuildLedger()
    build = ledger.wrap(SchedBuilder.build)
    dead = SchedBuilder()
    for b in (4, 3, 2, 1):
        build(dead, 0, types.SimpleNamespace(num_reqs=b, num_actual_tokens=16 * b))
    assert ledger.history(dead) == [[4, 64], [3, 48], [2, 32]]   # capped
    del dead   # vLLM's capture-memory profiling frees its builders; CPython may hand the address to the next one
    live = SchedBuilder()
    assert ledger.history(live) is None and ledger.of(live) is None
    build(live, 0, types.SimpleNamespace(num_reqs=1, num_actual_tokens=16))
    assert ledger.history(live) == [[1, 16]]


def test_layout_and_full_steps_carry_the_ledger_end_to_end(tmp_path):
    ledger_probe = P.StepProbe(str(tmp_path), raise_on_violation=False, reference=True, taps=P.AttnTaps())
    build = ledger_probe.builds.wrap(SchedBuilder.build)
    g6, g7 = SchedBuilder(), SchedBuilder()
    for b in (2, 1):
        build(g6, 0, types.SimpleNamespace(num_reqs=b, num_actual_tokens=16 * b))
        build(g7, 0, types.SimpleNamespace(num_reqs=b, num_actual_tokens=16 * b))
    grp = lambda name, b: types.SimpleNamespace(layer_names=[name], get_metadata_builder=lambda i: b)  # noqa: E731
    runner = types.SimpleNamespace(
        attn_groups=[[grp("m.layers.3.attn", g6)], [grp("m.layers.7.attn", g7)]],
        kv_cache_config=types.SimpleNamespace(num_blocks=9, kv_cache_groups=[
            types.SimpleNamespace(kv_cache_spec=object(), layer_names=["m.layers.3.attn"]),
            types.SimpleNamespace(kv_cache_spec=object(), layer_names=["m.layers.7.attn"])]))
    ledger_probe.builds.step_began()
    ledger_probe.write_layout(runner)
    build(g6, 0, types.SimpleNamespace(num_reqs=2, num_actual_tokens=32))   # step 2: group 6 only
    ledger_probe.builds.step_began()
    meta6 = types.SimpleNamespace(scheduler_metadata=g6.scheduler_metadata[:4])
    s = P.graph_schedules(runner.attn_groups, {"m.layers.3.attn": meta6, "m.layers.7.attn": meta6},
                          ledger_probe.builds)
    layout = __import__("json").loads(open(ledger_probe.path).readline())
    assert layout["builds_before_first_step"] == {"0": [[[2, 32], [1, 16]]], "1": [[[2, 32], [1, 16]]]}
    assert s["0"]["same_as_first_group_step"] and not s["1"]["same_as_first_group_step"] and not s["1"]["same"]
    assert s["1"]["last_build"]["num_reqs"] == 1 and s["1"]["last_build"]["before_first_step"]
    assert s["0"]["last_build"]["since_previous_step"] and not s["1"]["last_build"]["since_previous_step"]
    # the fix's refresh points group 7's step metadata into its own buffer: "same" is then trivially true, and only
    # the comparison with the first group's step schedule says the buffer is fresh
    g7.scheduler_metadata[:4] = g6.scheduler_metadata[:4]
    meta7 = types.SimpleNamespace(scheduler_metadata=g7.scheduler_metadata[:4])
    s = P.graph_schedules(runner.attn_groups, {"m.layers.3.attn": meta6, "m.layers.7.attn": meta7},
                          ledger_probe.builds)
    assert s["1"]["same"] and s["1"]["same_as_first_group_step"] and s["1"]["last_build"]["buffer_as_left"] is False


def test_the_ledger_can_be_left_out_of_a_tapped_probe(tmp_path, monkeypatch):
    taps = P.AttnTaps()
    assert P.StepProbe(str(tmp_path), raise_on_violation=False, reference=True, taps=taps).builds is not None
    assert P.StepProbe(str(tmp_path), raise_on_violation=False, reference=True, taps=taps, ledger=False).builds is None
    monkeypatch.delenv(P.ENV_LEDGER, raising=False)
    assert P.ledger_from_env() is True
    monkeypatch.setenv(P.ENV_TAPS, "sentinel")
    monkeypatch.setenv(P.ENV_LEDGER, "0")
    assert P.ledger_from_env() is False
    monkeypatch.setenv(P.ENV_LEDGER, "off")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        P.ledger_from_env()
    monkeypatch.setenv(P.ENV_LEDGER, "0")
    monkeypatch.delenv(P.ENV_TAPS)
    with pytest.raises(ValueError, match="needs DFLASH_LAB_PROBE_TAPS"):
        P.ledger_from_env()


def test_out_of_vocabulary_ids_are_counted_and_replaced_in_place_only():
    t = torch.tensor([[248320, -1, -1], [5, 7, -1], [0, 248320, 248321]])
    assert P.out_of_vocab(t, 248320) == 3
    before = t.clone()
    assert P.out_of_vocab(t, 248321) == 1 and torch.equal(t, before)   # counting changes nothing
    assert P.replace_out_of_vocab(t, 248320) == 3
    assert t.tolist() == [[0, -1, -1], [5, 7, -1], [0, 0, 0]]            # placeholders and valid ids kept
    assert P.replace_out_of_vocab(t, 248320) == 0
    with pytest.raises(ValueError, match="not a valid id"):
        P.replace_out_of_vocab(t, 248320, token=248320)


def test_the_replacement_switch_reads_only_0_or_1(monkeypatch):
    monkeypatch.delenv(P.ENV_OOR, raising=False)
    assert P.oor_from_env() is None
    for v, want in (("0", None), ("1", "all"), ("row0", "row0"), ("others", "others")):
        monkeypatch.setenv(P.ENV_OOR, v)
        assert P.oor_from_env() == want
    monkeypatch.setenv(P.ENV_OOR, "yes")
    with pytest.raises(ValueError, match="expected 0, 1, row0 or others"):
        P.oor_from_env()
    with pytest.raises(ValueError, match="expected one of"):
        P.StepProbe(None, raise_on_violation=False, reference=False, oor="row1")


@pytest.mark.parametrize("oor", [None, "all", "row0", "others"])
def test_the_sample_line_says_how_many_ids_were_out_of_vocabulary(tmp_path, oor):
    """The sampler's ids as returned (oor_sampled); with the intervention they are replaced before the runner's
    state update reads them, so the valid counts and first tokens the line records are the replaced ones."""
    probe = P.StepProbe(str(tmp_path), raise_on_violation=False, reference=False, oor=oor)
    probe.step = 3
    runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(vocab_size=100, req_ids=["a", "b", "c"]))
    logits = torch.zeros(3, 100)
    logits[1] = float("nan")
    probe.after_sample(runner, logits)
    ids = torch.tensor([[101, 4, -1], [100, -1, -1], [4, -1, -1]])
    probe.after_sampler(runner, types.SimpleNamespace(sampled_token_ids=ids))
    probe.after_update(runner, ids)
    line = [json.loads(x) for x in open(probe.path)][-1]
    assert line["kind"] == "sample" and line["oor_sampled"] == 2 and line["logits_nonfinite"] == 1
    first = {None: [101, 100, 4], "all": [0, 0, 4], "row0": [0, 100, 4], "others": [101, 0, 4]}[oor]
    assert line["first_token"] == first and line["valid"] == [2, 1, 1]
    assert line.get("oor_replaced") == {None: None, "all": 2, "row0": 1, "others": 1}[oor]


def test_install_replaces_out_of_vocabulary_ids_before_the_runner_reads_them(tmp_path, monkeypatch):
    """The wiring, on a stand-in GPUModelRunner: the probe's _sample wrapper replaces the ids in the sampler's output
    before it returns, so _update_states_after_model_execute (and everything after it) sees only valid ids."""
    seen = {}

    class Runner:
        def __init__(self):
            self.input_batch = types.SimpleNamespace(vocab_size=100, req_ids=["a", "b"])

        def _model_forward(self, *a, **kw):
            return None

        def _sample(self, logits, *a, **kw):
            return types.SimpleNamespace(sampled_token_ids=torch.tensor([[100, -1], [3, 100]]))

        def _update_states_after_model_execute(self, output_token_ids, *a, **kw):
            seen["ids"] = output_token_ids.clone()

    gmr = types.ModuleType("vllm.v1.worker.gpu_model_runner")
    gmr.GPUModelRunner = Runner
    for name in ("vllm.v1", "vllm.v1.worker"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", gmr)
    monkeypatch.setattr(P, "_PROBE", {})
    monkeypatch.setenv(P.ENV_PROBE, str(tmp_path))
    monkeypatch.setenv(P.ENV_OOR, "1")
    monkeypatch.delenv(P.ENV_TAPS, raising=False)
    probe = P.install()
    assert probe.oor == "all"
    r = Runner()
    probe.step = 1
    out = r._sample(torch.zeros(2, 100))
    r._update_states_after_model_execute(out.sampled_token_ids)
    assert seen["ids"].tolist() == [[0, -1], [3, 0]]
    line = [json.loads(x) for x in open(probe.path)][-1]
    assert line["oor_sampled"] == line["oor_replaced"] == 2 and line["first_token"] == [0, 3]
