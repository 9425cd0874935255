"""Command-line flags that several commands share (``generate``, ``serve``, ``eval-draft``):
one definition each, so their choices and help never drift apart."""

from __future__ import annotations

import argparse
from typing import Sequence

__all__ = ["DTYPES", "add_model_flags"]

from pyspec.models.llama import PACKED_WEIGHTS_CHOICES

DTYPES = ("float32", "bfloat16", "float16")

_PACKED_HELP = ("auto: float32 matrices that are exactly 4-bit / 8-bit block codes (the default "
                "model's) are read as those codes, same output bit for bit; codes: also free the "
                "decoder layers' float32 copies (about 5x less memory for them, same output; long "
                "prefills rebuild them per step); off: float32 matrices only")


def add_model_flags(p: argparse.ArgumentParser, *, dtypes: Sequence[str] = DTYPES,
                    device: bool = True) -> None:
    """``--dtype``, ``--device`` (unless ``device=False``) and ``--packed-weights``: how the
    target model is loaded."""
    p.add_argument("--dtype", default="float32", choices=list(dtypes))
    if device:
        p.add_argument("--device", default="cpu",
                       help="cpu, or cuda / cuda:N (a CUDA build with a GPU): where the model runs")
    p.add_argument("--packed-weights", default="auto", choices=list(PACKED_WEIGHTS_CHOICES),
                   help=_PACKED_HELP)
