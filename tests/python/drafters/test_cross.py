"""Drafts from a model with another tokenizer (pyspec.drafters.cross): chains re-tokenized through
text; the output stays plain decoding's, greedy and sampled."""

import json
import math
import os

import pytest
import torch

import pyspec
from models_support import write_byte_bpe, write_tiny_model
from pyspec.drafters.base import DraftRequest
from pyspec.drafters.cross import CrossTokenizerDrafter, same_vocabulary
from pyspec.tokenizer import Tokenizer


def _write_model(path, merges, seed=1, layers=1, padding=0):
    """A tiny random Llama whose byte-level tokenizer has these merges (its own vocabulary),
    its embedding table ``padding`` rows longer than the tokenizer."""
    from safetensors.torch import save_file

    from pyspec.models.config import ModelConfig
    from pyspec.models.loader import expected_shapes

    vocab = 259 + len(merges) + padding
    conf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab,
                hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=2)
    write_byte_bpe(str(path), merges=merges, model_config=conf)
    g = torch.Generator().manual_seed(seed)
    w = {}
    for name, shape in expected_shapes(ModelConfig.from_dict(conf)).items():
        w[name] = torch.ones(shape) if name.endswith("norm.weight") else \
            torch.randn(shape, generator=g) * (2.0 / math.sqrt(shape[-1]))
    save_file(w, os.path.join(str(path), "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cross")
    target = write_tiny_model(root / "target")
    draft = _write_model(root / "draft", [("t", "h"), ("th", "e"), ("Ġ", "t"), ("i", "n")])
    return target, draft


def test_a_draft_model_with_another_tokenizer_drafts_through_text(folders):
    target, draft = folders
    llm = pyspec.LLM(target, draft=draft, kv_cache_tokens=2048)
    d = llm.engine.drafters[llm.engine.default_drafter]
    assert isinstance(d, CrossTokenizerDrafter) and "cross-tokenizer" in llm.drafter_name
    plain = pyspec.LLM(target, draft="none", kv_cache_tokens=2048)
    prompts = ["the theme in the thing", "hello there, the cat", "in the end"]
    for params in ({"max_tokens": 24, "temperature": 0},
                   {"max_tokens": 24, "temperature": 0.8, "seed": 7}):
        got = llm.generate(prompts, params)
        want = plain.generate(prompts, params)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert llm.engine.stats.draft_tokens > 0  # it did draft
    assert not d._tables  # every request's draft KV was given back


def test_proposals_follow_the_target_tokenization(folders):
    """The mapping alone, with the draft model's continuation given: the draft's text comes back
    as the target's tokens after the context, also where the target's tokenizer would merge the
    context's last token with the proposal's first characters."""
    target, draft = folders
    merged = write_byte_bpe(os.path.join(os.path.dirname(target), "merged-tok"),
                            merges=[("r", "l"), ("l", "d")])
    dt = Tokenizer.from_pretrained(draft)
    for ttok_path in (target, merged):
        tt = Tokenizer.from_pretrained(ttok_path)
        assert not same_vocabulary(dt, tt)
        llm = pyspec.LLM(target, draft="none", kv_cache_tokens=1024)
        d = CrossTokenizerDrafter(llm.model, dt, tt, target_vocab=tt.vocab_size, max_depth=6,
                                  kv_tokens=256)
        said = {}

        def given(rid, ids, n, said=said):
            said["text"] = dt.decode(ids)
            return dt.encode("ld, the end")[:n]

        d._continue = lambda items: [given(*it) for it in items]
        ctx = tt.encode("Hello wor", add_special_tokens=False)
        (prop,) = d.propose([DraftRequest(0, ctx, len(ctx) - 1, [], 6)])
        assert said["text"] == "Hello wor"  # the draft model saw the context's text
        assert prop.tokens[0] == ctx[-1] and prop.parents == list(range(-1, len(prop.tokens) - 1))
        text = tt.decode(ctx + prop.tokens[1:])
        assert text.startswith("Hello world") and "Hello world, the end".startswith(text)
    # A draft token the target's model lacks (an added token of its tokenizer) ends the chain.
    d = CrossTokenizerDrafter(llm.model, dt, tt, target_vocab=5, kv_tokens=256)
    d._continue = lambda items: [dt.encode("abc") for _ in items]
    assert d.propose([DraftRequest(0, [1, 2], 1, [], 4)])[0].tokens == [2]


def test_same_tokenizer_is_a_plain_draft_model_and_errors_are_clear(folders, tmp_path):
    from pyspec.drafters.model import ModelDrafter

    target, draft = folders
    same = _write_model(tmp_path / "same", [])  # the target's byte vocabulary
    llm = pyspec.LLM(target, draft=same, kv_cache_tokens=1024)
    assert isinstance(llm.engine.drafters[llm.engine.default_drafter], ModelDrafter)
    with pytest.raises(ValueError, match="tree= does not apply"):
        pyspec.LLM(target, draft=draft + "@tree=2", kv_cache_tokens=1024)
    conf = json.load(open(os.path.join(draft, "config.json")))
    json.dump(dict(conf, vocab_size=conf["vocab_size"] - 2),  # its tokenizer no longer fits
              open(os.path.join(draft, "config.json"), "w"))
    try:
        with pytest.raises(ValueError, match="tokenizer.json has .* tokens, more than the model's"):
            pyspec.LLM(target, draft=draft, kv_cache_tokens=1024)
    finally:
        json.dump(conf, open(os.path.join(draft, "config.json"), "w"))
    os.remove(os.path.join(draft, "tokenizer.json"))
    try:
        with pytest.raises(ValueError, match="needs\\s+both tokenizers|both tokenizers"):
            pyspec.LLM(target, draft=draft, kv_cache_tokens=1024)
    finally:
        write_byte_bpe(draft, merges=[("t", "h"), ("th", "e"), ("Ġ", "t"), ("i", "n")],
                       model_config=json.load(open(os.path.join(draft, "config.json"))))


def test_draft_kv_is_reused_and_bounded(folders):
    """The draft model reruns only what changed since its last step, and a request that does not
    fit its pool gets no draft instead of an error."""
    target, draft = folders
    from pyspec.models.llama import LlamaForCausalLM

    dt, tt = Tokenizer.from_pretrained(draft), Tokenizer.from_pretrained(target)
    m = LlamaForCausalLM.from_pretrained(draft)
    d = CrossTokenizerDrafter(m, dt, tt, target_vocab=tt.vocab_size, max_depth=3, kv_tokens=64)
    rows = []
    real = d.runner.step
    d.runner.step = lambda seqs, **kw: (rows.append(len(seqs[0].token_ids)), real(seqs, **kw))[1]
    ctx = tt.encode("the theme of the day", add_special_tokens=False)
    d.propose([DraftRequest(0, ctx, len(ctx) - 1, [], 3)])
    first = rows[0]
    rows.clear()
    d.propose([DraftRequest(0, ctx + [ord("x") + 3], len(ctx), [], 3)])
    assert rows[0] < first  # only the new text's tokens ran
    big = tt.encode("the " * 40, add_special_tokens=False)
    assert d.propose([DraftRequest(1, big, len(big) - 1, [], 3)])[0].tokens == [big[-1]]
    d.release(0)
    d.release(1)
    assert len(d._free) == d.runner.kv.num_blocks


def test_requests_draft_together(folders):
    """Several requests' continuations run in one draft-model step per token position, each
    the same as when it runs alone."""
    target, draft = folders
    from pyspec.models.llama import LlamaForCausalLM

    dt, tt = Tokenizer.from_pretrained(draft), Tokenizer.from_pretrained(target)
    m = LlamaForCausalLM.from_pretrained(draft)
    texts = ["the theme of the day", "in the end the thing", "hello there"]
    ctxs = [tt.encode(t, add_special_tokens=False) for t in texts]
    alone = []
    for i, c in enumerate(ctxs):
        d = CrossTokenizerDrafter(m, dt, tt, target_vocab=tt.vocab_size, max_depth=4,
                                  kv_tokens=512)
        alone.append(d.propose([DraftRequest(i, c, len(c) - 1, [], 4)])[0].tokens)
    d = CrossTokenizerDrafter(m, dt, tt, target_vocab=tt.vocab_size, max_depth=4, kv_tokens=512)
    calls = []
    real = d.runner.step
    d.runner.step = lambda seqs, **kw: (calls.append(len(seqs)), real(seqs, **kw))[1]
    together = d.propose([DraftRequest(i, c, len(c) - 1, [], 4) for i, c in enumerate(ctxs)])
    assert [p.tokens for p in together] == alone
    assert calls[0] == 3 and len(calls) <= 4 + 2  # one step per position for all three


def test_same_tokenizer_with_padded_tables_of_other_sizes(tmp_path):
    """One tokenizer, embedding tables padded to different sizes (a model family's small and
    large members): the draft model drafts over the ids the target has, in both directions,
    greedy and sampled output equal to plain decoding's."""
    from pyspec.drafters.model import ModelDrafter

    for target_pad, draft_pad in ((0, 61), (61, 0)):
        target = _write_model(tmp_path / f"t{target_pad}", [], seed=0, layers=2,
                              padding=target_pad)
        draft = _write_model(tmp_path / f"d{draft_pad}", [], seed=3, padding=draft_pad)
        llm = pyspec.LLM(target, draft=draft, kv_cache_tokens=2048)
        assert isinstance(llm.engine.drafters[llm.engine.default_drafter], ModelDrafter)
        plain = pyspec.LLM(target, draft="none", kv_cache_tokens=2048)
        # Token ids in and out (a padded target may emit ids its tokenizer cannot spell).
        prompts = [llm.encode(p) for p in ("the theme in the thing", "abc abc abc abc")]
        for params in ({"max_tokens": 20, "temperature": 0},
                       {"max_tokens": 20, "temperature": 0.9, "seed": 5}):
            got = llm.engine.generate(prompts, params)
            assert [g.token_ids for g in got] == \
                [w.token_ids for w in plain.engine.generate(prompts, params)]
        assert llm.engine.stats.draft_tokens > 0
