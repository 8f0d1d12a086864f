"""The Triton kernel of `paged_attention.triton_attention` (see there for the contract).

A module of its own, imported only when the kernel is first needed, so that Triton stays
optional and the jit decorator runs at import, with Triton's names at module level.
"""

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    seq_ptr,
    pos_ptr,
    scale,
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
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    dims = tl.arange(0, HEAD_DIM)  # [D]
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + h * stride_qh + dims).to(tl.float32)
    q = q * scale
    kv_head = (h // GROUP).to(tl.int64) * stride_khead
    m = tl.full([], float("-inf"), tl.float32)  # running max of the scores
    z = tl.zeros([], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([HEAD_DIM], tl.float32)  # running sum of exp(score - m) v
    for start in range(0, pos + 1, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)  # [N] positions
        causal = keys <= pos
        # masked: table entries past the token's last page are never read
        page = tl.load(tables_ptr + seq * stride_table + keys // PAGE_SIZE, mask=causal)
        row = page.to(tl.int64) * stride_kpage + (keys % PAGE_SIZE) * stride_kslot + kv_head
        offs = row[:, None] + dims[None, :]  # [N, D]
        k = tl.load(k_ptr + offs, mask=causal[:, None], other=0.0).to(tl.float32)
        scores = tl.where(causal, tl.sum(k * q[None, :], axis=1), float("-inf"))  # [N]
        # the first block always holds key 0, so m_new is finite and alpha = exp(-inf) = 0
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)  # [N], 0 where masked
        v = tl.load(v_ptr + offs, mask=causal[:, None], other=0.0).to(tl.float32)
        z = z * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    out = acc / z
    o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + dims
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))
