"""Corpus drafting: continuations retrieved from text the target wrote before (in the manner of
REST and SuffixDecoding), with no model run at draft time.

A corpus of the target's own answers (``pyspec train-draft --method suffix`` generates one from
seed prompts) is indexed by a suffix array in the C++ core (:class:`pyspec._C.SuffixIndex`). Per
step, the longest suffix of the context (``max_match`` tokens at most) that the corpus continues
selects the corpus positions that followed the same words; the draft is a tree grown best first
over those continuations, a node scored by the empirical probability of its path. A small model
repeats its own phrasing across prompts ("Here are some ...", list layouts, closing sentences), so
its past answers predict its next tokens as often as a trained head on new text, for the cost of
a few binary searches.

With ``learn=T`` the drafter also learns from what it serves: every finished request's text
enters a second index (the newest ``T`` tokens; rebuilt in a background thread every
``rebuild_tokens`` new tokens), so repeated and templated traffic (agent loops, the same system
prompt and answer shapes) drafts from its own history. Learned text is kept per partition (a
request's ``SamplingParams.learn_partition``; the server uses the tenant): a request drafts from
its own partition's history only, so how well one tenant's text is drafted says nothing about
what another tenant sent. At most ``MAX_PARTITIONS`` partitions are kept, the least recently
used dropped first.

Drafts are deterministic (no draft distribution), so sampled requests are verified with the
target-only walk and stay lossless. Match lengths are separate draft sources: a continuation after
a 6-token match is right far more often than one after a single common token, and the scheduler
keeps an acceptance estimate and a draft length per source.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import List, Optional, Sequence

import numpy as np

from pyspec.drafters.base import Draft, Drafter, DraftRequest
from pyspec.drafters.folder import read_config, warn_target_hash, write_config

CORPUS_NAME = "corpus.npz"
MAX_PARTITIONS = 64
# Match-length buckets, one draft source each: >= 6 tokens, 3-5, 2, 1.
_BUCKETS = (6, 3, 2, 1)


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(self, index, *, max_nodes: int = 8, max_depth: int = 8, max_match: int = 8,
                 min_match: int = 1, min_prob: float = 0.0, max_children: int = 4,
                 learn: int = 0, rebuild_tokens: int = 4096, background: bool = True):
        for key, val, lo, hi in (("max_nodes", max_nodes, 1, 255),
                                 ("max_depth", max_depth, 1, 16), ("max_match", max_match, 1, 16),
                                 ("min_match", min_match, 1, 16),
                                 ("max_children", max_children, 1, 64)):
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or \
                    not lo <= val <= hi:
                raise ValueError(f"suffix drafter: {key} must be an int in [{lo}, {hi}]; "
                                 f"got {val!r}")
        if min_match > max_match:
            raise ValueError(f"suffix drafter: min_match ({min_match}) must be <= max_match "
                             f"({max_match})")
        if not isinstance(min_prob, (int, float)) or not 0.0 <= float(min_prob) < 1.0:
            raise ValueError(f"suffix drafter: min_prob must be in [0, 1); got {min_prob!r}")
        for key, val in (("learn", learn), ("rebuild_tokens", rebuild_tokens)):
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or \
                    not 0 <= val <= 1 << 30:  # an index holds < 2^31 tokens
                raise ValueError(f"suffix drafter: {key} must be an int in [0, 2^30]; "
                                 f"got {val!r}")
        # Learning from served text: finished requests' tokens (the newest ``learn`` tokens at
        # most) form a second index, rebuilt every ``rebuild_tokens`` new tokens off the serving
        # thread (the C++ build releases the GIL); drafts come from whichever index matches the
        # longer suffix.
        self.learn_tokens, self.rebuild_tokens = int(learn), max(1, int(rebuild_tokens))
        self._background = bool(background)
        self._parts: "collections.OrderedDict[Optional[str], _Learned]" = \
            collections.OrderedDict()
        self.index = index
        self.max_nodes, self.max_depth = int(max_nodes), int(max_depth)
        self.max_match, self.min_match = int(max_match), int(min_match)
        self.min_prob, self.max_children = float(min_prob), int(max_children)
        self.num_draft_sources = len(_BUCKETS)

    @property
    def max_draft_depth(self) -> int:
        return self.max_depth

    def node_budget(self, depth: int) -> int:
        return min(self.max_nodes, max(depth, round(self.max_nodes * depth / self.max_depth)))

    def _tail(self, context: Sequence[int]) -> List[int]:
        return [int(t) for t in context[-self.max_match:]]

    def _indexes(self, partition: Optional[str] = None):
        part = self._parts.get(partition)
        learned = part.index if part is not None else None
        return (self.index,) if learned is None else (self.index, learned)

    def draft_source(self, context: Sequence[int], partition: Optional[str] = None
                     ) -> Optional[int]:
        tail = self._tail(context)
        m = max(ix.longest_match(tail, self.max_match, self.min_match)[0]
                for ix in self._indexes(partition))
        if not m:
            return None
        return next(k for k, b in enumerate(_BUCKETS) if m >= b)

    def propose(self, reqs: List[DraftRequest]) -> List[Draft]:
        out = []
        for r in reqs:
            indexes = self._indexes(r.partition)
            root = int(r.context[-1])
            tail = self._tail(r.context)
            best = None
            for ix in indexes:  # the corpus first: a learned draft must match a longer suffix
                d = ix.propose(tail, min(int(r.budget), self.max_nodes),
                               min(int(r.depth_limit), self.max_depth), self.max_match,
                               self.min_match, self.min_prob, self.max_children)
                if d[0] and (best is None or d[3] > best[3]):
                    best = d
            toks, parents = (best[0], best[1]) if best else ([], [])
            out.append(Draft([root] + list(toks), [-1] + [p + 1 for p in parents]))
        return out

    def learn(self, request_id: int, tokens: Sequence[int],
              partition: Optional[str] = None) -> None:
        if not self.learn_tokens or len(tokens) < 2:
            return
        part = self._parts.get(partition)
        if part is None:
            part = self._parts[partition] = _Learned()
            while len(self._parts) > MAX_PARTITIONS:
                self._parts.popitem(last=False)
        self._parts.move_to_end(partition)
        doc = [int(t) for t in tokens[-self.learn_tokens:]]
        part.docs.append(doc)
        part.doc_tokens += len(doc)
        part.pending += len(doc)
        while part.doc_tokens > self.learn_tokens:
            part.doc_tokens -= len(part.docs.popleft())
        if part.pending < self.rebuild_tokens:
            return
        if part.builder is not None and part.builder.is_alive():
            return  # the next finished request starts the next build
        part.pending = 0
        docs = list(part.docs)
        if self._background:
            # Not a daemon: a daemon thread that leaves the C++ build while the interpreter
            # shuts down aborts the process; exit waits for the build (a fraction of a second).
            part.builder = threading.Thread(target=part.build, args=(docs,), daemon=False,
                                            name="pyspec-suffix-learn")
            part.builder.start()
        else:
            part.build(docs)

    @property
    def _builder(self) -> Optional[threading.Thread]:
        """The shared partition's index build in flight (or last run), if any."""
        part = self._parts.get(None)
        return part.builder if part is not None else None

    def learned_tokens_of(self, partition: Optional[str] = None) -> int:
        """Tokens in ``partition``'s learned index (what its drafting uses now)."""
        part = self._parts.get(partition)
        return 0 if part is None or part.index is None else int(part.index.num_tokens)

    @property
    def learned_tokens(self) -> int:
        """Tokens in the shared partition's learned index."""
        return self.learned_tokens_of(None)

    def describe(self) -> str:
        return (f"suffix (corpus of {self.index.num_tokens} tokens, match <= {self.max_match}, "
                f"<= {self.max_nodes} nodes" + (f", learning up to {self.learn_tokens} tokens"
                                                 if self.learn_tokens else "") + ")")


class _Learned:
    """One partition's learned text: its documents (newest last) and their index."""

    def __init__(self):
        self.docs: collections.deque = collections.deque()
        self.doc_tokens = self.pending = 0
        self.index = None
        self.builder: Optional[threading.Thread] = None

    def build(self, docs) -> None:
        self.index = index_of(docs)  # one reference swap: readers see old or new


def index_of(docs: Sequence[Sequence[int]]):
    """A :class:`pyspec._C.SuffixIndex` over token documents."""
    from pyspec import _C

    flat = np.fromiter((t for d in docs for t in d), dtype=np.int32,
                       count=sum(len(d) for d in docs))
    return _C.SuffixIndex(flat, np.cumsum([0] + [len(d) for d in docs], dtype=np.int64))


# ---------------------------------------------------------------------------------------------
# Files: drafter.json (method "suffix") + corpus.npz (tokens, offsets)

OPTIONS = {"nodes": "max_nodes", "depth": "max_depth", "match": "max_match",
           "min-match": "min_match", "prob": "min_prob", "children": "max_children",
           "learn": "learn"}


def save_corpus(path: str, docs: Sequence[Sequence[int]], vocab_size: int, *,
                manifest: Optional[dict] = None, defaults: Optional[dict] = None) -> str:
    """Write a corpus drafter folder from token documents (e.g. the target's answers)."""
    lens = [len(d) for d in docs]
    tokens = np.fromiter((int(t) for d in docs for t in d), dtype=np.int64, count=sum(lens))
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"corpus tokens must be in [0, {vocab_size})")
    offsets = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64)
    os.makedirs(path, exist_ok=True)
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    np.savez_compressed(os.path.join(path, CORPUS_NAME), tokens=tokens.astype(dtype),
                        offsets=offsets)
    write_config(path, "suffix", {"vocab_size": int(vocab_size),
                                  "corpus": {"tokens": int(tokens.size), "documents": len(lens)},
                                  "defaults": dict(defaults or {}),
                                  "manifest": dict(manifest or {})})
    return path


def read_corpus(path: str, vocab_size: int, cfg: Optional[dict] = None):
    """A corpus drafter folder's (``drafter.json`` of method "suffix" + ``corpus.npz``) token
    documents as flat int32 tokens and int64 offsets, checked against the target's vocabulary
    (``cfg``: its ``drafter.json`` when the caller has read it already)."""
    if cfg is None:
        cfg = read_config(path)
    if cfg.get("method") != "suffix":
        raise ValueError(f"{path!r}: drafter method {cfg.get('method')!r} is not a corpus "
                         "(\"suffix\")")
    if cfg.get("vocab_size") != vocab_size:
        raise ValueError(f"corpus drafter {path}: vocab_size {cfg.get('vocab_size')} does not "
                         f"match the target's {vocab_size}")
    f = os.path.join(path, CORPUS_NAME)
    if not os.path.isfile(f):
        raise ValueError(f"{path!r}: {CORPUS_NAME} is missing")
    try:
        with np.load(f) as z:
            if "tokens" not in z or "offsets" not in z:
                raise ValueError(f"{f}: needs arrays 'tokens' and 'offsets'")
            tokens, offsets = z["tokens"], z["offsets"]
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith(f) else f"{f}: {e}") from None
    except Exception as e:  # noqa: BLE001 - zipfile / numpy errors of a damaged file
        raise ValueError(f"{f}: not a readable .npz file ({type(e).__name__}: {e})") from None
    if tokens.dtype.kind not in "iu" or offsets.dtype.kind not in "iu":
        raise ValueError(f"{f}: 'tokens' and 'offsets' must be integer arrays; got "
                         f"{tokens.dtype} and {offsets.dtype}")
    if tokens.ndim != 1:
        raise ValueError(f"{f}: 'tokens' must be one-dimensional; got shape {list(tokens.shape)}")
    if tokens.size and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
        raise ValueError(f"{f}: tokens must lie in [0, {vocab_size}) (the target's vocabulary); "
                         f"got {int(tokens.min())}..{int(tokens.max())}")
    tokens, offsets = tokens.astype(np.int32), offsets.astype(np.int64)
    if (offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0
            or offsets[-1] != tokens.size or bool((np.diff(offsets) < 0).any())):
        raise ValueError(f"{f}: offsets must rise from 0 to the token count ({tokens.size})")
    return tokens, offsets


def load_corpus(path: str, cfg: dict, vocab_size: int):
    """The folder's corpus as a :class:`pyspec._C.SuffixIndex` (vocabulary checked)."""
    from pyspec import _C

    return _C.SuffixIndex(*read_corpus(path, vocab_size, cfg))


def load_suffix(path: str, cfg: dict, target_runner, **overrides) -> SuffixDrafter:
    index = load_corpus(path, cfg, target_runner.model.cfg.vocab_size)
    opts = dict(cfg.get("defaults") or {})
    opts.update({k: v for k, v in overrides.items() if v is not None})
    unknown = set(opts) - set(OPTIONS.values())
    if unknown:
        raise ValueError(f"unknown corpus drafter options {sorted(unknown)}; allowed: "
                         + ", ".join(f"{k}=" for k in OPTIONS))
    d = SuffixDrafter(index, **opts)
    d.manifest = cfg.get("manifest") or {}
    d.path = path
    warn_target_hash(d, path, target_runner)
    return d
