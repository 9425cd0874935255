"""EAGLE heads (pyspec.train.eagle): training on fused target layers, unrolled training passes
that see what tree nodes see, and the inference drafter computing what the trained head does."""

import json
import os

import pytest
import torch

from pyspec import cli
from pyspec.train.data import load_sequences

from train_support import _lossless, _random_head


def test_train_eagle_on_fused_target_layers(tiny, trained, tmp_path):
    """--feature-layers: the corpus's features are recomputed for those target layers (kept next
    to the drafter), the head learns to read them fused (its fuse starts as "the final layer
    only"), the drafter records them and loads as a lossless drafter reading those layers."""
    from safetensors.torch import load_file

    from pyspec.train.eagle import EagleHead

    out = str(tmp_path / "fused")
    corpus = os.path.join(trained, "data.pt")
    base = ["train-draft", "--target", tiny, "--out", out, "--data", corpus]
    for bad in (["--feature-layers", "1"], ["--feature-layers", "1,x"],
                ["--feature-layers", "2,1"], ["--feature-layers", "1,2", "--method", "medusa"]):
        assert cli.main(base + bad) == 2, bad
    rc = cli.main(base + ["--feature-layers", "1,2", "--epochs", "2", "--lr", "3e-3",
                          "--draft-vocab", "80", "--intermediate-size", "32"])
    assert rc == 0
    conf = json.load(open(os.path.join(out, "drafter.json")))
    assert conf["eagle"]["feature_layers"] == [1, 2]
    assert conf["manifest"]["recipe"]["feature_layers"] == [1, 2]
    h = conf["hidden_size"]
    assert load_file(os.path.join(out, "drafter.safetensors"))["fuse.weight"].shape == (h, 2 * h)
    feats = load_sequences(os.path.join(out, "features-1-2.pt"))
    seqs = load_sequences(corpus)
    assert [s.tokens for s in feats] == [s.tokens for s in seqs]
    # The recomputed final layer is the recorded one (same target, bf16 storage).
    for a, b in zip(feats, seqs):
        torch.testing.assert_close(a.hidden[:, h:].float(), b.hidden.float(), atol=0.1, rtol=0.05)
    llm, ref = _lossless(tiny, out)
    assert "reads target layers 1,2" in llm.drafter_name
    # Training moved the fuse off its start (the final layer only) and lowered the loss.
    dv = load_file(os.path.join(out, "drafter.safetensors"))["draft_vocab"]
    fresh = EagleHead(ref.model, dv, 32, (1, 2))
    learned = EagleHead(ref.model, dv, 32, (1, 2))
    learned.load_state_dict(torch.load(os.path.join(out, "checkpoint.pt"),
                                       weights_only=True)["head"])
    assert float(learned.fuse.weight.detach()[:, :h].abs().sum()) > 0

    def loss(m):
        from pyspec.train.eagle import _rms, _tensors

        nxt, f, tgt, mask = _tensors(feats, list(range(len(feats))), 512, h)
        with torch.no_grad():
            t = torch.softmax(torch.nn.functional.linear(_rms(tgt, m.teacher_norm, m.eps),
                                                         m.teacher_head), -1)
            cos, sin = m.rope(f.shape[1])
            _, logits, _ = m(nxt, f, cos, sin)
            return float(-(t * torch.log_softmax(logits, -1)).sum(-1)[mask].mean())

    assert loss(learned) < loss(fresh) - 1e-3


def test_unrolled_training_passes_see_what_tree_nodes_see(tiny):
    """Pass k of the unrolled EAGLE training attends like a depth-k tree node at inference: row p
    equals the last row of a plain causal pass over the true rows 0..p followed by the row's own
    chain of predicted features (checked against that brute force, float32)."""
    llm, head = _random_head(tiny)
    b, t, h = 2, 9, llm.model.cfg.hidden_size
    toks = torch.randint(0, 40, (b, t + 3))
    feats = torch.randn(b, t, h)
    cos, sin = head.rope(t + 3)
    with torch.no_grad():
        g1, _, kv1 = head(toks[:, :t], feats, cos[:t], sin[:t])
        g2, _, kv2 = head(toks[:, 1:t + 1], g1, cos[1:t + 1], sin[1:t + 1], ctx=(*kv1, []))
        g3, l3, _ = head(toks[:, 2:t + 2], g2, cos[2:t + 2], sin[2:t + 2], ctx=(*kv1, [kv2]))
        for p in (0, 4, t - 1):
            seq_t = torch.cat([toks[:, :p + 1], toks[:, p + 1:p + 3]], dim=1)
            seq_f = torch.cat([feats[:, :p + 1], g1[:, p:p + 1], g2[:, p:p + 1]], dim=1)
            n = p + 3
            x, logits, _ = head(seq_t, seq_f, cos[:n], sin[:n])
            assert torch.allclose(x[:, p + 1], g2[:, p], atol=1e-4), p
            assert torch.allclose(x[:, p + 2], g3[:, p], atol=1e-4), p
            assert torch.allclose(logits[:, p + 2], l3[:, p], atol=1e-4), p


@pytest.mark.parametrize("layers", [None, (1, 2)])
def test_eagle_drafter_runs_the_head_as_trained(tiny, tmp_path, layers):
    """The inference drafter (its own paged KV, one tree step per level) computes what the training
    module computes: the width-1 chain EagleDrafter drafts equals the greedy chain of EagleHead run
    causally over the true features followed by its own predicted features. One batch of three
    requests whose pending entries reach the drafter differently: a short prompt; a long prompt
    (its head KV written at prefill); a short prompt followed by 79 verified tokens it did not
    draft for (as after plain steps, or steps prompt lookup served), caught up in one causal chunk
    at the draft (as part of the first tree they would exceed the tree depth limit). A fourth
    request shares the long prompt's first four blocks as a prefix-cache hit and drafts before it:
    it reads the head KV that the long prompt's prefill wrote into the shared pages. With
    ``layers`` the head reads the outputs of both target layers, fused (EAGLE-3)."""
    import pyspec
    from pyspec.drafters import DraftRequest, PrefillChunk, Verified, make_drafter
    from pyspec.runner import ModelRunner, SeqStep
    from pyspec.train.eagle import EagleHead, write_drafter

    llm = pyspec.LLM(tiny, draft="none", kv_cache_tokens=512)
    vocab = llm.model.cfg.vocab_size
    torch.manual_seed(1)
    dv = torch.randperm(vocab)[:48].sort().values
    head = EagleHead(llm.model, dv, 32, layers)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    out = write_drafter(head, str(tmp_path / "d"), manifest={}, width=1, max_depth=3,
                        max_nodes=3, dtype=torch.float32)
    runner = ModelRunner(llm.model, num_blocks=32, block_size=16)
    drafter = make_drafter(out, runner)
    assert drafter.hidden_layers == layers
    # id: (length, prefilled part, cached prefix length)
    cases = {1: (12, None, 0), 2: (90, None, 0), 3: (90, 10, 0), 4: (80, None, 64)}
    reqs, expect, ctxs, tables = [], {}, {}, {}
    for rid, (length, part, cached) in cases.items():
        ctx = torch.randint(0, vocab, (length,)).tolist()
        table = list(range(8 * (rid - 1), 8 * rid))
        if cached:  # request 2's first blocks, tokens and pages
            ctx[:cached] = ctxs[2][:cached]
            table[:cached // 16] = tables[2][:cached // 16]
        ctxs[rid], tables[rid] = ctx, table
        n = len(ctx) - 1  # the committed tokens; ctx[-1] is the root
        res = runner.step([SeqStep(ctx[:n], 0, table, None, "last")],
                          return_hidden=layers or True)
        k = part or n
        drafter.prefill([PrefillChunk(rid, ctx[cached:k], cached, table, ctx,
                                      res.hidden[cached:k])])
        if part:  # the rest arrives as one verified step's worth of committed tokens
            drafter.observe([Verified(rid, k, ctx[k:n], ctx[k + 1:n + 1], table,
                                      res.hidden[k:n])])
        reqs.append(DraftRequest(rid, ctx, n, table, 3, max_depth=3))

        toks = torch.tensor(ctx[1:])[None]
        cos, sin = head.rope(n + 3)
        chain = []
        with torch.no_grad():
            feats = res.hidden[None].float()
            if layers:  # fused once; the head's own predicted features are appended as they are
                feats = head.fuse(feats)
            for _ in range(3):
                t = toks.shape[1]
                x, logits, _ = head(toks, feats, cos[:t], sin[:t])
                c = int(dv[int(logits[0, -1].argmax())])
                chain.append(c)
                toks = torch.cat([toks, torch.tensor([[c]])], dim=1)
                feats = torch.cat([feats, x[:, -1:]], dim=1)
        expect[rid] = [ctx[-1]] + chain
    drafts = drafter.propose(reqs[3:]) + drafter.propose(reqs[:3])  # the cache hit first
    for r, draft in zip(reqs[3:] + reqs[:3], drafts):
        assert draft.parents == [-1, 0, 1, 2]
        assert draft.tokens == expect[r.request_id], r.request_id
