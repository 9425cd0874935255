"""How well a trained EAGLE head predicts the target, outside the engine: top-1 agreement with the
target's greedy next token at depth 1 (true features) and depth 2 (the head's own predicted
features, as a depth-2 tree node sees them), on continuations the target generates (float32
features) for four prompt sets:

- ``mt_bench``: MT-bench first turns (the traffic the goals are stated on);
- ``heldout``: seed prompts of the head's own prompt set that it never trained on (same
  templates and word pools, another seed; for the ``self`` set, requests the target writes with
  another seed): agreement here close to the training corpus's means the head is not
  overfitting;
- ``novel_topics``: the basic templates over topics that no prompt set's pools contain: what the
  head does with words it never saw;
- ``training_corpus`` (when the folder, or --data, holds data.pt): the head's last training
  sequences (bfloat16 features).

Each set also reports how often the target's token lies in the head's draft vocabulary (the head
cannot propose another) and depth-1 agreement split by the target's own confidence (its top
probability): a gap between sets at equal confidence is the head's, not the text's. The
``breakdown`` splits depth-1 agreement further by the kind of token the target wants next (one
that continues a word, one that repeats a pair of tokens already in the context) and puts prompt
lookup beside the head at the same positions (the first token it would draft: the engine's
drafters try it first), with how often either of the two is right.

    python bench/eagle_offline_accuracy.py ~/.cache/pyspec/drafters/smollm2-eagle-v3
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))

# Topics for the novel_topics set: none is (or contains, or is contained in) an entry of any word
# pool of pyspec.train.data (checked at run time).
NOVEL_TOPICS = [
    "submarines", "the Eiffel Tower", "hip hop", "tax returns", "Shakespeare's sonnets",
    "lighthouses", "Mount Everest", "artificial sweeteners", "the Danube", "ballet",
    "cough medicine", "train stations", "sunscreen", "piano tuning", "crossbows",
    "medieval monasteries", "the Titanic", "vinyl records", "hurricanes", "credit scores",
]
CONFIDENCE_BINS = ((0.0, 0.3), (0.3, 0.5), (0.5, 0.7), (0.7, 0.9), (0.9, 1.01))


def head_from(folder, llm):
    from safetensors.torch import load_file

    from pyspec.train.eagle import EagleHead

    conf = json.load(open(os.path.join(folder, "drafter.json")))
    dv = load_file(os.path.join(folder, "drafter.safetensors"))["draft_vocab"]
    head = EagleHead(llm.model, dv, int(conf["eagle"]["intermediate_size"]),
                     conf["eagle"].get("feature_layers"))
    state = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)["head"]
    head.load_state_dict(state)
    return head.eval(), dv, conf


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


def novel_prompts(n: int):
    import random

    from pyspec.train import data as D

    pools = [w.lower() for w in D.TOPICS + D.SCIENCE + D.HUMANITIES + D.PLACES + D.THINGS
             + D.WIDE_POOLS]
    clash = [t for t in NOVEL_TOPICS if any(t.lower() in w or w in t.lower() for w in pools)]
    if clash:
        raise SystemExit(f"NOVEL_TOPICS entries found in the training pools: {clash}")
    rng = random.Random(3)
    with_topic = [t for t in D.TEMPLATES if "{t}" in t and "{c}" not in t]
    return [rng.choice(with_topic).format(t=t, u=u)
            for t, u in (rng.sample(NOVEL_TOPICS, 2) for _ in range(n))]


def _generated_part(head, dv, tokens, hidden, logits, p0, word_cont):
    """Depth-1/2 agreement, the target's confidence and its token at every position from ``p0``
    (the last prompt position) on; ``logits[p]`` is the target's prediction after position p.
    Also per position: the target's token continues a word (``word_cont``: a bool per vocabulary
    id), the pair (context's last token, target's token) occurred earlier in the context, and
    prompt lookup's first drafted token is the target's."""
    from pyspec.drafters.ngram import prompt_lookup_match

    nxt = logits.argmax(-1)
    top = torch.softmax(logits.float(), dim=-1).max(-1).values
    d1, d2 = agreement(head, dv, tokens[1:len(hidden) + 1], hidden, nxt[1:])
    m = d1[p0:].numel()
    want = nxt[1:][p0:p0 + m]
    ctx = [int(t) for t in tokens]
    cont, pair, lk = [], [], []
    for i in range(m):
        # Entry i: the context runs to position p0 + i + 1 and the target wants `want[i]` next.
        end, w = p0 + i + 2, int(want[i])
        prev = ctx[end - 1]
        cont.append(bool(word_cont[w]))
        pair.append(any(ctx[j] == prev and ctx[j + 1] == w for j in range(end - 2)))
        # Prompt lookup's first drafted token: the one after the latest earlier match.
        n, where = prompt_lookup_match(ctx[:end], 3)
        lk.append(n > 0 and ctx[where] == w)
    flags = torch.tensor([cont, pair, lk], dtype=torch.bool)
    return d1[p0:], d2[p0:], top[1:][p0:p0 + m], want, flags


def word_continuations(tokenizer, vocab: int) -> torch.Tensor:
    """Per token id: whether the token starts with a letter or digit, i.e. continues the word
    before it (a word's first token carries its leading space)."""
    out = torch.zeros(vocab, dtype=torch.bool)
    for i in range(vocab):
        s = tokenizer.decode([i])
        out[i] = bool(s) and s[0].isalnum()
    return out


def score(llm, head, dv, prompts, max_tokens, word_cont):
    from pyspec.runner import ModelRunner, SeqStep

    parts = []
    for p in prompts:
        ids = llm.chat_prompt([{"role": "user", "content": p}])
        gen = llm.generate([ids], {"max_tokens": max_tokens})[0].token_ids
        full = ids + gen
        runner = ModelRunner(llm.model, num_blocks=(len(full) + 31) // 16, block_size=16)
        res = runner.step([SeqStep(full, 0, list(range(runner.kv.num_blocks)), None, "all")],
                          return_hidden=head.feature_layers)
        parts.append(_generated_part(head, dv, full, res.hidden[:-1].float(), res.logits,
                                     len(ids) - 1, word_cont))
    return summarize(parts, dv, prompts=len(prompts))


def summarize(parts, dv, **extra):
    d1, d2, conf, nxt, flags = (torch.cat(x, dim=-1) for x in zip(*parts))
    in_vocab = torch.zeros(int(max(int(dv.max()), int(nxt.max())) + 1), dtype=torch.bool)
    in_vocab[dv] = True
    out = dict(extra, positions=int(d1.numel()), depth1_top1=round(float(d1.float().mean()), 4),
               depth2_top1=round(float(d2.float().mean()), 4),
               target_token_in_draft_vocab=round(float(in_vocab[nxt].float().mean()), 4),
               target_confidence_mean=round(float(conf.mean()), 4))
    out["depth1_top1_by_target_confidence"] = {
        f"{lo:.1f}-{min(hi, 1.0):.1f}": [int(m.sum()), round(float(d1[m].float().mean()), 4)
                                         if bool(m.any()) else None]
        for lo, hi in CONFIDENCE_BINS for m in [(conf >= lo) & (conf < hi)]}
    cont, pair, lookup = flags
    sure = conf >= 0.9

    def row(m):  # [positions, share of all, head depth-1, prompt lookup, head or lookup]
        n = int(m.sum())
        if n == 0:
            return [0, 0.0, None, None, None]
        return [n, round(n / d1.numel(), 4)] + [round(float(x[m].float().mean()), 4)
                                                for x in (d1, lookup, d1 | lookup)]

    out["breakdown"] = {"columns": ["positions", "share", "head_depth1", "prompt_lookup",
                                    "head_or_lookup"],
                        "all": row(torch.ones_like(d1)),
                        "continues_a_word": row(cont), "starts_a_word_or_other": row(~cont),
                        "pair_seen_in_context": row(pair), "pair_not_seen": row(~pair),
                        "target_at_least_0.9_sure": row(sure),
                        "target_at_least_0.9_sure_pair_seen": row(sure & pair),
                        "target_at_least_0.9_sure_pair_not_seen": row(sure & ~pair)}
    return out


def main(argv=None):
    from pyspec.train.data import PROMPT_SETS

    ap = argparse.ArgumentParser()
    ap.add_argument("folder", help="a train-draft --method eagle output folder (checkpoint.pt)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per generated set")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--train-seqs", type=int, default=64)
    ap.add_argument("--data", default=None, help="the training corpus (default: FOLDER/data.pt)")
    ap.add_argument("--heldout-set", default=None, choices=PROMPT_SETS,
                    help="the prompt set of the heldout prompts (default: the recipe's, its last "
                    "if several; seed-0 prompts of that set, which the recipes train on, are "
                    "left out)")
    ap.add_argument("--sets", default="mt_bench,heldout,novel_topics,training_corpus",
                    help="comma-separated subset of the sets above")
    args = ap.parse_args(argv)
    sets = set(args.sets.split(","))

    import pyspec
    from pyspec.train import data as D
    from pyspec.train.eagle import _rms
    from pyspec.train.evaluate import read_prompts

    llm = pyspec.LLM(None, draft="none", progress=False, kv_cache_tokens=2048)
    head, dv, conf = head_from(args.folder, llm)
    word_cont = word_continuations(llm.tokenizer, llm.model.cfg.vocab_size)
    recipe = (conf.get("manifest") or {}).get("recipe") or {}
    out = {}
    if "mt_bench" in sets:
        rows = [json.loads(line) for line in open(os.path.join(HERE, "data",
                                                               "mt_bench_questions.jsonl"))]
        rows = rows[::max(1, len(rows) // args.prompts)][:args.prompts]
        out["mt_bench"] = score(llm, head, dv, [r["turns"][0] for r in rows], args.max_tokens,
                                word_cont)
    if "heldout" in sets:
        pset = args.heldout_set or (recipe.get("prompt_set") or "diverse").split(",")[-1]
        if pset == "self":  # requests the target writes with another seed, less the trained
            path = os.path.join(args.folder, "self-prompts.jsonl")
            seen = {text for _, text in read_prompts(path)} if os.path.isfile(path) else set()
            fresh = D.self_prompts(llm, 2 * args.prompts, seed=777, progress=False)
        else:
            seen = set(D.seed_prompts(int(recipe.get("seed_prompts", 2400)), seed=0,
                                      prompt_set=pset))
            fresh = D.seed_prompts(20 * args.prompts, seed=777, prompt_set=pset)
        held = [p for p in fresh if p not in seen][:args.prompts]
        out["heldout"] = dict(score(llm, head, dv, held, args.max_tokens, word_cont),
                              prompt_set=pset)
    if "novel_topics" in sets:
        out["novel_topics"] = score(llm, head, dv, novel_prompts(args.prompts), args.max_tokens,
                                    word_cont)
    layers = head.feature_layers
    data = args.data or os.path.join(args.folder, "data.pt" if len(layers) == 1 else
                                     "features-" + "-".join(map(str, layers)) + ".pt")
    if "training_corpus" in sets and os.path.isfile(data) and args.train_seqs > 0:
        from pyspec.train.data import load_sequences

        seqs = load_sequences(data)[-args.train_seqs:]
        lm_head = llm.model.lm_head.float()
        parts = []
        for s in seqs:
            h = s.hidden.float()
            logits = F.linear(_rms(h[:, -head.cfg.hidden_size:], head.teacher_norm, head.eps),
                              lm_head)
            parts.append(_generated_part(head, dv, s.tokens, h, logits, s.num_prompt - 1,
                                         word_cont))
        out["training_corpus"] = summarize(parts, dv, sequences=len(seqs))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
