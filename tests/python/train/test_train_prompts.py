"""pyspec.train.prompts: near-duplicate detection, the language filter, the diversity and
reference-overlap report, and pyspec synth-prompts (resumable Magpie-style synthesis)."""

import json
import os

import pytest

from pyspec.train.prompts import (NearDuplicates, diversity_report, jaccard, latin_share,
                                  normalize, shingles)


def test_shingles_and_jaccard():
    assert normalize("  Hello,  WORLD! It's me ") == "hello world it's me"
    assert shingles("a b c d") == {"a b c", "b c d"}
    assert shingles("two words") == {"two words"} and shingles("!!") == set()
    assert jaccard({"x"}, {"x"}) == 1.0 and jaccard({"x"}, {"y"}) == 0.0


def test_near_duplicates_catch_copies_and_keep_new_requests():
    d = NearDuplicates(0.7)
    base = ("Write a short story about a lighthouse keeper who finds a message in a bottle "
            "washed up on the rocks one stormy night")
    assert d.add(base)
    assert not d.add(base.upper() + "  ")  # the same up to case and spacing
    assert not d.add(base + " near the harbour")  # a near copy (Jaccard >= 0.7)
    assert d.add("Explain how a transistor amplifies a signal, with a simple circuit example")
    assert d.add("Plan a three day trip to Lisbon on a student budget")
    assert not d.add("!!") or not d.add("!!")  # texts without words: exact copies only
    assert len(d) >= 3
    # Deterministic: a fresh index decides the same.
    e = NearDuplicates(0.7)
    assert e.add(base) and not e.add(base + " near the harbour")
    with pytest.raises(ValueError, match="threshold"):
        NearDuplicates(0.0)
    with pytest.raises(ValueError, match="multiple of bands"):
        NearDuplicates(0.5, num_perm=10, bands=3)


def test_near_duplicates_recall_over_many():
    """Every near copy of 200 distinct requests is caught; none of the originals is dropped."""
    topics = [f"topic{i} item{i * 7} thing{i * 13}" for i in range(200)]
    d = NearDuplicates(0.7)
    texts = [f"Please tell me everything about {t} and why it matters today" for t in topics]
    assert all(d.add(t) for t in texts)
    assert not any(d.add(t + " please") for t in texts)


def test_latin_share():
    assert latin_share("Hello there, café") == 1.0
    assert latin_share("Привет мир") == 0.0
    assert 0.4 < latin_share("hello Привет") < 0.6
    assert latin_share("123 !!") == 0.0


def test_diversity_report_and_reference_overlap():
    mt = ["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
          "cultural experiences and must-see attractions.",
          "Draft a professional email seeking your supervisor's feedback on the quarterly "
          "financial report you prepared."]
    mine = ["Plan a three day trip to Lisbon on a student budget",
            "Explain how a transistor amplifies a signal",
            "Write a poem about autumn leaves"]
    r = diversity_report(mine, mt)
    assert r["prompts"] == 3 and r["words"]["p10_p50_p90"][1] == 7
    assert 0 < r["distinct_1"] <= 1 and r["first_word_entropy_bits"] == 1.58  # 3 first words: log2(3)
    ref = r["reference"]
    assert ref["share_of_8grams_in_reference"] == 0 and ref["max_jaccard_3gram"] < 0.1
    copied = diversity_report(mine + [mt[0]], mt)["reference"]
    assert copied["max_jaccard_3gram"] == 1.0 and copied["prompts_at_or_above_0.5"] == 1
    assert copied["share_of_8grams_in_reference"] > 0
    with pytest.raises(ValueError, match="no prompts"):
        diversity_report([])


def test_synth_prompts_resumes_and_reports(tiny, tmp_path, monkeypatch, capsys):
    """pyspec synth-prompts writes requests as they come, resumes a stopped run where it was
    (the same requests as one run), and reports diversity and reference overlap."""
    import pyspec
    from pyspec import cli
    from pyspec.tokenizer import Tokenizer
    from pyspec.train.prompts import synthesize_prompts

    real = Tokenizer.from_pretrained

    def ending(path):  # a random tiny model rarely ends a turn: let many byte tokens end it
        t = real(path)
        t.eos_token_ids = set(range(3, 259, 3)) | {2}
        return t

    monkeypatch.setattr(Tokenizer, "from_pretrained", staticmethod(ending))
    llm = pyspec.LLM(tiny, draft="none", kv_cache_tokens=2048)
    kw = dict(batch=8, max_tokens=8, min_words=1, min_latin=0.0, progress=False)
    whole = synthesize_prompts(llm, 6, seed=3, **kw)
    assert whole["kept"] == 6 and whole["draws"] >= 6
    assert whole["prompts_per_hour"] > 0 and whole["generated_tokens"] > 0
    out = str(tmp_path / "p.jsonl")
    first = synthesize_prompts(llm, 3, out=out, seed=3, **kw)
    assert [json.loads(x)["prompt"] for x in open(out)] == first["prompts"]
    with open(out, "a") as f:
        f.write('{"prompt": "cut off mid-wri')  # a run killed mid-write
    again = synthesize_prompts(llm, 6, out=out, seed=3, **kw)  # resumes
    assert again["prompts"][:3] == first["prompts"] and again["kept"] == 6
    assert [json.loads(x)["prompt"] for x in open(out)] == again["prompts"]
    with pytest.raises(ValueError, match="same"):
        synthesize_prompts(llm, 8, out=out, seed=4, **kw)
    # A file that is not a run of this command is refused and left as it was.
    other = tmp_path / "config.json"
    other.write_text('{"vocab_size": 259}')  # no newline at its end, no state file
    with pytest.raises(ValueError, match="is not a synth-prompts run to resume"):
        synthesize_prompts(llm, 2, out=str(other), seed=3, **kw)
    assert other.read_text() == '{"vocab_size": 259}'
    # A run that kept nothing yet resumes: an empty file beside its state, or an empty file
    # alone (stopped during its first batch, before the state was first written).
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    (tmp_path / "e.jsonl.state.json").write_text(json.dumps({"seed": 3, "batch": 8, "tries": 0}))
    assert synthesize_prompts(llm, 2, out=str(empty), seed=3, **kw)["kept"] == 2
    alone = tmp_path / "alone.jsonl"
    alone.write_text("")
    assert synthesize_prompts(llm, 2, out=str(alone), seed=3, **kw)["kept"] == 2
    ref = tmp_path / "ref.jsonl"
    ref.write_text(json.dumps({"prompt": "an unrelated reference question about tea"}) + "\n")
    cout = str(tmp_path / "c.jsonl")
    assert cli.main(["synth-prompts", "--target", tiny, "--n", "2", "--out", cout, "--batch",
                     "4", "--max-tokens", "6", "--min-latin", "0", "--min-words", "1", "--reference", str(ref)]) == 0
    rep = json.load(open(os.path.splitext(cout)[0] + ".report.json"))
    assert rep["run"]["kept"] == 2 and rep["run"]["draws"] >= 2
    assert rep["diversity"]["prompts"] == 2 and rep["diversity"]["reference"]["prompts"] == 1
    assert "--min-latin 0.0" in rep["command"]
    assert cli.main(["synth-prompts", "--target", tiny, "--n", "0", "--out", cout]) == 2
    assert "--n must be >= 1" in capsys.readouterr().err
    # Named by their own flag, before the model loads (here it does not even exist).
    missing = str(tmp_path / "no-model")
    assert cli.main(["synth-prompts", "--target", missing, "--n", "2", "--out", cout,
                     "--reference", str(tmp_path / "nope.jsonl")]) == 2
    assert "--reference: " in capsys.readouterr().err
    assert cli.main(["synth-prompts", "--target", missing, "--n", "2", "--out",
                     str(tmp_path / "nodir" / "x.jsonl")]) == 2
    assert "must be a file in a folder that exists" in capsys.readouterr().err
