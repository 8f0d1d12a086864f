"""The native layer's GPU path: at most 12 kernel launches a layer (`launches.count_ops`, on the
meta device), and the numbers of the plain torch path it replaces, through the ops' torch
references and through the Triton kernels (interpreted)."""

import pytest
import torch

from smcspec.models import fused
from smcspec.models.launches import count_ops
from smcspec.models.llama import LlamaConfig, LlamaModel, random_weights

# Review finding 2's target (8-12 a layer): the plain torch layer launches 34 kernels in bf16,
# which made a 0.5B draft step ~800 launches, 2-2.5 ms against a 0.23 ms weight floor.
MAX_PER_LAYER = 12
# Embedding, the two RoPE table lookups, the last residual add, the final norm and the head (the
# first layer's input norm, a plain rms_norm, stands in for the others' add_rms_norm).
MAX_FIXED = 6


def config(arch: str, layers: int = 2) -> LlamaConfig:
    """qwen2 has q/k/v biases (an addmm), llama none (an mm)."""
    return LlamaConfig.from_hf(
        {
            "model_type": arch, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 128, "rope_theta": 1e6, "tie_word_embeddings": False,
        }
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize(("rows", "t"), [(1, 1), (8, 9)])  # a decode step, a verify of K = 8
def test_a_layer_launches_at_most_12_kernels(dtype, arch, rows, t):
    count = count_ops(config(arch), dtype, rows, t)
    print(
        f"{dtype} {arch} {rows}x{t}: {count.layer} a layer {count.per_layer}, fixed {count.fixed}"
    )
    assert count.layer <= MAX_PER_LAYER, count.per_layer
    assert sum(count.fixed.values()) <= MAX_FIXED, count.fixed


def test_a_split_kv_attention_keeps_the_layer_within_12():
    """The paged kernel's split-KV merge is a second launch."""
    count = count_ops(config("qwen2"), "bfloat16", 8, 1, attention_launches=2)
    assert count.layer <= MAX_PER_LAYER, count.per_layer


def test_the_plain_torch_layer_breaks_the_bound():
    """The count has the power to fail: the plain path (the CPU's, `fused=False`) launches 34
    kernels a bf16 layer, as the review counted (its bf16 RMSNorm alone is 9, twice)."""
    count = count_ops(config("qwen2"), "bfloat16", 8, 9, fused=False)
    assert count.layer == 34, count.per_layer
    assert count.layer > MAX_PER_LAYER


def model(dtype: str, attention: str, fused_path: bool, layers: int = 3) -> LlamaModel:
    """Random weights, norms included (all-ones norms would hide a norm read from the wrong
    layer)."""
    c = config("qwen2", layers)
    weights = random_weights(c, "cpu", seed=3)
    g = torch.Generator().manual_seed(4)
    for name, w in weights.items():
        if "norm" in name:
            weights[name] = 1 + 0.5 * torch.randn(w.shape, generator=g)
    m = LlamaModel(c, weights, dtype, "cpu", attention)
    m.fused = fused_path
    return m


def run(
    m: LlamaModel, prefill: tuple[int, int] = (7, 3), step: tuple[int, int] = (2, 1)
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A ragged prefill then a ragged step of two sequences; every logit, and the caches."""
    kv = m.new_kv(32, 4)
    seqs = [kv.new_sequence(), kv.new_sequence()]
    g = torch.Generator().manual_seed(0)
    rows = []
    for counts in (prefill, step):
        ids = [torch.randint(64, (n,), generator=g) for n in counts]
        rows += m.forward_ragged(kv, seqs, ids, list(counts))
    return rows, kv.k, kv.v


@pytest.mark.parametrize("attention", ["gather", "reference"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_path_gives_the_plain_paths_numbers(dtype, attention):
    """On the CPU the ops run their torch references: bit for bit the plain path's logits and
    caches, which checks the fused path's wiring (which norm, which residual, which slots)."""
    expected = run(model(dtype, attention, fused_path=False))
    got = run(model(dtype, attention, fused_path=True))
    for x, y in zip(got[0], expected[0], strict=True):
        assert torch.equal(x, y)
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_triton_kernels_in_the_model_give_the_plain_paths_numbers(dtype, monkeypatch):
    """The ops' CUDA implementations (`fused.TRITON`), run through Triton's interpreter on the
    CPU in place of the ops: the calls the GPU makes, checked before it makes them. float32:
    the kernels differ from torch in reduction order only (measured 1e-7 on logits of 0.3;
    1e-6 allowed); bf16: in a rare 1-ulp rounding of a norm or a SiLU (`_fused_kernels`;
    measured: none here), which moves a logit of 0.3 by about its own ulp, 2^-9: 4 allowed.
    Interpreted programs are slow: 2 layers, short feeds."""
    pytest.importorskip("triton")
    feeds = {"prefill": (4, 2), "step": (2, 1)}
    expected = run(model(dtype, "reference", fused_path=False, layers=2), **feeds)
    for name, launch in fused.TRITON.items():
        monkeypatch.setattr(fused, name, launch)
    got = run(model(dtype, "reference", fused_path=True, layers=2), **feeds)
    tol = {"float32": 1e-6, "bfloat16": 2**-7}[dtype]
    for x, y in zip(got[0], expected[0], strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    for x, y in zip(got[1:], expected[1:], strict=True):
        torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol)


def test_plan_fills_query_starts_for_paged_batches():
    """The [B + 1] cumulative counts the paged kernel reads (attention.ForwardBatch)."""
    m = LlamaModel.random(config("qwen2"), attention="reference")
    kv = m.new_kv(16, 4)
    seqs = [kv.new_sequence() for _ in range(3)]
    batch = m.plan(kv, seqs, [2, 5, 1])
    assert batch.query_starts.dtype == torch.int32
    assert batch.query_starts.tolist() == [0, 2, 7, 8]
