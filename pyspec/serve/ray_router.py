"""The request router of ``pyspec serve --ray``'s engine replicas: Ray's prefix-cache affinity
router (its prefix tree, its request bookkeeping) with pyspec's choice of replica.

Two things differ from Ray's policy. Unmatched prompts are routed by load (see the class).
And replicas that are gone never get chosen: Ray's tree lives in a named actor that outlives a
deployment version, so after a redeploy (a new replica count, new flags) it still names replicas
that are gone, and choosing one raises a KeyError inside Ray's routing loop that leaves the
request waiting forever; here tree tenants that are not current replicas are dropped whenever the
replica set changes, and matches are taken among current replicas only. Importing this module
fails (ImportError) where the Ray installed has no such router.
"""

from __future__ import annotations

import importlib

import ray



def _base():
    for module in ("ray.serve.llm.request_router",
                   "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"):
        try:
            return getattr(importlib.import_module(module), "PrefixCacheAffinityRouter")
        except Exception:  # noqa: BLE001 - ray[llm]'s packages missing (pyarrow): the next one
            continue
    raise ImportError("this Ray has no PrefixCacheAffinityRouter")


class PrefixAffinityRouter(_base()):
    """Follows a prefix only where one matches (at least ``match_rate_threshold`` of the
    prompt, on a current replica) and that replica is at most ``imbalanced_threshold`` requests
    busier than the least busy candidate; otherwise it chooses nothing and the request is routed
    by load (power of two choices). Ray's own policy sends a prompt that matches nothing to the
    replica with the least text in the tree, which piles a burst of new prompts onto one replica
    (measured: 2 replicas at 1.07x one on distinct prompts, bench/bench_ray.py)."""

    def update_replicas(self, replicas):
        super().update_replicas(replicas)
        self._drop_stale_tenants()

    def _drop_stale_tenants(self) -> None:
        live = {rid.to_full_id_str() for rid in self._replica_id_set}
        try:
            tenants = ray.get(self._tree_actor.getattr.remote("tenant_to_char_count"))
        except Exception:  # noqa: BLE001 - a tree without that attribute: matches are filtered
            return
        stale = [t for t in tenants if t not in live]
        if stale:
            ray.get(self._tree_actor.remove_tenants.remote(stale))

    def on_request_routed(self, pending_request, replica_id, result):
        # Requests without a prompt (other endpoints) leave the tree alone.
        if pending_request is not None and pending_request.args and \
                self._extract_text_from_request(pending_request):
            super().on_request_routed(pending_request, replica_id, result)

    async def _prefix_match_best_replicas(self, pending_request, candidate_replicas):
        if pending_request is None or not pending_request.args or not candidate_replicas:
            return [[]]
        text = self._extract_text_from_request(pending_request)
        if not text:
            return [[]]
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        matched, tenants = ray.get(self._tree_actor.prefix_match.remote(text, list(by_id)))
        chosen = [by_id[t] for t in tenants or [] if t in by_id]  # (gone replicas left out)
        if not chosen or len(matched) < self._match_rate_threshold * len(text):
            return [[]]
        lens = {r.replica_id: q for r, q in await self._probe_queue_lens(candidate_replicas, 0)
                if q is not None}
        if lens:
            least = min(lens.values())
            chosen = [r for r in chosen
                      if lens.get(r.replica_id, least) - least <= self._imbalanced_threshold]
        return [chosen]
