"""Training an EAGLE-style draft head by self-distillation (Li et al. 2024), on the CPU.

Data: :func:`pyspec.train.data.generate_corpus` (the target's own outputs + its hidden states).
Head: ``fc([embed(t_{p+1}); f_p])`` -> one Llama decoder layer (causal over positions) ->
``f_hat_{p+1}``; draft logits = ``lm_head_d(norm(f_hat))`` over a reduced draft vocabulary (the most
frequent target tokens; ids mapped back at inference). Loss per position: cross-entropy against the
*target's own distribution* at the next position, computed on the fly from the recorded feature
(``lm_head(norm(f_{p+1}))`` restricted to the draft vocabulary: knowledge distillation without
storing logits). Inputs get small uniform feature noise (EAGLE's robustness trick).

Deeper tree levels run on the head's own predicted features, so training unrolls it the same way
(EAGLE-3's "training-time test", ``steps`` passes): pass ``k`` feeds each row the features pass
``k - 1`` predicted, attends like a depth-``k`` tree node and is scored at that depth. EAGLE-1's
feature regression (``f_hat ~ f``) is available as ``reg_weight`` but off by default: on the
default model it reached a cosine similarity of only 0.25 with the true features, and depth-2
top-1 agreement stayed at 0.12.

The trained head is written in the drafter format of :mod:`pyspec.drafters.heads`.
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

from pyspec.drafters.heads import save_heads
from pyspec.models.llama import feature_layers as checked_layers


def target_hash(model_path: str) -> str:
    from pyspec.models.loader import weights_sha256

    return weights_sha256(model_path)


def _rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class EagleHead(nn.Module):
    def __init__(self, target, draft_vocab: torch.Tensor, intermediate_size: int,
                 feature_layers=None):
        super().__init__()
        cfg = target.cfg
        h = cfg.hidden_size
        self.cfg = cfg
        # The target layers whose outputs feed the head (EAGLE-3 fuses low, middle and high
        # ones): the last is the final hidden state, which also gives the teacher distribution.
        self.feature_layers = checked_layers(feature_layers, cfg.num_hidden_layers)
        self.fuse = None
        if len(self.feature_layers) > 1:
            # Starts as "read the final hidden state only" (the single-layer head).
            k = len(self.feature_layers)
            self.fuse = nn.Linear(k * h, h, bias=False)
            with torch.no_grad():
                self.fuse.weight.zero_()
                self.fuse.weight[:, (k - 1) * h:] = torch.eye(h)
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.ln1 = nn.Parameter(torch.ones(h))
        self.ln2 = nn.Parameter(torch.ones(h))
        self.q = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o = nn.Linear(self.nh * self.hd, h, bias=False)
        self.gate = nn.Linear(h, intermediate_size, bias=False)
        self.up = nn.Linear(h, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, h, bias=False)
        self.norm = nn.Parameter(target.norm.detach().float().clone())
        lm = target.lm_head.detach().float()
        self.lm_head = nn.Parameter(lm[draft_vocab].clone())
        self.register_buffer("embed", target.embed.detach().float().clone(), persistent=False)
        self.register_buffer("teacher_head", lm[draft_vocab].clone(), persistent=False)
        self.register_buffer("teacher_norm", target.norm.detach().float().clone(), persistent=False)
        self.draft_vocab = draft_vocab
        self.target = target
        with torch.no_grad():  # small residual branches at the start
            self.o.weight.mul_(0.1)
            self.down.weight.mul_(0.1)

    def rope(self, t: int):
        cos, sin = self.target.rope_tables(torch.arange(t))
        return cos.float(), sin.float()

    def forward(self, next_tokens, feats, cos, sin, ctx=None):
        """One pass over ``[b, t]`` rows: returns (output features, draft logits, (k, v)).

        ``ctx`` None: causal attention over the rows (pass 1, true features). Otherwise
        ``(k1, v1, earlier)``: row ``p`` of a later pass attends to pass 1's keys of rows ``<= p``
        (the committed context and the root entry), to its own row in each earlier later pass
        (``earlier``: list of (k, v)) and to itself: exactly what a tree node at that depth sees
        at inference."""
        if self.fuse is not None and feats.shape[-1] != self.cfg.hidden_size:
            feats = self.fuse(feats)  # the target's multi-layer features (pass 1)
        x = self.fc(torch.cat([F.embedding(next_tokens, self.embed), feats], dim=-1))
        x, kv = self.decoder_layer(self, x, cos, sin, ctx)
        logits = F.linear(_rms(x, self.norm, self.eps), self.lm_head)
        return x, logits, kv

    def decoder_layer(self, layer: nn.Module, x, cos, sin, ctx=None):
        """One Llama decoder layer over ``[b, t, h]`` rows with ``layer``'s weights (``ln1``,
        ``q``, ``k``, ``v``, ``o``, ``ln2``, ``gate``, ``up``, ``down``; the head itself holds
        its one layer's); ``ctx`` as in :meth:`forward`, with that layer's keys and values.
        Returns the rows and the layer's (k, v)."""
        b, t, _ = x.shape
        hx = _rms(x, layer.ln1, self.eps)
        q = layer.q(hx).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = layer.k(hx).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = layer.v(hx).view(b, t, self.nkv, self.hd).transpose(1, 2)
        half = self.hd // 2

        def rot(z):
            r = torch.cat([-z[..., half:], z[..., :half]], dim=-1)
            return z * cos[None, None] + r * sin[None, None]

        q, k = rot(q), rot(k)
        g = self.nh // self.nkv

        def heads(z):
            return z.repeat_interleave(g, dim=1) if g > 1 else z

        if ctx is None:
            a = F.scaled_dot_product_attention(q, heads(k), heads(v), is_causal=True)
        else:
            k1, v1, earlier = ctx
            scale = self.hd ** -0.5
            s1 = torch.matmul(q, heads(k1).transpose(-1, -2)).float() * scale
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            s1 = s1.masked_fill(~causal, float("-inf"))
            own = earlier + [(k, v)]
            sd = torch.stack([(q * heads(kj)).sum(-1).float() * scale for kj, _ in own], dim=-1)
            pr = torch.softmax(torch.cat([s1, sd], dim=-1), dim=-1)
            a = torch.matmul(pr[..., :t].to(v1.dtype), heads(v1))
            for j, (_, vj) in enumerate(own):
                a = a + pr[..., t + j, None].to(vj.dtype) * heads(vj)
        x = x + layer.o(a.transpose(1, 2).reshape(b, t, self.nh * self.hd))
        hx = _rms(x, layer.ln2, self.eps)
        x = x + layer.down(F.silu(layer.gate(hx)) * layer.up(hx))
        return x, (k, v)

    # drafter.safetensors names (export) -> this module's parameter names.
    _EXPORT_NAMES = {"fc.weight": "fc.weight", "norm.weight": "norm",
                     "layer.input_layernorm.weight": "ln1",
                     "layer.post_attention_layernorm.weight": "ln2",
                     "layer.self_attn.q_proj.weight": "q.weight",
                     "layer.self_attn.k_proj.weight": "k.weight",
                     "layer.self_attn.v_proj.weight": "v.weight",
                     "layer.self_attn.o_proj.weight": "o.weight",
                     "layer.mlp.gate_proj.weight": "gate.weight",
                     "layer.mlp.up_proj.weight": "up.weight",
                     "layer.mlp.down_proj.weight": "down.weight",
                     "lm_head.weight": "lm_head", "fuse.weight": "fuse.weight"}

    def load_exported(self, tensors: dict) -> None:
        """Start from a trained head's drafter.safetensors tensors (the inverse of export);
        shapes must match (the same draft vocabulary, intermediate size and feature layers)."""
        own = self.state_dict()
        state = {}
        for name, key in self._EXPORT_NAMES.items():
            if key not in own:
                if name in tensors:
                    raise ValueError(f"the initial head has {name} but this head has no {key}")
                continue
            if name not in tensors:
                raise ValueError(f"the initial head lacks {name}")
            t = tensors[name].float()
            if tuple(t.shape) != tuple(own[key].shape):
                raise ValueError(f"the initial head's {name} has shape {tuple(t.shape)}; this "
                                 f"head needs {tuple(own[key].shape)}")
            state[key] = t
        self.load_state_dict(state)

    def export(self) -> dict:
        p = {k: v.detach().float().contiguous() for k, v in self.state_dict().items()}
        out = {name: p[key] for name, key in self._EXPORT_NAMES.items() if key in p}
        return {**out, "draft_vocab": self.draft_vocab.to(torch.int64)}


def _tensors(seqs, idx, max_len, h_final):
    """Batch rows: next tokens, input features (all feature layers), the final layer's features
    one position on (the teacher), mask."""
    n = [min(len(seqs[i].tokens) - 2, max_len) for i in idx]
    t = max(n)
    h = seqs[idx[0]].hidden.shape[-1]
    nxt = torch.zeros(len(idx), t, dtype=torch.int64)
    feats = torch.zeros(len(idx), t, h)
    tgt = torch.zeros(len(idx), t, h_final)
    mask = torch.zeros(len(idx), t, dtype=torch.bool)
    for b, (i, m) in enumerate(zip(idx, n)):
        s = seqs[i]
        nxt[b, :m] = torch.tensor(s.tokens[1:m + 1])
        feats[b, :m] = s.hidden[:m].float()
        tgt[b, :m] = s.hidden[1:m + 1, -h_final:].float()
        mask[b, :m] = True
    return nxt, feats, tgt, mask


def train(llm, seqs, out_dir: str, *, draft_vocab: torch.Tensor, intermediate_size: int = 1024,
          epochs: int = 4, lr: float = 1e-3, max_entries: int = 256, max_len: int = 512,
          steps: int = 3, step_decay: float = 0.8, reg_weight: float = 0.0, noise: float = 0.05,
          seed: int = 0, feature_layers=None, init: dict = None, progress: bool = True,
          log=print, head_class=None) -> EagleHead:
    """Train (resuming from ``out_dir/checkpoint.pt`` when present) and return the head.

    ``steps`` > 1 unrolls the head as it runs at inference ("training-time test", EAGLE-3): pass
    ``k`` feeds every row the features the head itself predicted in pass ``k - 1`` with the token
    ``k`` positions ahead, attends like a depth-``k`` tree node (true context + its own chain) and
    is scored against the target's distribution there; pass ``k``'s loss weighs
    ``step_decay ** (k - 1)``. Without it deeper tree levels run on features the head never
    learned to read (on the default model, ``bench/eagle_offline_accuracy.py``: top-1 0.54 at
    depth 1 but 0.12 at depth 2 on its own corpus with a feature-regression loss alone). ``reg_weight`` adds EAGLE-1's feature regression on
    pass 1. ``init``: a trained head's drafter.safetensors tensors to start from (a fresh run
    only; a checkpoint in ``out_dir`` resumes instead). ``head_class``: an :class:`EagleHead`
    subclass to train instead (same constructor; experiments such as
    ``bench/eagle_capacity_probe.py``)."""
    from tqdm import tqdm

    from pyspec.train import loop as L

    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    torch.manual_seed(seed)
    head = (head_class or EagleHead)(llm.model, draft_vocab, intermediate_size, feature_layers)
    if init is not None:
        head.load_exported(init)
    h = llm.model.cfg.hidden_size
    k_layers = len(head.feature_layers)
    if seqs[0].hidden.shape[-1] != k_layers * h:
        raise ValueError(f"the corpus holds features of width {seqs[0].hidden.shape[-1]}, but "
                         f"feature layers {list(head.feature_layers)} need {k_layers * h} "
                         "(generate it with the same --feature-layers)")
    params = [p for p in head.parameters() if p.requires_grad]
    run = L.start(head, params, seqs, out_dir, "checkpoint.pt", "head", epochs=epochs, lr=lr,
                  max_entries=max_entries, max_len=max_len, seed=seed, log=log,
                  identity=draft_vocab.tolist())
    opt, rng, step = run.opt, run.rng, run.step
    # Feature noise: relative to the final layer's overall spread there (as for a single-layer
    # head), to each dimension's spread in the other layers (their scales differ by orders of
    # magnitude across dimensions: a few carry huge activations).
    sample = torch.cat([s.hidden[:64].float() for s in seqs[:256]]).view(-1, k_layers, h)
    scale = sample[:, -1].std().item() or 1.0
    noise_scale = torch.full((k_layers, h), scale)
    if k_layers > 1:
        noise_scale[:-1] = sample[:, :-1].std(dim=0).clamp_min(1e-6)
    noise_scale = noise_scale.reshape(-1)
    cos_full, sin_full = head.rope(max_len + steps)
    weights = [step_decay ** k for k in range(steps)]
    for ep in range(run.start_epoch, epochs):
        bar = tqdm(run.plan[ep], desc=f"epoch {ep + 1}/{epochs}", disable=not progress)
        agg = [0.0] * (2 * steps + 1)
        for idx in bar:
            nxt, feats, tgt, mask = _tensors(seqs, idx, max_len, h)
            t = feats.shape[1]
            L.set_lr(opt, lr, step, run.total)
            if noise > 0:
                feats = feats + (torch.rand(feats.shape, generator=rng) - 0.5) * (
                    2 * noise * noise_scale)
            with torch.no_grad():
                teacher = F.linear(_rms(tgt, head.teacher_norm, head.eps), head.teacher_head)
                tprob = torch.softmax(teacher.float(), dim=-1)
            loss = 0.0
            ces, top1s = [], []
            g, kv1, earlier = feats, None, []
            best = teacher.argmax(-1)
            # One autocast region for all passes: each weight is cast to bfloat16 once a step.
            with L.mixed_precision():
                for k in range(steps):
                    # Pass k + 1: row p holds the token at p + k + 1 and predicts the one after
                    # it, whose target distribution is teacher row p + k.
                    n = t - k
                    if n < 1:
                        break
                    m = mask[:, k:]
                    count = int(m.sum())
                    if count == 0:
                        break
                    tok = nxt if k == 0 else F.pad(nxt[:, k:], (0, k))
                    g_new, logits, kv = head(tok, g, cos_full[k:k + t], sin_full[k:k + t],
                                             ctx=None if k == 0 else (kv1[0], kv1[1], earlier))
                    if k == 0:
                        kv1 = kv
                        if reg_weight > 0:
                            m0 = mask.reshape(-1)
                            hf = g_new.shape[-1]
                            reg = F.smooth_l1_loss(g_new.float().reshape(-1, hf)[m0] / scale,
                                                   tgt.reshape(-1, hf)[m0] / scale)
                            loss = loss + reg_weight * reg
                    else:
                        earlier = earlier + [kv]
                    g = g_new
                    # Padded rows are weighted out rather than gathered away (a boolean gather
                    # of [rows, vocab] and its scatter backward cost more than the rows).
                    lp = torch.log_softmax(logits[:, :n].float(), dim=-1)
                    ce = -((tprob[:, k:] * lp).sum(-1) * m).sum() / count
                    loss = loss + weights[k] * ce
                    ces.append(ce.item())
                    with torch.no_grad():
                        top1s.append(int(((lp.argmax(-1) == best[:, k:]) & m).sum()) / count)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            for k in range(len(ces)):
                agg[2 * k] += ces[k]
                agg[2 * k + 1] += top1s[k]
            agg[-1] += 1
            bar.set_postfix(ce=f"{agg[0] / agg[-1]:.3f}", top1=" ".join(
                f"{agg[2 * k + 1] / agg[-1]:.3f}" for k in range(steps)))
        c = max(agg[-1], 1)
        log(f"epoch {ep + 1}: ce " + " ".join(f"{agg[2 * k] / c:.4f}" for k in range(steps))
            + " top1 " + " ".join(f"{agg[2 * k + 1] / c:.4f}" for k in range(steps)))
        run.save("head", head, ep + 1)
    return head


def write_drafter(head: EagleHead, out_dir: str, *, manifest: dict, width: int = 4,
                  max_depth: int = 5, max_nodes: int = 24, dtype=torch.bfloat16) -> str:
    cfg = head.cfg
    tensors = {k: (v if k == "draft_vocab" else v.to(dtype)) for k, v in head.export().items()}
    conf = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "eagle": {"intermediate_size": head.gate.out_features,
                      **({"feature_layers": list(head.feature_layers)} if head.fuse is not None
                         else {}),
                      "num_attention_heads": head.nh, "num_key_value_heads": head.nkv,
                      "head_dim": head.hd, "draft_vocab_size": int(head.draft_vocab.numel())},
            "defaults": {"width": width, "max_depth": max_depth, "max_nodes": max_nodes},
            "manifest": manifest}
    return save_heads(out_dir, "eagle", tensors, conf)
