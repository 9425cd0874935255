"""Prompts at scale without a dataset download: the target writes its own requests (Magpie-style
self-synthesis: it is given only its chat template's user-turn header and samples what a user
would ask), kept when they end their turn, look like natural-language text, and are not near
duplicates of one already kept; written to JSONL as they come, so a long run resumes where it
stopped; and a report of the set's diversity and of its overlap with a reference set (MT-bench,
which training data must not resemble).

    pyspec synth-prompts --n 100000 --out prompts.jsonl [--reference mt_bench_questions.jsonl]
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections import Counter
from typing import List, Optional, Sequence, Set

import numpy as np

__all__ = ["user_turn_prefix", "check_synthesis", "normalize", "shingles", "jaccard", "NearDuplicates", "latin_share",
           "synthesize_prompts", "diversity_report"]

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?", re.UNICODE)
_PRIME = (1 << 31) - 1  # a * x + b stays below 2^63 for a, b, x below it


def normalize(text: str) -> str:
    """Lower-case words separated by single spaces (the key of exact duplicates)."""
    return " ".join(_WORD.findall(text.lower()))


def _ngrams(text: str, n: int) -> List[str]:
    """The word ``n``-grams of ``text`` (normalized), in order."""
    w = normalize(text).split()
    return [" ".join(w[i:i + n]) for i in range(len(w) - n + 1)]


def shingles(text: str, n: int = 3) -> Set[str]:
    """The set of word ``n``-grams of ``text`` (its words when it has fewer than ``n``)."""
    grams = _ngrams(text, n)
    if grams:
        return set(grams)
    return {normalize(text)} if normalize(text) else set()


def jaccard(a: Set[str], b: Set[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def _h64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode("utf-8"), digest_size=8).digest(), "little")


class NearDuplicates:
    """Near-duplicate detection over word 3-gram sets: MinHash signatures (``num_perm`` hash
    functions) in ``bands`` locality-sensitive bands find candidates, and a candidate counts when
    its exact Jaccard similarity is at least ``threshold``. Deterministic (fixed hash seeds)."""

    def __init__(self, threshold: float = 0.7, num_perm: int = 64, bands: int = 16, seed: int = 1):
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1]; got {threshold!r}")
        if num_perm < 1 or bands < 1 or num_perm % bands:
            raise ValueError(f"num_perm must be a positive multiple of bands; got {num_perm}, "
                             f"{bands}")
        rng = np.random.default_rng(seed)
        self.threshold = float(threshold)
        self.bands, self.rows = bands, num_perm // bands
        self._a = rng.integers(1, _PRIME, size=num_perm, dtype=np.uint64)
        self._b = rng.integers(0, _PRIME, size=num_perm, dtype=np.uint64)
        self._buckets = [dict() for _ in range(bands)]
        self._sets: List[Set[str]] = []
        self._exact: Set[str] = set()  # whitespace- and case-normalized texts (words or not)

    def _signature(self, sh: Set[str]) -> np.ndarray:
        x = np.array([_h64(s) % _PRIME for s in sh], dtype=np.uint64)
        return ((np.outer(self._a, x) + self._b[:, None]) % _PRIME).min(axis=1)

    def _keys(self, sig: np.ndarray):
        for i in range(self.bands):
            yield i, sig[i * self.rows:(i + 1) * self.rows].tobytes()

    def _match(self, sh: Set[str], keys) -> Optional[int]:
        seen = set()
        for i, key in keys:
            for j in self._buckets[i].get(key, ()):
                if j not in seen:
                    seen.add(j)
                    if jaccard(sh, self._sets[j]) >= self.threshold:
                        return j
        return None

    def duplicate_of(self, text: str) -> Optional[int]:
        """The index of a kept text ``text`` nearly duplicates, else None."""
        sh = shingles(text)
        return self._match(sh, list(self._keys(self._signature(sh)))) if sh else None

    def add(self, text: str) -> bool:
        """Keep ``text`` unless it is a kept one (up to case and spacing) or nearly duplicates
        one; True when kept."""
        key = " ".join(text.lower().split())
        if key in self._exact:
            return False
        sh = shingles(text)
        keys = list(self._keys(self._signature(sh))) if sh else []
        if keys and self._match(sh, keys) is not None:
            return False
        self._exact.add(key)
        j = len(self._sets)
        self._sets.append(sh)
        for i, k in keys:
            self._buckets[i].setdefault(k, []).append(j)
        return True

    def __len__(self) -> int:
        return len(self._sets)


def latin_share(text: str) -> float:
    """The share of ``text``'s letters that are Latin-script (ASCII or Latin-1/Extended): a crude
    language filter for a target whose training text is mostly English."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 0.0
    return sum(c < "\u0250" for c in letters) / len(letters)


def _state_path(out: str) -> str:
    return out + ".state.json"


def _drop_partial_line(path: str) -> None:
    """Cut a JSONL file back to its last complete line (a process killed mid-write leaves the
    rest of a line)."""
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def user_turn_prefix(llm) -> List[int]:
    """The token ids of the target's chat template up to where a user's text starts (the system
    turn the template adds by default, then the user turn's header)."""
    mark = "\u2063pyspec-user-text\u2063"
    if not llm.tokenizer.chat_template:
        raise ValueError(f"the model at {llm.model_path} has no chat template: the 'self' prompt "
                         f"set needs one")
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": mark}],
                                             add_generation_prompt=False)
    if text.count(mark) != 1:
        raise ValueError("the target's chat template does not place a user's text verbatim; "
                         "the 'self' prompt set needs one that does")
    return llm.tokenizer.encode(text[:text.index(mark)], add_special_tokens=False)


def check_synthesis(n: int, *, batch: int, max_tokens: int, temperature: float, min_words: int,
                    max_words: int, min_latin: float, near_duplicate: float,
                    flags: bool = False) -> None:
    """:func:`synthesize_prompts`'s arguments checked (a ValueError naming the first bad one, as
    a command-line flag with ``flags``), before any model is loaded."""
    for name, v, ok, allowed in (
            ("n", n, n >= 1, ">= 1"), ("batch", batch, batch >= 1, ">= 1"),
            ("max_tokens", max_tokens, max_tokens >= 1, ">= 1"),
            ("temperature", temperature, 0.0 < temperature <= 2.0, "in (0, 2]"),
            ("min_words", min_words, min_words >= 1, ">= 1"),
            ("max_words", max_words, max_words >= min_words, ">= min_words"),
            ("min_latin", min_latin, 0.0 <= min_latin <= 1.0, "in [0, 1]"),
            ("near_duplicate", near_duplicate, 0.0 < near_duplicate <= 1.0, "in (0, 1]")):
        if not ok:
            what = "--" + name.replace("_", "-") if flags else name
            raise ValueError(f"{what} must be {allowed}; got {v}")


def synthesize_prompts(llm, n: int, *, out: Optional[str] = None, seed: int = 0, batch: int = 64,
                       max_tokens: int = 128, temperature: float = 1.0, top_p: float = 0.95,
                       min_words: int = 4, max_words: int = 200, min_latin: float = 0.9,
                       near_duplicate: float = 0.7, progress: bool = True) -> dict:
    """Up to ``n`` distinct requests written by the target (deterministic for a seed and batch):
    sampled after its chat template's user-turn header, kept when they end the turn within
    ``max_tokens`` tokens, have ``min_words`` to ``max_words`` words, at least ``min_latin`` of
    their letters Latin-script, and no kept request with word 3-gram Jaccard similarity of
    ``near_duplicate`` or more. With ``out`` (JSONL), each kept request is appended as it comes
    and a rerun resumes (what the file holds counts, and drawing goes on from where it stopped);
    at most ``10 * n`` draws in all. Returns the prompts and the run's counts and rates."""
    from tqdm import tqdm

    from pyspec.engine import Engine, SamplingParams
    from pyspec.runner import ModelRunner

    check_synthesis(n, batch=batch, max_tokens=max_tokens, temperature=temperature,
                    min_words=min_words, max_words=max_words, min_latin=min_latin,
                    near_duplicate=near_duplicate)
    prefix = user_turn_prefix(llm)
    eos = [int(e) for e in llm.tokenizer.eos_token_ids]
    kept: List[str] = []
    dedup = NearDuplicates(near_duplicate)
    tries = 0
    counts = Counter()
    if out is not None and os.path.exists(out):
        from pyspec.train.evaluate import read_prompts

        if not os.path.isfile(out) or (os.path.getsize(out) and
                                       not os.path.isfile(_state_path(out))):
            # Only a run of this command (its state file beside, or an empty file: a run
            # stopped in its first batch) is resumed: any other file is left as it is.
            raise ValueError(f"--out {out} exists and is not a synth-prompts run to resume (no "
                             f"{os.path.basename(_state_path(out))} beside it); choose another "
                             f"--out or delete it")
        _drop_partial_line(out)  # a run killed mid-write
        if os.path.getsize(out):  # a run that has kept none yet leaves it empty
            for _, text in read_prompts(out):
                if dedup.add(text):
                    kept.append(text)
        if os.path.isfile(_state_path(out)):
            with open(_state_path(out)) as f:
                state = json.load(f)
            if state.get("seed") != seed or state.get("batch") != batch:
                raise ValueError(f"{out} was written with seed {state.get('seed')} and batch "
                                 f"{state.get('batch')}; resume it with the same")
            tries = int(state["tries"])
            counts.update(state.get("dropped", {}))
    blocks = batch * ((len(prefix) + max_tokens + 32) // 16 + 2)
    runner = ModelRunner(llm.model, num_blocks=blocks, block_size=16)
    eng = Engine(runner, drafter=None, max_num_seqs=batch, max_num_batched_tokens=4096,
                 enable_prefix_cache=True, adaptive=False)
    sink = open(out, "a", encoding="utf-8") if out is not None else None
    bar = tqdm(total=n, initial=min(len(kept), n), desc="writing prompts", disable=not progress,
               unit="prompt")
    t0, tokens, new = time.perf_counter(), 0, 0
    try:
        while len(kept) < n and tries < 10 * n:
            k = min(batch, 10 * n - tries)
            params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                     seed=seed * 1_000_003 + 500_000_000 + tries + i,
                                     stop_token_ids=eos) for i in range(k)]
            tries += k
            rids = [eng.add_request(list(prefix), sp) for sp in params]
            while eng.has_unfinished():
                eng.step()
            for rid in rids:
                res = eng.result(rid, pop=True)
                tokens += len(res.token_ids)
                if len(kept) >= n:
                    continue
                why = None
                text = llm.tokenizer.decode([t for t in res.token_ids if t not in eos]).strip()
                words = len(text.split())
                if res.finish_reason != "stop":
                    why = "truncated"
                elif not min_words <= words <= max_words:
                    why = "length"
                elif latin_share(text) < min_latin:
                    why = "language"
                elif not dedup.add(text):
                    why = "near_duplicate"
                if why is not None:
                    counts[why] += 1
                    continue
                kept.append(text)
                new += 1
                bar.update(1)
                if sink is not None:
                    sink.write(json.dumps({"prompt": text}) + "\n")
            if sink is not None:
                sink.flush()
                tmp = _state_path(out) + ".tmp"
                with open(tmp, "w") as f:
                    json.dump({"seed": seed, "batch": batch, "tries": tries,
                               "dropped": dict(counts)}, f)
                os.replace(tmp, _state_path(out))  # never a half-written state
    finally:
        bar.close()
        if sink is not None:
            sink.close()
    secs = time.perf_counter() - t0
    return {"prompts": kept, "kept": len(kept), "new": new, "draws": tries,
            "dropped": dict(counts), "seconds": round(secs, 1),
            "generated_tokens": tokens,
            "prompts_per_hour": round(3600 * new / secs) if secs > 0 else None,
            "tokens_per_hour": round(3600 * tokens / secs) if secs > 0 else None}


def _quantiles(xs: Sequence[float], qs=(0.1, 0.5, 0.9)) -> List[float]:
    s = sorted(xs)
    return [s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] for q in qs] if s else []


def diversity_report(prompts: Sequence[str], reference: Sequence[str] = (),
                     near_duplicate: float = 0.5) -> dict:
    """How varied ``prompts`` are, and how much they resemble ``reference`` (e.g. MT-bench):

    * lengths in words (mean, 10th / 50th / 90th percentiles);
    * distinct-1 / distinct-2 (distinct words and word pairs over all of them) and the entropy
      of the first word (in bits; how many ways requests start) with the commonest openings;
    * topic spread: the commonest content words and the share of prompts holding the top 20;
    * against the reference: the share of the prompts' word 8-grams found in it, the largest
      word 3-gram Jaccard similarity of any prompt to any reference prompt, and how many prompts
      reach ``near_duplicate`` with one (all near zero for a set that does not copy it)."""
    if not prompts:
        raise ValueError("no prompts to report on")
    words = [normalize(p).split() for p in prompts]
    lens = [len(w) for w in words]
    uni = Counter(t for w in words for t in w)
    bi = Counter(" ".join(w[i:i + 2]) for w in words for i in range(len(w) - 1))
    first = Counter(w[0] for w in words if w)
    tot_first = sum(first.values())
    entropy = -sum(c / tot_first * math.log2(c / tot_first) for c in first.values())
    content = Counter(t for w in words for t in set(w) if t not in _STOPWORDS and len(t) > 2)
    top = [t for t, _ in content.most_common(20)]
    holding = sum(any(t in set(w) for t in top) for w in words) / len(words)
    rep = {"prompts": len(prompts),
           "words": {"mean": round(sum(lens) / len(lens), 1),
                     "p10_p50_p90": _quantiles(lens)},
           "distinct_1": round(len(uni) / max(1, sum(uni.values())), 4),
           "distinct_2": round(len(bi) / max(1, sum(bi.values())), 4),
           "first_word_entropy_bits": round(entropy, 2),
           "top_first_words": first.most_common(10),
           "top_content_words": content.most_common(20),
           "share_holding_top20_content_words": round(holding, 3)}
    if reference:
        ref8 = {g for r in reference for g in _ngrams(r, 8)}
        mine8 = [g for p in prompts for g in _ngrams(p, 8)]
        ref_sets = [shingles(r) for r in reference]
        best = []
        for p in prompts:
            sh = shingles(p)
            best.append(max((jaccard(sh, r) for r in ref_sets), default=0.0))
        rep["reference"] = {
            "prompts": len(reference),
            "share_of_8grams_in_reference": round(sum(g in ref8 for g in mine8)
                                                  / max(1, len(mine8)), 5),
            "max_jaccard_3gram": round(max(best), 4),
            "mean_max_jaccard_3gram": round(sum(best) / len(best), 4),
            f"prompts_at_or_above_{near_duplicate}": sum(b >= near_duplicate for b in best)}
    return rep


_STOPWORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being below
between both but by can could did do does doing down during each few for from further had has have
having he her here hers herself him himself his how i if in into is it its itself just let me more
most my myself no nor not now of off on once only or other our ours ourselves out over own please
same she should so some such than that the their theirs them themselves then there these they this
those through to too under until up very was we were what when where which while who whom why will
with would you your yours yourself yourselves can't don't i'm it's what's you're write give make
tell explain describe list use using one two like also get
""".split())
