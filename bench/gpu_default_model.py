"""The embedded default model end to end on a device: plain against speculative decoding (each
drafter) at several batch sizes, with and without CUDA graphs, and HF transformers' ``generate``
on the same model and device, all in one run (issue goals: speculative >= 1.5x plain at batch 1,
plain >= 1.5x HF transformers).

MT-bench first turns (bench/data/mt_bench_questions.jsonl) through the chat template, greedy,
exactly --max-tokens new tokens each (EOS ignored). A batch of B takes the first B prompts
(cycled). Per engine and batch: tokens/s over the batch's wall time, TPOT (each request's time
after its first token over its later tokens; mean and p90), TTFT, tokens per target step, and
how many outputs equal the plain engine's (same graphs setting).

    python bench/gpu_default_model.py --device cuda --out results.json
    python bench/gpu_default_model.py --device cpu --prompts 2 --max-tokens 8 --batch 1,2 \\
        --drafters none,ngram --graphs off      # a smoke run

On the GPU machine the default model's GGUF arrives in parts (``bench/gguf_parts.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = os.path.join(HERE, "data", "mt_bench_questions.jsonl")
sys.path.insert(0, HERE)
from bench_gpu_model import timed  # noqa: E402


def first_turns(n: int):
    with open(PROMPTS) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def run_engine(llm, prompts, batches, max_tokens, device):
    """Per batch size: the measurements of one generate() call over that many prompts."""
    import pyspec

    sp = pyspec.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    warm = pyspec.SamplingParams(max_tokens=min(32, max_tokens), temperature=0.0, ignore_eos=True)
    encoded = [llm.chat_prompt([{"role": "user", "content": p}]) for p in prompts]
    rows, ids = [], {}
    for b in batches:
        batch = [encoded[i % len(encoded)] for i in range(b)]
        # Untimed first: the batch's CUDA graphs are captured (and Triton's kernels compiled)
        # the first time a step needs them; captures left for the timed run are reported.
        llm.generate(batch, warm)
        captured = _captures(llm)
        outs, wall = timed(device, lambda: llm.generate(batch, sp))
        tokens = sum(len(o.token_ids) for o in outs)
        tpot = [(o.seconds - o.time_to_first_token) / (len(o.token_ids) - 1) for o in outs
                if o.time_to_first_token is not None and len(o.token_ids) > 1]
        steps = sum(o.stats.steps for o in outs)
        rows.append({
            "batch": b, "tokens": tokens, "seconds": round(wall, 3),
            "tok_s": round(tokens / wall, 1),
            "tpot_ms_mean": round(1e3 * statistics.mean(tpot), 3) if tpot else None,
            "tpot_ms_p90": round(1e3 * sorted(tpot)[int(0.9 * (len(tpot) - 1))], 3)
            if tpot else None,
            "ttft_ms_mean": round(1e3 * statistics.mean(
                o.time_to_first_token for o in outs if o.time_to_first_token is not None), 3),
            "tokens_per_step": round(tokens / steps, 3) if steps else None,
            "captures_while_timed": None if captured is None else _captures(llm) - captured})
        ids[b] = [o.token_ids for o in outs]
    return rows, ids


def _captures(llm):
    g = llm.describe().get("cuda_graphs")
    return None if g is None else g["captures"]


def hf_baseline(model_dir, prompts, max_tokens, device, dtype):
    """HF transformers' greedy ``generate`` on the same checkpoint, one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).to(device).eval()
    encoded = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True),
                   return_tensors="pt", add_special_tokens=False).input_ids for p in prompts]
    with torch.no_grad():
        model.generate(encoded[0].to(device), max_new_tokens=8, do_sample=False)  # warm-up
        outs, wall = timed(device, lambda: [
            model.generate(x.to(device), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           do_sample=False) for x in encoded])
    tokens = sum(o.shape[1] - x.shape[1] for o, x in zip(outs, encoded))
    return {"batch": 1, "tokens": tokens, "seconds": round(wall, 3),
            "tok_s": round(tokens / wall, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--drafters", default="none,ngram,default,eagle")
    ap.add_argument("--graphs", default="auto", choices=["auto", "off", "both"],
                    help="auto: with and without CUDA graphs where they can run (cuda + triton)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    import pyspec
    from pyspec.models.default import default_model_path
    from pyspec.triton_attention import available as triton_available

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    prompts = first_turns(args.prompts)
    batches = [int(b) for b in args.batch.split(",") if b]
    drafters = [d for d in args.drafters.split(",") if d]
    graphs = [False]
    if args.graphs != "off" and cuda and triton_available():
        graphs = [False, True]
    info = {"device": args.device, "dtype": dtype, "prompts": len(prompts),
            "max_tokens": args.max_tokens, "torch": torch.__version__}
    if cuda:
        info["gpu"] = torch.cuda.get_device_name(device)
    print(json.dumps(info), flush=True)
    result = {"info": info, "engines": [], "hf": None, "ratios": {}}
    for g in graphs:
        plain_ids = None
        for d in drafters:
            t0 = time.perf_counter()
            llm = pyspec.LLM(draft=d, device=args.device, dtype=dtype,
                             max_num_seqs=max(batches), kv_cache_tokens=max(batches) * 1024,
                             attention_backend="triton" if g else "native", cuda_graphs=g)
            rows, ids = run_engine(llm, prompts, batches, args.max_tokens, device)
            if d == "none":
                plain_ids = ids
            for r in rows:
                r["identical_to_plain"] = None if plain_ids is None else sum(
                    a == p for a, p in zip(ids[r["batch"]], plain_ids[r["batch"]]))
            entry = {"drafter": d, "cuda_graphs": g, "load_s": round(time.perf_counter() - t0, 1),
                     "rows": rows}
            if g:
                entry["graphs"] = llm.describe().get("cuda_graphs")
            result["engines"].append(entry)
            print(json.dumps(entry), flush=True)
            _write(args.out, result)  # (what finished survives a timeout)
            del llm
    if not args.no_hf:
        result["hf"] = hf_baseline(default_model_path(), prompts, args.max_tokens, device,
                                   getattr(torch, dtype))
        print(json.dumps({"hf": result["hf"]}), flush=True)
    # Ratios in this run: each drafter against plain decoding (same batch, same graphs setting),
    # and plain decoding at batch 1 against HF transformers.
    by = {(e["drafter"], e["cuda_graphs"], r["batch"]): r["tok_s"]
          for e in result["engines"] for r in e["rows"]}
    for (d, g, b), v in by.items():
        base = by.get(("none", g, b))
        if d != "none" and base:
            result["ratios"][f"{d}/plain graphs={g} batch={b}"] = round(v / base, 3)
        if d == "none" and b == 1 and result["hf"]:
            result["ratios"][f"plain/hf graphs={g} batch=1"] = round(v / result["hf"]["tok_s"], 3)
    print(json.dumps({"ratios": result["ratios"]}, indent=1), flush=True)
    _write(args.out, result)
    return result


def _write(path, result):
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
