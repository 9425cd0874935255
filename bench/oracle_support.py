"""Shared by the scaling benchmarks: random-weight Llama layouts of real sizes (no download), and
an oracle drafter of controlled acceptance.

The oracle knows each prompt's true continuation (the target's own greedy answer from a first,
plain pass) and drafts it with every token replaced, independently, by a wrong one with
probability ``1 - alpha``: a chain of D drafts then yields ``(1 - alpha^(D+1)) / (1 - alpha)``
tokens per target step on average, on any layout, so speedup can be measured against acceptance
without a trained drafter. A *tree* shape keeps that chain as its spine and adds random siblings
at every level: the same acceptance, more nodes to verify (what a wider tree costs).

    from oracle_support import LAYOUTS, random_model, OracleDrafter
"""

from __future__ import annotations

import random
from typing import Dict, List, Sequence, Tuple

LAYOUTS = {
    # ~1.1B parameters: Llama-3.2-1B's shapes with a 32k vocabulary.
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    # ~3.0B: Llama-3.2-3B's shapes with a 32k vocabulary.
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, vocab_size=32000),
    # Llama-3-8B's shapes (GPU runs).
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    # The default model's shapes (SmolLM2-135M): its decode step's cost with random weights.
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, vocab_size=49152),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=111),
}

# How the weights are held: "q8": float32 values on the 8-bit block grid (a model converted from
# a Q8_0 GGUF, like the default model), read as their codes; "bf16" / "float32": those dtypes.
WEIGHTS = ("q8", "bf16", "float32")


def layout_config(name: str):
    from pyspec.models.config import ModelConfig

    if name not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {name!r}")
    return ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5,
                                      max_position_embeddings=8192, tie_word_embeddings=False,
                                      **LAYOUTS[name]), source=name)


def _q8_matrix(n: int, k: int, g):
    """A float32 [n, k] matrix of std ~1/sqrt(k) whose values are exactly d * q per group of 32
    (q int8 in -127..127, d a float16 value): what pyspec.linear.pack_exact holds as codes."""
    import torch

    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g, dtype=torch.int8)
    q[..., 7] = 127  # the group's scale is its largest |value| / 127, as a quantizer leaves it
    # std of q uniform in -127..127 is ~73.6; d per group, jittered, rounded to float16.
    d = ((1.0 + 0.1 * torch.rand(n, k // 32, 1, generator=g)) / (73.6 * k ** 0.5)).half().float()
    return (q.float() * d + 0.0).reshape(n, k)


def random_model(layout: str, weights: str = "q8", seed: int = 0, device: str = "cpu"):
    """A random-weight model of ``layout`` held as ``weights`` (see WEIGHTS; "q8" on the CPU
    only), N(0, 1/fan_in) matrices like ``LlamaForCausalLM.random``. Each tensor is made in
    float32 and converted at once (on ``device`` when it is a GPU), so the peak is the model in
    its own dtype; "q8" matrices are kept as their codes only (the float32 matrices freed)."""
    import math

    import torch

    from pyspec.models.llama import LlamaForCausalLM, resolve_device
    from pyspec.models.loader import expected_shapes

    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}; got {weights!r}")
    dev = resolve_device(device)
    if weights == "q8" and dev.type != "cpu":
        raise ValueError("'q8' weights (read as codes) run on the CPU; use bf16 on a GPU")
    cfg = layout_config(layout)
    dt = {"q8": torch.float32, "bf16": torch.bfloat16, "float32": torch.float32}[weights]
    g = torch.Generator(device=dev).manual_seed(seed)
    w: Dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        if weights == "q8" and len(shape) == 2 and shape[-1] % 32 == 0 and \
                name != "model.embed_tokens.weight":
            w[name] = _q8_matrix(shape[0], shape[1], g)
            continue
        t = torch.randn(shape, generator=g, device=dev)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        elif name.endswith(".bias"):
            t = 0.1 * t
        elif name != "model.embed_tokens.weight":
            t = t / math.sqrt(shape[-1])
        w[name] = t.to(dt)
    m = LlamaForCausalLM(cfg, w, dt, device=str(dev))
    del w
    if dev.type == "cpu":
        m.place_on_huge_pages()
    if weights == "q8":
        if m.pack_weights() == 0:
            raise RuntimeError("this CPU's kernels read no packed codes (the AVX2 / AVX-512 "
                               "float32 build): 'q8' weights would run as float32")
        m.drop_dense()
    return m


def shape_nodes(shape: str) -> Tuple[int, int]:
    """``"chainD"`` -> (D, D); ``"treeN"`` -> (N, depth): a spine of depth 4 (N >= 8) with N/4 - 1
    random siblings of each spine node (N a multiple of 4)."""
    if shape.startswith("chain") and shape[5:].isdigit() and int(shape[5:]) >= 1:
        d = int(shape[5:])
        return d, d
    if shape.startswith("tree") and shape[4:].isdigit():
        n = int(shape[4:])
        if n >= 8 and n % 4 == 0:
            return n, 4
    raise ValueError(f"a draft shape is chainD (D >= 1) or treeN (N a multiple of 4, >= 8); "
                     f"got {shape!r}")


def chain_tokens(a: float, depth: int) -> float:
    """Expected tokens per step of a ``depth``-draft chain whose drafts each hold with
    probability ``a`` (the target's own token always counts)."""
    return float(depth + 1) if a >= 1.0 else (1.0 - a ** (depth + 1)) / (1.0 - a)


def make_oracle(truths: Sequence[Sequence[int]], alpha: float, shape: str = "chain4",
                seed: int = 0):
    """An :class:`OracleDrafter` (a pyspec Drafter; built here so that importing this module
    needs no pyspec)."""
    from pyspec.drafters.base import Draft, Drafter

    class OracleDrafter(Drafter):
        """Drafts ``truths`` (each a prompt + its true continuation) with per-token acceptance
        ``alpha``; a context no truth continues gets no draft."""

        name = "oracle"

        def __init__(self):
            if not 0.0 <= alpha <= 1.0:
                raise ValueError(f"alpha must be in [0, 1]; got {alpha!r}")
            self.nodes, self.depth = shape_nodes(shape)
            self.max_draft_depth = self.depth
            self.alpha = float(alpha)
            self.truths = [list(t) for t in truths]
            self.seed = int(seed)
            self.vocab = None  # set by the caller for replacement tokens (default: max id + 1)

        def node_budget(self, depth: int) -> int:
            return self.nodes if depth >= self.depth else depth

        def _truth(self, context: Sequence[int]) -> List[int]:
            n = len(context)
            for t in self.truths:
                if len(t) > n and t[n - 1] == context[-1] and t[:n] == list(context):
                    return t[n:]
            return []

        def propose(self, reqs):
            out = []
            for r in reqs:
                true = self._truth(r.context)
                rng = random.Random(self.seed * 1_000_003 + r.request_id * 65_537 + r.start)
                vocab = self.vocab or (max(max(t) for t in self.truths) + 1)
                depth = min(self.depth, r.depth_limit, len(true))
                wide = self.nodes // self.depth if self.nodes > self.depth and \
                    r.budget >= self.nodes else 1
                tokens, parents, spine = [int(r.context[-1])], [-1], 0
                for lvl in range(depth):
                    tok = true[lvl]
                    if rng.random() >= self.alpha:
                        tok = (tok + 1 + rng.randrange(vocab - 1)) % vocab  # any other token
                    kids = [tok] + [(true[lvl] + 1 + rng.randrange(vocab - 1)) % vocab
                                    for _ in range(wide - 1)]
                    first = len(tokens)
                    for k in kids:
                        if k not in tokens[first:]:
                            tokens.append(k)
                            parents.append(spine)
                    spine = first
                out.append(Draft(tokens, parents))
            return out

    return OracleDrafter()
