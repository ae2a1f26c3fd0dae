"""Fake ``python -m vllm.entrypoints.openai.api_server`` for tests/test_server_mode.py.

Speaks what dflash_lab.worker.run_server uses of the real server: ``/health``, ``/metrics`` (Prometheus
text with vLLM 0.22.1's spec-decode counter names, ``_total`` and ``_created`` samples, engine and model
labels) and streamed ``/v1/chat/completions`` with a final usage chunk, behind ``--api-key``.
Behaviour from FAKE_SERVER (JSON): ``startup`` "ok" | "exit"; ``die_after`` (requests answered before
the process dies mid-stream, as a CUDA crash kills the server); ``tokens`` per request (default: max_tokens).
"""

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

K = 15  # draft positions in the counters, as DFlash k=15


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--served-model-name", required=True)
    ap.add_argument("--api-key", required=True)
    args, rest = ap.parse_known_args()
    plan = json.loads(os.environ.get("FAKE_SERVER", "{}"))
    print("fake vllm api_server args: " + " ".join(sys.argv[1:]), flush=True)
    if plan.get("startup") == "exit":
        print("RuntimeError: fake engine failed to start", file=sys.stderr, flush=True)
        sys.exit(1)
    if plan.get("ignore_sigterm"):  # a server that does not shut down when asked
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lock = threading.Lock()
    state = {"requests": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * K}
    labels = f'engine="0",model_name="{args.served_model_name}"'

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, code, body, ctype="application/json"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, "")
            if self.path == "/v1/models":
                if self.headers.get("Authorization") != f"Bearer {args.api_key}":
                    return self._send(401, '{"error": "Unauthorized"}')
                return self._send(200, json.dumps({"object": "list", "data": [{"id": args.served_model_name,
                                                                               "object": "model"}]}))
            if self.path == "/metrics":
                with lock:
                    s = dict(state)
                    per = list(state["per_pos"])
                out = []
                for name, key in (("drafts", "drafts"), ("draft_tokens", "draft_tokens"), ("accepted_tokens", "accepted")):
                    out += [f"# HELP vllm:spec_decode_num_{name} x", f"# TYPE vllm:spec_decode_num_{name} counter",
                            f"vllm:spec_decode_num_{name}_total{{{labels}}} {float(s[key])}",
                            f"vllm:spec_decode_num_{name}_created{{{labels}}} 1.7645e+09"]
                out += ["# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter"]
                for i, v in enumerate(per):
                    out.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {float(v)}')
                    out.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_created{{{labels},position="{i}"}} 1.7645e+09')
                return self._send(200, "\n".join(out) + "\n", "text/plain; version=0.0.4")
            return self._send(404, '{"error": "not found"}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.headers.get("Authorization") != f"Bearer {args.api_key}":
                return self._send(401, '{"error": "Unauthorized"}')
            if self.path != "/v1/chat/completions" or body.get("model") != args.served_model_name:
                return self._send(404, json.dumps({"error": f"no model {body.get('model')!r} at {self.path}"}))
            with lock:
                state["requests"] += 1
                n_req = state["requests"]
            dying = "die_after" in plan and n_req > plan["die_after"]
            if "hang_after" in plan and n_req > plan["hang_after"]:
                time.sleep(3600)  # a hung engine: the request never answers
            n = int(plan.get("tokens", body.get("max_tokens", 16)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")  # as uvicorn streams
            self.end_headers()

            def event(obj):
                data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            for i in range(n):
                if dying and i == 2:
                    os._exit(1)  # the whole server, mid-stream
                event({"id": "c", "object": "chat.completion.chunk", "model": args.served_model_name,
                       "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]})
                time.sleep(0.002)
            # every 2 tokens one draft step of K drafted tokens, one accepted at positions 0
            with lock:
                steps = n // 2
                state["drafts"] += steps
                state["draft_tokens"] += steps * K
                state["accepted"] += steps
                state["per_pos"][0] += steps
            event({"id": "c", "object": "chat.completion.chunk", "choices": [],
                   "usage": {"prompt_tokens": 20, "completion_tokens": n, "total_tokens": 20 + n}})
            event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    ThreadingHTTPServer((args.host, args.port), H).serve_forever()


if __name__ == "__main__":
    main()
