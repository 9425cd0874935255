"""Memory of the default model under pyspec, per setting: resident after loading, after a
request, and the peak while loading; with the decoding speed of each, measured in the same run.

    python bench/bench_memory.py [--kv-cache-tokens 8192] [--prompt-tokens 1000]
                                 [--max-tokens 128] [--settings "auto/auto;codes/float16"]
                                 [--llama-cpp] [--out bench/results/memory.json]

Each setting (``PACKED_WEIGHTS/KV_CACHE_DTYPE``, as ``pyspec.LLM``'s ``packed_weights`` and
``kv_cache_dtype``; ``default`` for the constructor's defaults) runs in a fresh process: it imports
torch and pyspec, notes its resident memory (the baseline), loads the model with
``kv_cache_tokens`` (plain decoding, no drafter), notes the resident memory and the peak so far,
decodes one request (a prompt of about ``--prompt-tokens`` tokens: this file's text repeated,
then ``--max-tokens`` greedy tokens) and notes the resident memory again. Reported in MB (10^6
bytes) above the baseline, so the interpreter and torch's own libraries are left out as they
would be in a comparison with llama.cpp, whose process holds neither. Every setting decodes the
same tokens (the KV cache dtype may change them; ``same_tokens_as_first`` says whether it did).
``--llama-cpp`` adds llama.cpp (llama-cpp-python, when installed) on the GGUF the default model
was converted from, measured the same way: ``n_ctx`` = ``--kv-cache-tokens``, the same prompt
length and greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import json, resource, sys, time
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 1e6
import torch
import pyspec
torch.set_num_threads(2)
packed, kv, kv_tokens, prompt_tokens, max_tokens = sys.argv[1:6]
base = rss()
peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
kw = {}
if packed != "default":
    kw["packed_weights"] = packed
if kv != "default":
    kw["kv_cache_dtype"] = kv
t = time.perf_counter()
llm = pyspec.LLM(draft="none", progress=False, kv_cache_tokens=int(kv_tokens), **kw)
load_s = time.perf_counter() - t
loaded = rss()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
text = open(sys.argv[6]).read()
ids = llm.encode(text)
while len(ids) < int(prompt_tokens):
    ids = ids + ids
ids = ids[:int(prompt_tokens)]
sp = pyspec.SamplingParams(max_tokens=int(max_tokens), temperature=0.0, ignore_eos=True)
t = time.perf_counter()
out = llm.generate([ids], sp)[0]
dt = time.perf_counter() - t
print(json.dumps({"baseline_mb": round(base, 1), "loaded_mb": round(loaded - base, 1),
                  "load_peak_mb": round(max(peak, peak_before) - base, 1),
                  "after_request_mb": round(rss() - base, 1),
                  "load_seconds": round(load_s, 2), "request_seconds": round(dt, 2),
                  "kv_dtype": str(llm.runner.kv.k.dtype).replace("torch.", ""),
                  "tokens": out.token_ids}))
"""


LLAMA_CPP = r"""
import json, resource, sys, time
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 1e6
from llama_cpp import Llama
gguf, kv_tokens, prompt_tokens, max_tokens = sys.argv[1:5]
base = rss()
t = time.perf_counter()
llm = Llama(model_path=gguf, n_ctx=int(kv_tokens), n_threads=2, verbose=False)
load_s = time.perf_counter() - t
loaded = rss()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
ids = llm.tokenize(open(sys.argv[5], "rb").read())
while len(ids) < int(prompt_tokens):
    ids = ids + ids
ids = ids[:int(prompt_tokens)]
t = time.perf_counter()
n = 0
for tok in llm.generate(ids, top_k=1, temp=0.0):
    n += 1
    if n >= int(max_tokens):
        break
dt = time.perf_counter() - t
print(json.dumps({"baseline_mb": round(base, 1), "loaded_mb": round(loaded - base, 1),
                  "load_peak_mb": round(peak - base, 1), "after_request_mb": round(rss() - base, 1),
                  "load_seconds": round(load_s, 2), "request_seconds": round(dt, 2),
                  "kv_dtype": "float16 (llama.cpp)", "tokens": []}))
"""


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-cache-tokens", type=int, default=8192)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--settings", default="default/default;auto/auto;codes/auto;auto/float16;"
                    "codes/float16",
                    help="PACKED_WEIGHTS/KV_CACHE_DTYPE settings separated by semicolons")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="also llama.cpp (llama-cpp-python) on the default model's GGUF, the "
                         "same context and request")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from bench_spec import emit

    runs = {}
    first = None
    for setting in filter(None, args.settings.split(";")):
        packed, _, kv = setting.partition("/")
        cmd = [sys.executable, "-c", CHILD, packed, kv or "default", str(args.kv_cache_tokens),
               str(args.prompt_tokens), str(args.max_tokens), os.path.abspath(__file__)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise SystemExit(f"{setting}: exit {res.returncode}\n{res.stderr[-2000:]}")
        r = json.loads(res.stdout.strip().splitlines()[-1])
        toks = r.pop("tokens")
        first = first if first is not None else toks
        r["same_tokens_as_first"] = toks == first
        r["tokens_per_s"] = round(len(toks) / r["request_seconds"], 1)
        r["load_peak_over_steady"] = round(r["load_peak_mb"] / max(r["after_request_mb"], 1), 2)
        runs[setting] = r
        print(setting, r, file=sys.stderr, flush=True)
    if args.llama_cpp:
        from pyspec.models.default import default_gguf_path

        cmd = [sys.executable, "-c", LLAMA_CPP, default_gguf_path(), str(args.kv_cache_tokens),
               str(args.prompt_tokens), str(args.max_tokens), os.path.abspath(__file__)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise SystemExit(f"llama.cpp: exit {res.returncode}\n{res.stderr[-2000:]}")
        r = json.loads(res.stdout.strip().splitlines()[-1])
        r.pop("tokens")
        r["tokens_per_s"] = round(args.max_tokens / r["request_seconds"], 1)
        r["load_peak_over_steady"] = round(r["load_peak_mb"] / max(r["after_request_mb"], 1), 2)
        runs["llama.cpp"] = r
        print("llama.cpp", r, file=sys.stderr, flush=True)
    emit({"config": {"kv_cache_tokens": args.kv_cache_tokens,
                     "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens},
          "settings": runs}, args.out)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
