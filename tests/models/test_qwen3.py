"""Qwen3 on the native engine: a per-head RMSNorm of q and k before RoPE, no qkv bias, a head
size of its own (not hidden / heads). Logits against transformers' Qwen3 on the same random
weights, from a safetensors folder and from a GGUF file; int8 on the kernel close to float32."""

import itertools

import pytest
import torch

from smcspec.models.llama import LlamaModel
from smcspec.models.llama_config import LlamaConfig
from tests.models.test_llama import reference, write_gguf

VOCAB = 64  # a multiple of 16: the output layer on the kernel too


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen3")
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rope_theta=10000.0, tie_word_embeddings=False,
    )  # fmt: skip
    return saved_tiny(Qwen3ForCausalLM, config, folder, seed=3)


def saved_tiny(model_class, config, folder, seed: int):
    """transformers' `model_class` of `config` with random weights (norms around 1, but none
    equal, so that a missing or misplaced norm shows), saved to `folder`: (model, folder)."""
    torch.manual_seed(seed)
    hf = model_class(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    hf.save_pretrained(folder)
    return hf, folder


def logits(model: LlamaModel, feeds: list[list[int]], steps: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's logits over its feed then its steps (a ragged batch, then one step)."""
    kv = model.new_kv(32, 4)
    seqs = [kv.new_sequence() for _ in feeds]
    first = model.forward_ragged(
        kv, seqs, [torch.tensor(f) for f in feeds], [len(f) for f in feeds]
    )
    then = model.forward_ragged(kv, seqs, [torch.tensor(s) for s in steps], [len(s) for s in steps])
    return [torch.cat(pair) for pair in zip(first, then, strict=True)]


FEEDS, STEPS = [[1, 5, 9, 2, 7], [3, 3, 8]], [[4, 6], [11]]


def in_pieces(model: LlamaModel, ids: list[int], cuts: tuple[int, ...] = (13, 22)) -> torch.Tensor:
    """The logits [len(ids), V] of one sequence fed in pieces: ids up to cuts[0] as a prefill,
    each further cut as a chunk over what came before, then the rest one step at a time."""
    kv = model.new_kv(32, 4)
    seq = kv.new_sequence()
    bounds = [0, *cuts]
    pieces = [ids[a:b] for a, b in itertools.pairwise(bounds)] + [[t] for t in ids[cuts[-1] :]]
    return torch.cat(
        [model.forward_ragged(kv, [seq], [torch.tensor(p)], [len(p)])[0] for p in pieces]
    )


def test_the_config_reads_qwen3s_switches(qwen3):
    _, folder = qwen3
    config = LlamaConfig.read(folder)
    assert config.qk_norm and not config.qkv_bias
    assert (config.head_dim, config.num_heads, config.hidden_size) == (16, 4, 32)


def test_logits_match_transformers_on_a_ragged_batch(qwen3):
    hf, folder = qwen3
    model = LlamaModel.from_folder(folder)
    for feed, step, out in zip(FEEDS, STEPS, logits(model, FEEDS, STEPS), strict=True):
        torch.testing.assert_close(out, reference(hf, feed + step), rtol=1e-4, atol=1e-4)


def test_without_the_head_norms_the_logits_differ(qwen3):
    """The norms matter on these weights: the same model with them dropped misses by far."""
    hf, folder = qwen3
    model = LlamaModel.from_folder(folder)
    for layer in model.layers:
        layer.q_norm = layer.k_norm = None
    out = logits(model, FEEDS, STEPS)[0]
    assert (out - reference(hf, FEEDS[0] + STEPS[0])).abs().max() > 0.1


def test_a_gguf_file_loads_the_same_model(qwen3, tmp_path):
    hf, _ = qwen3
    write_gguf(tmp_path / "qwen3.gguf", hf, arch="qwen3", extra=lambda w: w.add_key_length(16))
    model = LlamaModel.from_gguf(tmp_path / "qwen3.gguf")
    assert model.config.qk_norm and model.config.head_dim == 16
    for feed, step, out in zip(FEEDS, STEPS, logits(model, FEEDS, STEPS), strict=True):
        torch.testing.assert_close(out, reference(hf, feed + step), rtol=1e-4, atol=1e-4)


def assert_close_in_kl(model: LlamaModel, hf, bound: float = 0.02) -> None:
    """Each sequence's logits over FEEDS then STEPS within `bound` nats (KL, per position) of
    transformers' on the same weights."""
    for feed, step, out in zip(FEEDS, STEPS, logits(model, FEEDS, STEPS), strict=True):
        want = reference(hf, feed + step)
        kl = torch.nn.functional.kl_div(
            out.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean"
        )
        assert kl < bound


def test_int8_on_the_kernel_is_close_to_float32(qwen3):
    """int8 (position 0 computed apart, its k normed too) against the float model."""
    hf, folder = qwen3
    assert_close_in_kl(LlamaModel.from_folder(folder, dtype="int8"), hf)


def test_a_sliding_window_config_is_refused_naming_it():
    cfg = {
        "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
        "use_sliding_window": True,
    }  # fmt: skip
    with pytest.raises(ValueError, match="use_sliding_window"):
        LlamaConfig.from_hf(cfg)
