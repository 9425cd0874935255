"""Model folders on disk for the tests of several packages: a byte-level BPE tokenizer
(``write_byte_bpe``) and a tiny random Llama checkpoint that uses it (``write_tiny_model``)."""

import json
import math
import os

import torch

from pyspec.models.config import ModelConfig
from pyspec.models.loader import expected_shapes


CHATML = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
          "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _byte_alphabet():
    """GPT-2's byte -> printable character table."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def write_byte_bpe(path, merges=(), config=None, generation_config=None, model_config=None,
                   jinja=None, bos_template=False):
    """A byte-level BPE tokenizer folder: one token per byte, a few merges, ChatML specials."""
    from tokenizers import AddedToken, Tokenizer as T, decoders, models, pre_tokenizers, processors

    alpha = _byte_alphabet()
    vocab = {}
    for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]:
        vocab[s] = len(vocab)
    for b in range(256):
        vocab.setdefault(alpha[b], len(vocab))
    pairs = []
    for a, b in merges:
        pairs.append((a, b))
        vocab.setdefault(a + b, len(vocab))
    tk = T(models.BPE(vocab=vocab, merges=pairs))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False)
                           for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]])
    if bos_template:
        tk.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    os.makedirs(path, exist_ok=True)
    tk.save(os.path.join(path, "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
           "pad_token": "<|endoftext|>", "chat_template": CHATML}
    cfg.update(config or {})
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({k: v for k, v in cfg.items() if v is not None}, f)
    for name, obj in (("generation_config.json", generation_config), ("config.json", model_config)):
        if obj is not None:
            with open(os.path.join(path, name), "w") as f:
                json.dump(obj, f)
    if jinja is not None:
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(jinja)
    return path


VOCAB = 259  # 3 specials + 256 bytes


def write_tiny_model(path, layers=2, seed=0):
    from safetensors.torch import save_file

    conf = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB,
                hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=2)
    write_byte_bpe(str(path), model_config=conf)
    cfg = ModelConfig.from_dict(conf)
    g = torch.Generator().manual_seed(seed)
    w = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w[name] = torch.ones(shape)
        elif name == "model.embed_tokens.weight":
            w[name] = torch.randn(shape, generator=g)
        else:
            w[name] = torch.randn(shape, generator=g) * (2.0 / math.sqrt(shape[-1]))
    save_file(w, os.path.join(str(path), "model.safetensors"))
    return str(path)
