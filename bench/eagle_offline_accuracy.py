"""How well a trained EAGLE head predicts the target, outside the engine: top-1 agreement with the
target's greedy next token at depth 1 (true features) and depth 2 (the head's own predicted
features, as a depth-2 tree node sees them), on MT-bench continuations the target generates
(float32 features) and, when the training folder still holds it, on the head's own training
corpus (data.pt, bfloat16 features). A large gap between the two says the corpus does not cover
the traffic.

    python bench/eagle_offline_accuracy.py ~/.cache/pyspec/drafters/smollm2-eagle-v2 \
        --data ~/.cache/pyspec/drafters/smollm2-eagle-v1/data.pt
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


def head_from(folder, llm):
    from safetensors.torch import load_file

    from pyspec.train.eagle import EagleHead

    conf = json.load(open(os.path.join(folder, "drafter.json")))
    dv = load_file(os.path.join(folder, "drafter.safetensors"))["draft_vocab"]
    head = EagleHead(llm.model, dv, int(conf["eagle"]["intermediate_size"]))
    state = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=False)["head"]
    head.load_state_dict(state)
    return head.eval(), dv


@torch.no_grad()
def agreement(head, dv, tokens, feats, target_next):
    """tokens[p] = t_{p+1}, feats[p] = f_p, target_next[p] = the target's argmax after p + 1."""
    t = feats.shape[0]
    cos, sin = head.rope(t + 1)
    tok = torch.as_tensor(tokens)[None]
    g1, l1, kv1 = head(tok, feats[None], cos[:t], sin[:t])
    _, l2, _ = head(F.pad(tok[:, 1:], (0, 1)), g1, cos[1:t + 1], sin[1:t + 1], ctx=(*kv1, []))
    d1 = dv[l1[0, :t - 1].argmax(-1)] == target_next[:t - 1]
    d2 = dv[l2[0, :t - 2].argmax(-1)] == target_next[1:t - 1]
    return d1, d2


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", help="a train-draft --method eagle output folder (checkpoint.pt)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--train-seqs", type=int, default=64)
    ap.add_argument("--data", default=None, help="the training corpus (default: FOLDER/data.pt)")
    args = ap.parse_args(argv)

    import pyspec
    from pyspec.runner import ModelRunner, SeqStep
    from pyspec.train.eagle import _rms

    llm = pyspec.LLM(None, draft="none", progress=False, kv_cache_tokens=2048)
    head, dv = head_from(args.folder, llm)
    rows = [json.loads(line) for line in open(os.path.join(HERE, "data",
                                                           "mt_bench_questions.jsonl"))]
    rows = rows[::max(1, len(rows) // args.prompts)][:args.prompts]
    out = {}
    d1s, d2s = [], []
    for r in rows:
        ids = llm.chat_prompt([{"role": "user", "content": r["turns"][0]}])
        gen = llm.generate([ids], {"max_tokens": args.max_tokens})[0].token_ids
        full = ids + gen
        runner = ModelRunner(llm.model, num_blocks=(len(full) + 31) // 16, block_size=16)
        res = runner.step([SeqStep(full, 0, list(range(runner.kv.num_blocks)), None, "all")],
                          return_hidden=True)
        nxt = res.logits.argmax(-1)  # the target's prediction after each position
        d1, d2 = agreement(head, dv, full[1:], res.hidden[:-1].float(), nxt[1:])
        p0 = len(ids) - 1  # score the generated part only
        d1s.append(d1[p0:])
        d2s.append(d2[p0:])
    out["mt_bench"] = {"prompts": len(rows), "positions": int(sum(x.numel() for x in d1s)),
                       "depth1_top1": float(torch.cat(d1s).float().mean()),
                       "depth2_top1": float(torch.cat(d2s).float().mean())}
    data = args.data or os.path.join(args.folder, "data.pt")
    if os.path.isfile(data) and args.train_seqs > 0:
        seqs = torch.load(data, weights_only=False)[-args.train_seqs:]
        d1s, d2s = [], []
        for s in seqs:
            h = s.hidden.float()
            logits = F.linear(_rms(h, head.teacher_norm, head.eps), head.teacher_head)
            nxt = dv[logits.argmax(-1)]  # the target's argmax within the draft vocabulary
            d1, d2 = agreement(head, dv, s.tokens[1:len(h) + 1], h, nxt[1:])
            d1s.append(d1[s.num_prompt - 1:])
            d2s.append(d2[s.num_prompt - 1:])
        out["training_corpus"] = {"sequences": len(seqs),
                                  "positions": int(sum(x.numel() for x in d1s)),
                                  "depth1_top1": float(torch.cat(d1s).float().mean()),
                                  "depth2_top1": float(torch.cat(d2s).float().mean())}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
