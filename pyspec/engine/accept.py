"""The ACCEPT stage of an engine step: one batched acceptance over every decoding request.

All-greedy batches on the CPU take the core's greedy walk straight from the logits
(:func:`pyspec.sampling.accept_greedy`); otherwise the logits go through the sampling filters
(per request temperature / top-k / top-p / min-p; temperature 0 is a one-hot row) and
:func:`pyspec.sampling.accept` walks the trees: rejection sampling for sampled draft children,
the target-only walk for deterministic ones. Draws are keyed by the request's seed and the
sequence position, so a request's output never depends on the rest of the batch.

Logits on a GPU stay there: the filters and the walk run on the device (the same algorithm and
draws as on the CPU), and only the decisions come back to the host.
"""

from __future__ import annotations

from typing import List

import torch

from pyspec.drafters.base import Draft
from pyspec.sampling import accept, accept_greedy, apply_sampling_filters

__all__ = ["accept_step"]


def _decisions(res):
    """(emitted tokens, accepted paths, accepted counts) as lists, in one copy from a device."""
    if res.num_accepted.device.type == "cpu":
        return (res.emitted_tokens.tolist(), res.accepted_nodes.tolist(),
                res.num_accepted.tolist())
    b, w = res.emitted_tokens.shape
    flat = torch.cat([res.emitted_tokens.reshape(-1), res.accepted_nodes.reshape(-1),
                      res.num_accepted]).cpu()
    return (flat[:b * w].view(b, w).tolist(), flat[b * w:2 * b * w].view(b, w).tolist(),
            flat[2 * b * w:].tolist())


def accept_step(reqs, drafts: List[Draft], logits: torch.Tensor, vocab_size: int, *,
                greedy_from_logits: bool = True, debug_skip_residual: bool = False,
                kernels=None):
    """``(emitted tokens, accepted paths, accepted counts)``, one entry per request.

    Args:
        reqs: the engine's requests, in the order of ``drafts`` (their params, seeds, contexts).
        drafts: each request's draft tree (its root alone where nothing was drafted).
        logits: float32 ``[sum of tree sizes, vocab]``, the trees' rows in order (cpu, or the
            model's GPU).
        greedy_from_logits: all-greedy batches walk the logits directly (False: through the
            temperature-0 rows, the same result; for measurements).
        debug_skip_residual: the deliberately broken rule (tests only).
        kernels: the target model's CPU kernels (their build runs the sampling filters).
    """
    indptr = [0]
    parents: List[int] = []
    flat: List[int] = []
    for d in drafts:
        indptr.append(indptr[-1] + len(d.tokens))
        parents.extend(d.parents)
        flat.extend(d.tokens)
    trees = (torch.tensor(flat, dtype=torch.int32), torch.tensor(parents, dtype=torch.int32),
             torch.tensor(indptr, dtype=torch.int64))
    greedy = [r.params.temperature == 0.0 for r in reqs]
    on_host = logits.device.type == "cpu"
    if all(greedy) and greedy_from_logits and on_host and not debug_skip_residual:
        res = accept_greedy(logits, *trees)
        return _decisions(res)
    if all(greedy):
        probs = apply_sampling_filters(logits, 0.0, kernels=kernels)
    else:
        sz = trees[2].diff()  # each tree's rows

        def rows(vals, dtype):
            return torch.repeat_interleave(torch.tensor(vals, dtype=dtype), sz)

        # Greedy rows use temperature 0 (a one-hot at the argmax, lowest id on ties).
        probs = apply_sampling_filters(
            logits,
            rows([float(r.params.temperature) for r in reqs], torch.float32),
            rows([int(r.params.top_k) for r in reqs], torch.int32),
            rows([float(r.params.top_p) for r in reqs], torch.float32),
            rows([float(r.params.min_p) for r in reqs], torch.float32), kernels=kernels)
    sampled = [d.draft_probs is not None and not g for d, g in zip(drafts, greedy)]
    draft_probs = None
    if any(sampled):
        draft_probs = torch.zeros((indptr[-1], vocab_size), dtype=torch.float32,
                                  device=logits.device)
        for k, d in enumerate(drafts):
            if sampled[k]:
                draft_probs[indptr[k]:indptr[k + 1]] = d.draft_probs
    # Draws are keyed by sequence position: the root decides the token after the context.
    res = accept(probs, *trees, draft_probs=draft_probs,
                 greedy=torch.tensor(greedy, dtype=torch.bool),
                 seeds=torch.tensor([r.seed for r in reqs], dtype=torch.int64),
                 offsets=torch.tensor([len(r.context) for r in reqs], dtype=torch.int64),
                 sampled_children=torch.tensor(sampled, dtype=torch.bool),
                 debug_skip_residual=debug_skip_residual)
    return _decisions(res)
