"""The scheduler binding (pyspec._C.Scheduler) driven by a deterministic fake model."""

import random

import pytest

from pyspec import _C

VOCAB = 111


def model_token(prompt, pos):
    # The token at position `pos` depends only on the prompt and the position, so outputs do not
    # depend on batching, chunking, acceptance or preemption.
    return hash((tuple(prompt), pos)) % VOCAB


def expected(prompt, max_tokens, stop=()):
    out = []
    while len(out) < max_tokens:
        t = model_token(prompt, len(prompt) + len(out))
        out.append(t)
        if t in stop:
            break
    return out


def run_fake(sched, out, rng):
    """The runner's side of one step: check the batch, emit correct tokens, random acceptance."""
    res = _C.StepResult()
    assert len(set(out.ids)) == len(out.ids)
    for i, rid in enumerate(out.ids):
        req = sched.request(rid)
        toks = out.tokens_of(i)
        assert toks == out.tokens[out.token_indptr[i]:out.token_indptr[i + 1]]
        assert len(out.block_table_of(i)) == out.block_indptr[i + 1] - out.block_indptr[i]
        if out.kinds[i] == "prefill":
            assert out.logits[i] == "none" and out.draft_budget[i] == 0
            assert len(out.slots_of(i)) == len(toks)
            res.add_prefill(rid, len(toks))
        else:
            assert toks == [(req.prompt + req.generated)[-1]]
            assert out.start_pos[i] == len(req.prompt) + len(req.generated) - 1
            budget = out.draft_budget[i]
            assert out.kinds[i] == ("speculative" if budget else "decode")
            assert len(out.slots_of(i)) == budget + 1
            drafted = rng.randint(0, budget)
            acc = rng.randint(0, drafted)
            start = out.start_pos[i]
            res.add_decode(rid, [model_token(req.prompt, start + 1 + j) for j in range(acc + 1)],
                           num_drafted=drafted, num_accepted=acc)
    return res


def drive(sched, rng, max_steps=10000):
    streamed = {}
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return streamed
        out = sched.step()
        assert out.num_budgeted_tokens <= 24
        for rid, new, finished, reason in sched.update(run_fake(sched, out, rng)):
            streamed.setdefault(rid, []).extend(new)
            assert finished == (reason is not None)
        sched.check_invariants()
    raise AssertionError("the scheduler did not finish")


def test_loop_with_fake_model_matches_solo_outputs():
    rng = random.Random(0)
    sched = _C.Scheduler(12, 4, max_num_batched_tokens=24, max_num_seqs=5, max_draft_tokens=3,
                         initial_draft_tokens=2, spec_token_budget=8, spec_disable_batch_size=4,
                         record_transitions=True)
    prompts = {}
    for rid in range(9):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 15))]
        stop = [rng.randrange(VOCAB)] if rid % 3 == 0 else []
        prompts[rid] = (prompt, rng.randint(1, 12), stop)
        sched.add_request(rid, prompt, max_tokens=prompts[rid][1], stop_token_ids=stop,
                          speculative=rid % 4 != 0)
    assert sched.num_waiting == 9 and sched.num_running == 0
    streamed = drive(sched, rng)
    assert sched.num_preemptions > 0  # 12 blocks of 4 tokens: the pool runs out
    for rid, (prompt, max_tokens, stop) in prompts.items():
        req = sched.request(rid)
        assert req.finished and req.state == "FINISHED"
        assert req.finish_reason in ("stop", "length")
        assert req.generated == expected(prompt, max_tokens, stop)
        assert streamed[rid] == req.generated
        assert req.history[0] == "WAITING" and req.history[-1] == "FINISHED"
        assert req.num_accepted_tokens <= req.num_draft_tokens
    assert sorted(sched.finished_ids) == list(range(9))
    assert sched.num_free_blocks == sched.num_total_blocks
    sched.release(3)
    assert not sched.has_request(3)


def test_chunked_prefill_and_records_are_plain_python():
    sched = _C.Scheduler(64, 4, max_num_batched_tokens=8)
    sched.add_request(5, list(range(1, 21)), max_tokens=2)
    out = sched.step()
    assert len(out) == 1 and out.kinds == ["prefill"] and out.start_pos == [0]
    assert out.tokens == list(range(1, 9)) and out.token_indptr == [0, 8]
    assert isinstance(out.slots, list) and all(isinstance(s, int) for s in out.slots)
    assert out.preempted_ids == [] and out.finished_ids == [] and out.pending_copies == []
    assert sched.update(_C.StepResult()) == []  # no progress reported: rescheduled
    chunks = []
    while sched.request(5).state == "PREFILL":
        out = sched.step()
        chunks.append(len(out.tokens))
        res = _C.StepResult()
        res.add_prefill(5, len(out.tokens))
        sched.update(res)
    assert chunks == [8, 8, 3]  # 19 positions before the root
    assert sched.request(5).state == "RUNNING_SPECULATIVE"
    assert sched.request(5).num_computed == 19


def test_spec_budget_shrinks_with_batch():
    sched = _C.Scheduler(64, 4, max_draft_tokens=4, spec_token_budget=12,
                         spec_disable_batch_size=8)
    assert [sched.spec_share(n, n) for n in (1, 3, 4, 6, 7, 8, 50)] == [4, 4, 3, 2, 1, 0, 0]


def test_abort_and_errors():
    sched = _C.Scheduler(4, 4, max_num_batched_tokens=16)
    sched.add_request(1, list(range(30)), max_tokens=3)  # cannot fit even alone
    sched.add_request(2, [1, 2, 3], max_tokens=3)
    out = sched.step()
    assert 1 in out.finished_ids
    req = sched.request(1)
    assert req.finish_reason == "error" and "even alone" in req.error
    assert sched.abort(2) is True
    assert sched.abort(2) is False
    sched.update(_C.StepResult())  # the aborted request's step is dropped
    assert sched.request(2).finish_reason == "abort"
    assert sched.num_free_blocks == sched.num_total_blocks
    sched.check_invariants()


def test_value_errors():
    with pytest.raises(ValueError):
        _C.Scheduler(8, 4, max_num_batched_tokens=0)
    with pytest.raises(ValueError):
        _C.Scheduler(8, 4, spec_token_budget=-1)
    with pytest.raises(ValueError):
        _C.Scheduler(8, 4, max_draft_tokens=2, initial_draft_tokens=3)
    with pytest.raises(ValueError):
        _C.Scheduler(0, 4)
    sched = _C.Scheduler(8, 4)
    with pytest.raises(ValueError):
        sched.add_request(1, [])
    with pytest.raises(ValueError):
        sched.add_request(1, [1], max_tokens=0)
    with pytest.raises(ValueError):
        sched.add_request(1, [2**40])
    sched.add_request(1, [1, 2])
    with pytest.raises(ValueError):
        sched.add_request(1, [1, 2])
    for bad in (sched.abort, sched.request, sched.release):
        with pytest.raises(ValueError):
            bad(99)
    with pytest.raises(ValueError):
        sched.update(_C.StepResult())  # no step in flight
    sched.step()
    with pytest.raises(ValueError):
        sched.step()
    res = _C.StepResult()
    res.add_decode(77, [1])
    with pytest.raises(ValueError):
        sched.update(res)
    res = _C.StepResult()
    res.add_prefill(1, 5)  # chunk is 1 token
    with pytest.raises(ValueError):
        sched.update(res)


def test_optimal_draft_length_matches_leviathan_formula():
    from pyspec import _C

    def rate(a, c, g):
        return sum(a ** i for i in range(g + 1)) / (1 + c * g)

    for a in (0.0, 0.3, 0.6, 0.8, 0.95):
        for c in (0.0, 0.05, 0.3):
            g, gain = _C.optimal_draft_length(a, c / 2, c / 2, 12)
            best = max(range(1, 13), key=lambda k: rate(a, c, k))
            assert abs(gain - rate(a, c, best)) < 1e-9
            assert abs(rate(a, c, g) - rate(a, c, best)) < 1e-9
    g, gain = _C.optimal_draft_length(0.05, 0.4, 0.2, 8)
    assert gain < 1.0  # speculation would be slower than plain decoding
    with pytest.raises(ValueError):
        _C.optimal_draft_length(0.5, -0.1, 0.0, 4)
    with pytest.raises(ValueError, match="max_len"):  # refused, not scanned for seconds
        _C.optimal_draft_length(0.5, 0.0, 0.0, 1 << 40)
    s = _C.Scheduler(16, 4, cost_model=True)
    with pytest.raises(ValueError, match="verify_cost"):
        s.set_cost_model(0.1, float("inf"))
    with pytest.raises(ValueError, match="draft_cost"):
        _C.Scheduler(16, 4, draft_cost=-1.0)


def test_draft_sources_keep_their_own_draft_length():
    """Through the binding: source 0 always right, source 1 never; each keeps its own length."""
    sched = _C.Scheduler(64, 4, max_draft_tokens=6, initial_draft_tokens=2)
    sched.add_request(1, [1, 2, 3], max_tokens=100)

    def step(all_right):
        out = sched.step()
        res = _C.StepResult()
        for i, rid in enumerate(out.ids):
            if out.kinds[i] == "prefill":
                res.add_prefill(rid, len(out.tokens_of(i)))
            else:
                b = out.draft_budget[i]
                a = b if all_right else 0
                res.add_decode(rid, [7] * (a + 1), num_drafted=b, num_accepted=a)
        sched.update(res)

    step(True)  # prefill
    lengths = {0: [], 1: []}
    for k in range(12):
        src = k % 2
        assert sched.set_draft_source(1, src) is True
        assert sched.request(1).draft_source == src
        lengths[src].append(sched.request(1).draft_len)
        step(src == 0)
    assert lengths[0] == [2, 3, 4, 5, 6, 6]  # +1 per fully accepted step, up to the maximum
    assert lengths[1] == [2, 1, 1, 1, 1, 1]  # -1 per miss, not below 1
    for bad in (-1, _C.MAX_DRAFT_SOURCES):
        with pytest.raises(ValueError, match="out of range"):
            sched.set_draft_source(1, bad)
    with pytest.raises(ValueError, match="unknown request"):
        sched.set_draft_source(99, 0)
    sched.step()
    with pytest.raises(ValueError, match="between update"):
        sched.set_draft_source(1, 0)
    sched.abort(1)
    assert sched.set_draft_source(1, 0) is False
