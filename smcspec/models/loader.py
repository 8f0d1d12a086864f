"""Pick a backend and a precision for a model spec, and load (model, tokenizer).

Backends: `native` (Llama / Qwen2 / Mistral on the paged KV cache, CPU or CUDA), `hf` (any
`transformers` causal LM), `auto` (native where it applies, hf otherwise).

RoPE scaling decides too. The native engine runs default, linear, llama3, dynamic and yarn
(`models/rope.py`) and refuses any other before the weights load. For a folder, `auto` then
takes hf, whose transformers reads `rope_scaling` itself. transformers' GGUF loader reads no RoPE
scaling for these architectures (neither `rope.scaling.*` nor the `rope_freqs` of Llama 3.1
files), so a .gguf with a scaling the native engine cannot run is refused on every backend:
hf would run it silently wrong. Precisions: float32,
bfloat16, float16 (hf only), int8 (CPU: int8 weights, float activations), int4 (CPU, native
only: int4 weights per group of 32 inputs on smcspec's own kernel, built on first use, which
rounds each product's activations to int8 per group), auto (int8 on a CPU, bfloat16
on CUDA).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from smcspec.config import EngineLimits
    from smcspec.models.base import CausalLM
    from smcspec.models.llama import LlamaModel

BACKENDS = ("auto", "native", "hf")
DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4")


def resolve_device(device: str) -> str:
    """The device to load on: `auto` (CUDA when there is one, else the CPU), `cpu`, `cuda` or
    `cuda:<index>`, checked against this machine before any weights load."""
    import torch

    kind, _, index = str(device).partition(":")
    if kind == "auto" and not index:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:<index>, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {device}: CUDA is not available on this machine (use --device cpu or auto)"
        )
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise ValueError(f"device {device}: this machine has {count} CUDA devices (0-{count - 1})")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    on_cpu = str(device).startswith("cpu")
    if dtype == "auto":
        return "int8" if on_cpu else "bfloat16"
    if dtype in ("int8", "int4") and not on_cpu:
        raise ValueError(f"{dtype} weights run on the CPU only; use bfloat16 on CUDA")
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


def native_refusal(spec: str) -> str | None:
    """Why the native engine cannot run `spec` (architecture, RoPE scaling), or None. Reads the
    config or GGUF metadata only, never the weights."""
    from smcspec.models.llama import SUPPORTED, LlamaConfig

    arch = architecture(spec)
    if arch is None:
        return f"the native backend needs a local model folder with config.json or a .gguf: {spec}"
    if arch not in SUPPORTED:
        return f"the native backend supports {', '.join(SUPPORTED)}, not {arch!r}"
    try:
        LlamaConfig.read(Path(spec).expanduser())
    except ValueError as e:
        return str(e)
    return None


def choose_backend(spec: str, backend: str, device: str, dtype: str) -> str:
    """`auto` takes the native engine for a local Llama-family model (CPU or CUDA) whose RoPE
    scaling it runs, hf otherwise (see the module docstring for a .gguf)."""
    from smcspec.models.llama import SUPPORTED

    check_backend(backend)
    if backend != "auto":
        return backend
    if dtype == "float16" or architecture(spec) not in SUPPORTED:
        return "hf"
    reason = native_refusal(spec)
    if reason is not None and _hf_drops_rope(spec):
        raise ValueError(f"{reason}; {_GGUF_HF_SCALING}")
    return "native" if reason is None else "hf"


def load(
    spec: str, backend: str, dtype: str, device: str, graphs: bool = True, tokenizer: Any = None
) -> tuple[CausalLM, Any]:
    """(model, tokenizer) for an already checked spec and a resolved backend and dtype;
    `graphs`: the native engine replays CUDA graphs of its repeated steps on a GPU; `tokenizer`:
    one already loaded from the same files (the native engine then loads none)."""
    from smcspec.models import hf

    if backend == "hf":
        if _hf_drops_rope(spec):
            raise ValueError(f"{spec} scales RoPE: {_GGUF_HF_SCALING}, or use --backend native")
        return hf.load(spec, dtype, device)
    return load_native(spec, dtype, device, graphs, tokenizer)


def load_two(
    target: str,
    draft: str,
    backend: str,
    dtype: str,
    device: str,
    limits: EngineLimits,
    graphs: bool = True,
) -> tuple[tuple[CausalLM, Any], tuple[CausalLM, Any]]:
    """(model, tokenizer) of the target and of the draft, as `load` gives them; one tokenizer
    serves both when their files are the same. The native engine sizes both KV pools from
    `limits` once both models' weights are in memory (`native.pool_pages`); the hf backend
    has no pool, and refuses a size."""
    shared = same_tokenizer_files(target, draft)
    if backend == "hf":
        if limits.kv_pages is not None or limits.kv_memory is not None:
            raise ValueError(
                "kv_pages and kv_memory size the native engine's KV pool; the hf backend "
                "has none (its caches grow with each request)"
            )
        first = load(target, backend, dtype, device, graphs)
        return first, load(draft, backend, dtype, device, graphs, first[1] if shared else None)
    from smcspec.models import native

    target_model, target_eos, target_tok = read_native(target, dtype, device)
    draft_read = read_native(draft, dtype, device, target_tok if shared else None)
    pair = [(target_model, target_eos), draft_read[:2]]
    target_lm, draft_lm = native.build(pair, limits, graphs)
    return (target_lm, target_tok), (draft_lm, draft_read[2])


_GGUF_HF_SCALING = (
    "transformers' GGUF loader ignores RoPE scaling, so the hf backend would run this file "
    "wrong; convert it to a safetensors folder whose config.json names the scaling"
)


def _hf_drops_rope(spec: str) -> bool:
    """Whether transformers would drop the RoPE scaling of `spec`: a Llama-family .gguf with
    `rope.scaling.*` metadata or a `rope_freqs` tensor."""
    from smcspec.models import gguf_loader
    from smcspec.models.llama import SUPPORTED

    path = Path(spec).expanduser()
    if path.suffix != ".gguf" or architecture(spec) not in SUPPORTED:
        return False
    return gguf_loader.has_rope_scaling(path)


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of a local folder or .gguf file (from its store after the first load:
    `tokenizer_cache`)."""
    path = Path(spec).expanduser()
    from smcspec.models import tokenizer_cache

    return tokenizer_cache.load(path)


def same_tokenizer_files(a: str, b: str) -> bool:
    """Whether two local specs tokenize alike (a draft and a target of one family), so that one
    loaded tokenizer serves both: the same tokenizer files, chat templates aside. The draft's
    tokenizer is read for its vocabulary and EOS id only, never to render a chat, so a template
    that differs (Qwen2.5-Coder's 0.5B and 1.5B escape one brace differently) costs no second
    load."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if not (pa.is_dir() and pb.is_dir()):
        return pa.is_file() and pa.resolve() == pb.resolve()
    return _tokenizer_key(pa) == _tokenizer_key(pb)


def _tokenizer_key(path: Path) -> tuple:
    """A folder's tokenizer files by name and SHA-256, but the chat template: its own files are
    left out, and tokenizer_config.json is compared as its settings without one."""
    from smcspec.models.tokenizer_cache import TOKENIZER_FILES

    key = []
    for f in sorted(path.iterdir()):
        if not f.name.startswith(TOKENIZER_FILES) or f.name.startswith("chat_template"):
            continue
        data = f.read_bytes()
        if f.name == "tokenizer_config.json":
            data = _without_template(data)
        key.append((f.name, hashlib.sha256(data).hexdigest()))
    return tuple(key)


def _without_template(config: bytes) -> bytes:
    """tokenizer_config.json's settings, its chat template dropped, in one canonical form (the
    bytes as they are when they do not parse: they then match only themselves)."""
    try:
        settings = json.loads(config)
    except ValueError:
        return config
    if not isinstance(settings, dict):
        return config
    settings.pop("chat_template", None)
    return json.dumps(settings, sort_keys=True).encode()


def load_native(
    spec: str, dtype: str, device: str, graphs: bool = True, tokenizer: Any = None
) -> tuple[CausalLM, Any]:
    """The native Llama-family model on a paged KV cache of the default size, from a local
    safetensors folder or a .gguf file, on `device` (a resolved one: cpu, cuda or cuda:<i>)."""
    from smcspec.models.native import NativeCausalLM

    model, eos, tokenizer = read_native(spec, dtype, device, tokenizer)
    return NativeCausalLM(model, eos, graphs=graphs), tokenizer


def read_native(
    spec: str, dtype: str, device: str, tokenizer: Any = None
) -> tuple[LlamaModel, set[int], Any]:
    """The native model's weights (no KV pool yet), its EOS ids and its tokenizer."""
    from smcspec.models.hf import collect_ids
    from smcspec.models.llama import LlamaModel

    if dtype == "float16":
        raise ValueError("the native backend runs float32, bfloat16, int8 or int4, not float16")
    path = Path(spec).expanduser()
    reason = native_refusal(spec)
    if reason is not None:
        hint = _GGUF_HF_SCALING if _hf_drops_rope(spec) else "use --backend hf"
        raise ValueError(f"{reason}; {hint}")
    tokenizer = load_tokenizer(spec) if tokenizer is None else tokenizer
    if path.suffix == ".gguf":
        return LlamaModel.from_gguf(path, dtype, device), {tokenizer.eos_token_id}, tokenizer
    config = json.loads((path / "config.json").read_text())
    model = LlamaModel.from_folder(path, dtype, device)
    gen_path = path / "generation_config.json"
    gen_eos = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.exists() else None
    eos = collect_ids(gen_eos, config.get("eos_token_id"), tokenizer.eos_token_id)
    return model, eos, tokenizer
