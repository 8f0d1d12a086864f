"""The CPU kernel's attention (`csrc/cpu_attention.cpp`, `GatherAttention(kernel.attend)`): the
causal softmax attention over a sequence's key slots, against float64, and the property it is
for: a row's result is the same bits alone, in a verification's block of rows, or beside other
sequences of other lengths; on a model whose products run on the kernel, a decoding step's
logits are those of the same row in a verify pass and in a batch of requests."""

import pytest
import torch

from smcspec.models import cpu_linear
from smcspec.models.attention import GatherAttention
from smcspec.models.llama import LlamaConfig, LlamaModel, random_weights

pytestmark = pytest.mark.skipif(
    not cpu_linear.available(), reason="the int4/int8 kernel did not build here"
)


def attend(*args, window=0):
    return cpu_linear.KERNEL.get().attend(*args, window)


def reference(q, k, v, key_slots, row_seq, positions, scale, window=0):
    """The definition in float64: row t over its sequence's keys 0 .. positions[t] (the last
    `window` of them where window > 0)."""
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t, (b, p) in enumerate(zip(row_seq.tolist(), positions.tolist(), strict=True)):
        slots = key_slots[b, max(0, p - window + 1) if window else 0 : p + 1]
        keys = k[slots].double().repeat_interleave(group, 1)  # [L, nh, d]
        values = v[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[t].double(), keys) * scale
        out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
    return out


def batch(lengths, new, nh, nkv, d, seed=0):
    """Sequences of `lengths` keys on scattered slots, each with its last new[b] keys as query
    rows (flat, sequence by sequence)."""
    g = torch.Generator().manual_seed(seed)
    slots = sum(lengths) + 7
    k, v = torch.randn(slots, nkv, d, generator=g), torch.randn(slots, nkv, d, generator=g)
    order = torch.randperm(slots, generator=g)
    key_slots = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    used = 0
    for b, n in enumerate(lengths):
        key_slots[b, :n] = order[used : used + n]
        used += n
    rows = [(b, p) for b, n in enumerate(new) for p in range(lengths[b] - n, lengths[b])]
    row_seq = torch.tensor([b for b, _ in rows])
    positions = torch.tensor([p for _, p in rows])
    q = torch.randn(len(rows), nh, d, generator=g) * 2
    return q, k, v, key_slots, row_seq, positions, d**-0.5


# (query heads, kv heads, head size): Qwen2.5-1.5B's 12/2 at 128, 0.5B's odd group 14/2 at 64,
# a head size with no vector count of its own (80), plain multi-head
SHAPES = [(12, 2, 128), (14, 2, 64), (4, 2, 80), (4, 4, 16)]
# a decoding step, a verification, a prefill from empty crossing the 16-row chunks, ragged
FEEDS = [([40], [1]), ([33, 50, 17], [5, 5, 5]), ([37], [37]), ([3, 70, 16, 20], [3, 1, 16, 2])]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("feed", FEEDS, ids=str)
def test_attention_is_the_causal_softmax_within_float32_rounding(shape, feed):
    args = batch(*feed, *shape)
    out = attend(*args)
    assert out.dtype == torch.float32 and out.shape == args[0].shape
    assert (out.double() - reference(*args)).abs().max() < 2e-6


@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_a_row_is_the_same_bits_alone_in_its_block_and_beside_other_sequences(shape):
    q, k, v, key_slots, row_seq, positions, scale = batch(*FEEDS[3], *shape)
    together = attend(q, k, v, key_slots, row_seq, positions, scale)
    for t in range(q.shape[0]):
        b, p = int(row_seq[t]), int(positions[t])
        alone = attend(q[t : t + 1], k, v, key_slots[b : b + 1, : p + 1], row_seq[:1] * 0,
                       positions[t : t + 1], scale)  # fmt: skip
        assert torch.equal(alone[0], together[t]), t
    # the same rows in another order of sequences, their slots' table wider
    flip = torch.tensor([3, 2, 1, 0])
    wide = torch.cat([key_slots, key_slots[:, :9]], dim=1)[flip]
    order = torch.cat([torch.nonzero(row_seq == b).flatten() for b in flip.tolist()])
    remap = torch.argsort(flip)[row_seq[order]]
    again = attend(q[order], k, v, wide, remap, positions[order], scale)
    assert torch.equal(again, together[order])


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
def test_a_sliding_window_sees_its_last_keys_and_a_row_keeps_its_bits(window):
    """Windows inside a block of 16 keys, at one, across blocks, longer than some sequences:
    the definition within float32 rounding, and each row alone the same bits as together."""
    q, k, v, key_slots, row_seq, positions, scale = batch(*FEEDS[3], *SHAPES[0])
    together = attend(q, k, v, key_slots, row_seq, positions, scale, window=window)
    want = reference(q, k, v, key_slots, row_seq, positions, scale, window)
    assert (together.double() - want).abs().max() < 2e-6
    for t in range(q.shape[0]):
        b, p = int(row_seq[t]), int(positions[t])
        alone = attend(q[t : t + 1], k, v, key_slots[b : b + 1, : p + 1], row_seq[:1] * 0,
                       positions[t : t + 1], scale, window=window)  # fmt: skip
        assert torch.equal(alone[0], together[t]), t


def test_bad_inputs_are_refused_naming_them():
    q, k, v, key_slots, row_seq, positions, scale = batch([10], [2], 4, 2, 16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        attend(q[..., :8], k[..., :8], v[..., :8], key_slots, row_seq, positions, scale)
    with pytest.raises(RuntimeError, match="outside key_slots"):
        attend(q, k, v, key_slots, row_seq, positions + 1, scale)  # the last row one past
    attend(q, k, v, key_slots, row_seq, positions, scale)  # at the table's last position
    with pytest.raises(RuntimeError, match="float32"):
        attend(q.double(), k, v, key_slots, row_seq, positions, scale)


CONFIG = LlamaConfig.from_hf(
    {
        "model_type": "qwen2", "vocab_size": 96, "hidden_size": 128, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }
)  # fmt: skip


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_steps_logits_are_the_same_row_in_a_verification_and_in_a_batch(dtype):
    """The property sd's and msd's exactness rests on: the target's law at a position does not
    depend on the pass that computes it. (PyTorch's SDPA, the attention before, moved a row's
    output by ~1e-7 with the pass's shape, and int8 activations carried that to the logits.)"""
    weights = random_weights(CONFIG, "cpu", seed=5)
    weights = {n: w if "norm" in n else w * 8 for n, w in weights.items()}
    m = LlamaModel(CONFIG, weights, dtype, "cpu")
    assert isinstance(m.attention, GatherAttention) and m.attention.name == "rows"
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(96, (n,), generator=g) for n in (30, 45, 12, 60)]
    block = torch.randint(96, (5,), generator=g)

    def prefilled(which):
        kv = m.new_kv(64, 16)
        seqs = [kv.new_sequence() for _ in which]
        for s, i in zip(seqs, which, strict=True):
            m.forward(kv, [s], [prompts[i]], 1)
        return kv, seqs

    kv, (a,) = prefilled([0])
    verify = m.forward(kv, [a], [block], 5)[0]  # [5, V]
    kv, (a,) = prefilled([0])
    steps = torch.stack([m.forward(kv, [a], [block[j : j + 1]], 1)[0, 0] for j in range(5)])
    kv, seqs = prefilled([0, 1, 2, 3])
    feeds = [block, prompts[1][:3], prompts[2][:1], prompts[3][:5]]
    batched = m.forward_ragged(kv, seqs, feeds, [5, 3, 1, 5])[0]
    assert torch.equal(steps, verify)
    assert torch.equal(batched, verify)
