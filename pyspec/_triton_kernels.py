"""The Triton kernels of :mod:`pyspec.triton_attention`; imported only when Triton is present.

Under ``TRITON_INTERPRET=1`` (Triton's own switch, read when Triton is imported) ``triton.jit``
makes them run in Triton's interpreter, on cpu tensors: that is how they are tested without a GPU.
"""

import triton
import triton.language as tl


@triton.jit
def _tile_rows(q_indptr, b, m_begin, kvh, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Request b's first query row and row count, and for the tile's packed rows
    m_begin + i (= node * GROUP + g): whether each is a row of the request, its node and q head."""
    q0 = tl.load(q_indptr + b)
    n = tl.load(q_indptr + b + 1) - q0
    offs_m = m_begin + tl.arange(0, BLOCK_M)
    return q0, n, offs_m < n * GROUP, offs_m // GROUP, kvh * GROUP + offs_m % GROUP


@triton.jit
def _tile(qv, k_ptrs, v_ptrs, kv_mask, visible, m_i, l_i, acc, scale_log2,
          PREC: tl.constexpr, WIDEN: tl.constexpr):
    """One K/V tile into the running softmax (base 2) of the rows: max m_i, sum l_i, output acc.
    A row that sees none of the tile's keys keeps its state."""
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    if WIDEN:  # Triton's interpreter cannot multiply bfloat16: it gets float32 operands
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(qv, tl.trans(k), input_precision=PREC) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def tree_attn(items, q_indptr, page_indptr, pages, tree_flags, masks,
              q, kp, vp, kn, vn, out, lse, part_o, part_lse,
              scale_log2, num_part_rows, num_q_heads,
              s_qt, s_qh, s_kb, s_ks, s_kh, s_nt, s_nh, s_ot, s_oh,
              GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
              MASK_WORDS: tl.constexpr, HAS_LSE: tl.constexpr, PREC: tl.constexpr,
              WIDEN: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    it = items + pid * 6
    b = tl.load(it)
    m_begin = tl.load(it + 1)
    kv_begin = tl.load(it + 2)
    kv_end = tl.load(it + 3)
    do_new = tl.load(it + 4)
    slot = tl.load(it + 5)
    q0, n, row_ok, node, head = _tile_rows(q_indptr, b, m_begin, kvh, GROUP, BLOCK_M)
    pbase = tl.load(page_indptr + b)
    is_tree = tl.load(tree_flags + b).to(tl.int32)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    qv = tl.load(q + (q0 + node)[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
                 mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if WIDEN:
        qv = qv.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # The prefix: every key is visible to every row.
    for start in range(kv_begin, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k_ok = keys < kv_end
        page = tl.load(pages + pbase + keys // PAGE, mask=k_ok, other=0).to(tl.int64)
        off = page * s_kb + (keys % PAGE) * s_ks + kvh * s_kh
        kv_mask = k_ok[:, None] & d_ok[None, :]
        m_i, l_i, acc = _tile(qv, kp + off[:, None] + offs_d[None, :],
                              vp + off[:, None] + offs_d[None, :], kv_mask, k_ok[None, :],
                              m_i, l_i, acc, scale_log2, PREC, WIDEN)

    # The request's new tokens, up to the tile's last node (ancestors come before a node).
    last = tl.minimum(n, (m_begin + BLOCK_M - 1) // GROUP + 1)
    n_new = tl.where(do_new != 0, last, 0)
    # A tile's 64 keys share one 64-bit word of each row's ancestor mask. Few tiles: not pipelined.
    tl.static_assert(BLOCK_N == 64)
    tree_rows = (node * 0 + is_tree) != 0
    for start in tl.range(0, n_new, BLOCK_N, num_stages=1):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < n_new
        off = (q0 + j) * s_nt + kvh * s_nh
        kv_mask = j_ok[:, None] & d_ok[None, :]
        both = row_ok[:, None] & j_ok[None, :]
        word = tl.load(masks + (q0 + node) * MASK_WORDS + start // 64, mask=row_ok & tree_rows,
                       other=0)
        in_tree = ((word[:, None] >> tl.arange(0, BLOCK_N).to(tl.int64)[None, :]) & 1) != 0
        causal = j[None, :] <= node[:, None]
        visible = both & tl.where(tree_rows[:, None], in_tree, causal)
        m_i, l_i, acc = _tile(qv, kn + off[:, None] + offs_d[None, :],
                              vn + off[:, None] + offs_d[None, :], kv_mask, visible,
                              m_i, l_i, acc, scale_log2, PREC, WIDEN)

    l_safe = tl.where(row_ok, l_i, 1.0)
    o = acc / l_safe[:, None]
    row_lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    if slot < 0:
        dst = out + (q0 + node)[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :]
        tl.store(dst, o.to(out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if HAS_LSE:
            tl.store(lse + (q0 + node) * num_q_heads + head, row_lse, mask=row_ok)
    else:
        prow = kvh * num_part_rows + slot + tl.arange(0, BLOCK_M)
        tl.store(part_o + prow[:, None] * BLOCK_D + offs_d[None, :], o)
        tl.store(part_lse + prow, row_lse)


@triton.jit
def merge(merges, q_indptr, part_o, part_lse, out, lse, num_part_rows, num_q_heads,
          s_ot, s_oh,
          GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
          BLOCK_M: tl.constexpr, HAS_LSE: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    mg = merges + pid * 4
    b = tl.load(mg)
    m_begin = tl.load(mg + 1)
    slot = tl.load(mg + 2)
    chunks = tl.load(mg + 3)
    q0, n, row_ok, node, head = _tile_rows(q_indptr, b, m_begin, kvh, GROUP, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = kvh * num_part_rows + slot + tl.arange(0, BLOCK_M)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for c in range(0, chunks):
        top = tl.maximum(top, tl.load(part_lse + rows + c * BLOCK_M))
    top = tl.where(row_ok, top, 0.0)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for c in range(0, chunks):
        w = tl.exp(tl.load(part_lse + rows + c * BLOCK_M) - top)
        w = tl.where(row_ok, w, 0.0)
        den += w
        acc += w[:, None] * tl.load(part_o + (rows + c * BLOCK_M)[:, None] * BLOCK_D
                                    + offs_d[None, :])
    den = tl.where(row_ok, den, 1.0)
    dst = out + (q0 + node)[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :]
    tl.store(dst, (acc / den[:, None]).to(out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d < D)[None, :])
    if HAS_LSE:
        tl.store(lse + (q0 + node) * num_q_heads + head, top + tl.log(den), mask=row_ok)


@triton.jit
def packed_matmul(x, q, d, m, bias, out, M, N, K, s_xm, s_om,
                  BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
                  WIDEN: tl.constexpr):
    """out[M, N] = x[M, K] @ W.T (+ bias) with W held as block codes (pyspec.linear.PackedWeight):
    groups of 32 inputs per row, W = q * d (8-bit, int8 q) or q * d + m (4-bit: group byte j
    holds input j in its low nibble and input j + 16 in its high one). Each weight is rebuilt in
    float32 and rounded once to x's dtype, as the float matrix the codes stand for would be."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows = offs_n.to(tl.int64)
    groups = K // 32
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    xdt = tl.float32 if WIDEN else x.dtype.element_ty
    GK: tl.constexpr = BLOCK_K // 32  # groups of 32 inputs per block
    g = tl.arange(0, GK)
    for k0 in range(0, K, BLOCK_K):
        gw_ok = n_ok[:, None] & ((k0 // 32 + g) < groups)[None, :]
        gidx = rows[:, None] * groups + (k0 // 32 + g)[None, :]
        dd = tl.load(d + gidx, mask=gw_ok, other=0.0)[:, :, None]  # one scale per group
        if BITS == 4:
            # Byte j of group g holds inputs k0 + 32 g + j (low nibble) and + 16 (high nibble).
            j = tl.arange(0, 16)
            mm = tl.load(m + gidx, mask=gw_ok, other=0.0)[:, :, None]
            byte = tl.load(q + rows[:, None, None] * (K // 2) + k0 // 2
                           + (g[:, None] * 16 + j[None, :])[None, :, :],
                           mask=gw_ok[:, :, None], other=0)
            w_lo = tl.reshape(((byte & 0xF).to(tl.float32) * dd + mm).to(xdt),
                              [BLOCK_N, BLOCK_K // 2])
            w_hi = tl.reshape(((byte >> 4).to(tl.float32) * dd + mm).to(xdt),
                              [BLOCK_N, BLOCK_K // 2])
            c = tl.arange(0, BLOCK_K // 2)
            k_lo = k0 + (c // 16) * 32 + c % 16
            x_ok = m_ok[:, None] & (k_lo < K)[None, :]
            xp = x + offs_m[:, None].to(tl.int64) * s_xm + k_lo[None, :]
            x_lo = tl.load(xp, mask=x_ok, other=0.0).to(xdt)
            x_hi = tl.load(xp + 16, mask=x_ok, other=0.0).to(xdt)
            acc += tl.dot(x_lo, tl.trans(w_lo), input_precision=PREC)
            acc += tl.dot(x_hi, tl.trans(w_hi), input_precision=PREC)
        else:
            j = tl.arange(0, 32)
            qq = tl.load(q + rows[:, None, None] * K + k0
                         + (g[:, None] * 32 + j[None, :])[None, :, :],
                         mask=gw_ok[:, :, None], other=0)
            w = tl.reshape((qq.to(tl.float32) * dd).to(xdt), [BLOCK_N, BLOCK_K])
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x + offs_m[:, None].to(tl.int64) * s_xm + k[None, :],
                         mask=m_ok[:, None] & (k < K)[None, :], other=0.0).to(xdt)
            acc += tl.dot(xv, tl.trans(w), input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dst = out + offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
