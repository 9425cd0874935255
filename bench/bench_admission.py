"""Admission under a burst: N concurrent short requests against `pyspec serve
--max-waiting-requests W` (a server process of its own, the default model unless --model).

Each request streams (so its time to first token is seen) a short prompt with a few new tokens.
Reported: how many were admitted and completed, how many were refused with 503 + Retry-After and
how fast the refusals came (p50 / p99 / max seconds from sending to the answer), the admitted
requests' TTFT (p50 / p99 / max) and whether any request got something else (must be none).

    python bench/bench_admission.py --requests 1000 --max-waiting 128 --out bench/results/admission.json

``--floor raw`` runs the same burst against a server that does no work at all (a bare
event-loop protocol answering 503 + Retry-After as soon as a request's headers are in): what this
machine's client, kernel and one Python event loop cost. ``--floor uvicorn`` answers 503 from an
ASGI app that does nothing, under uvicorn with the HTTP parser and loop pyspec serve uses (h11;
uvloop where installed, asyncio otherwise): the HTTP server's own cost before any of pyspec's.
Both sides run on this machine: on a small one the client's share of the CPU is in every number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time


def _run(coro):
    """The client's event loop: uvloop where installed (asyncio's own loop makes the client, not
    the server, the slower side of a 1,000-connection burst on a small machine)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 4)


async def _one(port, i, max_tokens):
    """One request over a raw connection (a full HTTP client per request would make the client,
    not the server, what 1,000 concurrent requests measure): its status, the time to the status
    line, and for a 200 the time to the first streamed chunk and whether the stream ended well."""
    body = json.dumps({"prompt": f"Question {i}: name a colour.", "max_tokens": max_tokens,
                       "stream": True, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + body)
        await writer.drain()
        status_line = await reader.readline()
        t_status = time.perf_counter() - t0
        status = int(status_line.split()[1])
        headers = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b""):
                break
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        if status != 200:
            writer.close()
            return {"status": status, "t": t_status, "retry_after": headers.get("retry-after")}
        ttft, rest = None, b""
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                break
            if ttft is None and b"data: {" in chunk:
                ttft = time.perf_counter() - t0
            rest += chunk
        writer.close()
        ok = b"data: [DONE]" in rest and b'"error"' not in rest
        return {"status": 200, "ttft": ttft, "t": time.perf_counter() - t0, "error": not ok}
    except Exception as e:  # noqa: BLE001
        return {"status": repr(e), "t": time.perf_counter() - t0}


# The --floor server: no HTTP framework, no parsing beyond the end of the headers.
_FLOOR_SERVER = r"""
import asyncio, sys
R = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 2\r\n"
     b"Connection: close\r\n\r\n{}")
class P(asyncio.Protocol):
    def connection_made(self, t):
        self.t, self.buf = t, b""
    def data_received(self, d):
        self.buf += d
        if b"\r\n\r\n" in self.buf:
            self.t.write(R)
            self.t.close()
async def main():
    s = await asyncio.get_running_loop().create_server(P, "127.0.0.1", int(sys.argv[1]),
                                                       backlog=4096)
    await s.serve_forever()
try:
    import uvloop
    uvloop.run(main())
except ImportError:
    asyncio.run(main())
"""

_FLOOR_UVICORN = r"""
import sys, uvicorn
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"retry-after", b"1"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), http="h11", loop="auto",
            log_level="warning")
"""


def _wait_listening(port, srv):
    for _ in range(1200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            pass
        if srv.poll() is not None:
            raise SystemExit(srv.stdout.read())
        time.sleep(0.5)
    raise SystemExit("the server did not start")


async def _burst(port, n, max_tokens):
    return await asyncio.gather(*[_one(port, i, max_tokens) for i in range(n)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-waiting", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--switch-interval", type=float, default=0.005,
                    help="the server process's sys.setswitchinterval (Python's default 0.005)")
    ap.add_argument("--floor", choices=("raw", "uvicorn"), default=None,
                    help="measure against a server that does no work instead of pyspec serve")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.requests)), hard))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.floor:
        code = _FLOOR_SERVER if args.floor == "raw" else _FLOOR_UVICORN
        cmd = [sys.executable, "-c", code, str(port)]
    else:
        cmd = [sys.executable, "-c", "import sys; sys.setswitchinterval(float(sys.argv[1])); "
               "from pyspec.cli import main; sys.exit(main(sys.argv[2:]))",
               str(args.switch_interval), "serve", "--port", str(port), "--draft", "none",
               "--max-waiting-requests", str(args.max_waiting)]
        if args.model:
            cmd += ["--model", args.model]
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_listening(port, srv)
        _run(_burst(port, 4, args.max_tokens))  # warm-up
        t0 = time.perf_counter()
        res = _run(_burst(port, args.requests, args.max_tokens))
        wall = time.perf_counter() - t0
    finally:
        srv.send_signal(signal.SIGTERM)
        try:
            srv.wait(timeout=60)
        except subprocess.TimeoutExpired:
            srv.kill()
    ok = [r for r in res if r["status"] == 200 and not r.get("error")]
    refused = [r for r in res if r["status"] == 503]
    other = [r for r in res if r not in ok and r not in refused]
    out = {
        "server": f"no-work floor ({args.floor})" if args.floor else "pyspec serve",
        "requests": args.requests, "max_waiting_requests": None if args.floor else args.max_waiting,
        "max_tokens": args.max_tokens, "cpu_count": os.cpu_count(), "wall_s": round(wall, 2),
        "admitted_completed": len(ok), "refused_503": len(refused),
        "refused_with_retry_after": sum(1 for r in refused if r.get("retry_after")),
        "other": len(other), "other_examples": [r["status"] for r in other[:5]],
        "refusal_s": {"p50": _pct([r["t"] for r in refused], 0.5),
                      "p99": _pct([r["t"] for r in refused], 0.99),
                      "max": _pct([r["t"] for r in refused], 1.0)},
        "admitted_ttft_s": {"p50": _pct([r["ttft"] for r in ok], 0.5),
                            "p99": _pct([r["ttft"] for r in ok], 0.99),
                            "max": _pct([r["ttft"] for r in ok], 1.0)},
    }
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
