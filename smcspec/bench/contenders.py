"""Everything a benchmark can run, behind one call: our methods over their grids (auto as
itself, exact, and as "auto-approx", auto with `approximate`, which may pick smc) and the
peers a user would pick instead: Hugging Face's `generate` (with and without `assistant_model`)
and llama.cpp (autoregressive, and speculative with the draft; `bench/llamacpp.py`).

Grids are validated before any model is loaded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from smcspec.config import SamplingConfig, SDConfig, SMCConfig
from smcspec.engine import configs_from_fields
from smcspec.potentials import Power

METHOD_NAMES = (
    "ar",
    "sd",
    "sd-block",
    "sd-lookup",
    "sd-lookup-draft",
    "smc",
    "msd",
    "msd-block",
    "msd-lookup-draft",
    "auto",
    "auto-approx",
    "hf",
    "hf-assisted",
    "llama-cpp",
    "llama-cpp-spec",
)
LLAMA_CPP = ("llama-cpp", "llama-cpp-spec")
# sd's variants: the settings each adds to sd's K
SD_VARIANTS = {
    "sd-block": {"verify": "block"},
    "sd-lookup": {"proposal": "lookup"},
    "sd-lookup-draft": {"proposal": "lookup+draft"},
}
# msd's variants: the settings each adds to msd's N and K
MSD_VARIANTS = {
    "msd-block": {"verify": "block"},
    "msd-lookup-draft": {"proposal": "lookup+draft"},
}
# ours: run by `LLM.generate` under the method name it knows (sd's variants as sd, msd's as msd)
OURS = {
    "ar": "ar",
    "sd": "sd",
    **dict.fromkeys(SD_VARIANTS, "sd"),
    "smc": "smc",
    "msd": "msd",
    **dict.fromkeys(MSD_VARIANTS, "msd"),
    "auto": "auto",
    "auto-approx": "auto",
}
# the methods that draft, and so run at every draft temperature asked for
DRAFTING = (
    "sd",
    "sd-block",
    "sd-lookup-draft",
    "smc",
    "msd",
    *MSD_VARIANTS,
    "auto",
    "auto-approx",
)


@dataclass(frozen=True)
class Contender:
    """One method at one setting. `label` names it in tables."""

    method: str
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        s = self.settings
        if self.method == "sd":
            label = f"sd K={s['draft_tokens']}"
        elif self.method in SD_VARIANTS:
            label = f"sd K={s['draft_tokens']} " + " ".join(
                s[key] for key in ("verify", "proposal") if key in s
            )
        elif self.method == "smc":
            label = f"smc N={s['particles']} K={s['draft_tokens']}"
            threshold = s.get("resample_threshold", SMCConfig.resample_threshold)
            if threshold != SMCConfig.resample_threshold:
                label += f" ESS<{threshold:g}N"
            if "power_alpha" in s:
                label += f" power={s['power_alpha']:g}"
        elif self.method in ("msd", *MSD_VARIANTS):
            label = f"msd N={s['particles']} K={s['draft_tokens']}"
            label += "".join(f" {s[key]}" for key in ("verify", "proposal") if key in s)
        elif self.method == "auto-approx":
            label = "auto approx"
        elif self.method == "llama-cpp":
            label = f"llama-cpp {s['quant']}"
        elif self.method == "llama-cpp-spec":
            label = f"llama-cpp-spec {s['quant']} K={s['draft_tokens']}"
        else:
            label = self.method
        if s.get("draft_temperature") is not None:
            label += f" draft T={s['draft_temperature']:g}"
        return label


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
    quants: list[str] | None = None,
    draft_temperatures: list[float | None] | None = None,
    msd_n: list[int] | None = None,
    msd_k: list[int] | None = None,
) -> list[Contender]:
    """Expand method names over the grids; raise ValueError on an unknown name or bad setting.
    Each smc (N, K) also runs with Power(alpha) for every alpha in `smc_power`; llama.cpp runs
    at every quant in `quants`, its speculative decoding at every sd K; msd runs at every
    (N, K) of `msd_n` x `msd_k` (K: sd's grid when not given); the drafting methods (sd, smc,
    msd, auto) run with the draft at every temperature in `draft_temperatures` (None: the
    target's)."""
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
        elif method in SD_VARIANTS:  # block verification or prompt lookup, at sd's K
            for k in sd_k:
                settings = {"draft_tokens": k, **SD_VARIANTS[method]}
                configs_from_fields({"method": "sd", **settings})
                out.append(Contender(method, settings))
        elif method == "smc":
            out += _smc_grid(smc_n, smc_k, resample_threshold, smc_power or [])
        elif method in ("msd", *MSD_VARIANTS):  # a variant: msd with its settings
            out += _msd_grid(method, msd_n or [2, 4], msd_k or sd_k)
        elif method == "auto-approx":
            out.append(Contender(method, {"approximate": True}))
        elif method == "llama-cpp":
            out += [Contender(method, {"quant": q}) for q in _quants(quants)]
        elif method == "llama-cpp-spec":
            for q in _quants(quants):
                for k in sd_k:
                    SDConfig(k)
                    out.append(Contender(method, {"quant": q, "draft_tokens": k}))
        else:
            out.append(Contender(method))
    return _with_draft_temperatures(out, draft_temperatures or [None])


def _smc_grid(smc_n, smc_k, resample_threshold, smc_power) -> list[Contender]:
    out = []
    for n in smc_n:
        for k in smc_k:
            base = {"particles": n, "draft_tokens": k, "resample_threshold": resample_threshold}
            configs_from_fields({"method": "smc", **base})  # checks and bounds N as generate does
            out.append(Contender("smc", base))
            for alpha in smc_power:
                Power(alpha)
                out.append(Contender("smc", {**base, "power_alpha": alpha}))
    return out


def _msd_grid(method: str, msd_n: list[int], msd_k: list[int]) -> list[Contender]:
    rule = MSD_VARIANTS.get(method, {})
    out = []
    for n in msd_n:
        for k in msd_k:
            settings = {"particles": n, "draft_tokens": k, **rule}
            configs_from_fields({"method": "msd", **settings})
            out.append(Contender(method, settings))
    return out


def _quants(quants: list[str] | None) -> list[str]:
    if not quants:
        raise ValueError("llama.cpp contenders need at least one quant, e.g. Q4_K_M,Q8_0")
    bad = [q for q in quants if not q.replace("_", "").isalnum()]
    if bad:
        raise ValueError(f"not a llama.cpp quant name: {', '.join(bad)} (e.g. Q4_K_M, Q8_0)")
    return quants


def _with_draft_temperatures(grid, temps: list[float | None]) -> list[Contender]:
    for t in temps:
        if t is not None:
            SamplingConfig(draft_temperature=t)  # the same check as generate's
    out = []
    for c in grid:
        if c.method in DRAFTING:
            for t in temps:
                extra = {} if t is None else {"draft_temperature": t}
                out.append(Contender(c.method, {**c.settings, **extra}))
        else:
            out.append(c)
    return out


def run(
    llm,
    contender: Contender,
    prompt_ids: list[int],
    temperature: float,
    max_new: int,
    stop_at_eos: bool,
    seed: int,
    llama_cpp=None,
) -> dict[str, Any]:
    """Generate once; return new token ids, seconds, tokens/s and the method's diagnostics.
    llama.cpp contenders run on `llama_cpp` (a `bench.llamacpp.LlamaCpp`)."""
    if contender.method in LLAMA_CPP:
        if llama_cpp is None or stop_at_eos:
            raise ValueError(f"{contender.method} runs in bench speed, at a fixed length")
        return llama_cpp.run(
            contender.method, contender.settings, prompt_ids, temperature, max_new, seed
        )
    if contender.method in OURS:
        kwargs = _kwargs(contender, temperature, max_new, stop_at_eos, seed)
        return _ours(llm.generate(prompt_ids, OURS[contender.method], **kwargs))
    return _run_hf(llm, contender, prompt_ids, temperature, max_new, stop_at_eos, seed)


def run_batch(
    llm,
    contender: Contender,
    prompts: list[list[int]],
    temperature: float,
    max_new: int,
    stop_at_eos: bool,
    seed: int,
) -> list[dict[str, Any]]:
    """`run` for several prompts at once, sharing batched passes (`LLM.generate_batch`: each
    decodes as it would alone), prompt i with seed + i; its seconds and tokens/s are under
    that load. Our methods only."""
    if contender.method not in OURS:
        raise ValueError(f"{contender.method} runs one prompt at a time")
    kwargs = _kwargs(contender, temperature, max_new, stop_at_eos, seed)
    return [_ours(o) for o in llm.generate_batch(prompts, OURS[contender.method], **kwargs)]


def _kwargs(contender, temperature, max_new, stop_at_eos, seed) -> dict[str, Any]:
    """`LLM.generate`'s settings for one of our contenders (prompts already tokenized)."""
    return {
        "temperature": temperature,
        "max_new_tokens": max_new,
        "stop_at_eos": stop_at_eos,
        "seed": seed,
        "chat": False,
        **contender.settings,
    }


def _ours(out) -> dict[str, Any]:
    d = dict(out.diagnostics)
    d.pop("weights", None)
    if "settings" in d:  # auto's choices, kept apart from the contender's own settings
        d["chosen"] = d.pop("settings")
    return {"token_ids": out.token_ids, "text": out.text, **d}


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
