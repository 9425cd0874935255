"""Training a small independent draft model (same tokenizer) by distillation, on the CPU.

The draft model is a Llama with the target's vocabulary and ``num_layers`` layers, initialised from
the target's first layers, its final norm and (tied) embeddings; the layers and the final norm are
trained to match the target's next-token distribution at every position of the self-generated
corpus (full-vocabulary KL; the teacher's logits come from the recorded hidden states, so the
target never runs during training). The result is an ordinary Hugging Face checkpoint folder
(config.json, model.safetensors, tokenizer files): pyspec's draft-model path and transformers'
assisted generation load the same files.
"""

from __future__ import annotations

import json
import os
import shutil
import torch
import torch.nn as nn
import torch.nn.functional as F

from pyspec.train.eagle import _rms


class DraftLM(nn.Module):
    def __init__(self, target, num_layers: int):
        super().__init__()
        cfg = target.cfg
        self.cfg = cfg
        self.target = target
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.inter = cfg.intermediate_size
        self.layers = nn.ModuleList()
        qs, ks = cfg.q_size, cfg.kv_size
        for li, layer in enumerate(target.layers[:num_layers]):
            # The float32 matrices, rebuilt from the codes if the target holds only those.
            layer = {k: target.layer_weight(li, k) if k in ("wqkv", "wo", "wgu", "wd") else v
                     for k, v in layer.items()}
            m = nn.Module()
            m.ln1 = nn.Parameter(layer["ln1"].detach().float().clone())
            m.ln2 = nn.Parameter(layer["ln2"].detach().float().clone())
            w = layer["wqkv"].detach().float()
            m.q = nn.Parameter(w[:qs].clone())
            m.k = nn.Parameter(w[qs:qs + ks].clone())
            m.v = nn.Parameter(w[qs + ks:].clone())
            m.o = nn.Parameter(layer["wo"].detach().float().clone())
            gu = layer["wgu"].detach().float()
            m.gate = nn.Parameter(gu[:self.inter].clone())
            m.up = nn.Parameter(gu[self.inter:].clone())
            m.down = nn.Parameter(layer["wd"].detach().float().clone())
            self.layers.append(m)
        self.norm = nn.Parameter(target.norm.detach().float().clone())
        self.register_buffer("embed", target.embed.detach().float().clone(), persistent=False)
        self.register_buffer("lm_head", target.lm_head.detach().float().clone(), persistent=False)
        self.register_buffer("teacher_norm", target.norm.detach().float().clone(),
                             persistent=False)

    def forward(self, tokens, cos, sin):
        b, t = tokens.shape
        x = F.embedding(tokens, self.embed)
        half = self.hd // 2

        def rot(z):
            r = torch.cat([-z[..., half:], z[..., :half]], dim=-1)
            return z * cos[None, None] + r * sin[None, None]

        for m in self.layers:
            h = _rms(x, m.ln1, self.eps)
            q = F.linear(h, m.q).view(b, t, self.nh, self.hd).transpose(1, 2)
            k = F.linear(h, m.k).view(b, t, self.nkv, self.hd).transpose(1, 2)
            v = F.linear(h, m.v).view(b, t, self.nkv, self.hd).transpose(1, 2)
            q, k = rot(q), rot(k)
            if self.nkv != self.nh:
                k = k.repeat_interleave(self.nh // self.nkv, dim=1)
                v = v.repeat_interleave(self.nh // self.nkv, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + F.linear(a.transpose(1, 2).reshape(b, t, self.nh * self.hd), m.o)
            h = _rms(x, m.ln2, self.eps)
            x = x + F.linear(F.silu(F.linear(h, m.gate)) * F.linear(h, m.up), m.down)
        return F.linear(_rms(x, self.norm, self.eps), self.lm_head)

    def save_pretrained(self, target_path: str, out_dir: str) -> str:
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        conf = json.load(open(os.path.join(target_path, "config.json")))
        conf["num_hidden_layers"] = len(self.layers)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(conf, f, indent=1)
        w = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm.detach()}
        if not self.cfg.tie_word_embeddings:
            w["lm_head.weight"] = self.lm_head
        for i, m in enumerate(self.layers):
            p = f"model.layers.{i}."
            w.update({p + "input_layernorm.weight": m.ln1, p + "post_attention_layernorm.weight":
                      m.ln2, p + "self_attn.q_proj.weight": m.q, p + "self_attn.k_proj.weight": m.k,
                      p + "self_attn.v_proj.weight": m.v, p + "self_attn.o_proj.weight": m.o,
                      p + "mlp.gate_proj.weight": m.gate, p + "mlp.up_proj.weight": m.up,
                      p + "mlp.down_proj.weight": m.down})
        save_file({k: v.detach().float().contiguous() for k, v in w.items()},
                  os.path.join(out_dir, "model.safetensors"))
        for f in os.listdir(target_path):
            if f.startswith("tokenizer") or f in ("generation_config.json", "chat_template.jinja",
                                                  "special_tokens_map.json"):
                shutil.copy(os.path.join(target_path, f), os.path.join(out_dir, f))
        return out_dir


def train(llm, seqs, out_dir: str, *, num_layers: int = 4, epochs: int = 2, lr: float = 2e-4,
          max_entries: int = 2048, max_len: int = 512, seed: int = 0, progress: bool = True,
          log=print) -> DraftLM:
    from tqdm import tqdm

    from pyspec.train import loop as L

    torch.manual_seed(seed)
    model = DraftLM(llm.model, num_layers)
    params = list(model.parameters())
    run = L.start(model, params, seqs, out_dir, "checkpoint-draft-model.pt", "model",
                  epochs=epochs, lr=lr, max_entries=max_entries, max_len=max_len, seed=seed,
                  log=log)
    opt, step = run.opt, run.step
    cos_full, sin_full = llm.model.rope_tables(torch.arange(max_len + 1))
    for ep in range(run.start_epoch, epochs):
        bar = tqdm(run.plan[ep], desc=f"epoch {ep + 1}/{epochs}", disable=not progress)
        agg = [0.0, 0.0, 0]
        for idx in bar:
            n = [min(len(seqs[i].tokens) - 2, max_len) for i in idx]
            t = max(n) + 1
            toks = torch.zeros(len(idx), t, dtype=torch.int64)
            feats = torch.zeros(len(idx), t, seqs[idx[0]].hidden.shape[-1])
            mask = torch.zeros(len(idx), t, dtype=torch.bool)
            for b, (i, m) in enumerate(zip(idx, n)):
                toks[b, :m + 1] = torch.tensor(seqs[i].tokens[:m + 1])
                feats[b, :m + 1] = seqs[i].hidden[:m + 1].float()
                mask[b, :m + 1] = True
            L.set_lr(opt, lr, step, run.total)
            with L.mixed_precision():
                logits = model(toks, cos_full[:t].float(), sin_full[:t].float())
            with torch.no_grad():
                teacher = F.linear(_rms(feats, model.teacher_norm, model.eps), model.lm_head)
                tlp = torch.log_softmax(teacher.float(), dim=-1)
                best = tlp.argmax(-1)
            # Padded rows are weighted out rather than gathered away (a boolean gather of
            # [rows, vocab] and its scatter backward cost more than the rows).
            lp = torch.log_softmax(logits.float(), dim=-1)
            count = int(mask.sum())
            kl = ((tlp.exp() * (tlp - lp)).sum(-1) * mask).sum() / count
            opt.zero_grad(set_to_none=True)
            kl.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            with torch.no_grad():
                top1 = int(((lp.argmax(-1) == best) & mask).sum()) / count
            agg[0] += kl.item()
            agg[1] += top1
            agg[2] += 1
            bar.set_postfix(kl=f"{agg[0] / agg[2]:.3f}", top1=f"{agg[1] / agg[2]:.3f}")
        log(f"epoch {ep + 1}: kl {agg[0] / max(agg[2], 1):.4f} top1 {agg[1] / max(agg[2], 1):.4f}")
        run.save("model", model, ep + 1)
    return model
