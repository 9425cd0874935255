"""Throughput of `pyspec serve --ray` with 1 and 2 engine replicas, in one run on a local Ray
cluster: the same MT-bench prompts at one concurrency, non-streaming completions through Ray's
HTTP proxy. The 1-replica level runs before and after the 2-replica one (drift check). Each
replica gets --replica-cpus CPUs (its engine's threads). Each level also reports the CPU seconds
spent by the engine replicas and by everything else on the machine (this load generator, Ray's
proxy, the ingress, Ray's own daemons): what the engines could not use bounds the speedup.

    python bench/bench_ray.py --draft default --concurrency 16 --out bench/results/ray.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="default")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64, help="requests per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--replica-cpus", type=float, default=1.0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ray.json"))
    args = ap.parse_args(argv)

    import httpx
    import ray
    from ray import serve

    from bench_serve import closed_loop
    from pyspec.serve.ray_app import build_app, parse_args

    rows = [json.loads(x) for x in open(os.path.join(HERE, "data", "mt_bench_questions.jsonl"))]
    prompts = [r["turns"][0] for r in rows]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    def deploy(n):
        flags = ["--draft", args.draft, "--replicas", str(n), "--replica-cpus",
                 str(args.replica_cpus), "--max-num-seqs", str(args.concurrency)]
        if args.model:
            flags += ["--model", args.model]
        serve.run(build_app(parse_args(flags)), name="pyspec", route_prefix="/")
        for i in range(2 * n):  # warm every replica (first requests pay one-time costs)
            httpx.post(url, json={"messages": [{"role": "user", "content": f"warm {i}"}],
                                  "max_tokens": 8}, timeout=300)

    def cpu_seconds():
        """CPU seconds so far: (engine replicas, every other process)."""
        import psutil

        engine = other = 0.0
        for p in psutil.process_iter(["cmdline", "cpu_times"]):
            try:
                t = p.info["cpu_times"]
                cmd = " ".join(p.info["cmdline"] or [])
            except (psutil.Error, TypeError):
                continue
            if t is None:
                continue
            if "PyspecEngine" in cmd:
                engine += t.user + t.system
            else:
                other += t.user + t.system
        return engine, other

    def level(n):
        seen = []

        def request(i):
            r = httpx.post(url, timeout=600, json={
                "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                "max_tokens": args.max_tokens, "temperature": 0})
            r.raise_for_status()
            seen.append(r.headers.get("x-pyspec-replica"))
            return r.json()["usage"]["completion_tokens"]

        c0 = cpu_seconds()
        done, wall = closed_loop(args.requests, args.concurrency, request)
        c1 = cpu_seconds()
        row = dict(replicas=n, requests=len(done), tokens=sum(done), seconds=wall,
                   tokens_per_s=sum(done) / wall, per_replica=sorted(Counter(seen).values()),
                   engine_cores=(c1[0] - c0[0]) / wall, other_cores=(c1[1] - c0[1]) / wall)
        print(json.dumps(row), flush=True)
        return row

    out = []
    try:
        for n in (1, 2, 1):
            deploy(n)
            out.append(level(n))
    finally:
        serve.shutdown()
        ray.shutdown()
    one = statistics.mean(r["tokens_per_s"] for r in out if r["replicas"] == 1)
    two = [r for r in out if r["replicas"] == 2][0]["tokens_per_s"]
    result = dict(args=vars(args), cpus=os.cpu_count(), levels=out,
                  speedup_2_vs_1=two / one)
    print(f"2 replicas vs 1 (mean of before/after): {two / one:.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
