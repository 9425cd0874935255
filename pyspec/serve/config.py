"""The server's YAML configuration: validated with errors that name the bad key.

    speculative:
      enabled_ratio: 0.1        # share of requests that use speculation (deterministic by request id)
      draft_model: "..."        # a drafter spec: ngram, layer-skip:L, a drafter/draft-model folder
      target_model: "..."       # a model folder, or "default" (the embedded model)
      gamma: 5                  # most draft tokens per step
      tree_width: 1             # a draft-model folder: 1 = chain, > 1 = dynamic top-W trees
      adaptive: true
      fallback_on_alpha_below: 0.0  # hard acceptance floor (0 = none; the cost model decides)
      long_prompt:              # the long-prompt channel (null: none, every prompt drafted alike)
        threshold_tokens: 4096  # prompts longer than this ...
        draft_model: ngram      # ... are drafted by this spec ("none": decoded plainly)
      predictor: null           # an acceptance predictor file (null: none) ...
      predictor_min_acceptance: 1.2  # ... short requests predicted below decode plainly
      quality_gate:
        kl_threshold: 0.05
        rollback_on_violation: true
    tenants:                    # optional: per-tenant settings
      batch-jobs:
        speculative: {enabled_ratio: 0.0}
        api_keys: ["..."]       # its keys (Bearer); with any key configured, keys name tenants
        max_concurrency: 8      # requests (samples) in flight at once; past it: 429
        tokens_per_minute: 60000  # prompt + max_tokens of its requests per minute; past it: 429

    classes:                    # optional: per prompt class ("short", "long": the prompt channel)
      long:
        speculative: {enabled_ratio: 0.0}
    regions:                    # optional: per region (this server's is --region NAME)
      eu-west:
        speculative: {draft_model: ngram, enabled_ratio: 0.5}
    rollback:                   # optional: rollbacks (each counted in pyspec_rollbacks_total)
      drafter: false            # true: draft with speculative.previous_draft_model again
      policy: false             # true (when loaded): the adaptive policy back to its start
      drafter_below_acceptance: 0  # > 0: roll the drafter back by itself when the mean
      window: 64                   #   acceptance length of its last `window` requests falls below

Everything under ``speculative`` is optional (defaults below). Tenant and class overrides may set
``enabled_ratio`` (the other settings belong to the shared engine: model, drafter, draft length
bounds and adaptivity are the same for every tenant). A tenant is named by its API key when keys
are on (``--api-key`` or any ``api_keys`` here), else by the ``X-Tenant`` header. A request's
settings: ``speculative`` with this server's region's overrides (any key: one file serves every
region), then its prompt class's, then its tenant's, each overriding what it sets; a speculation
rollback (the quality gate's) overrides them all until the config is reloaded.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional, Tuple

SPEC_KEYS = {"enabled_ratio", "draft_model", "target_model", "gamma", "tree_width", "adaptive",
             "fallback_on_alpha_below", "quality_gate", "long_prompt", "predictor",
             "predictor_min_acceptance", "previous_draft_model"}
LONG_PROMPT_KEYS = {"threshold_tokens", "draft_model"}
GATE_KEYS = {"kl_threshold", "rollback_on_violation", "sample_ratio"}
TENANT_KEYS = {"enabled_ratio"}
TENANT_SECTION_KEYS = {"speculative", "api_keys", "max_concurrency", "tokens_per_minute"}
TOP_KEYS = ("speculative", "tenants", "classes", "regions", "rollback")
PROMPT_CLASSES = ("short", "long")  # the prompt channel (the engine's long-prompt threshold)
ROLLBACK_KEYS = {"drafter", "policy", "drafter_below_acceptance", "window"}


log = logging.getLogger("pyspec.serve")


class ConfigError(ValueError):
    pass


@dataclass
class QualityGate:
    kl_threshold: float = 0.05
    rollback_on_violation: bool = True
    # Share of speculative requests also scored by the target alone (each costs one plain forward
    # over its sequence in the engine thread): 0 unless the config has a quality_gate section,
    # where it defaults to 0.05.
    sample_ratio: float = 0.0


@dataclass
class SpecSettings:
    enabled_ratio: float = 1.0
    draft_model: str = "default"
    target_model: str = "default"
    gamma: Optional[int] = None
    tree_width: int = 1
    adaptive: bool = True
    fallback_on_alpha_below: float = 0.0
    quality_gate: QualityGate = field(default_factory=QualityGate)
    long_prompt_tokens: int = 4096
    long_prompt_draft: Optional[str] = "ngram"  # None: no long-prompt channel
    predictor: Optional[str] = None  # "default" or a predictor file (pyspec.predictor)
    predictor_min_acceptance: float = 1.2
    # A drafter spec kept loaded beside draft_model: the drafter rollback goes back to it.
    previous_draft_model: Optional[str] = None

    def speculates(self, request_id: str) -> bool:
        """Deterministic by request id: the same id always gets the same answer."""
        if self.enabled_ratio >= 1.0:
            return True
        if self.enabled_ratio <= 0.0:
            return False
        h = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big")
        return h / float(1 << 64) < self.enabled_ratio


@dataclass
class TenantLimits:
    api_keys: Tuple[str, ...] = ()
    max_concurrency: Optional[int] = None
    tokens_per_minute: Optional[int] = None


@dataclass
class RollbackSettings:
    drafter: bool = False  # serve with previous_draft_model
    policy: bool = False  # reset the adaptive policy when a config saying so is loaded
    drafter_below_acceptance: float = 0.0  # automatic drafter rollback threshold (0: off)
    window: int = 64  # finished speculative requests it averages


@dataclass
class ServerConfig:
    speculative: SpecSettings = field(default_factory=SpecSettings)
    limits: Dict[str, TenantLimits] = field(default_factory=dict)
    tenant_overrides: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # tenant -> keys set
    classes: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # prompt class -> keys set
    region: Optional[str] = None  # this server's region (its overrides are in speculative)
    rollback: RollbackSettings = field(default_factory=RollbackSettings)
    # Speculation rolled back (the quality gate): every request decodes plainly until a reload.
    plain_only: bool = False

    def for_tenant(self, tenant: Optional[str]) -> SpecSettings:
        return self.settings_for(tenant, None)

    def settings_for(self, tenant: Optional[str], prompt_class: Optional[str]) -> SpecSettings:
        """A request's settings: ``speculative`` (with the region's overrides), then its prompt
        class's overrides, then its tenant's."""
        over = {**self.classes.get(prompt_class or "", {}),
                **self.tenant_overrides.get(tenant or "", {})}
        return replace(self.speculative, **over) if over else self.speculative

    def speculates(self, request_id: str, tenant: Optional[str] = None,
                   prompt_class: Optional[str] = None) -> bool:
        """Whether a request speculates (deterministic by request id): never after a
        speculation rollback, else by its settings' ``enabled_ratio``."""
        return not self.plain_only and \
            self.settings_for(tenant, prompt_class).speculates(request_id)

    def limits_for(self, tenant: Optional[str]) -> TenantLimits:
        return self.limits.get(tenant or "", _NO_LIMITS)

    def tenant_keys(self) -> Dict[str, str]:
        """API key -> tenant name."""
        return {k: name for name, lim in self.limits.items() for k in lim.api_keys}


_NO_LIMITS = TenantLimits()


def _num(v, key, lo, hi, integer=False):
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{key} must be {kind} in [{lo}, {hi}]; got {v!r}")
    return v


def _bool(v, key):
    if not isinstance(v, bool):
        raise ConfigError(f"{key} must be true or false; got {v!r}")
    return v


def _spec(d: Any, where: str, base: SpecSettings, allowed) -> SpecSettings:
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping; got {type(d).__name__}")
    unknown = set(d) - allowed
    if unknown:
        raise ConfigError(f"unknown key {where}.{sorted(unknown)[0]}; allowed: {sorted(allowed)}")
    s = replace(base, quality_gate=replace(base.quality_gate))
    for k, v in d.items():
        key = f"{where}.{k}"
        if k == "enabled_ratio":
            s.enabled_ratio = float(_num(v, key, 0.0, 1.0))
        elif k in ("draft_model", "target_model"):
            if not isinstance(v, str) or not v:
                raise ConfigError(f"{key} must be a non-empty string; got {v!r}")
            setattr(s, k, v)
        elif k == "previous_draft_model":
            if v is not None and (not isinstance(v, str) or not v or v == "none"):
                raise ConfigError(f"{key} must be a drafter spec (the version a drafter rollback "
                                  f"goes back to) or null; got {v!r}")
            s.previous_draft_model = v
        elif k == "gamma":
            s.gamma = _num(v, key, 1, 64, integer=True)
        elif k == "tree_width":
            s.tree_width = _num(v, key, 1, 16, integer=True)
        elif k == "adaptive":
            s.adaptive = _bool(v, key)
        elif k == "fallback_on_alpha_below":
            s.fallback_on_alpha_below = float(_num(v, key, 0.0, 0.99))
        elif k == "predictor":
            if v is not None and (not isinstance(v, str) or not v):
                raise ConfigError(f"{key} must be a predictor file's path or null; got {v!r}")
            s.predictor = v
        elif k == "predictor_min_acceptance":
            s.predictor_min_acceptance = float(_num(v, key, 1.0, 64.0))
        elif k == "long_prompt":
            if v is None:
                s.long_prompt_draft = None
                continue
            if not isinstance(v, dict):
                raise ConfigError(f"{key} must be a mapping ({', '.join(sorted(LONG_PROMPT_KEYS))})"
                                  " or null (no long-prompt channel)")
            bad = set(v) - LONG_PROMPT_KEYS
            if bad:
                raise ConfigError(f"unknown key {key}.{sorted(bad)[0]}; allowed: "
                                  f"{sorted(LONG_PROMPT_KEYS)}")
            if "threshold_tokens" in v:
                s.long_prompt_tokens = _num(v["threshold_tokens"], key + ".threshold_tokens", 1,
                                            1 << 30, integer=True)
            if "draft_model" in v:
                d = v["draft_model"]
                if not isinstance(d, str) or not d:
                    raise ConfigError(f"{key}.draft_model must be a drafter spec or 'none'; got "
                                      f"{d!r}")
                s.long_prompt_draft = d
        elif k == "quality_gate":
            if not isinstance(v, dict):
                raise ConfigError(f"{key} must be a mapping")
            bad = set(v) - GATE_KEYS
            if bad:
                raise ConfigError(f"unknown key {key}.{sorted(bad)[0]}; allowed: {sorted(GATE_KEYS)}")
            g = s.quality_gate
            if g.sample_ratio == 0.0:  # a gate section turns sampling on (an inherited ratio stays)
                g.sample_ratio = 0.05
            if "kl_threshold" in v:
                g.kl_threshold = float(_num(v["kl_threshold"], key + ".kl_threshold", 0.0, 100.0))
            if "rollback_on_violation" in v:
                g.rollback_on_violation = _bool(v["rollback_on_violation"],
                                                key + ".rollback_on_violation")
            if "sample_ratio" in v:
                g.sample_ratio = float(_num(v["sample_ratio"], key + ".sample_ratio", 0.0, 1.0))
    return s


def _overrides(d: Any, where: str, base: SpecSettings, allowed) -> Dict[str, Any]:
    """The keys a ``speculative`` override section sets (validated as ``_spec`` does)."""
    s = _spec(d, where, base, allowed)
    return {k: getattr(s, k) for k in d}


def _sections(d: Any, where: str, inner=("speculative",)) -> Dict[str, dict]:
    if not isinstance(d, dict):
        raise ConfigError(f"{where} must be a mapping of name -> settings; got "
                          f"{type(d).__name__}")
    out = {}
    for name, over in d.items():
        name = str(name)
        if not isinstance(over, dict) or set(over) - set(inner):
            raise ConfigError(f"{where}.{name} may only hold {sorted(inner)}")
        out[name] = over
    return out


def _rollback(d: Any, spec: SpecSettings) -> RollbackSettings:
    if not isinstance(d, dict):
        raise ConfigError(f"rollback must be a mapping ({', '.join(sorted(ROLLBACK_KEYS))})")
    bad = set(d) - ROLLBACK_KEYS
    if bad:
        raise ConfigError(f"unknown key rollback.{sorted(bad)[0]}; allowed: {sorted(ROLLBACK_KEYS)}")
    r = RollbackSettings()
    if "drafter" in d:
        r.drafter = _bool(d["drafter"], "rollback.drafter")
    if "policy" in d:
        r.policy = _bool(d["policy"], "rollback.policy")
    if "drafter_below_acceptance" in d:
        r.drafter_below_acceptance = float(_num(d["drafter_below_acceptance"],
                                                "rollback.drafter_below_acceptance", 0.0, 64.0))
    if "window" in d:
        r.window = _num(d["window"], "rollback.window", 1, 100_000, integer=True)
    if (r.drafter or r.drafter_below_acceptance > 0) and not spec.previous_draft_model:
        what = "rollback.drafter" if r.drafter else "rollback.drafter_below_acceptance"
        raise ConfigError(f"{what} needs speculative.previous_draft_model (the drafter version to "
                          "go back to, kept loaded beside draft_model)")
    return r


def parse_config(d: Any, region: Optional[str] = None) -> ServerConfig:
    """The validated config; ``region``: this server's region (``regions.<region>``'s overrides
    apply; every region's section is checked either way)."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ConfigError(f"the config must be a mapping at the top level; got {type(d).__name__}")
    unknown = set(d) - set(TOP_KEYS)
    if unknown:
        raise ConfigError(f"unknown key {sorted(unknown)[0]}; allowed: {', '.join(TOP_KEYS)}")
    spec = _spec(d.get("speculative") or {}, "speculative", SpecSettings(), SPEC_KEYS)
    regions = _sections(d.get("regions") or {}, "regions")
    mine = spec
    for name, over in regions.items():
        merged = _spec(over.get("speculative") or {}, f"regions.{name}.speculative", spec,
                       SPEC_KEYS)
        if name == region:
            mine = merged
    if region is not None and regions and region not in regions:
        log.warning("config: this server's region %r has no section under regions (%s): the "
                    "base settings apply", region, ", ".join(regions))
    spec = mine
    classes = {}
    for name, over in _sections(d.get("classes") or {}, "classes").items():
        if name not in PROMPT_CLASSES:
            raise ConfigError(f"classes.{name}: not a prompt class; the classes are "
                              f"{', '.join(PROMPT_CLASSES)} (the prompt channel)")
        classes[name] = _overrides(over.get("speculative") or {}, f"classes.{name}.speculative",
                                   spec, TENANT_KEYS)
    limits, owner, tenant_over = {}, {}, {}
    for name, over in _sections(d.get("tenants") or {}, "tenants", TENANT_SECTION_KEYS).items():
        tenant_over[name] = _overrides(over.get("speculative") or {},
                                       f"tenants.{name}.speculative", spec, TENANT_KEYS)
        keys = over.get("api_keys") or []
        if not isinstance(keys, list) or not all(
                isinstance(k, str) and len(k) >= 8 and k == k.strip() for k in keys):
            raise ConfigError(f"tenants.{name}.api_keys must be a list of strings of at least 8 "
                              "characters without surrounding spaces")
        for k in keys:
            if k in owner:
                raise ConfigError(f"tenants.{name}.api_keys: a key is also tenants.{owner[k]}'s "
                                  "(a key names one tenant)")
            owner[k] = name
        lim = TenantLimits(api_keys=tuple(keys))
        if over.get("max_concurrency") is not None:
            lim.max_concurrency = _num(over["max_concurrency"], f"tenants.{name}.max_concurrency",
                                       1, 1 << 20, integer=True)
        if over.get("tokens_per_minute") is not None:
            lim.tokens_per_minute = _num(over["tokens_per_minute"],
                                         f"tenants.{name}.tokens_per_minute", 1, 1 << 40,
                                         integer=True)
        limits[name] = lim
    rollback = _rollback(d.get("rollback") or {}, spec)
    return ServerConfig(speculative=spec, limits=limits, tenant_overrides=tenant_over,
                        classes=classes, region=region, rollback=rollback)


def load_config(path: Optional[str], region: Optional[str] = None) -> ServerConfig:
    if path is None:
        return ServerConfig(region=region)
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    return parse_config(data, region)
