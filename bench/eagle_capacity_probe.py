"""Does a bigger EAGLE head agree with the target more? The shipped head (1 decoder layer, MLP
1024) fine-tuned on the shipped corpus's answers to requests written like a person's, side by side
with the same head widened to an MLP of 3072 and deepened by a second decoder layer. The added
parts start as the identity (zero output maps), so every variant starts from the shipped head's
function and gets the same data, steps and learning rate. Reported: top-1 agreement with the
target at depth 1 and 2 on MT-bench first turns (continuations the target generates, as
``eagle_offline_accuracy.py`` scores them) and on held-out answers of the same corpus (every
tenth natural document, never trained on).
``--from-scratch`` trains each variant from a fresh head instead (lr 1e-3, as v9 was trained).

    python bench/eagle_capacity_probe.py --out bench/results/eagle_capacity_probe.json

(The corpus's features come from one teacher-forced bfloat16 pass of the target, kept in
``--features``: 10 minutes here the first time, 1.9 GB.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


class ExtraLayer(nn.Module):
    """A second decoder layer's weights, named as the head's own; output maps start at zero."""

    def __init__(self, h: int, nh: int, nkv: int, hd: int, inter: int):
        super().__init__()
        self.ln1, self.ln2 = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.q, self.o = nn.Linear(h, nh * hd, bias=False), nn.Linear(nh * hd, h, bias=False)
        self.k, self.v = nn.Linear(h, nkv * hd, bias=False), nn.Linear(h, nkv * hd, bias=False)
        self.gate, self.up = nn.Linear(h, inter, bias=False), nn.Linear(h, inter, bias=False)
        self.down = nn.Linear(inter, h, bias=False)
        with torch.no_grad():
            self.o.weight.zero_()
            self.down.weight.zero_()


def head_classes():
    from pyspec.train.eagle import EagleHead, _rms

    class TwoLayers(EagleHead):
        """kv is ((k, v) of layer 1, (k, v) of layer 2); ctx likewise, then the earlier passes'."""

        def __init__(self, target, draft_vocab, intermediate_size, feature_layers=None):
            super().__init__(target, draft_vocab, intermediate_size, feature_layers)
            self.second = ExtraLayer(target.cfg.hidden_size, self.nh, self.nkv, self.hd,
                                     intermediate_size)

        def load_exported(self, tensors):
            second = self.second
            del self.second
            super().load_exported(tensors)
            self.second = second

        def forward(self, next_tokens, feats, cos, sin, ctx=None):
            x = self.fc(torch.cat([F.embedding(next_tokens, self.embed), feats], dim=-1))
            c = [None, None] if ctx is None else [(*ctx[i], [e[i] for e in ctx[2]])
                                                  for i in range(2)]
            x, kv1 = self.decoder_layer(self, x, cos, sin, c[0])
            x, kv2 = self.decoder_layer(self.second, x, cos, sin, c[1])
            return x, F.linear(_rms(x, self.norm, self.eps), self.lm_head), (kv1, kv2)

    class WideMLP(EagleHead):
        """The shipped head's MLP units first; the added units' down map starts at zero."""

        def load_exported(self, tensors):
            t = dict(tensors)
            n = t["layer.mlp.gate_proj.weight"].shape[0]
            with torch.no_grad():
                for name, mod, rows in (("gate_proj", self.gate, True), ("up_proj", self.up, True),
                                        ("down_proj", self.down, False)):
                    w = mod.weight.detach().clone()
                    if not rows:
                        w.zero_()
                    src = t[f"layer.mlp.{name}.weight"].float()
                    if rows:
                        w[:n] = src
                    else:
                        w[:, :n] = src
                    t[f"layer.mlp.{name}.weight"] = w
            super().load_exported(t)

    return {"shipped": (EagleHead, 1024), "wide_mlp_3072": (WideMLP, 3072),
            "two_layers": (TwoLayers, 1024)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--features", default="/tmp/eagle_capacity_probe/features-30.pt",
                    help="the shipped corpus's features (computed and kept here when missing; "
                         "train-draft --data pyspec/data/default_corpus keeps the same file)")
    ap.add_argument("--natural-from", type=int, default=4800,
                    help="first document of the answers to requests written like a person's "
                         "(corpus v2: the 4,800 documents of v1 come first)")
    ap.add_argument("--variants", default="shipped,wide_mlp_3072,two_layers")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=None, help="default 3e-4, or 1e-3 from scratch")
    ap.add_argument("--from-scratch", action="store_true",
                    help="train every variant from a fresh head instead of growing the shipped one")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--val-docs", type=int, default=120)
    ap.add_argument("--train-docs", type=int, default=None, help="at most this many (a smoke run)")
    ap.add_argument("--work", default="/tmp/eagle_capacity_probe")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.lr is None:
        args.lr = 1e-3 if args.from_scratch else 3e-4
    classes = head_classes()
    unknown = [v for v in args.variants.split(",") if v not in classes]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {', '.join(classes)}")

    sys.path.insert(0, HERE)
    import eagle_offline_accuracy as O
    from safetensors.torch import load_file

    import pyspec
    from pyspec.models.default import default_corpus_path, default_drafter_path
    from pyspec.train import data as D
    from pyspec.train import eagle as E

    if not os.path.isfile(args.features):
        gen = pyspec.LLM(None, draft="none", dtype="bfloat16", kv_cache_tokens=1024,
                         progress=False)
        docs = D.corpus_sequences(default_corpus_path(), gen.model.cfg.vocab_size)
        os.makedirs(os.path.dirname(os.path.abspath(args.features)), exist_ok=True)
        torch.save(D.with_feature_layers(gen, docs, [gen.model.cfg.num_hidden_layers]),
                   args.features)
        del gen, docs
    torch.manual_seed(0)
    seqs = torch.load(args.features, weights_only=False)
    natural = seqs[args.natural_from:]
    val = natural[::10][:args.val_docs]
    train = [s for i, s in enumerate(natural) if i % 10][:args.train_docs]
    del seqs
    print(f"train {len(train)} documents, {sum(len(s.tokens) for s in train)} tokens; "
          f"held out {len(val)}", flush=True)
    llm = pyspec.LLM(None, draft="none", dtype="float32", kv_cache_tokens=2048, progress=False)
    init = load_file(os.path.join(default_drafter_path(), "drafter.safetensors"))
    dv = init["draft_vocab"].to(torch.int64)
    word_cont = O.word_continuations(llm.tokenizer, llm.model.cfg.vocab_size)
    rows = [json.loads(line) for line in open(os.path.join(HERE, "data",
                                                           "mt_bench_questions.jsonl"))]
    rows = rows[::max(1, len(rows) // args.prompts)][:args.prompts]
    lm_head = llm.model.lm_head.float()

    @torch.no_grad()
    def evaluate(head):
        head.eval()
        mt = O.score(llm, head, dv, [r["turns"][0] for r in rows], args.max_tokens, word_cont)
        parts = []
        for s in val:
            h = s.hidden.float()
            logits = F.linear(E._rms(h, head.teacher_norm, head.eps), lm_head)
            parts.append(O._generated_part(head, dv, s.tokens, h, logits, 0, word_cont))
        held = O.summarize(parts, dv, sequences=len(val))
        return {"mt_bench_depth1_depth2": [mt["depth1_top1"], mt["depth2_top1"]],
                "heldout_natural_depth1_depth2": [held["depth1_top1"], held["depth2_top1"]]}

    base = E.EagleHead(llm.model, dv, 1024)
    base.load_exported(init)
    out = {"from_scratch": args.from_scratch, "lr": args.lr, "shipped_untrained": evaluate(base)}
    print("shipped_untrained", json.dumps(out["shipped_untrained"]), flush=True)
    for name in args.variants.split(","):
        cls, inter = classes[name]
        t0 = time.time()
        head = E.train(llm, train, os.path.join(args.work, name), draft_vocab=dv,
                       intermediate_size=inter, epochs=args.epochs, lr=args.lr, max_entries=256,
                       steps=3, init=None if args.from_scratch else init, progress=False,
                       head_class=cls)
        out[name] = dict(evaluate(head), train_seconds=round(time.time() - t0, 1))
        print(name, json.dumps(out[name]), flush=True)
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
