"""Streaming serving-benchmark client whose metrics match ``vllm bench serve`` (vLLM 0.22.1).

Used by the server mode of :mod:`dflash_lab.worker`. Standard library only (``http.client``
and threads); numpy for the statistics, as vLLM uses it.

- :func:`stream_chat` sends one ``/v1/chat/completions`` request and reads its stream,
  recording the status, the arrival time of every SSE chunk, TTFT, ITL, end-to-end latency,
  token counts from the final ``usage`` chunk, and, when the request fails, *how* it failed
  (``error_kind``) with the server's own words (error body or in-stream error message).
- :func:`run_requests` fires a run's requests from threads and measures its duration.
- :func:`calculate_metrics` aggregates one run into the result dict of ``vllm bench serve``,
  under its names.
- :func:`summarize_failures` counts failures per ``error_kind`` and per HTTP status and keeps
  the first error text of each kind.

What was matched, in vLLM 0.22.1:

- per request: ``vllm/benchmarks/lib/endpoint_request_func.py``,
  ``async_request_openai_chat_completions`` (TTFT, ITL and latency are taken the same way
  from the same chunks, see :func:`stream_chat`);
- aggregate: ``vllm/benchmarks/serve.py``, ``calculate_metrics`` (per-request TPOT, the pooled
  ITL list, mean/median/std/percentiles with numpy, throughputs over the run's duration, the
  peak tokens/s and peak concurrency buckets), and the result dict built in
  ``vllm/benchmarks/serve.py``, ``benchmark`` (its key names, ``p{N}_{metric}_ms`` keys, and
  ``duration`` = wall time from before the first request is sent until all have returned).

Where we differ, and why:

- **What counts as completed.** vLLM bench marks a request successful when the response
  status is 200 and reading the stream raised nothing. It silently skips a ``data:`` chunk
  carrying ``{"error": ...}`` (vLLM's server sends one, then ``[DONE]``, when generation fails
  after the 200 was sent) and accepts a stream that ends without ``data: [DONE]``. For crash
  runs that would hide exactly what we look for, so here a request is completed only if it
  got a 200, read to the end without an exception, carried no in-stream error, and ended with
  ``[DONE]``. For requests that pass this stricter test the per-request numbers are computed
  identically, so on a healthy server the two agree.
- **Output token count.** vLLM bench uses ``usage.completion_tokens`` of the final usage
  chunk and, only if that is missing or 0, re-tokenizes the generated text (or counts 1 without
  a tokenizer). We request ``stream_options.include_usage`` and use ``completion_tokens`` the
  same way; without a tokenizer, our fallback is the number of chunks that carried content (a
  lower bound: with speculative decoding one chunk carries several tokens).
- **ITL is per chunk, not per token** - in vLLM bench and here alike: the server sends one SSE
  chunk per engine step, which under speculative decoding holds all the tokens accepted in that
  step. ``itl`` is the gap between consecutive chunks that carry ``choices`` (including vLLM's
  first chunk, the role chunk with empty content, which is where TTFT is taken; it is sent in
  the same engine step as the first token, so the first ITL of a request is near 0, in vLLM
  bench too). TPOT, in contrast, divides by tokens. ``max_output_tokens_per_s`` likewise counts
  chunks as tokens, as vLLM's code does.
- **Non-streamed requests** (``stream: false``): vLLM's chat client always streams. Here they
  contribute to E2EL, completion and throughputs, but have no TTFT/TPOT/ITL (vLLM's
  ``calculate_metrics`` would count a TTFT of 0.0 for them).
- **Client machinery.** vLLM bench uses one aiohttp event loop and reuses connections; we use
  one thread and one new HTTP/1.1 connection per request (a loopback connect is well under a
  millisecond). Timestamps are ``time.perf_counter()`` as in vLLM.
- **Omitted keys.** The per-request lists of vLLM's result dict (``input_lens``,
  ``output_lens``, ``ttfts``, ``itls``, ``start_times``, ``generated_texts``, ``errors``),
  ``rtfx`` (audio) and the spec-decode keys (the worker reports those from ``/metrics``
  separately) are not in :func:`calculate_metrics`'s dict. ``request_goodput`` is ``None``
  (no goodput SLOs), as in vLLM without ``--goodput``.
- **Percentiles.** vLLM defaults to ``--metric-percentiles 99`` and ``--percentile-metrics
  ttft,tpot,itl``; our defaults are the equivalent of ``--metric-percentiles 50,99
  --percentile-metrics ttft,tpot,itl,e2el`` (so ``p50_*`` and ``p99_*`` keys for all four).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

import numpy as np

ERROR_KINDS = ("http_error", "stream_error_event", "connection_reset", "incomplete_stream", "timeout", "other")
MAX_ERROR_CHARS = 2000
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50.0, 99.0)


@dataclass
class RequestResult:
    """One request's measurements. Times are seconds; ``start_time`` is ``time.perf_counter()``."""

    index: int = 0
    status: int | None = None  # HTTP status of the response; None if no response arrived
    success: bool = False
    start_time: float = 0.0
    ttft: float | None = None  # first chunk with choices, as vLLM bench
    itl: list = field(default_factory=list)  # gaps between consecutive chunks with choices
    latency: float | None = None  # E2EL: last data chunk (not [DONE]) minus start, as vLLM bench
    elapsed: float | None = None  # until the request ended, however it ended
    chunk_times: list = field(default_factory=list)  # arrival (s after start) of every chunk with choices
    content_chunks: int = 0  # chunks whose delta carried non-empty content
    output_tokens: int | None = None  # usage.completion_tokens
    prompt_tokens: int | None = None  # usage.prompt_tokens
    finish_reason: str | None = None
    done: bool = False  # data: [DONE] was seen
    error_kind: str | None = None
    error: str | None = None  # error body / in-stream error / exception text, truncated

    def fail(self, kind: str, text: str) -> None:
        assert kind in ERROR_KINDS, kind
        if self.error_kind is None:  # the first failure is the one that matters
            self.error_kind = kind
            self.error = _trunc(text)


def _trunc(text, n: int = MAX_ERROR_CHARS) -> str:
    text = text if isinstance(text, str) else str(text)
    return text if len(text) <= n else text[:n] + f"... [{len(text) - n} more chars]"


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def stream_chat(url: str, body: dict, *, timeout: float = 300.0, total_timeout: float | None = None,
                headers: dict | None = None, index: int = 0) -> RequestResult:
    """Send one chat-completion request to ``url`` and read its response.

    ``timeout`` bounds every socket operation (connect, each read); ``total_timeout``, if given,
    bounds the whole request (checked whenever a line arrives). Never raises for network or
    protocol trouble: the result says what happened (``error_kind``: http_error,
    stream_error_event, connection_reset, incomplete_stream, timeout, other).

    Per-chunk rules as vLLM 0.22.1 ``async_request_openai_chat_completions``: every ``data:``
    message but ``[DONE]`` is parsed and stamped; the first with non-empty ``choices`` gives
    TTFT, each later one appends an ITL (gap to the previous stamped message); a message
    without choices but with ``usage`` gives the token counts; latency is the last stamp
    minus the start.
    """
    u = urllib.parse.urlsplit(url)
    path = u.path + ("?" + u.query if u.query else "")
    hdr = {"Content-Type": "application/json", "Authorization": "Bearer sk-local"}
    hdr.update(headers or {})
    payload = json.dumps(body).encode()
    stream = bool(body.get("stream"))
    res = RequestResult(index=index)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    st = time.perf_counter()
    res.start_time = st
    last = st  # vLLM bench: most_recent_timestamp

    def handle(data: str, t: float) -> None:
        nonlocal last
        if data == "[DONE]":
            res.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            res.fail("other", f"undecodable SSE data: {data}")
            return
        if isinstance(obj, dict) and obj.get("error") is not None:
            err = obj["error"]
            res.fail("stream_error_event", json.dumps(err) if not isinstance(err, str) else err)
        elif isinstance(obj, dict) and obj.get("choices"):
            res.chunk_times.append(t - st)
            if res.ttft is None:
                res.ttft = t - st
            else:
                res.itl.append(t - last)
            ch = obj["choices"][0]
            if (ch.get("delta") or {}).get("content"):
                res.content_chunks += 1
            if ch.get("finish_reason"):
                res.finish_reason = ch["finish_reason"]
        elif isinstance(obj, dict) and obj.get("usage"):
            res.output_tokens = obj["usage"].get("completion_tokens")
            if obj["usage"].get("prompt_tokens") is not None:
                res.prompt_tokens = obj["usage"]["prompt_tokens"]
        last = t

    try:
        conn.request("POST", path, body=payload, headers=hdr)
        resp = conn.getresponse()
        res.status = resp.status
        if resp.status != 200:
            text = _decode(resp.read())
            res.fail("http_error", f"HTTP {resp.status} {resp.reason}: {text}")
        elif not stream:
            obj = json.loads(resp.read())
            last = time.perf_counter()
            if isinstance(obj, dict) and obj.get("error") is not None:
                res.fail("stream_error_event", json.dumps(obj["error"]))
            usage = obj.get("usage") or {}
            res.output_tokens = usage.get("completion_tokens")
            res.prompt_tokens = usage.get("prompt_tokens")
            res.done = True
            res.latency = last - st
        else:
            lines: list[str] = []  # data lines of the SSE event being read
            while True:
                raw = resp.readline()
                t = time.perf_counter()
                if total_timeout is not None and t - st > total_timeout:
                    raise TimeoutError(f"request exceeded its total timeout of {total_timeout:g} s")
                if not raw:
                    break
                line = _decode(raw).rstrip("\r\n")
                if line == "":
                    if lines:
                        handle("\n".join(lines).strip(), t)
                        lines = []
                elif line.startswith("data:"):
                    lines.append(line[5:].lstrip(" "))
                # SSE comments (":"), event:, id:, retry: lines carry no data
            if lines:  # a last event without its blank line
                handle("\n".join(lines).strip(), time.perf_counter())
            if not res.done:
                res.fail("incomplete_stream", f"stream ended without data: [DONE] after {len(res.chunk_times)} "
                         f"chunk(s) with choices ({res.content_chunks} with content)")
            res.latency = last - st
    except TimeoutError as e:  # socket.timeout is TimeoutError
        res.fail("timeout", f"{type(e).__name__}: {e} (after {len(res.chunk_times)} chunk(s))")
    except http.client.IncompleteRead as e:
        res.fail("incomplete_stream", f"incomplete chunked read: {e!r} after {len(res.chunk_times)} chunk(s)")
    except http.client.RemoteDisconnected as e:  # a ConnectionResetError: before any response
        res.fail("connection_reset", f"{type(e).__name__}: {e}")
    except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as e:
        res.fail("connection_reset", f"{type(e).__name__}: {e} (after {len(res.chunk_times)} chunk(s))")
    except Exception as e:  # noqa: BLE001 - refused connections, protocol errors, bad JSON...
        res.fail("other", f"{type(e).__name__}: {e}")
    finally:
        conn.close()
    res.elapsed = time.perf_counter() - st
    res.success = res.status == 200 and res.error_kind is None
    if not res.success:
        res.latency = None
    return res


def run_requests(url: str, body: dict, num_requests: int, max_concurrency: int | None = None, *,
                 timeout: float = 300.0, total_timeout: float | None = None,
                 headers: dict | None = None) -> tuple[list[RequestResult], float]:
    """Send ``num_requests`` copies of ``body``, at most ``max_concurrency`` in flight (default: all).

    Returns the results (in request order) and the run's duration: from just before the first
    request is sent until the last has returned (vLLM bench's ``benchmark_duration``).
    """
    n_threads = max(1, min(num_requests, max_concurrency or num_requests))
    results: list[RequestResult | None] = [None] * num_requests
    lock = threading.Lock()
    nxt = [0]
    go = threading.Event()

    def worker():
        go.wait()
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= num_requests:
                return
            try:
                results[i] = stream_chat(url, body, timeout=timeout, total_timeout=total_timeout,
                                         headers=headers, index=i)
            except BaseException as e:  # noqa: BLE001 - a request must never vanish without a record
                r = RequestResult(index=i)
                r.fail("other", f"client error: {type(e).__name__}: {e}")
                results[i] = r

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n_threads)]
    for th in threads:
        th.start()
    t0 = time.perf_counter()
    go.set()
    for th in threads:
        th.join()
    return list(results), time.perf_counter() - t0


def output_len(r: RequestResult) -> int:
    """Tokens a completed request produced: usage.completion_tokens, else content chunks (module docstring)."""
    return r.output_tokens if r.output_tokens else r.content_chunks


def _f(x) -> float:
    return float(x)


def calculate_metrics(results: list[RequestResult], duration: float,
                      percentiles=PERCENTILES, percentile_metrics=PERCENTILE_METRICS) -> dict:
    """The ``vllm bench serve`` result dict for one run (vLLM 0.22.1, ``vllm/benchmarks/serve.py``,
    ``calculate_metrics`` and the result dict of ``benchmark``); times in ms, throughputs per s.

    Completed requests only: TTFT list; TPOT = (E2EL - TTFT) / (output tokens - 1) for requests
    with more than one output token; ITL = all requests' per-chunk gaps pooled into one list;
    E2EL list. Each gives ``mean_/median_/std_`` and ``p{N}_`` (numpy's default linear
    percentile), 0 for an empty list (vLLM's ``np.mean(xs or 0)``). Throughputs divide by
    ``duration``; failed requests count 0 output tokens.
    """
    total_input = 0
    completed = 0
    out_lens: list[int] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    for r in results:
        if not r.success:
            out_lens.append(0)
            continue
        n = output_len(r)
        out_lens.append(n)
        total_input += r.prompt_tokens or 0
        if r.ttft is not None:  # streamed
            if n > 1:
                tpots.append((r.latency - r.ttft) / (n - 1))
            ttfts.append(r.ttft)
            itls += r.itl
        e2els.append(r.latency)
        completed += 1
    ok = [r for r in results if r.success]
    max_tok_s, max_conc = 0.0, 0
    if ok:  # peak output tokens/s and peak concurrency in 1 s buckets (chunks counted as tokens)
        t_min = min(r.start_time for r in ok)
        t_max = max(r.start_time + r.latency for r in ok)
        nb = int(np.ceil(t_max - t_min)) + 1
        tok = np.zeros(nb)
        conc = np.zeros(nb)
        for r in ok:
            if r.ttft is not None:
                times = [r.start_time + r.ttft]
                for gap in r.itl:
                    times.append(times[-1] + gap)
                for tt in times:
                    b = int(tt - t_min)
                    if 0 <= b < nb:
                        tok[b] += 1
            for s in range(int(r.start_time - t_min), int(r.start_time + r.latency - t_min) + 1):
                conc[s] += 1
        max_tok_s, max_conc = float(tok.max()), int(conc.max())
    total_output = sum(out_lens)
    m = {
        "duration": _f(duration),
        "completed": completed,
        "failed": len(results) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration if duration else None,
        "request_goodput": None,
        "output_throughput": total_output / duration if duration else None,
        "total_token_throughput": (total_input + total_output) / duration if duration else None,
        "max_output_tokens_per_s": max_tok_s,
        "max_concurrent_requests": max_conc,
    }
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        if name not in percentile_metrics:
            continue
        a = np.asarray(xs if xs else [0.0], dtype=float)
        m[f"mean_{name}_ms"] = _f(np.mean(a) * 1000)
        m[f"median_{name}_ms"] = _f(np.median(a) * 1000)
        m[f"std_{name}_ms"] = _f(np.std(a) * 1000)
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            m[f"p{word}_{name}_ms"] = _f(np.percentile(a, p) * 1000)
    return m


def summarize_failures(results: list[RequestResult]) -> dict:
    """How the failed requests failed: counts per ``error_kind`` and per HTTP status, and the
    first error text of each kind (with its request index and status)."""
    failed = [r for r in results if not r.success]
    by_kind: dict[str, int] = {}
    by_status: dict[str, int] = {}
    first: dict[str, dict] = {}
    for r in failed:
        kind = r.error_kind or "other"
        by_kind[kind] = by_kind.get(kind, 0) + 1
        st = str(r.status) if r.status is not None else "no_response"
        by_status[st] = by_status.get(st, 0) + 1
        if kind not in first:
            first[kind] = {"index": r.index, "status": r.status, "error": r.error,
                           "elapsed_s": round(r.elapsed, 3) if r.elapsed is not None else None,
                           "chunks": len(r.chunk_times)}
    return {"failed": len(failed), "by_kind": by_kind, "by_status": by_status, "first_error": first}
