"""Load generator for ``pyspec serve`` on loopback: throughput and p50/p99 TTFT / TPOT at several
concurrency levels, speculation on and off, in one run (same model, same prompts).

The server runs in this process (uvicorn on 127.0.0.1, its own engine thread); clients are threads
streaming `/v1/chat/completions` with httpx and timing tokens as they arrive (TTFT = first content
chunk; TPOT = (last chunk - first chunk) / (tokens - 1), per request). A level runs a bounded number
of requests (--requests-per-level, at least 2 x concurrency), each client issuing its next request
when the previous one finishes; request i asks for max_tokens scaled by a factor in [0.5, 1.5]
(--length-spread 0.5), the same sequence at every level, so that requests finish at different
times as in real traffic (with equal lengths plain decoding runs in waves whose prefills all
fall before the wave's first tokens, which flatters its TPOT and hurts its TTFT; speculation breaks
the waves up). The engine's steps, draft tokens and forward time per step are reported too. Speculation on/off is the config's enabled_ratio 1 / 0 (swapped on
the running server, as a SIGHUP reload would). JSON + PNG.

    python bench/bench_serve.py --draft default --out bench/results/serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


def closed_loop(total, concurrency, request):
    """``concurrency`` clients issue requests 0..total-1 (``request(i)``), each client its next
    one when its previous one finished; returns (the results in finishing order, wall seconds)."""
    work = list(range(total))
    lock = threading.Lock()
    results = []

    def client():
        while True:
            with lock:
                if not work:
                    return
                i = work.pop(0)
            r = request(i)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests-per-level", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--length-spread", type=float, default=0.5,
                    help="request i asks for max_tokens scaled by a factor in [1 - S, 1 + S] "
                         "(the same sequence at every level): requests of one wave finish at "
                         "different times, as in real traffic, instead of in lockstep (0: every "
                         "request asks for max_tokens)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "serve.json"))
    args = ap.parse_args(argv)

    import httpx
    import uvicorn

    import pyspec
    from pyspec.serve.app import create_app
    from pyspec.serve.config import parse_config

    rows = [json.loads(x) for x in open(os.path.join(HERE, "data", "mt_bench_questions.jsonl"))]
    prompts = [r["turns"][0] for r in rows]
    # No prefix cache: every level sends the same prompts, and later levels must not get their
    # prefills for free.
    llm = pyspec.LLM(args.model, draft=args.draft, dtype=args.dtype, progress=False,
                     enable_prefix_cache=False)
    app = create_app(llm, parse_config({"speculative": {"enabled_ratio": 1.0}}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    if not 0.0 <= args.length_spread < 1.0:
        ap.error("--length-spread must be in [0, 1)")

    def max_tokens_of(i):
        frac = (i * 0.6180339887) % 1.0  # a low-discrepancy sequence over request indices
        return max(1, round(args.max_tokens * (1 - args.length_spread
                                               + 2 * args.length_spread * frac)))

    def one(prompt, max_tokens):
        body = {"model": "pyspec", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first = last = None
        n = n_tokens = 0
        with httpx.stream("POST", url, json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if d.get("usage"):
                    n_tokens = d["usage"]["completion_tokens"]
                if d["choices"] and d["choices"][0]["delta"].get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n += 1
        end = time.perf_counter()
        # TPOT over tokens (a speculative step streams several tokens in one chunk).
        return dict(ttft=(first or end) - t0,
                    tpot=((last - first) / (n_tokens - 1)) if n_tokens > 1 and n > 1 else None,
                    tokens=n_tokens, chunks=n, seconds=end - t0)

    def level(conc, spec_on):
        app.state.config["config"].speculative.enabled_ratio = 1.0 if spec_on else 0.0
        total = max(args.requests_per_level, 2 * conc)
        es0 = llm.engine.stats
        before = (es0.steps, es0.drafts, es0.draft_tokens, es0.accepted_tokens,
                  es0.draft_seconds, es0.verify_seconds)
        results, wall = closed_loop(
            total, conc, lambda i: one(prompts[i % len(prompts)], max_tokens_of(i)))
        ttft = [r["ttft"] for r in results]
        tpot = [r["tpot"] for r in results if r["tpot"] is not None]
        usage_tokens = sum(r["tokens"] for r in results)
        es = llm.engine.stats
        steps, drafts, dtok, acc, dsec, vsec = (b - a for a, b in zip(before, (
            es.steps, es.drafts, es.draft_tokens, es.accepted_tokens, es.draft_seconds,
            es.verify_seconds)))
        # The engine's side: its steps, how many verified drafts, draft tokens and accepted
        # ones, and the time it spent drafting and in target forwards per step.
        engine = dict(steps=steps, draft_steps=drafts, draft_tokens=dtok, accepted_tokens=acc,
                      draft_ms_per_step=1e3 * dsec / max(steps, 1),
                      forward_ms_per_step=1e3 * vsec / max(steps, 1))
        return dict(concurrency=conc, speculation=spec_on, requests=len(results), seconds=wall,
                    engine=engine,
                    tokens_per_second=usage_tokens / wall,
                    ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99),
                    tpot_p50=pct(tpot, 50), tpot_p99=pct(tpot, 99),
                    tpot_mean=statistics.mean(tpot) if tpot else None)

    one(prompts[0], args.max_tokens)  # warm-up
    out = []
    for conc in [int(c) for c in args.concurrency.split(",")]:
        for spec_on in (True, False):  # same level back to back
            r = level(conc, spec_on)
            out.append(r)
            print(f"c={conc:3d} spec={'on ' if spec_on else 'off'} {r['tokens_per_second']:7.1f} "
                  f"tok/s  TTFT p50 {r['ttft_p50'] * 1e3:7.1f} ms p99 {r['ttft_p99'] * 1e3:7.1f} ms"
                  f"  TPOT p50 {r['tpot_p50'] * 1e3:6.1f} ms p99 {r['tpot_p99'] * 1e3:6.1f} ms"
                  f"  | {json.dumps(r['engine'])}", flush=True)
    srv.should_exit = True
    th.join(timeout=10)
    report = dict(config=vars(args), drafter=llm.drafter_name, levels=out)
    for conc in sorted({r["concurrency"] for r in out}):
        on = next(r for r in out if r["concurrency"] == conc and r["speculation"])
        off = next(r for r in out if r["concurrency"] == conc and not r["speculation"])
        report[f"tpot_gain_c{conc}"] = off["tpot_p50"] / on["tpot_p50"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    json.dump(report, open(args.out, "w"), indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for spec_on, style in ((True, "o-"), (False, "s--")):
            rs = [r for r in out if r["speculation"] == spec_on]
            c = [r["concurrency"] for r in rs]
            lab = "speculation on" if spec_on else "off"
            axes[0].plot(c, [r["tokens_per_second"] for r in rs], style, label=lab)
            axes[1].plot(c, [r["ttft_p50"] * 1e3 for r in rs], style, label=lab + " p50")
            axes[1].plot(c, [r["ttft_p99"] * 1e3 for r in rs], style, alpha=0.4, label=lab + " p99")
            axes[2].plot(c, [r["tpot_p50"] * 1e3 for r in rs], style, label=lab + " p50")
            axes[2].plot(c, [r["tpot_p99"] * 1e3 for r in rs], style, alpha=0.4, label=lab + " p99")
        for ax, t in zip(axes, ["throughput (tokens/s)", "TTFT (ms)", "TPOT (ms)"]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_title(t)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=100)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
