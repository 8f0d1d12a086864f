"""Pick a backend and a precision for a model spec, and load (model, tokenizer).

Backends: `native` (Llama / Qwen2 / Mistral on the paged KV cache, CPU), `hf` (any
`transformers` causal LM), `auto` (native where it applies, hf otherwise). Precisions: float32,
bfloat16, float16 (hf only), int8 (CPU: int8 weights, float activations), auto (int8 on a CPU,
bfloat16 on CUDA).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from smcspec.models.base import CausalLM

BACKENDS = ("auto", "native", "hf")
DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    on_cpu = str(device).startswith("cpu")
    if dtype == "auto":
        return "int8" if on_cpu else "bfloat16"
    if dtype == "int8" and not on_cpu:
        raise ValueError("int8 weights run on the CPU only (fbgemm); use bfloat16 on CUDA")
    return dtype


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def architecture(spec: str) -> str | None:
    """The model_type of a local folder or .gguf file; None for a hub id or an unreadable file."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from smcspec.models import gguf_loader

        return gguf_loader.architecture(path)
    config = path / "config.json"
    if config.is_file():
        return json.loads(config.read_text()).get("model_type")
    return None


def choose_backend(spec: str, backend: str, device: str, dtype: str) -> str:
    """`auto` takes the native engine for a local Llama-family model on the CPU."""
    from smcspec.models.llama import SUPPORTED

    check_backend(backend)
    if backend != "auto":
        return backend
    native_ok = str(device).startswith("cpu") and dtype != "float16"
    return "native" if native_ok and architecture(spec) in SUPPORTED else "hf"


def load(spec: str, backend: str, dtype: str, device: str) -> tuple[CausalLM, Any]:
    """(model, tokenizer) for an already checked spec and a resolved backend and dtype."""
    from smcspec.models import hf

    if backend == "hf":
        return hf.load(spec, dtype, device)
    return load_native(spec, dtype, device)


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of a local folder or .gguf file."""
    from transformers import AutoTokenizer

    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def load_native(spec: str, dtype: str, device: str) -> tuple[CausalLM, Any]:
    """The native Llama-family model on a paged KV cache, from a local safetensors folder or a
    .gguf file."""
    from smcspec.models.hf import collect_ids
    from smcspec.models.llama import SUPPORTED, LlamaModel, NativeCausalLM

    if not str(device).startswith("cpu"):
        raise ValueError("the native backend runs on the CPU only for now (use --backend hf)")
    if dtype == "float16":
        raise ValueError("the native backend runs float32, bfloat16 or int8, not float16")
    path = Path(spec).expanduser()
    arch = architecture(spec)
    if arch is None:
        raise ValueError(
            f"the native backend needs a local model folder with config.json or a .gguf: {spec}"
        )
    if arch not in SUPPORTED:
        raise ValueError(
            f"the native backend supports {', '.join(SUPPORTED)}, not {arch!r} (use --backend hf)"
        )
    tokenizer = load_tokenizer(spec)
    if path.suffix == ".gguf":
        model = LlamaModel.from_gguf(path, dtype)
        return NativeCausalLM(model, {tokenizer.eos_token_id}), tokenizer
    config = json.loads((path / "config.json").read_text())
    model = LlamaModel.from_folder(path, dtype)
    gen_path = path / "generation_config.json"
    gen_eos = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.exists() else None
    eos = collect_ids(gen_eos, config.get("eos_token_id"), tokenizer.eos_token_id)
    return NativeCausalLM(model, eos), tokenizer
