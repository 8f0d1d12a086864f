"""The two-level sampler (`sampling.sample_at`, chunked) against its one-level reference and
the exact law, and the device path's promises: no host sync, one read-back for many tensors.

The chunked sampler cuts a row into C chunks of W ~ sqrt(V) tokens. The sizes below make the
last chunk padded (V = 50: W = 8, C = 7, 6 padding slots; V = 1000: W = 32, C = 32, 24)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from smcspec import sampling
from tests import oracle
from tests.stats import ALPHA, chi_square_pvalue

NEG = float("-inf")


def random_law(v: int, seed: int, dead: float = 0.3) -> torch.Tensor:
    """log-probabilities [V] of random logits, a fraction `dead` of them at probability 0,
    normalized by the oracle (plain float64 Python)."""
    g = torch.Generator().manual_seed(seed)
    logits = (2.0 * torch.randn(v, generator=g, dtype=torch.float64)).tolist()
    dead_ids = torch.randperm(v, generator=g)[: int(dead * v)].tolist()
    for i in dead_ids:
        logits[i] = NEG
    return torch.tensor(oracle.tempered(logits, 1.0), dtype=torch.float64)


@pytest.mark.parametrize("v", [50, 1000])
def test_the_chunked_sampler_draws_the_exact_law(one_torch_thread, v):
    """Pearson chi-square against the oracle's law; 200,000 draws, cells of fewer than 5
    expected pooled, rejected at ALPHA (a correct sampler fails 1 time in 10,000)."""
    logp = random_law(v, seed=v)
    n = 200_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    draws = sampling.sample_at(logp.float().expand(n, -1), u, chunked=True)
    law = {i: math.exp(x) for i, x in enumerate(logp.tolist())}
    assert chi_square_pvalue(Counter(draws.tolist()), law) > ALPHA


def flat_cdf(logp: torch.Tensor) -> torch.Tensor:
    return logp.double().exp().cumsum(-1)


@pytest.mark.parametrize("v", [50, 1000, 4099])
def test_the_chunked_sampler_picks_the_flat_samplers_token(v):
    """For u at the middle of each token's CDF step, both samplers return that token: the
    step's half-width (p_i / 2 >= 5e-10 of the total, for every token kept below) is far
    beyond what the two summation orders' rounding (~V * 1e-16) can move a boundary, so no
    seed can make this flaky. Every token of positive probability is checked."""
    rows = torch.stack([random_law(v, seed=s) for s in range(4)]).float()  # [4, V]
    for row in rows:
        cdf = flat_cdf(row)
        total = cdf[-1]
        probs = row.double().exp()
        kept = torch.nonzero(probs > 1e-9 * total).squeeze(1)
        mid = (cdf[kept] - probs[kept] / 2) / total  # [kept]
        batch = row.expand(kept.numel(), -1)
        flat = sampling.sample_at(batch, mid, chunked=False)
        chunked = sampling.sample_at(batch, mid, chunked=True)
        assert torch.equal(flat, kept)
        assert torch.equal(chunked, kept)


def test_the_chunked_sampler_agrees_with_the_flat_one_on_random_uniforms():
    """Random rows and uniforms: token for token the same, but where u * total lies within
    1e-12 of the total from a CDF step of the flat sum (where rounding decides; skipped)."""
    g = torch.Generator().manual_seed(3)
    rows = torch.log_softmax(3 * torch.randn(64, 997, generator=g), -1)
    rows[:, ::7] = NEG
    u = torch.rand(64, generator=g, dtype=torch.float64)
    cdf = flat_cdf(rows)
    target = u[:, None] * cdf[:, -1:]
    near = ((cdf - target).abs() < 1e-12 * cdf[:, -1:]).any(dim=1)
    assert near.sum() < 2  # the skip is for rounding ties, not a way around the check
    got = sampling.sample_at(rows, u, chunked=True)
    want = sampling.sample_at(rows, u, chunked=False)
    assert torch.equal(got[~near], want[~near])


def test_the_chunked_sampler_never_draws_a_token_of_probability_zero():
    """Rows whose mass sits in a few tokens, whole chunks dead, at a chunk's first or last
    token or in the padded last chunk, drawn at u = 0, the largest u below 1, and u landing
    exactly on the chunk boundaries."""
    v = 50  # W = 8: chunks 0..7, 8..15, ..., 48..49 (+ 6 padding)
    alive_sets = [[0], [49], [7, 8], [15, 48], [23], [40, 41, 49], [8]]
    rows, us = [], []
    for alive in alive_sets:
        row = torch.full((v,), NEG)
        row[alive] = torch.log_softmax(torch.arange(len(alive), dtype=torch.float32), 0)
        cut = torch.tensor([k / 8 for k in range(9)] + [1 - 2**-53], dtype=torch.float64)
        edges = flat_cdf(row)[torch.arange(7, v, 8)] / flat_cdf(row)[-1]  # chunk ends
        for u in torch.cat([cut, edges.clamp(max=1 - 2**-53)]):
            rows.append(row)
            us.append(u)
    rows_t, u_t = torch.stack(rows), torch.stack(us)
    tokens = sampling.sample_at(rows_t, u_t, chunked=True)
    assert torch.isfinite(rows_t.gather(1, tokens[:, None])).all(), tokens.tolist()


def test_the_target_stays_inside_its_chunk_despite_rounding():
    """At the largest u below 1 the target sits an ulp under the total, and where the chunk's
    sum rounds above the scan inside it the target overshoots that scan: 3 of these 4,096
    random rows (V = 1000: W = 32) do. Every chunk's last token (and the vocabulary's) is dead,
    so an overshoot kept at the chunk's end would draw a token of probability zero."""
    g = torch.Generator().manual_seed(0)
    rows = torch.log_softmax(3 * torch.randn(4096, 1000, generator=g), -1)
    rows[:, 31::32] = NEG
    rows[:, -1] = NEG
    u = torch.full((4096,), 1 - 2**-53, dtype=torch.float64)
    tokens = sampling.sample_at(rows, u, chunked=True)
    assert (tokens < 1000).all() and torch.isfinite(rows.gather(1, tokens[:, None])).all()


def test_a_row_without_mass_gets_its_arg_max_as_before():
    """All -inf, NaN, +inf, zero mass after exp: the same argmax fallback as the flat one."""
    rows = torch.tensor(
        [
            [NEG] * 10,
            [float("nan")] * 10,
            [NEG, NEG, float("nan"), 0.0, *[NEG] * 6],
            [0.0, float("inf"), *[NEG] * 8],
            [-1e4] * 9 + [-2e3],  # exp underflows to 0 everywhere: no mass
        ]
    )
    u = torch.full((5,), 0.5, dtype=torch.float64)
    got = sampling.sample_at(rows, u, chunked=True)
    assert got.tolist() == [0, 0, 3, 1, 9]
    assert torch.equal(got, sampling.sample_at(rows, u, chunked=False))


aten = torch.ops.aten


class NoHostSync(TorchDispatchMode):
    """Fails on any read of a device (meta) tensor's value on the host: what CUDA graph
    capture forbids and what makes the host wait."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        meta = bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_meta
        to = kwargs.get("device")
        to_host = func is aten._to_copy.default and to is not None and to.type == "cpu"
        if meta and (func in (aten._local_scalar_dense.default, aten.equal.default) or to_host):
            raise AssertionError(f"host sync: {func}")
        return func(*args, **kwargs)


def test_the_device_path_never_syncs():
    """The law and the draw for logits on the meta device (standing in for a GPU), with a
    host generator: truncation, the chunked inverse CDF and the empty-row fallback all stay
    on the device."""
    logits = torch.zeros(8, 1000, device="meta")
    g = torch.Generator().manual_seed(0)
    with NoHostSync():
        logp = sampling.log_probs(logits, 0.7, top_k=50, top_p=0.9, min_p=0.01)
        token = sampling.sample(logp, g)
    assert token.shape == (8,) and token.dtype == torch.long and token.is_meta


def test_the_no_sync_check_sees_a_sync():
    logits = torch.zeros(8, 1000, device="meta")
    with NoHostSync(), pytest.raises(AssertionError, match="host sync"):
        bool(logits.sum() > 0)


def test_pack_and_unpack_give_back_every_bit():
    """`to_host`'s packing on the host: NaN, -0.0, inf, a 63-bit id, bool, bfloat16, a 0-d and
    an empty tensor, and a transposed (non-contiguous) one come back bit for bit."""
    tensors = [
        torch.tensor([1.5, float("nan"), -0.0, float("inf")]),
        torch.tensor(2**62 + 1),
        torch.tensor([True, False, True]),
        torch.randn(2, 3, generator=torch.Generator().manual_seed(0)).bfloat16(),
        torch.zeros(0, 4, dtype=torch.float64),
        torch.arange(6).view(2, 3).t(),
    ]
    back = sampling.unpack(sampling.pack(tensors), tensors)
    for want, got in zip(tensors, back, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_to_host_leaves_host_tensors_alone():
    t = torch.arange(3)
    assert sampling.to_host(t)[0] is t
    assert sampling.to_device(t, "cpu") is t
