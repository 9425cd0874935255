"""A short request behind a long prompt: its time to first token with and without a prefill chunk
limit (``pyspec serve --max-prefill-chunk``), over HTTP on the default model.

For each chunk limit, side by side in one run: a LONG-token prompt is sent, then after DELAY
seconds a 5-token prompt; both ask for a few tokens. Printed and written as JSON: the short
request's TTFT, the long one's TTFT and the long one's total time, per limit.

    python bench/bench_fairness.py --long 6000 --delay 2 --chunks 0,512 --out bench/results/fairness.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))


def _ttft(base, body, out, key):
    import httpx

    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                      timeout=600) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    out[key] = {"ttft_s": round(first, 3), "total_s": round(time.perf_counter() - t0, 3)}


def run(chunk: int, args) -> dict:
    import pyspec
    from pyspec.serve.app import create_app
    from serve_support import _start

    llm = pyspec.LLM(None, draft="none", kv_cache_tokens=args.long + 1024,
                     max_prefill_chunk=chunk, progress=False)
    app = create_app(llm)
    srv, th, base = _start(app)
    try:
        # Warm-up (first-call costs out of the timings).
        _ttft(base, {"prompt": "Hello", "max_tokens": 2}, {}, "w")
        text = " ".join(f"word{i % 97}" for i in range(args.long * 2))
        ids = llm.tokenizer.encode(text)[: args.long]
        out = {}
        long_t = threading.Thread(target=_ttft, args=(base, {"prompt": ids, "max_tokens": 4},
                                                      out, "long"))
        long_t.start()
        time.sleep(args.delay)
        _ttft(base, {"prompt": "Tell me a joke.", "max_tokens": 4}, out, "short")
        long_t.join()
        return {"max_prefill_chunk": chunk, "long_prompt_tokens": len(ids), **out}
    finally:
        srv.should_exit = True
        th.join(timeout=30)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--long", type=int, default=6000)
    ap.add_argument("--delay", type=float, default=2.0)
    ap.add_argument("--chunks", default="0,512")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for c in (int(x) for x in args.chunks.split(",")):
        row = run(c, args)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cpu": os.cpu_count(), "delay_s": args.delay, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
