"""The fused Triton kernels of a layer's small steps against the torch code they replace:
Hugging Face's RMSNorm (variance in float32, two roundings in bf16), its RoPE (x cos +
rotate_half(x) sin, each product rounded), the paged pool's `PagedKVCache.write`, F.silu x up.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
before Triton is imported); on a CUDA machine they are compiled for it.

Tolerances. float32: the kernels sum the variance in another order than torch and may fuse a
multiply-add on the GPU, a relative difference of a few float32 ulps (~1e-7) per step, so
rtol = atol = 1e-6. bf16: the kernels round where torch rounds, so they can differ only where a
float32 intermediate (the variance, rsqrt, exp) lands within a few float32 ulps of a bf16
rounding midpoint: a 1-ulp flip with probability about 2^-24 / 2^-9 = 2^-15 per element. Each
element may differ by 1 ulp, and at most FLIPS of them; rounding once instead of twice (the
plausible slip) moves about a quarter of them. Measured in the interpreter: no element differs.
"""

import copy
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from smcspec.kv.cache import PagedKVCache
from smcspec.models.paged_attention import triton_available

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if not triton_available(DEVICE):
    pytest.skip("Triton can run neither on a GPU nor in its interpreter", allow_module_level=True)

from smcspec.models import _fused_kernels as fk  # noqa: E402

EPS = 1e-6  # Qwen2's rms_norm_eps
FLIPS = 0.01  # the fraction of bf16 elements allowed 1 ulp off (about 300x the expected rate)
DTYPES = (torch.float32, torch.bfloat16)
# (hidden, block): a partial last chunk (48 = 32 + 16), whole chunks, one chunk (the default)
NORM_SHAPES = ((48, 32), (96, 32), (96, fk.BLOCK))


# -- the torch references --------------------------------------------------------------------


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm / Qwen2RMSNorm forward."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def hf_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on x [T, heads, d], cos, sin [T, d]."""
    half = x.shape[-1] // 2
    rotate_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotate_half * sin[:, None]


def hf_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# -- comparison ------------------------------------------------------------------------------


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in bf16 ulps, elementwise: bf16 bit patterns mapped to ordered integers."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        return
    off = ulps(out.cpu(), ref.cpu())
    assert int(off.max()) <= 1, f"{int(off.max())} bf16 ulps off"
    assert int((off > 0).sum()) <= FLIPS * off.numel(), (
        f"{int((off > 0).sum())} of {off.numel()} elements 1 bf16 ulp off"
    )


# -- inputs ----------------------------------------------------------------------------------


def rows(tokens: int, hidden: int, seed: int) -> torch.Tensor:
    """x [tokens, hidden] whose rows span magnitudes 1e-3 .. 30, the first row zero when there
    are several: a row whose mean square is near or below eps is where eps decides the norm."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-3, 1.5, tokens)[:, None]
    x = torch.randn(tokens, hidden, generator=g) * scale
    if tokens > 1:
        x[0] = 0
    return x


def on_device(*tensors: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    return [t.to(DEVICE, dtype) for t in tensors]


# -- RMSNorm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden,block", NORM_SHAPES)
@pytest.mark.parametrize("tokens", (1, 9))
def test_rms_norm_matches_hf(dtype: torch.dtype, hidden: int, block: int, tokens: int) -> None:
    g = torch.Generator().manual_seed(1)
    x, weight = on_device(rows(tokens, hidden, 0), torch.randn(hidden, generator=g), dtype=dtype)
    out = fk.rms_norm(x, weight, EPS, block=block)
    assert_matches(out, hf_rms_norm(x, weight, EPS))


def test_rms_norm_writes_into_out() -> None:
    x, weight = on_device(rows(9, 48, 2), torch.randn(48), dtype=torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    assert fk.rms_norm(x, weight, EPS, out=out, block=32) is out
    assert_matches(out, hf_rms_norm(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden,block", NORM_SHAPES)
@pytest.mark.parametrize("tokens", (1, 9))
def test_add_rms_norm_matches_hf(dtype: torch.dtype, hidden: int, block: int, tokens: int) -> None:
    """The residual stream's update x + residual (rounded to the dtype, as torch's add) and the
    norm of that rounded sum, the next layer's input."""
    g = torch.Generator().manual_seed(3)
    residual = torch.randn(tokens, hidden, generator=g) * 4
    x, residual, weight = on_device(
        rows(tokens, hidden, 4), residual, torch.randn(hidden, generator=g), dtype=dtype
    )
    normed, new = fk.add_rms_norm(x, residual, weight, EPS, block=block)
    assert torch.equal(new, x + residual)
    assert_matches(normed, hf_rms_norm(x + residual, weight, EPS))


# -- RoPE and the KV write -------------------------------------------------------------------


def paged_slots(kv: PagedKVCache, tokens: int) -> torch.Tensor:
    """Flat slots of `tokens` new positions spread over sequences that already hold some, so
    new tokens share pages with each other and with stored ones (page_size 4): 9 tokens are
    three sequences' 3 + 5 + 1, starting mid-page; 1 token is a decode step mid-page."""
    held, new = ((3, 6, 2), (3, 5, 1)) if tokens == 9 else ((6,), (1,))
    seqs = [kv.new_sequence() for _ in held]
    for seq, n in zip(seqs, held, strict=True):
        kv.reserve(seq, n)
    return torch.cat([kv.reserve(seq, n) for seq, n in zip(seqs, new, strict=True)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nh,nkv,head_dim", ((4, 2, 16), (14, 2, 64)))
@pytest.mark.parametrize("tokens", (1, 9))
def test_rope_write_matches_rotate_and_cache_write(
    dtype: torch.dtype, nh: int, nkv: int, head_dim: int, tokens: int
) -> None:
    """q and k heads rotated as HF's, k and v stored at their slots of layer 1 (a view with a
    storage offset, as the engine passes it), and nothing else in the pool touched. cos and sin
    are random, not a RoPE table's (whose halves are equal), so a half mix-up shows."""
    g = torch.Generator().manual_seed(5)
    kv = PagedKVCache(2, nkv, head_dim, page_size=4, num_pages=8, dtype=dtype, device=DEVICE)
    slots = paged_slots(kv, tokens).to(DEVICE)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))  # stored tokens, and what must stay
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    qkv = torch.randn(tokens, (nh + 2 * nkv) * head_dim, generator=g)  # the qkv linear's output
    cos, sin = torch.rand(2, tokens, head_dim, generator=g) * 2 - 1
    qkv, cos, sin = on_device(qkv, cos, sin, dtype=dtype)
    qkv = qkv.view(tokens, nh + 2 * nkv, head_dim)

    ref = copy.copy(kv)
    ref.k, ref.v = kv.k.clone(), kv.v.clone()
    qk = hf_rotate(qkv[:, : nh + nkv], cos, sin)
    ref.write(1, slots, qk[:, nh:], qkv[:, nh + nkv :])

    q = fk.rope_write(qkv, cos, sin, kv.k[1], kv.v[1], slots, nh, nkv)
    assert_matches(q, qk[:, :nh])
    assert_matches(kv.k, ref.k)
    assert torch.equal(kv.v, ref.v)


# -- SiLU x up -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter,block", ((40, 32), (96, fk.BLOCK)))
@pytest.mark.parametrize("tokens", (1, 9))
def test_silu_mul_matches_torch(dtype: torch.dtype, inter: int, block: int, tokens: int) -> None:
    """gate = the first half. Gates of +-100 reach exp's overflow (silu(-100) = -0.0)."""
    g = torch.Generator().manual_seed(6)
    gate_up = torch.randn(tokens, 2 * inter, generator=g) * 4
    gate_up[:, :2] = torch.tensor([-100.0, 100.0])
    (gate_up,) = on_device(gate_up, dtype=dtype)
    assert_matches(fk.silu_mul(gate_up, block=block), hf_silu_mul(gate_up))


# -- contract --------------------------------------------------------------------------------


def test_bad_inputs_name_the_field() -> None:
    x, w = torch.zeros(3, 8), torch.zeros(8)
    with pytest.raises(ValueError, match="weight"):
        fk.rms_norm(x, w.bfloat16(), EPS)
    with pytest.raises(ValueError, match="residual"):
        fk.add_rms_norm(x, torch.zeros(3, 9), w, EPS)
    with pytest.raises(ValueError, match="block"):
        fk.rms_norm(x, w, EPS, block=48)
    with pytest.raises(ValueError, match="gate_up"):
        fk.silu_mul(torch.zeros(3, 7))
    qkv, cos, pool = torch.zeros(3, 8, 16), torch.zeros(3, 16), torch.zeros(4, 4, 2, 16)
    with pytest.raises(ValueError, match="slots"):
        fk.rope_write(qkv, cos, cos, pool, pool.clone(), torch.zeros(3, dtype=torch.int32), 4, 2)
    with pytest.raises(ValueError, match="head_dim"):
        fk.rope_write(torch.zeros(3, 8, 12), *[torch.zeros(3, 12)] * 2, pool, pool, None, 4, 2)
    with pytest.raises(ValueError, match="qkv"):
        fk.rope_write(qkv, cos, cos, pool, pool.clone(), torch.zeros(3, dtype=torch.long), 4, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_kernels_replay_in_a_cuda_graph() -> None:
    """No host sync and no shape-dependent host work: all four captured in one graph, replayed
    on new inputs written into the captured tensors, equal the eager launches."""
    nh, nkv, d, hidden, inter, tokens = 4, 2, 64, 96, 160, 9
    dev, dtype = "cuda", torch.bfloat16
    x, res = torch.randn(2, tokens, hidden, device=dev, dtype=dtype)
    gate_up = torch.randn(tokens, 2 * inter, device=dev, dtype=dtype)
    w = torch.randn(hidden, device=dev, dtype=dtype)
    qkv = torch.randn(tokens, nh + 2 * nkv, d, device=dev, dtype=dtype)
    cos, sin = torch.randn(2, tokens, d, device=dev, dtype=dtype)
    pool = torch.zeros(2, 8, 4, nkv, d, device=dev, dtype=dtype)
    slots = torch.randperm(32, device=dev)[:tokens]

    def step() -> list[torch.Tensor]:
        q = fk.rope_write(qkv, cos, sin, pool[0], pool[1], slots, nh, nkv)
        return [fk.rms_norm(x, w, EPS), *fk.add_rms_norm(x, res, w, EPS), fk.silu_mul(gate_up), q]

    step()  # Triton compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for t in (x, res, gate_up, qkv, w):
        t.copy_(torch.randn_like(t))
    pool.zero_()
    graph.replay()
    replayed = [t.clone() for t in captured] + [pool.clone()]
    pool.zero_()
    eager = [*step(), pool]
    for a, b in zip(replayed, eager, strict=True):
        assert torch.equal(a, b)
