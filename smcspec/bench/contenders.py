"""Everything a benchmark can run, behind one call: our three methods over their grids and the
Hugging Face peers a user would pick instead (`generate`, and `generate` with `assistant_model`).

Grids are validated before any model is loaded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from smcspec.config import SDConfig, SMCConfig, method_configs
from smcspec.potentials import Power

METHOD_NAMES = ("ar", "sd", "smc", "hf", "hf-assisted")


@dataclass(frozen=True)
class Contender:
    """One method at one setting. `label` names it in tables."""

    method: str
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.method == "sd":
            return f"sd K={self.settings['draft_tokens']}"
        if self.method == "smc":
            label = f"smc N={self.settings['particles']} K={self.settings['draft_tokens']}"
            if "power_alpha" in self.settings:
                label += f" power={self.settings['power_alpha']:g}"
            return label
        return self.method


def parse_ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError as err:
        raise ValueError(
            f"{name} must be a comma-separated list of integers, got {text!r}"
        ) from err
    if not values:
        raise ValueError(f"{name} is empty")
    return values


def build_grid(
    methods: list[str],
    sd_k: list[int],
    smc_n: list[int],
    smc_k: list[int],
    resample_threshold: float = SMCConfig.resample_threshold,
    smc_power: list[float] | None = None,
) -> list[Contender]:
    """Expand method names over the grids; raise ValueError on an unknown name or bad setting.
    Each smc (N, K) also runs with Power(alpha) for every alpha in `smc_power`."""
    if not methods:
        raise ValueError("no methods given")
    unknown = [m for m in methods if m not in METHOD_NAMES]
    if unknown:
        raise ValueError(
            f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHOD_NAMES)}"
        )
    out: list[Contender] = []
    for method in dict.fromkeys(methods):
        if method == "sd":
            for k in sd_k:
                SDConfig(k)
                out.append(Contender("sd", {"draft_tokens": k}))
        elif method == "smc":
            for n in smc_n:
                for k in smc_k:
                    method_configs(n, k, resample_threshold)  # bounds N as generate does
                    base = {
                        "particles": n,
                        "draft_tokens": k,
                        "resample_threshold": resample_threshold,
                    }
                    out.append(Contender("smc", base))
                    for alpha in smc_power or []:
                        Power(alpha)
                        out.append(Contender("smc", {**base, "power_alpha": alpha}))
        else:
            out.append(Contender(method))
    return out


def run(
    llm,
    contender: Contender,
    prompt_ids: list[int],
    temperature: float,
    max_new: int,
    stop_at_eos: bool,
    seed: int,
) -> dict[str, Any]:
    """Generate once; return new token ids, seconds, tokens/s and the method's diagnostics."""
    if contender.method in ("ar", "sd", "smc"):
        out = llm.generate(
            prompt_ids,
            contender.method,
            temperature=temperature,
            max_new_tokens=max_new,
            stop_at_eos=stop_at_eos,
            seed=seed,
            chat=False,
            **contender.settings,
        )
        d = dict(out.diagnostics)
        d.pop("weights", None)
        return {"token_ids": out.token_ids, "text": out.text, **d}
    return _run_hf(llm, contender, prompt_ids, temperature, max_new, stop_at_eos, seed)


def _run_hf(llm, contender, prompt_ids, temperature, max_new, stop_at_eos, seed) -> dict[str, Any]:
    target = getattr(llm.target, "model", None)
    if target is None:
        raise ValueError(f"{contender.method} needs transformers models (the hf backend)")
    kwargs: dict[str, Any] = {
        "max_new_tokens": max_new,
        "do_sample": temperature > 0,
        "top_k": 0,
        "top_p": 1.0,
        "pad_token_id": next(iter(llm.target.eos_token_ids)),
    }
    if temperature > 0:
        kwargs["temperature"] = temperature
    if not stop_at_eos:
        kwargs["min_new_tokens"] = max_new
    if contender.method == "hf-assisted":
        # As a user gets it: the assistant's own generation config decides the draft (by
        # default up to 20 greedy tokens, stopping early below confidence 0.4); arguments to
        # generate() such as num_assistant_tokens do not reach it.
        kwargs["assistant_model"] = llm.draft.model
    ids = torch.tensor([prompt_ids], device=llm.target.device)
    torch.manual_seed(seed)  # HF samples from the global generator
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    seconds = time.perf_counter() - start
    new = out[0, ids.shape[1] :].tolist()
    return {
        "token_ids": new,
        "text": llm.decode_text(new),
        "seconds": seconds,
        "new_tokens": len(new),
        "tokens_per_second": len(new) / seconds,
        "seed": seed,
    }
