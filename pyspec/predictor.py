"""A prompt-feature acceptance predictor: how many tokens per speculative step a request's
drafter will give, estimated from its prompt before it is scheduled.

Features (:func:`prompt_features`), each cheap to compute from the prompt's token ids:

* ``log2_len``: log2 of the prompt length;
* ``repeat2``, ``repeat3``: the share of prompt positions whose 2-gram / 3-gram occurred earlier
  in the prompt (what prompt lookup can copy);
* ``distinct``: distinct tokens / length;
* ``corpus_mean``, ``corpus_tail``: with a corpus index (:class:`pyspec._C.SuffixIndex`, the
  shipped corpus drafter's), the mean longest match (up to 8 tokens, over up to 32 evenly spaced
  prompt positions) and the match of the prompt's end, divided by 8 (what a corpus drafter
  retrieves).

The model (:class:`AcceptancePredictor`) is ridge regression over standardized features, kept as
its sufficient statistics so finished requests update it online in fixed memory; saved as JSON
with a manifest (what it was trained on, its held-out Spearman correlation).
``bench/train_predictor.py`` records per-request acceptance and fits it.
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional, Sequence

import numpy as np

__all__ = ["FEATURES", "prompt_features", "AcceptancePredictor", "corpus_of", "spearman",
           "load_predictor"]

FEATURES = ("log2_len", "repeat2", "repeat3", "distinct", "corpus_mean", "corpus_tail")
FORMAT = "pyspec-predictor"
_MATCH = 8  # longest corpus match looked for, in tokens
_PROBES = 32  # prompt positions probed against the corpus


def _repeat_share(ids: Sequence[int], n: int) -> float:
    seen, hits = set(), 0
    for i in range(n - 1, len(ids)):
        g = tuple(ids[i - n + 1:i + 1])
        hits += g in seen
        seen.add(g)
    return hits / max(1, len(ids) - n + 1)


def prompt_features(ids: Sequence[int], corpus=None) -> List[float]:
    """The :data:`FEATURES` of a prompt (its token ids, chat template included); the corpus
    features are 0 without ``corpus``."""
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("a prompt needs at least one token")
    n = len(ids)
    feats = [math.log2(n), _repeat_share(ids, 2), _repeat_share(ids, 3), len(set(ids)) / n]
    if corpus is None:
        return feats + [0.0, 0.0]
    m = min(_PROBES, n)
    ends = sorted({max(1, round(n * (k + 1) / m)) for k in range(m)})
    lens = [corpus.longest_match(ids[max(0, e - _MATCH):e], _MATCH, 1)[0] for e in ends]
    tail = corpus.longest_match(ids[-_MATCH:], _MATCH, 1)[0]
    return feats + [sum(lens) / len(lens) / _MATCH, tail / _MATCH]


def corpus_of(drafter) -> Optional[object]:
    """The corpus index a drafter retrieves from (a corpus drafter, or the first corpus part of
    a combined one), for the corpus features; None when it has none."""
    if drafter is None:
        return None
    index = getattr(drafter, "index", None)
    if index is not None and hasattr(index, "longest_match"):
        return index
    for part in getattr(drafter, "parts", ()):
        index = corpus_of(part)
        if index is not None:
            return index
    return None


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); nan when either side is constant."""
    def ranks(x):
        x = np.asarray(x, dtype=np.float64)
        order = np.argsort(x, kind="mergesort")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=np.float64)
        for v in np.unique(x):  # ties: their mean rank
            m = x == v
            r[m] = r[m].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


class AcceptancePredictor:
    """Ridge regression from :data:`FEATURES` (standardized) to a request's acceptance length,
    kept as its sufficient statistics ``a`` = sum of z1 z1^T and ``b`` = sum of z1 y (z1: the
    standardized features and a constant 1; the constant is not penalized), so finished
    requests update it online in fixed memory (:meth:`update`)."""

    def __init__(self, mean, std, a, b, ridge: float = 1.0, manifest: Optional[dict] = None):
        k = len(FEATURES)
        self.mean = np.asarray(mean, dtype=np.float64)
        self.std = np.asarray(std, dtype=np.float64)
        self.a = np.array(a, dtype=np.float64)
        self.b = np.array(b, dtype=np.float64)
        if not (self.mean.shape == self.std.shape == (k,) and self.a.shape == (k + 1, k + 1)
                and self.b.shape == (k + 1,)):
            raise ValueError(f"a predictor needs {k} means and stds, a {k + 1}x{k + 1} matrix "
                             f"and {k + 1} sums ({', '.join(FEATURES)}, constant)")
        if not (np.isfinite(self.a).all() and np.isfinite(self.b).all()
                and (self.std > 0).all()) or not ridge >= 0:
            raise ValueError("a predictor needs finite sums, positive stds and ridge >= 0")
        self.ridge = float(ridge)
        self.manifest = dict(manifest or {})
        self._solve()

    def _solve(self) -> None:
        k = len(FEATURES)
        pen = np.diag([self.ridge] * k + [0.0])
        theta = np.linalg.lstsq(self.a + pen, self.b, rcond=None)[0]
        self.coef, self.intercept = theta[:k], float(theta[k])

    def _z1(self, feats) -> np.ndarray:
        z = (np.asarray(feats, dtype=np.float64) - self.mean) / self.std
        return np.append(z, 1.0)

    @classmethod
    def fit(cls, x: Sequence[Sequence[float]], y: Sequence[float], ridge: float = 1.0,
            manifest: Optional[dict] = None) -> "AcceptancePredictor":
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != len(FEATURES) or len(y) != len(x) or len(y) < 2:
            raise ValueError(f"fit needs rows of {len(FEATURES)} features and one target per row "
                             f"(at least 2); got x {x.shape}, y {y.shape}")
        if not (np.isfinite(x).all() and np.isfinite(y).all()) or not ridge >= 0:
            raise ValueError("fit needs finite features and targets and ridge >= 0")
        mean, std = x.mean(0), x.std(0)
        std[std == 0] = 1.0
        z1 = np.hstack([(x - mean) / std, np.ones((len(x), 1))])
        return cls(mean, std, z1.T @ z1, z1.T @ y, ridge, manifest)

    def update(self, feats: Sequence[float], y: float, weight: float = 1.0) -> None:
        """Learn from a finished request: its features and realized acceptance length."""
        z1 = self._z1(feats)
        if not (np.isfinite(z1).all() and math.isfinite(y)) or not weight > 0:
            return
        self.a += weight * np.outer(z1, z1)
        self.b += weight * z1 * y
        self._solve()

    def predict_features(self, feats: Sequence[float]) -> float:
        return float(self._z1(feats)[:-1] @ self.coef + self.intercept)

    def predict(self, ids: Sequence[int], corpus=None) -> float:
        """The expected acceptance length of a request with prompt ``ids``."""
        return self.predict_features(prompt_features(ids, corpus))

    def to_dict(self) -> dict:
        return {"format": FORMAT, "format_version": 1, "features": list(FEATURES),
                "mean": self.mean.tolist(), "std": self.std.tolist(), "a": self.a.tolist(),
                "b": self.b.tolist(), "ridge": self.ridge, "manifest": self.manifest}

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "AcceptancePredictor":
        try:
            with open(path, encoding="utf-8") as f:
                d: Dict = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a readable predictor file ({type(e).__name__}: {e})"
                             ) from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"{path}: not a pyspec predictor (format {FORMAT!r})")
        if d.get("features") != list(FEATURES):
            raise ValueError(f"{path}: its features {d.get('features')} are not this pyspec's "
                             f"{list(FEATURES)}")
        try:
            return cls(d["mean"], d["std"], d["a"], d["b"], d["ridge"], d.get("manifest"))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}: a predictor file without {e}") from None


def load_predictor(spec) -> Optional[AcceptancePredictor]:
    """``SpecConfig.predictor`` as a predictor: None, an AcceptancePredictor, or a predictor
    file's path."""
    if spec is None or isinstance(spec, AcceptancePredictor):
        return spec
    return AcceptancePredictor.load(os.path.expanduser(spec))
