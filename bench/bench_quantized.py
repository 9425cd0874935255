"""A 4-bit AWQ / GPTQ checkpoint (or a 16-bit one) against the same model's float32 weights read
through the packed kernel: decode speed (greedy, plain decoding, batch 1) and memory, side by side
in one run.

The quantized checkpoint is made here from the float one (asymmetric 4-bit, groups of
``--group``; the AWQ or GPTQ layout, GPTQ optionally with act-order column groups; embeddings,
norms and lm_head stored in ``--rest-dtype``: float16 as published AWQ / GPTQ files store them, or
float32 as in the float checkpoint), so the models hold the same network up to 4-bit rounding
of the layer matrices (and float16 rounding of the rest). A third variant loads the quantized checkpoint dequantized
(``packed_weights="off"``): the same weights as float32 matrices. Each variant runs in a process of its own
(its resident memory is its own); the runs alternate, best of ``--repeats``.

``--method bfloat16`` / ``float16``: the checkpoint stored in that dtype as a whole (as most
published checkpoints are), loaded with ``packed_weights="codes"`` (its matrices held as 16-bit
codes) against ``"off"`` (float32 matrices).

    python bench/bench_quantized.py --method awq --group 128 --out bench/results/quantized.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pack(v, order=None):
    import torch

    r, c = v.shape
    v = v.view(r, c // 8, 8)
    if order is not None:
        v = v[:, :, order]
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for i in range(8):
        out |= v[:, :, i].to(torch.int64) << (4 * i)
    return ((out + 2**31) % 2**32 - 2**31).to(torch.int32)


def quantize_folder(src: str, dst: str, method: str, group: int, act_order: bool,
                    rest_dtype: str = "float16") -> None:
    """``dst``: ``src`` (a float safetensors folder) with its layer matrices in 4-bit
    ``method`` layout and its other tensors in ``rest_dtype``."""
    import torch
    from safetensors.torch import save_file

    from pyspec.models.loader import iter_tensors

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    out = {}
    if method in ("bfloat16", "float16"):
        for name, t in iter_tensors(src):
            out[name] = t.to(getattr(torch, method)) if t.is_floating_point() else t
        save_file(out, os.path.join(dst, "model.safetensors"))
        return
    gen = torch.Generator().manual_seed(0)
    orders = {}
    for name, t in iter_tensors(src):
        base = name[:-len(".weight")] if name.endswith(".weight") else name
        if base.rsplit(".", 1)[-1] not in _LINEARS:
            out[name] = t.to(getattr(torch, rest_dtype)) if t.is_floating_point() else t
            continue
        w = t.float()
        n, k = w.shape
        g = k if group == -1 else group
        if k % g:
            raise SystemExit(f"{name}: {k} inputs are not a multiple of --group {g}")
        perm = None
        if act_order and method == "gptq":
            key = (base.rsplit(".", 2)[0], {"k_proj": "q_proj", "v_proj": "q_proj",
                                            "up_proj": "gate_proj"}.get(base.rsplit(".", 1)[1],
                                                                        base.rsplit(".", 1)[1]))
            perm = orders.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = (torch.argsort(perm) // g).to(torch.int32)  # column perm[i] in group i // g
            wg = w[:, perm].view(n, k // g, g)
        else:
            g_idx = (torch.arange(k) // g).to(torch.int32)
            wg = w.view(n, k // g, g)
        lo, hi = wg.amin(-1), wg.amax(-1)
        s = ((hi - lo) / 15).clamp_min(1e-6).half()
        z = torch.round(-lo / s.float()).clamp(0, 15)
        q = torch.round(wg / s.float()[..., None] + z[..., None]).clamp(0, 15).to(torch.int32)
        q = q.view(n, k)
        if perm is not None:
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(k)
            q = q[:, inv]  # back to the natural column order
        zeros, scales = z.to(torch.int32).t().contiguous(), s.t().contiguous()  # [K/G, N]
        if method == "awq":
            out[base + ".qweight"] = _pack(q.t().contiguous(), _AWQ_ORDER)
            out[base + ".qzeros"] = _pack(zeros, _AWQ_ORDER)
        else:
            out[base + ".qweight"] = _pack(q.contiguous()).t().contiguous()
            out[base + ".qzeros"] = _pack((zeros - 1) & 0xF)
            out[base + ".g_idx"] = g_idx
        out[base + ".scales"] = scales
    save_file(out, os.path.join(dst, "model.safetensors"))
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        conf = json.load(f)
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    qc.update({"version": "gemm", "zero_point": True} if method == "awq" else
              {"desc_act": act_order, "sym": False, "checkpoint_format": "gptq"})
    conf["quantization_config"] = qc
    with open(cfg_path, "w") as f:
        json.dump(conf, f)


_CHILD = r"""
import json, resource, sys, time
import pyspec
path, tokens, packed = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = pyspec.LLM(path, draft="none", progress=False, packed_weights=packed)
ids = llm.encode("Write a short story about a lighthouse keeper who finds a message in a bottle.")
p = pyspec.SamplingParams(max_tokens=tokens, ignore_eos=True)
llm.generate([ids], [pyspec.SamplingParams(max_tokens=8, ignore_eos=True)])  # warm-up
t0 = time.perf_counter()
out = llm.generate([ids], [p])[0]
dt = time.perf_counter() - t0
rss = int(open("/proc/self/statm").read().split()[1]) * 4096
d = llm.model.describe()
print(json.dumps({"tok_s": len(out.token_ids) / dt, "rss_mb": rss / 1e6,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
                  "packed": d["packed"], "tokens": out.token_ids}))
"""


# Decode steps of both models in one process, alternating (the same machine state for both), at
# one context: median step time per model, and a torch.profiler pass over each model's steps
# (self time by op and by pyspec range: the decoder layers, lm_head).
_CHILD_STEPS = r"""
import json, statistics, sys, time
import torch
import pyspec
from pyspec.runner import ModelRunner, SeqStep
paths, steps = sys.argv[1:3], int(sys.argv[3])
llms = [pyspec.LLM(p, draft="none", progress=False, packed_weights="auto") for p in paths]
ids = llms[0].encode("Write a short story about a lighthouse keeper who finds a message in a bottle.")
runs = []
for llm in llms:
    r = ModelRunner(llm.model, num_blocks=16, block_size=16)
    table = list(range(16))
    out = r.step([SeqStep(ids, 0, table, None, "last")])
    r.commit_kv(out, 0, range(len(ids)), list(range(len(ids))))
    step = [SeqStep([ids[-1]], len(ids), table, None, "last")]
    for _ in range(5):
        r.step(step)
    runs.append((r, step))
times = [[], []]
for _ in range(steps):
    for k, (r, step) in enumerate(runs):
        t0 = time.perf_counter()
        r.step(step)
        times[k].append(time.perf_counter() - t0)
prof = []
for r, step in runs:
    with torch.profiler.profile() as p:
        for _ in range(50):
            r.step(step)
    top = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    prof.append([(e.key, round(e.self_cpu_time_total / 50 / 1e3, 3)) for e in top])
print(json.dumps({"step_ms": [round(statistics.median(t) * 1e3, 3) for t in times],
                  "step_ms_p10": [round(sorted(t)[len(t) // 10] * 1e3, 3) for t in times],
                  "profile_self_ms_per_step": prof,
                  "packed": [llm.model.describe()["packed"] for llm in llms]}))
"""


def _run(path: str, tokens: int, packed: str = "auto") -> dict:
    r = subprocess.run([sys.executable, "-c", _CHILD, path, str(tokens), packed],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="float safetensors folder (default: the "
                                                  "embedded model)")
    ap.add_argument("--method", choices=("awq", "gptq", "bfloat16", "float16"), default="awq")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--act-order", action="store_true", help="GPTQ with act-order groups")
    ap.add_argument("--rest-dtype", choices=("float16", "float32"), default="float16",
                    help="the dtype of the quantized checkpoint's embeddings, norms and lm_head "
                         "(float16: as published files; float32: as the float checkpoint)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0,
                    help="also time N decode steps of the float and the quantized model in one "
                         "process, alternating, with a profile of each (0: off)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    src = args.model
    if src is None:
        from pyspec.models.default import default_model_path

        src = default_model_path(progress=False)
    tmp = tempfile.mkdtemp()
    try:
        qdir = os.path.join(tmp, "q")
        t0 = time.perf_counter()
        quantize_folder(src, qdir, args.method, args.group, args.act_order, args.rest_dtype)
        sixteen = args.method in ("bfloat16", "float16")
        q = f"{args.method} checkpoint" if sixteen else f"{args.method} 4-bit"
        runs = {"float32 packed": [], q: [], q + " dequantized to float32": []}
        for _ in range(args.repeats):
            runs["float32 packed"].append(_run(src, args.tokens))
            runs[q].append(_run(qdir, args.tokens, "codes" if sixteen else "auto"))
            runs[q + " dequantized to float32"].append(_run(qdir, args.tokens, "off"))
        same_process = None
        if args.steps:
            r = subprocess.run([sys.executable, "-c", _CHILD_STEPS, src, qdir, str(args.steps)],
                               capture_output=True, text=True, timeout=3600)
            if r.returncode != 0:
                raise SystemExit(r.stderr[-2000:])
            same_process = json.loads(r.stdout.strip().splitlines()[-1])
            ms = same_process["step_ms"]
            same_process["step_time_ratio_quantized_over_float"] = round(ms[1] / ms[0], 3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    best = {k: max(v, key=lambda r: r["tok_s"]) for k, v in runs.items()}
    a, b = best["float32 packed"], best[q]
    out = {"model": src, "method": args.method, "group_size": args.group,
           "act_order": args.act_order, "rest_dtype": args.rest_dtype, "tokens": args.tokens, "cpu_count": os.cpu_count(),
           "quantize_s": round(time.perf_counter() - t0, 1),
           "variants": {k: {"tok_s": [round(r["tok_s"], 1) for r in v],
                            "rss_mb": round(best[k]["rss_mb"], 1),
                            "peak_rss_mb": round(best[k]["peak_rss_mb"], 1),
                            "packed": best[k]["packed"]} for k, v in runs.items()},
           "speed_ratio_quantized_over_float": round(b["tok_s"] / a["tok_s"], 3)}
    if same_process is not None:
        out["same_process_decode_steps"] = dict(same_process, steps=args.steps)
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
