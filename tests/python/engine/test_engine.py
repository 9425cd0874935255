"""The batched engine (pyspec.engine.Engine) on a tiny random Llama, checked against decode_one."""

import pytest
import torch

from reference import decode_one, prompt_lookup_drafter
from pyspec.engine import Engine, SamplingParams
from pyspec.models.llama import LlamaForCausalLM
from pyspec.runner import ModelRunner
from helpers import default_prompt, tiny_config

MAX_TOKENS = 20
GAMMA = 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM.random(tiny_config(), seed=0)


@pytest.fixture(scope="module")
def ref_runner(model):
    return ModelRunner(model, num_blocks=64, block_size=8)


def prompts():
    base = default_prompt(length=48, seed=1)
    other = default_prompt(length=48, seed=7)
    # Different lengths; several share prefixes (full 8-token blocks) with each other.
    return ([base[:n] for n in (3, 17, 26, 41, 49)] + [other[:n] for n in (9, 24, 33)]
            + [base[:16] + other[:12]])


@pytest.fixture(scope="module")
def references(ref_runner):
    return [decode_one(ref_runner, p, MAX_TOKENS, drafter=prompt_lookup_drafter(),
                       gamma=GAMMA).tokens for p in prompts()]


def check_idle(eng):
    s = eng.scheduler
    assert not s.has_unfinished and s.num_running == 0 and s.num_waiting == 0
    assert s.num_free_blocks == s.num_total_blocks
    s.check_invariants()


def run_greedy_batch(eng, references):
    ps = prompts()
    params = [dict(max_tokens=MAX_TOKENS, speculative=i % 3 != 1) for i in range(len(ps))]
    # Two waves: the second reuses the prefix blocks the first one computed.
    first = eng.generate(ps[:4], params[:4])
    second = eng.generate(ps[4:], params[4:])
    results = first + second
    for i, (res, ref) in enumerate(zip(results, references)):
        assert res.token_ids == ref, f"request {i} differs from decode_one"
        assert res.finish_reason == "length"
        st = res.stats
        assert st.accepted_tokens <= st.draft_tokens
        if not params[i]["speculative"]:
            assert st.draft_tokens == 0 and st.acceptance_length == 1.0
    assert sum(r.stats.draft_tokens for r in results) > 0
    assert sum(r.stats.accepted_tokens for r in results) > 0
    assert sum(r.stats.cached_tokens for r in results) > 0  # prefix cache hits
    check_idle(eng)
    return results


def test_greedy_batch_matches_decode_one(model, references):
    eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), max_num_seqs=8,
                 max_num_batched_tokens=96, gamma=GAMMA, max_prefill_chunk=24)
    run_greedy_batch(eng, references)
    assert eng.scheduler.num_preemptions == 0


def test_greedy_batch_with_preemption_matches_decode_one(model, references):
    # 12 blocks of 8 tokens: the longest request alone needs 9-10 blocks, so requests running
    # together exhaust the pool and get preempted (recomputed later).
    eng = Engine(ModelRunner(model, num_blocks=12, block_size=8), max_num_seqs=8,
                 max_num_batched_tokens=64, gamma=GAMMA)
    results = run_greedy_batch(eng, references)
    assert eng.scheduler.num_preemptions > 0
    assert sum(r.stats.preemptions for r in results) == eng.scheduler.num_preemptions


def sampled_engine(model):
    # Unlimited speculation budgets: a request's draft lengths depend only on its own history.
    return Engine(ModelRunner(model, num_blocks=64, block_size=8), max_num_seqs=8,
                  max_num_batched_tokens=256, gamma=GAMMA, spec_token_budget=0,
                  spec_disable_batch_size=0)


def test_sampled_deterministic_and_batch_independent(model):
    ps = prompts()
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=1234)
    alone = sampled_engine(model).generate([ps[3]], sp)[0].token_ids
    assert len(alone) == MAX_TOKENS
    again = sampled_engine(model).generate([ps[3]], sp)[0].token_ids
    assert again == alone
    other_seed = sampled_engine(model).generate(
        [ps[3]], dict(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=99))[0].token_ids
    assert other_seed != alone
    # In a batch with greedy and differently sampled neighbours, the same seed gives the same
    # tokens.
    mixed = [dict(max_tokens=MAX_TOKENS, temperature=1.0, top_k=20, seed=i) for i in range(3)]
    mixed.insert(1, dict(max_tokens=MAX_TOKENS))
    batch = [ps[0], ps[3], ps[5], ps[7], ps[1]]
    params = mixed[:1] + [sp] + mixed[1:]
    eng = sampled_engine(model)
    res = eng.generate(batch, params)
    assert res[1].token_ids == alone
    assert res[1].stats.draft_tokens > 0  # the sampled request did speculate
    check_idle(eng)


def test_step_streaming_and_abort_frees_kv(model):
    eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), max_num_seqs=4,
                 max_num_batched_tokens=64, gamma=GAMMA)
    ps = prompts()
    keep = eng.add_request(ps[1], dict(max_tokens=8))
    victim = eng.add_request(ps[4], dict(max_tokens=200))
    streamed = {keep: [], victim: []}
    while len(streamed[victim]) < 5:
        for o in eng.step():
            streamed[o.request_id].extend(o.new_tokens)
    assert eng.scheduler.num_free_blocks < eng.scheduler.num_total_blocks
    assert eng.abort(victim)
    assert not eng.abort(victim)
    res = eng.result(victim, pop=True)
    assert res.finish_reason == "abort" and res.token_ids == streamed[victim]
    while eng.has_unfinished():
        for o in eng.step():
            streamed[o.request_id].extend(o.new_tokens)
    done = eng.result(keep, pop=True)
    assert done.finish_reason == "length" and done.token_ids == streamed[keep]
    assert len(done.token_ids) == 8
    check_idle(eng)
    # An abort before the request ever ran.
    rid = eng.add_request(ps[2], dict(max_tokens=4))
    assert eng.abort(rid)
    assert eng.step() == []
    check_idle(eng)


def test_stop_token(model, references):
    eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), gamma=GAMMA)
    ref = references[3]
    stop = ref[6]
    cut = ref.index(stop) + 1
    res = eng.generate([prompts()[3]], dict(max_tokens=MAX_TOKENS, stop_token_ids=[stop]))[0]
    assert res.finish_reason == "stop" and res.token_ids == ref[:cut]


@pytest.mark.parametrize("prompt, params", [
    ([], {}),
    ([1, 2, 111], {}),
    ([1, -1], {}),
    ([1, 2], dict(max_tokens=0)),
    ([1, 2], dict(temperature=-0.5)),
    ([1, 2], dict(top_p=0.0)),
    ([1, 2], dict(top_k=-1)),
    ([1, 2], dict(stop_token_ids=[500])),
    ([1, 2], dict(bogus=1)),
    # Values that are in range as Python floats but not once the filters convert to float32.
    ([1, 2], dict(temperature=1e300)),
    ([1, 2], dict(top_p=1e-300)),
    ([1, 2], dict(top_p=1e-46)),
    ([1, 2], dict(ignore_eos="no")),
    ([1, 2], dict(speculative=1)),
    ([1, 2], dict(stop_token_ids=[1.7])),
    ([1, 2], dict(stop_token_ids="ab")),
    ([1, 2], dict(stop_token_ids=5)),
])
def test_bad_input_raises(model, prompt, params):
    eng = Engine(ModelRunner(model, num_blocks=8, block_size=8))
    with pytest.raises(ValueError):
        eng.add_request(prompt, params)
    with pytest.raises(ValueError):
        eng.generate([[3, 4], prompt], params)
    check_idle(eng)
    with pytest.raises(ValueError):
        eng.abort(12345)


def test_extreme_but_valid_sampling_values(model):
    """A top_k past the vocabulary (even past int32) keeps every token, like top_k=0; a
    temperature that float32 rounds to 0 or a tiny top_p still sample; nothing breaks the
    engine for the next request."""
    eng = Engine(ModelRunner(model, num_blocks=32, block_size=8))
    base = dict(max_tokens=6, temperature=0.8, seed=3)
    ref = eng.generate([[3, 4, 5]], base)[0].token_ids
    for k in (model.cfg.vocab_size, 1 << 31, 1 << 70):
        assert eng.generate([[3, 4, 5]], dict(base, top_k=k))[0].token_ids == ref
    for extra in (dict(temperature=1e-300), dict(temperature=1e-40), dict(top_p=1.2e-38),
                  dict(min_p=1e-300)):
        res = eng.generate([[3, 4, 5]], dict(base, **extra))[0]
        assert len(res.token_ids) == 6 and res.finish_reason == "length"
    check_idle(eng)


def test_failed_step_fails_only_its_requests(model, references, monkeypatch):
    """A step that fails after it was scheduled finishes that step's requests with 'error',
    frees their KV and closes the scheduler's step: the engine serves the next requests (before
    this, every later step failed with 'the previous Step() has not been applied')."""
    import pyspec

    eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), gamma=GAMMA)
    a = eng.add_request(prompts()[0], dict(max_tokens=MAX_TOKENS))
    b = eng.add_request(prompts()[1], dict(max_tokens=MAX_TOKENS))
    eng.step()
    real = eng.runner.step
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(eng.runner, "step", broken)
    with pytest.raises(pyspec.StepError, match="injected failure") as info:
        eng.step()
    assert calls and sorted(info.value.request_ids) == sorted([a, b])
    for rid in (a, b):
        assert eng.result(rid, pop=True).finish_reason == "error"
    check_idle(eng)
    monkeypatch.setattr(eng.runner, "step", real)
    res = eng.generate([prompts()[3]], dict(max_tokens=MAX_TOKENS))[0]
    assert res.token_ids == references[3] and res.finish_reason == "length"
    check_idle(eng)


def test_bad_engine_config(model):
    runner = ModelRunner(model, num_blocks=8, block_size=8)
    with pytest.raises(ValueError):
        Engine(runner, drafter="eagle")
    with pytest.raises(ValueError):
        Engine(runner, max_num_seqs=0)
    with pytest.raises(ValueError):
        Engine(runner, gamma=-1)


def test_greedy_walk_from_logits_equals_accept_on_one_hot_rows():
    """The engine's greedy path (the core's walk over the logits, no probability rows) decides
    exactly what the acceptance op decides from temperature-0 rows: random trees with repeated
    sibling tokens, tied logits and several requests; a non-finite row is the filters' error."""
    from pyspec.sampling import accept, accept_greedy, apply_sampling_filters

    g = torch.Generator().manual_seed(0)
    vocab = 7  # few tokens: children often hold the argmax, and ties are common
    for trial in range(300):
        tokens, parents, indptr = [], [], [0]
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            n = int(torch.randint(1, 9, (1,), generator=g))
            parents += [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
            tokens += torch.randint(0, vocab, (n,), generator=g).tolist()
            indptr.append(indptr[-1] + n)
        logits = torch.randint(0, 3, (indptr[-1], vocab), generator=g).float()  # many ties
        trees = (torch.tensor(tokens, dtype=torch.int32), torch.tensor(parents, dtype=torch.int32),
                 torch.tensor(indptr))
        got = accept_greedy(logits, *trees)
        res = accept(apply_sampling_filters(logits, 0.0), *trees, greedy=True, seeds=0)
        assert torch.equal(got.num_accepted, res.num_accepted), trial
        assert got.emitted_lists() == res.emitted_lists(), trial
        assert torch.equal(got.accepted_nodes, res.accepted_nodes), trial
    for bad in (float("nan"), float("inf")):
        logits[0, 1] = bad
        with pytest.raises(ValueError, match="'logits' row 0 has a NaN or \\+inf entry at token 1"):
            accept_greedy(logits, *trees)
        with pytest.raises(ValueError, match="'logits' row 0 has a NaN or \\+inf entry at token 1"):
            apply_sampling_filters(logits, 0.0)
    logits[0] = float("-inf")
    with pytest.raises(ValueError, match="no finite entry"):
        accept_greedy(logits, *trees)
    # Every row is checked, also those the walk does not reach; the lowest bad row is named.
    tokens, parents, indptr = (torch.tensor([0, 3, 0], dtype=torch.int32),
                               torch.tensor([-1, 0, -1], dtype=torch.int32), torch.tensor([0, 2, 3]))
    logits = torch.zeros(3, 4)
    logits[:, 1] = 1.0  # the roots' argmax (1) misses the child (3): row 1 is never visited
    assert accept_greedy(logits, tokens, parents, indptr).num_accepted.tolist() == [0, 0]
    logits[2, 0] = float("nan")
    logits[1, 2] = float("inf")
    with pytest.raises(ValueError, match="'logits' row 1 has a NaN or \\+inf entry at token 2"):
        accept_greedy(logits, tokens, parents, indptr)


def test_small_steps_run_all_their_torch_work_on_one_thread(model, monkeypatch, torch_threads_2):
    """Not only the forward: drafting, acceptance and the drafters' updates of a decode or verify
    step run torch on one thread (a parallel op anywhere in the step leaves torch's OpenMP workers
    spinning against the next forward's kernel threads), prefill steps beyond the core kernel's
    rows keep torch's threads for their GEMMs, and the thread count is restored after each step,
    also after a failed one."""
    from pyspec.drafters.base import Draft, Drafter
    from pyspec.linear import max_fast_rows

    class Recording(Drafter):
        name = "recording"

        def __init__(self):
            self.seen = {"prefill": [], "propose": [], "observe": [], "accept": []}

        def prefill(self, chunks):
            self.seen["prefill"].append((sum(len(c.tokens) for c in chunks),
                                         torch.get_num_threads()))

        def propose(self, reqs):
            self.seen["propose"].append(torch.get_num_threads())
            return [Draft([r.context[-1], 3], [-1, 0]) for r in reqs]

        def observe(self, results):
            self.seen["observe"].append(torch.get_num_threads())

    class Wide(Recording):
        """Asks for more nodes than the core kernel's rows, drafts one: drafting keeps torch's
        threads, the (small) rest of the step does not."""

        def node_budget(self, depth):
            return max_fast_rows(torch.float32) + 8

    d = Recording()
    eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), drafter=d, gamma=2,
                 adaptive=False, max_num_batched_tokens=256)
    import pyspec.engine.engine as engine_mod

    accept = engine_mod.accept_step
    monkeypatch.setattr(engine_mod, "accept_step", lambda *a, **k: (
        d.seen["accept"].append(torch.get_num_threads()), accept(*a, **k))[1])
    threads = torch_threads_2
    limit = max_fast_rows(torch.float32)
    long_prompt = [(7 * i) % 100 + 1 for i in range(limit + 40)]
    eng.generate([long_prompt], SamplingParams(max_tokens=6, temperature=0.0))
    assert torch.get_num_threads() == threads
    big = [t for n, t in d.seen["prefill"] if n > limit]
    assert big and set(big) == {threads}  # the long prefill kept torch's threads
    for k in ("propose", "observe", "accept"):
        assert d.seen[k] and set(d.seen[k]) == {1}, (k, d.seen[k])
    monkeypatch.setattr(engine_mod, "accept_step", lambda *a, **k: 1 / 0)
    rid = eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(Exception):
        for _ in range(4):
            eng.step()
    assert eng.result(rid).finish_reason == "error"
    assert torch.get_num_threads() == threads
    monkeypatch.setattr(engine_mod, "accept_step", accept)

    w = Wide()
    eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), drafter=w, gamma=2,
                 adaptive=False)
    eng.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0.0))
    assert w.seen["propose"] and set(w.seen["propose"]) == {threads}
    assert w.seen["observe"] and set(w.seen["observe"]) == {1}
    assert torch.get_num_threads() == threads


def test_each_drafter_keeps_its_own_deployment_evidence(model):
    """A new request's prior for the cost model's fallback test is its own drafter's recent
    evidence on this engine (the scheduler's evidence group), not another drafter's."""
    from pyspec.drafters.base import Draft, Drafter
    from pyspec.engine import Router

    class Wrong(Drafter):
        name = "wrong"

        def propose(self, reqs):  # never the target's token: every draft rejected
            return [Draft([r.context[-1], 0], [-1, 0]) for r in reqs]

    class Silent(Drafter):
        name = "silent"

        def propose(self, reqs):
            return [Draft([r.context[-1]], [-1]) for r in reqs]

    eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), drafter=Silent(),
                 drafters={"wrong": Wrong()}, gamma=2,
                 router=Router([(lambda f: f.prompt_len > 4, "wrong")], default="silent"))
    groups = eng.drafting.evidence_group
    assert sorted(groups) == ["silent", "wrong"] and len(set(groups.values())) == 2
    eng.generate([[1, 2, 3, 4, 5, 6]], SamplingParams(max_tokens=12, temperature=0.0))
    hits, trials = eng.scheduler.deployment_evidence(groups["wrong"])
    assert trials > 0 and hits < trials
    assert eng.scheduler.deployment_evidence(groups["silent"]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="evidence_group"):
        eng.scheduler.add_request(999, [1, 2], evidence_group=-1)


def test_generate_leaves_nothing_behind_when_it_fails(model, references):
    """Bad arguments are refused before anything is queued; max_steps reached, or on_step
    raising, aborts the call's requests and forgets them (their KV freed); n > 1 is the LLM's
    and the server's (they add n requests), refused here; the engine then decodes as before."""
    eng = Engine(ModelRunner(model, num_blocks=64, block_size=8), drafter="ngram", gamma=GAMMA)
    ps = prompts()[:3]
    sp = SamplingParams(max_tokens=MAX_TOKENS)
    free = eng.scheduler.num_free_blocks
    for kw, msg in (({"max_steps": 0}, "max_steps"), ({"max_steps": "x"}, "max_steps"),
                    ({"on_step": 5}, "on_step")):
        with pytest.raises(ValueError, match=msg):
            eng.generate(ps, sp, **kw)
    with pytest.raises(RuntimeError, match="within 2 steps"):
        eng.generate(ps, sp, max_steps=2)

    def boom(outs):
        raise KeyError("from on_step")

    with pytest.raises(KeyError):
        eng.generate(ps, sp, on_step=boom)
    with pytest.raises(ValueError, match="n must be 1"):
        eng.generate(ps, SamplingParams(max_tokens=4, n=3))
    assert not eng._reqs and not eng.has_unfinished()
    assert eng.scheduler.num_free_blocks == free
    out = eng.generate(ps, sp)
    assert [r.token_ids for r in out] == references[:3]
