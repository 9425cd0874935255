"""Training Medusa heads by self-distillation (Cai et al. 2024, "Medusa", Medusa-1: frozen target).

Data: the corpus of :func:`pyspec.train.data.generate_corpus` (the target's own outputs and its
final hidden states ``f_p``, recorded before the final norm). Head ``k`` (0-based) reads the
normalised state of position ``p`` and predicts the token at ``p + k + 2``, one further than the
target's own head: ``h = norm(f_p)``, ``h_k = h + SiLU(W_k h + b_k)``, logits = the target's
``lm_head(h_k)``. Only ``W_k, b_k`` are trained; ``W_k`` starts at zero, so every head starts as
the target's own next-token head. Loss: cross-entropy against the target's distribution at that
position, ``softmax(lm_head(norm(f_{p+k+1})))`` computed from the recorded features (knowledge
distillation without stored logits), restricted to a draft vocabulary of the most frequent
tokens to keep the CPU cost down (inference uses the full ``lm_head``).

The heads are written in the drafter format of :mod:`pyspec.drafters.heads` (method "medusa").
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

from pyspec.drafters.heads import DEFAULT_MEDUSA_TREE, save_heads
from pyspec.train.eagle import _rms


class MedusaHeads(nn.Module):
    def __init__(self, target, num_heads: int, draft_vocab: torch.Tensor):
        super().__init__()
        h = target.cfg.hidden_size
        self.cfg = target.cfg
        self.eps = target.cfg.rms_norm_eps
        self.num_heads = num_heads
        self.w = nn.Parameter(torch.zeros(num_heads, h, h))
        self.b = nn.Parameter(torch.zeros(num_heads, h))
        self.register_buffer("norm", target.norm.detach().float().clone(), persistent=False)
        self.register_buffer("head", target.lm_head.detach().float()[draft_vocab].clone(),
                             persistent=False)

    def forward(self, feats):
        """feats [N, H] (pre-norm) -> logits [K, N, draft vocab]."""
        h = _rms(feats, self.norm, self.eps)
        z = torch.einsum("nh,koh->kno", h, self.w) + self.b[:, None, :]
        return F.linear(h[None] + F.silu(z), self.head)

    def teacher(self, feats):
        return F.linear(_rms(feats, self.norm, self.eps), self.head)

    def export(self) -> dict:
        out = {}
        for k in range(self.num_heads):
            out[f"heads.{k}.weight"] = self.w[k].detach().float().contiguous()
            out[f"heads.{k}.bias"] = self.b[k].detach().float().contiguous()
        return out


def _rows(seqs, idx, k_max: int, max_len: int):
    """Positions p of the batch's sequences with p + K + 1 inside the sequence: features
    [N, H] and, per head k, the teacher feature rows f_{p+k+1} [K, N, H]."""
    feats, tgts = [], []
    for i in idx:
        hid = seqs[i].hidden
        n = min(hid.shape[0] - k_max - 1, max_len)
        if n < 1:
            continue
        feats.append(hid[:n].float())
        tgts.append(torch.stack([hid[k + 1:k + 1 + n].float() for k in range(k_max)]))
    if not feats:
        return None, None
    return torch.cat(feats), torch.cat(tgts, dim=1)


def train(llm, seqs, out_dir: str, *, num_heads: int = 4, draft_vocab: torch.Tensor,
          epochs: int = 2, lr: float = 1e-3, max_entries: int = 2048, max_len: int = 512,
          seed: int = 0, progress: bool = True, log=print) -> MedusaHeads:
    """Train (resuming from ``out_dir/checkpoint.pt`` when present) and return the heads."""
    from tqdm import tqdm

    from pyspec.train import loop as L

    if not 1 <= num_heads <= 16:
        raise ValueError(f"num_heads must be in [1, 16]; got {num_heads}")
    torch.manual_seed(seed)
    heads = MedusaHeads(llm.model, num_heads, draft_vocab)
    params = [heads.w, heads.b]
    run = L.start(heads, params, seqs, out_dir, "checkpoint.pt", "heads", epochs=epochs, lr=lr,
                  max_entries=max_entries, max_len=max_len, seed=seed, log=log,
                  identity=draft_vocab.tolist())
    opt, step = run.opt, run.step
    for ep in range(run.start_epoch, epochs):
        bar = tqdm(run.plan[ep], desc=f"epoch {ep + 1}/{epochs}", disable=not progress)
        agg = [0.0, torch.zeros(num_heads), 0]
        for idx in bar:
            feats, tgts = _rows(seqs, idx, num_heads, max_len)
            if feats is None:
                continue
            L.set_lr(opt, lr, step, run.total)
            with L.mixed_precision():
                logits = heads(feats)
            with torch.no_grad():
                tprob = torch.softmax(heads.teacher(tgts).float(), dim=-1)  # [K, N, Vd]
            lp = torch.log_softmax(logits.float(), dim=-1)
            ce = -(tprob * lp).sum(-1).mean(-1)  # [K]
            loss = ce.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            with torch.no_grad():
                top1 = (lp.argmax(-1) == tprob.argmax(-1)).float().mean(-1)
            agg[0] += ce.detach().mean().item()
            agg[1] += top1
            agg[2] += 1
            bar.set_postfix(ce=f"{agg[0] / agg[2]:.3f}",
                            top1="/".join(f"{x:.2f}" for x in (agg[1] / agg[2]).tolist()))
        n = max(agg[2], 1)
        log(f"epoch {ep + 1}: ce {agg[0] / n:.4f} top1 per head "
            + " ".join(f"{x:.3f}" for x in (agg[1] / n).tolist()))
        run.save("heads", heads, ep + 1)
    return heads


def write_drafter(heads: MedusaHeads, out_dir: str, *, manifest: dict, tree=None,
                  dtype=torch.bfloat16) -> str:
    cfg = heads.cfg
    tree = [list(p) for p in (tree or DEFAULT_MEDUSA_TREE) if len(p) <= heads.num_heads]
    tensors = {k: v.to(dtype) for k, v in heads.export().items()}
    conf = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "medusa": {"num_heads": heads.num_heads, "tree": tree}, "manifest": manifest}
    return save_heads(out_dir, "medusa", tensors, conf)
