"""The serving-benchmark client (dflash_lab.servebench) against a real local HTTP server.

The server (http.server in a thread on 127.0.0.1, an ephemeral port) streams OpenAI-style SSE
chunks with controlled delays, the way vLLM 0.22.1's chat endpoint does (role chunk, content
chunks, a usage chunk with empty choices, ``data: [DONE]``), or fails in one of the ways a
crashing server fails its clients. Run as a module (``python -m test_servebench SPEC EVENTS``)
this file is also a stand-in engine worker for the runner, serving runs through the real
``worker.serve_run`` against the same server.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dflash_lab import servebench, worker
from dflash_lab.servebench import RequestResult, calculate_metrics, stream_chat, summarize_failures

# ----------------------------------------------------------------------------- the test server


def _ev(obj) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n"


def _role():
    return {"id": "x", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}


def _content(text, finish=None):
    return {"id": "x", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


def _usage(prompt, completion):
    return {"id": "x", "object": "chat.completion.chunk", "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}


class _Stream:
    """Chunked transfer encoding by hand, so a test can cut the stream anywhere."""

    def __init__(self, h: BaseHTTPRequestHandler, status=200):
        self.h = h
        h.send_response(status)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        h.wfile.flush()

    def send(self, *events):
        data = "".join(_ev(e) for e in events).encode()
        self.h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.h.wfile.flush()

    def end(self):
        self.h.wfile.write(b"0\r\n\r\n")
        self.h.wfile.flush()


# A scenario: (handler, request body, request number) -> None, chosen by the body's "model".
TTFT, GAP, NGAPS, TOK_PER_CHUNK, PROMPT_TOKENS = 0.20, 0.05, 4, 3, 17
FAST_TTFT, FAST_GAP, FAST_NGAPS = 0.05, 0.02, 3  # the "fast" scenario
NON_STREAM_S, SLOW_S = 0.05, 1.0  # "non_stream" answers after NON_STREAM_S, "slow" sends after SLOW_S

# Timing assertions. The server sleeps before it sends, so every time the client measures has a lower
# bound that a correct measurement meets however loaded the machine is (a busy machine only makes the
# client read later): those are asserted as they are, with EPS for clock rounding. A loaded machine can
# make any time arbitrarily long, so upper bounds are other measured times (the chunk stamps bound each
# other, a request lies within its wall time, a run within the call that made it), never small constants.
# That stamps are taken as chunks arrive (not after a stream is read) is checked on differences of two
# stamps, with half the server's spacing as margin.
EPS = 0.001


def ok_stream(ttft=TTFT, gap=GAP, ngaps=NGAPS, tok=TOK_PER_CHUNK, done=True):
    def run(h, body, k):
        s = _Stream(h)
        time.sleep(ttft)
        s.send(_role())  # vLLM sends the role chunk in the same engine step as the first token
        s.send(_content("a"))
        for i in range(ngaps):
            time.sleep(gap)
            s.send(_content("b", finish="length" if i == ngaps - 1 else None))
        s.send(_usage(PROMPT_TOKENS, tok * (ngaps + 1)))
        if done:
            s.send("[DONE]")
        s.end()
    return run


def http_500(h, body, k):
    data = json.dumps({"error": {"message": "EngineCore encountered an issue (boom)",
                                 "type": "InternalServerError", "param": None, "code": 500}}).encode()
    h.send_response(500)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def stream_error(h, body, k):
    s = _Stream(h)
    s.send(_role(), _content("a"))
    time.sleep(0.02)
    s.send({"error": {"message": "EngineDeadError: EngineCore encountered an issue",
                      "type": "InternalServerError", "param": None, "code": 500}})
    s.send("[DONE]")
    s.end()


def cut_at_chunk(h, body, k):  # the server process dies between two chunks: FIN, no terminal chunk
    s = _Stream(h)
    s.send(_role(), _content("a"))
    time.sleep(0.02)
    s.send(_content("b"))
    h.connection.shutdown(socket.SHUT_RDWR)
    h.close_connection = True


def cut_mid_chunk(h, body, k):  # dies half-way through writing a chunk
    s = _Stream(h)
    s.send(_role(), _content("a"))
    data = _ev(_content("b")).encode()
    h.wfile.write(b"%x\r\n%s" % (len(data), data[:9]))
    h.wfile.flush()
    h.connection.shutdown(socket.SHUT_RDWR)
    h.close_connection = True


def reset(h, body, k):  # the connection is reset (RST)
    s = _Stream(h)
    s.send(_role(), _content("a"))
    time.sleep(0.05)
    h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    h.connection.close()
    h.close_connection = True


def no_done(h, body, k):  # a well-formed chunked body that just lacks data: [DONE]
    ok_stream(ttft=0.0, gap=0.0, ngaps=1, done=False)(h, body, k)


def slow(h, body, k):  # nothing for longer than the client's read timeout
    s = _Stream(h)
    time.sleep(SLOW_S)
    try:
        s.send(_role())
        s.end()
    except OSError:
        pass


def trickle(h, body, k):  # keeps sending, forever for the client's patience
    ok_stream(ttft=0.0, gap=0.1, ngaps=8)(h, body, k)


def mixed(h, body, k):  # every second request fails with a 500
    (http_500 if k % 2 else ok_stream(ttft=0.05, gap=0.02, ngaps=3))(h, body, k)


def non_stream(h, body, k):
    time.sleep(NON_STREAM_S)
    data = json.dumps({"choices": [{"message": {"content": "hi"}}],
                       "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}).encode()
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


SCENARIOS = {"ok": ok_stream(), "http_500": http_500, "stream_error": stream_error,
             "cut_at_chunk": cut_at_chunk, "cut_mid_chunk": cut_mid_chunk, "reset": reset,
             "no_done": no_done, "slow": slow, "trickle": trickle, "mixed": mixed,
             "fast": ok_stream(ttft=FAST_TTFT, gap=FAST_GAP, ngaps=FAST_NGAPS), "non_stream": non_stream}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            k = self.server.count.get(body["model"], 0)
            self.server.count[body["model"]] = k + 1
            self.server.seen.append((self.path, dict(self.headers), body))
        SCENARIOS[body["model"]](self, body, k)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def handle_error(self, request, client_address):  # the failure scenarios break connections on purpose
        pass


def start_server():
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.lock, srv.count, srv.seen = threading.Lock(), {}, []
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


def body(model, stream=True):
    b = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": stream}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


# ----------------------------------------------------------------------------- tests

import pytest  # noqa: E402 - the module also runs as a fake worker, which needs the above only


@pytest.fixture(scope="module")
def server():
    srv, base = start_server()
    yield srv, base
    srv.shutdown()
    srv.server_close()


def check_stamps(r, ttft, gap, ngaps):
    """The chunk stamps of one completed ``ok_stream(ttft, gap, ngaps)`` request (see EPS above).

    TTFT is the role chunk's stamp; each ITL is the gap between two consecutive chunk stamps (role ->
    first content chunk, then one per later chunk); no chunk is stamped before the server sent it (the
    role and first content chunk after ``ttft`` s, the j-th later one after ``ttft + j * gap`` s); the
    stamps increase, and the last one is bounded by the E2EL, the E2EL by the request's elapsed time.
    """
    ct = r.chunk_times
    assert len(ct) == 2 + ngaps and len(r.itl) == 1 + ngaps, r
    assert ct[0] == pytest.approx(r.ttft) and r.ttft >= ttft - EPS, r
    assert r.itl == pytest.approx([b - a for a, b in zip(ct, ct[1:])]) and min(r.itl) > 0, r
    sent = [ttft, ttft] + [ttft + j * gap for j in range(1, ngaps + 1)]
    assert all(t >= s - EPS for t, s in zip(ct, sent)), (ct, sent)
    assert ct[-1] <= r.latency <= r.elapsed, r


def test_one_stream_timings_match_the_server_delays(server):
    srv, base = server
    t0 = time.perf_counter()
    r = stream_chat(base + "/v1/chat/completions", body("ok"), timeout=5)
    call = time.perf_counter() - t0
    assert r.success and r.status == 200 and r.error_kind is None and r.done, r
    path, headers, sent = srv.seen[-1]
    assert path == "/v1/chat/completions" and sent["stream_options"] == {"include_usage": True}
    # TTFT at the role chunk (>= TTFT), ITL per chunk, no stamp before its chunk was sent
    check_stamps(r, TTFT, GAP, NGAPS)
    # E2EL: up to the usage chunk, which follows the last content chunk at once; within the call
    assert TTFT + NGAPS * GAP - EPS <= r.chunk_times[-1] <= r.latency <= r.elapsed <= call, r
    # Stamps are taken as chunks arrive, not after the stream is read: the last chunk came NGAPS * GAP
    # after the role chunk, the first content chunk right with it (one engine step), so the first ITL is
    # the shortest. Margin: only a client stalled for NGAPS * GAP / 2 between two reads fails these.
    assert r.chunk_times[-1] - r.chunk_times[0] >= NGAPS * GAP / 2, r.chunk_times
    assert r.itl[0] < sum(r.itl[1:]), r.itl
    # tokens come from the usage chunk (3 per chunk, like a speculative step), not from chunk counts
    assert r.output_tokens == TOK_PER_CHUNK * (NGAPS + 1) and r.prompt_tokens == PROMPT_TOKENS
    assert r.content_chunks == NGAPS + 1 and r.finish_reason == "length"
    m = calculate_metrics([r], r.elapsed)
    tpot = (r.latency - r.ttft) / (r.output_tokens - 1)  # per token, not per chunk
    assert m["mean_tpot_ms"] == pytest.approx(tpot * 1000)
    assert m["mean_ttft_ms"] == pytest.approx(r.ttft * 1000)
    assert m["mean_e2el_ms"] == pytest.approx(r.latency * 1000)
    assert m["mean_itl_ms"] == pytest.approx(sum(r.itl) / len(r.itl) * 1000)


def _req(start, ttft, itl, latency, out, prompt=10, index=0):
    return RequestResult(index=index, status=200, success=True, start_time=start, ttft=ttft, itl=list(itl),
                         latency=latency, output_tokens=out, prompt_tokens=prompt, done=True)


def test_aggregate_metrics_against_a_hand_computation():
    failed = RequestResult(index=3, status=500, error_kind="http_error", error="HTTP 500", output_tokens=99,
                           prompt_tokens=10, ttft=0.01, latency=None)
    rs = [_req(0.0, 0.1, [0.02, 0.03], 0.15, 5, index=0), _req(0.5, 0.2, [0.04], 0.3, 3, index=1),
          _req(1.2, 0.3, [], 0.3, 1, index=2), failed]
    m = calculate_metrics(rs, 2.0)
    approx = pytest.approx
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (3, 1, 30, 9)
    assert m["duration"] == 2.0 and m["request_goodput"] is None
    assert m["request_throughput"] == approx(1.5)
    assert m["output_throughput"] == approx(4.5)
    assert m["total_token_throughput"] == approx(19.5)
    # TTFT [0.1, 0.2, 0.3] s; numpy's linear percentile: p99 = 0.2 + 0.98 * 0.1
    assert (m["mean_ttft_ms"], m["median_ttft_ms"], m["p50_ttft_ms"], m["p99_ttft_ms"]) == \
        (approx(200), approx(200), approx(200), approx(298))
    assert m["std_ttft_ms"] == approx(math.sqrt(0.02 / 3) * 1000)
    # TPOT per request: (0.15 - 0.1) / 4 and (0.3 - 0.2) / 2; one output token -> no TPOT
    assert (m["mean_tpot_ms"], m["median_tpot_ms"], m["p99_tpot_ms"]) == \
        (approx(31.25), approx(31.25), approx(12.5 + 0.99 * 37.5))
    # ITL: all requests' gaps pooled [0.02, 0.03, 0.04]
    assert (m["mean_itl_ms"], m["median_itl_ms"], m["p99_itl_ms"]) == (approx(30), approx(30), approx(39.8))
    # E2EL [0.15, 0.3, 0.3]
    assert (m["mean_e2el_ms"], m["median_e2el_ms"], m["p99_e2el_ms"]) == (approx(250), approx(300), approx(300))
    # 1 s buckets from the first start: chunks at 0.1 0.12 0.15 0.7 0.74 | 1.5; requests 2 | 1
    assert m["max_output_tokens_per_s"] == 5.0 and m["max_concurrent_requests"] == 2
    json.dumps(m)  # plain JSON types only


def test_aggregate_edge_cases():
    m = calculate_metrics([RequestResult(status=0, error_kind="other")], 1.0)
    assert m["completed"] == 0 and m["failed"] == 1 and m["output_throughput"] == 0
    assert m["mean_ttft_ms"] == 0 and m["p99_itl_ms"] == 0  # vLLM: np.mean(xs or 0)
    # no usage chunk: content chunks stand in for tokens
    r = _req(0.0, 0.1, [0.1], 0.2, None)
    r.content_chunks = 2
    m = calculate_metrics([r], 1.0, percentiles=(90,), percentile_metrics=("ttft",))
    assert m["total_output_tokens"] == 2 and "p90_ttft_ms" in m and "mean_itl_ms" not in m


def test_http_500_keeps_status_and_json_body(server):
    srv, base = server
    r = stream_chat(base + "/v1/chat/completions", body("http_500"), timeout=5)
    assert (r.success, r.status, r.error_kind) == (False, 500, "http_error")
    assert "EngineCore encountered an issue (boom)" in r.error and r.error.startswith("HTTP 500")
    assert json.loads(r.error.split(": ", 1)[1])["error"]["code"] == 500
    assert r.latency is None


def test_error_event_inside_a_200_stream(server):
    srv, base = server
    r = stream_chat(base + "/v1/chat/completions", body("stream_error"), timeout=5)
    assert (r.success, r.status, r.error_kind, r.done) == (False, 200, "stream_error_event", True)
    err = json.loads(r.error)
    assert err["message"] == "EngineDeadError: EngineCore encountered an issue" and err["code"] == 500
    assert r.content_chunks == 1 and r.ttft is not None


@pytest.mark.parametrize("scenario,kind,needle", [
    ("cut_at_chunk", "incomplete_stream", "without data: [DONE]"),
    ("cut_mid_chunk", "incomplete_stream", "IncompleteRead"),
    ("no_done", "incomplete_stream", "without data: [DONE]"),
    ("reset", "connection_reset", "ConnectionResetError"),
])
def test_streams_cut_off(server, scenario, kind, needle):
    srv, base = server
    r = stream_chat(base + "/v1/chat/completions", body(scenario), timeout=5)
    assert (r.success, r.status, r.error_kind) == (False, 200, kind), r
    assert needle in r.error and not r.done
    assert r.content_chunks >= 1  # what did arrive is kept


def test_timeouts(server):
    srv, base = server
    t0 = time.perf_counter()
    r = stream_chat(base + "/v1/chat/completions", body("slow"), timeout=0.4)
    call = time.perf_counter() - t0
    # "timeout" with nothing read: it gave up before the server's first chunk (sent after SLOW_S = 2.5 x
    # the read timeout; a read timeout applied 2.5 times too long would read it and fail otherwise)
    assert (r.success, r.status, r.error_kind) == (False, 200, "timeout") and r.chunk_times == [], r
    assert 0.4 - EPS <= r.elapsed <= call, r  # it waited the read timeout
    t0 = time.perf_counter()
    r = stream_chat(base + "/v1/chat/completions", body("trickle"), timeout=5, total_timeout=0.25)
    call = time.perf_counter() - t0
    assert r.error_kind == "timeout" and "total timeout" in r.error and not r.done
    assert 0.25 <= r.elapsed <= call, r
    # it stopped at the first line after 0.25 s: the chunks it kept came within 0.25 s, and by then the
    # server had sent at most 3 of its 9 content chunks (one at once, then one every 0.1 s)
    assert max(r.chunk_times, default=0) <= 0.25 and 1 <= r.content_chunks <= 3, r


def test_refused_connection_is_other():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    r = stream_chat(f"http://127.0.0.1:{port}/v1/chat/completions", body("ok"), timeout=2)
    assert (r.success, r.status, r.error_kind) == (False, None, "other") and "ConnectionRefusedError" in r.error


def test_non_streamed_request(server):
    srv, base = server
    t0 = time.perf_counter()
    r = stream_chat(base + "/v1/chat/completions", body("non_stream", stream=False), timeout=5)
    call = time.perf_counter() - t0
    assert r.success and r.output_tokens == 7 and r.ttft is None
    assert NON_STREAM_S - EPS <= r.latency <= r.elapsed <= call, r
    m = calculate_metrics([r], 1.0)
    assert m["completed"] == 1 and m["total_output_tokens"] == 7 and m["mean_ttft_ms"] == 0
    assert m["mean_e2el_ms"] == pytest.approx(r.latency * 1000)


def test_failure_summary_and_long_bodies_are_truncated():
    rs = [RequestResult(index=0, status=500, error_kind="http_error", error="first 500"),
          RequestResult(index=1, status=500, error_kind="http_error", error="second 500"),
          RequestResult(index=2, status=200, error_kind="stream_error_event", error="dead", elapsed=1.23456),
          RequestResult(index=3, status=None, error_kind="other", error="refused"),
          _req(0, 0.1, [], 0.1, 1, index=4)]
    s = summarize_failures(rs)
    assert s["failed"] == 4
    assert s["by_kind"] == {"http_error": 2, "stream_error_event": 1, "other": 1}
    assert s["by_status"] == {"500": 2, "200": 1, "no_response": 1}
    assert s["first_error"]["http_error"]["error"] == "first 500" and s["first_error"]["http_error"]["index"] == 0
    assert s["first_error"]["stream_error_event"]["elapsed_s"] == 1.235
    r = RequestResult()
    r.fail("http_error", "x" * 5000)
    r.fail("timeout", "later")  # the first failure stands
    assert r.error_kind == "http_error" and len(r.error) < 2100 and r.error.endswith("[3000 more chars]")


def test_concurrent_run_measures_duration_and_every_request(server):
    srv, base = server
    t0 = time.perf_counter()
    rs, dur = servebench.run_requests(base + "/v1/chat/completions", body("fast"), 6, 3, timeout=5)
    call = time.perf_counter() - t0
    assert [r.index for r in rs] == list(range(6)) and all(r.success for r in rs)
    for r in rs:
        check_stamps(r, FAST_TTFT, FAST_GAP, FAST_NGAPS)
    # at most 3 requests in flight at any time, and they did run side by side
    edges = sorted([(r.start_time, 1) for r in rs] + [(r.start_time + r.elapsed, -1) for r in rs])
    peak = max(sum(d for _, d in edges[:i + 1]) for i in range(len(edges)))
    assert 2 <= peak <= 3, peak
    # duration: from before the first request is sent to after the last returned, within the call; at
    # least two waves of 3 requests, each at least FAST_TTFT + FAST_NGAPS * FAST_GAP long
    span = max(r.start_time + r.elapsed for r in rs) - min(r.start_time for r in rs)
    assert span <= dur <= call and dur >= 2 * (FAST_TTFT + FAST_NGAPS * FAST_GAP) - EPS, (span, dur, call)
    m = calculate_metrics(rs, dur)
    assert m["completed"] == 6 and m["total_output_tokens"] == 6 * 12 and m["max_concurrent_requests"] >= 3
    assert m["output_throughput"] == pytest.approx(72 / dur)
    # TTFT at least the server's FAST_TTFT, below the E2EL (request by request, so the medians too),
    # which is at least the server's whole stream and at most the run's duration
    assert 1000 * (FAST_TTFT - EPS) <= m["median_ttft_ms"] < m["median_e2el_ms"] <= 1000 * dur, m
    assert m["median_e2el_ms"] >= 1000 * (FAST_TTFT + FAST_NGAPS * FAST_GAP - EPS), m
    # ITL: all requests' chunk gaps pooled; with stamps taken as chunks arrive they add up, per request,
    # to about the server's FAST_NGAPS * FAST_GAP (margin: half of it, lost only to a client that stalls
    # that long at the start of most streams); each is at most its request's E2EL - TTFT
    itls = [g for r in rs for g in r.itl]
    assert m["mean_itl_ms"] == pytest.approx(1000 * sum(itls) / len(itls))
    assert m["mean_itl_ms"] >= 1000 * FAST_NGAPS * FAST_GAP / (FAST_NGAPS + 1) / 2, m
    assert 0 < m["p50_itl_ms"] <= 1000 * max(r.latency - r.ttft for r in rs), m


def _run(concurrency=4):
    return {"id": f"e/c{concurrency}/r0", "concurrency": concurrency, "max_tokens": 16, "temperature": 0.0,
            "stream": True, "ignore_eos": True}


LEGACY = ("outcome", "requests_completed", "requests_failed", "http_statuses", "output_tokens", "wall_s",
          "output_tok_s", "request_throughput", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
          "spec_decode_metrics", "hook", "server_alive")
ZERO = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": None}


def test_worker_run_with_failed_requests_on_a_live_server_is_a_crash(server):
    srv, base = server
    f = worker.serve_run(base, "mixed", "hi", _run(), lambda: True, lambda: dict(ZERO))
    for k in LEGACY + ("serve_metrics", "request_errors"):
        assert k in f, k
    assert (f["outcome"], f["requests_completed"], f["requests_failed"], f["server_alive"]) == ("crash", 2, 2, True)
    assert sorted(f["http_statuses"]) == [200, 200, 500, 500]
    assert f["request_errors"]["by_kind"] == {"http_error": 2} and f["request_errors"]["by_status"] == {"500": 2}
    assert "boom" in f["request_errors"]["first_error"]["http_error"]["error"]
    sm = f["serve_metrics"]
    assert sm["completed"] == 2 and sm["failed"] == 2 and sm["total_output_tokens"] == f["output_tokens"] == 24
    json.dumps(f)


def test_worker_run_ok_and_dead_server(server):
    srv, base = server
    f = worker.serve_run(base, "fast", "hi", _run(3), lambda: True, lambda: dict(ZERO))
    assert f["outcome"] == "ok" and f["requests_failed"] == 0 and f["request_errors"]["failed"] == 0
    sm = f["serve_metrics"]
    assert sm["completed"] == 3 and sm["output_throughput"] == pytest.approx(f["output_tokens"] / sm["duration"])
    assert f["ttft_p50_s"] == pytest.approx(sm["median_ttft_ms"] / 1000)
    # at least the server's FAST_TTFT; below the E2EL, which lies within the run's duration
    assert FAST_TTFT - EPS <= f["ttft_p50_s"] < sm["median_e2el_ms"] / 1000 <= sm["duration"], (f, sm)
    assert f["wall_s"] == round(sm["duration"], 3)
    _, _, sent = srv.seen[-1]
    assert sent["stream_options"] == {"include_usage": True} and sent["model"] == "fast"
    f = worker.serve_run(base, "fast", "hi", _run(1), lambda: False, lambda: dict(ZERO))
    assert f["outcome"] == "crash" and f["server_alive"] is False and f["requests_failed"] == 0


def test_runner_copies_serve_metrics_and_request_errors_into_result_lines(tmp_path):
    import yaml

    from conftest import run_cli
    from dflash_lab.runner import read_lines

    m = {"name": "t", "worker": "test_servebench", "run_timeout_s": 20, "startup_timeout_s": 20,
         "defaults": {"target": "tiny-dense", "mode": "server"},
         "engines": [{"id": "e1", "runs": [{"concurrency": 2, "rounds": 2, "max_tokens": 16}]}]}
    p = tmp_path / "m.yaml"
    p.write_text(yaml.safe_dump(m))
    out = tmp_path / "runs.jsonl"
    r = run_cli("dflash_lab", "run", str(p), "--out", str(out), timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    lines = read_lines(out)
    assert [(l["run_id"], l["outcome"]) for l in lines] == [("e1/c2/r0", "ok"), ("e1/c2/r1", "crash")]
    ok, crash = lines
    assert ok["serve_metrics"]["completed"] == 2 and ok["serve_metrics"]["total_output_tokens"] == 24
    assert ok["request_errors"] == {"failed": 0, "by_kind": {}, "by_status": {}, "first_error": {}}
    assert crash["serve_metrics"]["completed"] == 1 and crash["request_errors"]["by_kind"] == {"http_error": 1}
    assert crash["requests_failed"] == 1 and crash["server_alive"] is True


# ----------------------------------------------------------------------------- as a fake engine worker

def _fake_worker(spec_path, events_path):
    spec = json.load(open(spec_path))
    ev = worker.Events(events_path)
    srv, base = start_server()
    ev.emit(event="ready", startup_s=0.0)
    for run in spec["runs"]:  # round 0 healthy, later rounds: half the requests get a 500
        ev.emit(event="run_start", run=run["id"])
        model = "fast" if run["round"] == 0 else "mixed"
        f = worker.serve_run(base, model, spec["prompt"], run, lambda: True, lambda: dict(ZERO))
        ev.emit(event="run_end", run=run["id"], **f)
        if f["outcome"] != "ok":
            time.sleep(60)  # like the real worker: the runner reads the crash, then kills us
    sys.stdout.flush()
    import os

    os._exit(0)


if __name__ == "__main__":
    _fake_worker(sys.argv[1], sys.argv[2])
