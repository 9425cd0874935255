"""Quality gate: a sampled share of speculative requests is also scored by the target alone.

For such a request the engine keeps the target logits each served token was drawn from (the rows
of the speculative verification forward: tree attention over paged KV, batched with other
requests). When it finishes, the target re-scores the whole sequence in one plain causal forward,
and the gate computes the mean per-token KL divergence KL(served || plain) of the two
distributions at the request's temperature (the unfiltered softmax, so top-k/top-p thresholds that
fall differently at a near-tie do not make it infinite). For a correct engine this is rounding
noise (the tests require < 1e-4 in float32); a wrong tree mask, stale KV or a bad materialization
shows up as a large divergence. Above ``kl_threshold`` with ``rollback_on_violation``, speculation
is switched off for new requests until the config is reloaded (the ``speculation`` rollback of
:mod:`pyspec.serve.rollback`), and the event is logged and counted.
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import List, Optional

import torch

from pyspec.runner import SeqStep

log = logging.getLogger("pyspec.serve")


def sampled(request_id: str, ratio: float) -> bool:
    if ratio >= 1.0:
        return True
    if ratio <= 0.0:
        return False
    h = int.from_bytes(hashlib.sha256(b"qg" + request_id.encode()).digest()[:8], "big")
    return h / float(1 << 64) < ratio


def served_vs_plain_kl(runner, prompt: List[int], generated: List[int], served: torch.Tensor,
                       temperature: float) -> Optional[float]:
    """Mean KL(served || plain) over the generated tokens (None when there is nothing to score)."""
    n = min(len(generated), served.shape[0])
    if n == 0:
        return None
    seq = list(prompt) + list(generated[:n - 1])
    bs = runner.block_size
    table = [0] * (-(-len(seq) // bs))  # never read or written: prefix 0, nothing committed
    # Only the rows that predicted the generated tokens (the last n): a whole [len(seq), vocab]
    # float32 array would be ~0.8 GB at 4k tokens of a 49k vocabulary.
    out = runner.step([SeqStep(seq, 0, table, None, n)])
    plain = out.logits
    t = temperature if temperature > 0 else 1.0
    lq = torch.log_softmax(served[:n].float() / t, dim=-1)
    lp = torch.log_softmax(plain.float() / t, dim=-1)
    kl = (lq.exp() * (lq - lp)).sum(-1)
    return float(kl.clamp_min(0).mean())


class QualityGate:
    def __init__(self, metrics, state: dict):
        from prometheus_client import Counter, Gauge, Histogram

        r = metrics.registry
        self.state = state
        self.kl = Gauge("pyspec_quality_gate_kl", "Mean per-token KL(served || target alone) of "
                        "the last scored request", registry=r)
        self.kl_hist = Histogram("pyspec_quality_gate_kl_divergence", "Per-request mean KL",
                                 buckets=(1e-9, 1e-7, 1e-5, 1e-3, 1e-2, 0.05, 0.1, 0.5, 1.0, 5.0),
                                 registry=r)
        self.checks = Counter("pyspec_quality_gate_checks", "Requests scored by the target alone",
                              registry=r)
        self.violations = Counter("pyspec_quality_gate_violations",
                                  "Scored requests above kl_threshold", registry=r)
        self.rollbacks = Counter("pyspec_quality_gate_rollbacks",
                                 "Times speculation was switched off by the gate", registry=r)
        # Switches speculation off (pyspec.serve.rollback.Rollbacks.speculation); True if it did.
        self.roll_back = None

    def wants(self, request_id: str, speculative: bool) -> bool:
        g = self.state["config"].speculative.quality_gate
        return speculative and sampled(request_id, g.sample_ratio)

    def score(self, runner, prompt, generated, served, temperature) -> Optional[float]:
        try:
            kl = served_vs_plain_kl(runner, prompt, generated, served, temperature)
        except Exception:  # noqa: BLE001 - scoring must never fail serving
            log.exception("quality gate scoring failed")
            return None
        if kl is None or math.isnan(kl):
            return None
        self.checks.inc()
        self.kl.set(kl)
        self.kl_hist.observe(kl)
        cfg = self.state["config"]
        g = cfg.speculative.quality_gate
        if kl > g.kl_threshold:
            self.violations.inc()
            log.warning("quality gate: KL %.3g above threshold %.3g", kl, g.kl_threshold)
            if g.rollback_on_violation and self.roll_back is not None and \
                    self.roll_back("quality_gate"):
                self.rollbacks.inc()
                log.error("quality gate: speculation switched off for new requests (rollback)")
        return kl
