"""The capture-size mirror against values recorded inside real vLLM 0.22.1 engines (H200)."""

import pytest

from dflash_lab import analysis, capture
from dflash_lab.errors import LabError


def test_mirror_matches_every_recorded_engine():
    dumps = [d for d in analysis.engine_dumps() if "cudagraph_capture_sizes" in d]
    modes = {d["cudagraph_mode"] for d in dumps}
    assert {"FULL_AND_PIECEWISE", "PIECEWISE", "NONE"} <= modes, modes
    for d in dumps:
        kn = capture.Knobs(max_num_seqs=64, num_speculative_tokens=d["num_speculative_tokens"],
                           max_num_batched_tokens=d["max_num_tokens"], cudagraph_mode=d["cudagraph_mode"])
        sizes, largest = capture.engine_capture_sizes(kn)
        assert sizes == d["cudagraph_capture_sizes"], d["file"]
        assert largest == d["max_cudagraph_capture_size"]
        assert kn.max_query_tokens == d["max_query_tokens"]


def test_report_config_never_pads_and_runs_big_batches_eagerly():
    s = capture.summary(capture.Knobs())
    assert s["capture_sizes"] == list(range(16, 513, 16))
    assert s["batches_graph"] == list(range(1, 33)) and s["batches_eager"] == list(range(33, 65))
    assert s["batches_padded"] == [] and s["batches_over_buffer"] == []


def test_padded_graph_longer_than_query_buffers():
    # 33 seqs, k=3: 132 query tokens replay the 136-token graph, buffers hold 132
    rows = capture.drafter_table(capture.Knobs(max_num_seqs=33, num_speculative_tokens=3))
    r = rows[-1]
    assert (r.batch, r.query_tokens, r.graph_size, r.mode, r.over_buffer) == (33, 132, 136, "padded", 4)


def test_piecewise_keeps_unrounded_sizes():
    sizes, largest = capture.engine_capture_sizes(capture.Knobs(cudagraph_mode="PIECEWISE"))
    assert sizes[:5] == [1, 2, 4, 8, 16] and largest == 512 and len(sizes) == 51


@pytest.mark.parametrize("kw,msg", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
    (dict(cudagraph_mode="FULLISH"), "cudagraph_mode"),
    (dict(cudagraph_capture_sizes=[]), "cudagraph_capture_sizes"),
    # true is an int in Python: a capture bound of True passed as 1 before
    (dict(max_cudagraph_capture_size=True), "max_cudagraph_capture_size must be a positive integer"),
    (dict(max_num_seqs=True), "max_num_seqs must be a positive integer"),
])
def test_bad_knobs(kw, msg):
    with pytest.raises(LabError, match=msg):
        capture.Knobs(**kw)
