"""`smcspec bench fidelity`: what a lower precision costs, in nats.

For each model of the pair: a float32 reference writes a greedy continuation of each prompt;
then every position of prompt + continuation is scored by the reference and by the model at the
lower precision, and KL(p_fp32 || p_low) of the next-token distributions (temperature 1) is
summarized over positions, with the arg-max agreement. Both run on the native engine.
"""

from __future__ import annotations

import gc
import statistics
from pathlib import Path

import torch

from smcspec.bench import machine
from smcspec.engine import CausalLM, fresh_logits, loading

README_PROMPTS = (
    "Write a Python function that checks if a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash map is in two sentences.",
)


def _load(spec: str, dtype: str) -> CausalLM:
    """The model of `spec` on the native engine, eager, on the CPU."""
    return loading.load_native(spec, dtype)[0]


def _greedy(model: CausalLM, ids: list[int], n: int) -> list[int]:
    """ids followed by n arg-max tokens."""
    cache, out = model.new_cache(), list(ids)
    try:
        logits = model.forward(torch.tensor([ids]), cache, 1)  # [1, 1, V]
        for _ in range(n):
            out.append(int(logits[0, -1].argmax()))
            logits = model.forward(torch.tensor([out[-1:]]), cache, 1)
    finally:
        cache.release()
    return out


def measure(spec: str, prompts: list[list[int]], dtype: str, new_tokens: int) -> dict:
    reference = _load(spec, "float32")
    texts = [_greedy(reference, ids, new_tokens) for ids in prompts]
    ref_logp = [torch.log_softmax(fresh_logits(reference, ids, len(ids)), -1) for ids in texts]
    del reference
    gc.collect()
    low = _load(spec, dtype)
    kls, agree = [], 0
    for ids, lp in zip(texts, ref_logp, strict=True):
        lq = torch.log_softmax(fresh_logits(low, ids, len(ids)), -1)
        kls += (lp.exp() * (lp - lq)).sum(-1).clamp_min(0).tolist()
        agree += int((lp.argmax(-1) == lq.argmax(-1)).sum())
    return {
        "positions": len(kls),
        "mean_kl": statistics.mean(kls),
        "median_kl": statistics.median(kls),
        "max_kl": max(kls),
        "argmax_agreement": agree / len(kls),
    }


def _prompt(tokenizer, text: str) -> list[int]:
    """`text` as a user's chat message, or as it is for a model without a chat template (a
    pretrained one: Gemma 3 270M)."""
    if tokenizer.chat_template is None:
        return tokenizer.encode(text)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(chat, add_special_tokens=False)


def run_fidelity(
    specs: dict[str, str], tokenizer, dtype: str, new_tokens: int, out_dir: str | Path
) -> str:
    """specs: role -> local folder or .gguf. Writes fidelity.md; returns its text."""
    prompts = [_prompt(tokenizer, text) for text in README_PROMPTS]
    chats = tokenizer.chat_template is not None
    rows = {role: measure(spec, prompts, dtype, new_tokens) for role, spec in specs.items()}
    lines = [
        f"Fidelity of {dtype} against float32 (native engine): "
        f"{machine.one_line(machine.describe(dtype))}; the README's {len(prompts)} prompts "
        f"{'as chat messages' if chats else 'as plain text (the model has no chat template)'}, "
        f"each with a {new_tokens}-token greedy float32 continuation; every "
        "position scored; KL(p_fp32 || p_low) of next-token distributions at temperature 1.",
        "",
        "| model | positions | mean KL (nats) | median | max | arg-max agreement |",
        "|---|---|---|---|---|---|",
    ]
    for role, r in rows.items():
        lines.append(
            f"| {role} | {r['positions']} | {r['mean_kl']:.4f} | {r['median_kl']:.4f} | "
            f"{r['max_kl']:.3f} | {100 * r['argmax_agreement']:.1f}% |"
        )
    text = "\n".join(lines) + "\n"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.md").write_text(text)
    return text
