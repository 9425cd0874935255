"""pyspec.LLM / pyspec.generate / the CLI on a tiny random model folder (byte-level BPE tokenizer,
random Llama weights): every drafter spec, prompts as text or ids, chat, streaming, stop strings,
n samples, errors."""

import json
import os

import pytest
import torch

import pyspec
from pyspec import cli
from reference import decode_one
from pyspec.runner import ModelRunner

from models_support import VOCAB, write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return pyspec.LLM(model_dir, draft="ngram", kv_cache_tokens=4096)


def plain_ref(llm, ids, n):
    runner = ModelRunner(llm.model, num_blocks=64, block_size=16)
    return decode_one(runner, ids, n, eos_token_ids=llm.tokenizer.eos_token_ids).tokens


PROMPTS = ["the cat sat on the mat. the cat sat on the", "abc abc abc abc", "x"]


@pytest.mark.parametrize("draft", ["ngram", "none", "layer-skip:1", "default"])
def test_generate_matches_plain_greedy(model_dir, draft):
    llm = pyspec.LLM(model_dir, draft=draft, kv_cache_tokens=4096)
    outs = llm.generate(PROMPTS, pyspec.SamplingParams(max_tokens=20))
    assert len(outs) == len(PROMPTS)
    for p, o in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(p)
        assert o.prompt == p and o.prompt_token_ids == ids
        assert o.token_ids == plain_ref(llm, ids, 20)
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert o.finish_reason in ("length", "stop")
        assert o.seconds > 0 and o.time_to_first_token is not None
        if draft == "none":
            assert o.stats.draft_tokens == 0
    if draft != "none":
        assert sum(o.stats.draft_tokens for o in outs) > 0


def test_token_id_prompts_and_single_prompt(llm):
    ids = llm.tokenizer.encode(PROMPTS[0])
    a = llm.generate(ids, {"max_tokens": 8})
    b = llm.generate([ids], [{"max_tokens": 8}])
    c = llm.generate(PROMPTS[0], {"max_tokens": 8})
    assert len(a) == len(b) == len(c) == 1
    assert a[0].token_ids == b[0].token_ids == c[0].token_ids


def test_stop_strings_and_eos(llm):
    full = llm.generate(PROMPTS[0], {"max_tokens": 30, "ignore_eos": True})[0]
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate(PROMPTS[0], {"max_tokens": 30, "ignore_eos": True, "stop": [stop, "\x00zz"]})[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[:text.find(stop)]
    assert stop not in cut.text
    # The engine is idle again: no request left holding KV.
    s = llm.engine.scheduler
    assert not s.has_unfinished and s.num_free_blocks == s.num_total_blocks


def test_n_samples_and_seeds(llm):
    p = pyspec.SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3)
    a = llm.generate(PROMPTS[1], p)[0]
    b = llm.generate(PROMPTS[1], p)[0]
    assert len(a.outputs) == 3
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]  # seeded
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # different samples
    assert a.token_ids == a.outputs[0].token_ids


def test_chat_and_stream(llm):
    msgs = [{"role": "user", "content": "hello there"}]
    one = llm.chat(msgs, {"max_tokens": 10, "ignore_eos": True})
    two = llm.chat([msgs, msgs], {"max_tokens": 10, "ignore_eos": True})
    assert isinstance(two, list) and two[0].token_ids == one.token_ids == two[1].token_ids
    chunks = list(llm.stream(msgs, {"max_tokens": 10, "ignore_eos": True}, chat=True))
    assert chunks[-1].finished and chunks[-1].stats is not None
    assert [t for c in chunks for t in c.token_ids] == one.token_ids
    assert "".join(c.text for c in chunks) == one.text


def test_stream_closed_early_frees_kv(llm):
    s = llm.engine.scheduler
    it = llm.stream(PROMPTS[0], {"max_tokens": 50, "ignore_eos": True})
    next(it)
    assert s.has_unfinished
    it.close()
    assert not s.has_unfinished and s.num_running == 0


@pytest.mark.parametrize("params, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n must"),
    ({"stop": [""]}, "stop"),
    ({"bogus": 1}, "unknown sampling"),
    ({"max_tokens": 5000}, "context|KV pool"),
    ({"temperature": 1e300}, "temperature"),
    ({"temperature": 1, "top_p": 1e-300}, "top_p"),
    ({"ignore_eos": "no"}, "ignore_eos"),
    ({"stop_token_ids": "ab"}, "stop_token_ids"),
])
def test_bad_params(llm, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPTS[:2], params)
    assert not llm.engine.scheduler.has_unfinished  # nothing left queued


def test_surrogates_numpy_ids_and_the_largest_seed(llm):
    import numpy as np

    for bad in ("\ud800", "ok \udfff"):  # lone surrogates: no UTF-8 for them
        with pytest.raises(ValueError, match="not valid Unicode"):
            llm.generate(bad, {"max_tokens": 2})
        with pytest.raises(ValueError, match="not valid Unicode"):
            llm.chat([{"role": "user", "content": bad}], {"max_tokens": 2})
    ids = llm.tokenizer.encode(PROMPTS[0])
    ref = llm.generate(ids, {"max_tokens": 4})[0].token_ids
    assert llm.generate(np.array(ids).tolist(), {"max_tokens": 4})[0].token_ids == ref
    assert llm.generate([np.int64(t) for t in ids], {"max_tokens": 4})[0].token_ids == ref
    # n samples of the largest seed: seeds wrap into the 64-bit range instead of overflowing.
    out = llm.generate(PROMPTS[0], {"max_tokens": 4, "temperature": 1.0, "n": 2,
                                    "seed": (1 << 63) - 1})[0]
    assert len(out.outputs) == 2
    assert not llm.engine.scheduler.has_unfinished


def test_failed_step_raises_and_leaves_nothing_behind(llm, monkeypatch):
    eng = llm.engine
    monkeypatch.setattr(eng.runner, "step", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("injected failure")))
    with pytest.raises(pyspec.StepError, match="injected failure"):
        llm.generate(PROMPTS[:2], {"max_tokens": 8})
    monkeypatch.undo()
    s = eng.scheduler
    assert not s.has_unfinished and s.num_free_blocks == s.num_total_blocks
    assert not eng._reqs  # every request of the failed call was forgotten
    assert len(llm.generate(PROMPTS[0], {"max_tokens": 4, "ignore_eos": True})[0].token_ids) == 4
    # Ctrl-C in the middle of a step: the interrupt propagates, the LLM stays usable.
    monkeypatch.setattr(eng.runner, "step", lambda *a, **k: (_ for _ in ()).throw(
        KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:2], {"max_tokens": 8})
    monkeypatch.undo()
    assert not eng._reqs and not s.has_unfinished
    assert len(llm.generate(PROMPTS[0], {"max_tokens": 4, "ignore_eos": True})[0].token_ids) == 4


def test_bad_prompts_and_config(llm, model_dir, tmp_path):
    for bad in ([], "", [1.5], [VOCAB + 3], None):
        with pytest.raises(ValueError):
            llm.generate(bad if bad != [] else [[]], {"max_tokens": 2})
    with pytest.raises(ValueError, match="messages"):
        llm.chat([{"role": "user"}])
    with pytest.raises(ValueError, match="not a directory"):
        pyspec.LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="unknown drafter"):
        pyspec.LLM(model_dir, draft="medusa-please")
    if not pyspec.cuda_available():
        with pytest.raises(ValueError, match="device 'cuda'"):
            pyspec.LLM(model_dir, device="cuda")
    with pytest.raises(ValueError, match="device"):
        pyspec.LLM(model_dir, device="tpu")
    for bs in (0, -4, 1.5):
        with pytest.raises(ValueError, match="block_size"):
            pyspec.LLM(model_dir, block_size=bs)
    with pytest.raises(ValueError, match="ewma_window"):
        pyspec.LLM(model_dir, spec=pyspec.SpecConfig(ewma_window=0))


def test_draft_model_folder(model_dir, tmp_path):
    draft_dir = write_tiny_model(tmp_path / "draft", layers=1, seed=3)
    llm = pyspec.LLM(model_dir, draft=draft_dir, kv_cache_tokens=4096)
    out = llm.generate(PROMPTS, {"max_tokens": 16})
    for p, o in zip(PROMPTS, out):
        assert o.token_ids == plain_ref(llm, llm.tokenizer.encode(p), 16)
    for bad in ("@tree", "@tree="):
        with pytest.raises(ValueError, match="needs a value"):
            pyspec.LLM(model_dir, draft=draft_dir + bad, kv_cache_tokens=4096)
    tree = pyspec.LLM(model_dir, draft=draft_dir + "@tree=3", kv_cache_tokens=4096)
    out2 = tree.generate(PROMPTS, {"max_tokens": 16})
    assert [o.token_ids for o in out2] == [o.token_ids for o in out]
    # A draft model with another vocabulary is refused at load.
    conf = json.load(open(os.path.join(draft_dir, "config.json")))
    conf["vocab_size"] = 300
    other = tmp_path / "other"
    os.makedirs(other)
    json.dump(conf, open(other / "config.json", "w"))
    with pytest.raises(ValueError):
        pyspec.LLM(model_dir, draft=str(other))


def test_generate_shortcut(model_dir):
    out = pyspec.generate("abc abc abc", model=model_dir, draft="ngram", max_tokens=6)
    assert isinstance(out, pyspec.GenerationOutput) and len(out.token_ids) <= 6
    # Sampling arguments are checked before the model loads (here: a folder that is not one).
    for kw, match in (({"max_token": 3}, "unknown sampling parameters.*max_tokens"),
                      ({"max_tokens": 0}, "max_tokens must be an int >= 1"),
                      ({"top_p": 2.0}, "top_p must be in")):
        with pytest.raises(ValueError, match=match):
            pyspec.generate("abc", model="/nonexistent", **kw)


def test_cli_generate_compare(model_dir, capsys):
    rc = cli.main(["generate", "abc abc abc abc", "--model", model_dir, "--draft", "ngram",
                   "--max-tokens", "16", "--compare", "--ignore-eos"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "acceptance length" in out and "speedup" in out
    assert "outputs identical: True" in out
    rc = cli.main(["generate", "x", "--model", model_dir, "--draft", "nonsense"])
    assert rc == 2
    assert "unknown drafter" in capsys.readouterr().err


def test_cli_usage_errors_are_one_line(model_dir, capsys, monkeypatch):
    """Usage errors (argparse's too), an empty prompt and a missing optional package each give
    one `pyspec: error:` line and exit status 2; --version prints the version."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"pyspec {pyspec.__version__}"
    for argv, match in ((["generate", "x", "--temperature", "abc"], "invalid float value: 'abc'"),
                        ([], "required: command")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and match in err and err.count("\n") == 1, err
        assert err.startswith("pyspec: error:") and "usage:" not in err
    assert cli.main(["generate", "", "--model", model_dir]) == 2
    assert "the prompt is empty" in capsys.readouterr().err

    def no_fastapi(args):
        raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")

    monkeypatch.setattr(cli, "_cmd_info", no_fastapi)
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err
    assert "No module named 'fastapi'" in err and "pip install 'pyspec-decode[serve]'" in err, err


    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_info", interrupted)
    assert cli.main(["info"]) == 130
    assert capsys.readouterr().err == "pyspec info: interrupted\n"


def test_cli_generate_compare_one_token(model_dir, capsys):
    """One token is all prefill: no decode speed to print, nor a decode speedup (not NaN)."""
    rc = cli.main(["generate", "abc abc abc abc", "--model", model_dir, "--draft", "ngram",
                   "--max-tokens", "1", "--compare", "--ignore-eos"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "nan" not in out.lower(), out
    assert "n/a tok/s decode" in out and "decode n/a" in out and "end to end" in out, out


def test_stop_string_token_ids_do_not_depend_on_the_drafter(model_dir):
    """A speculative step emits several tokens at once; a stop string completed by one of them
    ends the output at that token, as plain decoding would: the tokens the step accepted past
    it are not output, so text *and* token ids equal plain decoding's whatever the drafter.
    The drafter here is the target itself (every draft accepted, up to 5 tokens a step), with a
    fixed draft length: drafting with the target costs more than it gains, which the adaptive
    cost model would see and answer with plain decoding."""
    plain = pyspec.LLM(model_dir, draft="none", kv_cache_tokens=4096)
    spec = pyspec.LLM(model_dir, draft=model_dir, spec=pyspec.SpecConfig(adaptive=False),
                      kv_cache_tokens=4096)
    full = plain.generate(PROMPTS[0], {"max_tokens": 40, "ignore_eos": True})[0]
    assert len(full.text) > 30
    checked = 0
    for k in range(3, 30, 3):
        stop = full.text[k:k + 2]
        params = {"max_tokens": 40, "ignore_eos": True, "stop": stop}
        a = plain.generate(PROMPTS[0], params)[0]
        b = spec.generate(PROMPTS[0], params)[0]
        assert b.stats.accepted_tokens > 0
        assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)
        chunks = list(spec.stream(PROMPTS[0], params))
        assert [t for c in chunks for t in c.token_ids] == a.token_ids
        assert "".join(c.text for c in chunks) == a.text
        checked += a.finish_reason == "stop"
    assert checked >= 5
    s = spec.engine.scheduler
    assert not s.has_unfinished and s.num_free_blocks == s.num_total_blocks


def test_streams_and_generate_interleave_without_losing_tokens(llm):
    """Every call steps the one engine: a stream left open while generate() runs, or two
    streams read in turns, still get all their tokens (each equal to its request run alone)."""
    p = {"max_tokens": 20, "ignore_eos": True}
    alone = [llm.generate(x, p)[0].token_ids for x in PROMPTS[:2]]
    s = llm.stream(PROMPTS[0], p)
    first = next(s)
    assert llm.generate(PROMPTS[1], p)[0].token_ids == alone[1]
    rest = list(s)  # used to spin forever: generate() had consumed its outputs
    assert rest[-1].finished
    assert first.token_ids + [t for c in rest for t in c.token_ids] == alone[0]
    s1, s2 = llm.stream(PROMPTS[0], p), llm.stream(PROMPTS[1], p)
    got = [[], []]
    its = [iter(s1), iter(s2)]
    live = [0, 1]
    while live:
        for i in list(live):
            c = next(its[i], None)
            if c is None:
                live.remove(i)
            else:
                got[i].extend(c.token_ids)
    assert got == alone
    s = llm.engine.scheduler
    assert not s.has_unfinished and not llm._tracks and not llm.engine._reqs


def test_a_failure_while_submitting_leaves_nothing_queued(model_dir):
    """A router (user code) raising something other than ValueError for the third prompt: the
    first two, already added, are removed too."""
    def route(f):
        if f.prompt_len > 5:
            raise ZeroDivisionError("router bug")
        return False

    r = pyspec.Router([(route, "a")], default="a")
    llm = pyspec.LLM(model_dir, draft="ngram", kv_cache_tokens=512,
                     spec=pyspec.SpecConfig(drafters={"a": "ngram"}, router=r))
    with pytest.raises(ZeroDivisionError):
        llm.generate(["ab", "ab", "a long prompt here"], {"max_tokens": 50, "ignore_eos": True})
    assert not llm.engine.has_unfinished() and not llm.engine._reqs and not llm._tracks
    assert len(llm.generate("ab", {"max_tokens": 4, "ignore_eos": True})[0].token_ids) == 4


@pytest.mark.parametrize("params, match", [
    ({"stop_token_ids": iter([12])}, "stop_token_ids"),
    ({"stop": "x" * 1025}, "at most 1024"),
    ({"stop": ["ok", "\ud800"]}, "lone surrogate"),
])
def test_bad_stop_params(llm, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(PROMPTS[0], params)


def test_generate_shortcut_refuses_a_batch():
    with pytest.raises(ValueError, match="one prompt"):
        pyspec.generate(["a", "b"], max_tokens=2)  # refused before any model is loaded


@pytest.mark.parametrize("field, value", [
    ("num_speculative_tokens", 1.5), ("adaptive", "no"), ("fallback_on_alpha_below", "0.5"),
    ("fallback_on_alpha_below", None), ("ewma_window", True), ("warmup_steps", 1.5),
    ("probe_interval", -1), ("drafters", "ngram"), ("router", "ngram"),
    ("switch_below", float("nan")), ("drafters", {"long": "lookahead"}),
])
def test_bad_spec_config_names_the_field(model_dir, field, value):
    with pytest.raises(ValueError, match=field):
        pyspec.LLM(model_dir, spec=pyspec.SpecConfig(**{field: value}))


def test_bad_engine_sizes_and_drafter_layers(model_dir):
    from pyspec.drafters.base import Draft, Drafter

    for kw, name in (({"max_num_seqs": 1.5}, "max_num_seqs"),
                     ({"max_num_batched_tokens": "x"}, "max_num_batched_tokens"),
                     ({"enable_prefix_cache": "no"}, "enable_prefix_cache"),
                     ({"kv_cache_tokens": 10 ** 12}, "kv_cache_tokens"),
                     ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be 'auto'.*got 'fp8'"),
                     ({"kv_cache_dtype": "float16", "dtype": "bfloat16"},
                      "float16 KV cache needs a float32 model")):
        with pytest.raises(ValueError, match=name):
            pyspec.LLM(model_dir, draft="ngram", **kw)
    llm = pyspec.LLM(model_dir, draft="ngram", kv_cache_dtype="float16", kv_cache_tokens=64)
    assert llm.runner.kv.k.dtype == torch.float16
    assert llm.generate([[1, 2, 3]], pyspec.SamplingParams(max_tokens=4))[0].token_ids

    class ReadsLayer99(Drafter):
        name = "layer99"
        needs_hidden = True
        hidden_layers = (99,)

        def propose(self, reqs):
            return [Draft([r.context[-1]], [-1]) for r in reqs]

    # Refused when the engine is built, naming the drafter, not at every request's step.
    with pytest.raises(ValueError, match="layer99.*99"):
        pyspec.LLM(model_dir, draft=ReadsLayer99())


@pytest.mark.parametrize("window", [1, 5])
def test_deployment_acceptance_ewma_follows_ewma_window(model_dir, tmp_path, window):
    """stats.acceptance_ewma weighs each speculative step's accepted / drafted depth with
    2 / (ewma_window + 1), as the scheduler's per-request EWMAs do."""
    draft = write_tiny_model(tmp_path / "draft", layers=1, seed=5)
    llm = pyspec.LLM(model_dir, draft, pyspec.SpecConfig(ewma_window=window, adaptive=False))
    rates = []  # each speculative step's accepted / drafted depth, in order
    llm.engine.trace_hook = lambda t: rates.extend(
        a / depth for nd, depth, a, _ in t.decisions.values() if nd)
    # Another random model drafts, the target is sampled: acceptance varies by step.
    llm.generate("abc abc abc", pyspec.SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                                                      ignore_eos=True))
    assert len(rates) >= 4 and len(set(rates[1:])) > 1, rates
    w = 2 / (window + 1)
    e = rates[0]
    for x in rates[1:]:
        e = (1 - w) * e + w * x
    assert llm.engine.stats.acceptance_ewma == pytest.approx(e, abs=1e-12)


def test_describe_names_the_model_kernels_and_drafter(model_dir):
    """LLM.describe(): the model's device, dtype and its own dense-layer kernels (a property of
    the model: two LLMs in one process with different kernels keep theirs), the drafter and the
    speculation settings."""
    from pyspec import _C

    a = pyspec.LLM(model_dir, draft="ngram", kv_cache_tokens=256, kernels="generic")
    b = pyspec.LLM(model_dir, draft="none", kv_cache_tokens=256,
                   spec=pyspec.SpecConfig(adaptive=False))
    da, db = a.describe(), b.describe()
    assert da["model_path"] == model_dir and (da["device"], da["dtype"]) == ("cpu", "float32")
    assert da["dense_layers"] == {"isa": "generic", "kernel": "generic",
                                  "core_kernel_up_to_rows": 16}
    best = _C.LinearKernels()
    assert db["dense_layers"]["isa"] == best.isa
    assert db["dense_layers"]["core_kernel_up_to_rows"] == best.max_fast_rows("float32")
    assert a.describe()["dense_layers"]["isa"] == "generic"  # unchanged by the other LLM
    assert da["packed"] is None  # random weights are on no block grid
    assert da["fused_layers"] is True
    assert da["drafter"].startswith("ngram") and db["drafter"] == "none (plain decoding)"
    assert da["speculation"]["adaptive"] is True and db["speculation"]["adaptive"] is False
    p = {"max_tokens": 8, "ignore_eos": True}
    assert len(a.generate("abc", p)[0].token_ids) == len(b.generate("abc", p)[0].token_ids) == 8
    with pytest.raises(ValueError, match="unknown linear kernel ISA 'avx9'"):
        pyspec.LLM(model_dir, draft="none", kv_cache_tokens=256, kernels="avx9")


def test_a_tokenizer_larger_than_the_model_is_refused_at_load(tmp_path):
    """A tokenizer.json whose ordinary tokens outnumber the model's vocabulary (another model's)
    fails at load, naming both files, not at the first prompt that encodes past the table."""
    from models_support import _byte_alphabet, write_byte_bpe

    d = write_tiny_model(tmp_path / "m")
    alpha = _byte_alphabet()
    merges = [(alpha[ord("a")], alpha[ord(c)]) for c in "bcdefghijk"]
    write_byte_bpe(str(d), merges=merges)
    with pytest.raises(ValueError, match=rf"tokenizer.json has {VOCAB + 10} tokens, more than the "
                                         rf"model's vocabulary \(vocab_size {VOCAB} in config.json"):
        pyspec.LLM(d, draft="none", kv_cache_tokens=256)
