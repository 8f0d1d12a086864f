"""The model pairs of `smcspec bench gpu`: their published configs, the plan that sizes a run,
and both models of a pair with random weights (native, and transformers' on the same values).

Speed per forward pass does not depend on the weights' values, so the pairs are built from the
published config.json files (`configs/`) with random weights made on the device: no download,
and the same script runs on any machine.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from smcspec.config import SamplingConfig
from smcspec.engine.llm import LLM
from smcspec.models.graphs import eager_capture
from smcspec.models.llama import LlamaConfig, LlamaModel, random_weights
from smcspec.models.native import NativeCausalLM

CONFIGS = Path(__file__).parent / "configs"
PAIRS = {
    "qwen2.5-coder-1.5b+0.5b": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
    "qwen2.5-7b+coder-0.5b": ("qwen2.5-7b-instruct", "qwen2.5-coder-0.5b-instruct"),
}
ROLES = ("target", "draft")  # in the order of each PAIRS entry
# The smoke plan's shapes: every config shrunk to these (head_dim 16, GQA group 2).
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}
# Per-token acceptance alpha: accepted drafts / drafts checked (up to and including the first
# rejection), as `SpeculativeDecoder` reports it in `acceptance_rate`.
SD_ACCEPTANCE = 0.95
SD_ACCEPTANCE_PAIR = "qwen2.5-coder-1.5b+0.5b"
SD_ACCEPTANCE_SOURCE = (
    "sd K=4 on the real Qwen2.5-Coder 1.5B/0.5B pair, T=0.7, 3 HumanEval prompts x 128 tokens, "
    "native int8 engine on 2 AMD EPYC cores (docs/benchmarks.md 'Speed on this machine', "
    "benchmarks/cpu/engine-int8)"
)
# q_proj and k_proj (weights and biases) are this much larger than `random_weights` makes them:
# attention scores q.k grow by its square (see `pair_weights`).
QK_SCALE = 8.0
Method = tuple[str, int, int]  # (method, N, K)


@dataclass(frozen=True)
class GpuPlan:
    pairs: tuple[str, ...] = tuple(PAIRS)
    device: str = "cuda"
    dtype: str = "bfloat16"  # the bench's
    qk_scale: float = QK_SCALE  # the bench's (speed does not depend on it)
    # The correctness checks'. Peaked attention turns rounding into flips between near-tied
    # keys that grow layer by layer: native vs transformers, 0.5B shape, float32 on the CPU,
    # 32 tokens: at 8x, 2e-5 nats after 2 layers, 1.5e-3 after 8, 3.7e-2 after 24; at 2x,
    # 7e-6 after 8 and 24 layers. bf16 at 8x: 3 nats (the pre-flight review). So float32 at
    # 2x, where a tolerance of 1e-3 leaves 100x margin and still sees an attention bug.
    check_dtype: str = "float32"
    check_qk_scale: float = 2.0
    attention: str = "auto"
    tiny: bool = False  # shrink every config to TINY
    context: int = 512
    verify: tuple[tuple[int, int], ...] = ((1, 4), (2, 4), (4, 4), (4, 9), (8, 9), (16, 9))
    draft_batches: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    long_contexts: tuple[int, ...] = (2048, 4096)  # a step and an 8x9 verify at each (graphs)
    methods: tuple[Method, ...] = (
        ("ar", 1, 0),
        ("sd", 1, 4),
        ("smc", 2, 4),
        ("smc", 4, 4),
        ("smc", 8, 4),
        ("smc", 8, 8),
    )
    prompt_tokens: int = 128
    new_tokens: int = 128
    resample_particles: int = 8
    resample_tokens: int = 256
    temperature: float = SamplingConfig.temperature
    reps: int = 10
    check_tokens: int = 64
    bandwidth_bytes: int = 1 << 31  # read by `x.sum()`: well past the 60 MB L2
    # The paged-attention kernel alone: (sequences, query tokens each, keys each) on
    # kernel_heads (query heads, kv heads, head_dim: Qwen2.5-7B's).
    kernel_cases: tuple[tuple[int, int, int], ...] = (
        (1, 1, 512),
        (1, 1, 4096),
        (8, 9, 512),
        (8, 9, 2048),
    )
    kernel_heads: tuple[int, int, int] = (28, 4, 128)
    sample_shape: tuple[int, int] = (8, 152064)  # `sampling.sample` on [N, Qwen2.5-7B's vocab]
    prefill_prompts: tuple[int, ...] = (511, 4096)  # the SDPA backend of each prefill
    long_prompt: int = 32000  # one prefill: peak memory
    sync_tokens: int = 64  # host syncs per round: runs of sync_tokens / 2 and sync_tokens
    num_pages: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in self.pairs:
            if name not in PAIRS:
                raise ValueError(f"pairs: unknown pair {name!r} (known: {', '.join(PAIRS)})")
        for name in ("dtype", "check_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(f"{name} must be float32 or bfloat16, got {getattr(self, name)!r}")
        for name in ("context", "prompt_tokens", "new_tokens", "reps", "check_tokens"):
            if getattr(self, name) < (2 if name in ("context", "check_tokens") else 1):
                raise ValueError(f"{name} is too small: {getattr(self, name)}")
        for name in ("qk_scale", "check_qk_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.sync_tokens < 4:
            raise ValueError(f"sync_tokens is too small: {self.sync_tokens}")
        for method, n, k in self.methods:
            if method not in ("ar", "sd", "smc") or n < 1 or (method != "ar" and k < 1):
                raise ValueError(f"methods: bad entry {(method, n, k)}")

    @classmethod
    def smoke(cls) -> GpuPlan:
        """Tiny float32 models on the CPU, graphs through `eager_capture`: seconds."""
        return cls(
            device="cpu",
            dtype="float32",
            check_qk_scale=QK_SCALE,  # 2 layers: 8x stays within 1e-4
            attention="reference",
            tiny=True,
            context=32,
            verify=((1, 4), (2, 4), (2, 9)),
            draft_batches=(1, 2, 4),
            long_contexts=(48,),
            methods=(("ar", 1, 0), ("sd", 1, 4), ("smc", 2, 4), ("smc", 8, 8)),
            prompt_tokens=16,
            new_tokens=8,
            resample_tokens=16,
            reps=1,
            check_tokens=12,
            bandwidth_bytes=1 << 24,
            kernel_cases=((1, 1, 32), (8, 9, 32)),
            kernel_heads=(4, 2, 16),
            sample_shape=(8, 512),
            prefill_prompts=(20,),
            long_prompt=64,
            sync_tokens=12,
            num_pages=512,
        )


@dataclass(frozen=True)
class Deadline:
    """The run's time budget as a point on the monotonic clock (inf: none)."""

    at: float

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        return cls(time.monotonic() + (math.inf if seconds is None else seconds))

    def passed(self) -> bool:
        return time.monotonic() > self.at


@dataclass
class Pair:
    name: str
    configs: dict[str, dict]  # role -> Hugging Face config dict (as built)
    target: LlamaModel
    draft: LlamaModel
    seeds: dict[str, int]  # role -> seed of its random weights
    qk_scale: float = QK_SCALE  # of `pair_weights`


def load_config(name: str, tiny: bool = False) -> dict:
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    if tiny:
        cfg.update(TINY)
        for key in ("layer_types", "bos_token_id", "eos_token_id", "pad_token_id"):
            cfg.pop(key, None)  # one entry per layer, and ids outside the tiny vocabulary
    return cfg


def pair_weights(
    config: LlamaConfig, device: str | torch.device, seed: int, qk_scale: float = QK_SCALE
) -> dict:
    """`random_weights` with q_proj and k_proj (weights and biases) scaled by qk_scale: the
    state dict both the native and the transformers model of a pair load.

    N(0, 0.02) weights give attention scores so small that attention is near uniform, and an
    average over keys hides an attention bug (a key missed, a wrong position, a stale page):
    the model-level comparison in `gpu.checks` would barely see it. Scaling q and k by 8
    multiplies the scores by 64 (their variance by 4096), so each query attends to a few keys
    and such a bug moves the logits. Speed does not depend on the values, so the bench runs
    the same models."""
    weights = random_weights(config, device, seed)
    for name, tensor in weights.items():
        if ".q_proj." in name or ".k_proj." in name:
            tensor.mul_(qk_scale)  # a power of two: exact in bf16 too
    return weights


def build_pair(plan: GpuPlan, name: str) -> Pair:
    """Both models of pair `name` with `pair_weights`, on the plan's device. The draft's
    vocabulary is padded to the target's (Qwen2.5-7B pads to 152064 rows, the 0.5B to 151936;
    the engine needs one vocabulary, as vLLM does)."""
    configs = {role: load_config(n, plan.tiny) for role, n in zip(ROLES, PAIRS[name], strict=True)}
    configs["draft"]["vocab_size"] = configs["target"]["vocab_size"]
    seeds = {"target": plan.seed, "draft": plan.seed + 1}
    target, draft = (native_model(configs[role], plan, seeds[role]) for role in ROLES)
    return Pair(name, configs, target, draft, seeds, plan.qk_scale)


def native_model(cfg: dict, plan: GpuPlan, seed: int) -> LlamaModel:
    config = LlamaConfig.from_hf(cfg)
    weights = pair_weights(config, plan.device, seed, plan.qk_scale)
    return LlamaModel(config, weights, plan.dtype, plan.device, attention=plan.attention)


def wrap(model: LlamaModel, graphs: bool, plan: GpuPlan) -> NativeCausalLM:
    """The engine's view; off CUDA, graphs run through `eager_capture` (when attention is
    paged), which exercises the graph runner's logic everywhere but the CUDA call."""
    stand_in = model.device.type != "cuda" and model.attention.paged
    capture = eager_capture if graphs and stand_in else None
    return NativeCausalLM(model, set(), plan.num_pages, graphs=graphs, capture=capture)


def pair_llm(pair: Pair, graphs: bool, plan: GpuPlan) -> LLM:
    return LLM.from_models(wrap(pair.target, graphs, plan), wrap(pair.draft, graphs, plan))


def replays(llm: LLM) -> int:
    """CUDA-graph replays so far, both models together."""
    return sum(m.graphs.replays for m in (llm.target, llm.draft) if m.graphs is not None)


def hf_model(pair: Pair, role: str, plan: GpuPlan) -> Any:
    """transformers' Qwen2ForCausalLM with the same weights as `pair`'s `role` model (the same
    `pair_weights` seed gives the same state dict), parameters in the plan's dtype, buffers
    (RoPE) float32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = {k: v for k, v in pair.configs[role].items() if k not in ("torch_dtype", "dtype")}
    weights = pair_weights(LlamaConfig.from_hf(cfg), plan.device, pair.seeds[role], pair.qk_scale)
    with torch.device(plan.device):
        hf = Qwen2ForCausalLM(Qwen2Config(**cfg))
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    del weights
    cast_parameters(hf, torch_dtype(plan.dtype))
    return hf.eval()


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters only: `module.to(dtype)` would also round the RoPE frequencies."""
    for p in module.parameters():
        p.data = p.data.to(dtype)


def torch_dtype(dtype: str) -> torch.dtype:
    return torch.bfloat16 if dtype == "bfloat16" else torch.float32


def generate(llm: LLM, prompt: list[int], method: Method, plan: GpuPlan, new_tokens: int) -> Any:
    name, n, k = method
    return llm.generate(
        prompt,
        name,
        particles=n if name == "smc" else None,
        draft_tokens=k or None,
        temperature=plan.temperature,
        max_new_tokens=new_tokens,
        stop_at_eos=False,
        seed=plan.seed,
        chat=False,
    )


def label(method: Method) -> str:
    name, n, k = method
    return {"ar": "ar", "sd": f"sd K={k}"}.get(name, f"smc N={n} K={k}")
