"""Command-line flags that several commands share (``generate``, ``serve``, ``eval-draft``):
one definition each, so their choices and help never drift apart."""

from __future__ import annotations

import argparse
from typing import Sequence

__all__ = ["DTYPES", "add_model_flags"]

from pyspec.attention import ATTENTION_BACKENDS
from pyspec.models.llama import PACKED_WEIGHTS_CHOICES

DTYPES = ("float32", "bfloat16", "float16")

_PACKED_HELP = ("codes (default): float32 matrices that are exactly 4-bit / 8-bit block codes (the "
                "default model's) or 16-bit values (a bfloat16 / float16 checkpoint's) are held and "
                "read as those codes, same output bit for bit, 2x-5x less memory for them (long prefills rebuild them per step); auto: keep "
                "their float32 copies too; off: float32 matrices only")


def add_model_flags(p: argparse.ArgumentParser, *, dtypes: Sequence[str] = DTYPES,
                    device: bool = True, tensor_parallel: bool = False) -> None:
    """``--dtype``, ``--device`` (unless ``device=False``), ``--packed-weights``,
    ``--kv-cache-dtype`` and with ``tensor_parallel`` ``--tensor-parallel-size``: how the target
    model is loaded."""
    if tensor_parallel:
        p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                       help="split the target's heads and MLP across N processes (CPU, gloo; "
                            "at most its KV heads; docs/scaling.md)")
    p.add_argument("--dtype", default="float32", choices=list(dtypes))
    if device:
        p.add_argument("--device", default="cpu",
                       help="cpu, or cuda / cuda:N (a CUDA build with a GPU): where the model runs")
        p.add_argument("--attention-backend", default="native", choices=list(ATTENTION_BACKENDS),
                       help="tree attention's kernels: native (pyspec's), pipelined (on cuda: "
                            "its tensor-core kernel with two cp.async stages) or triton (on cuda, "
                            "with the triton package: one pass over a prefix per draft tree)")
        p.add_argument("--cuda-graphs", action="store_true",
                       help="run decode and verify steps as CUDA graphs (needs --device cuda and "
                            "--attention-backend triton)")
    p.add_argument("--packed-weights", default="codes", choices=list(PACKED_WEIGHTS_CHOICES),
                   help=_PACKED_HELP)
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "float16", "bfloat16"],
                   help="the KV cache's dtype: auto (float16 for a float32 model on the CPU: half "
                        "the memory of float32, as fast; else the model's), or float32 / float16 "
                        "/ bfloat16 (16-bit under a float32 model on the CPU only)")
