"""Output tracking (pyspec.outputs): the text a stream holds back because it may begin a stop
string, and one step's outputs through their trackers (stop strings, engine aborts, reasons)."""


def test_held_back_text_is_the_longest_stop_prefix():
    """The text held back from a stream (it may begin a stop string) is the longest end of the
    text that is a proper prefix of some stop string, checked against brute force."""
    import random

    from pyspec.outputs import OutputTracker

    rng = random.Random(0)
    for _ in range(500):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 3))]
        t = OutputTracker.__new__(OutputTracker)
        t.stops, t.text = stops, "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        want = max([k for s in stops for k in range(1, len(s)) if t.text.endswith(s[:k])],
                   default=0)
        assert t._held() == want, (stops, t.text)


class _Engine:
    """The one engine call apply_outputs makes: abort (recorded)."""

    def __init__(self):
        self.aborted = []

    def abort(self, rid):
        self.aborted.append(rid)
        return True


def test_apply_outputs_cuts_at_stop_strings_and_aborts_the_engine_request(tmp_path):
    """One step's outputs through their trackers: a stop string completed mid-step ends the
    request at the token that completed it (later tokens of the step dropped) and aborts it at
    the engine; outputs of requests without a tracker pass through as token deltas; a tracker that
    finished gets nothing more; an engine finish flushes and keeps the engine's reason."""
    from models_support import write_byte_bpe

    from pyspec.engine import RequestOutput
    from pyspec.outputs import OutputTracker, apply_outputs
    from pyspec.params import SamplingParams
    from pyspec.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(write_byte_bpe(str(tmp_path / "tok")))
    ids = tok.encode("ab\ncd", add_special_tokens=False)
    assert len(ids) == 5
    stopping = OutputTracker(tok, SamplingParams(stop="\n"))
    plain = OutputTracker(tok, SamplingParams())
    eng = _Engine()
    trackers = {1: stopping, 2: plain}
    d1, d2, d3 = apply_outputs(eng, [RequestOutput(1, ids, False, None),
                                     RequestOutput(2, ids[:2], False, None),
                                     RequestOutput(3, [7, 8], True, "length")], trackers)
    assert (d1.text, d1.token_ids, d1.finished, d1.finish_reason, d1.stopped) == (
        "ab", ids[:3], True, "stop", True)
    assert eng.aborted == [1] and stopping.text == "ab" and stopping.tokens == ids[:3]
    assert (d2.text, d2.token_ids, d2.finished, d2.stopped) == ("ab", ids[:2], False, False)
    assert (d3.tracker, d3.token_ids, d3.finished, d3.finish_reason) == (None, [7, 8], True,
                                                                         "length")
    # The stopped request's later outputs are ignored; the other finishes with its reason.
    later = apply_outputs(eng, [RequestOutput(1, ids[3:], True, "abort"),
                                RequestOutput(2, ids[2:], True, "length")], trackers)
    assert [d.request_id for d in later] == [2] and eng.aborted == [1]
    assert (later[0].text, later[0].finish_reason, plain.text) == ("\ncd", "length", "ab\ncd")
    assert plain.time_to_first_token is not None and plain.time_to_first_token >= 0


def _multichar_tokenizer(tmp_path):
    """A byte-level BPE whose merges make "the cat sat" three tokens: "the", " cat", " sat"."""
    from models_support import write_byte_bpe

    from pyspec.tokenizer import Tokenizer

    merges = [("t", "h"), ("th", "e"), ("Ġ", "c"), ("Ġc", "a"), ("Ġca", "t"), ("Ġ", "s"),
              ("Ġs", "a"), ("Ġsa", "t")]
    tok = Tokenizer.from_pretrained(write_byte_bpe(str(tmp_path / "tok"), merges=merges))
    ids = tok.encode("the cat sat", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == ["the", " cat", " sat"]
    return tok, ids


# (stop strings, text kept, tokens kept): each stop string ends inside a multi-character token.
STOPS_INSIDE_TOKENS = [
    (["h"], "t", 1),  # inside the first token
    (["ca"], "the ", 2),  # from the start of " cat" into it
    (["e c"], "th", 2),  # across "the" | " cat", ending inside " cat"
    (["at s"], "the c", 3),  # across " cat" | " sat", ending inside " sat"
    (["sat", "at"], "the c", 2),  # two stop strings: the earliest occurrence wins
    (["e ca"], "th", 2),
]


def test_stop_string_ending_inside_a_multi_character_token(tmp_path):
    """A stop string that ends inside a token cuts the text exactly where the stop string begins
    (not at a token boundary), keeps the tokens up to the one that completed it, and never streams
    a character past the cut, whether the tokens come one per step or in one speculative step."""
    from pyspec.outputs import OutputTracker
    from pyspec.params import SamplingParams

    tok, ids = _multichar_tokenizer(tmp_path)
    for stops, text, n_tokens in STOPS_INSIDE_TOKENS:
        assert min("the cat sat".find(s) for s in stops) == len(text)  # the table is right
        for split in ([1, 1, 1], [3], [2, 1], [1, 2]):
            t = OutputTracker(tok, SamplingParams(stop=stops))
            streamed, tokens, at = "", [], 0
            for k in split:
                delta, new, stopped = t.push(ids[at:at + k], at + k == len(ids), "length")
                at += k
                streamed += delta
                tokens += new
                if stopped:
                    break
            assert t.finished and t.reason == "stop", (stops, split)
            assert t.text == streamed == text, (stops, split, t.text, streamed)
            assert tokens == t.tokens == ids[:n_tokens], (stops, split, tokens)
