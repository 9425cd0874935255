"""Pieces every drafter training loop shares: the batch plan, the learning-rate schedule and
per-epoch checkpoints that make a run resumable."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch


@functools.lru_cache(maxsize=None)
def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX tiles or AVX-512 BF16)."""
    return any(getattr(torch.cpu, f, lambda: False)()
               for f in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))


def mixed_precision():
    """The training forward's autocast: bfloat16 where the CPU multiplies it natively, float32
    elsewhere (emulated bfloat16 matrix work is several times slower than float32 there)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=native_bf16())


def make_plan(seqs, epochs: int, max_entries: int, max_len: int,
              rng: torch.Generator) -> List[list]:
    """One shuffled list of length-bucketed batches per epoch (deterministic for the rng)."""
    return [length_batches(seqs, max_entries, max_len, rng) for _ in range(epochs)]


def length_batches(seqs, max_entries: int, max_len: int, rng: torch.Generator):
    """Index batches of sequences with similar lengths (<= max_entries padded entries each)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].tokens))
    out, cur, cur_max = [], [], 0
    for i in order:
        n = min(len(seqs[i].tokens) - 2, max_len)
        if n < 1:
            continue
        if cur and max(cur_max, n) * (len(cur) + 1) > max_entries:
            out.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        out.append(cur)
    perm = torch.randperm(len(out), generator=rng).tolist()
    return [out[k] for k in perm]


def set_lr(opt: torch.optim.Optimizer, lr: float, step: int, total: int) -> None:
    """3% linear warm-up, then cosine decay to 0 over ``total`` steps."""
    frac = step / max(total, 1)
    for g in opt.param_groups:
        g["lr"] = lr * min(1.0, frac / 0.03) * 0.5 * (1 + math.cos(math.pi * frac))


def fingerprint(seqs, *parts) -> str:
    """What a checkpoint was trained on: the sequences' tokens and ``parts`` (the options that
    shape the batches, the draft vocabulary), hashed."""
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for s in seqs:
        h.update(np.asarray(s.tokens, dtype=np.int64).tobytes())
        h.update(b"|")
    h.update(repr(parts).encode("utf-8"))
    return h.hexdigest()


def resume(path: str, key: str, module: torch.nn.Module, opt: torch.optim.Optimizer,
           log: Callable = print, data: Optional[str] = None) -> int:
    """Load ``path`` when it exists; returns the epochs already done (0 for a fresh start).
    ``data``: this run's :func:`fingerprint`; a checkpoint trained on other data or options is
    refused (resuming it would write a head of the old data under the new run's manifest).

    The checkpoint holds state dicts (tensors, numbers, strings) only, read with
    ``torch.load(weights_only=True)``: nothing in the file runs. One that needs unpickling
    anything else is refused (it was not written by :func:`save`)."""
    if not os.path.isfile(path):
        return 0
    from pyspec.models.loader import load_weights_only

    restart = "delete it to train from the first epoch"
    state = load_weights_only(
        path, lambda name: f"{path}: the checkpoint holds pickled Python objects (it names "
                           f"{name}), which pyspec does not load (unpickling can run any code); "
                           f"train-draft did not write it: {restart}",
        lambda why: f"{path}: not a readable training checkpoint ({why}); {restart}")
    if not (isinstance(state, dict) and isinstance(state.get(key), dict)
            and isinstance(state.get("opt"), dict) and isinstance(state.get("epoch"), int)):
        raise ValueError(f"{path}: not a training checkpoint of this trainer (needs '{key}', "
                         f"'opt' and 'epoch'); {restart}")
    if data is not None and state.get("data", data) != data:
        raise ValueError(f"{path}: this checkpoint was trained on other data or options (the "
                         "corpus, --train-tokens, --seed, --batch-tokens or the draft vocabulary "
                         f"differ); {restart}, or give another --out")
    try:
        module.load_state_dict(state[key])
        opt.load_state_dict(state["opt"])
    except (RuntimeError, ValueError, KeyError) as e:  # another head shape or layer list
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: this checkpoint was trained with other head options (the "
                         f"intermediate size, feature layers, heads or draft layers differ: "
                         f"{first}); {restart}, or give another --out") from None
    log(f"resumed from {path} after epoch {state['epoch']}")
    return int(state["epoch"])


def save(path: str, key: str, module: torch.nn.Module, opt: torch.optim.Optimizer,
         epoch: int, data: Optional[str] = None) -> None:
    """The checkpoint :func:`resume` reads: state dicts only (loadable with weights_only=True),
    and ``data``, the run's :func:`fingerprint`; written under a temporary name and renamed into
    place."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    state = {key: module.state_dict(), "opt": opt.state_dict(), "epoch": epoch}
    if data is not None:
        state["data"] = data
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


@dataclass
class Run:
    """What a trainer's epoch loop needs: optimizer, data rng, per-epoch batch plan, checkpoint
    path, and where a resumed run starts (epoch and global step)."""

    opt: torch.optim.Optimizer
    rng: torch.Generator
    plan: List[list]
    total: int  # batches over all epochs (the LR schedule's length)
    ckpt: str
    start_epoch: int
    step: int
    data: str  # the data and options' fingerprint, saved with each checkpoint

    def save(self, key: str, module: torch.nn.Module, epoch: int) -> None:
        save(self.ckpt, key, module, self.opt, epoch, self.data)


def start(module: torch.nn.Module, params, seqs, out_dir: str, ckpt_name: str, key: str, *,
          epochs: int, lr: float, max_entries: int, max_len: int, seed: int,
          log: Callable = print, identity=()) -> Run:
    """AdamW over ``params``, the seeded batch plan, and the checkpoint of an earlier run of the
    same trainer (``out_dir/ckpt_name``, state under ``key``) resumed when present and trained
    on the same data and options (``identity``: what else makes the run this one, e.g. the
    draft vocabulary's ids; ``--epochs`` and ``--lr`` may change, to train on)."""
    # The fused kernel: one pass over each parameter instead of a dozen elementwise ops.
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95), fused=True)
    rng = torch.Generator().manual_seed(seed)
    plan = make_plan(seqs, epochs, max_entries, max_len, rng)
    ckpt = os.path.join(out_dir, ckpt_name)
    data = fingerprint(seqs, max_entries, max_len, seed, list(identity))
    start_epoch = resume(ckpt, key, module, opt, log, data)
    return Run(opt, rng, plan, sum(len(p) for p in plan), ckpt, start_epoch,
               sum(len(p) for p in plan[:start_epoch]), data)
