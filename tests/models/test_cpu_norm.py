"""The CPU kernel's RMSNorms (`csrc/cpu_norm.cpp`, `models.norms.Norms`): against the float64
definition, a row's bits the same alone and among 40 rows, and in use wherever a model's
products run on the kernel (a Gemma 3 layer's six norms a step), where a step's logits are then
the same row's in a verification and in a batch."""

import pytest
import torch

from smcspec.models import cpu_linear
from smcspec.models.fused import rms_reference
from smcspec.models.llama import LlamaConfig, LlamaModel, random_weights
from smcspec.models.norms import Norms

pytestmark = pytest.mark.skipif(
    not cpu_linear.available(), reason="the int4/int8 kernel did not build here"
)


def kernel():
    return cpu_linear.KERNEL.get()


def definition(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


# Gemma 3 270M's hidden size and head size, a size with a tail past its last 16, no rows
@pytest.mark.parametrize("shape", [(1, 640), (7, 37), (3, 5, 256), (0, 16)])
def test_rms_norm_is_the_definition_within_float32_rounding(shape):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    out = kernel().rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), definition(x, w, 1e-6), rtol=1e-6, atol=1e-6)


def test_head_norms_normalise_q_and_k_heads_and_copy_v():
    nh, nkv, d = 4, 2, 32
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(6, nh + 2 * nkv, d, generator=g)
    wq, wk = torch.randn(d, generator=g), torch.randn(d, generator=g)
    out = kernel().head_norms(qkv, wq, wk, nh, nkv, 1e-6)
    want = torch.cat(
        [definition(qkv[:, :nh], wq, 1e-6), definition(qkv[:, nh : nh + nkv], wk, 1e-6)], dim=1
    )
    torch.testing.assert_close(out[:, : nh + nkv].double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(out[:, nh + nkv :], qkv[:, nh + nkv :])


def test_a_row_is_the_same_bits_alone_and_among_40_rows():
    """What the kernel is for beside speed: a row's norm does not depend on the rows that share
    its call (a decoding step, a verification's block, a batch of requests)."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(40, 640, generator=g), torch.randn(640, generator=g)
    together = kernel().rms_norm(x, w, 1e-6)
    qkv = torch.randn(40, 6, 256, generator=g)
    wq, wk = torch.randn(256, generator=g), torch.randn(256, generator=g)
    heads = kernel().head_norms(qkv, wq, wk, 4, 1, 1e-6)
    for t in (0, 17, 39):
        assert torch.equal(kernel().rms_norm(x[t : t + 1], w, 1e-6)[0], together[t]), t
        alone = kernel().head_norms(qkv[t : t + 1], wq, wk, 4, 1, 1e-6)[0]
        assert torch.equal(alone, heads[t]), t


def test_bad_inputs_are_refused_naming_them():
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="w must be a contiguous float32 \\[16\\]"):
        kernel().rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="x must be float32"):
        kernel().rms_norm(x.double(), torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="nh \\+ 2 nkv"):
        kernel().head_norms(torch.randn(2, 5, 16), torch.ones(16), torch.ones(16), 2, 2, 1e-6)


GEMMA = LlamaConfig.from_hf(
    {
        "model_type": "gemma3_text", "vocab_size": 96, "hidden_size": 128,
        "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
        "sliding_window": 8, "query_pre_attn_scalar": 32, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "layer_types": ["sliding_attention", "full_attention"],
    }
)  # fmt: skip


def test_the_kernels_norms_run_with_its_products_and_keep_a_steps_logits():
    """An int8 Gemma-like model (norms around every block, q and k head norms) normalises on
    the kernel, a float32 one in torch; on the kernel a step's logits are the same bits as the
    same row's in a verify pass and in a batch, and close to the torch norms' logits."""
    m = LlamaModel(GEMMA, random_weights(GEMMA, "cpu", seed=5), "int8", "cpu")
    assert m.norms.rms is kernel().rms_norm
    plain = LlamaModel(GEMMA, random_weights(GEMMA, "cpu", seed=5), "float32", "cpu")
    assert plain.norms.rms is rms_reference
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(96, (n,), generator=g) for n in (30, 12)]
    block = torch.randint(96, (5,), generator=g)

    def prefilled(model, which):
        kv = model.new_kv(64, 16)
        seqs = [kv.new_sequence() for _ in which]
        for s, i in zip(seqs, which, strict=True):
            model.forward(kv, [s], [prompts[i]], 1)
        return kv, seqs

    kv, (a,) = prefilled(m, [0])
    verify = m.forward(kv, [a], [block], 5)[0]
    kv, (a,) = prefilled(m, [0])
    steps = torch.stack([m.forward(kv, [a], [block[j : j + 1]], 1)[0, 0] for j in range(5)])
    kv, seqs = prefilled(m, [0, 1])
    batched = m.forward_ragged(kv, seqs, [block, prompts[1][:3]], [5, 3])[0]
    assert torch.equal(steps, verify) and torch.equal(batched, verify)
    m.norms = Norms()  # the same model on torch's norms
    kv, (a,) = prefilled(m, [0])
    torch.testing.assert_close(m.forward(kv, [a], [block], 5)[0], verify, rtol=1e-3, atol=1e-3)
