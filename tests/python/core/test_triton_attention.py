"""The Triton tree-attention kernel (``tree_attention(..., backend="triton")``) against the dense
float64 reference of test_attention.py.

On a GPU the kernel runs compiled. Without one it runs in Triton's interpreter, which Triton only
turns on for a whole process (``TRITON_INTERPRET=1`` before it is imported): those cases run in a
child process, whose failures fail the test here.
"""

import math
import os
import subprocess

import pytest
import torch

from pyspec import triton_attention
from pyspec.attention import tree_attention
from helpers import run_interpreted
from test_attention import BF16, F16, F32, check, make_batch, make_step, plan_for

pytest.importorskip("triton", reason="the Triton kernel needs the 'triton' package")

# (seed, batch, block_size, hq, hkv, head_dim, dtype): GQA 1/3/4, a head dim that is not a power
# of two, pages of 1 and 16 tokens, trees up to 256 nodes (several tiles and mask words),
# prefixes up to 3,000 keys (split and merged where the step has few tiles).
CASES = [
    (0, 1, 16, 4, 4, 64, F32),
    (1, 9, 16, 9, 3, 64, F32),
    (2, 5, 1, 12, 4, 80, F32),
    (3, 6, 16, 8, 2, 128, BF16),
    (4, 4, 16, 9, 3, 64, F16),
    (5, 3, 16, 8, 2, 256, F32),
]


def run_case(case, device):
    seed, batch, bs, hq, hkv, d, dtype = case
    c = make_batch(seed, batch, bs, hq, hkv, d, dtype, device)
    plan = plan_for(c, hq, hkv)
    scale = 1 / math.sqrt(d)
    out, lse = tree_attention(plan, c["q"], c["k_pages"], c["v_pages"], c["k_new"], c["v_new"],
                              return_lse=True, backend="triton")
    check(c, out, lse, dtype, scale)


# Steps of one tile height per request kind: (requests, q heads, kv heads, dtype). A 16-node tree
# of a GQA-4 model (one 64-row tile) beside a decode token (a 16-row tile) and a short tree (32
# rows); a group of 3 (rows not a power of two) in bfloat16.
SPLIT_CASES = [
    ([(700, 16, [-1] + [i // 2 for i in range(15)]), (300, 1, None), (129, 70, None),
      (0, 40, [-1] + list(range(39))), (200, 5, [-1, 0, 0, 1, 2])], 8, 2, F32),
    ([(640, 16, [-1] + [i // 3 for i in range(15)]), (90, 1, None), (257, 30, None)], 9, 3, BF16),
]


def run_split_case(case, device):
    """Long prefixes split into 64-key chunks (and not split: min_chunk at its default)."""
    reqs, hq, hkv, dtype = case
    c = make_step(reqs, 16, hq, hkv, 64, dtype, device, seed=3)
    for min_chunk in (64, triton_attention.MIN_CHUNK):
        plan = plan_for(c, hq, hkv)
        out = torch.empty_like(c["q"])
        lse = torch.empty(c["q"].shape[:2], dtype=torch.float32, device=device)
        triton_attention.tree_attention_triton(plan, c["q"], c["k_pages"], c["v_pages"],
                                               c["k_new"], c["v_new"], 0.125, out, lse,
                                               num_sms=64, min_chunk=min_chunk)
        step = next(v for k, v in plan.__dict__.items() if k[0] == "_triton_step")
        assert len(step.groups) >= 2  # several tile heights, one launch each
        if min_chunk == 64:
            assert step.num_merges > 0 and step.num_items > step.num_merges
        check(c, out, lse, dtype, 0.125)


def run_all(device):
    for case in CASES:
        run_case(case, device)
    for case in SPLIT_CASES:
        run_split_case(case, device)


def test_interpreted_kernel_matches_reference():
    run_interpreted(__file__, "run_all('cpu')")


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
def test_cuda_kernel_matches_reference(case):
    run_case(case, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_cuda_split_prefix(case):
    run_split_case(case, "cuda")


def check_partition(groups, part_rows, lens, prefixes, height, min_chunk=None):
    """Every request's packed rows in tiles of ``height(rows)`` rows, each tile's prefix read
    once (in chunks of at least ``min_chunk`` keys but the last) and its new tokens once, and
    each split tile merged from partial rows no other tile writes."""
    min_chunk = min_chunk or triton_attention.MIN_CHUNK
    merged, slots = 0, set()
    for block_m, (items, merges) in groups.items():
        seen = {}
        for b, row, k0, k1, with_new, slot in items:
            seen.setdefault((b, row), []).append((k0, k1, with_new, slot))
        for b in {b for b, _ in seen}:
            assert block_m == height(lens[b] * 4)
            assert sorted(r for (bb, r) in seen if bb == b) == list(range(0, lens[b] * 4, block_m))
        assert {b for b, _ in seen} == {b for b in range(len(lens)) if lens[b]} or \
            len(groups) > 1
        for (b, r), parts in seen.items():
            parts.sort()
            pre = prefixes[b]
            assert parts[0][0] == 0 and parts[-1][1] == pre  # the whole prefix ...
            assert all(parts[i][1] == parts[i + 1][0] for i in range(len(parts) - 1))  # once
            assert all(p[1] > p[0] for p in parts) or pre == 0
            assert sum(p[2] for p in parts) == 1 and parts[-1][2] == 1  # new tokens once, last
            assert all(p[1] - p[0] >= min_chunk for p in parts[:-1])
            if len(parts) == 1:
                assert parts[0][3] == -1
                continue
            m = [mg for mg in merges if (mg[0], mg[1]) == (b, r)]
            assert len(m) == 1 and m[0][3] == len(parts)
            # chunk c writes the partial rows the merge reads: slot + c * block_m
            assert [p[3] for p in parts] == [m[0][2] + c * block_m for c in range(len(parts))]
            slots.update(range(m[0][2], m[0][2] + len(parts) * block_m))
            merged += len(parts) * block_m
    assert merged == part_rows == len(slots)  # no partial row shared
    return merged


def test_partition_covers_every_row_and_key_once():
    # requests: (rows, prefix); GQA 4, 2 KV heads, a GPU of 64 processors (the prefixes split),
    # 512-key chunks
    lens, prefixes = [16, 1, 0, 64, 3, 40], [4000, 100, 7, 2048, 0, 1500]
    q_indptr = [0]
    for n in lens:
        q_indptr.append(q_indptr[-1] + n)
    groups, part_rows = triton_attention._partition(q_indptr, prefixes, 4, 2, 64)
    assert sorted(groups) == [16, 64, 128]  # decode / 3 nodes; a 16-node tree; 40 and 64 nodes
    merged = check_partition(groups, part_rows, lens, prefixes,
                             lambda rows: min(128, max(16, 1 << (rows - 1).bit_length())))
    assert merged > 0


def test_bad_input():
    c = make_step([(5, 3, None)], 16, 4, 2, 16, F32, "cpu")
    plan = plan_for(c, 4, 2)
    args = (plan, c["q"], c["k_pages"], c["v_pages"], c["k_new"], c["v_new"])
    with pytest.raises(ValueError, match="attention backend must be one of native, pipelined, triton"):
        tree_attention(*args, backend="cuda")
    with pytest.raises(ValueError, match="backend='pipelined' runs on CUDA tensors"):
        tree_attention(*args, backend="pipelined")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="runs on CUDA tensors"):
            tree_attention(*args, backend="triton")
    bad = (plan, c["q"], c["k_pages"].half(), c["v_pages"], c["k_new"], c["v_new"])
    with pytest.raises(ValueError, match="'k_pages' in q's dtype"):
        tree_attention(*bad, backend="triton")


def test_model_and_llm_settings():
    from pyspec import LLM
    from pyspec.models.llama import LlamaForCausalLM
    from helpers import tiny_config

    model = LlamaForCausalLM.random(tiny_config(), seed=0)
    assert model.attention_backend == "native"
    for backend in ("triton", "pipelined"):
        with pytest.raises(ValueError, match=f"'{backend}' runs on CUDA; this model is on cpu"):
            model.set_attention_backend(backend)
    with pytest.raises(ValueError, match="must be one of native, pipelined, triton; got 'flash'"):
        model.set_attention_backend("flash")
    assert model.attention_backend == "native"
    with pytest.raises(ValueError, match="must be one of native, pipelined, triton; got 'flash'"):
        LLM("/nonexistent", attention_backend="flash")  # refused before the model loads


# Compiled for an H100 (sm_90) here, without a GPU: the kernels must build, keep every register
# (no local-memory stack) and fit in shared memory (227 KB per block) in the shapes the launcher
# picks for 16-bit models. float32 compiles too, without tensor cores (it spills: for tests only).
SM90_SMEM = 227 * 1024
COMPILED = [  # (kernel, dtype, head_dim, tile rows, warps, stages, must not spill): the
    # launcher's choices (tree_attention_triton)
    ("tree_attn", "bf16", 128, 16, 4, 3, True),
    ("tree_attn", "bf16", 128, 64, 4, 3, True),
    ("tree_attn", "bf16", 128, 128, 8, 3, True),
    ("tree_attn", "bf16", 256, 16, 4, 2, True),
    ("tree_attn", "fp16", 64, 64, 4, 3, True),
    ("tree_attn", "fp32", 64, 64, 4, 3, False),
    ("merge", "bf16", 128, 64, 4, 3, True),
]


def compile_sm90(fn, types, const, aligned, warps, stages, no_spill, tmp_path, fp_fusion=True):
    """Compiles the Triton kernel ``fn`` for an H100 (sm_90) without a GPU: pointer ``types``
    by argument name (other arguments int32, as a launch types them where they fit), ``const``
    the constexprs, ``aligned`` the arguments Triton would see 16-byte aligned / divisible by 16.
    Checks shared memory and, with ``no_spill``, that every register stays (cuobjdump)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: "constexpr" if n in const else types.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(names.index(k),): v for k, v in const.items() if k in names},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages,
                                       "enable_fp_fusion": fp_fusion})  # as the launchers ask
    assert compiled.metadata.shared <= SM90_SMEM
    if not no_spill:
        return
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    line = next(ln for ln in usage.splitlines() if "REG:" in ln)
    assert " STACK:0 " in line and " LOCAL:0 " in line, line


@pytest.mark.parametrize("kernel, dtype, d, block_m, warps, stages, no_spill", COMPILED)
def test_compiles_for_sm90_without_spills(kernel, dtype, d, block_m, warps, stages, no_spill,
                                          tmp_path):
    import inspect

    from pyspec import _triton_kernels

    fn = getattr(_triton_kernels, kernel)
    names = list(inspect.signature(fn.fn).parameters)
    types = {"items": "*i64", "merges": "*i64", "q_indptr": "*i64", "page_indptr": "*i64",
             "pages": "*i64", "tree_flags": "*i64", "masks": "*i64", "lse": "*fp32",
             "part_o": "*fp32", "part_lse": "*fp32", "scale_log2": "fp32"}
    types.update({n: f"*{dtype}" for n in ("q", "kp", "vp", "kn", "vn", "out")})
    const = {"GROUP": 4, "D": d, "BLOCK_D": d, "BLOCK_M": block_m, "BLOCK_N": 64, "PAGE": 16,
             "MASK_WORDS": 4, "HAS_LSE": True, "PREC": "ieee" if dtype == "fp32" else "tf32",
             "WIDEN": False}
    # As Triton specializes at launch: 16-byte aligned tensors and strides divisible by 16.
    aligned = [n for n in names if types.get(n, "").startswith("*") and n not in
               ("items", "merges", "q_indptr", "page_indptr", "pages", "tree_flags", "masks")]
    aligned += [n for n in names if n.startswith("s_")]
    compile_sm90(fn, types, const, aligned, warps, stages, no_spill, tmp_path)
