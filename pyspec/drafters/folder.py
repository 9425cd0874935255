"""The drafter folder format shared by every trained drafter: ``drafter.json`` (format, method,
shapes, defaults, manifest) beside the method's own files (``drafter.safetensors`` for EAGLE and
Medusa heads, ``corpus.npz`` for a corpus drafter). docs/drafters.md describes the files."""

from __future__ import annotations

import json
import os
import warnings
from typing import Dict, Optional

__all__ = ["FORMAT", "CONFIG_NAME", "WEIGHTS_NAME", "METHODS", "write_config", "read_config",
           "folder_kind", "target_mismatch", "check_target", "warn_target_hash"]

FORMAT = "pyspec-drafter"
CONFIG_NAME = "drafter.json"
WEIGHTS_NAME = "drafter.safetensors"
METHODS = ("eagle", "medusa", "suffix")


def write_config(path: str, method: str, config: Dict) -> None:
    """Write ``drafter.json`` of a folder (created if needed) with the format's header."""
    os.makedirs(path, exist_ok=True)
    cfg = dict(config, format=FORMAT, format_version=1, method=method)
    with open(os.path.join(path, CONFIG_NAME), "w") as f:
        json.dump(cfg, f, indent=1)


def read_config(path: str) -> dict:
    """A drafter folder's validated drafter.json (format and method)."""
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{path!r} is not a drafter folder: {CONFIG_NAME} is missing")
    with open(cfg_path, "rb") as f:
        try:
            cfg = json.loads(f.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{cfg_path}: not valid UTF-8 JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: must hold a JSON object; got {type(cfg).__name__}")
    for key in ("defaults", "manifest"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise ValueError(f"{cfg_path}: {key!r} must be an object; got "
                             f"{type(cfg[key]).__name__}")
    if cfg.get("format") != FORMAT:
        raise ValueError(f"{cfg_path}: 'format' must be {FORMAT!r}; got {cfg.get('format')!r}")
    if cfg.get("method") not in METHODS:
        raise ValueError(f"{cfg_path}: 'method' must be 'eagle', 'medusa' or 'suffix'; got "
                         f"{cfg.get('method')!r}")
    return cfg


def folder_kind(path: str) -> Optional[str]:
    """What a folder holds: "drafter" (drafter.json: heads or a corpus), "draft-model" (a model's
    config.json), or None."""
    if os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return "drafter"
    if os.path.isfile(os.path.join(path, "config.json")):
        return "draft-model"
    return None


def target_mismatch(cfg: dict, target_cfg) -> Optional[str]:
    """Why a drafter config does not fit a target's shapes (hidden size, vocabulary), or None."""
    for key, want in (("hidden_size", target_cfg.hidden_size), ("vocab_size", target_cfg.vocab_size)):
        if cfg.get(key) != want:
            return f"drafter {key} {cfg.get(key)} does not match the target's {want}"
    return None


def check_target(cfg: dict, target_cfg) -> None:
    why = target_mismatch(cfg, target_cfg)
    if why:
        raise ValueError(why)


def warn_target_hash(d, path: str, target_runner) -> None:
    """Warn when a drafter's manifest names other target weights than ``target_runner``'s."""
    want = (d.manifest.get("target") or {}).get("sha256")
    src = getattr(target_runner.model, "source_path", None)
    if want and src:
        from pyspec.models.loader import weights_sha256

        have = weights_sha256(src)
        if have != want:
            warnings.warn(f"drafter {path} was trained for target weights {want[:12]}..., but the "
                          f"target at {src} has {have[:12]}...: it will run (output stays "
                          "lossless) but its acceptance may be much lower", stacklevel=3)
