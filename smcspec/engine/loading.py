"""Where a pair of models comes from: the user's specs (a hub id, a local folder, a .gguf file,
or None for the shipped default) checked before any weights load, then both models loaded on
one backend. `LLM` builds on `load_pair`; the command lines and benchmarks use these functions
instead of reaching into `smcspec.models`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from smcspec.config import EngineLimits
from smcspec.models import cpu_linear, defaults, hf, loader
from smcspec.models.base import CausalLM

BACKENDS = loader.BACKENDS
DTYPES = loader.DTYPES


@dataclass(frozen=True)
class Pair:
    """A loaded target and draft, their shared tokenizer, and how they were loaded."""

    target: CausalLM
    draft: CausalLM
    tokenizer: Any
    backend: str  # native or hf: one engine for both keeps their timings comparable
    dtype: str  # the resolved precision
    names: tuple[str, str]  # what to call the target and the draft in reports


def resolve_specs(
    target: str | None, draft: str | None, cache_dir: str | None = None
) -> tuple[str, str]:
    """Both specs checked first (a bad draft is reported before the default target downloads),
    then None replaced by the shipped default, fetched into `cache_dir` if missing."""
    for role, spec in (("target", target), ("draft", draft)):
        if spec is not None:
            hf.check_spec(spec, role)
    if target is None:
        target = str(defaults.ensure(defaults.DEFAULT_TARGET, cache_dir))
    if draft is None:
        draft = str(defaults.ensure(defaults.DEFAULT_DRAFT, cache_dir))
    return target, draft


def cache_root(cache_dir: str | None = None) -> Path:
    """smcspec's cache folder: `cache_dir`, else $SMCSPEC_CACHE, else ~/.cache/smcspec."""
    return defaults.cache_root(cache_dir)


def gguf_files(
    target: str | None, draft: str | None, cache_dir: str | None = None
) -> tuple[Path, Path]:
    """The .gguf files behind a pair, for engines that read GGUF themselves (llama.cpp): a spec
    that is a .gguf file as given, None as the shipped default's file. Anything else (a folder,
    a hub id) has no GGUF to hand over: ValueError naming it."""
    out = []
    for role, spec, key in (
        ("target", target, defaults.DEFAULT_TARGET),
        ("draft", draft, defaults.DEFAULT_DRAFT),
    ):
        if spec is None:
            out.append(defaults.gguf_path(key, cache_dir))
            continue
        hf.check_spec(spec, role)
        path = Path(spec).expanduser()
        if path.suffix != ".gguf" or not path.is_file():
            raise ValueError(
                f"{role}: llama.cpp reads .gguf files; give --{role} a .gguf file "
                f"(or leave it unset for the shipped default), got {spec}"
            )
        out.append(path)
    return out[0], out[1]


def load_pair(
    target: str | None,
    draft: str | None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    cache_dir: str | None = None,
    backend: str = "auto",
    enforce_eager: bool = False,
    limits: EngineLimits | None = None,
) -> Pair:
    """Check every setting, resolve the specs, and load both models on one backend, the native
    engine's KV pools sized by `limits` (None: `EngineLimits()`)."""
    limits = EngineLimits() if limits is None else limits
    device = loader.resolve_device(device)  # before a minute of loading, not after
    loader.check_backend(backend)
    dtype = loader.resolve_dtype(dtype, device)
    if device == "cpu" and dtype in ("int8", "int4"):
        cpu_linear.build_early()  # compiled while the default pair downloads and converts
    target, draft = resolve_specs(target, draft, cache_dir)
    chosen = {loader.choose_backend(s, backend, device, dtype) for s in (target, draft)}
    backend = "native" if chosen == {"native"} else "hf"  # native needs both
    graphs = not enforce_eager
    (target_model, target_tok), (draft_model, draft_tok) = loader.load_two(
        target, draft, backend, dtype, device, limits, graphs
    )
    check_same_tokenizer(target_tok, draft_tok)
    names = (display_name(target), display_name(draft))
    return Pair(target_model, draft_model, target_tok, backend, dtype, names)


def load_native(spec: str, dtype: str, device: str = "cpu") -> tuple[CausalLM, Any]:
    """One model on the native engine, eager, with its tokenizer (the fidelity bench)."""
    return loader.load_native(spec, loader.resolve_dtype(dtype, device), device, graphs=False)


def native_refusal(spec: str) -> str | None:
    """Why the native engine cannot run `spec`, or None; reads no weights."""
    return loader.native_refusal(spec)


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of a local folder or .gguf file."""
    return loader.load_tokenizer(spec)


def display_name(spec: str) -> str:
    """A shipped model's name (its package folder is opaque), else the spec itself."""
    for shipped in defaults.SHIPPED.values():
        if Path(spec).name == shipped.name:
            return shipped.description.split(" (")[0]
    return spec


def public_name(spec: str) -> str:
    """The model id to show for a hub id, folder or file: a local path gives its last part
    (a `.gguf` file its stem), so no absolute path reaches clients."""
    path = Path(spec)
    if not (path.is_absolute() or path.exists()):
        return spec
    return path.stem if path.suffix == ".gguf" else path.name


def check_same_tokenizer(target_tok: Any, draft_tok: Any) -> None:
    """Refuse a pair whose tokenizers map text to different ids, saying how they differ. (Their
    chat templates may differ: each request renders with the target's.)"""
    if target_tok is draft_tok:
        return
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        how = vocabulary_difference(target_vocab, draft_vocab)
        raise ValueError(
            f"draft and target tokenizers differ: {how}; SMC and speculative decoding need a "
            "draft that shares the target's tokenizer "
            "(the same family and version, e.g. Qwen2.5-0.5B for a Qwen2.5 target)"
        )


def vocabulary_difference(target: dict[str, int], draft: dict[str, int]) -> str:
    """How two token -> id maps differ, in a few words and up to three examples."""
    only_target = sorted(set(target) - set(draft), key=target.__getitem__)
    only_draft = sorted(set(draft) - set(target), key=draft.__getitem__)
    moved = sorted((t for t in set(target) & set(draft) if target[t] != draft[t]), key=target.get)
    parts = [f"{len(target)} against {len(draft)} tokens"]
    for what, tokens in (
        ("only the target's", only_target),
        ("only the draft's", only_draft),
        ("at other ids", moved),
    ):
        if tokens:
            parts.append(f"{len(tokens)} {what} ({', '.join(map(repr, tokens[:3]))})")
    return ", ".join(parts)
