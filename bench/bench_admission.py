"""Admission under a burst: N concurrent short requests against `pyspec serve
--max-waiting-requests W` (a server process of its own, the default model unless --model).

Each request streams (so its time to first token is seen) a short prompt with a few new tokens.
Reported: how many were admitted and completed, how many were refused with 503 + Retry-After and
how fast the refusals came (p50 / p99 / max seconds from sending to the answer), the admitted
requests' TTFT (p50 / p99 / max) and whether any request got something else (must be none).

    python bench/bench_admission.py --requests 1000 --max-waiting 128 --out bench/results/admission.json
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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.requests)), hard))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", "import sys; sys.setswitchinterval(float(sys.argv[1])); "
           "from pyspec.cli import main; sys.exit(main(sys.argv[2:]))", str(args.switch_interval),
           "serve", "--port", str(port), "--draft", "none",
           "--max-waiting-requests", str(args.max_waiting)]
    if args.model:
        cmd += ["--model", args.model]
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        import httpx

        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if srv.poll() is not None:
                raise SystemExit(srv.stdout.read())
            time.sleep(0.5)
        asyncio.run(_burst(port, 4, args.max_tokens))  # warm-up
        t0 = time.perf_counter()
        res = asyncio.run(_burst(port, args.requests, args.max_tokens))
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
        "requests": args.requests, "max_waiting_requests": args.max_waiting,
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
