import pytest
import torch

from smcspec.config import SamplingConfig, SDConfig, SMCConfig
from smcspec.decoding import AutoregressiveDecoder, SMCDecoder, SpeculativeDecoder
from smcspec.models import hf


def full_logits(model: hf.HFCausalLM, seqs: torch.Tensor) -> torch.Tensor:
    """Reference: next-token logits at the last position, recomputed from scratch.  [B, V]"""
    return model.forward(seqs, model.new_cache(), 1)[:, -1]


def test_cached_forward_matches_recomputation_after_select_and_crop(tiny_folder):
    model, _ = hf.load(str(tiny_folder))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 64, (1, 5), generator=g)
    cache = model.new_cache()
    model.forward(prompt, cache, 1)
    cache.select(torch.tensor([0, 0, 0]))  # fork into three particles
    seqs = prompt.expand(3, -1)
    for _ in range(3):
        new = torch.randint(3, 64, (3, 2), generator=g)
        model.forward(new, cache, 1)
        seqs = torch.cat([seqs, new], dim=1)
        rows = torch.tensor([2, 0, 2])  # resampling: duplicate row 2, drop row 1
        cache.select(rows)
        seqs = seqs[rows]
        cache.crop(seqs.shape[1] - 1)  # speculative rollback of one token
        step = seqs[:, -1:]
        got = model.forward(step, cache, 1)[:, -1]
        torch.testing.assert_close(got, full_logits(model, seqs), rtol=1e-4, atol=1e-4)
        assert cache.length == seqs.shape[1]


def test_decoders_run_on_a_transformers_model(tiny_folder, tiny_draft_folder):
    target, _ = hf.load(str(tiny_folder))
    draft, _ = hf.load(str(tiny_draft_folder))
    assert target.vocab_size == 64 and target.eos_token_ids == frozenset({1})
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=7, stop_at_eos=False)
    prompt = [4, 5, 6]
    for dec in (
        AutoregressiveDecoder(target),
        SpeculativeDecoder(target, draft, SDConfig(3)),
        SMCDecoder(target, draft, SMCConfig(4, 2)),
    ):
        out = dec.decode(prompt, cfg, torch.Generator().manual_seed(0))
        assert len(out.tokens) == 7 and all(0 <= t < 64 for t in out.tokens)


def test_greedy_sd_and_smc_with_identical_draft_match_ar(tiny_folder):
    target, _ = hf.load(str(tiny_folder))
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=9, stop_at_eos=False)
    prompt = [5, 6, 7]
    g = torch.Generator().manual_seed(0)
    ar = AutoregressiveDecoder(target).decode(prompt, cfg, g).tokens
    assert SpeculativeDecoder(target, target, SDConfig(4)).decode(prompt, cfg, g).tokens == ar
    assert SMCDecoder(target, target, SMCConfig(3, 2)).decode(prompt, cfg, g).tokens == ar


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("/no/such/model.gguf", "does not exist"),
        ("./missing-folder", "does not exist"),
        ("", "give a hub id"),
    ],
)
def test_bad_model_specs_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        hf.load(spec)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"0")
    with pytest.raises(ValueError, match=r"must be \.gguf"):
        hf.load(str(bad))


def test_unreachable_hub_id_is_a_value_error(monkeypatch):
    # No network here or in CI; offline mode makes the hub refuse at once instead of retrying.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="cannot load model"):
        hf.load("no-such-org/no-such-model-xyz")


def test_native_backend_matches_hf_on_a_tiny_model(tiny_folder, tiny_draft_folder):
    from smcspec import LLM

    hf_llm = LLM(str(tiny_folder), str(tiny_draft_folder), backend="hf", dtype="float32")
    native = LLM(str(tiny_folder), str(tiny_draft_folder), backend="native", dtype="float32")
    assert (native.backend, native.dtype) == ("native", "float32")
    prompt = torch.tensor([[4, 5, 6, 7]])
    a = hf_llm.target.forward(prompt, hf_llm.target.new_cache(), 4)
    b = native.target.forward(prompt, native.target.new_cache(), 4)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert native.target.eos_token_ids == hf_llm.target.eos_token_ids
    out = native.generate(
        [4, 5, 6], "smc", particles=3, draft_tokens=2, max_new_tokens=6, seed=0, stop_at_eos=False
    )
    assert len(out.token_ids) == 6


def test_int8_in_both_backends_stays_close_to_float32(tiny_folder, tiny_draft_folder):
    """The same int8 kernels behind both backends (the native engine also computes position 0
    apart, see test_llama), both within a small KL of float32."""
    from smcspec import LLM

    hf_llm = LLM(str(tiny_folder), str(tiny_draft_folder), backend="hf", dtype="int8")
    native = LLM(str(tiny_folder), str(tiny_draft_folder))  # auto on a CPU: native, int8
    assert (native.backend, native.dtype) == ("native", "int8")
    fp32 = LLM(str(tiny_folder), str(tiny_draft_folder), dtype="float32")
    prompt = torch.tensor([[4, 5, 6, 7, 8, 9]])
    c = fp32.target.forward(prompt, fp32.target.new_cache(), 6).log_softmax(-1)
    for llm in (hf_llm, native):
        b = llm.target.forward(prompt, llm.target.new_cache(), 6).log_softmax(-1)
        kl = (c.exp() * (c - b)).sum(-1)
        assert 0 < kl.max() < 1e-3


def test_auto_backend_takes_native_only_where_it_applies(tiny_folder, tmp_path):
    from smcspec.models.loader import choose_backend

    assert choose_backend(str(tiny_folder), "auto", "cpu", "int8") == "native"
    assert choose_backend(str(tiny_folder), "auto", "cuda", "bfloat16") == "native"
    assert choose_backend(str(tiny_folder), "auto", "cuda", "float16") == "hf"
    assert choose_backend(str(tiny_folder), "hf", "cpu", "int8") == "hf"
    assert choose_backend("Qwen/Qwen2.5-0.5B", "auto", "cpu", "int8") == "hf"
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    assert choose_backend(str(tmp_path), "auto", "cpu", "int8") == "hf"
    with pytest.raises(ValueError, match="supports llama"):
        from smcspec.models.loader import load_native

        load_native(str(tmp_path), "float32", "cpu")


def test_native_backend_refuses_what_it_cannot_load(tmp_path):
    from smcspec import LLM

    with pytest.raises(ValueError, match="backend must be"):
        LLM(str(tmp_path), str(tmp_path), backend="vllm")
    with pytest.raises(ValueError, match=r"config\.json"):
        LLM(str(tmp_path), str(tmp_path), backend="native")


@pytest.mark.parametrize("num_logits", [1, 3, 7])
def test_a_long_feed_runs_in_chunks_with_one_pass_logits(tiny_folder, monkeypatch, num_logits):
    """A feed longer than PREFILL_CHUNK goes through transformers in passes of at most that many
    tokens, and gives the logits of one pass (its last num_logits rows, across chunk borders)
    and the same cache: the next step's logits agree too."""
    model, _ = hf.load(str(tiny_folder))
    g = torch.Generator().manual_seed(1)
    feed = torch.randint(3, 64, (2, 11), generator=g)
    step = torch.randint(3, 64, (2, 1), generator=g)
    # the reference: transformers itself, without a cache, over the feed and over feed + step
    expected = model.model(input_ids=feed).logits[:, -num_logits:].float()
    expected_next = model.model(input_ids=torch.cat([feed, step], 1)).logits[:, -1:].float()
    sizes = []
    forward = model.model.forward
    monkeypatch.setattr(hf, "PREFILL_CHUNK", 4)
    monkeypatch.setattr(
        model.model, "forward", lambda **kw: sizes.append(kw["input_ids"].shape[1]) or forward(**kw)
    )
    chunked = model.new_cache()
    got = model.forward(feed, chunked, num_logits)
    assert sizes == [4, 4, 3] and chunked.length == 11
    assert got.shape == (2, num_logits, model.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.forward(step, chunked, 1), expected_next, rtol=1e-5, atol=1e-5)
