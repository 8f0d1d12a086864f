"""A byte-level LLM for exact text tests: a real Hugging Face byte-level BPE with no merges (one
token per byte, so every character beyond ASCII arrives over several tokens, as rare ones do in
Qwen's and GPT-2's vocabularies) and toy models that spell out a script byte by byte."""

from __future__ import annotations

import torch

from smcspec import LLM
from smcspec.models.toy import ToyLM

EOS = 256  # ids 0-255 are the bytes themselves
PROMPT = [ord("a")]


def gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (`bytes_to_unicode`), the byte-level BPE vocab."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def byte_level_tokenizer():
    """Decodes as every byte-level BPE does: the bytes joined, then each invalid or unfinished
    UTF-8 sequence replaced by U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: b for b, c in gpt2_byte_alphabet().items()} | {"<eos>": EOS}
    core = Tokenizer(models.BPE(vocab, []))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")


def script_lm(script: bytes) -> ToyLM:
    """After `PROMPT`, the bytes of `script` one token each, then EOS: logit 0 on the next one
    and -30 on the rest, so a step strays with probability under 256 e^-30 = 2.4e-11."""

    def logits_fn(prefix: tuple[int, ...]) -> torch.Tensor:
        at = len(prefix) - len(PROMPT)
        logits = torch.full((EOS + 1,), -30.0)
        logits[script[at] if at < len(script) else EOS] = 0.0
        return logits

    return ToyLM(logits_fn, EOS + 1, {EOS})


def script_llm(script: bytes) -> LLM:
    """Target and draft both spell `script`: sd accepts every draft and smc's particles agree,
    so every method outputs the script and stops only on a stop string or EOS."""
    return LLM.from_models(script_lm(script), script_lm(script), byte_level_tokenizer())
