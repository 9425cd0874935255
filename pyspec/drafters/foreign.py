"""Speculative settings spelled the way vLLM and SGLang spell them, mapped onto pyspec's draft
spec (:mod:`pyspec.drafters.spec`) and :class:`~pyspec.SpecConfig` fields.

* vLLM: ``--speculative-config '{"method": "eagle3", "model": DIR, "num_speculative_tokens": 5}'``
  (:func:`from_vllm`);
* SGLang: ``--speculative-algorithm EAGLE --speculative-draft-model-path DIR
  --speculative-num-steps 5 --speculative-eagle-topk 4 --speculative-num-draft-tokens 16``
  (:func:`from_sglang`).

Every option either maps onto something pyspec does, or is refused with what it would have
meant and why pyspec has no equivalent: nothing is silently ignored. docs/coming-from.md has the
tables.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

__all__ = ["SpecSettings", "from_vllm", "from_sglang", "add_flags", "settings_from_args",
           "VLLM_METHODS", "SGLANG_ALGORITHMS"]

VLLM_METHODS = ("ngram", "eagle", "eagle3", "medusa", "draft_model", "pyspec")
SGLANG_ALGORITHMS = ("EAGLE", "EAGLE3", "STANDALONE", "NGRAM")

# vLLM SpeculativeConfig fields pyspec has no equivalent for, and why (refused when set to
# anything but their neutral value).
_VLLM_NO_EQUIVALENT = {
    "quantization": "a drafter is loaded in the target's dtype and kernels",
    "max_model_len": "a drafter drafts for every context the target serves",
    "revision": "pyspec reads local folders only, never a hub",
    "code_revision": "pyspec reads local folders only, never a hub",
    "speculative_token_tree": "EAGLE trees are EAGLE-2 dynamic trees: size them with "
                              "DIR@width=W,depth=D,nodes=N (method \"pyspec\")",
    "posterior_threshold": "typical acceptance is lossy; pyspec verifies losslessly only",
    "posterior_alpha": "typical acceptance is lossy; pyspec verifies losslessly only",
    "disable_mqa_scorer": "pyspec verifies every draft with its tree attention",
    "disable_padded_drafter_batch": "pyspec's drafters take ragged batches",
    "draft_model_config": "give the draft model's folder as \"model\"",
    "draft_parallel_config": "drafters run in the target's process",
    "target_model_config": "the target is the served model",
    "target_parallel_config": "the target is the served model",
    "num_speculative_tokens_per_batch_size": "pyspec sizes drafts per step from the batch "
                                             "(SpecConfig.spec_token_budget)",
    "suffix_decoding_max_tree_depth": "use method \"pyspec\" with draft \"suffix@...\" "
                                      "(pyspec's corpus drafter)",
    "suffix_decoding_max_cached_requests": "use method \"pyspec\" with draft \"suffix@...\"",
    "suffix_decoding_max_spec_factor": "use method \"pyspec\" with draft \"suffix@...\"",
    "suffix_decoding_min_token_prob": "use method \"pyspec\" with draft \"suffix@...\"",
}
# Fields accepted when they hold vLLM's neutral value (what pyspec does anyway).
_VLLM_NEUTRAL = {
    "draft_tensor_parallel_size": (None, 1),
    "acceptance_method": (None, "rejection_sampler"),
    "disable_logprobs": (None, True, False),
    "enforce_eager": (None, True, False),
}
_VLLM_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max",
              "prompt_lookup_min", "disable_by_batch_size", "draft")


@dataclass(frozen=True)
class SpecSettings:
    """What a foreign speculative configuration means in pyspec: the draft spec (as
    ``LLM(draft=...)`` / ``--draft`` take it) and :class:`~pyspec.SpecConfig` fields (None: the
    engine's default)."""

    draft: str
    num_speculative_tokens: Optional[int] = None
    spec_disable_batch_size: Optional[int] = None

    def spec_config_fields(self) -> Dict[str, int]:
        out = {}
        if self.num_speculative_tokens is not None:
            out["num_speculative_tokens"] = self.num_speculative_tokens
        if self.spec_disable_batch_size is not None:
            out["spec_disable_batch_size"] = self.spec_disable_batch_size
        return out


def _int(v: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{what} must be an int in [{lo}, {hi}]; got {v!r}")
    return v


def _folder(path: Any, what: str) -> str:
    if not isinstance(path, str) or not path:
        raise ValueError(f"{what} must be a local folder path; got {path!r}")
    if "@" in path or "|" in path or "+" in path:
        raise ValueError(f"{what} {path!r}: a folder path without pyspec's '@', '|' or '+' "
                         "(use method \"pyspec\" with \"draft\" for pyspec's own spec strings)")
    full = os.path.expanduser(path)
    if not os.path.isdir(full):
        raise ValueError(f"{what} {path!r} is not a folder (pyspec reads local checkpoints "
                         "only: download it first)")
    return full


def _heads_kind(path: str) -> Optional[str]:
    """"eagle", "eagle3" or "medusa" for a heads folder (pyspec's drafter.json, or a published
    layout), "draft-model" for a model, else None."""
    from pyspec.drafters.published import published_kind
    from pyspec.drafters.folder import folder_kind, read_config

    kind = published_kind(path)
    if kind is not None:
        return kind
    k = folder_kind(path)
    if k == "drafter":
        cfg = read_config(path)
        if cfg["method"] == "eagle":
            e = cfg.get("eagle") or {}
            return "eagle3" if e.get("feature_layers") or e.get("layout") == "eagle3" else "eagle"
        return cfg["method"]
    return k


def from_vllm(config) -> SpecSettings:
    """vLLM's ``--speculative-config`` (a JSON string or a dict) as :class:`SpecSettings`."""
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--speculative-config must be a JSON object; got "
                         f"{type(config).__name__}")
    for key, v in config.items():
        if key in _VLLM_NO_EQUIVALENT:
            if v is not None:
                raise ValueError(f"--speculative-config {key!r} has no equivalent in pyspec: "
                                 f"{_VLLM_NO_EQUIVALENT[key]}")
        elif key in _VLLM_NEUTRAL:
            allowed = _VLLM_NEUTRAL[key]
            if v is not None and (v not in allowed or
                                  isinstance(v, bool) != isinstance(allowed[-1], bool)):
                raise ValueError(f"--speculative-config {key!r}: pyspec supports only "
                                 f"{[x for x in _VLLM_NEUTRAL[key] if x is not None]}; got {v!r}")
        elif key not in _VLLM_KEYS:
            raise ValueError(f"--speculative-config has an unknown key {key!r}; pyspec maps "
                             f"{', '.join(_VLLM_KEYS)}")
    method = config.get("method")
    model = config.get("model")
    if method is None:
        raise ValueError(f"--speculative-config needs \"method\": one of {', '.join(VLLM_METHODS)}")
    if method not in VLLM_METHODS:
        why = (" (multi-token-prediction layers of the target: pyspec has no MTP drafter; "
               "use eagle or draft_model)" if method in ("mtp", "deepseek_mtp") else "")
        raise ValueError(f"--speculative-config method {method!r} is not supported{why}; "
                         f"allowed: {', '.join(VLLM_METHODS)}")
    k = config.get("num_speculative_tokens")
    if k is not None:
        k = _int(k, "--speculative-config num_speculative_tokens", 1, 32)
    off = config.get("disable_by_batch_size")
    if off is not None:
        off = _int(off, "--speculative-config disable_by_batch_size", 1, 1 << 20)
    if method != "ngram":
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            if config.get(key) is not None:
                raise ValueError(f"--speculative-config {key!r} applies to method \"ngram\"; "
                                 f"the method is {method!r}")
    if method != "pyspec" and config.get("draft") is not None:
        raise ValueError("--speculative-config \"draft\" (a pyspec draft spec) goes with method "
                         f"\"pyspec\"; the method is {method!r}")
    if method == "ngram":
        if model is not None:
            raise ValueError("--speculative-config method \"ngram\" takes no \"model\" (prompt "
                             "lookup needs no weights)")
        # As vLLM reads them: both unset -> 5 and 5; one set -> the other copies it.
        hi, lo = config.get("prompt_lookup_max"), config.get("prompt_lookup_min")
        hi = hi if hi is not None else lo if lo is not None else 5
        lo = lo if lo is not None else hi
        hi = _int(hi, "--speculative-config prompt_lookup_max", 1, 16)
        lo = _int(lo, "--speculative-config prompt_lookup_min", 1, 16)
        if lo > hi:
            raise ValueError(f"--speculative-config prompt_lookup_min ({lo}) is above "
                             f"prompt_lookup_max ({hi})")
        draft = f"ngram:{hi}" + (f"@min={lo}" if lo > 1 else "")
        return SpecSettings(draft, k, off)
    if method == "pyspec":
        draft = config.get("draft")
        if not isinstance(draft, str) or not draft:
            raise ValueError("--speculative-config method \"pyspec\" needs \"draft\": a pyspec "
                             "draft spec (e.g. \"ngram|suffix\", \"DIR@width=4,depth=6\")")
        if model is not None:
            raise ValueError("--speculative-config method \"pyspec\" takes its folder inside "
                             "\"draft\", not \"model\"")
        return SpecSettings(draft, k, off)
    path = _folder(model, f"--speculative-config method {method!r} needs \"model\":")
    kind = _heads_kind(path)
    want = {"eagle": ("eagle",), "eagle3": ("eagle3",), "medusa": ("medusa",),
            "draft_model": ("draft-model",)}[method]
    if kind not in want:
        raise ValueError(f"--speculative-config method {method!r}: {model!r} holds "
                         f"{_describe_kind(kind)}, not {_describe_kind(want[0])}")
    if method in ("eagle", "eagle3"):
        # vLLM drafts a chain of k tokens; pyspec's EAGLE drafts a dynamic tree k levels deep.
        return SpecSettings(path + (f"@depth={k}" if k else ""), None, off)
    if method == "draft_model":
        return SpecSettings(path + (f"@depth={k}" if k else ""), k, off)
    return SpecSettings(path, k, off)  # medusa: k caps the nodes of its static tree


def _describe_kind(kind: Optional[str]) -> str:
    return {"eagle": "an EAGLE head", "eagle3": "an EAGLE-3 head", "medusa": "Medusa heads",
            "draft-model": "a draft model (config.json of a causal LM)",
            "drafter": "a pyspec corpus drafter", "suffix": "a pyspec corpus drafter",
            None: "no drafter or model files"}.get(kind, repr(kind))


def from_sglang(algorithm: Optional[str], draft_model_path: Optional[str] = None,
                num_steps: Optional[int] = None, eagle_topk: Optional[int] = None,
                num_draft_tokens: Optional[int] = None,
                accept_threshold_single: Optional[float] = None,
                accept_threshold_acc: Optional[float] = None,
                token_map: Optional[str] = None) -> SpecSettings:
    """SGLang's ``--speculative-*`` flags as :class:`SpecSettings`. ``num_draft_tokens`` counts
    the tree's root (the last verified token), as SGLang does; pyspec's ``nodes=`` does not."""
    if algorithm is None:
        raise ValueError("--speculative-algorithm is needed with the other --speculative-* flags; "
                         f"allowed: {', '.join(SGLANG_ALGORITHMS)}")
    alg = algorithm.upper()
    if alg == "NEXTN":
        raise ValueError("--speculative-algorithm NEXTN (the target's own multi-token-prediction "
                         "layers) has no equivalent in pyspec; use EAGLE, EAGLE3, STANDALONE or "
                         "NGRAM")
    if alg not in SGLANG_ALGORITHMS:
        raise ValueError(f"--speculative-algorithm {algorithm!r} is not supported; allowed: "
                         f"{', '.join(SGLANG_ALGORITHMS)}")
    for name, v in (("--speculative-accept-threshold-single", accept_threshold_single),
                    ("--speculative-accept-threshold-acc", accept_threshold_acc)):
        if v is not None and v != 1.0:
            raise ValueError(f"{name} {v}: relaxed acceptance is lossy; pyspec verifies "
                             "losslessly only (1.0)")
    if token_map is not None:
        raise ValueError("--speculative-token-map has no equivalent: a reduced draft vocabulary "
                         "is part of a pyspec or EAGLE-3 head's own files")
    steps = None if num_steps is None else _int(num_steps, "--speculative-num-steps", 1, 32)
    topk = None if eagle_topk is None else _int(eagle_topk, "--speculative-eagle-topk", 1, 16)
    total = (None if num_draft_tokens is None
             else _int(num_draft_tokens, "--speculative-num-draft-tokens", 2, 256))
    if alg == "NGRAM":
        if draft_model_path is not None:
            raise ValueError("--speculative-algorithm NGRAM takes no --speculative-draft-model-path")
        if topk not in (None, 1):
            raise ValueError("--speculative-eagle-topk applies to EAGLE and STANDALONE trees; "
                             "prompt lookup drafts one chain")
        return SpecSettings("ngram", total - 1 if total else steps)
    path = _folder(draft_model_path, f"--speculative-algorithm {alg} needs "
                                     "--speculative-draft-model-path:")
    kind = _heads_kind(path)
    want = {"EAGLE": ("eagle", "eagle3"), "EAGLE3": ("eagle3",),
            "STANDALONE": ("draft-model",)}[alg]
    if kind not in want:
        raise ValueError(f"--speculative-algorithm {alg}: {draft_model_path!r} holds "
                         f"{_describe_kind(kind)}, not {_describe_kind(want[0])}")
    if total is not None and steps is not None and (topk or 1) == 1 and total > steps + 1:
        raise ValueError(f"--speculative-num-draft-tokens {total} exceeds what a chain of "
                         f"{steps} steps holds ({steps + 1} with its root)")
    opts = []
    if alg == "STANDALONE":
        if topk and topk > 1:
            opts.append(f"tree={topk}")
        if steps:
            opts.append(f"depth={steps}")
        return SpecSettings(path + ("@" + ",".join(opts) if opts else ""),
                            total - 1 if total else None)
    if topk:
        opts.append(f"width={topk}")
    if steps:
        opts.append(f"depth={steps}")
    if total:
        opts.append(f"nodes={total - 1}")
    return SpecSettings(path + ("@" + ",".join(opts) if opts else ""))


def add_flags(p) -> None:
    """The vLLM and SGLang spellings as flags of ``pyspec generate`` / ``pyspec serve``."""
    g = p.add_argument_group("speculative settings as vLLM / SGLang spell them "
                             "(docs/coming-from.md); instead of --draft")
    g.add_argument("--speculative-config", default=None,
                   help="vLLM's JSON: {\"method\": ngram|eagle|eagle3|medusa|draft_model|pyspec, "
                        "\"model\": DIR, \"num_speculative_tokens\": K, ...}")
    g.add_argument("--speculative-algorithm", default=None,
                   help="SGLang's: EAGLE, EAGLE3, STANDALONE or NGRAM")
    g.add_argument("--speculative-draft-model-path", default=None)
    g.add_argument("--speculative-num-steps", type=int, default=None)
    g.add_argument("--speculative-eagle-topk", type=int, default=None)
    g.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    g.add_argument("--speculative-accept-threshold-single", type=float, default=None)
    g.add_argument("--speculative-accept-threshold-acc", type=float, default=None)
    g.add_argument("--speculative-token-map", default=None)


_SGLANG_FLAGS = ("speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
                 "speculative_eagle_topk", "speculative_num_draft_tokens",
                 "speculative_accept_threshold_single", "speculative_accept_threshold_acc",
                 "speculative_token_map")


def settings_from_args(args) -> Optional[SpecSettings]:
    """The settings the foreign flags in ``args`` give (None when none is set); an error when
    they are combined with ``--draft`` or with each other."""
    vllm = getattr(args, "speculative_config", None)
    sgl = {k: getattr(args, k, None) for k in _SGLANG_FLAGS}
    used_sgl = [k for k, v in sgl.items() if v is not None]
    if vllm is None and not used_sgl:
        return None
    if vllm is not None and used_sgl:
        raise ValueError("give either --speculative-config (vLLM) or --speculative-* flags "
                         "(SGLang), not both")
    if getattr(args, "draft", None) is not None:
        which = "--speculative-config" if vllm is not None else "--speculative-* flags"
        raise ValueError(f"give either --draft or {which}, not both")
    if vllm is not None:
        return from_vllm(vllm)
    return from_sglang(sgl["speculative_algorithm"], sgl["speculative_draft_model_path"],
                       sgl["speculative_num_steps"], sgl["speculative_eagle_topk"],
                       sgl["speculative_num_draft_tokens"],
                       sgl["speculative_accept_threshold_single"],
                       sgl["speculative_accept_threshold_acc"], sgl["speculative_token_map"])
