"""The Triton kernels of `paged_attention.triton_attention` (see there for the contract, the
tiling and the split/merge identity).

A module of its own, imported only when the kernels are first needed, so that Triton stays
optional and the jit decorator runs at import, with Triton's names at module level.

Scores live in base 2: the caller folds log2(e) into the scale and the kernels use exp2, so the
running maxima m written for the merge are in log2 units too, and the merge uses exp2 alike.
"""

import triton
import triton.language as tl


@triton.jit
def _find_sequence(starts_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence owning grid row `q_block`: sequence b's q-blocks start at row
    starts[b] // BLOCK_Q + b (strictly increasing in b, even across zero-length sequences), so
    this is the largest such b <= q_block, found by binary search over the B entries."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(starts_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """tl.dot, float32 accumulation. DOT_FP32 (the interpreter only): Triton's interpreter
    multiplies bfloat16 operands as their raw uint16 bits; products of bf16 values are exact in
    float32, as on tensor cores, so the upcast changes only the summation order."""
    if DOT_FP32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _locate(starts_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """Grid row `q_block` as (sequence, its first flat row, its token count, the q-block's
    index within it)."""
    seq = _find_sequence(starts_ptr, num_seqs, q_block, BLOCK_Q)
    q_start = tl.load(starts_ptr + seq)
    q_count = tl.load(starts_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    return seq, q_start, q_count, local


@triton.jit
def _query_rows(
    q_start,
    q_count,
    local,
    kv_head,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Row r of the q-block's [BLOCK_M, HEAD_DIM] tile is its token r // GROUP and query head
    r % GROUP of `kv_head`: (token [M] flat row, head [M] query head, valid [M])."""
    rows = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + rows // GROUP  # [M] token index within the sequence
    valid = (rows < BLOCK_Q * GROUP) & (tok < q_count)  # [M]
    token = (q_start + tok).to(tl.int64)  # [M] flat row
    head = kv_head * GROUP + rows % GROUP  # [M] query head
    return token, head, valid


@triton.jit
def _load_queries(q_ptr, pos_ptr, token, head, dims, valid, in_head, stride_qt, stride_qh):
    """The tile's queries [M, D] and positions [M]."""
    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=valid[:, None] & in_head[None, :], other=0.0)  # [M, D]
    # padding rows get position -1: they see no key and are never stored
    pos = tl.load(pos_ptr + token, mask=valid, other=-1).to(tl.int32)  # [M]
    return q, pos


@triton.jit
def _key_range(pos, reach, split, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """Keys [lo, hi) of split `split`: the q-block's keys run from the first tile any of its
    rows sees (a row sees its `reach` last keys: its position's and reach - 1 before) to
    max(pos), and each split takes an equal share of whole key tiles."""
    num_keys = tl.max(pos, axis=0) + 1
    lowest = tl.min(tl.where(pos >= 0, pos, num_keys), axis=0)  # padding rows' -1 aside
    first = tl.maximum(lowest - reach + 1, 0) // BLOCK_N * BLOCK_N
    tiles_per_split = tl.cdiv(tl.cdiv(num_keys - first, BLOCK_N), SPLITS)
    lo = first + split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, num_keys)
    return lo, hi


@triton.jit
def _load_tile(
    k_ptr,
    v_ptr,
    table,
    keys,
    hi,
    head_off,
    dims,
    in_head,
    stride_kpage,
    stride_kslot,
    PAGE_SIZE: tl.constexpr,
):
    """K [D, N] and V [N, D] of positions `keys` [N] through the page table, zeros from `hi`
    (the split's end) on, and which keys are in the split [N]."""
    in_split = keys < hi
    page = tl.load(table + keys // PAGE_SIZE, mask=in_split, other=0)
    slot = page.to(tl.int64) * stride_kpage + (keys % PAGE_SIZE) * stride_kslot + head_off
    k_mask = in_split[None, :] & in_head[:, None]
    k = tl.load(k_ptr + slot[None, :] + dims[:, None], mask=k_mask, other=0.0)  # [D, N]
    v_mask = in_split[:, None] & in_head[None, :]
    v = tl.load(v_ptr + slot[:, None] + dims[None, :], mask=v_mask, other=0.0)  # [N, D]
    return k, v, in_split


@triton.jit
def _online_softmax(
    q,
    k,
    v,
    keys,
    pos,
    reach,
    in_split,
    qk_scale,
    m,
    z,
    acc,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One key tile folded into the rows' running (m, z, acc), each row seeing the keys at or
    before its position and within its reach: the old sums are rescaled by exp2(m - m_new),
    then the tile's added."""
    scores = _dot(q, k, PRECISION, DOT_FP32) * qk_scale  # [M, N]
    ahead = keys[None, :] <= pos[:, None]
    seen = in_split[None, :] & ahead & (keys[None, :] > pos[:, None] - reach)
    scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    # a row that has seen no key yet keeps m = -inf; 0 stands in so exp2 gives 0, not NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)  # [M]
    p = tl.exp2(scores - m_safe[:, None])  # [M, N], 0 where not seen
    z = z * alpha + tl.sum(p, axis=1)
    pv = _dot(p.to(v.dtype), v, PRECISION, DOT_FP32)  # [M, D]
    acc = acc * alpha[:, None] + pv
    return m_new, z, acc


@triton.jit
def _attend_split(
    q,
    pos,
    reach,
    split,
    k_ptr,
    v_ptr,
    tables_ptr,
    seq,
    kv_head,
    dims,
    in_head,
    qk_scale,
    stride_kpage,
    stride_kslot,
    stride_khead,
    stride_table,
    BLOCK_M: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Over the keys of split `split`: the running max m [M] of the scores (log2 units), the
    sum z [M] of exp2(score - m) and the sum acc [M, D] of exp2(score - m) v."""
    lo, hi = _key_range(pos, reach, split, BLOCK_N, SPLITS)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    head_off = kv_head.to(tl.int64) * stride_khead
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    z = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    # Loads first, no branch inside: the shape Triton's pipeliner overlaps across iterations.
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)  # [N] positions
        k, v, in_split = _load_tile(
            k_ptr, v_ptr, table, keys, hi, head_off, dims, in_head, stride_kpage, stride_kslot,
            PAGE_SIZE,
        )  # fmt: skip
        m, z, acc = _online_softmax(
            q, k, v, keys, pos, reach, in_split, qk_scale, m, z, acc, PRECISION, DOT_FP32
        )
    return m, z, acc


@triton.jit
def _store_out(out_ptr, acc, z, token, head, dims, valid, in_head, stride_ot, stride_oh):
    """The normalised output of an unsplit key range; a row that saw no key (z = 0) gets 0."""
    o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    out = acc / tl.where(z > 0, z, 1.0)[:, None]
    o_mask = valid[:, None] & in_head[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _store_partials(
    part_acc_ptr,
    part_m_ptr,
    part_z_ptr,
    m,
    z,
    acc,
    split,
    num_tokens,
    token,
    head,
    dims,
    valid,
    in_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One split's (m, z, acc) for `merge_splits_kernel`. Every split writes, an empty one
    (m = -inf, z = 0) too: the merge reads all SPLITS."""
    part = (split * num_tokens + token) * (GROUP * tl.num_programs(1)) + head  # [M]
    tl.store(part_m_ptr + part, m, mask=valid)
    tl.store(part_z_ptr + part, z, mask=valid)
    a_offs = part[:, None] * HEAD_DIM + dims[None, :]
    tl.store(part_acc_ptr + a_offs, acc, mask=valid[:, None] & in_head[None, :])


@triton.jit
def paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_z_ptr,
    tables_ptr,
    starts_ptr,
    pos_ptr,
    qk_scale,
    reach,
    num_seqs,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kpage,
    stride_kslot,
    stride_khead,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One program: BLOCK_Q query tokens of one sequence x the GROUP query heads of kv head
    program_id(1) (`_query_rows`), over the key range of split program_id(2); each row sees
    its `reach` last keys (a sliding window; the wrapper's NO_WINDOW for all)."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, q_start, q_count, local = _locate(starts_ptr, num_seqs, q_block, BLOCK_Q)
    if local * BLOCK_Q >= q_count:  # the grid's spare rows, and zero-length sequences
        return
    token, head, valid = _query_rows(q_start, q_count, local, kv_head, GROUP, BLOCK_Q, BLOCK_M)
    dims = tl.arange(0, HEAD_PAD)  # [D] a power of two >= 16 (tl.arange, tl.dot's K)
    in_head = dims < HEAD_DIM
    q, pos = _load_queries(q_ptr, pos_ptr, token, head, dims, valid, in_head, stride_qt, stride_qh)
    m, z, acc = _attend_split(
        q, pos, reach, split, k_ptr, v_ptr, tables_ptr, seq, kv_head, dims, in_head, qk_scale,
        stride_kpage, stride_kslot, stride_khead, stride_table, BLOCK_M, HEAD_PAD, PAGE_SIZE,
        BLOCK_N, SPLITS, PRECISION, DOT_FP32,
    )  # fmt: skip
    if SPLITS == 1:
        _store_out(out_ptr, acc, z, token, head, dims, valid, in_head, stride_ot, stride_oh)
    else:
        _store_partials(
            part_acc_ptr, part_m_ptr, part_z_ptr, m, z, acc, split, num_tokens, token, head,
            dims, valid, in_head, GROUP, HEAD_DIM,
        )  # fmt: skip


@triton.jit
def merge_splits_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_z_ptr,
    out_ptr,
    num_tokens,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """out[t, h] = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) z_s, m = max_s m_s: one program
    per (token, query head). Every token sees its own key, which some split holds, so m is
    finite."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    real = s < SPLITS
    part = (s * num_tokens + t) * num_heads + h  # [S]
    m_s = tl.load(part_m_ptr + part, mask=real, other=float("-inf"))
    z_s = tl.load(part_z_ptr + part, mask=real, other=0.0)
    dims = tl.arange(0, HEAD_PAD)
    in_head = dims < HEAD_DIM
    acc_offs = part[:, None] * HEAD_DIM + dims[None, :]
    acc_s = tl.load(part_acc_ptr + acc_offs, mask=real[:, None] & in_head[None, :], other=0.0)
    w = tl.exp2(m_s - tl.max(m_s, axis=0))  # [S], 0 for splits that saw no key
    out = tl.sum(w[:, None] * acc_s, axis=0) / tl.sum(w * z_s, axis=0)  # [D]
    o_ptrs = out_ptr + t * stride_ot + h * stride_oh + dims
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=in_head)
