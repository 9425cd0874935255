"""Every drafter through the engine on tiny random models: greedy output equals plain greedy
decoding token for token (batched, with prefix-cache hits and preemption), drafter files load and
fail clearly, and a failing drafter only makes its requests decode plainly."""

import dataclasses
import json
import os

import pytest
import torch

from pyspec import _C
from reference import decode_one
from pyspec.drafters import (Draft, Drafter, EagleDrafter, FirstDrafter, LayerSkipDrafter,
                             MedusaDrafter, MergedDrafter, ModelDrafter, NgramDrafter, load_heads,
                             make_drafter, save_heads)
from pyspec.engine import Engine, SamplingParams
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner
from helpers import default_prompt, tiny_config

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM.random(tiny_config(), seed=0)


def prompts():
    a = default_prompt(length=40, seed=1)
    b = default_prompt(length=40, seed=5)
    return [a[:n] for n in (2, 11, 25, 40)] + [b[:n] for n in (7, 30)] + [a[:16] + b[:9]]


@pytest.fixture(scope="module")
def plain(model):
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    return [decode_one(runner, p, MAX_TOKENS).tokens for p in prompts()]


def _heads_dir(tmp, model, method):
    cfg = model.cfg
    if method == "medusa":
        t = MedusaDrafter.random_weights(cfg.hidden_size, 3, seed=1, scale=0.5)
        conf = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                "medusa": {"num_heads": 3, "tree": [[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 1]]}}
    else:  # "eagle", or "eagle-fused": reading target layers 1 and 2 (EAGLE-3 style)
        fused = method == "eagle-fused"
        t = EagleDrafter.random_weights(cfg, seed=2, intermediate_size=128,
                                        num_feature_layers=2 if fused else 1)
        conf = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                "eagle": {"intermediate_size": 128, **({"feature_layers": [1, 2]} if fused
                                                       else {})},
                "defaults": {"width": 3, "max_depth": 4, "max_nodes": 10}}
    return save_heads(os.path.join(tmp, method), method.split("-")[0], t, conf)


def _suffix_dir(tmp, model, plain):
    """A corpus drafter over the plain outputs (so drafts are often right) and random text (so
    trees branch)."""
    from pyspec.drafters.suffix import save_corpus

    g = torch.Generator().manual_seed(4)
    noise = [torch.randint(0, model.cfg.vocab_size, (30,), generator=g).tolist() for _ in range(6)]
    docs = [p + o for p, o in zip(prompts(), plain)] + noise
    return save_corpus(os.path.join(tmp, "suffix"), docs, model.cfg.vocab_size,
                       defaults={"max_nodes": 6, "max_depth": 4})


def _drafter(kind, runner, model, tmp, plain=None):
    if kind == "ngram":
        return "ngram"
    if kind == "suffix":
        return _suffix_dir(tmp, model, plain)
    if kind == "ngram|suffix":  # through the spec syntax, with options
        return "ngram|" + _suffix_dir(tmp, model, plain) + "@nodes=4,depth=3,match=6"
    if kind == "layer-skip":
        return LayerSkipDrafter(runner, 1, max_depth=4)
    if kind == "draft-model-self":  # the target itself: everything is accepted
        return ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner, max_depth=4)
    if kind == "draft-model":
        small = dataclasses.replace(model.cfg, num_hidden_layers=1)
        return ModelDrafter(LlamaForCausalLM.random(small, seed=3), runner, max_depth=4)
    if kind == "draft-model-tree":
        return ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner, width=3,
                            max_depth=3)
    if kind in ("medusa", "eagle", "eagle-fused"):
        return load_heads(_heads_dir(tmp, model, kind), runner)
    if kind == "medusa+eagle-fused":  # parts reading different target layers
        return _heads_dir(tmp, model, "medusa") + "+" + _heads_dir(tmp, model, "eagle-fused")
    if kind == "ngram+eagle":  # merged trees, through the spec syntax
        return "ngram+" + _heads_dir(tmp, model, "eagle")
    if kind == "ngram|eagle":  # prompt lookup, else the head
        return "ngram|" + _heads_dir(tmp, model, "eagle")
    raise AssertionError(kind)


KINDS = ["ngram", "suffix", "ngram|suffix", "layer-skip", "draft-model-self", "draft-model",
         "draft-model-tree", "medusa",
         "eagle", "eagle-fused", "ngram+eagle", "ngram|eagle", "medusa+eagle-fused"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_blocks", [64, 14])  # 14 blocks of 8: requests get preempted
def test_greedy_lossless_every_drafter(model, plain, tmp_path, kind, num_blocks):
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=8)
    eng = Engine(runner, drafter=_drafter(kind, runner, model, str(tmp_path), plain),
                 max_num_seqs=8,
                 max_num_batched_tokens=80, max_prefill_chunk=16, adaptive=False)
    ps = prompts()
    # Two waves: the second hits the prefix cache of the first.
    res = eng.generate(ps[:4], SamplingParams(max_tokens=MAX_TOKENS)) + \
        eng.generate(ps[4:], SamplingParams(max_tokens=MAX_TOKENS))
    for i, (r, ref) in enumerate(zip(res, plain)):
        assert r.token_ids == ref, f"{kind}: request {i} differs from plain greedy decoding"
        assert not r.stats.fallbacks.get("drafter_error"), f"{kind} failed on request {i}"
    drafted = sum(r.stats.draft_tokens for r in res)
    accepted = sum(r.stats.accepted_tokens for r in res)
    assert drafted > 0
    if kind == "draft-model-self":
        assert accepted == drafted  # an identical draft model is always right
    if kind in ("draft-model-tree", "suffix", "ngram|suffix"):
        assert accepted > 0
    if kind in ("ngram+eagle", "ngram|eagle", "suffix", "ngram|suffix"):
        assert eng.drafters[eng.default_drafter].name == kind
    s = eng.scheduler
    assert s.num_free_blocks == s.num_total_blocks
    if num_blocks == 14:
        assert s.num_preemptions > 0


def test_per_position_stats(model):
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    d = ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner, max_depth=4)
    eng = Engine(runner, drafter=d, adaptive=False, gamma=4)
    r = eng.generate([prompts()[3]], SamplingParams(max_tokens=30))[0]
    st = r.stats
    assert st.drafts > 0 and st.accepted_tokens == st.draft_tokens
    assert st.accepted_per_position[0] == st.drafts
    assert st.per_position_acceptance[0] == 1.0
    assert st.acceptance_length == 1 + st.accepted_tokens / st.drafts
    assert st.drafter == "draft-model"
    assert eng.stats.accepted_tokens == st.accepted_tokens


class Exploding(Drafter):
    name = "exploding"

    def __init__(self, bad_ids, mode):
        self.bad, self.mode = set(bad_ids), mode
        self.seen = 0

    def propose(self, reqs):
        out = []
        for r in reqs:
            self.seen += 1
            if r.request_id in self.bad:
                if self.mode == "raise":
                    raise RuntimeError("drafter crashed")
                if self.mode == "nan":
                    probs = torch.full((2, 111), float("nan"))
                    out.append(Draft([r.context[-1], 1], [-1, 0], probs))
                    continue
                if self.mode == "token":
                    out.append(Draft([r.context[-1], 5000], [-1, 0]))
                    continue
                if self.mode == "tree":
                    out.append(Draft([r.context[-1], 1, 2], [-1, 2, 0]))
                    continue
            n = min(2, r.budget)
            out.append(Draft([r.context[-1], 3, 4][:n + 1], [-1, 0, 1][:n + 1]))
        return out


@pytest.mark.parametrize("mode", ["raise", "nan", "token", "tree"])
def test_drafter_failure_falls_back_without_changing_output(model, plain, mode, caplog):
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    d = Exploding({1, 3}, mode)
    eng = Engine(runner, drafter=d, adaptive=False)
    with caplog.at_level("WARNING", logger="pyspec.engine"):
        res = eng.generate(prompts()[:5], [SamplingParams(max_tokens=MAX_TOKENS)] * 5)
    # Each failure is logged once, naming the request, the drafter and what went wrong.
    logged = [r.getMessage() for r in caplog.records if r.name == "pyspec.engine"]
    assert len(logged) == 2, logged
    for rid, msg in zip((1, 3), logged):
        assert msg.startswith(f"request {rid}: drafter 'exploding' failed")
        assert ("drafter crashed" in msg) == (mode == "raise"), msg
    for i, r in enumerate(res):
        assert r.token_ids == plain[i]
        failed = r.stats.fallbacks.get("drafter_error", 0)
        assert failed == (1 if i in (1, 3) else 0)
        if i not in (1, 3):
            assert r.stats.draft_tokens > 0
    assert eng.stats.fallbacks["drafter_error"] == 2


def test_router_and_switching(model, plain):
    from pyspec.engine import Router

    runner = ModelRunner(model, num_blocks=64, block_size=8)
    bad = Exploding(set(), "none")  # always drafts tokens 3, 4: rarely right

    eng = Engine(runner, drafter=bad, drafters={"ngram": "ngram",
                                                "self": ModelDrafter(
                                                    LlamaForCausalLM.random(model.cfg, seed=0),
                                                    runner, max_depth=3)},
                 router=Router([(lambda f: f.prompt_len >= 30, "ngram")], default="exploding",
                               switch_order=["self"]),
                 adaptive=False, switch_below=0.5)
    res = eng.generate(prompts(), SamplingParams(max_tokens=MAX_TOKENS))
    for i, r in enumerate(res):
        assert r.token_ids == plain[i]
    long_ = [i for i, p in enumerate(prompts()) if len(p) >= 30]
    assert all(res[i].stats.drafters_used[0] == "ngram" for i in long_)
    switched = [r for r in res if r.stats.switches.get("low_acceptance")]
    assert switched, "a request with a poor drafter should have switched"
    for r in switched:
        assert r.stats.drafters_used[-1] == "self"
    with pytest.raises(ValueError, match="router names drafter"):
        Engine(runner, router=Router(default="nope"))


def test_a_request_that_starts_plain_switches_to_an_untried_drafter(model, plain):
    """With drafter switching on, a request that starts plain because its drafter has been
    losing on this engine (the scheduler's evidence for that drafter) moves at once to the next
    drafter it has not tried, instead of decoding plainly until its first probe: counted as a
    "cost_model" switch. (The costs are fixed here, not measured.)"""
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    bad = Exploding(set(), "none")  # never right
    good = ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner, max_depth=3)
    eng = Engine(runner, drafter=bad, drafters={"self": good},
                 router=pyspec_router(default="exploding", switch_order=["self"]),
                 max_draft_tokens=3, measure_costs=False)
    eng.scheduler.set_cost_model(0.5, 0.2)
    first = eng.generate([prompts()[3]], SamplingParams(max_tokens=MAX_TOKENS))[0]
    assert first.stats.fallbacks.get("cost_model", 0) >= 1 and first.stats.drafts > 0
    eng.switch_below = 0.5
    second = eng.generate([prompts()[3]], SamplingParams(max_tokens=MAX_TOKENS))[0]
    assert second.token_ids == plain[3]
    assert second.stats.switches == {"cost_model": 1}
    assert second.stats.drafters_used == ["exploding", "self"]
    assert second.stats.fallbacks.get("cost_model") == 1  # the plain start
    assert second.stats.accepted_tokens > 0  # the target itself drafts: always right
    assert eng.stats.switches.get("cost_model") == 1


def test_a_switch_gives_the_new_drafter_a_fresh_start(model, plain):
    """The scheduler's acceptance evidence about the drafter a request leaves is dropped: right
    after the switch the request speculates from the initial draft length, even where the old
    drafter's misses had shrunk it to 1, and the new drafter (the target itself: always right)
    then has every token accepted."""
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    bad = Exploding(set(), "none")
    good = ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner, max_depth=3)
    eng = Engine(runner, drafter=bad, drafters={"self": good},
                 router=pyspec_router(default="exploding", switch_order=["self"]),
                 adaptive=False, switch_below=0.5, max_draft_tokens=3)
    rid = eng.add_request(prompts()[3], SamplingParams(max_tokens=40))
    before = None
    while eng.has_unfinished():
        snap = eng.scheduler.request(rid)
        eng.step()
        r = eng._reqs[rid]
        if r.stats.switches.get("low_acceptance"):
            before = snap
            break
    assert before is not None and before.draft_len == 1  # the old drafter's misses
    after = eng.scheduler.request(rid)
    assert after.state == "RUNNING_SPECULATIVE" and after.token_acceptance is None
    assert after.draft_len == 3  # initial_draft_tokens = min(4, max_draft_tokens)
    accepted = eng._reqs[rid].stats.accepted_tokens
    eng.step()
    assert eng._reqs[rid].stats.accepted_tokens - accepted == 3
    while eng.has_unfinished():
        eng.step()
    assert eng.result(rid).token_ids == decode_one(ModelRunner(model, 64, 8), prompts()[3],
                                                   40).tokens


def test_prompt_lookup_sources_are_match_lengths():
    from pyspec.drafters.ngram import prompt_lookup_match
    from pyspec.drafters.base import DraftRequest

    d = NgramDrafter(3)
    assert d.num_draft_sources == 3
    ctx = [5, 6, 7, 8, 1, 6, 7, 8]  # "6 7 8" occurred before, followed by 1
    assert prompt_lookup_match(ctx, 3) == (3, 4)
    assert d.draft_source(ctx) == 0
    ctx = [5, 7, 8, 1, 2, 7, 8]  # "7 8" occurred before ("2 7 8" did not), followed by 1
    assert prompt_lookup_match(ctx, 3) == (2, 3)
    assert d.draft_source(ctx) == 1
    ctx = [1, 2, 3, 9, 4, 3]  # only the single token 3 repeats
    assert prompt_lookup_match(ctx, 3) == (1, 3)
    assert d.draft_source(ctx) == 2
    ctx = [1, 2, 3, 4]
    assert prompt_lookup_match(ctx, 3) == (0, -1)
    assert d.draft_source(ctx) is None
    req = DraftRequest(0, ctx, 3, [0], 3)
    assert d.propose([req])[0].tokens == [4]  # nothing drafted, as it said
    # In `ngram|B`, B's sources follow prompt lookup's three.
    first = FirstDrafter([d, SomeSteps(d)])
    assert first.num_draft_sources == 4
    assert first.draft_source([1, 2, 3, 4, 5]) == 3  # no match: B (5 % 5 < 3)
    assert first.draft_source([1, 2, 3, 9, 4, 3]) == 2


class SomeSteps(Drafter):
    """Drafts with ``inner`` only when the context's length is 0, 1 or 2 modulo 5, and says so
    beforehand (a fully accepted depth-3 draft adds 4 tokens, a miss 1: the parts alternate)."""

    name = "some-steps"

    def __init__(self, inner):
        self.inner = inner
        self.max_draft_depth = inner.max_draft_depth

    def draft_source(self, context):
        return 0 if len(context) % 5 < 3 else None

    def kv_pools(self):
        return self.inner.kv_pools()

    def prefill(self, chunks):
        self.inner.prefill(chunks)

    def observe(self, results):
        self.inner.observe(results)

    def release(self, request_id):
        self.inner.release(request_id)

    def propose(self, reqs):
        out = self.inner.propose(reqs)
        return [d if self.draft_source(r.context) is not None else Draft([r.context[-1]], [-1])
                for r, d in zip(reqs, out)]


@pytest.mark.parametrize("sourced", [True, False])
def test_first_drafter_parts_keep_their_own_draft_length(model, sourced):
    """``A|B``: A (the target itself, so always right) drafts on some steps, B (never right) on the
    others. The scheduler sizes each step from the acceptance of the part that drafts it, so B's
    misses do not shorten A's drafts: once A has reached the longest draft, every A step drafts
    and has accepted all of it. Without the per-part estimates (``sourced=False``, the engine not
    naming the part) A's drafts shrink after B's misses, which the test checks too, so it can
    fail."""
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    good = SomeSteps(ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner,
                                       max_depth=3))
    first = FirstDrafter([good, Exploding(set(), "none")])
    assert first.num_draft_sources == 2
    eng = Engine(runner, drafter=first, adaptive=False, max_draft_tokens=3)
    if not sourced:
        eng.drafting.sourced = {}
    steps = []
    eng.trace_hook = lambda t: steps.append(t.decisions)
    rid = eng.add_request(prompts()[3], SamplingParams(max_tokens=60))
    sources = []
    while eng.has_unfinished():
        r = eng._reqs[rid]
        # (the part that drafts, whether max_tokens leaves room for the longest draft)
        sources.append((first.draft_source(r.context), 60 - len(r.generated) > 4))
        eng.step()
    a_steps = [d[rid] for (s, _), d in zip(sources, steps) if s == 0 and rid in d]
    b_steps = [d[rid] for (s, _), d in zip(sources, steps) if s == 1 and rid in d]
    roomy = [d[rid] for (s, room), d in zip(sources, steps) if s == 0 and room and rid in d]
    assert len(a_steps) >= 4 and len(b_steps) >= 4
    assert all(a == 0 for _, _, a, _ in b_steps)  # B is never right
    assert all(a == depth for _, depth, a, _ in a_steps)  # A always is
    later = [depth for _, depth, _, _ in roomy[2:]]
    assert len(later) >= 3
    if sourced:
        assert later == [3] * len(later), a_steps
    else:
        assert min(later) < 3, a_steps
    assert eng.result(rid).token_ids == decode_one(ModelRunner(model, 64, 8), prompts()[3],
                                                   60).tokens


def test_a_failing_draft_source_fails_over_to_plain_decoding(model, caplog):
    class Broken(Exploding):
        def draft_source(self, context):
            raise RuntimeError("cannot tell")

    runner = ModelRunner(model, num_blocks=64, block_size=8)
    first = FirstDrafter([Broken(set(), "none"), Exploding(set(), "none")])
    eng = Engine(runner, drafter=first)
    res = eng.generate(prompts()[:2], SamplingParams(max_tokens=20))
    for i, r in enumerate(res):
        assert r.token_ids == decode_one(ModelRunner(model, 64, 8), prompts()[i], 20).tokens
        assert r.stats.fallbacks.get("drafter_error") == 1
    assert "draft_source: RuntimeError: cannot tell" in caplog.text
    # More sources than the scheduler keeps estimates for: the last ones share one.
    many = FirstDrafter([NgramDrafter(16), NgramDrafter(2)])
    assert many.num_draft_sources == _C.MAX_DRAFT_SOURCES + 2
    eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), drafter=many)
    res = eng.generate(prompts()[:2], SamplingParams(max_tokens=20))
    for i, r in enumerate(res):
        assert r.token_ids == decode_one(ModelRunner(model, 64, 8), prompts()[i], 20).tokens
    broken = Exploding(set(), "none")
    broken.num_draft_sources = 0
    with pytest.raises(ValueError, match="draft sources"):
        Engine(ModelRunner(model, num_blocks=16, block_size=8), drafter=broken)


def pyspec_router(**kw):
    from pyspec.engine import Router

    return Router(**kw)


def test_adaptive_falls_back_and_reprobes(model, plain):
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    # Never right, but nearly free on this tiny model: the cost model alone would keep it (its
    # worst case is the verify cost); the hard floor makes it fall back.
    eng = Engine(runner, drafter=Exploding(set(), "none"), gamma=2, warmup_steps=2,
                 probe_interval=4, min_acceptance_rate=0.3)
    res = eng.generate(prompts()[:3], SamplingParams(max_tokens=40))
    for i, r in enumerate(res):
        assert r.token_ids == decode_one(ModelRunner(model, 64, 8), prompts()[i], 40).tokens
        st = r.stats
        fb = st.fallbacks.get("low_acceptance", 0) + st.fallbacks.get("cost_model", 0)
        assert fb >= 1 and st.probes >= 1, st
        assert st.steps > st.drafts  # plain steps happened


def test_heads_files_and_errors(model, tmp_path):
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    d = _heads_dir(str(tmp_path), model, "eagle")
    assert isinstance(load_heads(d, runner), EagleDrafter)
    assert isinstance(make_drafter(d, runner), EagleDrafter)
    m = _heads_dir(str(tmp_path), model, "medusa")
    assert isinstance(make_drafter(m, runner), MedusaDrafter)
    e = make_drafter(d + "@width=2,depth=3,nodes=7", runner)
    assert (e.width, e.max_depth, e.max_nodes, e.max_draft_depth) == (2, 3, 7, 3)
    assert e.node_budget(3) == 7 and e.node_budget(1) == 2
    # A target of another width: shape mismatch is a clear error.
    other = LlamaForCausalLM.random(dataclasses.replace(model.cfg, hidden_size=128,
                                                        num_attention_heads=2), seed=0)
    with pytest.raises(ValueError, match="hidden_size"):
        load_heads(d, ModelRunner(other, 16, 8))
    cfg_path = os.path.join(d, "drafter.json")
    conf = json.load(open(cfg_path))
    conf["method"] = "lookahead"
    json.dump(conf, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="method"):
        load_heads(d, runner)
    with pytest.raises(ValueError, match="drafter.json"):
        load_heads(str(tmp_path), runner)
    for bad in ("bogus", "layer-skip:9", "layer-skip:x", "ngram:0", str(tmp_path / "nothing"),
                d + "@size=3", m + "@width=2"):
        with pytest.raises(ValueError):
            make_drafter(bad, runner)
    wrong_vocab = LlamaForCausalLM.random(tiny_config(vocab=97), seed=0)
    with pytest.raises(ValueError, match="vocabulary"):
        ModelDrafter(wrong_vocab, runner)
    # Fused target layers: the layer list must fit the target and the fuse weight the list.
    f = _heads_dir(str(tmp_path), model, "eagle-fused")
    fused = load_heads(f, runner)
    assert fused.hidden_layers == (1, 2) and "reads target layers 1,2" in fused.describe()
    conf_path = os.path.join(f, "drafter.json")
    good = json.load(open(conf_path))
    for layers, match in (([1, 3], r"\[1, 2\]"), ([2, 1], "final layer"), ([0, 2], r"\[1, 2\]"),
                          ([1, 1, 2], "distinct")):
        conf = json.loads(json.dumps(good))
        conf["eagle"]["feature_layers"] = layers
        json.dump(conf, open(conf_path, "w"))
        with pytest.raises(ValueError, match=match):
            load_heads(f, runner)
    conf = json.loads(json.dumps(good))
    conf["eagle"].pop("feature_layers")  # a fuse weight the config does not account for
    json.dump(conf, open(conf_path, "w"))
    with pytest.raises(ValueError, match="feature_layers"):
        load_heads(f, runner)


def test_eagle_reduced_vocab(model, plain, tmp_path):
    cfg = model.cfg
    dv = torch.arange(0, cfg.vocab_size, 2)
    t = EagleDrafter.random_weights(cfg, seed=4, intermediate_size=64, draft_vocab=dv)
    d = save_heads(str(tmp_path / "ev"), "eagle", t, {
        "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
        "eagle": {"intermediate_size": 64}})
    runner = ModelRunner(model, num_blocks=64, block_size=8)
    eng = Engine(runner, drafter=d, adaptive=False)
    res = eng.generate(prompts()[:3], SamplingParams(max_tokens=MAX_TOKENS))
    for i, r in enumerate(res):
        assert r.token_ids == plain[i]
        assert r.stats.draft_tokens > 0


def test_switch_to_a_draft_model_catches_up_its_kv(model, plain):
    """A request routed to a draft model mid-way (no draft KV yet) recomputes the draft KV of
    its whole context, so the identical draft model is right every time after the switch."""
    from pyspec.engine import Router

    runner = ModelRunner(model, num_blocks=64, block_size=8)
    same = ModelDrafter(LlamaForCausalLM.random(model.cfg, seed=0), runner, max_depth=3)
    proposed = []
    real = same.propose

    def counting(reqs):
        drafts = real(reqs)
        proposed.extend(d.num_draft_tokens for d in drafts)
        return drafts

    same.propose = counting
    bad = Exploding(set(), "none")
    eng = Engine(runner, drafter=bad, drafters={"same": same},
                 router=Router(default="exploding", switch_order=["same"]), adaptive=False,
                 switch_below=0.5, gamma=3)
    res = eng.generate([prompts()[3]], SamplingParams(max_tokens=40))[0]
    assert res.token_ids == decode_one(ModelRunner(model, 64, 8), prompts()[3], 40).tokens
    assert res.stats.drafters_used == ["exploding", "same"]
    assert sum(proposed) > 0
    # Before the switch the bad drafter's tokens (3, 4) were rejected; after it, every token the
    # identical draft model proposed must have been accepted (its catch-up KV is right).
    assert res.stats.accepted_tokens >= sum(proposed)


def test_batch_aware_budget_from_measured_step_times(model):
    """The scheduler's step-time fit (t = base + slope * tokens, from the step times the engine
    reports) sets the shared draft budget to the tokens a step can add before it turns
    compute-bound, and stops speculation once the batch alone gets there."""
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    eng = Engine(runner, drafter="ngram")
    s = eng.scheduler
    assert s.memory_bound_tokens == 0
    for tokens in (4, 8, 12, 16, 20, 24, 28, 32):  # t = 10 ms + 1 ms per token
        s.observe_step_time(4, tokens, 0.010 + 0.001 * tokens)
    s.refit_cost_model()
    assert s.memory_bound_tokens == 10 and eng.stats.spec_free_tokens == 6
    # The scheduler's share: what the running batch leaves of those tokens, split among the
    # speculating requests; nothing once the batch alone reaches them.
    assert s.spec_share(4, 4) == 1 and s.spec_share(2, 2) == 4 and s.spec_share(10, 10) == 0
    assert s.spec_share(12, 3) == 0
    with pytest.raises(ValueError):
        s.set_memory_bound_tokens(-1)
    with pytest.raises(ValueError, match="observe_step_time"):
        s.observe_step_time(4, 2, 0.01)  # fewer tokens than requests


def test_draft_costs_count_every_request_of_the_batch(model):
    """A request's draft and verify tokens lengthen the step of the whole batch while its accepted
    tokens are its own, so the costs the scheduler weighs them with (relative to a plain step of
    the batch) are b times a lone request's: the same fit at batch 4 gives 4x the costs, and a
    drafter that pays alone (40% per token at 0.12 of a step per level) stops paying."""
    from pyspec._C import optimal_draft_length

    def costs(batch):
        runner = ModelRunner(model, num_blocks=16, block_size=8)
        eng = Engine(runner, drafter="ngram")
        s = eng.scheduler
        for tokens in (4, 8, 12, 16, 20, 24, 28, 32):  # t = 10 ms + 1 ms per token
            s.observe_step_time(batch, tokens, 0.010 + 0.001 * tokens)
        s.observe_draft_time(0, 0.0014 * 10, 10)  # 1.4 ms per draft level
        s.refit_cost_model()
        return eng.stats.draft_cost, eng.stats.verify_cost

    d1, v1 = costs(1)
    d4, v4 = costs(4)
    plain1, plain4 = 0.010 + 0.001 * 1, 0.010 + 0.001 * 4
    assert d1 == pytest.approx(0.0014 / plain1) and d4 == pytest.approx(4 * 0.0014 / plain4)
    assert v1 > 0 and v4 == pytest.approx(4 * v1 * plain1 / plain4)
    alpha = 0.4
    _, gain1 = optimal_draft_length(alpha, 0.0, 0.12, 8)
    _, gain4 = optimal_draft_length(alpha, 0.0, 4 * 0.12, 8)
    assert gain1 > 1 > gain4


def test_a_budget_that_stops_every_draft_is_probed_again(model):
    """A step-time fit that puts the memory-bound limit at or below the batch stops every draft,
    and so the step-size spread the fit would need to correct it: after BUDGET_PROBE_FIRST decode
    steps without a draft token (then twice as many after each probe, up to BUDGET_PROBE_MAX)
    the scheduler lifts the limit (to twice the batch) until its next refit, and the limit is then
    computed again from what the drafting steps measured."""
    from pyspec._C import BUDGET_PROBE_FIRST, BUDGET_PROBE_MAX

    runner = ModelRunner(model, num_blocks=16, block_size=8)
    eng = Engine(runner, drafter="ngram")
    s = eng.scheduler
    for tokens in (4, 8, 12, 16, 20):  # noise: t = 10 ms + 5 ms per token -> limit 2 < batch 4
        s.observe_step_time(4, tokens, 0.010 + 0.005 * tokens)
    s.refit_cost_model()
    assert s.memory_bound_tokens == 2 and s.spec_share(4, 4) == 0
    assert BUDGET_PROBE_FIRST < BUDGET_PROBE_MAX
    for _ in range(BUDGET_PROBE_FIRST - 1):  # plain steps only: the fit cannot move
        s.observe_step_time(4, 4, 0.030)
    s.refit_cost_model()
    assert s.memory_bound_tokens == 2 and eng.stats.budget_probes == 0
    s.observe_step_time(4, 4, 0.030)
    s.refit_cost_model()
    # lifted to twice the batch (at least 8 more tokens), not away: drafts again, a few per
    # request, instead of every request's full tree
    assert s.memory_bound_tokens == 12 and eng.stats.budget_probes == 1
    assert 0 < s.spec_share(4, 4) <= 2
    # The noisy fit again: the next probe waits twice as long, and the interval stops at
    # BUDGET_PROBE_MAX.
    waits = []
    for probe in range(2, 7):
        for tokens in (4, 8, 12, 16, 20):
            s.observe_step_time(4, tokens, 0.010 + 0.005 * tokens)
        s.refit_cost_model()
        assert s.memory_bound_tokens <= 4
        n = 0
        while eng.stats.budget_probes < probe:
            s.observe_step_time(4, 4, 0.030)
            s.refit_cost_model()
            n += 1
        waits.append(n)
    expected = [min(BUDGET_PROBE_FIRST * 2 ** k, BUDGET_PROBE_MAX) for k in range(1, 6)]
    assert waits == expected
    for tokens in (8, 12, 16, 20) * 8:  # what the drafting steps measure: 1 ms per token
        s.observe_step_time(4, tokens, 0.026 + 0.001 * tokens)
    s.refit_cost_model()
    assert s.memory_bound_tokens > 4 and s.spec_share(4, 4) > 0
    # A limit that leaves room for drafts is not lifted, however long no request drafted
    # (then acceptance, not the budget, kept the drafts off).
    probes = eng.stats.budget_probes
    for _ in range(2 * BUDGET_PROBE_MAX):
        s.observe_step_time(4, 4, 0.030)
    s.refit_cost_model()
    assert eng.stats.budget_probes == probes and s.memory_bound_tokens > 0


class Oracle(Drafter):
    """Drafts the next tokens of a known continuation (always right, at no cost)."""

    name = "oracle"
    max_draft_depth = 4

    def __init__(self, prompt, continuation):
        self.text = list(prompt) + list(continuation)

    def propose(self, reqs):
        out = []
        for r in reqs:
            n = len(r.context)
            c = self.text[n:n + min(r.depth_limit, r.budget)]
            out.append(Draft([r.context[-1]] + c, list(range(-1, len(c)))))
        return out


def test_a_drafter_that_always_drafts_gets_plain_calibration_steps(model):
    """After CALIBRATION_STEPS decode-only steps in a row that drafted, the next decode-only step
    drafts nothing, so the step-time fit sees a plain step (with trees always the same size its
    intercept and slope are left to noise); the output is unchanged and the steps are counted.
    Without adaptive speculation there is no fit and no calibration step."""
    from pyspec._C import CALIBRATION_STEPS

    n = 3 * CALIBRATION_STEPS + 40
    p = prompts()[3]
    want = decode_one(ModelRunner(model, 64, 8), p, n).tokens
    for adaptive in (True, False):
        runner = ModelRunner(model, num_blocks=64, block_size=8)
        # (cost_model=False: draft lengths that do not depend on this machine's timings; the
        # calibration steps come with the scheduler's measured costs either way)
        eng = Engine(runner, drafter=Oracle(p, want), adaptive=adaptive, max_draft_tokens=1,
                     cost_model=False)
        steps = []
        eng.trace_hook = lambda t: steps.append((bool(t.prefill), t.decisions))
        rid = eng.add_request(p, SamplingParams(max_tokens=n))
        while eng.has_unfinished():
            eng.step()
        assert eng.result(rid).token_ids == want
        drafted = [d[rid][0] > 0 for pre, d in steps if not pre and rid in d]
        plain_at = [i for i, x in enumerate(drafted) if not x]
        if not adaptive:
            assert not plain_at and eng.stats.calibration_steps == 0
            continue
        assert eng.stats.calibration_steps == len(plain_at) >= 2
        # each after exactly CALIBRATION_STEPS drafted steps
        assert plain_at == [(k + 1) * (CALIBRATION_STEPS + 1) - 1 for k in range(len(plain_at))]


def test_merge_drafts_is_a_trie_within_the_budget():
    from pyspec.drafters import merge_drafts

    a = Draft([9, 1, 2, 3], [-1, 0, 1, 2])  # chain 1-2-3
    b = Draft([9, 1, 5, 4, 6], [-1, 0, 0, 1, 1])  # 1 (shared), 5; under 1: 4, 6
    m = merge_drafts([a, b], budget=10)
    paths = set()
    for i in range(1, len(m.tokens)):
        p, path = i, []
        while p > 0:
            path.append(m.tokens[p])
            p = m.parents[p]
        paths.add(tuple(reversed(path)))
    assert paths == {(1,), (1, 2), (1, 2, 3), (5,), (1, 4), (1, 6)}
    assert all(m.parents[i] < i for i in range(1, len(m.tokens)))  # parents first
    cut = merge_drafts([a, b], budget=4)  # the first draft's nodes first, then b's in its order
    assert cut.tokens == [9, 1, 2, 3, 5] and cut.parents == [-1, 0, 1, 2, 0]
    assert merge_drafts([a, b], budget=0).tokens == [9]
    sampled = Draft([9, 7], [-1, 0], torch.full((2, 4), 0.25))
    assert merge_drafts([a, sampled], budget=10) is sampled  # not mergeable: used alone
    with pytest.raises(ValueError, match="root"):
        merge_drafts([a, Draft([8, 1], [-1, 0])], budget=10)


def test_merged_spec_errors(model, tmp_path):
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    heads = _heads_dir(str(tmp_path), model, "eagle")
    f = make_drafter(heads + "@width=2,depth=1,nodes=2|ngram", runner)  # options on a part
    assert isinstance(f, FirstDrafter) and isinstance(f.parts[0], EagleDrafter)
    assert f.parts[0].max_depth == 1 and f.parts[0].width == 2
    plus = os.path.join(str(tmp_path), "a+b")  # a folder whose name holds a separator
    os.rename(heads, plus)
    assert isinstance(make_drafter(plus, runner), EagleDrafter)
    assert isinstance(make_drafter(plus + "@depth=1|ngram", runner), FirstDrafter)
    with pytest.raises(ValueError, match="none"):
        make_drafter("ngram+none", runner)
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter("ngram+bogus", runner)
    m = make_drafter("ngram:2+ngram", runner)
    assert m.name == "ngram+ngram" and m.max_draft_depth == 5 and not m.needs_hidden
    with pytest.raises(ValueError, match="none"):
        make_drafter("none|ngram", runner)
    f = make_drafter("ngram|ngram:2+ngram", runner)  # '|' binds looser than '+'
    assert isinstance(f, FirstDrafter) and f.name == "ngram|ngram+ngram"
    assert isinstance(f.parts[1], MergedDrafter)
    # Messages that name what is wrong.
    for spec, match in (("ngram|", "empty part"), ("+", "empty part"),
                        ("ngram++ngram", "empty part"),
                        (str(tmp_path / "no-such-folder"), "does not exist"),
                        ("./nope", "does not exist"),
                        (plus + "@width=abc", "width=N needs an integer"),
                        (plus + "@nodes", "'nodes' needs a value"),
                        (plus + "@nodes=", "'nodes' needs a value"),
                        ("default:3", "takes no argument"), ("default:foo", "takes no argument"),
                        (os.path.join(str(tmp_path), "file.txt"), "is a file")):
        if spec.endswith("file.txt"):
            open(spec, "w").close()
        with pytest.raises(ValueError, match=match):
            make_drafter(spec, runner)


class Scripted(Drafter):
    """Drafts a fixed token chain for the request ids it knows, nothing for the others; records
    what it was asked and told."""

    def __init__(self, name, chains):
        self.name, self.chains = name, chains
        self.asked, self.seen = [], []

    def propose(self, reqs):
        self.asked.append([r.request_id for r in reqs])
        out = []
        for r in reqs:
            c = self.chains.get(r.request_id, [])
            out.append(Draft([r.context[-1]] + c, list(range(-1, len(c)))))
        return out

    def observe(self, results):
        self.seen.extend(v.request_id for v in results)


def test_first_drafter_takes_the_first_part_that_drafts():
    from pyspec.drafters.base import DraftRequest, Verified

    a = Scripted("a", {1: [5, 6], 3: [7]})
    b = Scripted("b", {1: [8], 2: [9, 9], 3: [4]})
    f = FirstDrafter([a, b])
    reqs = [DraftRequest(i, [1, 2, 3], 3, [0], 4, max_depth=4) for i in (1, 2, 3, 4)]
    ds = f.propose(reqs)
    assert [d.tokens for d in ds] == [[3, 5, 6], [3, 9, 9], [3, 7], [3]]
    assert a.asked == [[1, 2, 3, 4]] and b.asked == [[2, 4]]  # b only where a had nothing
    f.observe([Verified(1, 3, [3, 5], [5, 6], [0])])
    assert a.seen == b.seen == [1]  # every part keeps up with every request
    assert f.describe() and f.name == "a|b"


def test_default_on_another_architecture_is_ngram(model):
    runner = ModelRunner(model, num_blocks=16, block_size=8)
    assert make_drafter("default", runner).name == "ngram"


def test_draft_bytes_counts_what_drafters_hold_beyond_the_target(model, tmp_path):
    """The serve metric pyspec_memory_bytes{component="draft_weights"}: heads' own weights, each
    tensor once, never the target's tensors they read (on a CPU target a head's embedding and
    lm_head are the target's); a host copy (what a head keeps for a GPU target) counts; parts
    of combined drafters count."""
    pytest.importorskip("fastapi")
    from pyspec.engine import Engine
    from pyspec.serve.metrics import draft_bytes as _draft_bytes
    from pyspec.serve.metrics import model_tensors as _model_tensors

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    runner = ModelRunner(model, num_blocks=32, block_size=8)
    eagle = make_drafter(_heads_dir(str(tmp_path), model, "eagle"), runner)
    medusa = make_drafter(_heads_dir(str(tmp_path), model, "medusa"), runner)
    assert eagle.embed_w is model.embed and medusa.lm_head is model.lm_head  # CPU: no copies
    own = {id(t) for t in _model_tensors(model)}
    head_own = [t for t in _model_tensors(eagle.head) if id(t) not in own]
    want_eagle = nbytes(head_own) + nbytes([eagle.fc_w])
    assert want_eagle > 0
    assert _draft_bytes(Engine(runner, drafter=eagle)) == want_eagle
    want_medusa = nbytes([medusa.w, medusa.b])
    assert _draft_bytes(Engine(runner, drafter=medusa)) == want_medusa
    # Combined: both parts, counted once each however the engine names them.
    merged = make_drafter("ngram+" + str(tmp_path / "eagle"), runner)
    assert _draft_bytes(Engine(runner, drafter=merged)) == want_eagle
    # A host copy of the target's embedding (a GPU target's) is memory the drafter adds.
    eagle.embed_w = model.embed.clone()
    assert _draft_bytes(Engine(runner, drafter=eagle)) == want_eagle + nbytes([model.embed])
    assert _draft_bytes(Engine(runner, drafter="ngram")) == 0
